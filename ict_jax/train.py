"""`python -m ict_jax.train`: RLVR with GRPO / ICT on a device mesh.

    python -m ict_jax.train --workdir DIR --config configs/NAME.py --config.train.steps=200

With no flags it runs the embedded default (tiny model, bundled tokenizer, synthetic arithmetic,
`./runs/default`). Re-running the same command resumes from the latest checkpoint.

The library API, `train(cfg, workdir, hooks=[...])`, is three calls: `build_run` (ict_jax/build.py:
the checks, the mesh, the data, the tokenizer, the model's layout), `default_hooks` (ict_jax/run_hooks.py:
preemption, profiler, token view, periodic eval, health, logging, checkpoints) around your hooks,
and `Learner.fit` (ict_jax/learner.py: prompts -> G samples each -> rewards -> advantages -> jitted
step(s) -> hooks).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Callable, Sequence

import jax

from ict_jax import cli_config
from ict_jax import config as config_lib
from ict_jax.build import build_run
from ict_jax.config import ConfigError
from ict_jax.hooks import Hook, Hooks
from ict_jax.learner import Learner, OutOfDeviceMemory
from ict_jax.preemption import Preemption
from ict_jax.run_hooks import default_hooks

log = logging.getLogger("ict_jax.train")


def train(
    config_dict,
    workdir: str,
    *,
    init_from_hf: str = "",
    progress: bool = True,
    hooks: Sequence[Hook] = (),
    reward_funcs: Sequence[Callable | str] = (),
) -> list[dict]:
  """Run (or resume) training; returns the metrics of the steps run in this call.

  config_dict: a ConfigDict or dict (validated here: a bad key is one ConfigError before anything
  compiles). hooks: your own `ict_jax.hooks.Hook`s, called at each step after the built-in ones
  that read or add metrics (periodic eval, health) and before logging and checkpointing.
  reward_funcs: reward functions with TRL's signature (ict_jax/rewards/functions.py), callables or
  "module:fn" strings, in place of reward.funcs (weighted by reward.weights); with
  reward.num_workers > 0 a callable must be importable by name (a module-level function of a module,
  not a lambda or the script's __main__): a ConfigError otherwise."""
  cfg = config_lib.validate(config_dict)
  Hooks(hooks)  # a wrong type is an error now, before any data is prepared
  run = build_run(cfg, workdir, init_from_hf=init_from_hf, reward_funcs=reward_funcs)
  return Learner(run, default_hooks(run, list(hooks), progress=progress)).fit()


def load_hooks(spec: str) -> list[Hook]:
  """`--hooks "pkg.module:Name,other.module:make"` -> one hook each: `Name` a Hook subclass or a
  callable that returns a Hook, called with no arguments. ConfigError naming the entry otherwise."""
  import importlib

  hooks = []
  for entry in [e.strip() for e in spec.split(",") if e.strip()]:
    module, _, attr = entry.partition(":")
    try:
      factory = getattr(importlib.import_module(module), attr) if attr else None
    except (ImportError, AttributeError) as e:
      raise ConfigError(f"--hooks {entry}: cannot import it ({type(e).__name__}: {e})") from None
    if factory is None:
      raise ConfigError(f"--hooks {entry}: expected module:name")
    hook = factory()
    if not isinstance(hook, Hook):
      raise ConfigError(f"--hooks {entry}: returned {type(hook).__name__}, expected an ict_jax.hooks.Hook")
    hooks.append(hook)
  return hooks


def _error(msg: str) -> None:
  print(f"ict_jax.train: error: {msg}", file=sys.stderr)
  sys.exit(2)


def main(argv=None) -> None:
  from absl import flags

  fl = flags.FlagValues()
  flags.DEFINE_string(
      "workdir", "./runs/default", "Checkpoints, logs and metrics go here (local or gs://).", flag_values=fl
  )
  flags.DEFINE_string("init_from_hf", "", "Start from this local Hugging Face folder.", flag_values=fl)
  flags.DEFINE_string(
      "hooks", "", "Your own per-step hooks: module:Name[,module:Name] (ict_jax.hooks.Hook).", flag_values=fl
  )
  argv = sys.argv if argv is None else argv
  try:  # flag and --config.* override errors become one line, not a traceback
    cd = cli_config.parse(fl, argv)
  except ConfigError as e:
    _error(str(e))
  # force: importing orbax already put a WARNING-level handler on the root logger, which would
  # make basicConfig a no-op and hide every INFO line (resume step, warm-start progress)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
  logging.getLogger("absl").setLevel(logging.WARNING)
  logging.getLogger("fsspec").setLevel(logging.WARNING)  # gs://: a line per file opened otherwise
  try:
    train(cd, fl.workdir, init_from_hf=fl.init_from_hf, hooks=load_hooks(fl.hooks))
  except ConfigError as e:
    _error(str(e))
  except OutOfDeviceMemory as e:
    print(f"ict_jax.train: error: {e}", file=sys.stderr)
    sys.exit(1)
  except Exception:  # pylint: disable=broad-except
    if not jax.distributed.is_initialized():
      raise
    # several processes: typically a peer died and this host's collective with it failed. Leave
    # now: JAX's exit handler would wait in the coordination service's shutdown barrier for every
    # process, which a dead one never reaches, until train.heartbeat_timeout_s has passed
    traceback.print_exc()
    _exit(1)
  if Preemption.stopped:
    # the checkpoint is committed and the logs are closed: skip the interpreter teardown
    # (seconds of XLA / TensorStore destructors), which the grace period cannot spare
    _exit(0)


def _exit(code: int) -> None:
  """Exit now, without the interpreter teardown (and, on several processes, JAX's shutdown barrier)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


if __name__ == "__main__":
  main()
