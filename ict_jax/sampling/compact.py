"""Finished rows stop costing: the decode loop driven stretch by stretch from the host, the rows
that have finished dropped from the batch it computes and reads between stretches (issue 41).

`decode._decode_rows` keeps every row of a decode batch to the end: a row that emitted its EOS
token at step 30 still reads its KV cache and computes its logits at every step until the longest
row of the batch ends. Here the length-bounded phases of `plan.decode_phases(max_len)`, each cut
into up to 4 stretches (`plan.decode_stretches`: 64 steps each at 2,048 columns), are run one
program call a stretch, and between two of them the host reads (one small transfer) how many rows
each row shard still decodes. The rows are sharded in blocks over ("data", "fsdp"); when the shards
can keep fewer rows than the batch holds (`balance.plan`), every shard sorts its live rows to the
front, longest prompt first, sends a few of them to its neighbouring shards so that the live counts
even out (`balance`: up to 8 rows each way an edge, two `ppermute`s, only when that lowers the
rows kept) and keeps `plan.compacted_rows(the most live rows a shard now holds, rows a shard,
units)` rows: the KV cache, the last tokens, the done flags, the row ids (the draws' keys) and the
prompts' keys/values are gathered (or sent) along (`_compact_shard`, under `shard_map`). The
outputs [B, max_len] keep their rows a shard, computed rows first: a row that moves takes its
output row with it and a finished output row comes back; `order` names each output row's row, and
`_close` puts them back in the rows' order once at the end.

The prompt cache: until the first compaction the R rows of a prompt read its one prefilled copy
(`decode.prefill`); the first compaction gathers a copy per kept row (the rows of a prompt no longer
sit together), so from then on a step reads each live row's prompt slots. A prompt none of whose
rows still decodes is read as all padding (`decode._phase`), which the fused kernel skips.

Tokens, masks and log-probs are those of `decode._decode_rows` (rows are computed independently
and row r draws with its own key, `decode._emit`).

Programs. A decode of max_len columns compiles, for each shape of prompts: `_open` (prefill and
the first stretch) once; `_phase` per (phase bound, computed rows), the stretch's last step a
traced argument: at most len(phases) x units (`plan.compacted_rows` keeps a multiple of 1/units
of a shard's rows; 8 by default, `generate`'s compaction_units); `_compact` per (rows in, rows
out, prompts shared or not, rows moved or not): at most units - 1 a decode (the kept rows only
fall, by whole units); `_close` once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ict_jax.models.axes import constrain, logical_to_spec
from ict_jax.models.qwen2 import CACHE_AXES, LayerCache
from ict_jax.sampling import balance, decode
from ict_jax.sampling.decode import Decoding, Flags
from ict_jax.sampling.plan import decode_phases, decode_stretches

Array = jax.Array


def _live(c: Decoding, shards: int) -> Array:
  """[1 + S] int32, replicated: (the next completion token, the rows still decoding on each of the
  S row shards)."""
  live = jnp.sum((~c.done).reshape(shards, -1), axis=1).astype(jnp.int32)
  return constrain(jnp.concatenate([c.i[None], live]), (None,))


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


class _Rows(NamedTuple):
  """A shard's per-row decode state (`Decoding`'s), the prompt a copy a row."""

  cache: LayerCache  # [L, b, K, N, H]
  tok: Array  # [b]
  done: Array  # [b]
  num_prompt: Array  # [b]
  row_ids: Array  # [b]
  prompt_cache: LayerCache  # [L, b, K, P, H]
  prompt_mask: Array  # [b, P]


_CACHES = ("cache", "prompt_cache")  # the _Rows fields whose rows are axis 1


def _set_rows(x: Array, pos: Array, v: Array, axis: int) -> Array:
  """x with its rows pos [k] along `axis` set to v's [k] (a position past the end: dropped)."""
  index = (slice(None),) * axis + (pos,)
  return x.at[index].set(v, mode="drop")


