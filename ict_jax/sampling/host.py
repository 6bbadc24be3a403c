"""The host entry points: `generate` (validated numpy prompts in, completions out) and
`lower_generate` (the same program compiled for abstract inputs, e.g. absent accelerators)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import numbers
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ict_jax.models.axes import logical_to_spec
from ict_jax.sampling.compact import decode_compacted
from ict_jax.sampling.decode import (
    QWEN_EOS_IDS,
    QWEN_PAD_ID,
    Flags,
    _eos_array,
    _generate_jit,
    join_sub_batches_rows,
)
from ict_jax.sampling.plan import (
    DecodeLayout,
    _check_int,
    bucket_length,
    decode_layout,
    decode_phases,
    resolve_decode_batch_size,
)
from ict_jax.sampling.policy import ROLLOUT_DTYPES, RolloutPolicy, _find_mesh, as_rollout_policy
from ict_jax.sharding import put_global, replicated

Array = jax.Array


def _validate_prompts(prompt_ids, prompt_mask, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  for name, x in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask)):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      raise ValueError(f"generate: {name} spans several hosts; call sample_fn inside your jit")
  ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
  if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
    raise ValueError("generate: prompt_ids must be [batch, prompt_len] with both > 0, " f"got shape {ids.shape}")
  if mask.shape != ids.shape:
    raise ValueError(f"generate: prompt_mask shape {mask.shape} != prompt_ids shape {ids.shape}")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"generate: prompt_ids must be integers, got dtype {ids.dtype}")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("generate: prompt_mask must hold only 0 (padding) and 1 (token)")
  mask = mask.astype(np.int32)
  if (mask.sum(axis=1) == 0).any():
    raise ValueError(
        f"generate: prompt row(s) {np.flatnonzero(mask.sum(axis=1) == 0).tolist()} "
        "have no tokens (prompt_mask all 0)"
    )
  if (np.diff(mask, axis=1) < 0).any():
    raise ValueError("generate: prompts must be left-padded (each prompt_mask row 0...0 1...1)")
  real = ids[mask == 1]
  if real.size and (real.min() < 0 or real.max() >= vocab):
    raise ValueError(f"generate: prompt token ids must be in [0, {vocab}), got " f"[{real.min()}, {real.max()}]")
  return ids.astype(np.int32), mask


class _Job(NamedTuple):
  """A validated `generate` call: the prompts laid out for `_generate_jit` (numpy, not yet placed)."""

  ids: np.ndarray  # [layout.prefill_rows, P bucket]
  mask: np.ndarray
  rng: Array
  scalars: tuple
  static: dict
  mesh: Mesh | None
  layout: DecodeLayout
  n_rows: int
  n_new: int
  compact: bool  # drop the finished rows between stretches (`compact.decode_compacted`)
  units: int = 8  # a compacted batch keeps a multiple of 1/units of a shard's rows (`compacted_rows`)

  def rows(self, j: int) -> np.ndarray:
    """[prompts x R] the row of `generate`'s output each row of sub-batch j is (>= n_rows: batch
    padding): its prompt k is prompt k * n + j of all (`decode.join_sub_batches_rows`)."""
    n, r, per = self.layout.sub_batches, self.layout.samples, self.layout.prompts
    return ((np.arange(per) * n + j)[:, None] * r + np.arange(r)).reshape(-1).astype(np.int32)


def _prepare(
    model,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    rng: Array | None = None,
    eos_token_ids: Sequence[int] | None = None,
    pad_id: int = QWEN_PAD_ID,
    num_samples: int = 1,
    mesh=None,
    return_logits: bool = False,
    buckets: Sequence[int] | None = None,
    decode_batch_size: int | str | None = None,
    return_logprobs: bool = True,
    rollout_dtype: str | None = None,
    compact_rows: bool = True,
    compaction_units: int = 8,
) -> _Job:
  """`generate`'s checks, buckets and layout, without touching a device."""
  if isinstance(model, RolloutPolicy):
    graphdef, state = model
    cfg = nnx.merge(graphdef, state).cfg
  else:
    cfg = model.cfg
    graphdef, state = nnx.split(model)
  ids, mask = _validate_prompts(prompt_ids, prompt_mask, cfg.vocab_size)
  n_new = _check_int("max_new_tokens", max_new_tokens, 1)
  top_k = _check_int("top_k", top_k, 0)
  g = _check_int("num_samples", num_samples, 1)
  if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature!r}")
  if not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
  longest = int(mask.sum(axis=1).max())
  if longest + n_new > cfg.max_position_embeddings:
    raise ValueError(
        f"generate: prompt of {longest} tokens + max_new_tokens {n_new} exceeds the "
        f"model context (max_position_embeddings {cfg.max_position_embeddings})"
    )
  eos = QWEN_EOS_IDS if eos_token_ids is None else tuple(eos_token_ids)
  if not all(isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in eos):
    raise ValueError(f"generate: eos_token_ids must be ints, got {eos_token_ids!r}")
  pad_id = _check_int("pad_id", pad_id, 0)
  greedy = float(temperature) == 0.0
  if rng is None and not greedy:
    raise ValueError("generate: rng (a jax.random key) is required when temperature > 0")
  if rng is None:
    rng = jax.random.key(0)  # unused by greedy decoding
  if rollout_dtype is not None and rollout_dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"generate: rollout_dtype must be one of {ROLLOUT_DTYPES}, got {rollout_dtype!r}")

  mesh = mesh if mesh is not None else _find_mesh(state)
  rows_per_shard = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
  n_rows = ids.shape[0] * g
  p_bucket = bucket_length(ids.shape[1], buckets)
  n_bucket = bucket_length(n_new, buckets)
  sub = resolve_decode_batch_size(
      decode_batch_size,
      n_rows,
      cfg=cfg,
      prompt_len=p_bucket,
      new_len=n_bucket,
      group_size=g,
      mesh=mesh,
      dtype=rollout_dtype or cfg.dtype,
  )
  layout = decode_layout(n_rows, g, sub, rows_per_shard)
  # each prompt prefilled G / R times (once when a sub-batch holds whole groups), decoded by R rows;
  # padding prompts (all-0 mask) emit nothing
  ids, mask = np.repeat(ids, g // layout.samples, axis=0), np.repeat(mask, g // layout.samples, axis=0)
  widths = ((0, layout.prefill_rows - ids.shape[0]), (p_bucket - ids.shape[1], 0))
  ids = np.pad(ids, widths, constant_values=pad_id)
  mask = np.pad(mask, widths)

  static = dict(
      max_len=n_bucket,
      greedy=greedy,
      top_k=min(top_k, cfg.vocab_size),
      use_top_p=bool(top_p < 1.0),
      return_logits=bool(return_logits),
      return_logprobs=bool(return_logprobs),
      sub_batches=layout.sub_batches,
      samples=layout.samples,
  )
  scalars = (
      np.int32(n_new),
      np.float32(1.0 if greedy else temperature),
      np.float32(top_p),
      _eos_array(eos),
      np.int32(pad_id),
  )
  compact = bool(compact_rows) and len(decode_phases(n_bucket)) > 1  # one phase: no boundary to compact at
  units = _check_int("compaction_units", compaction_units, 1)
  return _Job(ids, mask, rng, scalars, static, mesh, layout, n_rows, n_new, compact, units)


def generate(
    model,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    rng: Array | None = None,
    eos_token_ids: Sequence[int] | None = None,
    pad_id: int = QWEN_PAD_ID,
    num_samples: int = 1,
    mesh=None,
    return_logits: bool = False,
    buckets: Sequence[int] | None = None,
    decode_batch_size: int | str | None = None,
    return_logprobs: bool = True,
    rollout_dtype: str | None = None,
    compact_rows: bool = True,
    compaction_units: int = 8,
):
  """Generate completions for left-padded prompts [B, P] with a `Qwen2` model or a
  `RolloutPolicy` (`make_rollout_policy`, used as is).

  Each prompt gets `num_samples` (G) rows: rows g*G .. g*G+G-1 are prompt g. A prompt is prefilled
  once and its keys/values read by its G rows (G / R times for R = gcd(decode_batch_size, G) when
  a sub-batch cannot hold whole groups; `plan.decode_layout`).
  Returns (completion_ids [B*G, max_new_tokens] int32, completion_mask int32 (EOS included),
  logprobs float32 (0 where the mask is 0)), logprobs left out with return_logprobs=False, plus
  the raw logits [B*G, max_new_tokens, V] with return_logits. eos_token_ids None means Qwen's
  (151645, 151643); () disables EOS stopping. rng (a jax PRNG key) is required unless
  temperature == 0 (greedy). With `mesh` (else the one set by `jax.set_mesh`, else the one the
  parameters live on) rows are sharded over ("data", "fsdp"), the batch padded up to a multiple
  of that and cut back, and a model's weights are first copied into the decoding layout
  (`DECODE_RULES`) in `rollout_dtype` (default: the model's compute dtype). decode_batch_size
  (an int dividing B*G, "auto" to size it from free device memory, None for all rows) decodes
  the rows in sub-batches, one KV cache at a time (see `decode._generate_impl`). compact_rows
  drops the rows that have finished from the decode batch at each boundary of the length-bounded
  phases (`compact.py`; the host drives the phases, one program each): the same tokens, masks and
  log-probs as compact_rows=False (one program for the whole decode); the batch keeps a multiple of
  1 / compaction_units of a shard's rows (8: up to 8 decode programs a phase; 16 drops the finished
  rows sooner and may compile twice as many; a unit finer than an eighth holds at least 8 rows).
  Row r draws its token i with fold_in(fold_in(rng, r), i): the same tokens whatever the
  sub-batches."""
  job = _prepare(
      model,
      prompt_ids,
      prompt_mask,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_p=top_p,
      top_k=top_k,
      rng=rng,
      eos_token_ids=eos_token_ids,
      pad_id=pad_id,
      num_samples=num_samples,
      mesh=mesh,
      return_logits=return_logits,
      buckets=buckets,
      decode_batch_size=decode_batch_size,
      return_logprobs=return_logprobs,
      rollout_dtype=rollout_dtype,
      compact_rows=compact_rows,
      compaction_units=compaction_units,
  )
  with _mesh_ctx(job.mesh):
    graphdef, state = as_rollout_policy(model, dtype=rollout_dtype, mesh=job.mesh)  # as is if one already
    if job.compact:
      n = job.layout.sub_batches
      parts = [_decode_compacted(job, graphdef, state, j) for j in range(n)]
      out = parts[0] if n == 1 else _join_jit(tuple(parts), samples=job.layout.samples)
    else:
      rows = np.arange(job.ids.shape[0] * job.layout.samples, dtype=np.int32)
      out = _generate_jit(state, *_place(job, job.ids, job.mask, rows), graphdef=graphdef, **job.static)
  return tuple(x[: job.n_rows, : job.n_new] for x in out)


def _decode_compacted(job: _Job, graphdef, state, j: int) -> tuple:
  """Sub-batch j of `job` decoded with its finished rows dropped between stretches."""
  n = job.layout.sub_batches
  ids, mask, rows, rng, *scalars = _place(job, job.ids[j::n], job.mask[j::n], job.rows(j))
  st = job.static
  shards = 1 if job.mesh is None else job.mesh.shape["data"] * job.mesh.shape["fsdp"]
  flags = Flags(
      st["max_len"], st["greedy"], st["top_k"], st["use_top_p"], st["return_logprobs"], st["return_logits"], shards
  )
  return decode_compacted(
      state,
      ids,
      mask,
      rows,
      rng,
      tuple(scalars),
      graphdef=graphdef,
      flags=flags,
      samples=st["samples"],
      n_new=job.n_new,
      units=job.units,
  )


def _mesh_ctx(mesh):
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _place(job: _Job, ids: np.ndarray, mask: np.ndarray, row_ids: np.ndarray) -> tuple:
  """(ids, mask, row_ids, rng, *scalars) as `_generate_jit` takes them: on a mesh, prompts and
  rows over its row axes and the rest replicated (one cache entry per mesh)."""
  rng = job.rng
  if job.mesh is None:
    return (ids, mask, row_ids, rng, *job.scalars)
  prompts = prompt_sharding(job.mesh, ids.shape[0])
  rows = _row_ids_sharding(job.mesh, row_ids.shape[0])
  repl = replicated(job.mesh)
  rng = jax.random.wrap_key_data(put_global(jax.random.key_data(rng), repl), impl=jax.random.key_impl(rng))
  placed = (put_global(ids, prompts), put_global(mask, prompts), put_global(row_ids, rows))
  return (*placed, rng, *(put_global(x, repl) for x in job.scalars))


class SubBatch(NamedTuple):
  """One decode sub-batch of `generate_sub_batches`: `outputs` (ids, mask[, logprobs][, logits])
  [rows, max_new_tokens(, V)] as `generate` returns them, possibly still being computed; `rows`
  [rows] the row of `generate`'s output each is (-1: batch padding)."""

  index: int
  rows: np.ndarray
  outputs: tuple
  layout: DecodeLayout


def generate_sub_batches(model, prompt_ids, prompt_mask, **kwargs) -> Iterator[SubBatch]:
  """`generate`'s decode sub-batches, each its own dispatch of one compiled program, yielded
  in order, sub-batch j only once sub-batch j + 1 has been launched: dispatch is asynchronous,
  so the caller's host work on j (fetching its tokens, detokenizing, scoring) runs while the
  devices decode j + 1. Arguments as `generate`'s. The tokens are `generate`'s: sub-batch j
  holds the same prompts (j, j + n, ...), each row drawing with its own key; `join_sub_batches`
  lays the parts out as `generate`'s output. With compact_rows (and more than one phase) the host
  drives each sub-batch's phases (`compact.decode_compacted`): sub-batch j + 1 is driven by a
  worker thread while the caller works on j."""
  job = _prepare(model, prompt_ids, prompt_mask, **kwargs)
  n = job.layout.sub_batches
  with _mesh_ctx(job.mesh):
    graphdef, state = as_rollout_policy(model, dtype=kwargs.get("rollout_dtype"), mesh=job.mesh)
  static = dict(job.static, graphdef=graphdef, sub_batches=1)

  def launch(j: int) -> SubBatch:
    rows = job.rows(j)
    with _mesh_ctx(job.mesh):
      if job.compact:
        out = _decode_compacted(job, graphdef, state, j)
      else:
        out = _generate_jit(state, *_place(job, job.ids[j::n], job.mask[j::n], rows), **static)
      out = tuple(x[:, : job.n_new] for x in out)
    return SubBatch(j, np.where(rows < job.n_rows, rows, -1), out, job.layout)

  if not job.compact:  # dispatch is asynchronous: launching j + 1 returns at once
    ahead = launch(0)
    for j in range(n):
      current, ahead = ahead, launch(j + 1) if j + 1 < n else None
      yield current
    return
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode") as pool:
    ahead = pool.submit(launch, 0)
    for j in range(n):
      current = ahead.result()
      ahead = pool.submit(launch, j + 1) if j + 1 < n else None
      yield current


def join_sub_batches(parts: Sequence[SubBatch]) -> tuple[Array, ...]:
  """All the sub-batches of one `generate_sub_batches` call -> `generate`'s outputs."""
  layout = parts[0].layout
  if [p.index for p in parts] != list(range(layout.sub_batches)):
    raise ValueError(f"join_sub_batches: expected sub-batches 0..{layout.sub_batches - 1} in order")
  n_rows = int(max(p.rows.max() for p in parts)) + 1
  if layout.sub_batches == 1:
    return tuple(x[:n_rows] for x in parts[0].outputs)
  sharding = parts[0].outputs[0].sharding
  with _mesh_ctx(sharding.mesh if isinstance(sharding, NamedSharding) else None):  # rows stay sharded
    out = _join_jit(tuple(p.outputs for p in parts), samples=layout.samples)
  return tuple(x[:n_rows] for x in out)


@functools.partial(jax.jit, static_argnames=("samples",))
def _join_jit(outputs: tuple, *, samples: int) -> tuple:
  return tuple(join_sub_batches_rows(jnp.stack(xs), samples) for xs in zip(*outputs))


def prompt_sharding(mesh: Mesh, n_prompts: int) -> NamedSharding:
  """Prompt rows over as many of ("data", "fsdp") as divide them (the rest replicated): with a
  group's rows sharing one prefilled prompt, there may be fewer prompts than row shards."""
  return NamedSharding(mesh, logical_to_spec(("act_batch", None), (n_prompts, 1), dict(mesh.shape)))


def _row_ids_sharding(mesh: Mesh, n_rows: int) -> NamedSharding:
  """The row ids [n_rows] laid out as the decode rows are (`prompt_sharding`'s first axis)."""
  return NamedSharding(mesh, PartitionSpec(prompt_sharding(mesh, n_rows).spec[0]))


def lower_generate(
    policy: RolloutPolicy,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    *,
    mesh: Mesh | None = None,
    greedy: bool = False,
    top_k: int = 0,
    use_top_p: bool = False,
    decode_batch_size: int | None = None,
    return_logprobs: bool = False,
    num_samples: int = 1,
) -> jax.stages.Lowered:
  """The sampler's program lowered for abstract inputs, without running it (e.g. for absent
  accelerators: `.compile()` it, then read `memory_analysis()` / `cost_analysis()`).

  policy: a RolloutPolicy whose state may hold `jax.ShapeDtypeStruct`s carrying shardings
  (e.g. `decode_shardings` over a topology's mesh); batch rows (prompts x num_samples, laid out and
  padded as `generate` does: `plan.decode_layout`); prompt_len and max_new_tokens the bucketed
  widths. Temperature, top_p, EOS ids and the number of new tokens stay runtime inputs (traced),
  as in `generate`. This is the decode without compaction (compact_rows=False: every row to the
  end, one program); `compact.py` runs the same phases one program per (bound, rows)."""
  sub = batch if decode_batch_size is None else decode_batch_size
  if batch % sub or batch % num_samples:
    raise ValueError(f"lower_generate: decode_batch_size {sub} and num_samples {num_samples} must divide batch {batch}")
  layout = decode_layout(batch, num_samples, sub, 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"])
  prompts = None if mesh is None else prompt_sharding(mesh, layout.prefill_rows)
  n_rows = layout.prefill_rows * layout.samples
  rows = None if mesh is None else _row_ids_sharding(mesh, n_rows)
  repl = None if mesh is None else replicated(mesh)
  sds = lambda shape, dtype, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
  args = (
      policy.state,
      sds((layout.prefill_rows, prompt_len), jnp.int32, prompts),
      sds((layout.prefill_rows, prompt_len), jnp.int32, prompts),
      sds((n_rows,), jnp.int32, rows),
      sds((), jax.eval_shape(lambda: jax.random.key(0)).dtype, repl),
      sds((), jnp.int32, repl),
      sds((), jnp.float32, repl),
      sds((), jnp.float32, repl),
      sds(_eos_array(QWEN_EOS_IDS).shape, jnp.int32, repl),
      sds((), jnp.int32, repl),
  )
  static = dict(
      graphdef=policy.graphdef,
      max_len=max_new_tokens,
      greedy=greedy,
      top_k=top_k,
      use_top_p=use_top_p,
      return_logits=False,
      return_logprobs=return_logprobs,
      sub_batches=layout.sub_batches,
      samples=layout.samples,
  )
  ctx = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  with ctx:
    return _generate_jit.lower(*args, **static)
