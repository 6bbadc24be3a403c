"""Compiling a lowered program for a target and reading what it needs (`measure` -> `Report`)."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from ict_jax.aot.targets import Target

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# an instruction's result type and its collective: "%x = f32[16,1536]{1,0} all-reduce(" or an async
# "-start" whose tuple holds the operand and the result ("(bf16[8,64], bf16[64,64]) all-gather-start(")
_COLLECTIVE_TYPE_RE = re.compile(r"=\s*(\S.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY_RE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "bf16": 2}
_OOM_RES = (
    re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass
class Report:
  """What one compile of one program for one target measured (bytes are per device)."""

  program: str
  target: str
  fits: bool
  hbm_bytes_per_device: int
  peak_bytes_per_device: int | None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  temp_bytes: int | None = None
  generated_code_bytes: int | None = None
  compiler_accepted: bool = False  # compiled (libtpu refuses what overflows its HBM accounting)
  compile_s: float = 0.0
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)
  model_flops_per_step: float = 0.0
  shapes: dict[str, Any] = dataclasses.field(default_factory=dict)
  error: str = ""
  advice: str = ""
  # bytes other buffers hold on each device while this program runs (the sampler: the train
  # state, which stays on the devices during the rollout); fits = peak + resident <= usable HBM
  resident_bytes: int = 0
  # the sampler: rows decoded at once (rollout.decode_batch_size resolved as the trainer does),
  # the bytes one decode step reads and writes (`cost_analysis()` of the step alone) and their
  # minimum (the rollout-dtype weights + the sub-batch's KV cache, per device)
  decode_batch_size: int | None = None
  decode_step_bytes: float | None = None
  decode_step_min_bytes: int | None = None
  # cuDNN flash-attention calls (forward and backward custom calls) in the compiled program
  cudnn_attention_calls: int = 0
  # the sampler: prompt rows prefilled over the whole rollout (prompts once each when a decode
  # sub-batch holds whole groups; batch padding included) and their forward FLOPs
  prefill_rows: int | None = None
  prefill_flops: float | None = None
  # the sampler: KV cache slots the decode steps read over a whole rollout / the slots written when
  # read (`sampling.kv_read_over_filled`), assuming every completion runs to the last column and
  # every row stays in the batch: it sees only the phases' read bounds, not the finished rows
  # (step_bound's decode_bytes_over_limit and live_row_steps_over_real do)
  kv_read_over_filled: float | None = None
  # the sampler, one entry a decode phase (`sampling.decode_phases`, the last = decode_step_*): the
  # bytes one step of that phase's compiled decode step reads and writes a chip (None: no cost
  # analysis), its FLOPs a chip, and its minimum bytes (the rollout weights + the prompt cache +
  # the completion slots the phase reads)
  decode_phase_bytes: list[float] | None = None
  decode_phase_flops: list[float] | None = None
  decode_phase_min_bytes: list[int] | None = None
  # the sampler, one entry a decode phase: the Pallas grid steps a chip's decode step takes (the
  # fused decode-attention kernel's, `sampler.pallas_grid_steps`; 0 with XLA's decode attention)
  decode_phase_grid_steps: list[int] | None = None
  # the sampler: a lower bound on one training step's time on the target (`plan.step_bound`)
  step_bound: Any = None
  # the compiler options the decode phases' bytes were counted with (TPU: without VMEM staging)
  decode_bytes_options: dict | None = None
  # the sampler: the decode step's costs a chip at each (phase bound, decode rows)
  # (`plan.DecodeGrid` as a dict, + "mode": the decode_compiles that made it), and one step's
  # collectives at all rows and the last bound, by kind: their number and the bytes they move a
  # chip (`collective_bytes`)
  decode_grid: dict | None = None
  decode_step_collectives: dict[str, int] | None = None
  decode_step_collective_bytes: dict[str, float] | None = None

  @property
  def margin_bytes(self) -> int | None:
    if self.peak_bytes_per_device is None:
      return None
    return self.hbm_bytes_per_device - self.peak_bytes_per_device - self.resident_bytes

  @property
  def decode_bytes_ratio(self) -> float | None:
    if not self.decode_step_bytes or not self.decode_step_min_bytes:
      return None
    return self.decode_step_bytes / self.decode_step_min_bytes

  @property
  def decode_phase_bytes_over_weights_kv(self) -> list[float] | None:
    """Each decode phase's step bytes / (weights + the KV cache that phase reads); issue 25's goal
    is <= 1.3 in every phase."""
    if not self.decode_phase_bytes or None in self.decode_phase_bytes or not self.decode_phase_min_bytes:
      return None
    return [b / m for b, m in zip(self.decode_phase_bytes, self.decode_phase_min_bytes)]

  def to_json(self) -> dict:
    bound = self.step_bound.to_json() if self.step_bound is not None else None
    return {
        **dataclasses.asdict(dataclasses.replace(self, step_bound=None)),
        "margin_bytes": self.margin_bytes,
        "decode_bytes_ratio": self.decode_bytes_ratio,
        "decode_phase_bytes_over_weights_kv": self.decode_phase_bytes_over_weights_kv,
        "step_bound": bound,
        "step_time_lower_bound_s": bound and bound["step_time_lower_bound_s"],
        "hours_lower_bound": bound and bound["hours_lower_bound"],
    }


# ---- measuring a compiled program ------------------------------------------------------------
def count_cudnn_attention(hlo_text: str) -> int:
  """cuDNN fused-attention custom calls (`__cudnn$fmha...`, forward and backward) in optimised HLO."""
  return len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo_text))


def count_collectives(hlo_text: str) -> dict[str, int]:
  """{kind: number of instructions} in optimised HLO text; an async pair (-start/-done) is one."""
  counts = {k: 0 for k in COLLECTIVES}
  for m in _COLLECTIVE_RE.finditer(hlo_text):
    counts[m.group(1)] += 1
  return counts


def _array_bytes(dtype: str, dims: str) -> int:
  size = _ITEM_BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype.split("e")[0]) or 8) // 8)
  return size * math.prod(int(d) for d in dims.split(",") if d)


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """{kind: bytes a device's collectives of that kind put on the interconnect} in optimised HLO
  text, counted from each instruction's result type: a sync collective's result arrays summed, an
  async one's (-start, whose tuple also holds the operand) its largest array; an all-reduce counts
  twice its bytes (a ring all-reduce is a reduce-scatter then an all-gather, each moving ~its
  bytes), the others once (an all-gather: its result; a reduce-scatter: its shard, ~its operand
  divided over the group; both ~ the bytes leaving a device)."""
  out = {k: 0 for k in COLLECTIVES}
  for m in _COLLECTIVE_TYPE_RE.finditer(hlo_text):
    arrays = [_array_bytes(d, s) for d, s in _ARRAY_RE.findall(m.group(1))]
    n = (max(arrays, default=0) if m.group(3) else sum(arrays)) * (2 if m.group(2) == "all-reduce" else 1)
    out[m.group(2)] += n
  return out


def _parse_oom(msg: str) -> tuple[int | None, int | None]:
  """libtpu's overflow message -> (bytes needed, bytes available), None when not parsed."""
  m = next((m for m in (r.search(msg) for r in _OOM_RES) if m), None)
  if not m:
    return None, None
  return (int(float(m.group(1)) * _UNITS[m.group(2)]), int(float(m.group(3)) * _UNITS[m.group(4)]))


def measure(lowered, target: Target, *, program: str, advice: str = "", resident: int = 0) -> Report:
  """Compile `lowered` (a `jax.stages.Lowered` for `target`'s devices) and read its memory.

  Peak per device = arguments + outputs - aliased (donated) + temporaries + generated code;
  fits = compiled and peak <= usable HBM. libtpu has been seen to accept a program whose peak so
  counted exceeds its usable HBM (1.5B on v5e-8, micro-batch 32: 17.03 vs 15.75 GiB); such a
  program is reported as not fitting, with `compiler_accepted` true. `resident`: bytes per device
  that other buffers hold meanwhile (counted against the usable HBM, not in the peak)."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001  (libtpu's overflow is an XlaRuntimeError)
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
      raise
    needed, available = _parse_oom(msg)
    first = next((line for line in msg.splitlines() if "RESOURCE_EXHAUSTED" in line), msg)
    return Report(
        program,
        target.name,
        False,
        available or target.usable_hbm,
        needed,
        temp_bytes=needed,
        compile_s=time.perf_counter() - t0,
        error=first.strip()[:500],
        advice=advice,
        resident_bytes=resident,
    )
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak = (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      - mem.alias_size_in_bytes
      + mem.temp_size_in_bytes
      + mem.generated_code_size_in_bytes
  )
  fits = peak + resident <= target.usable_hbm
  text = compiled.as_text()
  return Report(
      program,
      target.name,
      fits,
      target.usable_hbm,
      int(peak),
      argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
      generated_code_bytes=int(mem.generated_code_size_in_bytes),
      compiler_accepted=True,
      compile_s=compile_s,
      collectives=count_collectives(text),
      cudnn_attention_calls=count_cudnn_attention(text),
      advice="" if fits else advice,
      resident_bytes=resident,
  )


def bytes_per_device(tree) -> int:
  """Bytes one device holds of the arrays (or ShapeDtypeStructs with shardings) of `tree`: the
  shard shape of each leaf; a leaf without a sharding counts whole."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total