def _compact_shard(
    c: Decoding, counts: Array, shard, prompt0, *, shards: int, keep: int, cap: int, per_prompt: int, axes
) -> Decoding:
  """One row shard's compaction (`_compact`), on its own rows: c's arrays are the shard's (here
  computed rows, `total` out rows, the prompts it holds from global prompt prompt0 on, each read by
  per_prompt consecutive rows), counts [4, S] the rows each shard sends right and left and takes in
  from the left and right (`balance.Compaction.counts`), axes the mesh axes the rows are sharded
  over. The rows are sorted live first, longest prompt
  first; the last live ones go to the neighbours (`balance.rows_after`), each with its out row,
  and a finished out row comes back for each live row taken in."""
  here, total = c.tok.shape[0], c.order.shape[0]
  key = jnp.where(c.done, jnp.iinfo(jnp.int32).max, -c.num_prompt)  # live first, longest prompt first
  srt = jnp.argsort(key, stable=True).astype(jnp.int32)  # [here]
  n = jnp.sum(~c.done).astype(jnp.int32)
  send_r, send_l, from_l, from_r = counts[:, shard]
  stay = n - send_r - send_l  # own live rows kept
  came = from_l + from_r
  full = jnp.concatenate([srt, jnp.arange(here, total, dtype=jnp.int32)])  # [total] out rows, the same order
  clip = lambda x, hi: jnp.clip(x, 0, hi - 1)
  own = lambda x: jnp.where(x < stay, x, x - came + send_r + send_l)  # slot x's own row: past the rows taken in
  prompt_of = lambda j: (shard * here + j) // per_prompt - prompt0  # a row's prompt, as held here

  def rows(idx: Array) -> _Rows:  # the shard's rows idx [k]
    take = lambda tree, j, axis: jax.tree.map(lambda x: jnp.take(x, j, axis=axis), tree)
    p = prompt_of(idx)
    return _Rows(take(c.cache, idx, 1), c.tok[idx], c.done[idx], c.num_prompt[idx], c.row_ids[idx],
                 take(c.prompt_cache, p, 1), c.prompt_mask[p])  # fmt: skip

  records = lambda idx: ({k: v[idx] for k, v in c.out.items()}, c.order[idx])  # out rows idx [k]

  p = jnp.arange(keep, dtype=jnp.int32)
  new = rows(srt[clip(own(p), here)])
  q = jnp.arange(total, dtype=jnp.int32)
  out, order = records(full[clip(own(q), total)])
  if cap:
    k = jnp.arange(cap, dtype=jnp.int32)
    to_r = n - send_r + k  # the last live rows, or finished out rows for the live rows taken in
    to_l = stay + k
    msg_r = (rows(srt[clip(to_r, here)]), records(full[clip(jnp.where(k < send_r, to_r, total - from_r + k), total)]))
    msg_l = (rows(srt[clip(to_l, here)]),
             records(full[clip(jnp.where(k < send_l, to_l, total - from_r - from_l + k), total)]))  # fmt: skip
    send = lambda m, pairs: jax.tree.map(lambda x: jax.lax.ppermute(x, axes, pairs), m)
    got_l = send(msg_r, [(j, j + 1) for j in range(shards - 1)])  # from the left neighbour
    got_r = send(msg_l, [(j + 1, j) for j in range(shards - 1)])
    for (got_rows, _), n_in, at in ((got_l, from_l, stay), (got_r, from_r, stay + from_l)):
      pos = jnp.where(k < n_in, at + k, keep)  # the live rows taken in, after the shard's own
      put = lambda axis, pos=pos: lambda x, v: _set_rows(x, pos, v, axis)
      new = _Rows(*(jax.tree.map(put(1 if f in _CACHES else 0), a, b) for f, a, b in zip(_Rows._fields, new, got_rows)))
    for (_, (rec, ordr)), n_live, at_live, n_fin, at_fin in (
        (got_l, from_l, stay, send_l, total - send_r - send_l),
        (got_r, from_r, stay + from_l, send_r, total - send_r),
    ):
      pos = jnp.where(k < n_live, at_live + k, jnp.where(k < n_fin, at_fin + k, total))
      out = {name: _set_rows(v, pos, rec[name], 0) for name, v in out.items()}
      order = _set_rows(order, pos, ordr, 0)
  done = new.done | (p >= stay + came)  # past the live rows: finished rows, or a repeat marked finished
  return c._replace(**new._replace(done=done)._asdict(), out=out, order=order)


