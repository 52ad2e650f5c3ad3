"""Per-kernel tables: the HLO cost walk, the table builder and the trace parser."""

import jax
import jax.numpy as jnp
import pytest

from coa_jax.perf import op_profile


def _layers(x_BxD, w_LxDxD):
  """A scanned stack of tanh(x @ w) layers, summed."""
  return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x_BxD, w_LxDxD)[0].sum()


@pytest.fixture(scope="module")
def compiled():
  x, w = jnp.ones((32, 64)), jnp.ones((3, 64, 64))
  return jax.jit(_layers).lower(x, w).compile(), (x, w)


def test_hlo_ops_count_the_scanned_body_once_per_layer(compiled):
  program, _ = compiled
  ops, notes = op_profile.hlo_ops(program.as_text(), peak_flops=1e12, hbm_bytes_per_s=1e11)
  assert not notes
  # three layers of a 32 x 64 @ 64 x 64 matmul; XLA's own count has the body once
  assert sum(o.flops for o in ops) == 3 * 2 * 32 * 64 * 64
  matmuls = [o for o in ops if o.flops]
  assert all(o.count == 3 for o in matmuls)
  assert all(o.seconds == max(o.flops / 1e12, o.bytes / 1e11) > 0 for o in matmuls)


def test_kernel_table_keeps_the_top_ops_and_sums_the_rest():
  ops = [op_profile.OpCost(f"op{i}", seconds=float(i), flops=1.0) for i in range(1, 26)]
  rows = op_profile.kernel_table(ops, top=20)
  assert [r["name"] for r in rows[:3]] == ["op25", "op24", "op23"]
  assert rows[-1]["name"] == "rest (5 ops)" and rows[-1]["seconds"] == 1 + 2 + 3 + 4 + 5
  assert rows[-1]["flops"] == 5 and len(rows) == 21
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)
  assert "| 1 | `op25` |" in op_profile.markdown(rows, measured=True)


def test_the_same_op_of_layers_with_weights_of_their_own_is_one_row():
  src = "while/body/Transformer/layers_{}/mlp/gate_proj/dot_general"
  ops = [op_profile.OpCost(f"dot.{i}", "fusion(dot)", src.format(i), 1, 2.0, 3.0, 0.5, 0)
         for i in (0, 1, 12)] + [op_profile.OpCost("add", "fusion()", "", 1, 0, 1.0, 0.1, 0)]
  (merged, other) = op_profile.group_ops(ops)
  assert (merged.name, merged.source) == ("dot.0 (+2)", src.format("*"))
  assert (merged.flops, merged.bytes, merged.seconds) == (6.0, 9.0, 1.5)
  assert (other.name, other.source) == ("add", "")


def test_kernel_table_of_a_compiled_program_lists_its_ops(compiled):
  program, _ = compiled
  ops, _ = op_profile.hlo_ops(program.as_text(), peak_flops=1e12, hbm_bytes_per_s=1e11)
  rows = op_profile.kernel_table(op_profile.group_ops(ops), top=2)
  assert len(rows) == 3 and rows[-1]["name"].startswith("rest (")
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)
  assert any("dot_general" in r["source"] for r in rows[:2] + [
      dict(source=o.source) for o in ops if o.flops])


def test_trace_parser_reads_a_real_cpu_trace(compiled, tmp_path):
  program, (x, w) = compiled
  step = jax.jit(_layers)
  step(x, w).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      step(x, w).block_until_ready()
  text = program.as_text()
  module = text.split(",")[0].split()[-1]
  measured, plane = op_profile.trace_ops(op_profile.xplane_path(str(tmp_path)), module)
  assert plane == "/host:CPU" and measured
  ops = op_profile.join_hlo(measured, text, steps=2)
  hlo_names = {i.name for insts in op_profile.parse_hlo(text)[0].values() for i in insts}
  assert {o.name for o in ops} <= hlo_names  # every measured op is an op of the program
  # the matmul of each layer ran 3 times a step, its measured time without the loop's
  assert sum(o.flops for o in ops) == 3 * 2 * 32 * 64 * 64
  assert all(o.seconds >= 0 for o in ops) and sum(o.seconds for o in ops) > 0
  rows = op_profile.kernel_table(ops)
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)


def test_tpu_convolutions_count_only_the_positions_that_read_input():
  """XLA:TPU writes a batched matmul (attention's scores) as a convolution over padded,
  dilated spatial dims: its FLOPs are still 2 x B x H x T x S x D."""
  from jax.sharding import SingleDeviceSharding

  from coa_jax.perf import aot

  device = aot.topology_devices("v5e:2x2")[0]
  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                            sharding=SingleDeviceSharding(device))
  scores = jax.jit(lambda q, k: jnp.einsum("bthd,bshd->bhts", q, k))
  text = scores.lower(arg(2, 64, 4, 32), arg(2, 64, 4, 32)).compile().as_text()
  ops, _ = op_profile.hlo_ops(text, peak_flops=1e12, hbm_bytes_per_s=1e11)
  assert sum(o.flops for o in ops) == 2 * 2 * 4 * 64 * 64 * 32


def _switched_layers(x_BxD, w_LxDxD):
  """The layers of `_layers`, each trip switching to its own layer's weights (lax.switch)."""
  layers = w_LxDxD.shape[0]
  branches = [lambda x, i=i: jnp.tanh(x @ w_LxDxD[i]) for i in range(layers)]
  return jax.lax.fori_loop(0, layers, lambda i, x: jax.lax.switch(i, branches, x), x_BxD).sum()


def test_a_conditional_counts_one_branch_a_run():
  x, w = jnp.ones((32, 64)), jnp.ones((3, 64, 64))
  text = jax.jit(_switched_layers).lower(x, w).compile().as_text()
  ops, _ = op_profile.hlo_ops(text, peak_flops=1e12, hbm_bytes_per_s=1e11)
  assert sum(o.flops for o in ops) == pytest.approx(3 * 2 * 32 * 64 * 64)  # not 3 x 3 layers
