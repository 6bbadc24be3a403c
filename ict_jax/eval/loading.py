"""The model to evaluate: a Hugging Face folder, or a training workdir's checkpoint.

A workdir is read without writing to it: its `config.json` (the trainer's full config; the
checkpoint's `meta["config"]` when the file is missing) gives the architecture and dtypes, and
only `state.params` of `checkpoints/<step>/` is restored (Orbax partial restore: the optimizer
moments are never read), each parameter straight into its sharding on the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax.numpy as jnp
from etils import epath
from flax import nnx

from ict_jax import config as config_lib
from ict_jax import setup, task_vocab
from ict_jax.checkpoint import CheckpointError, CheckpointReader, resolve_path
from ict_jax.config import Config, ConfigError

log = logging.getLogger("ict_jax.eval")


@dataclasses.dataclass
class LoadedModel:
  model: Any  # a Qwen2 nnx module
  label: str  # the row name in results tables
  step: int | None  # the checkpoint step (None for a Hugging Face folder)
  config: Config | None  # the training config (None for a Hugging Face folder)


def load_hf(hf_dir: str, *, dtype: str = "bfloat16", mesh=None) -> LoadedModel:
  """A local Hugging Face Qwen2 folder, parameters and compute in `dtype`; the kernels are
  `model.kernels`'s "auto" for the devices of `mesh` (default jax.devices())."""
  from ict_jax.models.hf import load_pretrained

  devices = None if mesh is None else list(mesh.devices.flat)
  kernels = setup.resolve_kernels("auto", devices)
  decode_attention = setup.resolve_decode_attention("auto", devices)
  model = load_pretrained(hf_dir, jnp.dtype(dtype), mesh=mesh, kernels=kernels, decode_attention=decode_attention)
  return LoadedModel(model, os.path.basename(os.path.normpath(hf_dir)) or hf_dir, None, None)


def _reader(workdir: str) -> CheckpointReader:
  directory = resolve_path(workdir) / "checkpoints"
  if not directory.exists():
    raise CheckpointError(f"{os.fspath(directory)!r} does not exist: no checkpoints in workdir {workdir!r}")
  return CheckpointReader(directory)


def read_run_config(workdir: str, step: int | None = None) -> Config:
  """The validated training config of a workdir: its config.json, else the `config` in the meta
  of checkpoint `step` (default: the latest)."""
  path = epath.Path(workdir) / "config.json"
  if path.exists():
    try:
      raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{os.fspath(path)}: not valid JSON ({e})") from None
    source = os.fspath(path)
  else:
    with _reader(workdir) as reader:
      step = reader.pick_step(step)
      meta = reader.meta(step)
    if "config" not in meta:
      raise ConfigError(f"{os.fspath(path)} is missing and checkpoint {step}'s meta has no 'config'")
    raw, source = meta["config"], f"{workdir}/checkpoints/{step}/meta"
  try:
    return config_lib.from_dict(raw)
  except ConfigError as e:
    raise ConfigError(f"{source}: {e}") from None


def load_workdir(
    workdir: str, *, step: int | None = None, mesh=None, dtype: str | None = None, config: Config | None = None
) -> tuple[LoadedModel, Any]:
  """-> (the model at `step` (default: the latest), the mesh it lives on).

  `config` defaults to `read_run_config(workdir, step)`; `mesh` to the run's `config.mesh` over
  this machine's devices; `dtype` overrides the compute dtype (parameters keep the dtype they
  were saved in)."""
  with _reader(workdir) as reader:
    step = reader.pick_step(step)
    cfg = config if config is not None else read_run_config(workdir, step)
    mesh = mesh if mesh is not None else setup.make_mesh(cfg)
    mcfg = setup.model_config(cfg, cfg.model.path, mesh, task_vocab.load_tokenizer(os.fspath(workdir)))
    if dtype is not None:
      mcfg = mcfg.replace(dtype=jnp.dtype(dtype).name)
    graphdef, abstract, _ = setup.abstract_params(mcfg, mesh)
    try:
      restored = reader.restore_state(step, {"state": {"params": abstract}})
    except CheckpointError as e:
      raise CheckpointError(f"{e} (the model of the run's config)") from e.__cause__
  model = nnx.merge(graphdef, restored["state"]["params"])  # the model holds only Params
  label = os.path.basename(os.path.normpath(os.fspath(workdir))) or os.fspath(workdir)
  log.info("restored state.params of step %d from %s", step, workdir)
  return LoadedModel(model, label, step, cfg), mesh
