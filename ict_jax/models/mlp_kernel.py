"""A fused decode MLP (Pallas TPU) for the split rollout layouts ("tensor", "mlp").

Decoding with the MLP split over every chip (`sampling.policy`: the intermediate dimension F over
all of them), each chip runs the gate, up and down projections of every row of the mesh on its
F / chips columns. Written in XLA those are three fusions whose activations pass through HBM: the
gathered rows read twice (gate, up), the gate written and read, the gated product written and read,
and at 1,024 rows of Qwen2.5-1.5B on a v5e-8 that is ~27 MB a layer, more than the 10 MB of MLP
weights a chip holds (`benchmarks/RESULTS.md`). Here one kernel call a layer keeps them on-chip:

  out[rows] = (silu(xs @ gate) * (xs @ up)) @ down,  xs = scale * x[rows]
                                         x [B, D] (RMS-normalised), gate / up [D, F'], down [F', D]

a grid step a block of rows, the three weights whole in VMEM (their index maps constant: copied
once, into one buffer), so a call reads x once and each weight once and writes the partial sums
[B, D] once; the post-attention norm's scale is applied to the rows in the kernel too. The partial
sums of the chips' F' columns are then reduce-scattered to the rows' shards, as XLA does
(`jax.lax.psum_scatter`). The gate and up products are rounded to x's dtype before the gating, as
the XLA path's einsums round them. `fits` says when the kernel applies: the chip's weights within
`WEIGHT_VMEM_BYTES` (Qwen2.5 0.5B and 1.5B on 8 chips: 3.3 and 10.3 MB; not 7B, whose MLP weights
take 51 MB a chip); otherwise `Qwen2`'s XLA path runs. `interpret=True` runs it in the Pallas
interpreter (the CPU tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ict_jax.models.axes import logical_to_spec

P = jax.sharding.PartitionSpec
Array = jax.Array

WEIGHT_VMEM_BYTES = 16 << 20  # a chip's three weights (one buffer: their block never changes) at most this
ROW_BLOCK = 256  # rows a grid step, at most


def fits(d: int, f: int, itemsize: int) -> bool:
  """Whether a chip's share of the gate, up and down weights ([d, f] each, f split over the
  current mesh's "act_split" axes) fits the kernel's VMEM budget."""
  mesh = jax.sharding.get_abstract_mesh()
  chips = 1
  if not mesh.empty:
    shape = dict(mesh.shape)
    for axis in _split_axes(f, shape):
      chips *= shape[axis]
  return 3 * d * (f // chips) * itemsize <= WEIGHT_VMEM_BYTES


def _vmem_limit(rows: int, d: int, f: int, itemsize: int) -> int:
  """The kernel's scoped VMEM: the weights once, the rows' blocks in and out twice (pipelined),
  the step's float32 gate, up and hidden [rows, f], and 4 MiB to spare."""
  return 3 * d * f * itemsize + 4 * rows * d * itemsize + 3 * rows * f * 4 + (4 << 20)


def _row_block(b: int) -> int:
  """The rows a grid step: the largest multiple of 8 dividing b, at most ROW_BLOCK (else all b)."""
  return next((r for r in range(min(b, ROW_BLOCK), 7, -1) if b % r == 0 and r % 8 == 0), b)


def _kernel(layer_ref, x_ref, scale_ref, gate_ref, up_ref, down_ref, out_ref):
  del layer_ref  # read by the index maps
  x = x_ref[...] * scale_ref[...]  # [rows, D]: the norm's scale applied, as `RMSNorm` applies it
  dt = x.dtype
  gate = jnp.dot(x, gate_ref[...], preferred_element_type=jnp.float32).astype(dt)  # [rows, F']
  up = jnp.dot(x, up_ref[...], preferred_element_type=jnp.float32).astype(dt)
  g = gate.astype(jnp.float32)
  hidden = (g / (1.0 + jnp.exp(-g))).astype(dt) * up  # silu(gate) * up, in x's dtype
  out_ref[...] = jnp.dot(hidden, down_ref[...], preferred_element_type=jnp.float32).astype(out_ref.dtype)


