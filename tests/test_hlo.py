"""portddp/jax/compiled.py's `hlo_facts` alone: what it reads from optimised HLO text.

The snippets below are XLA:CPU's output for small shard_map / pmap programs (jax 0.10), trimmed
to what the parser looks at, plus an asynchronous schedule (all-reduce-start/done, as XLA emits
where collectives are async) written by hand. One test compiles a real program in a subprocess
(the host-device-count flag must be set before jax starts), started before this process
imports jax so that the two overlap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

LIVE = r"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from portddp.jax.compiled import hlo_facts

mesh = jax.make_mesh((2,), ("data",))
sharded = NamedSharding(mesh, P("data"))
args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharded) for s in ((2, 8), (2, 3))]

def buckets(a, b):  # one psum per bucket, as psum_buckets does
    return jax.lax.psum(a * 2.0, "data"), jax.lax.psum(jnp.tanh(b), "data")

step = jax.jit(jax.shard_map(buckets, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()),
                             check_vma=False))
text = step.lower(*args).compile().as_text()
print(json.dumps(hlo_facts(text) | {"text_has_all_reduce": " all-reduce(" in text}))
"""


@pytest.fixture(scope="module", autouse=True)
def live():
    """The compiled program's facts, computed in a subprocess started before this module's first test."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LIVE)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def hlo_facts(live):  # imported after the subprocess started (importing jax takes a second)
    from portddp.jax.compiled import hlo_facts

    return hlo_facts


# jax.grad + psum under shard_map over a replicated weight: the transpose already psums the
# gradients, the explicit psums add more; XLA merged two of them into one tuple all-reduce.
# Computations before ENTRY (regions, fusions) hold adds and dots that must not be counted.
SHARD_MAP_GRAD = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4,8]{1,0}, f32[8,3]{1,0}, f32[1,4]{1,0})->(f32[4,8]{1,0}, f32[8,3]{1,0})}, num_partitions=2

%region_0.0 (psum_invariant.0: f32[], psum_invariant.1: f32[]) -> f32[] {
  %psum_invariant.0 = f32[] parameter(0), metadata={op_name="transpose(jvp())/psum_invariant"}
  %psum_invariant.1 = f32[] parameter(1), metadata={op_name="transpose(jvp())/psum_invariant"}
  ROOT %add.0 = f32[] add(%psum_invariant.0, %psum_invariant.1), metadata={op_name="transpose(jvp())/add" stack_frame_id=6}
}

%fused_computation.1 (param_0.7: f32[1,8]) -> f32[8] {
  %param_0.7 = f32[1,8]{1,0} parameter(0)
  %bitcast.13 = f32[8]{0} bitcast(%param_0.7), metadata={op_name="jit(step)/shard_map/jvp()/dot_general" stack_frame_id=16}
  ROOT %tanh.5 = f32[8]{0} tanh(%bitcast.13), metadata={op_name="jit(step)/shard_map/jvp()/tanh" stack_frame_id=15}
}

ENTRY %main.0_spmd (param.3: f32[4,8], param.4: f32[8,3], param.5: f32[1,4]) -> (f32[4,8], f32[8,3]) {
  %param.3 = f32[4,8]{1,0} parameter(0), sharding={replicated}, metadata={op_name="w[0]"}
  %param.4 = f32[8,3]{1,0} parameter(1), sharding={replicated}, metadata={op_name="w[1]"}
  %param.5 = f32[1,4]{1,0} parameter(2), sharding={devices=[2,1]<=[2]}, metadata={op_name="x"}
  %broadcast_bitcast_fusion = f32[3,1]{1,0} fusion(), kind=kLoop, calls=%fused_computation.3
  %bitcast_bitcast_fusion = f32[4,1]{1,0} fusion(%param.5), kind=kLoop, calls=%fused_computation.2, metadata={op_name="x"}
  %dot.4 = f32[1,8]{1,0} dot(%broadcast_bitcast_fusion, %param.4), lhs_contracting_dims={0}, rhs_contracting_dims={1}
  %dot.5 = f32[1,8]{1,0} dot(%bitcast_bitcast_fusion, %param.3), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %bitcast_tanh_fusion = f32[8]{0} fusion(%dot.5), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/shard_map/jvp()/tanh" stack_frame_id=15}
  %transpose_copy_fusion = f32[4,8]{1,0} fusion(%bitcast_tanh_fusion, %param.5, %dot.4), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/shard_map/transpose(jvp())/transpose" stack_frame_id=16}
  %wrapped_broadcast = f32[8,3]{1,0} fusion(%bitcast_tanh_fusion), kind=kLoop, calls=%wrapped_broadcast_computation, metadata={op_name="jit(step)/shard_map/transpose(jvp())/transpose" stack_frame_id=15}
  %psum_invariant.28 = f32[4,8]{1,0} all-reduce(%transpose_copy_fusion), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(step)/shard_map/transpose(jvp())/psum_invariant" stack_frame_id=16}
  %all-reduce = (f32[4,8]{1,0}, f32[8,3]{1,0}) all-reduce(%psum_invariant.28, %wrapped_broadcast), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(step)/shard_map/(psum_invariant:transpose(jvp())/psum_invariant)" stack_frame_id=18}
  %get-tuple-element.2 = f32[4,8]{1,0} get-tuple-element(%all-reduce), index=0, metadata={op_name="jit(step)/shard_map/psum_invariant" stack_frame_id=18}
  %get-tuple-element.3 = f32[8,3]{1,0} get-tuple-element(%all-reduce), index=1, metadata={op_name="jit(step)/shard_map/transpose(jvp())/psum_invariant" stack_frame_id=15}
  %psum_invariant.31 = f32[8,3]{1,0} all-reduce(%get-tuple-element.3), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%region_3.0, metadata={op_name="jit(step)/shard_map/psum_invariant" stack_frame_id=18}
  ROOT %tuple.5 = (f32[4,8]{1,0}, f32[8,3]{1,0}) tuple(%get-tuple-element.2, %psum_invariant.31)
}

"""

