"""The built-in hooks of a training run (`default_hooks`): preemption, the profiler, the token view,
periodic pass@k, health warnings, the metrics logs and checkpoints. Each is one `Hook`
(ict_jax/hooks.py) with the state it needs; `ict_jax.train.train(..., hooks=[...])` puts the
user's hooks after the ones that read or add metrics and before logging and checkpointing, so a
metric a user hook adds is logged and checkpointed with the step."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from ict_jax import config as config_lib
from ict_jax import sharding
from ict_jax import token_view as tv
from ict_jax.build import Run
from ict_jax.checkpoint import resolve_path
from ict_jax.hooks import Hook

log = logging.getLogger("ict_jax.train")
SAMPLES_LOGGED = 16  # completions per step written to the samples log


class PreemptionHook(Hook):
  """SIGTERM (one process) or JAX's preemption service (several): stop before a step starts, or
  before its update when it would not end within train.sigterm_grace_s (ict_jax/preemption.py)."""

  def __init__(self, grace_s: float):
    from ict_jax.preemption import Preemption

    self.preemption = Preemption(grace_s)

  def on_run_start(self, learner) -> None:
    self.preemption.__enter__()

  def on_step_start(self, learner, step: int) -> None:
    if self.preemption.reached(step):  # the same answer on every host at this step
      learner.request_stop("")

  def on_update_start(self, learner, step: int) -> None:
    last = learner.last_step_s
    if self.preemption.drop_step(None if last is None else 1.5 * last):  # one process only
      learner.request_stop(f": step {step + 1} would not end within train.sigterm_grace_s")

  def on_run_end(self, learner) -> None:
    self.preemption.__exit__(None, None, None)


def _profiler(action, *args) -> bool:
  """Start or stop the `train.profile_steps` trace; a failure (e.g. the profiler's own storage
  client cannot write to the workdir's bucket) is a warning and the run goes on untraced."""
  try:
    action(*args)
    return True
  except Exception as e:  # pylint: disable=broad-except  # jax.errors.JaxRuntimeError, OSError, ...
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    log.warning(
        "train.profile_steps: jax.profiler.%s failed, training goes on without the trace (%s: %s)",
        action.__name__,
        type(e).__name__,
        first[:300],
    )
    return False


class ProfilerHook(Hook):
  """A jax.profiler trace of steps a..b (train.profile_steps "a,b", 1-based) in <workdir>/profile."""

  def __init__(self, steps: tuple[int, int], workdir: str):
    self.steps, self.workdir, self.tracing = steps, workdir, False

  def on_step_start(self, learner, step: int) -> None:
    if step + 1 == self.steps[0]:
      self.tracing = _profiler(jax.profiler.start_trace, os.fspath(resolve_path(self.workdir) / "profile"))

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    if self.tracing and step == self.steps[1]:
      self.tracing = False
      if _profiler(jax.profiler.stop_trace):
        log.info("profile of steps %d-%d written to %s/profile", *self.steps, self.workdir)

  def on_run_end(self, learner) -> None:
    if self.tracing:
      self.tracing = False
      _profiler(jax.profiler.stop_trace)


def _checkpoint_due(cfg, done: int) -> bool:
  return done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps


class TokenViewHook(Hook):
  """At checkpoint steps, the per-token statistics of the first logged groups (what ICT selected,
  token by token: `ict_jax.analyze`), in <workdir>/tokens; taken before packing, whose group
  balancing reorders the rows."""

  def __init__(self, run: Run):
    self.run, self.tokens, self.view = run, None, None

  def on_run_start(self, learner) -> None:
    from ict_jax.train_step import StepConfig

    groups = max(1, SAMPLES_LOGGED // self.run.cfg.rollout.group_size)
    self.view = tv.TokenView(learner.graphdef, StepConfig.from_config(self.run.cfg), groups=groups, mesh=self.run.mesh)

  def on_batch(self, learner, step: int, rollout, batch):
    cfg, self.tokens = self.run.cfg, None
    if _checkpoint_due(cfg, step + 1):
      self.tokens = tv.records(
          step + 1,
          self.view(learner.policy_params(), batch),
          self.run.tokenizer,
          dict(zip(rollout.rows.tolist(), rollout.golds)),  # the rows this host scored
          rollout.rewards,
          batch.advantages,
          dense_warmup=cfg.ict.method == "ict" and step < cfg.ict.warmup_steps,
      )
    return None

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    if self.tokens and sharding.is_main_process():
      tv.write(self.run.workdir, step, self.tokens)


class PeriodicEvalHook(Hook):
  """pass@1 / pass@k on the first train.eval_prompts held-out problems every train.eval_every
  steps and after the last (`ict_jax.eval.periodic`), added to the step's metrics."""

  def __init__(self, run: Run):
    self.run, self.periodic = run, None

  def on_run_start(self, learner) -> None:
    from ict_jax.build import load_examples
    from ict_jax.eval.periodic import PeriodicEval

    cfg = self.run.cfg
    source = load_examples(cfg, cfg.data.eval_split, self.run.workdir)
    self.periodic = PeriodicEval.from_config(cfg, self.run.tokenizer, source, mesh=self.run.mesh)

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    if self.periodic.due(step, self.run.cfg.train.steps):
      metrics.update(self.periodic((learner.graphdef, learner.policy_params()), learner.reward_pool))


class HealthHook(Hook):
  """Dead ends said in the log while the run goes on (ict_jax/health.py)."""

  def __init__(self, cfg):
    from ict_jax.health import RunHealth

    self.health = RunHealth(
        max_new_tokens=cfg.rollout.max_new_tokens, mask_truncated=cfg.loss.mask_truncated_completions
    )

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    for warning in self.health.check(metrics):
      log.warning("%s", warning)


class LoggingHook(Hook):
  """The metrics and samples logs, TensorBoard, W&B and the progress bar (ict_jax/logs.py), from
  process 0; flushed before every checkpoint, so a resume from it keeps every step it covers."""

  def __init__(self, run: Run, *, progress: bool = True):
    self.run, self.progress, self.logger = run, progress, None

  def on_run_start(self, learner) -> None:
    from ict_jax.logs import MetricsLogger

    cfg = self.run.cfg
    self.logger = MetricsLogger(
        self.run.workdir,
        enabled=sharding.is_main_process(),
        progress=self.progress,
        total=cfg.train.steps,
        initial=learner.start_step,
        config=config_lib.to_dict(cfg),
        wandb_project=cfg.log.wandb_project,
    )

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    roll, tok = learner.current.rollout, self.run.tokenizer
    shown = roll.rows[:SAMPLES_LOGGED]  # rows this host scored (process 0 writes the logs)
    prompts = tok.decode_batch([i[k != 0] for i, k in zip(roll.prompt_ids[shown], roll.prompt_mask[shown])])
    samples = [
        {"prompt": p, "completion": c, "gold": str(gd), "reward": float(roll.rewards[r])}
        for p, r, c, gd in zip(prompts, shown, roll.completions, roll.golds)
    ]
    self.logger.write(metrics, samples=samples)

  def on_save(self, learner, step: int) -> None:
    if self.logger is not None:
      self.logger.flush()

  def on_run_end(self, learner) -> None:
    if self.logger is not None:
      self.logger.close()


class CheckpointHook(Hook):
  """A checkpoint every train.checkpoint_every steps and after the last (`Learner.save`)."""

  def __init__(self, cfg):
    self.cfg = cfg

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    if _checkpoint_due(self.cfg, step):
      learner.save(step, force=True)


def default_hooks(run: Run, user: list[Hook] = (), *, progress: bool = True) -> list[Hook]:
  """The run's built-in hooks around the user's: preemption and the profiler first (they act at a
  step's start), the token view, periodic eval and health, then `user`, then logging and
  checkpointing (last: a checkpoint covers every metric the hooks before it added)."""
  cfg = run.cfg
  hooks: list[Hook] = [PreemptionHook(cfg.train.sigterm_grace_s)]
  if cfg.train.profile_steps:
    hooks.append(ProfilerHook(config_lib.profile_range(cfg.train.profile_steps), run.workdir))
  hooks.append(TokenViewHook(run))
  if cfg.train.eval_every:
    hooks.append(PeriodicEvalHook(run))
  hooks.append(HealthHook(cfg))
  return hooks + list(user) + [LoggingHook(run, progress=progress), CheckpointHook(cfg)]
