"""Sampling rules: one token per row from logits [B, V].

`sample_logits`: logits / temperature, then top-k (exactly k candidates, ties broken by the lower
token id), then top-p (the smallest set of most likely tokens whose mass reaches top_p, like
`transformers`' TopPLogitsWarper), then one draw by the Gumbel-max trick (`jax.random.categorical`:
the argmax of the scaled logits plus Gumbel noise, generated inside the reduction, never stored).
On a TPU decode step of Qwen2.5's 151,936 ids this accesses what greedy does: the logits written
once by the head and read twice (the draw, the normaliser); the inverse-CDF draw it replaced (block
sums of chunk sums, then the drawn block picked out) accessed 2-4 logits arrays more, counted
without VMEM staging (RESULTS, "The draw by Gumbel-max"). The returned log-prob is that of the sampled token under the distribution
actually sampled from (after temperature, top-k and top-p). `temperature=0` is greedy: argmax of
the raw logits, and the log-prob is `log_softmax(raw logits)` at that token. This is the portable
path, run on TPU/GPU and on any mesh. With the model's `kernels == "cpu"` (XLA:CPU on one device,
`ict_jax.cpu_paths`) the head is vocabulary-major [V, B] and greedy / plain temperature sampling
reduce it in two levels without building any [B, V] probabilities (`cpu_paths.plain_step`);
top-k / top-p work on [B, V] either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ict_jax import cpu_paths
from ict_jax.models.axes import constrain

Array = jax.Array

_F32_ONE_BITS = 0x3F800000
_TOP_P_CANDIDATES = 256  # top-p fast path: the nucleus usually lies within the 256 best tokens


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


def row_keys(rng: Array, row_ids: Array, i) -> Array:
  """The draw's keys of decode step i: row r (its index in `generate`'s output, row_ids [B]) draws
  with fold_in(fold_in(rng, r), i), so its tokens do not depend on the rows that share its batch
  (compaction, sub-batches) -> keys [B]."""
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(rng, r), i))(row_ids)


def _categorical(key: Array, logits: Array) -> Array:
  """`jax.random.categorical` over the last axis of logits [B, n]: one key for the whole batch
  (key []) or row b drawn with its own key[b] (key [B]: a row's draw does not depend on the other
  rows of its batch)."""
  if jnp.ndim(key) == 0:
    return jax.random.categorical(key, logits, axis=-1)
  return jax.vmap(lambda k, x: jax.random.categorical(k, x))(key, logits)


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
    vocab_split: bool = False,
) -> tuple[Array, Array]:
  """logits [B, V] float32 -> (token ids [B] int32, log-probs [B] float32). key: one key [] for
  the batch, or a key a row [B] (the decode loop's: row b's token depends on key[b] and its logits
  only). kernels "cpu" takes `cpu_paths.plain_step` for greedy and plain temperature sampling
  (same values). vocab_split (the tensor decode layout, `Qwen2Config.decode_weights`): the logits
  stay split over every chip by vocabulary, every row on every chip, and the reductions over the
  vocabulary (the max, the Gumbel-max draw, the normaliser) are computed on each chip's ids and
  combined across chips (all-reduces of [B] values): left to itself XLA moved the [B, V] logits to
  the rows' chips."""
  if vocab_split:
    tok, lp = _sample_step(
        constrain(logits, (None, "act_split")),
        key,
        temperature,
        top_p,
        greedy=greedy,
        top_k=top_k,
        use_top_p=use_top_p,
        kernels=kernels,
    )
    return constrain(tok, (None,)), constrain(lp, (None,))
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
    j = _categorical(key, scaled)
    tok = jnp.take_along_axis(cand, j[:, None], axis=-1)[:, 0].astype(jnp.int32)
    lp = jnp.take_along_axis(scaled, j[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)
    return tok, lp
  scaled = logits / temperature
  top = jnp.max(scaled, axis=-1)
  if use_top_p:  # tokens outside the nucleus: weight 0
    e = jnp.exp(scaled - top[:, None])  # [B, V] in [0, 1], max exactly 1
    scaled = jnp.where(e >= _top_p_threshold(e, top_p)[:, None], scaled, -jnp.inf)
  # Gumbel-max (`jax.random.categorical`): one pass over the logits with the noise fused into the
  # argmax; the normaliser `total` is the second
  tok = _categorical(key, scaled).astype(jnp.int32)
  total = jnp.sum(jnp.exp(scaled - top[:, None]), axis=-1)
  lp = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0] - top - jnp.log(total)
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
