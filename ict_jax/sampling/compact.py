"""Finished rows stop costing: the decode loop driven stretch by stretch from the host, the rows
that have finished dropped from the batch it computes and reads between stretches (issue 41).

`decode._decode_rows` keeps every row of a decode batch to the end: a row that emitted its EOS
token at step 30 still reads its KV cache and computes its logits at every step until the longest
row of the batch ends. Here the length-bounded phases of `plan.decode_phases(max_len)`, each cut
into up to 4 stretches (`plan.decode_stretches`: 64 steps each at 2,048 columns), are run one
program call a stretch, and between two of them the host reads (one small transfer) how many rows
each row shard still decodes; when the fullest shard needs fewer rows than the batch holds, every
shard moves its live rows to the front, longest prompt first, and keeps `plan.compacted_rows(most
live, rows a shard)` of them: the KV cache, the last tokens, the done flags, the row ids (the draws' keys)
and the prompts' keys/values are gathered along. Rows never cross devices: the rows are sharded in
blocks over ("data", "fsdp") and each shard gathers within its block (`_take_rows`). The outputs
[B, max_len] stay whole, each shard's block permuted like its rows (the computed rows first), and
are put back in the rows' order once at the end (`_close`).

The prompt cache: until the first compaction the R rows of a prompt read its one prefilled copy
(`decode.prefill`); the first compaction gathers a copy per kept row (the rows of a prompt no longer
sit together), so from then on a step reads each live row's prompt slots. A prompt none of whose
rows still decodes is read as all padding (`decode._phase`), which the fused kernel skips.

Tokens, masks and log-probs are those of `decode._decode_rows` (rows are computed independently
and row r draws with its own key, `decode._emit`).

Programs. A decode of max_len columns compiles, for each shape of prompts: `_open` (prefill and
the first stretch) once; `_phase` per (phase bound, computed rows), the stretch's last step a
traced argument: at most len(phases) x 8 (`plan.compacted_rows` keeps a multiple of 1/8 of a
shard's rows); `_compact` per (rows in, rows out, prompts shared or not): gathers only, at most 7
a decode (the kept rows only fall, by whole eighths); `_close` once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.models.axes import constrain
from ict_jax.models.qwen2 import CACHE_AXES
from ict_jax.sampling import decode
from ict_jax.sampling.decode import Decoding, Flags
from ict_jax.sampling.plan import compacted_rows, decode_phases, decode_stretches

Array = jax.Array


def _live(c: Decoding, shards: int) -> Array:
  """[2] int32, replicated: (the next completion token, the most rows still decoding in a shard)."""
  most = jnp.max(jnp.sum((~c.done).reshape(shards, -1), axis=1))
  return constrain(jnp.stack([c.i, most.astype(jnp.int32)]), (None,))


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "samples", "bound"))
def _open(
    state, prompt_ids, prompt_mask, row_ids, rng, scalars, stop, *, graphdef, flags: Flags, samples: int, bound: int
):
  """Prefill, token 0 and the first stretch (steps <= stop, bound `bound`) of every row ->
  (Decoding, `_live`)."""
  model = nnx.merge(graphdef, state)
  c = decode._start(model, prompt_ids, prompt_mask, row_ids, rng, scalars, flags, samples)
  c = decode._phase(model, c, rng, scalars, flags, bound, stop)
  return c, _live(c, flags.shards)


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "bound"), donate_argnames=("c",))
def _phase(state, c: Decoding, rng, scalars, stop, *, graphdef, flags: Flags, bound: int):
  """One stretch of the decode loop (steps <= stop of the phase of bound `bound`) on the computed
  rows of c -> (Decoding, `_live`). `stop` is traced: a program a (bound, rows)."""
  c = decode._phase(nnx.merge(graphdef, state), c, rng, scalars, flags, bound, stop)
  return c, _live(c, flags.shards)


def _take_rows(x: Array, idx: Array, axis: int, names) -> Array:
  """x with `axis` of S blocks of n rows (one a row shard) -> S blocks of k: block s holds its rows
  idx[s] [k] (indices within the block). A gather batched over the blocks: no row crosses a shard."""
  s = idx.shape[0]
  blocks = x.reshape(*x.shape[:axis], s, x.shape[axis] // s, *x.shape[axis + 1 :])
  take = jax.vmap(lambda a, j: jnp.take(a, j, axis=axis), in_axes=(axis, 0), out_axes=axis)
  y = take(blocks, idx)
  return constrain(y.reshape(*x.shape[:axis], s * idx.shape[1], *x.shape[axis + 1 :]), names)


@functools.partial(jax.jit, static_argnames=("shards", "keep"))
def _compact(c: Decoding, *, shards: int, keep: int) -> Decoding:
  """Each row shard's rows still decoding first, the longest prompts first (ties in their order,
  so a prompt's rows stay together), then its first `keep` computed rows only: the cache, tokens,
  flags, row ids and prompts' keys/values gathered, the outputs' rows permuted alike. Sorted by
  prompt length, a row block of the fused decode kernel holds prompts of like length and skips
  more of their left padding (`decode_kernel`)."""
  b = c.tok.shape[0]
  here = b // shards  # computed rows a shard
  finished = jnp.iinfo(jnp.int32).max  # after every live row
  key = jnp.where(c.done, finished, -c.num_prompt).reshape(shards, here)  # [S, here]
  order = jnp.argsort(key, axis=1, stable=True).astype(jnp.int32)  # live first, longest prompt first
  take = order[:, :keep]  # [S, keep]
  rows = ("act_batch",)
  row = lambda x: _take_rows(x, take, 0, rows + (None,) * (x.ndim - 1))
  cache_rows = lambda tree, idx: jax.tree.map(lambda x: _take_rows(x, idx, 1, CACHE_AXES), tree)
  u = c.prompt_mask.shape[0]
  if u == b:  # a prompt copy a row already
    prompt_cache, prompt_mask = cache_rows(c.prompt_cache, take), row(c.prompt_mask)
  elif u % shards == 0:  # each shard's rows read its own prompts: local prompt = local row // R
    r = b // u
    prompt_cache = cache_rows(c.prompt_cache, take // r)
    prompt_mask = _take_rows(c.prompt_mask, take // r, 0, rows + (None,))
  else:  # fewer prompts than shards: a copy a row first
    r = b // u
    per_row = lambda x: constrain(jnp.repeat(x, r, axis=1), CACHE_AXES)
    prompt_cache = cache_rows(jax.tree.map(per_row, c.prompt_cache), take)
    prompt_mask = row(jnp.repeat(c.prompt_mask, r, axis=0))
  total = c.order.shape[0] // shards  # all rows a shard
  rest = jnp.broadcast_to(jnp.arange(here, total, dtype=jnp.int32), (shards, total - here))
  full = jnp.concatenate([order, rest], axis=1)  # [S, total]: the out rows' new order
  return c._replace(
      cache=cache_rows(c.cache, take),
      tok=row(c.tok),
      done=row(c.done),
      num_prompt=row(c.num_prompt),
      row_ids=row(c.row_ids),
      prompt_cache=prompt_cache,
      prompt_mask=prompt_mask,
      out={k: _row_all(v, full) for k, v in c.out.items()},
      order=_row_all(c.order, full),
  )


def _row_all(x: Array, full: Array) -> Array:
  """x [B, ...] (all rows of the sub-batch) with each shard's rows in the order full [S, B / S]."""
  return _take_rows(x, full, 0, ("act_batch",) + (None,) * (x.ndim - 1))


