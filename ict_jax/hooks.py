"""Per-step behaviours of a run, as hooks the `Learner` calls at named points of each step.

    class PrintReward(Hook):
      def on_step_end(self, learner, step, metrics):
        print(step, metrics["reward_mean"])

    ict_jax.train.train(cfg, workdir, hooks=[PrintReward()])

A step, in the order the learner calls its hooks (each list in the order given: the built-in
hooks of `run_hooks.default_hooks` first, then the user's):

    on_run_start(learner)                      once, after the state is restored or initialised
    on_step_start(learner, step)               before the rollout (step: 0-based, steps done so far)
    on_batch(learner, step, rollout, batch)    the rollout's trimmed batch, before packing;
                                               returns the batch the update takes (or None: same)
    on_update_start(learner, step)             right before the update
    on_step_end(learner, step, metrics)        after the update (step: 1-based, steps done);
                                               `metrics` is the step's record, which a hook may add to
    on_save(learner, step)                     before a checkpoint of `step` completed steps is written
    on_saved(learner, step)                    after it was handed to Orbax (train.async_checkpointing:
                                               it commits in the background)
    on_run_end(learner)                        once, whether the run ended, stopped or raised

A hook stops the run by `learner.request_stop(why)` in on_step_start or on_update_start: the later
hooks of that call are skipped, the learner saves the state of the steps completed and returns.
Every method is optional (the base class's do nothing). On the command line, `python -m ict_jax.train
--hooks pkg.module:Name` adds hooks the same way (`Name` a Hook class or a function returning one). Hooks run on every process of a
multi-host run: write files from process 0 only (`ict_jax.sharding.is_main_process()`).
"""

from __future__ import annotations

from typing import Any, Sequence


class Hook:
  """A per-step behaviour; override the methods you need."""

  def on_run_start(self, learner) -> None:
    pass

  def on_step_start(self, learner, step: int) -> None:
    pass

  def on_batch(self, learner, step: int, rollout, batch):
    """-> the batch the update takes (a `TrainBatch`), or None to keep `batch`."""
    return None

  def on_update_start(self, learner, step: int) -> None:
    pass

  def on_step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    pass

  def on_save(self, learner, step: int) -> None:
    pass

  def on_saved(self, learner, step: int) -> None:
    pass

  def on_run_end(self, learner) -> None:
    pass


class Hooks:
  """Calls a list of hooks in order; a stop requested by one skips the rest of that call."""

  def __init__(self, hooks: Sequence[Hook]):
    for h in hooks:
      if not isinstance(h, Hook):
        raise TypeError(f"hooks: expected ict_jax.hooks.Hook instances, got {type(h).__name__}")
    self.hooks = list(hooks)

  def run_start(self, learner) -> None:
    for h in self.hooks:
      h.on_run_start(learner)

  def step_start(self, learner, step: int) -> None:
    for h in self.hooks:
      h.on_step_start(learner, step)
      if learner.stop_reason is not None:
        return

  def batch(self, learner, step: int, rollout, batch):
    for h in self.hooks:
      out = h.on_batch(learner, step, rollout, batch)
      batch = batch if out is None else out
    return batch

  def update_start(self, learner, step: int) -> None:
    for h in self.hooks:
      h.on_update_start(learner, step)
      if learner.stop_reason is not None:
        return

  def step_end(self, learner, step: int, metrics: dict[str, Any]) -> None:
    for h in self.hooks:
      h.on_step_end(learner, step, metrics)

  def save(self, learner, step: int) -> None:
    for h in self.hooks:
      h.on_save(learner, step)

  def saved(self, learner, step: int) -> None:
    for h in self.hooks:
      h.on_saved(learner, step)

  def run_end(self, learner) -> None:
    """Every hook's on_run_end, even when one raises (the first error is raised after)."""
    error = None
    for h in self.hooks:
      try:
        h.on_run_end(learner)
      except Exception as e:  # pylint: disable=broad-except
        error = error or e
    if error is not None:
      raise error
