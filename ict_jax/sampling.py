"""Jitted generation: prefill + KV-cache decode loop, temperature / top-k / top-p, EOS stop.

Layout. Prompts are left-padded [B, P]; the cache holds S = P_bucket + N_bucket slots: the prompt in
slots [0, P_bucket) and completion token i in slot P_bucket + i. Keys are visible when their slot is
<= the query's slot and `kv_mask` is 1 (prompt mask, then ones). RoPE positions come from the
prompt (`cumsum(mask) - 1`) and continue with `num_prompt_tokens + i` for completion token i, so
left padding never shifts a position (same as `transformers` with an attention mask). Prefill
attends over the prompt only (`hidden_states(prefill=True)`: [P, P] scores, not [P, P + N]) and
writes its keys/values into slots [0, P_bucket).

Decode is one `[B, 1]` forward per step inside a `lax.while_loop` that stops when every row has
emitted an EOS token or `max_new_tokens` tokens. The EOS token itself is part of the completion
(mask 1); later positions hold `pad_id` with mask 0 and log-prob 0.

Sampling (`sample_logits`): logits / temperature, then top-k (exactly k candidates, ties broken by
the lower token id), then top-p (the smallest set of most likely tokens whose mass reaches top_p,
like `transformers`' TopPLogitsWarper), then one draw by inverse CDF from a single uniform per row
(no [B, V] Gumbel noise). The returned log-prob is that of the sampled token under the distribution
actually sampled from (after temperature, top-k and top-p). `temperature=0` is greedy: argmax of
the raw logits, and the log-prob is `log_softmax(raw logits)` at that token. The decode loop
takes logits [B, V] from `Qwen2.next_token_logits` and samples them with `jnp.argmax` / the
inverse CDF above: the portable path, run on TPU/GPU and on any mesh. With the model's
`kernels == "cpu"` (XLA:CPU on one device, `ict_jax.cpu_paths`) the head is vocabulary-major
[V, B] and greedy / plain temperature sampling reduce it in two levels without building any
[B, V] probabilities (`cpu_paths.plain_step`); top-k / top-p work on [B, V] either way.

Compilation. Prompt length and max_new_tokens are rounded up to buckets (powers of two from 16, or a
given list); the jitted generator is cached by jax per (graphdef, bucketed shapes, static sampling
flags). temperature, top_p and the actual max_new_tokens are traced values, so changing them does
not recompile. The KV cache lives in the compute dtype (`cfg.dtype`) inside the loop carry and is
updated in place; nothing the caller owns is donated (the outputs do not alias any input).

Weights and memory. The sampler decodes with a `RolloutPolicy`: the parameters cast once to the
rollout dtype (bfloat16 on accelerators in training) and laid out for decoding (`DECODE_RULES`:
nothing over "fsdp", heads / MLP / vocabulary over "tensor") by one jitted call
(`make_rollout_policy`), so no decode step casts or all-gathers a weight. `decode_batch_size`
decodes the rows in sub-batches (one KV cache live at a time), "auto" sizing them from the
devices' free memory (`decode_row_bytes`). `lower_generate` + `abstract_rollout_policy` compile
the same program for devices that are absent.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import Mesh, NamedSharding

from ict_jax import cpu_paths
from ict_jax.models.axes import DEFAULT_RULES, axis_rules, constrain, pure_shardings
from ict_jax.models.qwen2 import abstract_model
from ict_jax.sharding import batch_sharding, put_global, replicated

Array = jax.Array

QWEN_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
QWEN_PAD_ID = 151643
_MIN_BUCKET = 16
_CDF_BLOCK = 1024  # inverse-CDF search: block sums first, then a cumsum inside one block
_F32_ONE_BITS = 0x3F800000
_TOP_P_CANDIDATES = 256  # top-p fast path: the nucleus usually lies within the 256 best tokens


# ---- buckets ------------------------------------------------------------------------------------
def bucket_length(n: int, buckets: Sequence[int] | None = None) -> int:
  """The smallest listed bucket >= n, else the next power of two >= max(n, 16)."""
  if buckets:
    fits = [b for b in sorted(buckets) if b >= n]
    if fits:
      return int(fits[0])
  return max(_MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ---- sampling one step --------------------------------------------------------------------------
def _first_crossing(cum: Array, weights: Array, target: Array) -> Array:
  """Index of the entry whose cumulative interval holds `target`: cum, weights [B, n]; target [B].

  Zero-weight entries have empty intervals and are never chosen; float round-off past the end
  lands on the last entry with weight > 0."""
  n = weights.shape[-1]
  count = jnp.sum(cum <= target[:, None], axis=-1)
  last_nonzero = n - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
  return jnp.minimum(count, last_nonzero).astype(jnp.int32)


def _inverse_cdf(key: Array, weights: Array) -> Array:
  """One draw per row from unnormalised weights [B, V] >= 0 (at least one > 0) -> ids [B]."""
  b, v = weights.shape
  u = jax.random.uniform(key, (b,), jnp.float32)
  block = min(_CDF_BLOCK, v)
  nb = -(-v // block)
  w = jnp.pad(weights, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)  # [B, nb, block]
  block_sum = jnp.sum(w, axis=-1)  # [B, nb]
  cum = jnp.cumsum(block_sum, axis=-1)
  target = u * cum[:, -1]
  blk = _first_crossing(cum, block_sum, target)  # [B]
  inside = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [B, block]
  before = jnp.take_along_axis(cum - block_sum, blk[:, None], axis=1)[:, 0]
  j = _first_crossing(jnp.cumsum(inside, axis=-1), inside, target - before)
  return blk * block + j


def _bisect_threshold(e: Array, target: Array) -> Array:
  """Largest t with sum(e[e >= t]) >= target, per row; e [B, V] in [0, 1], target [B] -> t [B].

  Bisection over the bit patterns of non-negative float32 (ordered like the integers), so the
  result is exactly one of the values of e. 31 passes over e."""
  lo = jnp.zeros(e.shape[:1], jnp.int32)  # t = 0 keeps everything: always enough mass
  hi = jnp.full(e.shape[:1], _F32_ONE_BITS + 1, jnp.int32)  # t > 1 keeps nothing

  def body(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    t = jax.lax.bitcast_convert_type(mid, jnp.float32)
    ok = jnp.sum(jnp.where(e >= t[:, None], e, 0.0), axis=-1) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))  # 2**31 > _F32_ONE_BITS + 1
  return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _top_p_threshold(e: Array, top_p: Array) -> Array:
  """Threshold t [B] such that {e >= t} is the smallest top set holding top_p of the mass.

  e [B, V] in [0, 1]. Fast path: when the nucleus of every row lies within its
  `_TOP_P_CANDIDATES` largest values (the usual case for a trained model), read t off their
  sorted cumulative sum; otherwise bisect over the whole vocabulary."""
  target = top_p * jnp.sum(e, axis=-1)  # [B]
  k = min(_TOP_P_CANDIDATES, e.shape[-1])
  vals, _ = jax.lax.top_k(e, k)  # [B, k] descending
  cum = jnp.cumsum(vals, axis=-1)
  inside = cum >= target[:, None]
  j = jnp.minimum(jnp.sum(~inside, axis=-1), k - 1)  # first j whose prefix reaches the target
  fast = jnp.take_along_axis(vals, j[:, None], axis=-1)[:, 0]
  return jax.lax.cond(jnp.all(inside[:, -1]), lambda: fast, lambda: _bisect_threshold(e, target))


def _sample_step(
    logits: Array,
    key: Array,
    temperature: Array,
    top_p: Array,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    kernels: str = "portable",
) -> tuple[Array, Array]:
  """logits [B, V] float32 -> (token ids [B] int32, log-probs [B] float32). kernels "cpu" takes
  `cpu_paths.plain_step` for greedy and plain temperature sampling (same values)."""
  logits = logits.astype(jnp.float32)
  top_k = 0 if top_k >= logits.shape[-1] else top_k  # k >= vocab keeps everything
  if kernels == "cpu" and (greedy or not (top_k or use_top_p)):
    return cpu_paths.plain_step(logits.T, key, temperature, greedy=greedy)
  if greedy:  # the first maximum; its log-prob under log_softmax(raw logits)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    return tok, lp
  if top_k:  # work on the k best candidates only: [B, k], sorted descending
    vals, cand = jax.lax.top_k(logits, top_k)
    scaled = vals / temperature
    if use_top_p:
      probs = jax.nn.softmax(scaled, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      scaled = jnp.where(mass_before < top_p, scaled, -jnp.inf)  # the first is always kept
    e = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # (slicing [:, :1] would make
    # XLA CPU lower top_k as a full sort of the vocabulary instead of its TopK kernel)
    j = _inverse_cdf(key, e)
    tok = jnp.take_along_axis(cand, j[:, None], axis=-1)[:, 0].astype(jnp.int32)
    lp = jnp.take_along_axis(scaled, j[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)
    return tok, lp
  scaled = logits / temperature
  shifted = scaled - jnp.max(scaled, axis=-1, keepdims=True)
  e = jnp.exp(shifted)  # [B, V] in [0, 1], max exactly 1
  if use_top_p:
    e = jnp.where(e >= _top_p_threshold(e, top_p)[:, None], e, 0.0)
  tok = _inverse_cdf(key, e)
  lp = jnp.take_along_axis(shifted, tok[:, None], axis=-1)[:, 0] - jnp.log(jnp.sum(e, axis=-1))
  return tok, lp


def sample_logits(logits: Array, key: Array, *, temperature=1.0, top_k: int = 0, top_p=1.0) -> tuple[Array, Array]:
  """Sample one token per row from logits [B, V] -> (ids [B] int32, log-probs [B] float32).

  temperature 0 (a Python number) is greedy. top_k 0 and top_p 1.0 (Python numbers) are off;
  temperature and top_p may also be traced scalars. Pure: usable inside jit."""
  greedy = isinstance(temperature, (int, float)) and temperature == 0
  use_top_p = not (isinstance(top_p, (int, float)) and top_p >= 1.0)
  return _sample_step(
      logits,
      key,
      jnp.asarray(1.0 if greedy else temperature, jnp.float32),
      jnp.asarray(top_p, jnp.float32),
      greedy=greedy,
      top_k=int(top_k),
      use_top_p=use_top_p,
  )


# ---- the rollout copy of the policy --------------------------------------------------------------
# Decoding layout: heads, KV heads, MLP and vocabulary over "tensor" as in training, but nothing
# over "fsdp" (the `embed` dimension whole on every device), so a decode step reads its weights
# where they are instead of all-gathering them from the FSDP shards every token.
DECODE_RULES = tuple((name, () if name == "embed" else axes) for name, axes in DEFAULT_RULES)
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


class RolloutPolicy(NamedTuple):
  """The weights the sampler decodes with: `state` (a pure dict like `nnx.state(model,
  nnx.Param).to_pure_dict()`) in the rollout dtype and the decoding layout, and the `graphdef`
  of a `Qwen2` whose compute and parameter dtype are that dtype (so nothing is cast per token)."""

  graphdef: Any
  state: Any


@functools.lru_cache(maxsize=None)
def _rollout_graphdef(model_cfg, dtype: str):
  return nnx.graphdef(abstract_model(model_cfg.replace(dtype=dtype, param_dtype=dtype)))


def decode_shardings(state: nnx.State, mesh: Mesh) -> dict:
  """NamedShardings of the decoding layout (`DECODE_RULES`) as a pure dict, for an `nnx.State`
  of the model's Params (arrays or ShapeDtypeStructs, e.g. `nnx.state(abstract_model(cfg),
  nnx.Param)`); the logical axis names come from the parameters' metadata."""
  with axis_rules(DECODE_RULES):
    return pure_shardings(state, mesh)


def _cast(params, dtype: str):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@functools.lru_cache(maxsize=None)
def _reshard_fn(dtype: str, treedef, shardings: tuple | None):
  """The jitted cast + reshard, one per (dtype, layout): built once, not per step."""
  out = None if shardings is None else jax.tree.unflatten(treedef, shardings)
  return jax.jit(functools.partial(_cast, dtype=dtype), out_shardings=out)


def make_rollout_policy(graphdef, params, *, dtype: str | None = None, mesh: Mesh | None = None) -> RolloutPolicy:
  """The rollout copy of the policy: `params` (a pure dict, e.g. the train state's, any layout)
  cast to `dtype` (default: the model's compute dtype) and laid out for decoding on `mesh` by one
  jitted call, once per step. Without a mesh and with nothing to cast, `params` is used as is."""
  model = nnx.merge(graphdef, params)  # Python objects around the same device arrays: no copy
  cfg = model.cfg
  dtype = cfg.dtype if dtype is None else dtype
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  state = nnx.state(model, nnx.Param)
  pure = state.to_pure_dict()
  rgraphdef = _rollout_graphdef(cfg, dtype)
  same = all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(pure))
  if (
      mesh is None
      and same
      and all(
          not isinstance(getattr(x, "sharding", None), NamedSharding) or x.sharding.mesh.size == 1
          for x in jax.tree.leaves(pure)
      )
  ):
    return RolloutPolicy(rgraphdef, pure)
  shardings = None if mesh is None else decode_shardings(state, mesh)
  leaves, treedef = jax.tree.flatten(shardings)
  fn = _reshard_fn(dtype, treedef, None if shardings is None else tuple(leaves))
  return RolloutPolicy(rgraphdef, fn(pure))


def as_rollout_policy(model, *, dtype: str | None = None, mesh: Mesh | None = None) -> RolloutPolicy:
  """A `Qwen2` -> its rollout copy (`make_rollout_policy`) on `mesh` (else the mesh set by
  `jax.set_mesh` or the one its parameters live on); a `RolloutPolicy` is returned as is. For a
  caller that samples the same weights many times (an evaluation's batches): the copy is made once,
  where `generate(model, ...)` makes one per call."""
  if isinstance(model, RolloutPolicy):
    return model
  graphdef, state = nnx.split(model)
  mesh = mesh if mesh is not None else _find_mesh(state)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    return make_rollout_policy(graphdef, state, dtype=dtype, mesh=mesh)


def abstract_rollout_policy(model_cfg, *, dtype: str, mesh: Mesh | None = None) -> RolloutPolicy:
  """A RolloutPolicy of `jax.ShapeDtypeStruct`s (in `dtype`, carrying the decoding layout's
  shardings on `mesh`) for a `Qwen2Config`: what `lower_generate` needs to compile the sampler
  for a mesh whose devices are absent (e.g. a TPU topology's)."""
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  params = nnx.state(abstract_model(model_cfg), nnx.Param)
  shardings = None if mesh is None else decode_shardings(params, mesh)
  pure = params.to_pure_dict()
  structs = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s
      ),
      pure,
      shardings if shardings is not None else jax.tree.map(lambda _: None, pure),
  )
  return RolloutPolicy(_rollout_graphdef(model_cfg, dtype), structs)


# ---- the generator ------------------------------------------------------------------------------
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


# ---- host entry point ---------------------------------------------------------------------------
def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"generate: {name} must be an int >= {minimum}, got {value!r}")
  return int(value)


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


def _find_mesh(state) -> jax.sharding.Mesh | None:
  """The mesh set by `jax.set_mesh`, else the one the parameters are sharded over, else None."""
  mesh = jax.sharding.get_mesh()
  if not mesh.empty:
    return mesh
  for leaf in jax.tree.leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


# ---- the memory plan ----------------------------------------------------------------------------
_AUTO_HEADROOM = 0.8  # share of the free device memory the decode batch may plan for
_LOGIT_COPIES = 8  # float32 [V] vectors per row planned for the head's output and the sampler


def decode_row_bytes(cfg, cache_len: int, mesh: Mesh | None, dtype: str) -> int:
  """Device bytes one decoded row needs on each device: its KV cache (2 x layers x KV heads x
  cache_len x head_dim in `dtype`, KV heads split over "tensor" when it divides them) plus
  `_LOGIT_COPIES` float32 vectors of the vocabulary (split likewise) for the logits and the
  sampler's temporaries."""
  t = 1 if mesh is None else mesh.shape["tensor"]
  kv = cfg.num_key_value_heads // t if cfg.num_key_value_heads % t == 0 else cfg.num_key_value_heads
  vocab = cfg.vocab_size // t if cfg.vocab_size % t == 0 else cfg.vocab_size
  cache = 2 * cfg.num_hidden_layers * kv * cache_len * cfg.head_dim * jnp.dtype(dtype).itemsize
  return cache + _LOGIT_COPIES * vocab * 4


def auto_decode_batch_size(n_rows: int, rows_per_shard: int, row_bytes: int, free_bytes: int | None) -> int:
  """The largest divisor d of n_rows whose sub-batch (ceil(d / rows_per_shard) rows on each
  device, `row_bytes` each) fits in `_AUTO_HEADROOM` of `free_bytes`; all rows when the backend
  reports no memory statistics (free_bytes None, e.g. CPU)."""
  if free_bytes is None:
    return n_rows
  budget = _AUTO_HEADROOM * free_bytes
  for d in sorted((d for d in range(1, n_rows + 1) if n_rows % d == 0), reverse=True):
    if -(-d // rows_per_shard) * row_bytes <= budget:
      return d
  raise ValueError(
      f"decode_batch_size=auto: not even one row per device fits: it needs "
      f"{row_bytes / 2**20:.1f} MiB and {free_bytes / 2**20:.1f} MiB are free"
  )


def free_device_bytes(devices) -> int | None:
  """The least free memory (bytes_limit - bytes_in_use) over `devices`; None without stats."""
  free = []
  for d in devices:
    stats = d.memory_stats() if d.process_index == jax.process_index() else None
    if stats and "bytes_limit" in stats:
      free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else None


def resolve_decode_batch_size(
    decode_batch_size, n_rows: int, *, cfg, cache_len: int, mesh: Mesh | None, dtype: str
) -> int:
  """None: all rows; "auto": `auto_decode_batch_size` from the free memory of the mesh's
  devices (all rows on CPU); an int must divide n_rows. Raises ValueError before compiling."""
  if decode_batch_size is None:
    return n_rows
  rps = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
  if decode_batch_size == "auto":
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    free = free_device_bytes(devices)
    if free is not None and jax.process_count() > 1:  # every host must compile the same program
      from jax.experimental import multihost_utils

      free = int(np.min(multihost_utils.process_allgather(np.int64(free))))
    return auto_decode_batch_size(n_rows, rps, decode_row_bytes(cfg, cache_len, mesh, dtype), free)
  size = _check_int("decode_batch_size", decode_batch_size, 1)
  if n_rows % size:
    raise ValueError(f"generate: decode_batch_size {size} does not divide the {n_rows} rows " "(prompts x num_samples)")
  return size


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
):
  """Generate completions for left-padded prompts [B, P] with a `Qwen2` model or a
  `RolloutPolicy` (`make_rollout_policy`, used as is).

  Each prompt is repeated `num_samples` (G) times consecutively: rows g*G .. g*G+G-1 are prompt g.
  Returns (completion_ids [B*G, max_new_tokens] int32, completion_mask int32 (EOS included),
  logprobs float32 (0 where the mask is 0)), logprobs left out with return_logprobs=False, plus
  the raw logits [B*G, max_new_tokens, V] with return_logits. eos_token_ids None means Qwen's
  (151645, 151643); () disables EOS stopping. rng (a jax PRNG key) is required unless
  temperature == 0 (greedy). With `mesh` (else the one set by `jax.set_mesh`, else the one the
  parameters live on) rows are sharded over ("data", "fsdp"), the batch padded up to a multiple
  of that and cut back, and a model's weights are first copied into the decoding layout
  (`DECODE_RULES`) in `rollout_dtype` (default: the model's compute dtype). decode_batch_size
  (an int dividing B*G, "auto" to size it from free device memory, None for all rows) decodes
  the rows in sub-batches, one KV cache at a time (see `_generate_impl`)."""
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
  ids, mask = np.repeat(ids, g, axis=0), np.repeat(mask, g, axis=0)
  n_rows = ids.shape[0]
  p_bucket = bucket_length(ids.shape[1], buckets)
  n_bucket = bucket_length(n_new, buckets)
  sub = resolve_decode_batch_size(
      decode_batch_size, n_rows, cfg=cfg, cache_len=p_bucket + n_bucket, mesh=mesh, dtype=rollout_dtype or cfg.dtype
  )
  sub_batches = n_rows // sub
  per_sub = -(-sub // rows_per_shard) * rows_per_shard  # batch padding rows have an all-0 mask:
  widths = ((0, sub_batches * per_sub - n_rows), (p_bucket - ids.shape[1], 0))  # they emit nothing
  ids = np.pad(ids, widths, constant_values=pad_id)
  mask = np.pad(mask, widths)

  static = dict(
      graphdef=graphdef,
      max_len=n_bucket,
      greedy=greedy,
      top_k=min(top_k, cfg.vocab_size),
      use_top_p=bool(top_p < 1.0),
      return_logits=bool(return_logits),
      return_logprobs=bool(return_logprobs),
      sub_batches=sub_batches,
  )
  scalars = (
      np.int32(n_new),
      np.float32(1.0 if greedy else temperature),
      np.float32(top_p),
      _eos_array(eos),
      np.int32(pad_id),
  )
  ctx = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  with ctx:
    graphdef, state = as_rollout_policy(model, dtype=rollout_dtype, mesh=mesh)  # as is if one already
    static["graphdef"] = graphdef
    if mesh is not None:
      ids = put_global(ids, batch_sharding(mesh))
      mask = put_global(mask, batch_sharding(mesh))
      rng = jax.random.wrap_key_data(
          put_global(jax.random.key_data(rng), replicated(mesh)), impl=jax.random.key_impl(rng)
      )
      scalars = tuple(put_global(x, replicated(mesh)) for x in scalars)  # one cache entry per mesh
    out = _generate_jit(state, ids, mask, rng, *scalars, **static)
  return tuple(x[:n_rows, :n_new] for x in out)


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
) -> jax.stages.Lowered:
  """The sampler's program lowered for abstract inputs, without running it (e.g. for absent
  accelerators: `.compile()` it, then read `memory_analysis()` / `cost_analysis()`).

  policy: a RolloutPolicy whose state may hold `jax.ShapeDtypeStruct`s carrying shardings
  (e.g. `decode_shardings` over a topology's mesh); batch rows (prompts x samples, a multiple
  of the mesh's data x fsdp times the number of sub-batches); prompt_len and max_new_tokens the
  bucketed widths. Temperature, top_p, EOS ids and the number of new tokens stay runtime inputs
  (traced), as in `generate`."""
  sub = batch if decode_batch_size is None else decode_batch_size
  if batch % sub:
    raise ValueError(f"lower_generate: decode_batch_size {sub} does not divide batch {batch}")
  rows = None if mesh is None else batch_sharding(mesh)
  repl = None if mesh is None else replicated(mesh)
  sds = lambda shape, dtype, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
  args = (
      policy.state,
      sds((batch, prompt_len), jnp.int32, rows),
      sds((batch, prompt_len), jnp.int32, rows),
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
      sub_batches=batch // sub,
  )
  ctx = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  with ctx:
    return _generate_jit.lower(*args, **static)


__all__ = [
    "generate",
    "sample_fn",
    "sample_logits",
    "bucket_length",
    "make_rollout_policy",
    "as_rollout_policy",
    "RolloutPolicy",
    "decode_shardings",
    "lower_generate",
    "QWEN_EOS_IDS",
    "QWEN_PAD_ID",
]
