"""The equivalence harness and the mixed-framework job, on tiny configs (the README shows the full matrix)."""

from __future__ import annotations

import json

import pytest

from tests import mpi

CASES = [
    (2, "gpt", "float32", "adamw"),
    (2, "cnn", "float64", "adamw"),
    (3, "mlp", "float64", "sgd"),  # (gpt at n=3: ~40 s on 2 cores; the mixed job runs it at n=3)
]


@pytest.mark.parametrize("n,model,dtype,optimizer", CASES, ids=[f"n{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_every_implementation_trains_the_same(tmp_path, n, model, dtype, optimizer):
    proc = mpi.run(n, "comparisons.equivalence", "--model", model, "--dtype", dtype, "--optimizer", optimizer,
                   "--steps", "3", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / f"{model}-{dtype}-{optimizer}-n{n}"
    result = json.loads((out / "result.json").read_text())
    assert result["ok"] and "EQUIVALENT" in proc.stdout
    expected = {"native-ddp", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled"}
    if model != "cnn":
        expected |= {"torch-ref", "jax-ref"}
    assert set(result["results"]) == expected
    for name, r in result["results"].items():
        assert max(r["deviation"].values()) <= result["bound"], (name, r["deviation"])
        steps = (out / f"{name}.loss.txt").read_text().splitlines()
        assert [int(line.split()[0]) for line in steps] == [0, 1, 2]


@pytest.mark.parametrize("n,model", [(2, "mlp"), (3, "gpt")])
def test_mixed_pytorch_and_jax_ranks_stay_in_lockstep(n, model):
    proc = mpi.run(n, "comparisons.mixed", "--model", model, "--steps", "3", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1 (  jax)" in proc.stdout and "rank 0 (torch)" in proc.stdout
    assert "same bucket plan on every rank: True; parameters across ranks: bitwise equal" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--model", "resnet"], "unknown model 'resnet': choose one of ('mlp', 'cnn', 'gpt')"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--global-batch", "7"], "--global-batch 7 is not divisible by the world size 2: pass a multiple of 2"),
])
def test_equivalence_bad_arguments(args, message):
    proc = mpi.run(2, "comparisons.equivalence", *args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_mixed_job_refuses_models_with_buffers():
    proc = mpi.run(2, "comparisons.mixed", "--model", "cnn", timeout=120)
    assert proc.returncode != 0 and "BatchNorm buffers" in proc.stderr
