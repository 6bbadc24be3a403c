"""Causal self-attention over a padded batch without the cache, by a chosen implementation.

The train step, scoring and the warm start attend the T tokens of a row to themselves; there the
[B, K, G, T, T] float32 scores of the plain einsum dominate the step's temporaries. Each function
here takes q [B, T, N, H] (rotary applied, unscaled), k and v [B, T, K, H] (GQA: N = K * G) and
`segment_ids` [B, T] (1 token, 0 padding: the attention mask), and returns [B, T, N, H]:

  "einsum"       the reference (also `Attention`'s cache path): scores materialised; CPU default.
  "dot_product"  `jax.nn.dot_product_attention(implementation="xla")`: the portable fused op.
  "cudnn"        cuDNN flash attention on NVIDIA GPUs (`jax.nn.dot_product_attention(
                 implementation="cudnn")`). cuDNN takes no [B, 1, 1, S] key mask (a bias must be
                 [.., T, S]) and reads padding as sequence lengths, i.e. right padding only: each
                 row is rotated so its real tokens start at 0 (`seq_lengths_attention`), attended
                 with PADDING_CAUSAL and rotated back. Packed rows go to cuDNN's sequence packing
                 (`packed_cudnn_attention`: each sequence's run as ragged offsets and lengths;
                 Hopper or later). It computes in float16/bfloat16 only; float32 inputs (a
                 rollout or eval dtype override) take XLA's implementation of the same masks.
  "splash"       the Pallas TPU splash-attention kernel (flash, blockwise; causal mask blocks are
                 skipped), run per shard under `shard_map` when a mesh is set.

Real tokens attend causally to the real tokens of their row in every implementation. Padding
query rows (never read by a loss) differ: "splash" lets padding attend to padding (segment ids,
so no row is empty), "cudnn" gives them zeros, the others a uniform or arbitrary finite mix.
"cudnn" needs the real tokens of a row to be one run (left-padded prompt, right-padded
completion: what the train step, scoring, the warm start and the sampler's prefill pass).
Packed rows (`PackedSegments`: several sequences a row, ids 1, 2, .. per sequence, 0 padding;
the train step's `train.token_budget`) attend within their own sequence: "einsum" and
"dot_product" by a block mask, "splash" by its segment ids, "cudnn" by the runs' offsets and
lengths (a sequence's tokens are one run of its row, as `ict_jax.packing` lays them out).
Choosing one is the caller's business (`setup.model_config` resolves "auto" from the mesh's
devices); nothing here looks at the backend.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ict_jax.models.axes import constrain, logical_to_spec

Array = jax.Array
from ict_jax.models.config import ATTENTION as IMPLEMENTATIONS

CUDNN_PACKING_CAPABILITY = (9, 0)  # cuDNN's sequence packing: Hopper or later (JAX checks it when tracing)


def compute_capability(text: str) -> tuple[int, ...]:
  """A CUDA compute capability as JAX's devices and cuDNN checks spell it ("9.0") -> (9, 0)."""
  return tuple(int(x) for x in text.split("."))


class PackedSegments(NamedTuple):
  """Segment ids [B, T] of packed rows: token t of row b belongs to sequence ids[b, t] (1, 2, ..
  within the row, 0 padding) and attends causally to the earlier tokens of that sequence only.
  `max_segments` (static): at most that many sequences in a row (cuDNN sizes its ragged offsets
  and its softmax statistics [B x max_segments, N, T] by it); None: T."""

  ids: Array
  max_segments: int | None = None


SPLASH_BLOCKS = (512, 256, 128)  # splash tile along T (queries and keys): the largest dividing T
SPLASH_LANES = 128  # T is padded up to a multiple of this (the TPU lane width)


def _allowed(segment_ids, packed: bool) -> Array:
  """[B, T, S] bool: causal, keys real, and (packed rows) of the query's own sequence."""
  pos = jnp.arange(segment_ids.shape[1])
  allowed = (pos[None, :] <= pos[:, None])[None] & (segment_ids[:, None, :] > 0)
  if packed:
    allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return allowed


