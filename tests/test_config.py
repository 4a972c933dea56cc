"""portddp/config.py alone: DDPConfig.resolve's rules (native DDP's for None and a given cap,
"auto" for the tuner), the errors a bad knob gets from either frontend, and what ranks exchange."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from portddp.autotune import CANDIDATES_MB, CapTuner
from portddp.config import DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB, DDPConfig
from portddp.protocol import check_same_config

TORCH = ("c10d", "mpi")


def resolve(bucket_cap_mb=None, first_bucket_cap_mb=None, **kw):
    return DDPConfig.resolve(bucket_cap_mb, first_bucket_cap_mb, **{"transport": "c10d", "transports": TORCH} | kw)


def test_native_defaults():
    assert (DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB) == (25.0, 1.0)  # torch.distributed's
    c = resolve()
    assert (c.bucket_cap_mb, c.first_bucket_cap_mb, c.autotune) == (25.0, 1.0, False)
    assert (c.transport, c.overlap, c.check_finite) == ("c10d", True, False)


@pytest.mark.parametrize("cap, first, want", [
    (None, None, (25.0, 1.0)),
    (10, None, (10, 10)),  # native: a cap given alone applies to the first bucket too
    (10, 2, (10, 2)),
    (None, 4, (25.0, 4)),
    (0.5, None, (0.5, 0.5)),
    (math.inf, None, (math.inf, math.inf)),  # one bucket
    (math.inf, 1.0, (math.inf, 1.0)),
])
def test_caps_resolve_as_native(cap, first, want):
    c = resolve(cap, first)
    assert (c.bucket_cap_mb, c.first_bucket_cap_mb) == want
    assert not c.autotune


def test_auto_starts_from_the_tuners_first_cap():
    c = resolve("auto")
    assert c.autotune
    assert c.bucket_cap_mb == CANDIDATES_MB[0]
    assert c.first_bucket_cap_mb == DEFAULT_FIRST_CAP_MB  # not the tuned cap: the tuner only moves the others
    assert resolve("auto", 3.0).first_bucket_cap_mb == 3.0


def test_tuner_only_with_auto():
    assert resolve(10).tuner() is None
    c = resolve("auto")
    t1, t2 = c.tuner(), c.tuner()
    assert isinstance(t1, CapTuner) and t1 is not t2  # each DDP object gets its own state
    assert t1.first == c.bucket_cap_mb  # the plan built at construction is the tuner's first trial


@pytest.mark.parametrize("cap", [-0.5, -1, float("nan"), "big", "Auto", True, [25]])
def test_bad_bucket_cap_is_refused_naming_it_and_auto(cap):
    with pytest.raises(ValueError) as e:
        resolve(cap)
    msg = str(e.value)
    assert msg.startswith(f"bucket_cap_mb={cap!r} is not a valid bucket size")
    assert "math.inf for a single bucket, or 'auto' to time a few caps" in msg


@pytest.mark.parametrize("first", [-1, -2.5, "auto", False])
def test_bad_first_cap_is_refused_naming_it(first):
    with pytest.raises(ValueError) as e:
        resolve(25, first)
    msg = str(e.value)
    assert msg.startswith(f"first_bucket_cap_mb={first!r} is not a valid bucket size")
    assert "or 'auto' to time" not in msg  # only bucket_cap_mb can be tuned


def test_bad_first_cap_is_refused_even_when_the_cap_is_auto():
    with pytest.raises(ValueError, match="first_bucket_cap_mb=-1 "):
        resolve("auto", -1)


def test_unknown_transport_lists_the_choices():
    with pytest.raises(ValueError, match=re.escape("unknown transport 'nccl': choose one of ('c10d', 'mpi')")):
        resolve(transport="nccl")


def test_flags_are_booleans():
    c = resolve(overlap=0, check_finite=1)
    assert c.overlap is False and c.check_finite is True


def test_frozen():
    c = resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bucket_cap_mb = 5.0
    assert dataclasses.replace(c, overlap=False).overlap is False and c.overlap is True


def test_exchanged_is_what_ranks_must_agree_on():
    assert resolve(10, 2, transport="mpi", check_finite=True).exchanged() == {
        "bucket_cap_mb": 10, "first_bucket_cap_mb": 2, "transport": "mpi", "check_finite": True}
    # overlap only changes when buckets launch, not which collectives run: ranks may differ
    assert resolve(overlap=False).exchanged() == resolve(overlap=True).exchanged()


def test_exchanged_says_auto_not_the_first_trial():
    # a rank with "auto" and one with a fixed cap equal to the tuner's first would otherwise look alike
    auto, fixed = resolve("auto"), resolve(CANDIDATES_MB[0], DEFAULT_FIRST_CAP_MB)
    assert auto.exchanged()["bucket_cap_mb"] == "auto"
    with pytest.raises(ValueError, match=r"bucket_cap_mb is 'auto' on rank 0 but 1\.0 on rank 1"):
        check_same_config([auto.exchanged(), fixed.exchanged()])


def test_exchanged_transport_override():
    # JAX exchanges what carries the gradients for its strategy, not the constructor's transport
    c = DDPConfig.resolve(None, None, transport="mpi", transports=("mpi",))
    assert c.exchanged(transport="xla (strategy='compiled')")["transport"] == "xla (strategy='compiled')"
    assert c.exchanged()["transport"] == "mpi"
