"""The rollout's sampler compiled for a target as the trainer runs it (`compile_sampler`), and its
decode step alone, one compile a decode phase, for the bytes a step reads (`compile_decode_step`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from ict_jax import sampling
from ict_jax import setup as setup_lib
from ict_jax.aot import plan
from ict_jax.aot.measure import Report, bytes_per_device, measure
from ict_jax.aot.step import _cudnn_tracing, _setup
from ict_jax.aot.targets import AotError, Target
from ict_jax.config import Config
from ict_jax.length_model import LengthDistribution
from ict_jax.rollout import decode_batch_size
from ict_jax.models.axes import axis_rules, logical_to_spec
from ict_jax.models.qwen2 import CACHE_AXES, JointCache, LayerCache, make_cache
from ict_jax.sampling import bucket_length


def _decode_step(
    state, cache, prompt_cache, tok, num_prompt, i, prompt_mask, rng, temperature, top_p, *, graphdef, kw, read_len
):
  """One step of the sampler's decode loop (`sampling.decode._decode_rows`'s while-loop body,
  without writing the outputs): token i - 1 [b] in, its KV written at completion slot i - 1, the
  shared prompt cache and the first read_len completion slots (the phase's bound) read, token i
  sampled."""
  model = nnx.merge(graphdef, state)
  logits, cache = sampling.decode_one(model, tok, num_prompt, i, cache, prompt_cache, prompt_mask, read_len)
  kernels, split = model.cfg.kernels, model.cfg.decode_weights == "tensor"
  key = jax.random.fold_in(rng, i)
  tok, _ = sampling.rules._sample_step(logits, key, temperature, top_p, kernels=kernels, vocab_split=split, **kw)
  return tok, cache


def decode_cache(mcfg, mesh, batch: int, cache_len: int, dtype: str) -> LayerCache | JointCache:
  """The abstract KV cache `Qwen2.init_cache` makes for a decode batch, in the decoding layout
  (decode_attention "pallas": one joint [L, B, K, S, 2H] array)."""

  def struct(shape):
    with axis_rules(sampling.DECODE_RULES):
      spec = logical_to_spec(CACHE_AXES, shape, dict(mesh.shape))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  return make_cache(mcfg, batch, cache_len, struct)


@contextlib.contextmanager
def _unrolled_scans():
  """`jax.lax.scan` unrolled while a program is traced: `cost_analysis()` counts a loop body once,
  so the decode step's layer scan must be straight-line code for its bytes to count every layer."""
  scan = jax.lax.scan

  def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  jax.lax.scan = unrolled
  try:
    yield
  finally:
    jax.lax.scan = scan


# libtpu's cost analysis counts an operand staged into on-chip VMEM by memory-space assignment
# (MSA) several times: the HBM read, the VMEM write, each read from VMEM (a 37 MiB logits array
# reduced twice on v5p: 7 x its bytes with MSA, 3 x without). The decode step's bytes are counted
# with MSA off: what the step moves through HBM when nothing is kept on-chip, an upper bound on
# the HBM traffic of the program the sampler runs (MSA only moves traffic off HBM).
HBM_BYTES_OPTIONS = {"xla_msa_enable": False}


def compile_decode_step(
    policy,
    mesh,
    cache: LayerCache,
    prompt_cache: LayerCache,
    sample_kw: dict,
    read_len: int | None = None,
    compiler_options: dict | None = None,
    *,
    traced: bool = False,
):
  """`_decode_step` compiled for `mesh` (the decode cache donated, as the loop carries it in
  place; the prompt cache only read), reading read_len completion slots (a decode phase's bound;
  None: all), its layer scan unrolled (`_unrolled_scans`). traced=True: (the compiled step, its
  `jax.stages.Traced`, whose jaxpr `pallas_grid_steps` counts).

  The layouts of the cache and the weights are the compiler's choice (`Layout.AUTO`), as inside
  the sampler, where the cache is made in the program and a weight relayout is loop-invariant
  (done once, before the loop): with the default layouts of arguments, XLA relayouts the whole
  cache into and out of the layer scan (4 x its bytes: 1.5B on v5e-8, 64 rows a chip, 18 GB) and
  the tied embedding for its gather, and the step would be charged for what the loop does not do."""
  batch, prompts, prompt_len = cache[0].shape[1], prompt_cache[0].shape[1], prompt_cache[0].shape[3]
  cache_formats = type(cache)(*(Format(Layout.AUTO, x.sharding) for x in cache))
  rows, repl = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
  sds = jax.ShapeDtypeStruct
  args = (
      policy.state,
      cache,
      prompt_cache,
      sds((batch,), jnp.int32, sharding=rows),  # the last token
      sds((batch,), jnp.int32, sharding=rows),  # prompt lengths
      sds((), jnp.int32, sharding=repl),  # i
      sds((prompts, prompt_len), jnp.int32, sharding=sampling.prompt_sharding(mesh, prompts)),
      sds((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=repl),
      sds((), jnp.float32, sharding=repl),
      sds((), jnp.float32, sharding=repl),
  )
  in_shardings = list(jax.tree.map(lambda x: x.sharding, args))
  in_shardings[0] = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), policy.state)
  in_shardings[1] = cache_formats
  in_shardings[2] = type(prompt_cache)(*(Format(Layout.AUTO, x.sharding) for x in prompt_cache))
  step = jax.jit(
      functools.partial(_decode_step, graphdef=policy.graphdef, kw=sample_kw, read_len=read_len),
      in_shardings=tuple(in_shardings),
      out_shardings=(rows, cache_formats),
      donate_argnums=(1,),
      compiler_options=compiler_options,
  )
  with jax.set_mesh(mesh), axis_rules(sampling.DECODE_RULES), _unrolled_scans():
    trace = step.trace(*args)
    compiled = trace.lower().compile()
  return (compiled, trace) if traced else compiled


