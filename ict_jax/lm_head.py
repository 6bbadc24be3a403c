"""The train step's fused, chunked LM head: log-probs of the sampled tokens, token statistics,
and a backward pass that only touches the rows that carry gradient.

Forward, chunk by chunk over the completion positions (one [N, chunk, V] float32 logits block
live at a time): logits = h @ W / T, log pi(y) = logit(y) - logsumexp, and the no-gradient
statistics of `selection.chunk_stats` (entropy, Renyi-2, ICT's JS score). Only h, W, the token
ids and the logsumexp [N, C] are kept for the backward pass.

Backward (custom VJP). With g = dLoss/dlog pi [N, C], the LM head's gradients are
  dlogits = g / T * (onehot(y) - softmax(logits)),  dh = dlogits @ W^T,  dW = h^T @ dlogits,
which vanish on every row with g == 0. ICT puts the policy gradient on the top 10% of tokens, so
~90% of the rows have g == 0: when the number of non-zero rows is at most `grad_rows`, only those
rows are gathered, and their logits, softmax and both matmuls are recomputed (the forward's logits
are never stored): ~10% of the dense backward's work. Otherwise (GRPO, ICT's dense
warm-up steps, or a capacity overflow) every row is recomputed in chunks. The choice is a
`lax.cond` on the actual count, so the result is the exact gradient either way; `grad_rows` is
only a performance hint (0 = always dense).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ict_jax import selection, token_masks
from ict_jax.models.axes import constrain

__all__ = ["logp_and_stats", "sparse_grad_rows"]


def sparse_grad_rows(method: str, top_fraction: float, entropy_top_fraction: float, rows: int, length: int) -> int:
  """Capacity of the sparse backward for `rows` responses of `length` completion positions.

  ICT keeps ceil(f * len_i) <= ceil(f * length) tokens per response, so rows * that bounds its
  selection exactly; 20-Entropy keeps ~f of all tokens (ties may exceed it: dense fallback).
  GRPO and STAPO keep (almost) every token: always dense."""
  if method == "ict":  # ceil in exact rational arithmetic, as selection's counts
    num, den = token_masks._rational(top_fraction, "ict top_fraction")
    return rows * -(-num * length // den)
  if method == "entropy":
    num, den = token_masks._rational(entropy_top_fraction, "entropy_top_fraction")
    return -(-num * rows * length // den)
  return 0


def _chunked(x, n_chunks: int, k: int):
  """[N, C, ...] -> [n_chunks, N, k, ...] (zero-padded to n_chunks * k positions)."""
  n, c = x.shape[:2]
  pad = n_chunks * k - c
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(n, n_chunks, k, *x.shape[2:]), 1, 0)


def _unchunked(x, c: int):
  """[n_chunks, N, k, ...] -> [N, C, ...]."""
  n = x.shape[1]
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(n, -1, *x.shape[3:])[:, :c]


def _split(c: int, chunk_size: int) -> tuple[int, int]:
  """C positions -> (n_chunks, k): equal chunks of k <= chunk_size (192 -> 2 x 96, not 128+64)."""
  n_chunks = max(1, -(-c // max(1, min(chunk_size, c))))
  return n_chunks, max(1, -(-c // n_chunks))


def _w(vocab_major: bool) -> str:
  """Einsum letters of the head weight: [V, D] (a tied embedding, used as stored) or [D, V]."""
  return "VD" if vocab_major else "DV"


# Vocabulary-parallel layout (a mesh): inside the head, rows are split over "data" only and the
# vocabulary over the other axes ("act_head_vocab" -> tensor, fsdp); the head weight is resharded
# once per step from its parameter layout ([D over fsdp, V over tensor]) to [D, V over
# tensor x fsdp], so no chip ever holds the whole [D, V] head, and the hidden states of the
# chunk's rows are gathered over fsdp instead (N x k x D, far smaller). Reductions over V
# (logsumexp, entropy, Renyi-2, the JS score's KL sums, the picked logit) are partial sums plus
# all-reduces of [N, k] scalars. A group's G rows sit on one chip whenever a chip's share of
# the rows (micro-batch / data) holds whole groups, so the JS group mean moves no [k, V] block.
ROW_NAMES = ("act_head_batch", None)  # [N, k] statistics and ids
LOGIT_NAMES = ("act_head_batch", None, "act_head_vocab")  # [N, k, V]
_REF_NAMES = ("act_head_batch", "act_head_vocab")  # [N, V]: the "sequence_mean" reference


def _weight_names(vocab_major: bool):
  return ("act_head_vocab", None) if vocab_major else (None, "act_head_vocab")


def _head_weight(w, dtype, vocab_major: bool):
  """The stored head cast to the compute dtype, laid out by vocabulary shards (see above)."""
  return constrain(w.astype(dtype), _weight_names(vocab_major))


def _logits(h, w, temperature: float, names, vocab_major: bool):
  h = constrain(h, names[:-1] + (None,))
  logits = jnp.einsum(f"...D,{_w(vocab_major)}->...V", h, w, preferred_element_type=jnp.float32) / temperature
  return constrain(logits, names)


def _forward(
    h,
    w,
    ids,
    mask,
    temperature,
    group_size,
    chunk_size,
    vocab_major,
    reference="active_mean",
    kl=False,
    kernels="portable",
    segments=None,
):
  n, c = ids.shape
  n_chunks, k = _split(c, chunk_size)
  xs = (_chunked(h, n_chunks, k), _chunked(ids, n_chunks, k), _chunked(mask, n_chunks, k))
  if segments is not None:  # the packed head's pieces (`packing`): the group reference per piece
    xs += (_chunked(segments, n_chunks, k),)
  seq_ref = None
  if reference == selection.SEQUENCE_REFERENCE and group_size is not None:
    # each response's mean distribution over its real positions: a first pass over the chunks
    # (the logits recomputed, one [N, k, V] block live at a time), summed into [N, V]
    def add(total, xs_c):
      h_c, _, m_c = xs_c[:3]
      logits = _logits(h_c, w, temperature, LOGIT_NAMES, vocab_major)
      p = jnp.exp(logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
      return total + jnp.einsum("nkv,nk->nv", p, constrain(m_c, ROW_NAMES)), None

    total, _ = jax.lax.scan(
        add, constrain(jnp.zeros((n, w.shape[0 if vocab_major else 1]), jnp.float32), _REF_NAMES), xs
    )
    seq_ref = constrain(total / jnp.maximum(mask.sum(axis=1), 1.0)[:, None], _REF_NAMES)

  def chunk(xs):
    h_c, ids_c, m_c = xs[:3]  # [N, k, D], [N, k], [N, k]
    seg_c = None if segments is None else constrain(xs[3], ROW_NAMES)  # [N, k]
    ids_c, m_c = constrain(ids_c, ROW_NAMES), constrain(m_c, ROW_NAMES)
    logits = _logits(h_c, w, temperature, LOGIT_NAMES, vocab_major)  # [N, k, V]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [N, k]
    logp = jnp.take_along_axis(logits, ids_c[..., None], axis=-1)[..., 0] - lse
    stats = selection.chunk_stats(
        logits, m_c, group_size, lse, reference=reference, kl=kl, kernels=kernels, seq_ref=seq_ref, segments=seg_c
    )
    return logp, lse, stats

  logp, lse, stats = jax.lax.map(chunk, xs)
  return _unchunked(logp, c), _unchunked(lse, c), jax.tree.map(lambda s: _unchunked(s, c), stats)


def _compact(nz, size: int):
  """nz bool [M] -> (idx [size], slot [M]): idx[s] = position of the s-th True (0 past the
  last, as `jnp.nonzero(nz, size=size, fill_value=0)`), slot[j] = number of Trues before j.

  A prefix sum and a binary search over it (`jnp.searchsorted`, a log2(M)-step loop), where
  `jnp.nonzero` scatters (a bincount): the same indices, no scatter for XLA:TPU to compile."""
  count = jnp.cumsum(nz, dtype=jnp.int32)  # [M]: Trues at or before j
  idx = jnp.searchsorted(count, jnp.arange(1, size + 1, dtype=jnp.int32), side="left").astype(jnp.int32)
  return jnp.where(idx < nz.shape[0], idx, 0), count - nz.astype(jnp.int32)


def _rows_backward(h, w, ids, lse, g, temperature, names, vocab_major):
  """Gradients of sum(g * log pi) over blocks: h [B, R, D], ids/lse/g [B, R] -> dh, dW.

  B blocks run one after the other (`lax.scan`, dW accumulated in float32, vocabulary-sharded
  like w)."""

  def block(dw, xs):
    h_b, ids_b, lse_b, g_b = xs
    logits = _logits(h_b, w, temperature, names, vocab_major)  # [R, V] or [N, k, V]
    p = jnp.exp(logits - lse_b[..., None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == ids_b[..., None]
    dlogits = (g_b / temperature)[..., None] * (onehot.astype(jnp.float32) - p)
    dlogits = constrain(dlogits, names).astype(h_b.dtype)
    wl = _w(vocab_major)
    dh = jnp.einsum(f"...V,{wl}->...D", dlogits, w, preferred_element_type=jnp.float32)
    dw = dw + jnp.einsum(f"...D,...V->{wl}", h_b, dlogits, preferred_element_type=jnp.float32)
    return constrain(dw, _weight_names(vocab_major)), dh.astype(h_b.dtype)

  dw0 = constrain(jnp.zeros(w.shape, jnp.float32), _weight_names(vocab_major))
  dw, dh = jax.lax.scan(block, dw0, (h, ids, lse, g))
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def _logp_and_stats(
    h, w, ids, mask, segments, temperature, group_size, chunk_size, grad_rows, vocab_major, reference, kl, kernels
):
  args = (temperature, group_size, chunk_size, grad_rows, vocab_major, reference, kl, kernels)
  return _fwd(h, w, ids, mask, segments, *args)[0]


def _fwd(
    h, w, ids, mask, segments, temperature, group_size, chunk_size, grad_rows, vocab_major, reference, kl, kernels
):
  logp, lse, stats = _forward(
      h,
      _head_weight(w, h.dtype, vocab_major),
      ids,
      mask,
      temperature,
      group_size,
      chunk_size,
      vocab_major,
      reference,
      kl,
      kernels,
      segments,
  )
  return (logp, stats), (h, w, ids, lse)


def _bwd(temperature, group_size, chunk_size, grad_rows, vocab_major, reference, kl, kernels, res, cotangents):
  del group_size, reference, kl, kernels
  h, w_stored, ids, lse = res
  w = _head_weight(w_stored, h.dtype, vocab_major)  # dW is summed in float32, returned as stored
  g = cotangents[0].astype(jnp.float32)  # [N, C]; the statistics carry no gradient
  n, c, d = h.shape
  n_chunks, k = _split(c, chunk_size)

  def dense(_):
    dh, dw = _rows_backward(
        _chunked(h, n_chunks, k),
        w,
        _chunked(ids, n_chunks, k),
        _chunked(lse, n_chunks, k),
        _chunked(g, n_chunks, k),
        temperature,
        LOGIT_NAMES,
        vocab_major,
    )
    return _unchunked(dh, c), dw

  if not 0 < grad_rows < n * c:
    dh, dw = dense(None)
  else:
    nnz = jnp.sum(g != 0)  # rows that carry gradient
    n_blocks = -(-grad_rows // (n * k))  # blocks of at most one forward chunk's rows,
    block = -(-grad_rows // n_blocks)  # as equal as possible: 160 rows -> 2 x 80, not 2 x 128
    cap = n_blocks * block

    def sparse(_):
      flat = g.reshape(-1)
      idx, slot = _compact(flat != 0, cap)  # [cap] positions (0 past nnz), [N * C] slots
      valid = jnp.arange(cap) < nnz
      take = lambda x: x.reshape(n * c, *x.shape[2:])[idx].reshape(n_blocks, block, *x.shape[2:])
      g_s = jnp.where(valid, flat[idx], 0.0).reshape(n_blocks, block)
      dh_s, dw = _rows_backward(
          take(h), w, take(ids), take(lse), g_s, temperature, ("act_head_batch", "act_head_vocab"), vocab_major
      )
      # back to [N * C, D] by a gather of each position's slot (no scatter: XLA:TPU lowers a
      # scatter into a row-sharded array to a sort of the indices and a slow-to-compile loop)
      dh = jnp.where((flat != 0)[:, None], dh_s.reshape(cap, d)[jnp.minimum(slot, cap - 1)], 0)
      return dh.astype(h.dtype).reshape(n, c, d), dw

    dh, dw = jax.lax.cond(nnz <= cap, sparse, dense, None)
  return dh, dw.astype(w_stored.dtype), None, None, None


_logp_and_stats.defvjp(_fwd, _bwd)


def logp_and_stats(
    h,
    w,
    ids,
    mask,
    *,
    temperature: float,
    group_size: int | None,
    chunk_size: int = 128,
    grad_rows: int = 0,
    vocab_major: bool = False,
    reference: str = "active_mean",
    kl: bool = False,
    kernels: str = "portable",
    segments=None,
):
  """log pi(y) [N, C] (differentiable in h and w) and no-grad stats [N, C] of `chunk_stats`.

  h [N, C, D] final hidden states at the positions that predict ids [N, C]; w the LM head as
  stored (float32 master weights), [D, V], or [V, D] with `vocab_major` (a tied embedding as
  stored: no transposed copy per step). The matmuls run in h's dtype (the compute dtype); dW is
  accumulated in float32 and returned in w's dtype, so a float32 head never sees a bf16 gradient;
  mask [N, C] the completion mask. `grad_rows`: capacity of the sparse backward (see module doc).
  `reference`, `kl`: as for `selection.chunk_stats` (ICT's ablations); `kernels`: its statistics'
  formulation ("portable" or "cpu", see `ict_jax.cpu_paths`). `segments` [N, C] int32: the
  packed head's pieces (`packing.pack_batch`): the group reference reads, in each stripe of G
  rows, only the rows of the same piece (`chunk_stats`)."""
  return _logp_and_stats(
      h,
      w,
      ids,
      mask.astype(jnp.float32),
      segments,
      float(temperature),
      group_size,
      int(chunk_size),
      int(grad_rows),
      bool(vocab_major),
      str(reference),
      bool(kl),
      str(kernels),
  )
