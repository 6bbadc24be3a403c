"""A lower bound on one training step's time on a target, before renting it.

A step is the rollout (prefill, then decode) and the update, one after the other on the same chips.
Each part is bounded by what it must do at the chip's peak (`targets.Target`: dense bf16 FLOP/s,
HBM bandwidth), on the real tokens of a step drawn from a length distribution
(`ict_jax.length_model.LengthDistribution`), averaged over `batches` simulated steps:

- update: the model FLOPs of the real tokens, every row packed without padding, at all chips' peak:
  per row of p + c tokens, `num_iterations` passes of (p + c) x the decoder's training FLOPs a token
  (`Qwen2Config.flops_per_token`, attention at that length) plus the LM head on the c completion
  tokens only (what `train_step` computes), and the reference model's forward when loss.beta > 0;
- prefill: each sub-batch's prompts once (the decoder forward on their real tokens, the head on
  the last), at max(FLOPs at the chips' peak, bytes at their bandwidth), the bytes being the rollout
  weights read once a sub-batch and the prompts' keys/values written;
- decode: the rows as the sampler lays them out (`sampling.decode_layout`: sub-batches, each
  prompt's R rows consecutive, a sub-batch's rows in blocks over the chips); each sub-batch steps
  until its longest completion ends (i = 1 .. T - 1), in the length-bounded phases of
  `sampling.decode_phases`, each cut into the stretches of `sampling.decode_stretches`; at each
  boundary between stretches the finished rows are dropped, the chips' live rows evened out by a
  few sent to the neighbouring chips (`sampling.balance`), and every chip keeps
  `sampling.compacted_rows(the most rows then live on a chip, its rows, units)` rows, so a step of
  a stretch of the phase of bound b runs at that row count r (the first stretch at all rows; once
  rows are dropped, each reads its own copy of its prompt's slots, as the sampler's compaction
  gathers them: `decode_grid.prompt_rows`). A compaction costs its copy of the kept rows' state
  (read and written: `DecodeCosts.row_bytes` a row) at the HBM bandwidth and the rows sent
  (`sampling.balance.move_cap` each way an edge) at the inter-chip bandwidth.
  A step costs max(its bytes at the HBM bandwidth, its FLOPs at the peak) + its collectives' bytes
  at the inter-chip bandwidth (an all-reduce between a layer's matmuls is on the critical path:
  not overlapped), a chip's bytes, FLOPs and collective bytes of the decode step compiled at
  (b, r) (`DecodeGrid`, `cost_analysis()` and the HLO), less the blocks the fused decode kernel
  skips: the prompts' left padding at the rows' prompt lengths and the prompts none of whose rows
  still decodes (`prompt_bytes_skipped`), and the cache slots not written yet at each step
  (`cache_bytes_skipped`), which its cost estimate counts (a stretch's steps at their mean bytes),
  or, where the compiler gives no cost analysis (the CUDA plugin), its minimum: the rollout weights
  + the KV cache read, and the decode matmuls.

The decode limit (`decode_limit`), counted without the compiled programs: each decode step of a
sub-batch reads the rollout weights once split over the chips, plus the KV cache really read:
each live row its filled slots (i at step i: its new one and those before), each prompt's slots
once a step while any of its rows lives, at the HBM bandwidth. `decode_bytes_over_limit` is the
compiled decode bytes a chip over a rollout / the limit's; `live_row_steps_over_real` the rows x
steps the decode computes / the decode tokens generated (sum of completion length - 1).

Not counted (so real steps are slower): padding, the sampler's and the loss's elementwise work,
host work and reward scoring, compile time, the optimizer update, the fused decode kernel's grid
steps (~0.35 us each on TPU whatever they read: `decode_phase_grid_steps` counts them).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ict_jax.length_model import LengthDistribution


@dataclasses.dataclass(frozen=True)
class DecodeGrid:
  """A chip's costs of one decode step at each (phase bound, decode rows): `bounds` the decode
  phases' read bounds, `rows` the decode batches the step may run at (the mesh's rows, ascending:
  `sampling.compacted_rows` counts x the row shards, the last all of a sub-batch's); entries
  [bound][rows]. `compiled` the (bound, rows) whose programs were compiled (at `depths` layers),
  the rest derived (`bilinear`, `derive_grid`)."""

  bounds: tuple[int, ...]
  rows: tuple[int, ...]
  bytes: tuple[tuple[float, ...], ...]  # bytes accessed (cost_analysis), or the minimum without one
  flops: tuple[tuple[float, ...], ...]
  ici_bytes: tuple[tuple[float, ...], ...]  # the collectives' bytes (`measure.collective_bytes`)
  collectives: tuple[tuple[float, ...], ...]  # the number of collectives
  compiled: tuple[tuple[int, int], ...] = ()
  depths: tuple[int, ...] = ()  # the layer counts compiled (the model's own: nothing derived in depth)

  def full_rows(self, table) -> list[float]:
    """One entry a phase: `table` at all of a sub-batch's rows (no row finished)."""
    return [float(row[-1]) for row in table]


