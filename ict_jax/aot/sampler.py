"""The rollout's sampler compiled for a target as the trainer runs it (`compile_sampler`), and its
decode step alone (`decode_step.compile_decode_step`) at the (phase bound, rows) the bound needs
(`decode_grid`), for the bytes, FLOPs and collectives a step costs."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ict_jax import sampling
from ict_jax import setup as setup_lib
from ict_jax.aot import decode_grid as decode_grid_lib
from ict_jax.aot import plan
from ict_jax.aot.decode_step import (  # noqa: F401  (re-exported: tests and benchmarks import them from here)
    HBM_BYTES_OPTIONS,
    compile_decode_step,
    decode_cache,
    pallas_grid_steps,
)
from ict_jax.aot.measure import Report, bytes_per_device, measure
from ict_jax.aot.step import _cudnn_tracing, _setup
from ict_jax.aot.targets import AotError, Target
from ict_jax.config import Config
from ict_jax.length_model import LengthDistribution
from ict_jax.rollout import decode_batch_size
from ict_jax.sampling import bucket_length


def _join_notes(note: str, more: str) -> str:
  """The report's note and one more remark, "; "-separated (either may be empty)."""
  return "; ".join(n for n in (note, more) if n)


def _decode_batch_size(
    cfg: Config,
    mcfg,
    target: Target,
    mesh,
    *,
    rows: int,
    prompt_len: int,
    new_len: int,
    dtype: str,
    free: int,
    note: str,
) -> tuple[int, str]:
  """(the rows the sampler decodes at once, the note): `rollout.decode_batch_size` resolved as the
  trainer resolves it, "auto" sized from `free`, the HBM a chip leaves free next to the train state
  and the rollout copy. When not even one row a chip fits, one row a chip is compiled (to report
  not fitting) and the note says so; a setting that cannot be resolved is an `AotError`."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  dbs = decode_batch_size(cfg)
  group = cfg.rollout.group_size
  try:
    if dbs == "auto":
      row_bytes = sampling.decode_row_bytes(mcfg, new_len, mesh, dtype)
      prompt_bytes = sampling.kv_bytes(mcfg, prompt_len, mesh, dtype)
      try:
        if free <= 0:
          raise ValueError("no memory is free")
        sub = sampling.auto_decode_batch_size(
            rows, shards, row_bytes, free, group_size=group, prompt_bytes=prompt_bytes
        )
      except ValueError:  # not even one row a chip fits: compile one row a chip, report not fitting
        sub = min(d for d in range(shards, rows + 1) if rows % d == 0)
        note = _join_notes(note, f"decode_batch_size=auto: not one row a chip fits the free HBM; compiled {sub}")
    else:
      sub = sampling.resolve_decode_batch_size(
          dbs, rows, cfg=mcfg, prompt_len=prompt_len, new_len=new_len, group_size=group, mesh=mesh, dtype=dtype
      )
  except ValueError as e:
    raise AotError(f"--target {target.name}: config.rollout.{' '.join(str(e).split())}") from None
  return sub, note


@dataclasses.dataclass(frozen=True)
class _Rollout:
  """The rollout `compile_sampler` compiles: its rows, their columns, and how they are decoded."""

  rows: int  # prompts_per_step x group_size
  group: int  # rollout.group_size
  prompt_len: int  # prompt columns (bucketed)
  new_len: int  # completion columns (bucketed)
  sub: int  # rows decoded at once (rollout.decode_batch_size resolved)
  layout: sampling.DecodeLayout  # as `generate` lays the rows out
  phases: tuple[int, ...]  # the decode phases' read bounds (`sampling.decode_phases`)
  shards: int  # row shards (mesh data x fsdp)
  dtype: str  # the rollout copy's (and its KV cache's)
  units: int = 8  # rollout.compaction_units: a compacted batch keeps a multiple of 1/units of a chip's rows


@dataclasses.dataclass
class _DecodeStepCosts:
  """The decode step's costs a chip, one list entry a decode phase at all of a sub-batch's rows
  (`Report.decode_phase_*`): its `cost_analysis()` bytes (None where the compiler gives no cost
  analysis), its FLOPs (the decode matmuls' where it gives none), its minimum bytes, its Pallas
  grid steps; the grid at every (bound, rows) (`decode_grid`) and the step's collectives; the
  report's error (the first decode step that failed to compile); the bytes of a sub-batch's
  prompt cache and of its prompt + completion caches."""

  bytes: list[float | None]
  flops: list[float]
  min_bytes: list[int]
  grid_steps: list[int]
  grid: decode_grid_lib.GridResult
  error: str
  prompt_kv_bytes: int
  kv_cache_bytes: int


def _decode_step_costs(
    mcfg, mesh, target: Target, ro: _Rollout, sample_kw: dict, dtype: str, opts, *, weights_read, error, mode, weights
) -> _DecodeStepCosts:
  """The decode step alone compiled (`decode_grid`: a few (bound, rows), the rest derived; or
  every one) for its costs: cost_analysis counts a loop body once, so the whole program's figure
  is not per step; this is the body as its own program, its cache donated (updated in place). A
  phase's minimum: weights_read + the prompt cache + the completion slots it reads."""
  cache = decode_cache(mcfg, mesh, ro.layout.rows, ro.new_len, dtype)
  prompt_kv = bytes_per_device(decode_cache(mcfg, mesh, ro.layout.prompts, ro.prompt_len, dtype))
  res = decode_grid_lib.decode_grid(
      mcfg, mesh, ro, sample_kw, dtype, opts, chips=target.chips, weights_read=weights_read, mode=mode, weights=weights
  )
  min_bytes = [
      weights_read + prompt_kv + bytes_per_device(decode_cache(mcfg, mesh, ro.layout.rows, bound, dtype))
      for bound in ro.phases
  ]
  full_bytes = res.grid.full_rows(res.grid.bytes) if res.cost_analysis else [None] * len(min_bytes)
  return _DecodeStepCosts(
      full_bytes,
      res.grid.full_rows(res.grid.flops),
      min_bytes,
      res.grid_steps,
      res,
      error or res.error,
      prompt_kv,
      bytes_per_device(cache) + prompt_kv,
  )


def _step_bound(cfg: Config, mcfg, mesh, target: Target, ro: _Rollout, step: _DecodeStepCosts, weights: tuple, **kw):
  """`plan.step_bound` of the rollout as compiled on `mesh`; weights: (a chip's rollout weights a
  step reads, all chips' together); kw: the length distribution (`lengths`, `batches`, `seed`)."""
  kernel = mcfg.decode_attention == "pallas" and step.grid.cost_analysis  # the bytes its estimate counts
  kernel_slot = sampling.kv_bytes(mcfg, 1, mesh, ro.dtype) // mcfg.num_hidden_layers if kernel else 0
  costs = plan.DecodeCosts(
      rows=ro.rows,
      group_size=ro.group,
      decode_batch_size=ro.sub,
      prompt_len=ro.prompt_len,
      completion_len=ro.new_len,
      phases=tuple(ro.phases),
      grid=step.grid.grid,
      weights_read_bytes=weights[0],
      prompt_kv_bytes=step.prompt_kv_bytes,
      shards=ro.shards,
      prompts_per_sub_batch=ro.layout.prompts,
      samples=ro.layout.samples,
      weights_total_bytes=weights[1],
      kv_slot_bytes=sampling.kv_bytes(mcfg, 1, None, ro.dtype),
      kernel_slot_bytes=kernel_slot,
      layers=mcfg.num_hidden_layers,
      units=ro.units,
      row_bytes=sampling.kv_bytes(mcfg, ro.new_len + ro.prompt_len, mesh, ro.dtype)
      + ro.new_len * 12,  # ids, mask, logprobs
  )
  return plan.step_bound(
      mcfg,
      costs,
      chips=target.chips,
      peak_tflops=target.peak_tflops,
      hbm_tb_s=target.hbm_tb_s,
      ici_gb_s=target.ici_gb_s,
      train_steps=cfg.train.steps,
      passes=cfg.train.num_iterations,
      with_ref=cfg.loss.beta > 0,
      **kw,
  )


def _shapes(
    cfg: Config,
    mcfg,
    mesh,
    ro: _Rollout,
    dtype: str,
    policy_bytes: int,
    weights_read: int,
    step: _DecodeStepCosts,
    note: str,
) -> dict:
  """The report's `shapes`: the rollout's rows, columns and sub-batches, the mesh, the model, the
  bytes of the rollout policy, of the weights a step reads and of the KV caches, and the note."""
  return dict(
      rows=ro.rows,
      decode_batch_size=ro.sub,
      sub_batches=ro.layout.sub_batches,
      rows_per_device=ro.layout.rows // (mesh.shape["data"] * mesh.shape["fsdp"]),
      prompts_per_sub_batch=ro.layout.prompts,
      samples_per_prompt=ro.layout.samples,
      decode_phases=list(ro.phases),
      prompt_len=ro.prompt_len,
      completion_len=ro.new_len,
      mesh=dict(mesh.shape),
      model=cfg.model.path or cfg.model.preset,
      num_params=mcfg.num_params(),
      dtype=dtype,
      param_dtype=dtype,
      attention=mcfg.attention,  # the prefill's
      decode_attention=mcfg.decode_attention,
      rollout_policy_bytes=policy_bytes,
      rollout_weights_read_bytes=weights_read,  # a step's share of the minimum
      kv_cache_bytes=step.kv_cache_bytes,
      prompt_kv_cache_bytes=step.prompt_kv_bytes,
      note=note,
  )


def compile_sampler(
    cfg: Config,
    target: Target,
    *,
    prompt_len: int = 0,
    completion_len: int = 0,
    lengths: LengthDistribution = LengthDistribution(),
    length_batches: int = 20,
    length_seed: int = 0,
    decode_compiles: str = "few",
) -> Report:
  """Compile the rollout's sampler (`sampling.lower_generate`) for `target` as the trainer runs
  it: the rollout copy of the policy (`rollout.dtype`, the decoding layout), all
  prompts_per_step x group_size rows in sub-batches of `rollout.decode_batch_size` ("auto" sized
  from what the target's HBM leaves free next to the train state and the rollout copy, as
  `sampling.resolve_decode_batch_size` sizes it from the devices' memory statistics). Fits when
  its peak plus the train state (which stays on the devices meanwhile) is within the usable HBM.
  Then the decode step alone is compiled at a few (phase bound, decode rows) (`decode_grid`,
  `decode_compiles` "few"; "all": at every one) for its `cost_analysis()` bytes accessed, FLOPs
  and collectives, and the step's time is bounded (`plan.step_bound`) on `length_batches` steps
  of `lengths`, the finished rows dropped at each phase's start."""
  su = _setup(cfg, target)
  cfg, mesh, mcfg, note = su.cfg, su.mesh, su.mcfg, su.note
  prompt_len = prompt_len or bucket_length(cfg.data.max_prompt_len)
  new_len = bucket_length(completion_len or cfg.rollout.max_new_tokens)
  rows = cfg.rollout.rows
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  dtype = setup_lib.rollout_dtype(cfg, mesh)
  policy = sampling.abstract_rollout_policy(mcfg, dtype=dtype, mesh=mesh, weights=cfg.rollout.decode_weights)
  resident = bytes_per_device(su.state) + (bytes_per_device(su.params) if cfg.loss.beta > 0 else 0)
  policy_bytes = bytes_per_device(policy.state)
  # what a prefill or decode step must read of them: all, less an untied input embedding, of which
  # it gathers one row a token (a tied one is the LM head, read whole)
  weights_read = policy_bytes - (0 if mcfg.tie_word_embeddings else bytes_per_device(policy.state["embed"]))
  # the same, all chips together, whatever the layout: what the limit splits over the chips
  whole = lambda tree: sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
  weights_total = whole(policy.state) - (0 if mcfg.tie_word_embeddings else whole(policy.state["embed"]))
  free = target.usable_hbm - resident - policy_bytes
  sub, note = _decode_batch_size(
      cfg, mcfg, target, mesh, rows=rows, prompt_len=prompt_len, new_len=new_len, dtype=dtype, free=free, note=note
  )
  group = cfg.rollout.group_size
  layout = sampling.decode_layout(rows, group, sub, shards)  # as `generate` lays the rows out
  greedy = cfg.rollout.temperature == 0
  sample_kw = dict(greedy=greedy, top_k=min(cfg.rollout.top_k, mcfg.vocab_size), use_top_p=cfg.rollout.top_p < 1.0)
  with _cudnn_tracing(mcfg):  # the prefill
    lowered = sampling.lower_generate(
        policy, rows, prompt_len, new_len, mesh=mesh, decode_batch_size=sub, num_samples=group, **sample_kw
    )
  advice = (
      f"lower --config.rollout.decode_batch_size (now {sub} of {rows} rows; it must divide them), or "
      f"rollout.max_new_tokens (now {new_len}), or spread the model over more chips (config.mesh)"
  )
  report = measure(lowered, target, program="sampler", advice=advice, resident=resident)
  report.decode_batch_size = sub
  report.prefill_rows = layout.prefill_rows
  report.prefill_flops = layout.prefill_rows * prompt_len * mcfg.flops_per_token(prompt_len, training=False)
  phases = sampling.decode_phases(new_len)
  report.kv_read_over_filled = sampling.kv_read_over_filled(phases, layout.prompts, prompt_len, layout.rows)
  ro = _Rollout(rows, group, prompt_len, new_len, sub, layout, phases, shards, dtype, cfg.rollout.compaction_units)
  opts = HBM_BYTES_OPTIONS if target.platform == "tpu" else None
  report.decode_bytes_options = opts
  step = _decode_step_costs(
      mcfg,
      mesh,
      target,
      ro,
      sample_kw,
      dtype,
      opts,
      weights_read=weights_read,
      error=report.error,
      mode=decode_compiles,
      weights=cfg.rollout.decode_weights,
  )
  report.error = step.error
  if step.bytes[-1] is None and not report.error:  # the CUDA plugin's compile-only executables
    note = _join_notes(
        note, "decode step bytes: this compiler gives no cost analysis (the step bound uses the minimum)"
    )
  report.decode_phase_bytes, report.decode_phase_flops = step.bytes, step.flops
  report.decode_phase_min_bytes = step.min_bytes
  report.decode_phase_grid_steps = step.grid_steps if len(step.grid_steps) == len(phases) else None
  report.decode_step_bytes = step.bytes[-1]  # the last phase reads every slot
  report.decode_step_min_bytes = weights_read + step.kv_cache_bytes
  report.decode_grid = dict(dataclasses.asdict(step.grid.grid), mode=decode_compiles, affine_miss=step.grid.affine_miss)
  report.decode_step_collectives = step.grid.collectives
  report.decode_step_collective_bytes = step.grid.collective_bytes
  report.step_bound = _step_bound(
      cfg,
      mcfg,
      mesh,
      target,
      ro,
      step,
      (weights_read, weights_total),
      lengths=lengths,
      batches=length_batches,
      seed=length_seed,
  )
  report.shapes = _shapes(cfg, mcfg, mesh, ro, dtype, policy_bytes, weights_read, step, note)
  return report