@functools.partial(jax.jit, static_argnames=("shards", "keep", "cap"))
def _compact(c: Decoding, counts: Array, *, shards: int, keep: int, cap: int = 0) -> Decoding:
  """Each row shard keeps `keep` computed rows: its rows still decoding first, the longest prompts
  first (ties in their order, so a prompt's rows stay together), then finished ones; the cache,
  tokens, flags, row ids and prompts' keys/values gathered (a prompt copy a row), the out rows
  permuted alike. With cap > 0 the live rows counts [4, S] says (`balance.Compaction.counts`) cross
  to the neighbouring shards in buffers of cap rows (two `ppermute`s), so the shards hold even counts;
  with cap 0 no row leaves its device. Sorted by prompt length, a row block of the fused decode
  kernel holds prompts of like length and skips more of their left padding (`decode_kernel`)."""
  per_prompt = c.tok.shape[0] // c.prompt_mask.shape[0]
  kw = dict(shards=shards, keep=keep, cap=cap, per_prompt=per_prompt)
  mesh = jax.sharding.get_abstract_mesh()
  if shards == 1 or mesh.empty:
    return _compact_shard(c, counts, 0, 0, axes=None, **kw)
  shape = dict(mesh.shape)
  spec = lambda names, x: logical_to_spec(names, x.shape, shape)
  caches = lambda tree: jax.tree.map(lambda x: spec(CACHE_AXES, x), tree)
  row = lambda x: spec(("act_batch",) + (None,) * (x.ndim - 1), x)
  specs = Decoding(
      P(), caches(c.cache), row(c.tok), row(c.done), row(c.num_prompt), row(c.row_ids), caches(c.prompt_cache),
      row(c.prompt_mask), {k: row(v) for k, v in c.out.items()}, row(c.order),
  )  # fmt: skip
  axes, prompt_axes = specs.tok[0], specs.prompt_mask[0]
  out_specs = specs._replace(prompt_cache=caches(c.cache), prompt_mask=P(axes, None))  # a prompt copy a row

  def local(c: Decoding, counts: Array) -> Decoding:
    prompt0 = 0 if prompt_axes is None else jax.lax.axis_index(prompt_axes) * c.prompt_mask.shape[0]
    return _compact_shard(c, counts, jax.lax.axis_index(axes), prompt0, axes=axes, **kw)

  return jax.shard_map(local, in_specs=(specs, P()), out_specs=out_specs, check_vma=False)(c, counts)


@functools.partial(jax.jit, static_argnames=("names",))
def _close(c: Decoding, *, names: tuple) -> tuple:
  """The outputs in the rows' order: out row p holds the sub-batch's row order[p] (rows that
  crossed shards included: a gather over the mesh of the [B, N] outputs)."""
  back = jnp.argsort(c.order).astype(jnp.int32)
  rows = lambda x: constrain(jnp.take(x, back, axis=0), ("act_batch",) + (None,) * (x.ndim - 1))
  return tuple(rows(c.out[k]) for k in names)


def decode_compacted(
    state,
    ids,
    mask,
    row_ids,
    rng,
    scalars,
    *,
    graphdef,
    flags: Flags,
    samples: int,
    n_new: int,
    units: int | None = None,
):
  """`decode._decode_rows`'s outputs (ids, mask[, logprobs][, logits]) for one decode batch (placed
  as `host._place` does), the finished rows dropped between stretches. flags.shards: the row
  shards (("data", "fsdp") of the mesh); n_new: the tokens wanted (the loop's num_new). Blocks at
  each stretch's end (one [1 + S] int32 transfer: `_live`); call under the mesh (`jax.set_mesh`)."""
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
  cap = balance.move_cap(flags.shards, total)
  for stop, bound in rest:
    i, *live_rows = (int(v) for v in np.asarray(live.addressable_data(0)))
    if i >= n_new or max(live_rows) == 0:
      break
    step = balance.plan(np.asarray(live_rows), total, cap, units)
    if step.keep < c.tok.shape[0] // flags.shards:
      c = _compact(c, jnp.asarray(step.counts), shards=flags.shards, keep=step.keep, cap=step.sent)
    c, live = _phase(state, c, rng, scalars, stop_at(stop), graphdef=graphdef, flags=flags, bound=bound)
  names = decode.output_names(flags.return_logprobs, flags.return_logits)
  return _close(c, names=names)