def bilinear(points: dict[tuple[int, int], float], x: float, y: float) -> float:
  """f(x, y) = a + b x + c y + d x y through the four measured points around (x, y): the nearest
  measured x on each side (or x itself), likewise y (a side may be a single value). A decode
  step's bytes and FLOPs are affine in its read bound at a fixed row count (the KV slots read)
  and affine in its rows at a fixed bound, piecewise where a row count was measured between."""
  xs, ys = sorted({k[0] for k in points}), sorted({k[1] for k in points})
  near = lambda vs, v: (max((u for u in vs if u <= v), default=vs[0]), min((u for u in vs if u >= v), default=vs[-1]))
  (x0, x1), (y0, y1) = near(xs, x), near(ys, y)
  tx = 0.0 if x1 == x0 else (x - x0) / (x1 - x0)
  ty = 0.0 if y1 == y0 else (y - y0) / (y1 - y0)
  f = lambda a, b: points[(a, b)]
  return (1 - tx) * (1 - ty) * f(x0, y0) + tx * (1 - ty) * f(x1, y0) + (1 - tx) * ty * f(x0, y1) + tx * ty * f(x1, y1)


def derive_grid(bounds, rows, measured: dict[tuple[int, int], tuple[float, ...]]) -> list[list[tuple[float, ...]]]:
  """[bound][rows] cost tuples: the measured (bound, rows) as measured, every other one `bilinear`
  in each of the tuple's entries through the measured corners."""
  n = len(next(iter(measured.values())))
  at = lambda b, r: measured.get((b, r)) or tuple(
      bilinear({k: v[j] for k, v in measured.items()}, b, r) for j in range(n)
  )
  return [[at(b, r) for r in rows] for b in bounds]


@dataclasses.dataclass(frozen=True)
class DecodeCosts:
  """What the sampler's compiled programs say about a rollout, per chip (`compile_sampler`)."""

  rows: int  # prompts_per_step x group_size
  group_size: int
  decode_batch_size: int  # rows decoded at once; sub-batches = rows / decode_batch_size
  prompt_len: int  # prompt columns (the maximum prompt length)
  completion_len: int  # completion columns (the maximum completion length)
  phases: tuple[int, ...]  # the decode phases' read bounds
  grid: DecodeGrid  # one decode step's costs a chip at each (phase bound, decode rows)
  weights_read_bytes: (
      int  # the rollout weights a chip reads once a prefill (an untied input embedding: gathered, not read)
  )
  prompt_kv_bytes: int  # the prompt cache of a sub-batch on a chip (written by the prefill)
  shards: int = 1  # row shards (mesh data x fsdp): a sub-batch's rows in equal consecutive blocks
  prompts_per_sub_batch: int = 0  # `sampling.DecodeLayout.prompts` (padding prompts included)
  samples: int = 1  # `sampling.DecodeLayout.samples`: consecutive rows reading one prefilled prompt
  # the limit's inputs, counted from the model alone: the rollout weights a step must read, all
  # chips together (an untied input embedding left out), and one KV slot of one row, all layers
  weights_total_bytes: int = 0
  kv_slot_bytes: int = 0
  # the fused decode kernel's (decode_attention "pallas", `models/decode_kernel.py`): a chip's KV
  # slot of one row in one layer (its KV heads), and the layers; 0 without it (every prompt slot read)
  kernel_slot_bytes: int = 0
  layers: int = 0
  # `sampling.compacted_rows`: a compacted batch keeps a multiple of 1/units (8) of a chip's rows
  units: int | None = None
  # one decode row's state a chip (its completion cache, its prompt copy, its outputs), which a
  # compaction copies for each kept row and sends for each row moved to another chip
  row_bytes: int = 0


