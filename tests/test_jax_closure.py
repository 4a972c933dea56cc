"""portddp.jax.closure: which values a loss function reads from outside its arguments, and when
one was replaced (the step is then traced again: tests/test_jax_dropin.py, captured values)."""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from portddp.jax.closure import Captured


def learnt(fn, *args) -> Captured:
    """A watch of `fn` as after a trace with `args` (its constants) or, without args, of everything."""
    watch = Captured(fn)
    assert watch.changed() is None and not watch.learnt  # nothing to compare before the first trace
    watch.learn(jax.make_jaxpr(fn)(*args).consts if args else None)
    return watch

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
    watch = learnt(reads_a_global_through_a_helper, jnp.ones(3), jnp.ones(3))
    assert watch.changed() is None
    old, SCALE = SCALE, SCALE + 1
    try:
        assert watch.changed() == "SCALE" and not watch.learnt  # learnt again after the trace it calls for
    finally:
        SCALE = old


def test_numbers_compare_by_value_arrays_by_identity():
    global TEMPERATURE
    watch = learnt(reads_a_global_through_a_helper, jnp.ones(3), jnp.ones(3))
    old = TEMPERATURE
    try:
        TEMPERATURE = float("1.0")  # an equal number: nothing to trace again
        assert watch.changed() is None
        TEMPERATURE = 0.5
        assert watch.changed() == "TEMPERATURE"
        TEMPERATURE = float("nan")
        watch.learn(None)
        assert watch.changed() is None  # (NaN is NaN: no trace every call)
    finally:
        TEMPERATURE = old


def test_an_attribute_is_no_read_of_a_global_of_that_name():
    global params
    watch = learnt(reads_an_attribute)
    old, params = params, params + 1
    try:
        assert watch.changed() is None
    finally:
        params = old


def test_closure_cells_and_partial_arguments():
    weights = {"w": jnp.ones(2)}

    def loss(p, batch, mask):
        return jnp.sum(p * weights["w"] * mask) + batch

    watch = learnt(functools.partial(loss, mask=np.ones(2)))
    weights = {"w": jnp.zeros(2)}  # noqa: F841 -- read through the closure cell
    assert watch.changed() == "weights"


def test_an_nnx_teacher_updated_in_place():
    from flax import nnx

    teacher = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def loss(w, x):
        return jnp.mean((x @ w - teacher(x)) ** 2)

    watch = learnt(loss, jnp.ones((2, 2)), jnp.ones((1, 2)))
    assert watch.changed() is None
    teacher.kernel[...] = teacher.kernel[...] * 0.5
    assert watch.changed() == "teacher"


def test_arrays_the_trace_does_not_use_are_not_watched():
    """A global pytree read for something static (a TrainState's apply_fn) whose arrays change every
    step: not constants of the trace, so no retrace at every step."""
    import types

    state = types.SimpleNamespace()  # not a pytree: stands for the loss reading one field of a global
    table = {"used": jnp.ones(2), "unused": jnp.zeros(2)}

    def loss(p, x):
        return jnp.sum(p * x * table["used"])

    watch = learnt(loss, jnp.ones(2), jnp.ones(2))
    table["unused"] = table["unused"] + 1
    assert watch.changed() is None
    table["used"] = table["used"] + 1
    assert watch.changed() == "table"
    del state


def test_a_methods_instance_attributes_it_reads():
    class Trainer:
        def __init__(self):
            self.temperature, self.step = 2.0, 0

        def loss(self, p, x):
            return jnp.sum(p * x) / self.temperature

    trainer = Trainer()
    watch = learnt(trainer.loss, jnp.ones(2), jnp.ones(2))
    trainer.step += 1  # not read by the loss
    assert watch.changed() is None
    trainer.temperature = 4.0
    assert watch.changed() == "self.temperature"


class ScaledLoss:
    """A loss object (a callable class), as some training loops keep one."""

    def __init__(self):
        self.temperature, self.calls = 2.0, 0

    def __call__(self, p, x):
        return jnp.sum(p * x) / self.temperature


HP = type("HP", (), {})()  # a global hyper-parameter holder of the user's (SimpleNamespace alike)
HP.temperature, HP.epoch = 2.0, 0


def reads_a_global_objects_attribute(p, x):
    return jnp.sum(p * x) / HP.temperature


def test_a_loss_objects_attributes_and_a_global_objects_attributes_it_reads():
    """Found by an audit: a callable loss object's attributes, and a global object's (`hp.temperature`),
    went into the program as they were at the first call, silently."""
    loss = ScaledLoss()
    watch = learnt(loss, jnp.ones(2), jnp.ones(2))
    loss.calls += 1  # not read by __call__
    assert watch.changed() is None
    loss.temperature = 4.0
    assert watch.changed() == "self.temperature"

    watch = learnt(reads_a_global_objects_attribute, jnp.ones(2), jnp.ones(2))
    HP.epoch += 1
    assert watch.changed() is None
    HP.temperature = 4.0
    assert watch.changed() == "HP.temperature"


def test_two_instances_of_one_loss_class_are_each_watched():
    """A review: the second instance's bound __call__ (made while looking, then freed) reused the first's id
    and was skipped, and both instances' attributes had one name -- a change of the second went unseen."""
    a, b = ScaledLoss(), ScaledLoss()
    watch = learnt(lambda p, x: a(p, x) + b(p, x), jnp.ones(2), jnp.ones(2))
    assert watch.changed() is None
    b.temperature = 10.0
    assert watch.changed() == "self.temperature #2"


class Frozen(typing.NamedTuple):
    beta: float
    scale: jax.Array


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    beta: float
    epoch: int = 0


class Plain:
    __slots__ = ("beta", "unset")

    def __init__(self, beta):
        self.beta = beta

    def loss(self, p, x):
        return jnp.sum(p * x) * self.beta


NT = Frozen(beta=0.5, scale=jnp.ones(2))
SL = Slotted(beta=0.5)


def reads_a_namedtuple(p, x):
    return jnp.sum(p * x * NT.scale) * NT.beta


def reads_a_slotted_dataclass(p, x):
    return jnp.sum(p * x) * SL.beta


def test_namedtuple_and_slots_hyper_parameters_are_watched():
    """Found by an audit: a number in a NamedTuple (`hp = hp._replace(beta=...)`) or a `__slots__`
    dataclass stayed at the first trace's value, silently (they have no `__dict__`)."""
    global NT, SL
    watch = learnt(reads_a_namedtuple, jnp.ones(2), jnp.ones(2))
    assert watch.changed() is None
    NT = NT._replace(beta=0.25)
    assert watch.changed() == "NT.beta"
    watch.learn(None)
    NT = NT._replace(scale=jnp.ones(2))  # a new array: by identity, as everywhere
    assert watch.changed() == "NT"

    watch = learnt(reads_a_slotted_dataclass, jnp.ones(2), jnp.ones(2))
    SL = dataclasses.replace(SL, epoch=1)  # not read by the loss
    assert watch.changed() is None
    SL = dataclasses.replace(SL, beta=2.0)
    assert watch.changed() == "SL.beta"

    plain = Plain(1.0)  # a method of a __slots__ class; one slot never assigned
    watch = learnt(plain.loss, jnp.ones(2), jnp.ones(2))
    assert watch.changed() is None
    plain.beta = 3.0
    assert watch.changed() == "self.beta"