def _local(x: Array, scale: Array, gate: Array, up: Array, down: Array, layer: Array, interpret: bool) -> Array:
  """One chip: x [B, D] and layer `layer` [1] of the stacked norm scales [L, 1, D], gate / up
  [L, D, F'] and down [L, F', D] (read in place: the index maps take the layer) -> partial sums
  [B, D] in x's dtype."""
  b, d = x.shape
  f = gate.shape[2]
  rows = _row_block(b)
  once = pl.Buffered(1)  # the same block every step: fetched once, one buffer
  whole = lambda shape: pl.BlockSpec((None, *shape), lambda i, sc: (sc[0], 0, 0), pipeline_mode=once)
  cost = pl.CostEstimate(
      flops=6 * b * d * f,
      transcendentals=b * f,
      bytes_accessed=2 * x.size * x.dtype.itemsize + (3 * f + 1) * d * gate.dtype.itemsize,
  )
  return pl.pallas_call(
      _kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b // rows,),
          in_specs=[
              pl.BlockSpec((rows, d), lambda i, sc: (i, 0)),
              whole((1, d)),
              whole((d, f)),
              whole((d, f)),
              whole((f, d)),
          ],
          out_specs=pl.BlockSpec((rows, d), lambda i, sc: (i, 0)),
      ),
      out_shape=jax.ShapeDtypeStruct((b, d), x.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",), vmem_limit_bytes=_vmem_limit(rows, d, f, x.dtype.itemsize)
      ),
      cost_estimate=cost,
      interpret=interpret,
      name="ict_decode_mlp",
  )(layer, x, scale, gate, up, down)


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _split_axes(f: int, shape: dict) -> tuple[str, ...]:
  """The mesh axes the intermediate dimension (f) is split over: "act_split"'s that divide it."""
  return _axes(logical_to_spec(("act_split",), (f,), shape)[0])


def decode_mlp(
    x: Array,
    scale: Array,
    gate: Array,
    up: Array,
    down: Array,
    layer: Array | None = None,
    *,
    interpret: bool = False,
) -> Array:
  """x [B, T, D] (every row of the mesh, RMS-normalised without its scale), the norm's scale [D],
  gate / up [D, F] and down [F, D], or the layers' stacked [L, D] / [L, D, F] / [L, F, D] with the
  `layer` to run (read in place, as `decode_kernel` reads the cache: a layer's slice handed to a
  kernel would be copied first), F split over the chips as "act_split" says -> [B, T, D], the rows
  sharded as "act_batch" says: MLP(scale * x) of every row, one kernel call a chip, the chips'
  partial sums reduce-scattered to the rows' shards (and summed over the other axes F is split
  over). The scale is applied in the kernel: applied before it, XLA writes the scaled rows of the
  whole mesh to HBM and reads them back. Without a mesh, one call over the whole weights."""
  b, t, d = x.shape
  flat = x.reshape(b * t, d)
  if gate.ndim == 2:
    scale, gate, up, down, layer = scale[None], gate[None], up[None], down[None], 0
  weights = [w.astype(x.dtype) for w in (scale[:, None], gate, up, down)]  # no copy in x's dtype already
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return _local(flat, *weights, layer, interpret).reshape(b, t, d)
  shape = dict(mesh.shape)
  split = _split_axes(gate.shape[2], shape)
  rows = _axes(logical_to_spec(("act_batch",), (b * t,), shape)[0])  # the axes the output rows are
  rows = tuple(a for a in rows if a in split)  # the partial sums are scattered over these, summed over the rest
  rest = tuple(a for a in split if a not in rows)

  def run(xs, sc, g, u, dn, at):
    part = _local(xs, sc, g, u, dn, at, interpret)  # [B T, D]: this chip's F' columns
    if rows:
      part = jax.lax.psum_scatter(part, rows, scatter_dimension=0, tiled=True)
    return jax.lax.psum(part, rest) if rest else part

  cols = P(None, None, split or None)
  run = jax.shard_map(
      run,
      in_specs=(P(None, None), P(None, None, None), cols, cols, P(None, split or None, None), P(None)),
      out_specs=P(rows or None, None),
      check_vma=False,
  )
  return run(flat, *weights, layer).reshape(b, t, d)