@functools.partial(jax.jit, static_argnames=("shards", "names"))
def _close(c: Decoding, *, shards: int, names: tuple) -> tuple:
  """The outputs in the rows' order: out row p of shard s holds its row order[p]."""
  back = jnp.argsort(c.order.reshape(shards, -1), axis=1).astype(jnp.int32)
  return tuple(_row_all(c.out[k], back) for k in names)


def decode_compacted(state, ids, mask, row_ids, rng, scalars, *, graphdef, flags: Flags, samples: int, n_new: int):
  """`decode._decode_rows`'s outputs (ids, mask[, logprobs][, logits]) for one decode batch (placed
  as `host._place` does), the finished rows dropped between stretches. flags.shards: the row
  shards (("data", "fsdp") of the mesh); n_new: the tokens wanted (the loop's num_new). Blocks at
  each stretch's end (one [2] int32 transfer); call under the mesh (`jax.set_mesh`)."""
  (stop, bound), *rest = decode_stretches(decode_phases(flags.max_len))
  stop_at = lambda n: jnp.asarray(n, jnp.int32)
  c, live = _open(
      state,
      ids,
      mask,
      row_ids,
      rng,
      scalars,
      stop_at(stop),
      graphdef=graphdef,
      flags=flags,
      samples=samples,
      bound=bound,
  )
  total = c.tok.shape[0] // flags.shards  # rows a shard
  for stop, bound in rest:
    i, most = (int(v) for v in np.asarray(live.addressable_data(0)))
    if i >= n_new or most == 0:
      break
    keep = compacted_rows(most, total)
    if keep < c.tok.shape[0] // flags.shards:
      c = _compact(c, shards=flags.shards, keep=keep)
    c, live = _phase(state, c, rng, scalars, stop_at(stop), graphdef=graphdef, flags=flags, bound=bound)
  names = decode.output_names(flags.return_logprobs, flags.return_logits)
  return _close(c, shards=flags.shards, names=names)