def einsum_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, packed: bool = False) -> Array:
  """The reference: scores [B, K, G, T, S] in float32, additive mask, softmax, weighted sum."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k).astype(jnp.float32) * h**-0.5
  allowed = _allowed(segment_ids, packed)  # [B, T, S]
  bias = jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)[:, None, None]  # [B, 1, 1, T, S]
  probs = jax.nn.softmax(scores + bias, axis=-1).astype(q.dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
  return out.reshape(b, t, n, h)


def dot_product_attention(
    q: Array, k: Array, v: Array, segment_ids: Array, *, implementation: str = "xla", packed: bool = False
) -> Array:
  """`jax.nn.dot_product_attention`, causal, keys masked by `segment_ids` [B, 1, 1, S] (packed
  rows: the block mask [B, 1, T, S] of same-sequence pairs)."""
  if packed:
    mask = _allowed(segment_ids, True)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  mask = (segment_ids > 0)[:, None, None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def _gather_rows(x: Array, shift: Array) -> Array:
  """out[b, i] = x[b, (i + shift[b]) % T] for x [B, T, ...] and shift [B] (int32)."""
  t = x.shape[1]
  idx = (jnp.arange(t, dtype=jnp.int32)[None] + shift[:, None]) % t  # [B, T]
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@jax.custom_vjp
def _rotate_rows(x: Array, shift: Array) -> Array:
  """Rotate each row of x [B, T, ...] left by shift[b]. A permutation, so its gradient is the
  opposite rotation (a gather again, not the scatter-add autodiff would make of the gather)."""
  return _gather_rows(x, shift)


def _rotate_rows_fwd(x, shift):
  return _gather_rows(x, shift), shift


def _rotate_rows_bwd(shift, g):
  return _gather_rows(g, -shift), None


_rotate_rows.defvjp(_rotate_rows_fwd, _rotate_rows_bwd)


def _cudnn_operands(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
  """q [B, T, N, H], k and v [B, T, K, H] as cuDNN's partitioner takes them under a mesh:
  sharded alike. K heads that do not split over `tensor` as the N query heads do are repeated to
  N (GQA as MHA, the same values; query head n reads KV head n // G either way). No mesh: as given."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return q, k, v
  heads, kv_heads = ("act_batch", "act_length", "act_heads", None), ("act_batch", "act_length", "act_kv_heads", None)
  shape = dict(mesh.shape)
  if logical_to_spec(heads, q.shape, shape) != logical_to_spec(kv_heads, k.shape, shape):
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    kv_heads = heads
  return constrain(q, heads), constrain(k, kv_heads), constrain(v, kv_heads)


def seq_lengths_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, implementation: str) -> Array:
  """Causal attention with padding given as sequence lengths, the form cuDNN takes.

  A row's real tokens are one run [start, start + n) (left padding before it, right padding
  after). Rotating the row left by `start` puts them at [0, n): then real token i sees exactly
  the real tokens 0..i under PADDING_CAUSAL with query and key lengths n. Exact for real tokens;
  padding queries come back as zeros (a padding-only row gets length 1, so no row is empty).
  Under a mesh q, k and v are given one sharding (`_cudnn_operands`)."""
  real = segment_ids > 0
  start = jnp.argmax(real, axis=1).astype(jnp.int32)  # the first real token (0 if none)
  lengths = jnp.maximum(jnp.sum(real, axis=1, dtype=jnp.int32), 1)
  q, k, v = _cudnn_operands(*(_rotate_rows(x, start) for x in (q, k, v)))
  out = jax.nn.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      query_seq_lengths=lengths,
      key_value_seq_lengths=lengths,
      implementation=implementation,
  )
  out = _rotate_rows(out, -start)
  return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))


def segment_runs(ids: Array, max_segments: int) -> tuple[Array, Array]:
  """cuDNN's ragged form of packed rows whose sequences are each one run of ids 1, 2, .. (0
  padding): ids [B, T] -> (lengths [B, M], offsets [B, M + 1]), int32, M = max_segments: run m's
  token count and first position, -1 where a row has no run m (and in offsets' last column)."""
  number = jnp.arange(1, max_segments + 1, dtype=ids.dtype)
  member = ids[:, :, None] == number  # [B, T, M]
  lengths = jnp.sum(member, axis=1, dtype=jnp.int32)  # [B, M]
  present = lengths > 0
  starts = jnp.where(present, jnp.argmax(member, axis=1).astype(jnp.int32), -1)
  offsets = jnp.pad(starts, [(0, 0), (0, 1)], constant_values=-1)
  return jnp.where(present, lengths, -1), offsets


def packed_cudnn_attention(q: Array, k: Array, v: Array, segments: PackedSegments) -> Array:
  """cuDNN flash attention over packed rows: cuDNN's sequence packing (each sequence a run of
  its row, `segment_runs`) with PADDING_CAUSAL, so a token attends to the earlier tokens of its
  own run. Padding tokens come back as zeros. cuDNN takes this on Hopper or later GPUs
  (`CUDNN_PACKING_CAPABILITY`; JAX raises at trace time before that). Under a mesh the runs are
  sharded over the batch with q, k and v (`_cudnn_operands`)."""
  from jax._src.cudnn.fused_attention_stablehlo import MaskType
  from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

  ids = segments.ids
  lengths, offsets = segment_runs(ids, min(segments.max_segments or ids.shape[1], ids.shape[1]))
  q, k, v = _cudnn_operands(q, k, v)
  if not jax.sharding.get_abstract_mesh().empty:
    lengths, offsets = constrain(lengths, ("act_batch", None)), constrain(offsets, ("act_batch", None))
  out = cudnn_dpa(
      q,
      k,
      v,
      q_seqlen=lengths,
      kv_seqlen=lengths,
      q_offsets=offsets,
      kv_offsets=offsets,
      scale=q.shape[-1] ** -0.5,
      mask_type=MaskType.PADDING_CAUSAL,
      qkv_layout="BTNH",
  )
  return jnp.where(ids[:, :, None, None] > 0, out, jnp.zeros((), out.dtype))


