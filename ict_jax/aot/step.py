"""The trainer's set-up on a target's mesh (abstract: no weight is allocated) and its jitted train
step compiled for it (`compile_train_step`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ict_jax import packing
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.aot.measure import Report, measure
from ict_jax.aot.targets import AotError, Target, target_devices
from ict_jax.config import Config, ConfigError, check_packing_attention
from ict_jax.models.attention import compute_capability
from ict_jax.sampling import bucket_length
from ict_jax.build import build_model
from ict_jax.setup import make_mesh, model_config


def _without_missing_model_path(cfg: Config) -> tuple[Config, str]:
  """A model.path that is not on this machine -> the preset (same shapes as the published
  config.json); returns the config and a note for the report ("" when nothing changed)."""
  path = cfg.model.path
  if not path or os.path.isfile(os.path.join(path, "config.json")):
    return cfg, ""
  note = f"model.path {path} is not on this machine: shapes from model.preset " f"{cfg.model.preset!r}"
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="")), note


def _cudnn_loadable() -> bool:
  try:  # JAX checks the cuDNN version while tracing its cuDNN attention
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    check_cudnn_version()
    return True
  except Exception:  # noqa: BLE001 - no cuDNN library on this machine, whatever JAX raises
    return False


# The cuDNN version JAX's probe reports while tracing for a GPU target on a machine without the
# library (9.12: the oldest jax-cuda13-plugin[with-cuda] accepts). JAX only gates features on it
# (MLA, compute capability 10.3); nothing of it enters the program.
CUDNN_VERSION_FOR_TRACING = 91200
# The GPU targets' compute capability (H100 and H200 SXM: 9.0, gpu_specs/h100_sxm.txtpb), which JAX
# asks the local GPU for while tracing cuDNN's sequence packing (the packed step on GPU).
COMPUTE_CAPABILITY_FOR_TRACING = (9, 0)


def _cudnn_note(mcfg) -> str:
  if mcfg.attention != "cudnn" or _cudnn_loadable():
    return ""
  return (
      f"cuDNN is not installed here: its version probe answered {CUDNN_VERSION_FOR_TRACING} while "
      "tracing; the cudnn attention compiled, its workspace (sized when a GPU loads it) not counted"
  )


@contextlib.contextmanager
def _cudnn_tracing(mcfg):
  """Trace `mcfg`'s cudnn attention on a machine without the cuDNN library (a CPU box compiling
  for a GPU node). JAX asks the library for its version while tracing and stops there when it is
  absent; the CUDA plugin compiles the cuDNN custom call without it. So, for the trace only, the
  probe answers CUDNN_VERSION_FOR_TRACING, and the compute-capability probes (no local GPU)
  answer for the target's (COMPUTE_CAPABILITY_FOR_TRACING): what compiles is the program the
  trainer runs."""
  if not _cudnn_note(mcfg):
    yield
    return
  from jax._src.cudnn import fused_attention_stablehlo as fused

  probes = {
      "check_cudnn_version": lambda: CUDNN_VERSION_FOR_TRACING,
      "check_compute_capability": lambda c: COMPUTE_CAPABILITY_FOR_TRACING >= compute_capability(c),
      "is_cuda_compute_capability_equal": lambda c: COMPUTE_CAPABILITY_FOR_TRACING == compute_capability(c),
  }
  saved = {name: getattr(fused, name) for name in probes}
  for name, probe in probes.items():
    setattr(fused, name, probe)
  try:
    yield
  finally:
    for name, probe in saved.items():
      setattr(fused, name, probe)


def train_batch(cfg: Config, prompt_len: int, completion_len: int, sharding=None) -> TrainBatch:
  """One step's batch as the rollout builds it (`TrainBatch.abstract`: shapes, no arrays)."""
  rows = cfg.rollout.rows
  # the second pass of a batch also carries old log-probs
  return TrainBatch.abstract(rows, prompt_len, completion_len, old_logp=cfg.train.num_iterations > 1, sharding=sharding)


def packed_train_batch(
    cfg: Config, prompt_len: int, completion_len: int, multiple: int, sharding=None
) -> tuple[TrainBatch, dict]:
  """With `train.token_budget`: (the abstract packed batch, the packing's sizes) of one step's
  batch as train.py packs it (`packing.pack_batch`, whole groups balanced, rows a multiple of
  `multiple` = data x fsdp), at its largest: every prompt and completion at full length, so the
  most micro-batches and every head stripe full (the widest head). The step scans the
  micro-batches, so its peak memory is a micro-batch's; shorter batches pack into fewer."""
  full = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), train_batch(cfg, prompt_len, completion_len))
  packed = packing.pack_batch(
      full,
      token_budget=cfg.train.token_budget,
      group_size=cfg.rollout.group_size,
      micro_batch_size=cfg.train.micro_batch_size,
      multiple=multiple,
      balance=True,
      micro_batch_tokens=cfg.train.micro_batch_tokens,
  )
  n, mb, layout = packed.rows, packed.micro_batch_rows, packed.packed
  sizes = dict(
      token_budget=cfg.train.token_budget,
      micro_batch_tokens=cfg.train.micro_batch_tokens,
      width=layout.ids.shape[1],
      micro_batches=n // mb,
      packed_rows_per_micro_batch=layout.ids.shape[0] // (n // mb),
      head_width=layout.head_ids.shape[1],
  )
  return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding), packed), sizes


