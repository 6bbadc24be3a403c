"""The XLA:CPU formulations of the hot kernels, behind one switch.

`Qwen2Config.kernels` (from the run config's `model.kernels`: auto | portable | cpu) names the
set of kernels the model, the sampler and the token statistics use:

  "portable"  what runs on TPU and GPU and on any multi-device mesh, and what the reference tests
              check on every mesh: the decode head is the plain einsum giving logits [B, V];
              greedy is `jnp.argmax` and the log-prob `log_softmax`; sampling draws by inverse
              CDF over [B, V]; the ICT statistics are one fused pass over an [N, C, V] chunk.
  "cpu"       the formulations below, tuned for XLA:CPU on one device (2 cores,
              benchmarks/RESULTS.md). They compute the same values as the portable path
              (`tests/test_cpu_paths.py` checks each against it; a sampled token follows the
              same distribution, not the same draw).

"auto" is resolved once, at set-up (`setup.resolve_kernels`), from the devices the run uses:
"cpu" for a single CPU device, "portable" for anything else. Nothing inside the model, the
sampler or the selection looks at the backend; they read the resolved name from the config.

This module imports nothing else of ict_jax (selection, sampling and the model all use it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array
KERNELS = ("portable", "cpu")  # Qwen2Config.kernels; the run config adds "auto"

# Row-blocked ICT statistics. One [N, C, V] pass makes XLA:CPU run large 3-D reductions and
# materialize shared [N, C, V] intermediates; the same statistics as 2-D reductions over
# [<= ROW_BLOCK positions, V] slices of one response (contiguous, cache-sized) measured
# 1.5-2.3x faster on 2 cores (benchmarks/RESULTS.md). Accelerators fuse the whole chunk, and on a
# multi-device mesh per-row slices of a batch-sharded array would gather it.
ROW_BLOCK = 16
# ... when the vocabulary is large. The slices are unrolled (N x C / ROW_BLOCK of them, each a
# handful of fusions), so over a small vocabulary, where the whole [N, C, V] chunk is cache-sized
# anyway, they only cost compile time: the default run's step (128 rows x 20 positions x V 128)
# had ~2,300 fusions and compiled in 42 s on 2 cores (benchmarks/RESULTS.md).
BLOCKED_MIN_VOCAB = 4096
_TINY = 1e-37  # floor inside log(): 0 * log(floor) = 0 where the exact value is 0 log 0
_LOG_FLOOR = -1e30  # floor of log p: -inf logits (masked vocabulary) give p * log p = 0
_LOG2 = math.log(2.0)
_GROUPS = 128  # vocabulary groups of the two-level greedy / plain-sampling reductions


# ---- the decode head ----------------------------------------------------------------------------
def head_logits(h: Array, w: Array, vocab_major: bool) -> Array:
  """h [B, D] (after the final norm, one position per row), w the LM head as stored ([V, D] when
  vocab_major, else [D, V]) -> float32 logits laid out [V, B].

  Vocabulary-major, so the sampler's reductions over the vocabulary (`plain_step`) stream
  through memory. For a tied head with few rows and a narrow hidden size the head is a
  multiply-and-reduce over D: XLA:CPU's GEMM was 1.1-1.35x slower than the loop, which streams
  the [V, D] table once with the rows in cache (V 151936, 2 cores: D 128-256 with B 8-16; at
  D 64 or 512, or B 32, the GEMM was as fast or faster). Same float32 accuracy."""
  b, d = h.shape
  if vocab_major and b <= 16 and 128 <= d <= 256:
    f32 = jnp.float32
    return jnp.sum(w[:, None, :].astype(f32) * h.astype(f32)[None], axis=-1)
  return jnp.einsum(
      "BD,VD->VB" if vocab_major else "BD,DV->VB", h, w.astype(h.dtype), preferred_element_type=jnp.float32
  )


# ---- greedy and plain temperature sampling -------------------------------------------------------
def _first_crossing(cum: Array, weights: Array, target: Array) -> Array:
  """Index of the entry whose cumulative interval holds `target`: cum, weights [B, n]; target [B]
  (zero-weight entries are never chosen)."""
  n = weights.shape[-1]
  count = jnp.sum(cum <= target[:, None], axis=-1)
  last_nonzero = n - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
  return jnp.minimum(count, last_nonzero).astype(jnp.int32)


def first_argmax(x: Array) -> Array:
  """jnp.argmax(x, -1) for [B, V] (first maximum; first NaN if any) as two plain reductions:
  XLA:CPU lowers argmax to a variadic (value, index) reduce that ran ~9x slower over a
  151936-token vocabulary (5.6 vs 0.65 ms per [8, V] call on one core)."""
  m = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one
  hit = (x == m) | jnp.isnan(x)
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit, idx, x.shape[-1] - 1), axis=-1)


def _token_groups(v: int) -> int:
  """How many token groups the two-level reductions use for a vocabulary of v: a power of two
  <= sqrt(v), at most _GROUPS (151936 -> 128 groups of 1187 tokens)."""
  return min(_GROUPS, 1 << (math.isqrt(v).bit_length() - 1))


def plain_step(lv: Array, key: Array, temperature: Array, *, greedy: bool) -> tuple[Array, Array]:
  """Greedy or plain temperature sampling from vocabulary-major logits lv [V, B] -> (ids [B]
  int32, log-probs [B] float32), the values of the portable `sampling.rules._sample_step`.

  Two passes over lv, a maximum and a sum of exp(x - max), each in two levels whose second
  reduces only [G, B] (G = _token_groups(V)); no [B, V] probabilities, indices or cumulative
  sums are built. Greedy is the first maximum of the raw logits (the first NaN if any): the
  maximum is taken per contiguous block of V / G tokens, and the first block holding it is
  searched. Its log-prob is log_softmax(raw logits). Sampling draws from
  softmax(logits / temperature) by inverse CDF with one uniform per row over strided groups
  (group n holds tokens n, n + G, n + 2G, ...: viewed as [V / G, G, B], the sums stream
  contiguous [G, B] rows): first a group by the group sums, then a token inside it; the
  log-prob is the drawn token's under that distribution. key: one key [] for the batch, or a key a
  row [B] (row b's uniform drawn with key[b], as `sampling.rules._sample_step` takes them)."""
  v, b = lv.shape
  g = _token_groups(v)
  per = -(-v // g)  # tokens per group
  x = lv.astype(jnp.float32)
  if not greedy:
    x = x / temperature
  if per * g != v:
    x = jnp.pad(x, ((0, per * g - v), (0, 0)), constant_values=-jnp.inf)
  # The barriers keep XLA from merging two levels into one [V, B] -> [B] reduction, which
  # XLA:CPU runs several times slower than the two.
  level1 = lambda f, y, axis: jax.lax.optimization_barrier(f(y, axis=axis))
  rows = jnp.arange(b)
  groups = x.reshape(per, g, b)  # token r * G + n at [r, n]
  if greedy:  # the maximum by contiguous blocks: the first block holding it holds the first one
    blocks = x.reshape(g, per, b)
    block_max = level1(jnp.max, blocks, 1)  # [G, B]
    m = jnp.max(block_max, axis=0)
  else:
    m = jnp.max(level1(jnp.max, groups, 0), axis=0)  # [B]
  group_sum = level1(jnp.sum, jnp.exp(groups - m), 0).T  # [B, G]
  cum = jnp.cumsum(group_sum, axis=-1)
  log_z = jnp.log(cum[:, -1])
  if greedy:
    first = first_argmax(block_max.T)  # the first block holding the maximum (or a NaN)
    inside = blocks[first, :, rows]  # [B, per]
    j = first_argmax(inside)
    tok = jnp.minimum(first * per + j, v - 1)  # (v - 1: a row of -inf only)
    return tok.astype(jnp.int32), inside[rows, j] - m - log_z
  if jnp.ndim(key) == 0:
    uniform = jax.random.uniform(key, (b,), jnp.float32)
  else:
    uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
  target = uniform * cum[:, -1]
  n = _first_crossing(cum, group_sum, target)  # [B]
  before = jnp.take_along_axis(cum - group_sum, n[:, None], axis=1)[:, 0]
  col = groups[:, n, rows].T  # [B, per]: the tokens of group n
  e = jnp.exp(col - m[:, None])
  r = _first_crossing(jnp.cumsum(e, axis=-1), e, target - before)
  return (r * g + n).astype(jnp.int32), col[rows, r] - m - log_z


# ---- the ICT statistics on row blocks ------------------------------------------------------------
def use_blocked_stats(vocab: int) -> bool:
  """Whether `blocked_stats` pays over the one-pass [N, C, V] statistics (see BLOCKED_MIN_VOCAB)."""
  return vocab >= BLOCKED_MIN_VOCAB


def row_sum(x: Array) -> Array:
  """[B, V] -> [B]: sums of 32 entries as a matrix-vector product, then a reduce. XLA:CPU
  materializes the summand (one fused elementwise pass) instead of evaluating a many-input
  expression inside its reduction (4x faster here); short dot rows keep float32 accuracy."""
  k = math.gcd(x.shape[-1], 32)
  return jnp.sum(x.reshape(*x.shape[:-1], -1, k) @ jnp.ones((k,), x.dtype), axis=-1)


def _sum_without(members, i):
  """Sum of the tuples members[j], j != i, added directly (as `selection._sum_of_others`)."""
  rest = [m for j, m in enumerate(members) if j != i]
  return tuple(sum(parts[1:], parts[0]) for parts in zip(*rest))


def blocked_stats(logits, lse, valid, group_size, block=ROW_BLOCK, reference="active_mean", kl=False, seq_ref=None):
  """`selection.chunk_stats` on 2-D [B, V] slices (B <= block positions of one response).

  logits [N, C, V] float32 (temperature-scaled, no gradient), lse [N, C], valid [N, C] in the
  logits' dtype. p = valid * softmax is computed once per slice (one exp per logit) and feeds all
  four statistics; rows with valid == 0 get p = 0 and are zeroed at the end. seq_ref [N, V]: each
  row's own reference (reference "sequence_mean")."""
  n, c, _ = logits.shape
  s_w = lse - jnp.log(valid)  # exp(l - s_w) = valid * p
  if reference == "sequence_mean" and group_size is not None:
    seq_ref = seq_ref.astype(logits.dtype)
    seq_log = jnp.log(jnp.maximum(seq_ref, _TINY))  # once per row, not per block
  ent, ren, js, kls = [], [], [], []
  for a in range(0, c, block):
    b = min(a + block, c)
    lp = [jnp.maximum(logits[i, a:b] - lse[i, a:b, None], _LOG_FLOOR) for i in range(n)]
    p = [jnp.exp(logits[i, a:b] - s_w[i, a:b, None]) for i in range(n)]  # [B, V] each
    ent.append(jnp.stack([-row_sum(p[i] * lp[i]) for i in range(n)]))  # [N, B]
    ren.append(jnp.stack([row_sum(p[i] * p[i]) for i in range(n)]))
    if group_size is None:
      continue
    jsb, klb = [], []
    for q in range(0, n, group_size):
      rows = range(q, q + group_size)
      if reference == "active_mean":
        active = sum(valid[i, a:b] for i in rows)
        big = sum(p[i] for i in rows) / jnp.maximum(active, 1.0)[:, None]  # P: active rows' mean
        log_big = jnp.log(jnp.maximum(big, _TINY))
        # materialized once: XLA would otherwise recompute P from all G rows in every term
        big, log_big = jax.lax.optimization_barrier((big, log_big))
      for i in rows:
        has_ref = jnp.ones_like(valid[i, a:b])
        if reference == "sequence_mean":  # row i's own mean over its positions
          big, log_big = seq_ref[i][None], seq_log[i][None]
        if reference == "others_mean":  # leave row i out
          rest, others = _sum_without([(p[j], valid[j, a:b]) for j in rows], i - q)
          big = rest / jnp.maximum(others, 1.0)[:, None]
          log_big = jnp.log(jnp.maximum(big, _TINY))
          has_ref = (others > 0).astype(big.dtype)
        log_mid = jnp.log(jnp.maximum(0.5 * (p[i] + big), _TINY))
        jsb.append(0.5 * row_sum(p[i] * (lp[i] - log_mid) + big * (log_big - log_mid)) * has_ref)
        if kl:
          klb.append(jnp.maximum(row_sum(p[i] * (lp[i] - log_big)), 0.0) * has_ref)
    js.append(jnp.stack(jsb))
    kls.append(jnp.stack(klb) if kl else None)
  ren = jnp.concatenate(ren, 1)
  out = {
      "entropy": jnp.concatenate(ent, 1) * valid,
      "renyi2": -jnp.log(jnp.where(valid > 0, ren, 1.0)) * valid,
  }  # ren = 0 if invalid
  if group_size is not None:
    out["js"] = jnp.clip(jnp.concatenate(js, 1), 0.0, _LOG2) * valid
    if kl:
      out["kl"] = jnp.concatenate(kls, 1) * valid
  return out