def pallas_grid_steps(jaxpr) -> int:
  """The Pallas grid steps one run of `jaxpr` takes (a device's, inside `shard_map`): each
  `pallas_call`'s grid size, times the length of a scan around it; a cond's largest branch; a
  while loop's body once. A TPU grid step costs ~0.35 us whatever it reads (Pallas TPU docs,
  "Matrix Multiplication"), which a byte count does not see."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "pallas_call":
      total += math.prod(eqn.params["grid_mapping"].grid)
      continue
    inner = [pallas_grid_steps(j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]
    if name == "cond":
      total += max(inner, default=0)
    else:
      total += sum(inner) * (eqn.params["length"] if name == "scan" else 1)
  return total


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


@dataclasses.dataclass
class _DecodeStepCosts:
  """The decode step's costs a chip, one list entry a decode phase (`Report.decode_phase_*`): its
  `cost_analysis()` bytes (None where the compiler gives no cost analysis), its FLOPs (the decode
  matmuls' where it gives none), its minimum bytes, its Pallas grid steps (an entry a phase
  compiled); the report's error (the first phase whose step alone failed to compile); the bytes
  of a sub-batch's prompt cache and of its prompt + completion caches."""

  bytes: list[float | None]
  flops: list[float]
  min_bytes: list[int]
  grid_steps: list[int]
  error: str
  prompt_kv_bytes: int
  kv_cache_bytes: int


def _decode_step_costs(
    policy, mcfg, mesh, target: Target, ro: _Rollout, sample_kw: dict, dtype: str, opts, *, weights_read, error
) -> _DecodeStepCosts:
  """The decode step alone compiled once a decode phase (`compile_decode_step`, reading the slots
  that phase reads) for its costs: cost_analysis counts a loop body once, so the whole program's
  figure is not per step; this is the body as its own program, its cache donated (updated in
  place). A phase's minimum: weights_read + the prompt cache + the completion slots it reads."""
  cache = decode_cache(mcfg, mesh, ro.layout.rows, ro.new_len, dtype)
  prompt_cache = decode_cache(mcfg, mesh, ro.layout.prompts, ro.prompt_len, dtype)
  prompt_kv = bytes_per_device(prompt_cache)
  out = _DecodeStepCosts([], [], [], [], error, prompt_kv, bytes_per_device(cache) + prompt_kv)
  matmul_flops = ro.layout.rows * mcfg.flops_per_token(0, training=False) / target.chips  # no cost analysis
  for bound in ro.phases:
    costs = None
    if not out.bytes or out.bytes[-1] is not None:  # no cost analysis in one phase: none in any
      try:
        compiled, trace = compile_decode_step(policy, mesh, cache, prompt_cache, sample_kw, bound, opts, traced=True)
        costs = compiled.cost_analysis()
        out.grid_steps.append(pallas_grid_steps(trace.jaxpr.jaxpr))
      except Exception as e:  # noqa: BLE001 - the step alone overflowing is reported, not fatal
        out.error = out.error or f"decode step (phase {bound}): {' '.join(str(e).split())[:300]}"
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    out.bytes.append(float(costs["bytes accessed"]) if costs and costs.get("bytes accessed") else None)
    out.flops.append(float(costs["flops"]) if costs and costs.get("flops") else matmul_flops)
    out.min_bytes.append(
        weights_read + prompt_kv + bytes_per_device(decode_cache(mcfg, mesh, ro.layout.rows, bound, dtype))
    )
  return out


