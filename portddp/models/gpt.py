"""`gpt`: a nanoGPT-style decoder in PyTorch and in Flax NNX.

Token + position embeddings, pre-LayerNorm blocks of causal self-attention and
a GELU MLP, a final LayerNorm, and an LM head tied to the token embedding (so
it is not a parameter of its own). Attention is written out (no fused kernel)
the same way on both sides, so float64 forwards agree to rounding.

GPTConfig.tiny() is for tests; GPTConfig.bench() is ~25M parameters.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)

    @classmethod
    def bench(cls) -> "GPTConfig":
        """About 25M parameters (nanoGPT's shakespeare-char shape, wider)."""
        return cls(vocab_size=96, block_size=128, n_layer=8, n_head=8, n_embd=512)


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.n_head))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = _MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # nanoGPT's initialisation; residual projections scaled down with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # tied LM head


def nnx_gpt(cfg: GPTConfig = GPTConfig()):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    def layer_norm(rngs):
        # Two-pass variance, as PyTorch computes it (Flax's fast variance rounds differently).
        return nnx.LayerNorm(cfg.n_embd, epsilon=1e-5, use_fast_variance=False, rngs=rngs)

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.c_attn = nnx.Linear(cfg.n_embd, 3 * cfg.n_embd, rngs=rngs)
            self.c_proj = nnx.Linear(cfg.n_embd, cfg.n_embd, rngs=rngs)

        def __call__(self, x):
            B, T, C = x.shape
            hs = C // cfg.n_head
            q, k, v = jnp.split(self.c_attn(x), 3, axis=2)
            q, k, v = (t.reshape(B, T, cfg.n_head, hs).transpose(0, 2, 1, 3) for t in (q, k, v))
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
            att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf), axis=-1)
            return self.c_proj((att @ v).transpose(0, 2, 1, 3).reshape(B, T, C))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
            self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)

        def __call__(self, x):
            return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=False))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln_1, self.attn = layer_norm(rngs), Attention(rngs)
            self.ln_2, self.mlp = layer_norm(rngs), MLP(rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class NnxGPT(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
            self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.n_layer)])
            self.ln_f = layer_norm(rngs)

        def __call__(self, idx):
            # Indexing the tables directly: nnx.Embed casts to its own dtype (float32 by default).
            x = self.wte.embedding[...][idx] + self.wpe.embedding[...][: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.embedding[...].T  # tied LM head

    return NnxGPT(nnx.Rngs(0))
