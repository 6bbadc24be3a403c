"""The jitted generator: prefill once per prompt + KV-cache decode loop, EOS stop, sub-batches.

Layout. Prompts are left-padded [U, P] and each is decoded by R consecutive rows (its samples):
B = U x R rows. A prompt is prefilled once (`hidden_states(prefill=True)`: [P, P] scores) into a
prompt cache [L, U, K, P, H] that its R rows read as a shared prefix (`Qwen2.hidden_states(prefix=
...)`: one block of prompt slots per prompt, not per row); the decode cache [L, B, K, N, H] holds
completion token i in slot i. So prefill FLOPs and the prompt's KV memory are per prompt, not per
sample. RoPE positions come from the prompt (`cumsum(mask) - 1`) and continue with
`num_prompt_tokens + i` for completion token i, so left padding never shifts a position (same as
`transformers` with an attention mask).

Decode is one `[B, 1]` forward per step inside `lax.while_loop`s that stop when every row has
emitted an EOS token or `max_new_tokens` tokens: one loop a length-bounded phase
(`plan.decode_phases`), whose steps read only the completion slots within its bound (compiled
with it), so a rollout reads ~1 + 1 / 16 of the slots written, not ~2x. The EOS token itself is
part of the completion (mask 1); later positions hold `pad_id` with mask 0 and log-prob 0. Each
step's logits [B, V] (`Qwen2.next_token_logits`, or `cpu_paths.head_logits` for
`kernels == "cpu"`) are sampled by `rules._sample_step`, row r's token i with the key
fold_in(fold_in(rng, r), i) (r its row of `generate`'s output): a row's tokens do not depend on the
rows decoded with it, so sub-batches and `compact.py` (which drops the finished rows between the
phases) give the same tokens.

Compilation. The jitted generator is cached by jax per (graphdef, bucketed shapes, static sampling
flags). temperature, top_p and the actual max_new_tokens are traced values, so changing them does
not recompile. The KV cache lives in the compute dtype (`cfg.dtype`) inside the loop carry and is
updated in place; nothing the caller owns is donated (the outputs do not alias any input).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import cpu_paths
from ict_jax.models.axes import constrain
from ict_jax.models.qwen2 import LayerCache
from ict_jax.sampling.plan import decode_phases
from ict_jax.sampling.rules import _sample_step, row_keys

Array = jax.Array

QWEN_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
QWEN_PAD_ID = 151643


def decode_head(model, h: Array) -> Array:
  """h [b, D] (final-normed) -> float32 logits [b, V], as the sampler computes them for
  `model.cfg.kernels` ("cpu": vocabulary-major [V, b], transposed without a copy into
  `cpu_paths.plain_step`)."""
  if model.cfg.kernels == "cpu":
    return cpu_paths.head_logits(h, *model.head_weight()).T
  return model.next_token_logits(h)


def prefill(model, prompt_ids: Array, prompt_mask: Array) -> tuple[Array, LayerCache]:
  """Prompts [u, P] left-padded -> (logits [u, V] of the first completion token, the prompt cache
  [L, u, K, P, H] that `decode_one` reads as the shared prefix of the prompt's rows)."""
  mask = prompt_mask.astype(jnp.int32)
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  cache = model.init_cache(*prompt_ids.shape)
  h, cache = model.hidden_states(
      prompt_ids, mask, positions=positions, cache=cache, cache_index=jnp.int32(0), prefill=True
  )  # [P, P] scores
  return decode_head(model, h[:, -1]), cache  # left padding: the last slot is real


def decode_one(
    model, tok: Array, num_prompt: Array, i, cache, prompt_cache, prompt_mask: Array, read_len: int | None = None
):
  """One step of the decode loop: completion token i - 1 (tok [b]) in, its keys/values written at
  slot i - 1 of the decode cache [L, b, K, N, H] -> (logits [b, V] of completion token i, the
  updated cache). Row r reads the prompt cache [L, u, K, P, H] (`prefill`) at row r // (b / u)
  where `prompt_mask` [u, P] is 1, then the completion slots before i - 1 and its own new slot;
  read_len (static, >= i - 1) bounds the completion slots read (default all N)."""
  h, cache = model.hidden_states(
      tok[:, None],
      jnp.ones((tok.shape[0], 1), jnp.int32),
      positions=(num_prompt + i - 1)[:, None],
      cache=cache,
      cache_index=i - 1,
      prefix=prompt_cache,
      prefix_mask=prompt_mask,
      cache_read_len=read_len,
  )
  return decode_head(model, h[:, 0]), cache


class Flags(NamedTuple):
  """The static choices of a decode program (hashable: part of its jit cache key). shards: the row
  shards the outputs are laid out over in blocks (`_write_column`; 1 outside `compact.py`)."""

  max_len: int
  greedy: bool
  top_k: int
  use_top_p: bool
  return_logprobs: bool
  return_logits: bool
  shards: int = 1


class Decoding(NamedTuple):
  """The decode loop's state between two steps (and between the host-driven phases of
  `compact.py`): b decode rows computed, `out` holding all B rows of the sub-batch. Per row shard
  (`Flags.shards` blocks of rows), the b / shards computed rows are its out rows [0, b / shards)."""

  i: Array  # [] the completion token the next step samples
  cache: LayerCache  # [L, b, K, N, H] completion slots (a JointCache with decode_attention "pallas")
  tok: Array  # [b] completion token i - 1
  done: Array  # [b] bool: emitted an EOS token (or batch padding)
  num_prompt: Array  # [b] prompt tokens of the row: the position of its first completion token
  row_ids: Array  # [b] the row of `generate`'s output each is: its draws' key
  prompt_cache: LayerCache  # [L, u, K, P, H]: rows [k b/u, (k + 1) b/u) read its row k
  prompt_mask: Array  # [u, P]
  out: dict  # {ids, mask[, logprobs][, logits]} [B, max_len(, V)]
  order: Array  # [B] the index in the sub-batch of the row each out row holds


def _write_column(o: Array, v: Array, i, shards: int) -> Array:
  """o [B, N, ...] with column i of the computed rows set to v [b, ...]: each of the `shards`
  blocks of o's rows holds its b / shards computed rows first."""
  o3 = o.reshape(shards, o.shape[0] // shards, *o.shape[1:])
  v3 = v.reshape(shards, v.shape[0] // shards, 1, *v.shape[1:]).astype(o.dtype)
  o3 = jax.lax.dynamic_update_slice(o3, v3, (0, 0, i) + (0,) * (o.ndim - 2))
  return constrain(o3.reshape(o.shape), ("act_batch",) + (None,) * (o.ndim - 1))


def _emit(cfg, c: Decoding, logits: Array, rng, scalars, flags: Flags) -> Decoding:
  """Sample completion token c.i of each computed row from logits [b, V] and write it into the
  outputs. Row r draws with fold_in(fold_in(rng, row_ids[r]), i): its tokens do not depend on the
  rows that share its batch."""
  _, temperature, top_p, eos_ids, pad_id = scalars
  i = c.i
  keys = row_keys(rng, c.row_ids, i)  # [b]
  tok, lp = _sample_step(
      logits,
      keys,
      temperature,
      top_p,
      greedy=flags.greedy,
      top_k=flags.top_k,
      use_top_p=flags.use_top_p,
      kernels=cfg.kernels,
      vocab_split=cfg.split_mlp,
  )
  active = ~c.done
  tok = jnp.where(active, tok, pad_id)
  write = lambda o, v: _write_column(o, v, i, flags.shards)
  out = dict(c.out, ids=write(c.out["ids"], tok), mask=write(c.out["mask"], active))
  if flags.return_logprobs:
    out["logprobs"] = write(out["logprobs"], jnp.where(active, lp, 0.0))
  if flags.return_logits:
    out["logits"] = write(out["logits"], logits)
  done = c.done | (active & jnp.any(tok[:, None] == eos_ids[None, :], axis=-1))
  return c._replace(i=i + 1, tok=tok, done=done, out=out)


def _start(model, prompt_ids, prompt_mask, row_ids, rng, scalars, flags: Flags, samples: int) -> Decoding:
  """Prefill the u prompts [u, P] (each read by `samples` consecutive rows, row_ids [b] their rows
  of `generate`'s output) and sample completion token 0 of every row."""
  u = prompt_ids.shape[0]
  b = u * samples
  rows = ("act_batch", None)
  per_row = lambda x: jnp.repeat(x, samples, axis=0)  # [u, ...] -> [b, ...]
  prompt_mask = prompt_mask.astype(jnp.int32)
  num_prompt = per_row(jnp.sum(prompt_mask, axis=-1))  # [b]; the position of the first completion token
  logits, prompt_cache = prefill(model, prompt_ids, prompt_mask)
  logits = per_row(logits)  # [b, V]: the samples of a prompt draw from the same first logits
  max_len = flags.max_len
  out = dict(
      ids=constrain(jnp.full((b, max_len), scalars[4], jnp.int32), rows),
      mask=constrain(jnp.zeros((b, max_len), jnp.int32), rows),
  )
  if flags.return_logprobs:
    out["logprobs"] = constrain(jnp.zeros((b, max_len), jnp.float32), rows)
  if flags.return_logits:
    out["logits"] = constrain(jnp.zeros((b, max_len, logits.shape[1]), jnp.float32), ("act_batch", None, None))
  c = Decoding(
      jnp.int32(0),
      model.init_cache(b, max_len),
      jnp.zeros((b,), jnp.int32),
      num_prompt == 0,  # batch padding emits nothing
      num_prompt,
      constrain(row_ids.astype(jnp.int32), ("act_batch",)),
      prompt_cache,
      prompt_mask,
      out,
      constrain(jnp.arange(b, dtype=jnp.int32), ("act_batch",)),
  )
  return _emit(model.cfg, c, logits, rng, scalars, flags)


def live_prompt_mask(prompt_mask: Array, done: Array) -> Array:
  """prompt_mask [u, P] with the prompts none of whose rows still decodes (done [b], rows
  [k b/u, (k + 1) b/u) prompt k's) all padding: [u, P]."""
  live = ~jnp.all(done.reshape(prompt_mask.shape[0], -1), axis=1)  # [u]
  return prompt_mask * live[:, None].astype(prompt_mask.dtype)


def _phase(model, c: Decoding, rng, scalars, flags: Flags, bound: int, stop=None) -> Decoding:
  """The steps i <= bound of the decode loop (completion slots [0, i - 1) within [0, bound)), one
  `lax.while_loop` that stops early when every row is done or num_new tokens are out; `stop` (a
  traced int32, <= bound: not a new program) ends it after step `stop` (a stretch, `compact.py`).
  A prompt whose rows have all finished is masked out of the step (its rows' tokens are padding
  whatever they read), so the fused kernel skips its blocks (`decode_kernel`)."""
  num_new = scalars[0]
  last = bound if stop is None else jnp.minimum(stop, bound)

  def cond(c):
    return (c.i < num_new) & (c.i <= last) & ~jnp.all(c.done)

  def body(c):  # c.tok [b]: completion token i - 1, into slot i - 1
    read = live_prompt_mask(c.prompt_mask, c.done)
    logits, cache = decode_one(model, c.tok, c.num_prompt, c.i, c.cache, c.prompt_cache, read, bound)
    return _emit(model.cfg, c._replace(cache=cache), logits, rng, scalars, flags)

  return jax.lax.while_loop(cond, body, c)


def _decode_rows(model, prompt_ids, prompt_mask, row_ids, rng, scalars, flags: Flags, samples: int) -> dict:
  """One decode batch: prompts [u, P], `samples` rows each (row_ids [u * samples] their rows of
  `generate`'s output) -> {ids, mask[, logprobs][, logits]} [u * samples, max_len(, V)], row
  k * samples + s sample s of prompt k.

  Prefill the u prompts, then [b, 1] steps that stop when every row has emitted an EOS token or
  num_new tokens, in length-bounded phases (`plan.decode_phases`): one `lax.while_loop` a phase,
  whose steps read only the completion slots within its bound. Every row stays in the batch to the
  end (`compact.py` drops the finished ones between the phases)."""
  c = _start(model, prompt_ids, prompt_mask, row_ids, rng, scalars, flags, samples)
  for bound in decode_phases(flags.max_len):
    c = _phase(model, c, rng, scalars, flags, bound)
  return c.out


def _generate_impl(
    state,
    prompt_ids,
    prompt_mask,
    row_ids,
    rng,
    num_new,
    temperature,
    top_p,
    eos_ids,
    pad_id,
    *,
    graphdef,
    max_len: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    return_logits: bool,
    return_logprobs: bool = True,
    sub_batches: int = 1,
    samples: int = 1,
):
  """prompt_ids/mask [U, P] left-padded, `samples` (R) rows each -> ids [U * R, max_len],
  mask(, logprobs)(, logits [U * R, N, V]); row k * R + s is sample s of prompt k.

  row_ids [U * R]: the row of `generate`'s output each row is; row r draws its token i with
  fold_in(fold_in(rng, row_ids[r]), i), so its tokens do not depend on the rows decoded with it.
  num_new (<= max_len), temperature, top_p, eos_ids [E] (-1 = none) and pad_id are traced, so they
  never cause a recompile; prompts whose mask is all 0 (batch padding) emit nothing.

  sub_batches n > 1 decodes the prompts as n sub-batches of U / n prompts (U * R / n rows), one
  after the other (`lax.map`), so only one sub-batch's KV cache is live. Sub-batch j holds prompts
  j, j + n, j + 2n, ...: viewed as [U / n, n], prompts sharded in blocks over ("data", "fsdp")
  stay on their devices and every sub-batch spans all of them."""
  model = nnx.merge(graphdef, state)
  flags = Flags(max_len, greedy, top_k, use_top_p, return_logprobs, return_logits)
  scalars = (num_new, temperature, top_p, eos_ids, pad_id)
  if sub_batches == 1:
    out = _decode_rows(model, prompt_ids, prompt_mask, row_ids, rng, scalars, flags, samples)
  else:
    u, p = prompt_ids.shape
    per = u // sub_batches
    split = lambda x, w: jnp.swapaxes(
        constrain(x.reshape(per, sub_batches, w), ("act_batch", None, None)), 0, 1
    )  # [n, U/n, w]

    def one(args):
      ids, mask, rows = args
      return _decode_rows(model, ids, mask, rows.reshape(-1), rng, scalars, flags, samples)

    out = jax.lax.map(one, (split(prompt_ids, p), split(prompt_mask, p), split(row_ids, samples)))
    out = {k: join_sub_batches_rows(v, samples) for k, v in out.items()}
  return output_tuple(out, return_logprobs, return_logits)


def output_names(return_logprobs: bool, return_logits: bool) -> tuple[str, ...]:
  """The outputs `generate` returns, in order: ids, mask[, logprobs][, logits]."""
  return ("ids", "mask") + (("logprobs",) if return_logprobs else ()) + (("logits",) if return_logits else ())


def output_tuple(out: dict, return_logprobs: bool, return_logits: bool) -> tuple:
  """(ids, mask[, logprobs][, logits]) of a decode's outputs, as `generate` returns them."""
  return tuple(out[k] for k in output_names(return_logprobs, return_logits))


def join_sub_batches_rows(v: Array, samples: int) -> Array:
  """Outputs of n sub-batches [n, U/n * R, ...] -> [U * R, ...]: row k * R + s of sub-batch j
  (sample s of its prompt k, prompt k * n + j of all) is row (k * n + j) * R + s."""
  n, rows = v.shape[:2]
  per = rows // samples
  v = jnp.swapaxes(v.reshape(n, per, samples, *v.shape[2:]), 0, 1)  # [U/n, n, R, ...]
  return constrain(v, ("act_batch",) + (None,) * (v.ndim - 1)).reshape(per * n * samples, *v.shape[3:])


_STATIC = (
    "graphdef",
    "max_len",
    "greedy",
    "top_k",
    "use_top_p",
    "return_logits",
    "return_logprobs",
    "sub_batches",
    "samples",
)
_generate_jit = jax.jit(_generate_impl, static_argnames=_STATIC)


def sample_fn(
    graphdef,
    state,
    prompt_ids: Array,
    prompt_mask: Array,
    rng: Array,
    *,
    max_new_tokens: int,
    temperature=1.0,
    top_p=1.0,
    top_k: int = 0,
    eos_token_ids: Sequence[int] = QWEN_EOS_IDS,
    pad_id: int = QWEN_PAD_ID,
    return_logits: bool = False,
    num_samples: int = 1,
):
  """Pure generator for use inside other jitted code (no validation, no bucketing).

  graphdef, state = nnx.split(model); prompt_ids/mask [B, P] left-padded, every row with at least
  one token, each prompt prefilled once and decoded by num_samples (G) rows; max_new_tokens a
  Python int (the output width). Returns (ids [B * G, N] int32, mask [B * G, N] int32, logprobs
  [B * G, N] float32), rows g * G .. g * G + G - 1 prompt g's, and, with return_logits, the raw
  float32 logits [B * G, N, V] each token was sampled from."""
  greedy = isinstance(temperature, (int, float)) and temperature == 0
  return _generate_impl(
      state,
      prompt_ids,
      prompt_mask,
      jnp.arange(prompt_ids.shape[0] * int(num_samples), dtype=jnp.int32),
      rng,
      jnp.int32(max_new_tokens),
      jnp.asarray(1.0 if greedy else temperature, jnp.float32),
      jnp.asarray(top_p, jnp.float32),
      jnp.asarray(_eos_array(eos_token_ids)),
      jnp.int32(pad_id),
      graphdef=graphdef,
      max_len=int(max_new_tokens),
      greedy=greedy,
      top_k=int(top_k),
      use_top_p=not (isinstance(top_p, (int, float)) and top_p >= 1.0),
      return_logits=return_logits,
      samples=int(num_samples),
  )


def _eos_array(eos_token_ids: Sequence[int]) -> np.ndarray:
  """EOS ids padded with -1 (never a token) to a multiple of 4: few distinct shapes."""
  eos = [int(e) for e in eos_token_ids]
  out = np.full(max(4, -(-len(eos) // 4) * 4), -1, np.int32)
  out[: len(eos)] = eos
  return out
