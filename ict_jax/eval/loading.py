"""The model to evaluate: a Hugging Face folder, or a training workdir's checkpoint.

A workdir is read without writing to it: its `config.json` (the trainer's full config; the
checkpoint's `meta["config"]` when the file is missing: `setup.read_run_config`) gives the
architecture and dtypes (`setup.model_config_from_checkpoint`, the trainer's rule), and
only `state.params` of `checkpoints/<step>/` is restored (Orbax partial restore: the optimizer
moments are never read), each parameter straight into its sharding on the mesh. A LoRA run's
(model.lora_rank) are its adapters, merged into the base it froze (`setup.lora_merged_params`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax.numpy as jnp
from flax import nnx

from ict_jax import setup
from ict_jax.checkpoint import CheckpointError, CheckpointReader
from ict_jax.config import Config
from ict_jax.models.qwen2 import abstract_model

log = logging.getLogger("ict_jax.eval")


@dataclasses.dataclass
class LoadedModel:
  model: Any  # a Qwen2 nnx module
  label: str  # the row name in results tables
  step: int | None  # the checkpoint step (None for a Hugging Face folder)
  config: Config | None  # the training config (None for a Hugging Face folder)


def load_hf(hf_dir: str, *, dtype: str = "bfloat16", mesh=None) -> LoadedModel:
  """A Hugging Face Qwen2 folder or hub id (`models.hf.resolve_model_dir`), parameters and
  compute in `dtype`; the kernels are `model.kernels`'s "auto" for the devices of `mesh`
  (default jax.devices()). A hub id is the row's label."""
  from ict_jax.models.hf import load_pretrained, resolve_model_dir

  devices = None if mesh is None else list(mesh.devices.flat)
  kernels = setup.resolve_kernels("auto", devices)
  decode_attention = setup.resolve_decode_attention("auto", devices)
  local = resolve_model_dir(hf_dir)
  model = load_pretrained(local, jnp.dtype(dtype), mesh=mesh, kernels=kernels, decode_attention=decode_attention)
  label = os.path.basename(os.path.normpath(hf_dir)) if os.path.isdir(os.path.expanduser(hf_dir)) else hf_dir
  return LoadedModel(model, label or hf_dir, None, None)


def load_workdir(
    workdir: str, *, step: int | None = None, mesh=None, dtype: str | None = None, config: Config | None = None
) -> tuple[LoadedModel, Any]:
  """-> (the model at `step` (default: the latest), the mesh it lives on).

  `config` defaults to `setup.read_run_config(workdir, step)`; `mesh` to the run's `config.mesh`
  over this machine's devices; the model is `setup.model_config_from_checkpoint`'s; `dtype`
  overrides the compute dtype (parameters keep the dtype they were saved in)."""
  with CheckpointReader.of_workdir(workdir) as reader:
    step = reader.pick_step(step)
    cfg = config if config is not None else setup.read_run_config(workdir, step)
    mesh = mesh if mesh is not None else setup.make_mesh(cfg)
    mcfg = setup.model_config_from_checkpoint(workdir, config=cfg, mesh=mesh)
    if dtype is not None:
      mcfg = mcfg.replace(dtype=jnp.dtype(dtype).name)
    graphdef, abstract, _ = setup.abstract_params(mcfg, mesh)
    if cfg.model.lora_rank:  # a LoRA run's checkpoint holds its adapters, merged into the base below
      abstract = setup.lora_abstract_adapters(cfg, mcfg, mesh)
    try:
      restored = reader.restore_state(step, {"state": {"params": abstract}})
    except CheckpointError as e:
      raise CheckpointError(f"{e} (the model of the run's config)") from e.__cause__
  params = restored["state"]["params"]
  if cfg.model.lora_rank:
    params = setup.lora_merged_params(cfg, mcfg, params, mesh)
    graphdef = nnx.graphdef(abstract_model(mcfg.replace(param_dtype="float32")))
  model = nnx.merge(graphdef, params)  # the model holds only Params
  label = os.path.basename(os.path.normpath(os.fspath(workdir))) or os.fspath(workdir)
  log.info("restored state.params of step %d from %s", step, workdir)
  return LoadedModel(model, label, step, cfg), mesh