# jax.pmap of two psums (one per bucket; jax 0.10 lowers pmap through shard_map): XLA:CPU
# combined them into one tuple all-reduce.
PMAP_TWO_BUCKETS = """\
HloModule jit__fun, is_scheduled=true, entry_computation_layout={(f32[1,8]{1,0}, f32[1,3]{1,0})->(f32[1,8]{1,0}, f32[1,3]{1,0})}, allow_spmd_sharding_propagation_to_parameters={false,false}, allow_spmd_sharding_propagation_to_output={false,false}, num_partitions=2

ENTRY %main.0_spmd (param.2: f32[1,8], param.3: f32[1,3]) -> (f32[1,8], f32[1,3]) {
  %param.2 = f32[1,8]{1,0} parameter(0), sharding={devices=[2,1]<=[2]}, metadata={op_name="flat_args[0]"}
  %param.3 = f32[1,3]{1,0} parameter(1), sharding={devices=[2,1]<=[2]}, metadata={op_name="flat_args[1]"}
  %multiply_bitcast_fusion = f32[8]{0} fusion(%param.2), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(_fun)/shard_map/mul" stack_frame_id=8}
  %tanh_bitcast_fusion = f32[3]{0} fusion(%param.3), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(_fun)/shard_map/tanh" stack_frame_id=10}
  %all-reduce = (f32[8]{0}, f32[3]{0}) all-reduce(%multiply_bitcast_fusion, %tanh_bitcast_fusion), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(_fun)/shard_map/psum" stack_frame_id=9}
  %get-tuple-element.2 = f32[8]{0} get-tuple-element(%all-reduce), index=0, metadata={op_name="jit(_fun)/shard_map/psum" stack_frame_id=9}
  %get-tuple-element.3 = f32[3]{0} get-tuple-element(%all-reduce), index=1, metadata={op_name="jit(_fun)/shard_map/psum" stack_frame_id=11}
  %bitcast.1 = f32[1,8]{1,0} bitcast(%get-tuple-element.2), metadata={op_name="jit(_fun)/shard_map/psum" stack_frame_id=9}
  %bitcast.3 = f32[1,3]{1,0} bitcast(%get-tuple-element.3), metadata={op_name="jit(_fun)/shard_map/psum" stack_frame_id=11}
  ROOT %tuple.5 = (f32[1,8]{1,0}, f32[1,3]{1,0}) tuple(%bitcast.1, %bitcast.3)
}

"""

