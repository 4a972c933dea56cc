"""portddp.jax.closure: which values a loss function reads from outside its arguments, and when
one was replaced (the step is then traced again: tests/test_jax_dropin.py, captured values)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from portddp.jax.closure import Captured

SCALE = jnp.ones(3)
params = jnp.zeros(3)  # a global that shares its name with an attribute loss functions read
TEMPERATURE = 1.0


def helper(x):
    return x * SCALE


def reads_a_global_through_a_helper(p, batch):
    return jnp.sum(helper(p) * batch) / TEMPERATURE


def reads_an_attribute(p, state):
    return jnp.sum(state.params * p)


def test_a_replaced_global_read_through_a_helper_is_named():
    global SCALE
    watch = Captured(reads_a_global_through_a_helper)
    assert watch.changed() is None  # the first call: what the trace reads
    assert watch.changed() is None
    old, SCALE = SCALE, SCALE + 1
    try:
        assert watch.changed() == "SCALE"
        assert watch.changed() is None  # held from the retrace on
    finally:
        SCALE = old


def test_numbers_compare_by_value_arrays_by_identity():
    global TEMPERATURE
    watch = Captured(reads_a_global_through_a_helper)
    watch.changed()
    old = TEMPERATURE
    try:
        TEMPERATURE = float("1.0")  # an equal number: nothing to trace again
        assert watch.changed() is None
        TEMPERATURE = 0.5
        assert watch.changed() == "TEMPERATURE"
    finally:
        TEMPERATURE = old


def test_an_attribute_is_no_read_of_a_global_of_that_name():
    global params
    watch = Captured(reads_an_attribute)
    watch.changed()
    old, params = params, params + 1
    try:
        assert watch.changed() is None
    finally:
        params = old


def test_closure_cells_and_partial_arguments():
    weights = {"w": jnp.ones(2)}

    def loss(p, batch, mask):
        return jnp.sum(p * weights["w"] * mask) + batch

    watch = Captured(functools.partial(loss, mask=np.ones(2)))
    watch.changed()
    weights = {"w": jnp.zeros(2)}  # noqa: F841 -- read through the closure cell
    assert watch.changed() == "weights"


def test_an_nnx_teacher_updated_in_place():
    from flax import nnx

    teacher = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def loss(model, x):
        return jnp.mean((model(x) - teacher(x)) ** 2)

    watch = Captured(loss)
    watch.changed()
    assert watch.changed() is None
    teacher.kernel[...] = teacher.kernel[...] * 0.5
    assert watch.changed() == "teacher"