def cudnn_attention(q: Array, k: Array, v: Array, segment_ids) -> Array:
  """cuDNN flash attention (`seq_lengths_attention`; packed rows `packed_cudnn_attention`);
  float32 inputs, which cuDNN refuses, take XLA's implementation of the same masks."""
  if isinstance(segment_ids, PackedSegments):
    if q.dtype == jnp.float32:
      return dot_product_attention(q, k, v, segment_ids.ids, implementation="xla", packed=True)
    return packed_cudnn_attention(q, k, v, segment_ids)
  implementation = "xla" if q.dtype == jnp.float32 else "cudnn"
  return seq_lengths_attention(q, k, v, segment_ids, implementation=implementation)


@functools.lru_cache(maxsize=32)
def _splash_kernel(groups: int, t: int, interpret: bool):
  """A causal splash-attention kernel for `groups` query heads sharing one K/V head (MQA form):
  q [G, T, H], k and v [T, H], segment ids [T] -> [G, T, H]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  block = next(b for b in SPLASH_BLOCKS if t % b == 0)  # t is padded to a multiple of 128
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(groups)])
  sizes = sk.BlockSizes(
      block_q=block,
      block_kv=block,
      block_kv_compute=block,
      block_q_dkv=block,
      block_kv_dkv=block,
      block_kv_dkv_compute=block,
      block_q_dq=block,
      block_kv_dq=block,
  )
  return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q: Array, k: Array, v: Array, segment_ids: Array, *, interpret: bool) -> Array:
  """One shard: q [B, K, G, T, H] (scaled), k/v [B, K, T, H], segment_ids [B, T] -> [B, K, G, T, H]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  kernel = _splash_kernel(q.shape[2], q.shape[3], interpret)
  per_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over K, sharing the row's segments
  per_row = jax.vmap(lambda q, k, v, s: per_head(q, k, v, sk.SegmentIds(q=s, kv=s)))
  return per_row(q, k, v, segment_ids.astype(jnp.int32))


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, interpret: bool = False) -> Array:
  """The Pallas TPU splash kernel. Under a mesh (`jax.set_mesh`) it runs per shard of the batch
  (act_batch) and KV heads (act_kv_heads) by `shard_map`, as a Pallas kernel is not partitioned
  by XLA. T is padded up to a multiple of 128 with padding tokens (segment 0, after the row's
  end, so no real token sees them). `interpret=True` runs the kernel in the Pallas interpreter
  (any backend; tests)."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  pad = -t % SPLASH_LANES
  if pad:
    widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    out = splash_attention(widen(q), widen(k), widen(v), widen(segment_ids), interpret=interpret)
    return out[:, :t]
  qg = (q * jnp.asarray(h**-0.5, q.dtype)).reshape(b, t, kv_heads, n // kv_heads, h)
  qg = qg.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
  local = functools.partial(_splash_local, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    shape = dict(mesh.shape)
    spec = lambda names, x: logical_to_spec(names, x.shape, shape)
    q_spec = spec(("act_batch", "act_kv_heads", None, None, None), qg)
    kv_spec = spec(("act_batch", "act_kv_heads", None, None), kh)
    seg_spec = jax.sharding.PartitionSpec(q_spec[0], None)
    local = jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False)
  out = local(qg, kh, vh, segment_ids)  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def attend(q: Array, k: Array, v: Array, segment_ids, implementation: str) -> Array:
  """Dispatch on `implementation` (one of IMPLEMENTATIONS); `segment_ids` is the [B, T] mask of a
  padded batch or the `PackedSegments` of packed rows."""
  packed = isinstance(segment_ids, PackedSegments)
  if implementation == "cudnn":
    return cudnn_attention(q, k, v, segment_ids)
  if packed:  # every implementation below takes the ids (einsum, dot_product: a block mask)
    segment_ids = segment_ids.ids
  if implementation == "einsum":
    return einsum_attention(q, k, v, segment_ids, packed=packed)
  if implementation == "dot_product":
    return dot_product_attention(q, k, v, segment_ids, implementation="xla", packed=packed)
  if implementation == "splash":
    return splash_attention(q, k, v, segment_ids)
  raise ValueError(f"attention implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