@dataclasses.dataclass
class _Setup:
  """What the trainer builds before its first step, abstract, on the target's mesh."""

  cfg: Config
  mesh: Any
  mcfg: Any
  note: str
  graphdef: Any
  params: Any  # abstract float32 parameters (pure dict of ShapeDtypeStructs with shardings)
  optimizer: Any
  state_sharding: Any
  state: Any  # abstract TrainState


def _task_tokenizer(cfg: Config):
  """`model.vocab="task"`: the task vocabulary the trainer would build (the data prepared in a
  temporary folder, unless `data.data_dir` holds it)."""
  import tempfile

  from ict_jax.build import load_examples
  from ict_jax.setup import make_tokenizer

  with tempfile.TemporaryDirectory(prefix="ict_jax_aot_") as tmp:  # data.data_dir, else tmp/data
    return make_tokenizer(cfg, tmp, "", lambda split: load_examples(cfg, split, tmp))


def _setup(cfg: Config, target: Target) -> _Setup:
  devices = target_devices(target)
  cfg, note = _without_missing_model_path(cfg)
  try:
    mesh = make_mesh(cfg, devices=devices)
  except ConfigError as e:
    raise AotError(f"--target {target.name} has {target.chips} chips: {e}") from None
  mb = cfg.train.micro_batch_size or cfg.rollout.rows
  try:  # the trainer's own check, named for the target
    ts.check_micro_batch(mb, mesh)
  except ValueError as e:
    raise AotError(f"--target {target.name}: {e}") from None
  tok = None
  if cfg.model.vocab == "task" and not cfg.model.path:  # the embedding's rows come from the task's text
    tok = _task_tokenizer(cfg)
  mcfg = model_config(cfg, cfg.model.path, mesh, tok)  # "auto" attention: the target's kernel
  if cfg.train.token_budget:
    try:  # the trainer's own start-up check, named for the target
      check_packing_attention(mcfg.attention, devices)
    except ConfigError as e:
      raise AotError(f"--target {target.name}: {e}") from None
  note = "; ".join(n for n in (note, _cudnn_note(mcfg)) if n)
  model = build_model(cfg, mesh, mcfg)  # the trainer's own layout of the model and its update
  return _Setup(
      cfg, mesh, mcfg, note, model.graphdef, model.params, model.optimizer, model.state_sharding, model.abstract_state()
  )


def compile_train_step(cfg: Config, target: Target, *, prompt_len: int = 0, completion_len: int = 0) -> Report:
  """Compile the trainer's jitted step for `target`; prompt_len 0: bucket of
  data.max_prompt_len; completion_len 0: rollout.max_new_tokens."""
  su = _setup(cfg, target)
  cfg, mesh, mcfg, note, graphdef, params = su.cfg, su.mesh, su.mcfg, su.note, su.graphdef, su.params
  optimizer, state_sharding, state = su.optimizer, su.state_sharding, su.state
  prompt_len = prompt_len or bucket_length(cfg.data.max_prompt_len)
  completion_len = completion_len or cfg.rollout.max_new_tokens
  rows = cfg.rollout.rows
  mb = cfg.train.micro_batch_size or rows
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  rows_sharding = NamedSharding(mesh, P(("data", "fsdp")))
  batch, packed = train_batch(cfg, prompt_len, completion_len, rows_sharding), None
  if cfg.train.token_budget:  # the packed step train.py runs, at its largest batch
    batch, packed = packed_train_batch(cfg, prompt_len, completion_len, shards, rows_sharding)
    mb = batch.micro_batch_rows or mb
  ref = params if cfg.loss.beta > 0 else None
  step = ts.make_train_step(
      graphdef, ts.StepConfig.from_config(cfg), optimizer, mesh=mesh, state_sharding=state_sharding
  )
  with jax.set_mesh(mesh), _cudnn_tracing(mcfg):
    lowered = step.jitted.lower(state, batch, ref)
  lower = (
      f"--config.train.micro_batch_tokens (now {cfg.train.micro_batch_tokens})"
      if cfg.train.token_budget and cfg.train.micro_batch_tokens
      else f"--config.train.micro_batch_size (now {mb}; a multiple of group_size {cfg.rollout.group_size} "
      f"and of data x fsdp = {shards})"
  )
  advice = (
      f"lower {lower}, or --completion_len (now {completion_len}), or spread the model over more chips (config.mesh)"
  )
  report = measure(lowered, target, program="train_step", advice=advice)
  tokens = rows * (prompt_len + completion_len)
  report.model_flops_per_step = float(mcfg.flops_per_token(prompt_len + completion_len) * tokens)
  report.shapes = dict(
      rows=rows,
      micro_batch_size=mb,
      group_size=cfg.rollout.group_size,
      prompt_len=prompt_len,
      completion_len=completion_len,
      mesh=dict(mesh.shape),
      model=cfg.model.path or cfg.model.preset,
      num_params=mcfg.num_params(),
      dtype=mcfg.dtype,
      param_dtype=mcfg.param_dtype,
      remat_policy=mcfg.remat_policy,
      attention=mcfg.attention,
      kernels=mcfg.kernels,
      method=cfg.ict.method,
      rows_per_shard=mb // shards,
      note=note,
  )
  if packed is not None:
    report.shapes["packed"] = packed
  return report