def _step_bound(cfg: Config, mcfg, target: Target, ro: _Rollout, step: _DecodeStepCosts, weights_read: int, **kw):
  """`plan.step_bound` of the rollout as compiled, a phase without cost analysis at its minimum
  bytes; kw: the length distribution (`lengths`, `batches`, `seed`)."""
  costs = plan.DecodeCosts(
      rows=ro.rows,
      group_size=ro.group,
      decode_batch_size=ro.sub,
      prompt_len=ro.prompt_len,
      completion_len=ro.new_len,
      phases=tuple(ro.phases),
      phase_bytes=tuple(b if b is not None else m for b, m in zip(step.bytes, step.min_bytes)),
      phase_flops=tuple(step.flops),
      weights_read_bytes=weights_read,
      prompt_kv_bytes=step.prompt_kv_bytes,
  )
  return plan.step_bound(
      mcfg,
      costs,
      chips=target.chips,
      peak_tflops=target.peak_tflops,
      hbm_tb_s=target.hbm_tb_s,
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
) -> Report:
  """Compile the rollout's sampler (`sampling.lower_generate`) for `target` as the trainer runs
  it: the rollout copy of the policy (`rollout.dtype`, the decoding layout), all
  prompts_per_step x group_size rows in sub-batches of `rollout.decode_batch_size` ("auto" sized
  from what the target's HBM leaves free next to the train state and the rollout copy, as
  `sampling.resolve_decode_batch_size` sizes it from the devices' memory statistics). Fits when
  its peak plus the train state (which stays on the devices meanwhile) is within the usable HBM.
  Then the decode step alone is compiled once a decode phase (`sampling.decode_phases`: the
  completion slots it reads) for its `cost_analysis()` bytes accessed and FLOPs, and the step's
  time is bounded (`plan.step_bound`) on `length_batches` steps of `lengths`."""
  su = _setup(cfg, target)
  cfg, mesh, mcfg, note = su.cfg, su.mesh, su.mcfg, su.note
  prompt_len = prompt_len or bucket_length(cfg.data.max_prompt_len)
  new_len = bucket_length(completion_len or cfg.rollout.max_new_tokens)
  rows = cfg.rollout.rows
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  dtype = setup_lib.rollout_dtype(cfg, mesh)
  policy = sampling.abstract_rollout_policy(mcfg, dtype=dtype, mesh=mesh)
  resident = bytes_per_device(su.state) + (bytes_per_device(su.params) if cfg.loss.beta > 0 else 0)
  policy_bytes = bytes_per_device(policy.state)
  # what a prefill or decode step must read of them: all, less an untied input embedding, of which
  # it gathers one row a token (a tied one is the LM head, read whole)
  weights_read = policy_bytes - (0 if mcfg.tie_word_embeddings else bytes_per_device(policy.state["embed"]))
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
  ro = _Rollout(rows, group, prompt_len, new_len, sub, layout, phases)
  opts = HBM_BYTES_OPTIONS if target.platform == "tpu" else None
  report.decode_bytes_options = opts
  step = _decode_step_costs(
      policy, mcfg, mesh, target, ro, sample_kw, dtype, opts, weights_read=weights_read, error=report.error
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
  report.step_bound = _step_bound(
      cfg, mcfg, target, ro, step, weights_read, lengths=lengths, batches=length_batches, seed=length_seed
  )
  report.shapes = _shapes(cfg, mcfg, mesh, ro, dtype, policy_bytes, weights_read, step, note)
  return report
