"""Test-only phase markers of the runs benchmarks/faults kills and signals (`Run(markers=True)`).

startup/sitecustomize.py calls `install()` at start-up of every such process (and tests/host_cache.py's
of the CPU pod's). With $ICT_FAULTS_MARKERS set it wraps `rollout.collect`, the compiled train step
and `Checkpointer.save` to append `{"t", "event"}` lines to that file, optionally sleeping
($ICT_FAULTS_SLEEP="sample=2,step=8"); without it nothing is patched. The product has no fault hooks.
"""

from __future__ import annotations

import json
import os
import time

from benchmarks.faults import hook

_MARKERS = os.environ.get("ICT_FAULTS_MARKERS")
_SLEEP = dict(
    (k, float(v)) for k, v in (kv.split("=") for kv in os.environ.get("ICT_FAULTS_SLEEP", "").split(",") if kv)
)


def _mark(event, **kw):
  with open(_MARKERS, "a") as f:
    f.write(json.dumps({"t": time.time(), "event": event, **kw}) + "\n")


def _rollout(m):
  orig = m.collect

  def collect(*a, **kw):
    _mark("sample_start")
    time.sleep(_SLEEP.get("sample", 0.0))
    out = orig(*a, **kw)
    _mark("sample_end")
    return out

  m.collect = collect


def _train_step(m):
  orig = m.make_train_step

  def make_train_step(*a, **kw):
    fn = orig(*a, **kw)

    def step(*a2, **kw2):
      import jax

      _mark("step_start")
      time.sleep(_SLEEP.get("step", 0.0))
      out = jax.block_until_ready(fn(*a2, **kw2))
      _mark("step_end")
      return out

    return step

  m.make_train_step = make_train_step


def _checkpoint(m):
  orig = m.Checkpointer.save

  def save(self, step, *a, **kw):
    _mark("save_start", step=int(step))
    out = orig(self, step, *a, **kw)
    _mark("save_return", step=int(step))
    return out

  m.Checkpointer.save = save


PATCHES = {"ict_jax.rollout": _rollout, "ict_jax.train_step": _train_step, "ict_jax.checkpoint": _checkpoint}


def install() -> None:
  """Patches those modules when they are first imported, if $ICT_FAULTS_MARKERS is set."""
  if _MARKERS:
    hook.install(PATCHES)