# What the DDP design wants from XLA: each bucket's all-reduce started as soon as its gradient
# exists, the rest of the backward computed while it runs. A while body after ENTRY holds an
# all-reduce of its own, outside the entry computation.
ASYNC_OVERLAPPED = """\
HloModule jit_step, is_scheduled=true

ENTRY %main (x: f32[4,4], w: f32[4,4]) -> (f32[4,4], f32[4,4]) {
  %x = f32[4,4]{1,0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %grad_last = f32[4,4]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_computation
  %all-reduce-start = f32[4,4]{1,0} all-reduce-start(%grad_last), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %grad_first = f32[4,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %conv = f32[4,4]{1,0} convolution(%grad_first, %w), window={size=1}, dim_labels=bf_io->bf
  %all-reduce-start.1 = f32[4,4]{1,0} all-reduce-start(%conv), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %cc = f32[4,4]{1,0} custom-call(%x), custom_call_target="my_kernel"
  %all-reduce-done = f32[4,4]{1,0} all-reduce-done(%all-reduce-start)
  %all-reduce-done.1 = f32[4,4]{1,0} all-reduce-done(%all-reduce-start.1)
  ROOT %out = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%all-reduce-done, %all-reduce-done.1)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %gte = f32[8]{0} get-tuple-element(%p), index=1
  %ar.in.loop = f32[8]{0} all-reduce(%gte), replica_groups={{0,1}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar.in.loop)
}
"""

NO_COLLECTIVES = """\
HloModule jit_local, is_scheduled=true

ENTRY %main.1 (w_0_.1: f32[4,8], x.1: f32[1,4]) -> f32[1,8] {
  %w_0_.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="w[0]"}
  %x.1 = f32[1,4]{1,0} parameter(1), metadata={op_name="x"}
  %dot.5 = f32[1,8]{1,0} dot(%x.1, %w_0_.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %bitcast_tanh_fusion = f32[1,8]{1,0} fusion(%dot.5), kind=kLoop, calls=%fused_computation.1
}
"""


def test_counts_every_all_reduce_of_the_entry_computation(hlo_facts):
    f = hlo_facts(SHARD_MAP_GRAD)
    assert f["instructions"] == 16  # the ENTRY's lines with " = ", parameters and ROOT included
    assert f["all_reduces"] == 3  # the tuple one once; %all-reduce as an operand name is not an op
    assert f["all_reduce_positions"] == pytest.approx([10 / 16, 11 / 16, 14 / 16], abs=1e-3)
    assert f["compute_ops"] == 7  # 5 fusions + 2 dots; the add/dot of other computations ignored
    assert f["compute_ops_after_first_all_reduce"] == 0  # XLA:CPU: everything reduced at the end


def test_buckets_combined_into_one_all_reduce_count_as_one(hlo_facts):
    f = hlo_facts(PMAP_TWO_BUCKETS)
    assert f == {"all_reduces": 1, "instructions": 10, "all_reduce_positions": [0.4], "compute_ops": 2,
                 "compute_ops_after_first_all_reduce": 0}


def test_async_all_reduces_and_the_compute_they_overlap(hlo_facts):
    f = hlo_facts(ASYNC_OVERLAPPED)
    assert f["instructions"] == 11
    assert f["all_reduces"] == 2  # the starts; the dones are the same collectives; the loop's is not in ENTRY
    assert f["all_reduce_positions"] == pytest.approx([3 / 11, 6 / 11], abs=1e-3)
    assert f["compute_ops"] == 4  # fusion, dot, convolution, custom-call
    assert f["compute_ops_after_first_all_reduce"] == 3  # dot, convolution, custom-call ran during it


def test_no_collectives(hlo_facts):
    assert hlo_facts(NO_COLLECTIVES) == {"all_reduces": 0, "instructions": 4, "all_reduce_positions": [],
                                         "compute_ops": 2, "compute_ops_after_first_all_reduce": 0}


def test_positions_are_rounded_fractions_of_the_schedule(hlo_facts):
    body = "\n".join(f"  %a.{k} = f32[] add(%p, %p)" for k in range(2)) + "\n  %r = f32[] all-reduce(%a.1)"
    f = hlo_facts(f"HloModule m\n\nENTRY %main (p: f32[]) -> f32[] {{\n{body}\n}}\n")
    assert f["all_reduce_positions"] == [0.667]


def test_text_without_an_entry_computation_is_refused(hlo_facts):
    with pytest.raises(ValueError):
        hlo_facts("HloModule m\n\n%f (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n}\n")


def test_a_compiled_shard_map_program(live):
    out, err = live.communicate(timeout=120)
    assert live.returncode == 0, err[-3000:]
    facts = json.loads(out.splitlines()[-1])
    assert facts["text_has_all_reduce"]
    assert 1 <= facts["all_reduces"] <= 2  # two psums, maybe combined by XLA
    positions = facts["all_reduce_positions"]
    assert len(positions) == facts["all_reduces"]
    assert positions == sorted(positions) and all(0 < p < 1 for p in positions)
    assert facts["compute_ops"] >= 1  # the multiply and the tanh, fused or not
    assert 0 <= facts["compute_ops_after_first_all_reduce"] <= facts["compute_ops"] < facts["instructions"]
