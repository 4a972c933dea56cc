"""portddp/jax/taps.py alone, one process: how XLA hands values to the host.

`host_call` has two implementations: jax.experimental.buffer_callback (the default where JAX
has it: the callback reads XLA's buffers and writes XLA's results in place, no copies) and
io_callback (older JAX, or PORTDDP_HOST_CALL=io_callback). Both must behave alike: same
values, same scheduling rules, refused under vmap; and a hooked step must give the same
gradients bit for bit through either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portddp.jax import taps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_buffer_callback_is_used_here():
    assert taps._buffer_callback is not None, "jax.experimental.buffer_callback is missing: host_call uses io_callback"


def test_host_call_hands_numpy_operands_and_returns_the_results():
    seen = []

    def callback(a, b):
        seen.append((type(a), a.dtype, a.shape, b.dtype))
        return [np.asarray(a, np.float32) * 2, np.float32(b.sum())]

    out_shapes = [jax.ShapeDtypeStruct((3, 2), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)]
    f = jax.jit(lambda a, b: taps.host_call(callback, out_shapes, a + 1, b))
    doubled, total = f(jnp.arange(6, dtype=jnp.float32).reshape(3, 2), jnp.ones(4, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(doubled), (np.arange(6).reshape(3, 2) + 1) * 2)
    assert float(total) == 4.0
    assert seen == [(np.ndarray, np.dtype(np.float32), (3, 2), jnp.bfloat16)]


def test_host_call_without_outputs_used_still_runs_and_runs_once_per_step_under_scan():
    calls = []

    def callback(x):
        calls.append(float(x))
        return np.float32(0)

    def body(carry, x):
        done = taps.host_call(callback, jax.ShapeDtypeStruct((), jnp.float32), x)
        return carry + done, None

    jax.jit(lambda xs: jax.lax.scan(body, jnp.float32(0), xs)[0])(jnp.arange(3, dtype=jnp.float32))
    assert calls == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("impl", ["buffer_callback", "io_callback"])
def test_a_filling_host_call_writes_its_results_itself(monkeypatch, impl):
    """host_call(..., fills=True): the callback gets one writable array per result and fills it."""
    if impl == "io_callback":
        monkeypatch.setattr(taps, "_buffer_callback", None)
    seen = []

    def callback(outs, a):
        seen.append([(o.shape, o.dtype, o.flags.writeable) for o in outs])
        outs[0][...] = a.T * 3
        outs[1][...] = a.sum()

    out_shapes = [jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)]
    tripled, total = jax.jit(lambda a: taps.host_call(callback, out_shapes, a, fills=True))(
        jnp.arange(6, dtype=jnp.float32).reshape(3, 2))
    np.testing.assert_array_equal(np.asarray(tripled), np.arange(6).reshape(3, 2).T * 3)
    assert float(total) == 15.0
    assert [(shape, writeable) for shape, _, writeable in seen[0]] == [((2, 3), True), ((), True)]


def test_host_call_is_refused_under_vmap():
    f = lambda x: taps.host_call(lambda v: np.float32(0), jax.ShapeDtypeStruct((), jnp.float32), x)  # noqa: E731
    with pytest.raises(ValueError, match="cannot run under jax.vmap"):
        jax.vmap(f)(jnp.ones((2, 3)))


def test_a_callback_error_reaches_the_caller():
    def callback(x):
        raise KeyError("from the host")

    errors: list = []
    f = jax.jit(lambda x: taps.host_call(taps.reporting(callback, errors), jax.ShapeDtypeStruct((), jnp.float32), x))
    with pytest.raises(Exception):  # noqa: B017 (XLA's wrapper type differs by JAX version)
        jax.block_until_ready(f(jnp.ones(2)))
    assert isinstance(errors[0], KeyError)


HOOKED = textwrap.dedent(r"""
    import json
    import numpy as np
    import portddp
    portddp.init(torch_distributed=False, jax_distributed=False)
    import jax, jax.numpy as jnp
    from portddp.jax import DistributedDataParallel, taps

    rng = np.random.default_rng(0)
    params = {"a": {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), "b": jnp.zeros(8, jnp.float32)},
              "c": jnp.asarray(rng.standard_normal((8, 3)), jnp.bfloat16), "t": jnp.float32(0.7)}
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)

    def loss(p, x):
        h = jnp.tanh(x @ p["a"]["w"] + p["a"]["b"])
        return jnp.mean((h @ p["c"].astype(jnp.float32) * p["t"]) ** 2)  # (a 0-d leaf too)

    grad_fn = DistributedDataParallel(params, bucket_cap_mb=256 / 2**20, first_bucket_cap_mb=64 / 2**20
                                      ).value_and_grad(loss)
    value, grads = grad_fn(params, x)
    _, reference = jax.jit(jax.value_and_grad(loss))(params, x)
    print(json.dumps({"direct": taps._buffer_callback is not None,
                      "grads": [np.asarray(g, np.float32).tolist() for g in jax.tree.leaves(grads)],
                      "worst": max(float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32))))
                                   for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))),
                      "equal": all(bool((np.asarray(g) == np.asarray(r)).all())
                                   for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))}))
""")


def _hooked(mode: str) -> dict:
    env = dict(os.environ, PORTDDP_HOST_CALL=mode, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", HOOKED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_hooked_step_gives_the_same_gradients_through_either_implementation():
    direct, fallback = _hooked("buffer"), _hooked("io_callback")
    assert direct["direct"] and not fallback["direct"]
    assert direct["equal"] and fallback["equal"], "world 1: the hooked gradients are jax.grad's"
    assert direct["grads"] == fallback["grads"]
