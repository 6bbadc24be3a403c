"""What a step achieves against what the chips could do: model TFLOP/s per chip, MFU, tokens/s.

Model FLOPs are `Qwen2Config.flops_per_token` (6N-style, attention included) of each row's real
tokens (its prompt and completion, no padding; attention over the row's own length), times the
passes (`train.num_iterations`), over the train step's wall time: padding the update executes is
not useful work, so MFU does not count it; `padded_fraction` is the share of the executed
positions that were padding. Sampling and reward time are not in it (`tokens_per_s_per_chip`,
completion tokens, covers the whole iteration). Peaks are dense bf16 TFLOP/s per chip from the vendors' specifications; a CPU
has none published, so it is measured once (a float32 matmul) and MFU there reads against that.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# dense bf16 TFLOP/s per chip, by a lower-cased substring of `jax.Device.device_kind`; the first
# match wins, so the longer names come first ("tpu v5 lite" is a v5e, "tpu v5" alone a v5p).
PEAK_TFLOPS: tuple[tuple[str, str, float], ...] = (
    ("tpu v6 lite", "TPU v6e", 918.0),
    ("tpu v6e", "TPU v6e", 918.0),
    ("tpu v5 lite", "TPU v5e", 197.0),
    ("tpu v5e", "TPU v5e", 197.0),
    ("tpu v5p", "TPU v5p", 459.0),
    ("tpu v5", "TPU v5p", 459.0),
    ("tpu v4", "TPU v4", 275.0),
    ("h200", "NVIDIA H200", 989.0),
    ("h100", "NVIDIA H100", 989.0),
)


def table_peak(device_kind: str) -> tuple[str, float] | None:
  """(chip name, dense bf16 TFLOP/s) of a `device_kind`, or None when the table lacks it."""
  kind = device_kind.lower()
  for key, name, tflops in PEAK_TFLOPS:
    if key in kind:
      return name, tflops
  return None


def measure_matmul_tflops(n: int = 1024, repeats: int = 5) -> float:
  """The best float32 `n`-cube matmul rate of the default device, in TFLOP/s."""
  a = jnp.ones((n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()  # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    dot(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best / 1e12


def chip_peak(device=None) -> tuple[str, float, str]:
  """(chip name, peak TFLOP/s, where the number comes from: "table" or "measured")."""
  device = device if device is not None else jax.devices()[0]
  found = table_peak(device.device_kind)
  if found is not None:
    return (*found, "table")
  return device.device_kind, measure_matmul_tflops(), "measured"


class Throughput:
  """Per-step model TFLOP/s per chip, MFU and tokens/s per chip for one run."""

  def __init__(self, model_config, *, num_chips: int | None = None, peak=None):
    self.model_config = model_config
    self.num_chips = num_chips or jax.device_count()
    self.chip, self.peak_tflops, self.peak_source = peak if peak is not None else chip_peak()

  def step_metrics(
      self,
      *,
      lengths: Sequence[int],
      executed: int,
      passes: int,
      step_s: float,
      tokens: int,
      iteration_s: float,
  ) -> dict[str, float]:
    """Rows of `lengths` real tokens each (prompt + completion) through the train step `passes`
    times in `step_s` seconds, each pass executing `executed` positions (padding included, e.g.
    rows x columns as batched); `tokens` completion tokens generated in an iteration of
    `iteration_s` seconds."""
    lengths = np.asarray(lengths, np.int64)
    flops_of = self.model_config.flops_per_token
    flops = sum(flops_of(int(n)) * int(n) for n in lengths) * passes
    tflops = flops / max(step_s, 1e-9) / self.num_chips / 1e12
    return {
        "model_tflops_per_chip": tflops,
        "mfu": tflops / self.peak_tflops,
        "padded_fraction": 1.0 - float(lengths.sum()) / max(executed, 1),
        "tokens_per_s_per_chip": tokens / max(iteration_s, 1e-9) / self.num_chips,
    }
