"""Shapes and memory of a rollout: length buckets and the decode sub-batch size.

Prompt length and max_new_tokens are rounded up to buckets (powers of two from 16, or a given
list), so few programs are compiled. `decode_batch_size` decodes the rows in sub-batches (one KV
cache live at a time), "auto" sizing them from the devices' free memory (`decode_row_bytes`).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

_MIN_BUCKET = 16


def bucket_length(n: int, buckets: Sequence[int] | None = None) -> int:
  """The smallest listed bucket >= n, else the next power of two >= max(n, 16)."""
  if buckets:
    fits = [b for b in sorted(buckets) if b >= n]
    if fits:
      return int(fits[0])
  return max(_MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"generate: {name} must be an int >= {minimum}, got {value!r}")
  return int(value)


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
