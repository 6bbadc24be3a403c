"""Shapes and memory of a rollout: length buckets, the decode sub-batches and their layout.

Prompt length and max_new_tokens are rounded up to buckets (powers of two from 16, or a given
list), so few programs are compiled. `decode_batch_size` decodes the rows in sub-batches (one KV
cache live at a time), "auto" sizing them from the devices' free memory (`decode_row_bytes` a
decoded row, `kv_bytes` a prefilled prompt). `decode_layout` says which rows share a prefilled
prompt and how much batch padding each sub-batch gets.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

_MIN_BUCKET = 16
_PHASES = 8  # the decode loop's length-bounded phases (at most; each at least _MIN_BUCKET steps)


def bucket_length(n: int, buckets: Sequence[int] | None = None) -> int:
  """The smallest listed bucket >= n, else the next power of two >= max(n, 16)."""
  if buckets:
    fits = [b for b in sorted(buckets) if b >= n]
    if fits:
      return int(fits[0])
  return max(_MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def decode_phases(max_len: int) -> tuple[int, ...]:
  """The read bounds of the decode loop's phases: multiples of max(16, ceil(max_len / 8)), then
  max_len. The phase of bound b runs the steps whose cache slots written so far fit in b, and its
  attention reads b completion slots, not max_len: over a whole rollout the slots read exceed the
  slots written by ~1 / (2 x phases), where reading all max_len slots every step reads ~2x."""
  step = max(_MIN_BUCKET, -(-max_len // _PHASES))
  return tuple(range(step, max_len, step)) + (max_len,)


def kv_read_over_filled(phases: Sequence[int], prompts: int, prompt_len: int, rows: int) -> float:
  """Cache slots the decode steps of one sub-batch read over a whole rollout / the slots that held
  keys when read, for completions all running to the last of max_len = phases[-1] columns: step i
  (1 .. max_len - 1) reads the prompts' prompt_len slots (once a prompt: shared by its rows) and
  each row's first b completion slots, b its phase's bound, of which i - 1 are written."""
  read = filled = 0
  for i in range(1, phases[-1]):
    bound = next(b for b in phases if i <= b)
    read += prompts * prompt_len + rows * bound
    filled += prompts * prompt_len + rows * (i - 1)
  return read / filled


_STRETCHES = 4  # the compacted decode looks for finished rows up to 4 times a phase,
_MIN_STRETCH = 16  # every 16 steps at the most (a check stalls the device for a host round trip)


def decode_stretches(phases: Sequence[int]) -> tuple[tuple[int, int], ...]:
  """The compacted decode's stretches, (last step, phase bound) each, for the read bounds `phases`
  (`decode_phases`): each phase's steps cut into up to 4 equal stretches of at least 16 steps.
  Between two stretches the loop drops its finished rows (`compacted_rows`); a step reads as its
  phase's bound says, so the stretches add no programs, only checks (a [2] int32 read each)."""
  out, prev = [], 0
  for bound in phases:
    n = max(1, min(_STRETCHES, (bound - prev) // _MIN_STRETCH))
    width = -(-(bound - prev) // n)
    out += [(min(prev + width * (j + 1), bound), bound) for j in range(n)]
    prev = bound
  return tuple(out)


_ROW_UNITS = 8  # a compacted decode batch keeps a multiple of 1/8 of a shard's rows (by default)
_TILE_ROWS = 8  # finer units hold at least 8 rows: a TPU tile's sublanes (`aot.decode_grid`)


def compacted_rows(live_per_shard: int, rows_per_shard: int, units: int | None = None) -> int:
  """The rows each data shard keeps in the decode batch after a compaction, when the fullest
  shard has `live_per_shard` rows still decoding: the smallest multiple of the unit that holds
  them, capped at rows_per_shard; the unit is ceil(rows_per_shard / units) (units default 8), and
  one finer than an eighth of the rows holds at least 8 rows (16 units of 128 rows a chip: 8 rows;
  of 64: 8 rows, 8 units). Every shard keeps the same count (one program for the mesh), so a
  rollout compiles at most `units` batch sizes a phase bound; 0 live rows keep one unit (the loop
  has ended and is not run)."""
  eighth = -(-rows_per_shard // _ROW_UNITS)
  unit = max(-(-rows_per_shard // (units or _ROW_UNITS)), min(_TILE_ROWS, eighth))
  return min(rows_per_shard, max(1, -(-live_per_shard // unit)) * unit)


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"generate: {name} must be an int >= {minimum}, got {value!r}")
  return int(value)


# ---- the layout of the rows -----------------------------------------------------------------------
class DecodeLayout(NamedTuple):
  """How the n_rows = prompts x G rows of a rollout are decoded: `sub_batches` sub-batches, each
  prefilling `prompts` prompt rows (batch padding included) whose keys/values `samples` (R, a
  divisor of G) consecutive decode rows read. A prompt is prefilled G / R times: once when a
  sub-batch holds whole groups (decode_batch_size a multiple of G)."""

  sub_batches: int
  prompts: int
  samples: int

  @property
  def rows(self) -> int:
    """Decode rows of one sub-batch, batch padding included."""
    return self.prompts * self.samples

  @property
  def prefill_rows(self) -> int:
    """Prompt rows prefilled over the whole rollout, batch padding included."""
    return self.sub_batches * self.prompts


def decode_layout(n_rows: int, group_size: int, decode_batch_size: int, rows_per_shard: int) -> DecodeLayout:
  """The layout of n_rows rows (groups of group_size consecutive rows share a prompt) decoded in
  sub-batches of decode_batch_size rows (a divisor of n_rows): R = gcd(decode_batch_size,
  group_size) rows share a prefilled prompt, and each sub-batch gets the fewest padding prompts
  (all-0 mask: they emit nothing) that make its rows a multiple of rows_per_shard."""
  samples = math.gcd(decode_batch_size, group_size)
  step = rows_per_shard // math.gcd(samples, rows_per_shard)  # prompts whose rows fill the shards
  prompts = -(-(decode_batch_size // samples) // step) * step
  return DecodeLayout(n_rows // decode_batch_size, prompts, samples)


# ---- the memory plan ----------------------------------------------------------------------------
_AUTO_HEADROOM = 0.8  # share of the free device memory the decode batch may plan for
_LOGIT_COPIES = 8  # float32 [V] vectors per row planned for the head's output and the sampler


def _split(n: int, t: int) -> int:
  return n // t if n % t == 0 else n


def kv_bytes(cfg, slots: int, mesh: Mesh | None, dtype: str) -> int:
  """Device bytes of one row's keys and values over `slots` cache slots on each device: 2 x layers
  x KV heads x slots x head_dim in `dtype`, KV heads split over "tensor" when it divides them."""
  kv = _split(cfg.num_key_value_heads, 1 if mesh is None else mesh.shape["tensor"])
  return 2 * cfg.num_hidden_layers * kv * slots * cfg.head_dim * jnp.dtype(dtype).itemsize


def decode_row_bytes(cfg, cache_len: int, mesh: Mesh | None, dtype: str) -> int:
  """Device bytes one decoded row needs on each device: its KV cache of cache_len slots
  (`kv_bytes`; the completion's, the prompt's being shared) plus `_LOGIT_COPIES` float32 vectors
  of the vocabulary (split over "tensor" likewise) for the logits and the sampler's temporaries."""
  vocab = _split(cfg.vocab_size, 1 if mesh is None else mesh.shape["tensor"])
  return kv_bytes(cfg, cache_len, mesh, dtype) + _LOGIT_COPIES * vocab * 4


def auto_decode_batch_size(
    n_rows: int,
    rows_per_shard: int,
    row_bytes: int,
    free_bytes: int | None,
    *,
    group_size: int = 1,
    prompt_bytes: int = 0,
) -> int:
  """The largest divisor d of n_rows whose sub-batch fits in `_AUTO_HEADROOM` of `free_bytes`:
  its decode rows (`decode_layout`, ceil(rows / rows_per_shard) on each device) at `row_bytes`
  each plus its prefilled prompts at `prompt_bytes` each (a device's share when they divide over
  the row shards, else all); all rows when the backend reports no memory statistics (free_bytes
  None, e.g. CPU)."""
  if free_bytes is None:
    return n_rows
  budget = _AUTO_HEADROOM * free_bytes
  for d in sorted((d for d in range(1, n_rows + 1) if n_rows % d == 0), reverse=True):
    layout = decode_layout(n_rows, group_size, d, rows_per_shard)
    need = -(-layout.rows // rows_per_shard) * row_bytes + _split(layout.prompts, rows_per_shard) * prompt_bytes
    if need <= budget:
      return d
  raise ValueError(
      f"decode_batch_size=auto: not even one row per device fits: it needs "
      f"{(row_bytes + prompt_bytes) / 2**20:.1f} MiB and {free_bytes / 2**20:.1f} MiB are free"
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
    decode_batch_size,
    n_rows: int,
    *,
    cfg,
    prompt_len: int,
    new_len: int,
    group_size: int,
    mesh: Mesh | None,
    dtype: str,
) -> int:
  """None: all rows; "auto": `auto_decode_batch_size` from the free memory of the mesh's
  devices (all rows on CPU) for prompts of prompt_len slots shared by groups of group_size rows
  and new_len completion slots a row; an int must divide n_rows. Raises ValueError before
  compiling."""
  if decode_batch_size is None:
    return n_rows
  rps = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
  if decode_batch_size == "auto":
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    free = free_device_bytes(devices)
    if free is not None and jax.process_count() > 1:  # every host must compile the same program
      from jax.experimental import multihost_utils

      free = int(np.min(multihost_utils.process_allgather(np.int64(free))))
    row = decode_row_bytes(cfg, new_len, mesh, dtype)
    prompt = kv_bytes(cfg, prompt_len, mesh, dtype)
    return auto_decode_batch_size(n_rows, rps, row, free, group_size=group_size, prompt_bytes=prompt)
  size = _check_int("decode_batch_size", decode_batch_size, 1)
  if n_rows % size:
    raise ValueError(f"generate: decode_batch_size {size} does not divide the {n_rows} rows " "(prompts x num_samples)")
  return size
