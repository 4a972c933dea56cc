"""The knobs both DistributedDataParallel frontends share, validated once.

Each frontend keeps its own constructor (PyTorch's takes native DDP's
arguments in native's order; JAX's takes a pytree), and both hand the shared
knobs to `DDPConfig.resolve`, so a bad value gets the same error from either
and every rank compares the same dict before the first collective.
"""

from __future__ import annotations

import dataclasses

from portddp.autotune import CANDIDATES_MB, CapTuner
from portddp.buckets import cap_bytes

__all__ = ["DEFAULT_CAP_MB", "DEFAULT_FIRST_CAP_MB", "DDPConfig"]

DEFAULT_CAP_MB = 25.0
"""Native DDP's bucket cap (MiB)."""
DEFAULT_FIRST_CAP_MB = 1.0
"""Native DDP's first bucket (the last layers' gradients): small, so communication starts early."""


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """portddp's DDP knobs, resolved (no None, no "auto" left)."""

    bucket_cap_mb: float
    """Cap of every bucket but the first, in MiB (math.inf: one bucket). With `autotune`, the
    first cap the tuner tries; the DDP object's own `bucket_cap_mb` follows the tuner."""
    first_bucket_cap_mb: float
    """Cap of the first bucket, in MiB."""
    autotune: bool
    """bucket_cap_mb="auto": time a few caps during the first iterations and keep the fastest."""
    transport: str
    """Who carries the gradients: "c10d" or "mpi" (torch); "mpi" or XLA (jax, by strategy)."""
    overlap: bool
    """False launches every bucket only after backward has finished (the no-overlap baseline)."""
    check_finite: bool
    """Check every local gradient for NaN/Inf as it arrives; any rank finding one stops all."""

    @classmethod
    def resolve(cls, bucket_cap_mb: float | str | None, first_bucket_cap_mb: float | None, *, transport: str,
                transports: tuple[str, ...], overlap: bool = True, check_finite: bool = False) -> "DDPConfig":
        """Validate and resolve, native's way: `bucket_cap_mb=None` is 25 MiB after a 1 MiB first
        bucket; a cap given without `first_bucket_cap_mb` applies to the first bucket too."""
        if transport not in transports:
            raise ValueError(f"unknown transport {transport!r}: choose one of {transports}")
        autotune = isinstance(bucket_cap_mb, str) and bucket_cap_mb == "auto"
        if autotune:
            bucket_cap_mb = CANDIDATES_MB[0]  # what CapTuner tries first
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = DEFAULT_FIRST_CAP_MB if bucket_cap_mb is None or autotune else bucket_cap_mb
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_CAP_MB
        cap_bytes(bucket_cap_mb, "bucket_cap_mb")
        cap_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
        return cls(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb, autotune=autotune,
                   transport=transport, overlap=bool(overlap), check_finite=bool(check_finite))

    def tuner(self) -> CapTuner | None:
        """A fresh CapTuner when bucket_cap_mb="auto" (its state is the DDP object's), else None."""
        return CapTuner() if self.autotune else None

    def exchanged(self, transport: str | None = None) -> dict:
        """What every rank must agree on (compared by portddp.protocol.check_same_config)."""
        return {"bucket_cap_mb": "auto" if self.autotune else self.bucket_cap_mb,
                "first_bucket_cap_mb": self.first_bucket_cap_mb, "transport": transport or self.transport,
                "check_finite": self.check_finite}
