"""A fused decode-attention kernel (Pallas TPU) over a joint, lane-dense KV cache.

The decode step's attention reads each cache slot once and does almost no arithmetic, so its cost
is bytes. Written in XLA (`Attention`'s "xla" decode path) the scores and softmax weights
[B, K, G, 1, S] pass through HBM between the fusions, and for 64-value heads (Qwen2.5 0.5B) the
compiler lays the cache out slots-minor, so the one-slot write of every step rewrites a tile per
row and head. Here the cache is one array `JointCache.kv` [L, B, K, S, 2H]: slot s of a row and KV
head holds its key in lanes [0, H) and its value in lanes [H, 2H) (128 lanes for H = 64: one
lane-dense tile row a slot, written whole), and one kernel call a layer does the step's whole
softmax on-chip (flash decoding), block by block:

  1. the new token (its own key and value: always visible) starts the running max, sum and
     value sum;
  2. the prompt block [P, 2H] shared by the R samples of a prompt, read once for its R rows;
  3. the rows' own first s cache slots (the decode phase's bound);

a grid step taking every KV head of a block of rows (whole prompts, the block within
BLOCK_BYTES: `blocks`), as a TPU grid step costs a fixed ~0.35 us: the grid is (row blocks,
prompt blocks + cache blocks), 12 to 68 steps a layer on a v5e chip at Qwen2.5 0.5B's shapes.

  scores = q_pad @ kv_blk^T   q_pad [G, 2H]: the query in the key lanes, zeros in the value lanes
  acc    = p @ kv_blk         [G, 2H]: lanes [H, 2H) hold p @ v (lanes [0, H) p @ k, unused)

so neither needs a lane slice; the output is acc / sum, of which the caller keeps lanes [H, 2H).
Heads of 128 values or more (a lane tile's multiple: Qwen2.5 1.5B, 7B) go in unpadded: the scores
take a block's key lanes [0, H) and the kernel writes only lanes [H, 2H) of acc / sum, both slices
on a tile's edge, so the padded query and the whole-width output (~3 MB a layer at 128 rows a chip
of 1.5B, written and read back by XLA) are not made.
Layer `layer` of the stacked caches is read in place (scalar-prefetched into the index maps), so
no layer slice is copied. Biases (0 where a slot may be read, finfo.min where not) come from
`Qwen2.hidden_states`. `interpret=True` runs it in the Pallas interpreter (any backend: the CPU
tests). Under a mesh it runs per shard of rows and KV heads (`shard_map`), as XLA does not
partition a Pallas kernel; a shard's rows find their prompt by global row // R.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ict_jax.models.axes import logical_to_spec

P = jax.sharding.PartitionSpec

Array = jax.Array

SLOT_BLOCKS = (512, 256, 128)  # slots a grid step may read: those dividing the slots (else all of them)
BLOCK_BYTES = 2 << 20  # a grid step's cache block (rows x KV heads x slots x lanes) at most: 2 MiB
LANES = 128  # m and l live lane-replicated in VMEM, as in JAX's TPU flash attention
SUBLANES = 16  # a block's slots: a multiple of this (a bf16 tile's rows) or the whole cache


def _slot_blocks(slots: int) -> list[int]:
  """The slot blocks a grid step may read of `slots`: those of SLOT_BLOCKS dividing it, else all."""
  return [b for b in SLOT_BLOCKS if slots % b == 0] or [slots]


class Blocks(NamedTuple):
  rows: int  # rows a grid step (with all of the shard's KV heads)
  slots: int  # cache slots a grid step
  prompt_slots: int  # prompt-block slots a grid step (0: no prompt block)


def blocks(b: int, group: int, slots: int, prompt_slots: int, slot_bytes: int) -> Blocks:
  """The grid's blocks for b rows of a shard (`group` rows a prompt; prompt_slots 0: no prompt
  block), `slots` cache slots read, a slot of all KV heads `slot_bytes`: a block within
  BLOCK_BYTES (or one row and the smallest slot blocks); two row blocks at least (a megacore's two
  cores); whole prompts a row block or whole parts of one. Of those, the fewest reads of the
  prompts' slots (a prompt split over n row blocks is read n times), then the fewest grid steps:
  a TPU grid step costs ~0.35 us whatever it reads (Pallas TPU docs, "Matrix Multiplication"),
  and a step a prompt and KV head made that a good part of a 0.5B decode layer's time. With a
  prompt copy a row (`group` 1: the rows after a compaction), the smallest prompt blocks: a row
  block skips the leading blocks that are padding for all its rows (`_local`), and a row's copy
  reads ~1/3 of 512 slots at the recipes' prompt lengths, for a few grid steps more."""
  cache_options = _slot_blocks(slots)
  prompt_options = _slot_blocks(prompt_slots) if prompt_slots else [0]  # bp 0: no prompt block
  if group == 1:  # a prompt copy a row: the smallest blocks, as the leading padding ones are skipped
    prompt_options = prompt_options[-1:]
  smallest = (cache_options[-1], prompt_options[-1])
  candidates = []  # (prompt reads, grid steps, -rows), blocks
  for rows in (r for r in range(1, b + 1) if b % r == 0 and (r == 1 or b // r >= 2)):
    if group > 1 and prompt_slots and rows % group and group % rows:
      continue
    prompts, reads = max(1, rows // group), max(1, group // rows) if prompt_slots else 1
    for bs, bp in itertools.product(cache_options, prompt_options):
      fits = rows * bs * slot_bytes <= BLOCK_BYTES and prompts * bp * slot_bytes <= BLOCK_BYTES
      if fits or (rows == 1 and (bs, bp) == smallest):
        steps = b // rows * ((prompt_slots // bp if bp else 0) + slots // bs)
        candidates.append(((reads, steps, -rows), Blocks(rows, bs, bp)))
  return min(candidates, key=lambda c: c[0])[1]


def _kernel(
    scalars_ref,
    q_ref,
    new_ref,
    new_bias_ref,
    *refs,
    group: int,
    prefix_blocks: int,
    scale: float,
    shared: tuple[bool, bool],
    last_at: int,
):
  """Grid step (row block i, slot block j): j < prefix_blocks reads the j-th slots of the block's
  prompts (one [bs, W] block a prompt and KV head, for its `group` rows), then the rows' own cache
  slots. q_ref [R, K, G, W] (zeros in the value lanes) or [R, K, G, H] (H a multiple of 128: the
  key lanes are sliced instead, on a lane tile's edge); new_ref [R, K, 1, W] and new_bias_ref
  [R | 1, 1, 1]: the new token (its key | value, its bias); then (prefix_ref [U, K, bs, W],
  prefix_bias_ref [U, 1, bs]) if a prompt block (row r's prompt: r // group), cache_ref
  [R, K, bs, W], cache_bias_ref [R | 1, 1, bs], out_ref as wide as q_ref (H wide: the value lanes
  only), scratch m, l [R, K, G, LANES] and acc [R, K, G, W] (the running maximum, sum and weighted
  value sum). Rows run in a loop, KV heads unrolled."""
  # scalars_ref [layer, first row, first prompt, (per row block its first prompt block holding a key,)
  # from last_at per row block its last cache block holding a key]: read by the index maps, the
  # blocks' own by the conditions below
  if prefix_blocks:
    prefix_ref, prefix_bias_ref, cache_ref, cache_bias_ref, out_ref, m_ref, l_ref, acc_ref = refs
  else:
    cache_ref, cache_bias_ref, out_ref, m_ref, l_ref, acc_ref = refs
  i, j = pl.program_id(0), pl.program_id(1)
  rows, heads, g, wq = q_ref.shape  # wq: W (q padded by the caller) or H (128-lane heads)
  w = cache_ref.shape[-1]
  keys = (lambda x: x) if wq == w else (lambda x: x[:, :wq])  # a slot's key lanes, as wide as q

  def widen(x, n):  # [G, LANES] lane-replicated -> [G, n]
    return jnp.tile(x, (1, n // LANES)) if n % LANES == 0 else jnp.broadcast_to(x[:, :1], (x.shape[0], n))

  def each_row(body):  # body(r, h) for every row (a loop) and KV head (unrolled)
    def step(r, carry):
      for h in range(heads):
        body(r, h)
      return carry

    jax.lax.fori_loop(0, rows, step, 0)

  @pl.when(j == 0)
  def _start():  # the softmax starts at the new token, which every row sees
    def start(r, h):
      new = new_ref[r, h].astype(jnp.float32)  # [1, W]: key | value
      score = jnp.sum(q_ref[r, h].astype(jnp.float32) * keys(new), axis=1, keepdims=True) * scale  # [G, 1]
      score = score + new_bias_ref[0 if shared[0] else r]
      m_ref[r, h] = jnp.broadcast_to(score, (g, LANES))
      l_ref[r, h] = jnp.ones((g, LANES), jnp.float32)
      acc_ref[r, h] = jnp.broadcast_to(new, (g, w))

    each_row(start)

  def update(r, h, kv, bias):  # kv [bs, W] slots, bias [1, bs]
    s = jax.lax.dot_general(q_ref[r, h], keys(kv), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * scale + bias  # [G, bs]
    m_prev = m_ref[r, h]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - widen(m_next, s.shape[1]))
    alpha = jnp.exp(m_prev - m_next)
    l_ref[r, h] = alpha * l_ref[r, h] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[r, h] = m_next
    acc_ref[r, h] = acc_ref[r, h] * widen(alpha, w) + jnp.dot(
        p.astype(kv.dtype), kv, preferred_element_type=jnp.float32
    )

  if prefix_blocks:

    @pl.when((j < prefix_blocks) & (j >= scalars_ref[3 + i]))  # leading padding blocks: skipped (all
    def _prompt():  # masked: they would add exact zeros); one block of each prompt's slots for its rows
      each_row(lambda r, h: update(r, h, prefix_ref[r // group, h], prefix_bias_ref[r // group]))

  @pl.when((j >= prefix_blocks) & (j - prefix_blocks <= scalars_ref[last_at + i]))  # trailing blocks no row
  def _cache():  # has written (all masked): skipped likewise
    each_row(lambda r, h: update(r, h, cache_ref[r, h], cache_bias_ref[0 if shared[1] else r]))

  @pl.when(j == pl.num_programs(1) - 1)
  def _done():
    def done(r, h):
      out = acc_ref[r, h] / widen(l_ref[r, h], w)  # [G, W]: lanes [H, 2H) hold the attention's output
      out_ref[r, h] = (out if wq == w else out[:, w - wq :]).astype(out_ref.dtype)

    each_row(done)


def _local(q, new, new_bias, *rest, scale: float, group: int, has_prefix: bool, interpret: bool) -> Array:
  """One shard: q [B, K, G, W], new [B, K, 1, W], new_bias [B | 1, 1, 1], (prefix_kv
  [L, U, K, P, W], prefix_bias [U, 1, P],) kv [L, B, K, S, W], bias [B | 1, 1, s], and the
  scalars [layer, first row, first prompt] of this shard -> [B, K, G, W]. `group`: rows a prompt.
  A row block's prompt blocks before the first that holds a key of one of its prompts (left
  padding: every bias finfo.min), and its cache blocks after the last that holds a key of one of
  its rows (slots not written yet), are neither read (their index map repeats the nearest one read,
  so no copy is issued) nor computed; the cost estimate counts them (a bound: `prompt_blocks_read`
  and `cache_blocks_read` count what is read)."""
  if has_prefix:
    prefix_kv, prefix_bias, kv, bias, scalars = rest
  else:
    kv, bias, scalars = rest
  b, k, g, wq = q.shape  # wq: 2H (q padded) or H
  w = kv.shape[-1]
  s = bias.shape[-1]
  shared = (new_bias.shape[0] == 1, bias.shape[0] == 1)  # a bias for every row alike
  p = prefix_kv.shape[3] if has_prefix else 0
  rows, bs, bp = blocks(b, group, s, p, k * w * kv.dtype.itemsize)
  prefix_blocks = p // bp if has_prefix else 0
  nrb = b // rows  # row blocks
  last_at = 3 + (nrb if has_prefix else 0)  # where the row blocks' last keyed cache blocks sit in the scalars
  cache_j = lambda i, j, sc: jnp.clip(j - prefix_blocks, 0, jnp.maximum(sc[last_at + i], 0))
  per_row = lambda i, j, sc: (i, 0, 0, 0)
  in_specs = [
      pl.BlockSpec((rows, k, g, wq), per_row),
      pl.BlockSpec((rows, k, 1, w), per_row),
      pl.BlockSpec((1 if shared[0] else rows, 1, 1), lambda i, j, sc: (0 if shared[0] else i, 0, 0)),
  ]
  operands = [q, new, new_bias]
  read = b * k * s * w * kv.dtype.itemsize + bias.size * 4 * (b // rows if shared[1] else 1)
  if has_prefix:  # a block holds whole prompts (pp of them) or a part of one: row // group, less the shard's first
    u, pp = prefix_kv.shape[1], max(1, rows // group)
    prompt = lambda i, sc: ((sc[1] + i * rows) // group - sc[2]) // pp
    pre_j = lambda i, j, sc: jnp.minimum(jnp.maximum(j, sc[3 + i]), prefix_blocks - 1)
    first = first_key_blocks(prefix_bias.reshape(u, p), bp)  # [U]
    first = jnp.min(first.reshape(-1, pp), axis=1)[prompt(jnp.arange(b // rows), scalars)]  # [row blocks]
    scalars = jnp.concatenate([scalars, first.astype(jnp.int32)])
    in_specs += [
        pl.BlockSpec((None, pp, k, bp, w), lambda i, j, sc: (sc[0], prompt(i, sc), 0, pre_j(i, j, sc), 0)),
        pl.BlockSpec((pp, 1, bp), lambda i, j, sc: (prompt(i, sc), 0, pre_j(i, j, sc))),
    ]
    operands += [prefix_kv, prefix_bias]
    reads_a_prompt = max(1, group // rows)  # a prompt's slots are read once a row block
    read += reads_a_prompt * (u * k * p * w * prefix_kv.dtype.itemsize + prefix_bias.size * 4)
  in_specs += [
      pl.BlockSpec((None, rows, k, bs, w), lambda i, j, sc: (sc[0], i, 0, cache_j(i, j, sc), 0)),
      pl.BlockSpec((1 if shared[1] else rows, 1, bs), lambda i, j, sc: (0 if shared[1] else i, 0, cache_j(i, j, sc))),
  ]
  operands += [kv, bias]
  last = last_key_blocks(bias.reshape(bias.shape[0], s), bs)  # [B | 1]
  last = jnp.broadcast_to(last, (b,)).reshape(nrb, rows).max(axis=1)  # [row blocks]
  scalars = jnp.concatenate([scalars, last.astype(jnp.int32)])
  kernel = functools.partial(
      _kernel, group=group, prefix_blocks=prefix_blocks, scale=scale, shared=shared, last_at=last_at
  )
  slots = s + p
  cost = pl.CostEstimate(  # what the kernel moves: q and the output, the new tokens, the slots read
      flops=4 * b * k * g * slots * w,
      transcendentals=b * k * g * slots,
      bytes_accessed=2 * q.size * q.dtype.itemsize + new.size * new.dtype.itemsize + read,
  )
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b // rows, prefix_blocks + s // bs),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((rows, k, g, wq), per_row),
          scratch_shapes=[
              pltpu.VMEM((rows, k, g, LANES), jnp.float32),
              pltpu.VMEM((rows, k, g, LANES), jnp.float32),
              pltpu.VMEM((rows, k, g, w), jnp.float32),
          ],
      ),
      out_shape=jax.ShapeDtypeStruct((b, k, g, wq), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      cost_estimate=cost,
      interpret=interpret,
      name="ict_decode_attention",
  )(scalars, *operands)


def first_key_blocks(prompt_bias: Array, bp: int) -> Array:
  """prompt_bias [U, P] (0 where a slot holds a key, finfo.min where not) -> [U] int32: each
  prompt's first block of bp slots holding a key (P // bp for a prompt of none: a padding one)."""
  u, p = prompt_bias.shape
  keyed = jnp.any(prompt_bias.reshape(u, p // bp, bp) > 0.5 * jnp.finfo(jnp.float32).min, axis=2)  # [U, P / bp]
  return jnp.where(jnp.any(keyed, axis=1), jnp.argmax(keyed, axis=1), p // bp).astype(jnp.int32)


def last_key_blocks(bias: Array, bs: int) -> Array:
  """bias [N, s] (0 where a cache slot holds a key) -> [N] int32: each row's last block of bs
  slots holding a key (-1 for a row of none)."""
  n, s = bias.shape
  keyed = jnp.any(bias.reshape(n, s // bs, bs) > 0.5 * jnp.finfo(jnp.float32).min, axis=2)  # [N, s / bs]
  return jnp.where(jnp.any(keyed, axis=1), s // bs - 1 - jnp.argmax(keyed[:, ::-1], axis=1), -1).astype(jnp.int32)


def cache_blocks_read(written, slots: int, bs: int):
  """The cache blocks of bs slots (of `slots` read) a row block copies when its rows have written
  `written` slots (an int or an array): those holding a key, at least the first (its index map
  points there)."""
  return np.minimum(slots // bs, np.maximum(1, -(-np.asarray(written) // bs)))


def prompt_blocks_read(prompt_lens, p: int, bp: int):
  """The prompt blocks of bp slots a row block copies for its prompts' lengths [..., prompts]
  (left-padded in p slots; any leading axes: many row blocks at once) -> [...]: from the first
  holding a key of the longest to the last, for each of its prompts (the last block once when none
  holds a key: its index map still points there)."""
  lens = np.asarray(prompt_lens)
  n = p // bp
  longest = lens.max(axis=-1)
  first = np.where(longest > 0, (p - longest) // bp, n)
  return lens.shape[-1] * (n - np.minimum(first, n - 1))


def _shard_start(spec_entry, local: int) -> Array:
  """The global index of a shard's first element along an axis sharded by `spec_entry` (None,
  an axis name or a tuple of them), inside `shard_map`."""
  if spec_entry is None:
    return jnp.int32(0)
  return jax.lax.axis_index(spec_entry).astype(jnp.int32) * local


def decode_attention(
    q: Array, k: Array, v: Array, mask, kv: Array, layer: Array, prefix_kv: Array | None, *, interpret: bool = False
) -> Array:
  """One new token a row over the joint caches, one kernel call: q [B, 1, K, G, H] (rotary
  applied, unscaled), its own key and value k, v [B, 1, K, H]; `mask` the biases of
  `Qwen2.hidden_states` ((prefix [U, 1, 1, 1, 1, P],) old [B | 1, 1, 1, 1, s], new
  [B | 1, 1, 1, 1, 1]); layer `layer` of the decode cache kv [L, B, K, S, 2H] (its first s slots)
  and of the prompt block prefix_kv [L, U, K, P, 2H] (rows [u R, u R + R) read its row u)
  -> [B, 1, K, G, H]. Under a mesh it runs per shard of rows and KV heads (`shard_map`)."""
  b, t, kh, g, h = q.shape
  if t != 1:
    raise ValueError(f"decode_attention 'pallas' takes one new token a row, got {t}; decode_attention 'xla' takes more")
  lanes = h % LANES == 0  # 128-lane heads: q goes in as it is, the kernel slicing the key lanes on a tile's edge
  q_pad = q[:, 0] if lanes else jnp.pad(q[:, 0], [(0, 0), (0, 0), (0, 0), (0, h)])  # [B, K, G, H | 2H]
  new = jnp.concatenate([k, v], axis=-1).transpose(0, 2, 1, 3)  # [B, K, 1, 2H]
  old_bias, new_bias = mask[-2], mask[-1]
  has_prefix = prefix_kv is not None
  args = [q_pad, new, new_bias.reshape(-1, 1, 1)]
  if has_prefix:
    args += [prefix_kv, mask[0].reshape(prefix_kv.shape[1], 1, -1)]
  old_bias = old_bias.reshape(old_bias.shape[0], 1, -1)  # [B | 1, 1, s]
  s = old_bias.shape[-1]
  read = min(kv.shape[3], -(-s // SUBLANES) * SUBLANES)  # a bound off the tiling: a few masked slots more
  if read > s:
    old_bias = jnp.pad(old_bias, [(0, 0), (0, 0), (0, read - s)], constant_values=jnp.finfo(jnp.float32).min)
  args += [kv, old_bias]
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  group = b // prefix_kv.shape[1] if has_prefix else 1
  local = functools.partial(_local, scale=h**-0.5, group=group, has_prefix=has_prefix, interpret=interpret)
  row_axes = prompt_axes = None  # the mesh axes the rows and the prompts are sharded over (none: one shard)

  def run(*xs):  # one shard: its first row and prompt go to the index maps with the layer
    *xs, layer = xs
    row0 = _shard_start(row_axes, xs[0].shape[0])
    prompt0 = _shard_start(prompt_axes, xs[3].shape[1]) if has_prefix else jnp.int32(0)
    return local(*xs, jnp.concatenate([layer, jnp.stack([row0, prompt0])]))

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    shape = dict(mesh.shape)
    spec = lambda names, x: logical_to_spec(names, x.shape, shape)
    rows = spec(("act_batch", "act_kv_heads", None, None), q_pad)
    per_row = lambda x: P(rows[0] if x.shape[0] > 1 else None, None, None)
    stacked = lambda x: spec((None, "act_batch", "act_kv_heads", None, None), x)
    in_specs = [rows, rows, per_row(args[2])]
    if has_prefix:  # the prompts are sharded over as many row axes as divide them (sampling.prompt_sharding)
      prefix_spec = stacked(prefix_kv)
      in_specs += [prefix_spec, P(prefix_spec[1], None, None)]
      prompt_axes = prefix_spec[1]
    in_specs += [stacked(kv), per_row(args[-1]), P(None)]
    row_axes = rows[0]
    run = jax.shard_map(run, in_specs=tuple(in_specs), out_specs=rows, check_vma=False)
  out = run(*args, layer)  # [B, K, G, H], or [B, K, G, 2H] whose value lanes hold it
  return (out if lanes else out[..., h:])[:, None]  # [B, 1, K, G, H]
