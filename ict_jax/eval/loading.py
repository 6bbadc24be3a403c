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
from ict_jax import setup
from ict_jax.checkpoint import CheckpointError, resolve_path
from ict_jax.config import Config, ConfigError

log = logging.getLogger("ict_jax.eval")


@dataclasses.dataclass
class LoadedModel:
    model: Any                 # a Qwen2 nnx module
    label: str                 # the row name in results tables
    step: int | None           # the checkpoint step (None for a Hugging Face folder)
    config: Config | None      # the training config (None for a Hugging Face folder)


def load_hf(hf_dir: str, *, dtype: str = "bfloat16", mesh=None) -> LoadedModel:
    """A local Hugging Face Qwen2 folder, parameters and compute in `dtype`."""
    from ict_jax.models.hf import load_pretrained
    model = load_pretrained(hf_dir, jnp.dtype(dtype), mesh=mesh)
    return LoadedModel(model, os.path.basename(os.path.normpath(hf_dir)) or hf_dir, None, None)


def _manager(workdir: str):
    import orbax.checkpoint as ocp
    directory = resolve_path(workdir) / "checkpoints"
    if not directory.exists():
        raise CheckpointError(f"{os.fspath(directory)!r} does not exist: no checkpoints in workdir {workdir!r}")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    return ocp, ocp.CheckpointManager(directory, options=options)


def _pick_step(mngr, workdir: str, step: int | None) -> int:
    steps = sorted(int(s) for s in mngr.all_steps())
    if not steps:
        raise CheckpointError(f"no checkpoints in {workdir!r}/checkpoints")
    if step is None:
        return steps[-1]
    if int(step) not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {workdir!r}/checkpoints; available steps: {steps}")
    return int(step)


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
        ocp, mngr = _manager(workdir)
        try:
            step = _pick_step(mngr, workdir, step)
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        finally:
            mngr.close()
        if "config" not in meta:
            raise ConfigError(f"{os.fspath(path)} is missing and checkpoint {step}'s meta has no 'config'")
        raw, source = meta["config"], f"{workdir}/checkpoints/{step}/meta"
    try:
        return config_lib.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_workdir(workdir: str, *, step: int | None = None, mesh=None, dtype: str | None = None,
                 config: Config | None = None) -> tuple[LoadedModel, Any]:
    """-> (the model at `step` (default: the latest), the mesh it lives on).

    `config` defaults to `read_run_config(workdir, step)`; `mesh` to the run's `config.mesh` over
    this machine's devices; `dtype` overrides the compute dtype (parameters keep the dtype they
    were saved in)."""
    ocp, mngr = _manager(workdir)
    try:
        step = _pick_step(mngr, workdir, step)
        cfg = config if config is not None else read_run_config(workdir, step)
        mesh = mesh if mesh is not None else setup.make_mesh(cfg)
        mcfg = setup.model_config(cfg, cfg.model.path, mesh)
        if dtype is not None:
            mcfg = mcfg.replace(dtype=jnp.dtype(dtype).name)
        graphdef, abstract, _ = setup.abstract_params(mcfg, mesh)
        target = {"state": {"params": abstract}}
        args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(state=args))
        except Exception as e:
            raise CheckpointError(f"{workdir!r}/checkpoints/{step}: cannot restore state.params for the "
                                  f"model of its config ({type(e).__name__}: {str(e)[:500]})") from e
    finally:
        mngr.close()
    model = nnx.merge(graphdef, restored.state["state"]["params"])  # the model holds only Params
    label = os.path.basename(os.path.normpath(os.fspath(workdir))) or os.fspath(workdir)
    log.info("restored state.params of step %d from %s", step, workdir)
    return LoadedModel(model, label, step, cfg), mesh

