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
- decode: each sub-batch steps until its longest completion ends (i = 1 .. T - 1); a step of the
  phase of bound b (`sampling.decode_phases`) costs max(its bytes at the bandwidth, its FLOPs at the
  peak), a chip's bytes and FLOPs of that phase's compiled decode step (`cost_analysis()`), or,
  where the compiler gives none (the CUDA plugin), its minimum: the rollout weights + the KV cache
  of that phase, and the decode matmuls.

Not counted (so real steps are slower): padding, the sampler's and the loss's elementwise work,
collectives, host work and reward scoring, compile time, the optimizer update.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ict_jax.length_model import LengthDistribution


@dataclasses.dataclass(frozen=True)
class DecodeCosts:
  """What the sampler's compiled programs say about a rollout, per chip (`compile_sampler`)."""

  rows: int  # prompts_per_step x group_size
  group_size: int
  decode_batch_size: int  # rows decoded at once; sub-batches = rows / decode_batch_size
  prompt_len: int  # prompt columns (the maximum prompt length)
  completion_len: int  # completion columns (the maximum completion length)
  phases: tuple[int, ...]  # the decode phases' read bounds
  phase_bytes: tuple[float, ...]  # bytes one decode step of each phase reads and writes on a chip
  phase_flops: tuple[float, ...]  # FLOPs of one decode step of each phase on a chip
  weights_read_bytes: (
      int  # the rollout weights a chip reads once a prefill (an untied input embedding: gathered, not read)
  )
  prompt_kv_bytes: int  # the prompt cache of a sub-batch on a chip (written by the prefill)


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
  decode_phase_bytes: list[float]  # one step, a chip
  decode_phase_flops: list[float]  # one step, a chip
  decode_s: float
  step_time_lower_bound_s: float
  train_steps: int
  hours_lower_bound: float
  lengths: dict

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def phase_steps(phases, longest: int) -> list[int]:
  """Decode steps in each phase for a sub-batch whose longest completion has `longest` tokens: the
  loop runs steps i = 1 .. longest - 1 (token 0 comes from the prefill), phase of bound b taking
  those with previous bound < i <= b."""
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


def step_bound(
    mcfg,
    costs: DecodeCosts,
    *,
    chips: int,
    peak_tflops: float,
    hbm_tb_s: float,
    train_steps: int,
    passes: int = 1,
    with_ref: bool = False,
    lengths: LengthDistribution = LengthDistribution(),
    batches: int = 20,
    seed: int = 0,
) -> StepBound:
  """The lower bound of one step (module docstring), averaged over `batches` steps of lengths."""
  peak, bw = peak_tflops * 1e12, hbm_tb_s * 1e12
  rng = np.random.default_rng(seed)
  group = costs.group_size
  prompts = costs.rows // group
  sub_batches = costs.rows // costs.decode_batch_size
  upd = pre = tokens = completion = capped = 0.0
  steps = np.zeros(len(costs.phases))
  for _ in range(batches):
    p, c = lengths.sample(rng, prompts, group, costs.prompt_len, costs.completion_len)
    rows_p = np.repeat(p, group)
    upd += update_flops(mcfg, rows_p, c, passes=passes, with_ref=with_ref)
    pre += prefill_flops(mcfg, p)
    tokens += float(rows_p.sum() + c.sum())
    completion += float(c.sum())
    capped += float(np.mean(c == costs.completion_len))
    for sub in c.reshape(sub_batches, -1):
      steps += phase_steps(costs.phases, int(sub.max()))
  upd, pre, tokens, completion, capped, steps = (x / batches for x in (upd, pre, tokens, completion, capped, steps))
  prefill_bytes = sub_batches * (costs.weights_read_bytes + costs.prompt_kv_bytes)
  prefill_s = max(pre / (chips * peak), prefill_bytes / bw)
  decode_s = float(sum(n * max(b / bw, f / peak) for n, b, f in zip(steps, costs.phase_bytes, costs.phase_flops)))
  update_s = upd / (chips * peak)
  total = update_s + prefill_s + decode_s
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
      decode_phase_bytes=[float(x) for x in costs.phase_bytes],
      decode_phase_flops=[float(x) for x in costs.phase_flops],
      decode_s=decode_s,
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
      f"{b.train_steps} steps >= {b.hours_lower_bound:.3g} h"
  )