@dataclasses.dataclass
class StepBound:
  """The bound and its parts (means over the simulated steps); FLOPs over all chips, bytes a chip."""

  chips: int
  peak_tflops: float  # a chip's
  hbm_tb_s: float  # a chip's
  batches: int
  real_tokens: float  # prompt + completion tokens of a step's rows
  completion_tokens: float
  capped_fraction: float  # completions at the cap
  update_flops: float
  update_s: float
  prefill_flops: float
  prefill_bytes: float  # a chip's
  prefill_s: float
  decode_phases: list[int]
  decode_steps_per_phase: list[float]  # over all sub-batches of a step
  decode_phase_bytes: list[float]  # one step at all rows, a chip
  decode_phase_flops: list[float]  # one step at all rows, a chip
  decode_phase_rows: list[float]  # the rows a chip a phase's steps run at (mean over its steps)
  decode_bytes: float  # a chip's compiled decode bytes over a rollout
  decode_ici_bytes: float  # a chip's collective bytes over a rollout
  decode_ici_s: float  # those at the inter-chip bandwidth (in decode_s)
  ici_gb_s: float  # a chip's, both directions
  decode_s: float
  decode_limit_bytes: float  # a chip's: the weights split over the chips + the real KV reads
  decode_limit_s: float  # at the HBM bandwidth
  decode_bytes_over_limit: float
  decode_s_over_limit: float
  live_row_steps: float  # decode rows x steps computed over a rollout (compaction units included)
  real_decode_tokens: float  # tokens the decode steps generate: sum of (completion length - 1)
  live_row_steps_over_real: float
  step_time_lower_bound_s: float
  train_steps: int
  hours_lower_bound: float
  lengths: dict

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def phase_steps(phases, longest: int) -> list[int]:
  """Decode steps in each phase (or stretch) for a sub-batch whose longest completion has `longest`
  tokens: the loop runs steps i = 1 .. longest - 1 (token 0 comes from the prefill), the phase of
  bound (or the stretch ending at) b taking those with the previous one's b < i <= b."""
  steps, prev = [], 0
  for b in phases:
    steps.append(max(0, min(b, longest - 1) - prev))
    prev = b
  return steps


def update_flops(mcfg, prompt_lens: np.ndarray, completion_lens: np.ndarray, *, passes: int, with_ref: bool) -> float:
  """Training FLOPs of the rows' real tokens (`prompt_lens` a row), packed: the decoder on all
  p + c tokens, the LM head on the c completion tokens; the reference model's forward too."""
  head = 2.0 * mcfg.hidden_size * mcfg.vocab_size  # forward FLOPs of the head, a token
  total = 0.0
  for p, c in zip(prompt_lens.tolist(), completion_lens.tolist()):
    n = p + c
    fwd = n * (mcfg.flops_per_token(n, training=False) - head) + c * head
    total += passes * (3 * fwd + (fwd if with_ref else 0.0))
  return total


def prefill_flops(mcfg, prompt_lens: np.ndarray) -> float:
  """Forward FLOPs of the prompts' real tokens, the LM head on each prompt's last token only."""
  head = 2.0 * mcfg.hidden_size * mcfg.vocab_size
  return float(sum(p * (mcfg.flops_per_token(p, training=False) - head) + head for p in prompt_lens.tolist()))


