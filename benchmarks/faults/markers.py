"""Test-only phase markers of the runs benchmarks/faults kills and signals (`Run(markers=True)`,
tests/test_pod.py's `Pod(shim=True)`), through the trainer's own seam: a hook, named on the command
line (`python -m ict_jax.train --hooks benchmarks.faults.markers:MarkerHook`, `HOOKS_FLAG`).

It appends `{"t", "event"}` lines to $ICT_FAULTS_MARKERS at the phases of each step (the rollout,
the update, a checkpoint handed to Orbax), optionally sleeping in a phase
($ICT_FAULTS_SLEEP="sample=2,step=8"), so a test can kill or signal a run at a known phase."""

from __future__ import annotations

import json
import os
import time

from ict_jax.hooks import Hook

HOOKS_FLAG = "--hooks=benchmarks.faults.markers:MarkerHook"


def _sleeps(text: str) -> dict[str, float]:
  return dict((k, float(v)) for k, v in (kv.split("=") for kv in text.split(",") if kv))


class MarkerHook(Hook):
  """sample_start / sample_end around the rollout, step_start / step_end around the update,
  save_start / save_return around a checkpoint save; $ICT_FAULTS_SLEEP's "sample" and "step"
  seconds are slept right after their start markers."""

  def __init__(self):
    self.path = os.environ.get("ICT_FAULTS_MARKERS")
    self.sleep = _sleeps(os.environ.get("ICT_FAULTS_SLEEP", ""))

  def _mark(self, event: str, **kw) -> None:
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps({"t": time.time(), "event": event, **kw}) + "\n")

  def on_step_start(self, learner, step):
    self._mark("sample_start")
    time.sleep(self.sleep.get("sample", 0.0))

  def on_batch(self, learner, step, rollout, batch):
    self._mark("sample_end")

  def on_update_start(self, learner, step):
    self._mark("step_start")
    time.sleep(self.sleep.get("step", 0.0))

  def on_step_end(self, learner, step, metrics):
    self._mark("step_end")  # the update's metrics are on the host: the step has run

  def on_save(self, learner, step):
    self._mark("save_start", step=int(step))

  def on_saved(self, learner, step):
    self._mark("save_return", step=int(step))
