"""The jitted generator: prefill + KV-cache decode loop, EOS stop, decode sub-batches.

Layout. Prompts are left-padded [B, P]; the cache holds S = P_bucket + N_bucket slots: the prompt in
slots [0, P_bucket) and completion token i in slot P_bucket + i. Keys are visible when their slot is
<= the query's slot and `kv_mask` is 1 (prompt mask, then ones). RoPE positions come from the
prompt (`cumsum(mask) - 1`) and continue with `num_prompt_tokens + i` for completion token i, so
left padding never shifts a position (same as `transformers` with an attention mask). Prefill
attends over the prompt only (`hidden_states(prefill=True)`: [P, P] scores, not [P, P + N]) and
writes its keys/values into slots [0, P_bucket).

Decode is one `[B, 1]` forward per step inside a `lax.while_loop` that stops when every row has
emitted an EOS token or `max_new_tokens` tokens. The EOS token itself is part of the completion
(mask 1); later positions hold `pad_id` with mask 0 and log-prob 0. Each step's logits [B, V]
(`Qwen2.next_token_logits`, or `cpu_paths.head_logits` for `kernels == "cpu"`) are sampled by
`rules._sample_step`.

Compilation. The jitted generator is cached by jax per (graphdef, bucketed shapes, static sampling
flags). temperature, top_p and the actual max_new_tokens are traced values, so changing them does
not recompile. The KV cache lives in the compute dtype (`cfg.dtype`) inside the loop carry and is
updated in place; nothing the caller owns is donated (the outputs do not alias any input).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import cpu_paths
from ict_jax.models.axes import constrain
from ict_jax.sampling.rules import _sample_step

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


def decode_one(model, tok: Array, num_prompt: Array, i, cache, cache_index, kv_mask: Array):
  """One step of the decode loop: completion token i - 1 (tok [b]) in, its keys/values written at
  cache slot `cache_index` -> (logits [b, V] of completion token i, the updated cache)."""
  h, cache = model.hidden_states(
      tok[:, None],
      jnp.ones((tok.shape[0], 1), jnp.int32),
      positions=(num_prompt + i - 1)[:, None],
      cache=cache,
      cache_index=cache_index,
      kv_mask=kv_mask,
  )
  return decode_head(model, h[:, 0]), cache


def _decode_rows(
    model,
    prompt_ids,
    prompt_mask,
    rng,
    num_new,
    temperature,
    top_p,
    eos_ids,
    pad_id,
    *,
    max_len: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    return_logprobs: bool,
    return_logits: bool,
) -> dict:
  """One decode batch: prompt_ids/mask [b, P] -> {ids, mask[, logprobs][, logits]} [b, max_len(, V)].

  Prefill, then a `lax.while_loop` of [b, 1] steps that stops when every row has emitted an EOS
  token or num_new tokens."""
  b, p = prompt_ids.shape
  mask = prompt_mask.astype(jnp.int32)
  rows = ("act_batch", None)
  num_prompt = jnp.sum(mask, axis=-1)  # [b]; the position of the first completion token
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  kv_mask = constrain(jnp.concatenate([mask, jnp.ones((b, max_len), jnp.int32)], axis=1), rows)

  cache = model.init_cache(b, p + max_len)
  h, cache = model.hidden_states(
      prompt_ids, mask, positions=positions, cache=cache, cache_index=jnp.int32(0), prefill=True
  )  # [P, P] scores
  kernels = model.cfg.kernels
  logits = decode_head(model, h[:, -1])  # left padding: the last slot is real

  def emit(i, logits, done, out):
    """Sample completion token i from logits [b, V] and write it into the outputs."""
    tok, lp = _sample_step(
        logits,
        jax.random.fold_in(rng, i),
        temperature,
        top_p,
        greedy=greedy,
        top_k=top_k,
        use_top_p=use_top_p,
        kernels=kernels,
    )
    active = ~done
    tok = jnp.where(active, tok, pad_id)
    out = dict(out, ids=out["ids"].at[:, i].set(tok), mask=out["mask"].at[:, i].set(active))
    if return_logprobs:
      out["logprobs"] = out["logprobs"].at[:, i].set(jnp.where(active, lp, 0.0))
    if return_logits:
      out["logits"] = jax.lax.dynamic_update_index_in_dim(out["logits"], logits, i, axis=1)
    done = done | (active & jnp.any(tok[:, None] == eos_ids[None, :], axis=-1))
    return tok, done, out

  out = dict(
      ids=constrain(jnp.full((b, max_len), pad_id, jnp.int32), rows),
      mask=constrain(jnp.zeros((b, max_len), jnp.int32), rows),
  )
  if return_logprobs:
    out["logprobs"] = constrain(jnp.zeros((b, max_len), jnp.float32), rows)
  if return_logits:
    out["logits"] = constrain(jnp.zeros((b, max_len, logits.shape[1]), jnp.float32), ("act_batch", None, None))
  tok, done, out = emit(0, logits, num_prompt == 0, out)

  def cond(carry):
    i, _, _, done, _ = carry
    return (i < num_new) & ~jnp.all(done)

  def body(carry):
    i, cache, tok, done, out = carry  # tok [b]: completion token i - 1, in slot p + i - 1
    logits, cache = decode_one(model, tok, num_prompt, i, cache, p + i - 1, kv_mask)
    tok, done, out = emit(i, logits, done, out)
    return i + 1, cache, tok, done, out

  carry = (jnp.int32(1), cache, tok, done, out)
  return jax.lax.while_loop(cond, body, carry)[-1]


def _generate_impl(
    state,
    prompt_ids,
    prompt_mask,
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
):
  """prompt_ids/mask [B, P] left-padded -> ids [B, max_len], mask(, logprobs)(, logits [B, N, V]).

  num_new (<= max_len), temperature, top_p, eos_ids [E] (-1 = none) and pad_id are traced, so they
  never cause a recompile; rows whose prompt mask is all 0 (batch padding) emit nothing.

  sub_batches n > 1 decodes the rows as n sub-batches of B / n, one after the other
  (`lax.map`), so only one sub-batch's KV cache is live. Sub-batch j holds rows j, j + n,
  j + 2n, ...: viewed as [B / n, n], rows sharded in blocks over ("data", "fsdp") stay on their
  devices and every sub-batch spans all of them. Sub-batch j samples with `fold_in(rng, j)`."""
  model = nnx.merge(graphdef, state)
  kw = dict(
      max_len=max_len,
      greedy=greedy,
      top_k=top_k,
      use_top_p=use_top_p,
      return_logprobs=return_logprobs,
      return_logits=return_logits,
  )
  scalars = (num_new, temperature, top_p, eos_ids, pad_id)
  if sub_batches == 1:
    out = _decode_rows(model, prompt_ids, prompt_mask, rng, *scalars, **kw)
  else:
    b, p = prompt_ids.shape
    per = b // sub_batches
    split = lambda x: jnp.swapaxes(
        constrain(x.reshape(per, sub_batches, p), ("act_batch", None, None)), 0, 1
    )  # [n, B/n, P]

    def one(args):
      j, ids, mask = args
      return _decode_rows(model, ids, mask, jax.random.fold_in(rng, j), *scalars, **kw)

    out = jax.lax.map(one, (jnp.arange(sub_batches), split(prompt_ids), split(prompt_mask)))
    out = {
        k: constrain(jnp.swapaxes(v, 0, 1), ("act_batch",) + (None,) * (v.ndim - 1)).reshape(b, *v.shape[2:])
        for k, v in out.items()
    }  # [B/n, n, ...] -> [B, ...]
  names = ("ids", "mask") + (("logprobs",) if return_logprobs else ()) + (("logits",) if return_logits else ())
  return tuple(out[k] for k in names)


_STATIC = ("graphdef", "max_len", "greedy", "top_k", "use_top_p", "return_logits", "return_logprobs", "sub_batches")
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
):
  """Pure generator for use inside other jitted code (no validation, no bucketing, no repeats).

  graphdef, state = nnx.split(model); prompt_ids/mask [B, P] left-padded, every row with at least
  one token; max_new_tokens a Python int (the output width). Returns (ids [B, N] int32,
  mask [B, N] int32, logprobs [B, N] float32) and, with return_logits, the raw float32 logits
  [B, N, V] each token was sampled from."""
  greedy = isinstance(temperature, (int, float)) and temperature == 0
  return _generate_impl(
      state,
      prompt_ids,
      prompt_mask,
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
  )


def _eos_array(eos_token_ids: Sequence[int]) -> np.ndarray:
  """EOS ids padded with -1 (never a token) to a multiple of 4: few distinct shapes."""
  eos = [int(e) for e in eos_token_ids]
  out = np.full(max(4, -(-len(eos) // 4) * 4), -1, np.int32)
  out[: len(eos)] = eos
  return out