def sub_batch_rows(completion: np.ndarray, prompt: np.ndarray, costs: DecodeCosts) -> tuple[np.ndarray, np.ndarray]:
  """The rows as the sampler lays them out (`sampling.decode_layout`, `generate`): completion
  lengths [rows] (row k x G + s sample s of prompt k), prompt lengths [prompts] -> (completion
  lengths [sub-batches, u x R] of each sub-batch's decode rows, prompt lengths [sub-batches, u]
  of its prefilled prompts; 0 for a padding prompt and its rows). Prompt k is prefilled G / R
  times (copy t decoding its samples t R .. t R + R - 1), sub-batch j holds the prefilled prompts
  j, j + n, j + 2n, ..., each followed by its R rows; the chips hold equal consecutive blocks."""
  n, u, r = costs.rows // costs.decode_batch_size, costs.prompts_per_sub_batch, costs.samples
  pre = completion.reshape(-1, r)  # [prefilled prompts, R]
  pre_p = np.repeat(prompt, costs.group_size // r)
  pad = n * u - pre.shape[0]
  pre, pre_p = np.pad(pre, ((0, pad), (0, 0))), np.pad(pre_p, (0, pad))
  return pre.reshape(u, n, r).transpose(1, 0, 2).reshape(n, u * r), pre_p.reshape(u, n).T


class Stretch(NamedTuple):
  """The rows each chip computes in a stretch: rows [shards, r] indices into the sub-batch's rows,
  held [shards, r] False where a slot repeats a row that moved away (computed as finished);
  compacted: the stretch starts with a compaction, which sent `sent` rows each way an edge (the
  buffers' size: 0 when no row moved)."""

  rows: np.ndarray
  held: np.ndarray
  compacted: bool = False
  sent: int = 0


def stretch_batches(
    ends, lens: np.ndarray, shards: int, prompt: np.ndarray | None = None, units: int | None = None
) -> list[Stretch]:
  """The rows each chip computes in each stretch (or phase), indices into one sub-batch's
  completion lengths `lens` [rows] in the decode batch's order, `ends` the stretches' last steps
  (`sampling.decode_stretches`): all rows in the first; at each later one's start (step i = the
  previous end + 1) the rows still live (length > i) are counted and, when the chips can keep fewer
  than the batch holds (`sampling.balance.plan`: the live rows evened out over the chips, a few
  crossing to the neighbouring chips, then `sampling.compacted_rows` of the fullest), every chip
  sorts its live rows to the front, the longest of `prompt` [rows] (each row's prompt length;
  None: all alike) first, ties in their order, and keeps that many (multiples of 1/units of its
  rows), laid out as
  `sampling.balance.rows_after` says (`sampling.compact._compact`)."""
  from ict_jax.sampling import balance

  total = lens.size // shards
  cap = balance.move_cap(shards, total)
  longest_first = -(np.zeros(lens.size, np.int64) if prompt is None else np.asarray(prompt, np.int64))
  now = Stretch(np.arange(lens.size).reshape(shards, total), np.ones((shards, total), bool))
  out, prev = [], 0
  for k, end in enumerate(ends):
    if k:
      live = now.held & (lens[now.rows] > prev + 1)
      counts = live.sum(axis=1)
      step = balance.plan(counts, total, cap, units)
      if step.keep < now.rows.shape[1]:
        key = np.where(live, longest_first[now.rows], np.iinfo(np.int64).max)
        ordered = np.take_along_axis(now.rows, np.argsort(key, axis=1, kind="stable"), axis=1)
        now = Stretch(*balance.rows_after(ordered, counts, step.flows, step.keep), True, step.sent)
      else:
        now = now._replace(compacted=False, sent=0)
    out.append(now)
    prev = end
  return out


def phase_rows(ends, lens: np.ndarray, shards: int) -> list[int]:
  """The decode rows a chip each stretch (or phase) runs at (`stretch_batches`)."""
  return [b.rows.shape[1] for b in stretch_batches(ends, lens, shards)]


def prompt_bytes_skipped(
    batch: np.ndarray,
    prompt_lens: np.ndarray,
    bound: int,
    costs: DecodeCosts,
    shared: bool,
    live: np.ndarray | None = None,
) -> float:
  """The prompt bytes the fused decode kernel skips in a decode step, on the chip that skips the
  fewest (the step waits for it), which the decode step's compiled bytes count (its cost estimate
  reads every prompt block): `batch` [shards, r] the rows each chip computes (`stretch_batches`),
  `prompt_lens` [rows] each row's prompt length, `live` [steps, shards, r] whether each row still
  decodes at each step of a stretch (None: one step, all live): the mean over the steps.
  Until the first compaction (`shared`) the rows read their prompts shared (`costs.samples` rows a
  prompt), after it a copy a row; a prompt none of whose rows is live reads as all padding
  (`sampling.decode._phase` masks it); a row block (`decode_kernel.blocks`) skips the leading prompt
  blocks that are left padding for all of its prompts (`decode_kernel.prompt_blocks_read`, for
  every row block and step at once). 0 without the kernel."""
  from ict_jax.models import decode_kernel

  if not costs.kernel_slot_bytes:
    return 0.0
  group = costs.samples if shared else 1
  rows, _, bp = _kernel_blocks(batch.shape[1], shared, bound, costs)[0]
  live = np.ones((1, *batch.shape), bool) if live is None else live
  steps, chips, r = live.shape
  if group > 1:  # shared: the batch is every row in order, a prompt's rows (maybe over chips) consecutive
    live = np.repeat(live.reshape(steps, -1, group).any(axis=2), group, axis=1).reshape(live.shape)
  lens = np.where(live, np.asarray(prompt_lens)[batch][None], 0)  # [steps, chips, r]: 0 once its prompt is dead
  lens = lens.reshape(steps, chips, r // rows, rows)[..., ::group]  # [steps, chips, row blocks, prompts a block]
  copied = decode_kernel.prompt_blocks_read(lens, costs.prompt_len, bp)  # [steps, chips, row blocks]
  skipped = lens.shape[2] * lens.shape[3] * (costs.prompt_len // bp) - copied.sum(axis=2)  # [steps, chips]
  return float(skipped.min(axis=1).mean() * bp * costs.kernel_slot_bytes * costs.layers)


def decode_limit(lens: np.ndarray, prompt: np.ndarray, costs: DecodeCosts) -> float:
  """The bytes one sub-batch's decode must read, all chips together (module docstring): its
  longest completion's steps x the rollout weights + the KV slots really read: a row of length c
  reads i slots at step i (1 .. c - 1), a prompt its p slots at every step while any of its R
  rows lives."""
  steps = max(int(lens.max()) - 1, 0)
  row_slots = float(np.sum(lens * np.maximum(lens - 1, 0) / 2))
  prompt_slots = float(np.sum(prompt * np.maximum(lens.reshape(-1, costs.samples).max(axis=1) - 1, 0)))
  return steps * costs.weights_total_bytes + costs.kv_slot_bytes * (row_slots + prompt_slots)


def _kernel_blocks(r: int, shared: bool, bound: int, costs: DecodeCosts):
  """(`decode_kernel.blocks`, the cache slots read) of the fused kernel at r rows a chip and a
  phase's bound: the bound read up to a bf16 tile's 16 slots, as `decode_attention` reads it."""
  from ict_jax.models import decode_kernel

  read = min(costs.completion_len, -(-bound // 16) * 16)
  group = costs.samples if shared else 1
  return decode_kernel.blocks(r, group, read, costs.prompt_len, costs.kernel_slot_bytes), read


def cache_bytes_skipped(first: int, last: int, bound: int, r: int, shared: bool, costs: DecodeCosts) -> float:
  """The cache bytes the fused decode kernel skips over steps first..last of a stretch (r rows a
  chip, the phase's `bound`), which the compiled bytes count: at step i the rows have written i - 1
  completion slots, and a row block copies the cache blocks holding them, at least the first
  (`decode_kernel.cache_blocks_read`), of the bound's. 0 without the kernel."""
  from ict_jax.models import decode_kernel

  if not costs.kernel_slot_bytes or last < first:
    return 0.0
  (_, bs, _), read = _kernel_blocks(r, shared, bound, costs)
  written = np.arange(first, last + 1) - 1
  skipped = int((read // bs - decode_kernel.cache_blocks_read(written, read, bs)).sum())
  return float(skipped * bs * r * costs.kernel_slot_bytes * costs.layers)


def _decode_rollout(costs: DecodeCosts, lens: np.ndarray, prompt: np.ndarray, bw: float, peak: float, ici: float):
  """One step's decode over its sub-batches: (steps a phase [phases], row-steps a phase [phases]
  (a chip), bytes, ICI bytes, seconds, limit bytes; bytes a chip, the limit all chips')."""
  from ict_jax import sampling

  g = costs.grid
  steps, row_steps = np.zeros(len(g.bounds)), np.zeros(len(g.bounds))
  nbytes = ici_bytes = secs = limit = 0.0
  ends, bounds = zip(*sampling.decode_stretches(g.bounds))
  phase_of = [g.bounds.index(b) for b in bounds]  # each stretch's phase
  for sub, pre in zip(lens, prompt):
    limit += decode_limit(sub, pre, costs)
    row_prompt = np.repeat(pre, costs.samples)  # [rows]: each row's prompt length
    steps_in = phase_steps(ends, int(sub.max()))
    batches = stretch_batches(ends, sub, costs.shards, row_prompt, costs.units)
    for s, (n, (batch, held, compacted, sent), k) in enumerate(zip(steps_in, batches, phase_of)):
      if not n:
        continue
      if compacted:  # `compact._compact`: the kept rows' state copied, `sent` rows each way an edge
        copied, moved = 2 * batch.shape[1] * costs.row_bytes, 2 * sent * costs.row_bytes
        nbytes, ici_bytes = nbytes + copied, ici_bytes + moved
        secs += copied / bw + (moved / ici if ici else 0.0)
      r, first = batch.shape[1], (ends[s - 1] if s else 0) + 1  # the stretch's steps: first .. first + n - 1
      j = g.rows.index(r * costs.shards)
      shared = r * costs.shards == sub.size
      b, f, x = g.bytes[k][j], g.flops[k][j], g.ici_bytes[k][j]
      at = np.arange(first, first + n)[:, None, None]
      live = held & (sub[batch][None] > at)  # [n, chips, r]: rows live at each step
      b -= prompt_bytes_skipped(batch, row_prompt, g.bounds[k], costs, shared, live)
      b -= cache_bytes_skipped(first, first + n - 1, g.bounds[k], r, shared, costs) / n  # a step's mean
      steps[k] += n
      row_steps[k] += n * r
      nbytes, ici_bytes = nbytes + n * b, ici_bytes + n * x
      secs += n * (max(b / bw, f / peak) + (x / ici if ici else 0.0))
  return steps, row_steps, nbytes, ici_bytes, secs, limit


def step_bound(
    mcfg,
    costs: DecodeCosts,
    *,
    chips: int,
    peak_tflops: float,
    hbm_tb_s: float,
    train_steps: int,
    ici_gb_s: float = 0.0,
    passes: int = 1,
    with_ref: bool = False,
    lengths: LengthDistribution = LengthDistribution(),
    batches: int = 20,
    seed: int = 0,
) -> StepBound:
  """The lower bound of one step (module docstring), averaged over `batches` steps of lengths."""
  peak, bw, ici = peak_tflops * 1e12, hbm_tb_s * 1e12, ici_gb_s * 1e9
  rng = np.random.default_rng(seed)
  group = costs.group_size
  prompts = costs.rows // group
  sub_batches = costs.rows // costs.decode_batch_size
  upd = pre = tokens = completion = capped = real = 0.0
  steps, row_steps, dec = np.zeros(len(costs.phases)), np.zeros(len(costs.phases)), np.zeros(4)
  for _ in range(batches):
    p, c = lengths.sample(rng, prompts, group, costs.prompt_len, costs.completion_len)
    rows_p = np.repeat(p, group)
    upd += update_flops(mcfg, rows_p, c, passes=passes, with_ref=with_ref)
    pre += prefill_flops(mcfg, p)
    tokens += float(rows_p.sum() + c.sum())
    completion += float(c.sum())
    real += float(np.maximum(c - 1, 0).sum())
    capped += float(np.mean(c == costs.completion_len))
    s, rs, *rest = _decode_rollout(costs, *sub_batch_rows(c, p, costs), bw, peak, ici)
    steps, row_steps, dec = steps + s, row_steps + rs, dec + rest
  upd, pre, tokens, completion, capped, real = (x / batches for x in (upd, pre, tokens, completion, capped, real))
  steps, row_steps, (decode_bytes, ici_bytes, decode_s, limit) = steps / batches, row_steps / batches, dec / batches
  prefill_bytes = sub_batches * (costs.weights_read_bytes + costs.prompt_kv_bytes)
  prefill_s = max(pre / (chips * peak), prefill_bytes / bw)
  update_s = upd / (chips * peak)
  total = update_s + prefill_s + decode_s
  limit_chip = limit / chips
  live = float(row_steps.sum()) * costs.shards
  return StepBound(
      chips=chips,
      peak_tflops=peak_tflops,
      hbm_tb_s=hbm_tb_s,
      batches=batches,
      real_tokens=tokens,
      completion_tokens=completion,
      capped_fraction=capped,
      update_flops=upd,
      update_s=update_s,
      prefill_flops=pre,
      prefill_bytes=float(prefill_bytes),
      prefill_s=prefill_s,
      decode_phases=list(costs.phases),
      decode_steps_per_phase=[float(x) for x in steps],
      decode_phase_bytes=costs.grid.full_rows(costs.grid.bytes),
      decode_phase_flops=costs.grid.full_rows(costs.grid.flops),
      decode_phase_rows=[float(r / n) if n else 0.0 for r, n in zip(row_steps, steps)],
      decode_bytes=float(decode_bytes),
      decode_ici_bytes=float(ici_bytes),
      decode_ici_s=float(ici_bytes / ici) if ici else 0.0,
      ici_gb_s=ici_gb_s,
      decode_s=float(decode_s),
      decode_limit_bytes=limit_chip,
      decode_limit_s=limit_chip / bw,
      decode_bytes_over_limit=float(decode_bytes / limit_chip) if limit_chip else 0.0,
      decode_s_over_limit=float(decode_s / (limit_chip / bw)) if limit_chip else 0.0,
      live_row_steps=live,
      real_decode_tokens=real,
      live_row_steps_over_real=live / real if real else 0.0,
      step_time_lower_bound_s=total,
      train_steps=train_steps,
      hours_lower_bound=total * train_steps / 3600,
      lengths=dict(dataclasses.asdict(lengths), seed=seed),
  )


def format_bound(b: StepBound, target_name: str) -> str:
  """The bound as a report line."""
  return (
      f"  step time LOWER BOUND on {target_name} (not a measurement: real tokens at {b.chips} x "
      f"{b.peak_tflops:g} TFLOP/s and {b.hbm_tb_s:g} TB/s a chip, mean of {b.batches} simulated steps of "
      f"{b.real_tokens:,.0f} tokens, {b.capped_fraction:.0%} of completions capped): "
      f"{b.step_time_lower_bound_s:.3g} s = update {b.update_s:.3g} s ({b.update_flops:.3e} FLOPs) + "
      f"prefill {b.prefill_s:.3g} s + decode {b.decode_s:.3g} s "
      f"({sum(b.decode_steps_per_phase):,.0f} steps in phases {b.decode_phases}); "
      f"{b.train_steps} steps >= {b.hours_lower_bound:.3g} h\n"
      f"  decode over a rollout, a chip: {b.decode_bytes / 1e9:,.1f} GB compiled ({b.decode_bytes_over_limit:.2f}x the "
      f"limit {b.decode_limit_bytes / 1e9:,.1f} GB = {b.decode_limit_s:.3g} s: the weights split over the chips + the KV "
      f"really read), collectives {b.decode_ici_bytes / 1e9:,.2f} GB = {b.decode_ici_s:.3g} s at {b.ici_gb_s:g} GB/s; "
      f"decode_s / limit {b.decode_s_over_limit:.2f}; rows a chip each phase "
      f"{', '.join(f'{r:.0f}' for r in b.decode_phase_rows)}; row-steps / decode tokens {b.live_row_steps_over_real:.2f}"
  )
