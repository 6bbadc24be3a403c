"""The per-response token masks of the selection methods (jit-able, arrays only): ICT's top
fraction by score, 20-Entropy's top fraction by entropy, STAPO's spurious-token filter, and the
exact integer counts they share.

Counts "ceil(fraction * n)" are computed in exact integer arithmetic with the fraction taken
as the nearest rational of denominator <= 10_000 (exact for up to 4 decimals), so
ceil(0.1 * 30) is 3, not the 4 that float rounding would give. The top-k is a bitwise
search over sortable keys, not a sort (XLA:TPU compiles sorts slowly), row-wise only, so rows
sharded over a mesh stay where they are.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

_MAX_DENOMINATOR = 10_000
KEEPS: dict[str, str] = {
    "unique": "keep the highest-scoring tokens of each response (ICT)",
    "frequent": "keep the lowest-scoring tokens of each response (the paper's 90%-frequent)",
}


def _rational(value: float, what: str, low_open: bool = True) -> tuple[int, int]:
  if not isinstance(value, (int, float)) or not ((0.0 < value if low_open else 0.0 <= value) and value <= 1.0):
    bound = "(0, 1]" if low_open else "[0, 1]"
    raise ValueError(f"selection: {what}={value!r}; expected a Python float in {bound}")
  frac = Fraction(str(float(value))).limit_denominator(_MAX_DENOMINATOR)
  return frac.numerator, frac.denominator


def _ceil_times(count: jax.Array, fraction: float, what: str) -> jax.Array:
  """ceil(fraction * count) in int32 without overflow (count < 2**31)."""
  num, den = _rational(fraction, what)
  count = count.astype(jnp.int32)
  q, r = count // den, count % den
  return q * num + (r * num + den - 1) // den


def _sortable_bits(x: jax.Array) -> jax.Array:
  """float32 [...] -> uint32 [...] in the order of ``jnp.sort``: -0.0 = 0.0 = subnormals (XLA
  flushes them to zero), every NaN last."""
  x = jnp.where(jnp.abs(x) < jnp.finfo(jnp.float32).tiny, 0.0, jnp.where(jnp.isnan(x), jnp.nan, x))
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  i = i ^ ((i >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude -> smaller int
  return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)  # signed -> unsigned order


def _top_k_rows(score: jax.Array, valid: jax.Array, k: jax.Array) -> jax.Array:
  """Per row keep the k highest-scoring valid positions; ties -> lower position first.

  The k-th smallest sort key t of each row is found bit by bit (32 steps of a compare and a
  row count, `lax.fori_loop`); the row keeps the keys below t and, of those equal to t, the
  first k - #below by position: exactly the first k of a stable argsort, without sorting
  (XLA:TPU compiles a sort slowly) and with row-wise ops only, so rows sharded over a mesh
  stay where they are. score, valid: [R, L]; k: [R] int."""
  key = _sortable_bits(jnp.where(valid, -score.astype(jnp.float32), jnp.inf))  # [R, L]
  k = k.astype(jnp.int32)[:, None]  # [R, 1]

  def bit(i, t):  # t [R, 1]: the smallest v with #(key <= v) >= k agrees with t above bit 31-i
    b = jnp.uint32(1) << (31 - i).astype(jnp.uint32)
    below = jnp.sum(key <= (t | (b - 1)), axis=-1, keepdims=True, dtype=jnp.int32)
    return jnp.where(below < k, t | b, t)

  t = jax.lax.fori_loop(0, 32, bit, jnp.zeros(k.shape, jnp.uint32))
  less = key < t
  tied = key == t
  room = k - jnp.sum(less, axis=-1, keepdims=True, dtype=jnp.int32)
  return valid & (less | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= room)))


def ict_mask(u: jax.Array, mask: jax.Array, top_fraction: float = 0.1, keep: str = "unique") -> jax.Array:
  """ICT: per response keep k_i = max(1, ceil(top_fraction * len_i)) positions by u: the
  highest ("unique", ICT) or the lowest ("frequent", the paper's 90%-frequent ablation).

  u, mask: [N, T]; len_i = sum_t mask[i, t]. Rows with len_i = 0 get no token; ties go to
  the lower position. Returns bool [N, T].
  """
  if keep not in KEEPS:
    raise ValueError(f"selection: unknown keep={keep!r}; expected one of {sorted(KEEPS)}")
  valid = mask.astype(bool)
  length = valid.sum(axis=1)
  k = jnp.maximum(1, _ceil_times(length, top_fraction, "ict top_fraction"))
  return _top_k_rows(u if keep == "unique" else -u.astype(jnp.float32), valid, k)


def entropy_mask(entropy: jax.Array, mask: jax.Array, top_fraction: float = 0.2) -> jax.Array:
  """20-Entropy: keep the top ceil(top_fraction * valid tokens) of the whole batch by entropy.

  entropy, mask: [B, T]; returns bool [B, T]. Exactly that many tokens are kept; ties go
  to the lower flat index (row-major), so the result is deterministic.

  Reference behaviour: the official "Beyond the 80/20 Rule" verl code
  (``get_global_entropy_top_mask`` in verl/trainer/ppo/core_algos.py) also takes a global
  top-k, with k = max(1, int(n * top_ratio + 0.9999)) and torch.topk's unspecified tie
  order, over each micro-batch; its loss is the token mean over response_mask * mask
  (our "bnpo" over M), while its KL loss, if enabled, stays on all response tokens. TRL's
  ``top_entropy_quantile`` instead thresholds at torch.quantile(entropies, 1 - fraction)
  and keeps entropy >= threshold, which can keep one token more or fewer and every token
  tied at the threshold. Here the count is an exact ceil and the batch is whatever the
  caller passes (the train step passes the whole step's batch).
  """
  valid = mask.astype(bool).reshape(1, -1)
  k = _ceil_times(valid.sum(axis=1), top_fraction, "entropy top_fraction")
  return _top_k_rows(entropy.reshape(1, -1), valid, k).reshape(mask.shape)


def masked_quantile(x: jax.Array, mask: jax.Array, q: float) -> jax.Array:
  """q-quantile of x over mask == 1, linear interpolation (numpy.quantile's default).

  q is a static float in [0, 1]; the position q*(n-1) is computed exactly as a rational.
  Returns 0 when no entry is valid.
  """
  num, den = _rational(q, "quantile", low_open=False)
  flat_valid = mask.astype(bool).reshape(-1)
  s = jnp.sort(jnp.where(flat_valid, x.reshape(-1).astype(jnp.float32), jnp.inf))
  last = jnp.maximum(flat_valid.sum().astype(jnp.int32) - 1, 0)  # n - 1
  a, b = last // den, last % den
  lo = a * num + (b * num) // den  # floor(q * (n-1))
  frac = ((b * num) % den).astype(jnp.float32) / den
  hi = jnp.minimum(lo + 1, last)
  v_lo, v_hi = s[lo], s[hi]
  value = jnp.where(frac > 0, v_lo + frac * (v_hi - v_lo), v_lo)
  return jnp.where(flat_valid.any(), value, 0.0)


def stapo_mask(
    token_prob: jax.Array,
    entropy: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    tau_p: float = 0.002,
    tau_h_quantile: float = 0.8,
) -> jax.Array:
  """STAPO: drop spurious tokens, keep = mask & ~(A > 0 & prob < tau_p & H < tau_h).

  token_prob, entropy, mask: [B, T]; advantages: [B]; tau_h is the tau_h_quantile quantile
  of entropy over the valid tokens of the batch (linear interpolation). Returns bool [B, T].
  """
  valid = mask.astype(bool)
  tau_h = masked_quantile(entropy, valid, tau_h_quantile)
  spurious = (advantages[:, None] > 0) & (token_prob < tau_p) & (entropy < tau_h)
  return valid & ~spurious
