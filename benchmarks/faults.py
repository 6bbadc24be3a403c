"""Fault injection for the training program, end to end: one Markdown row per fault, then JSON.

    python benchmarks/faults.py                          # every fault; 10 kills; 200-step soak
    python benchmarks/faults.py --only kill,sigterm --kills 3 --json out.json

Faults (each through `python -m ict_jax.train`, a fresh process per run, 1 CPU device):
  kill       SIGKILL during sampling, during the train step and during an async checkpoint save,
             `--kills` times in one run directory; each time the same command is re-run. Checked:
             it resumes from the newest complete checkpoint, at most checkpoint_every steps are
             lost, and the final metrics log equals an uninterrupted run's step by step.
  sigterm    SIGTERM during a step (the step finishes, is saved, exit 0 within
             train.sigterm_grace_s) and during sampling when the step would not fit in the grace
             period (the step is dropped, the last completed state saved, exit 0 in time); the
             continued runs equal an uninterrupted one.
  nonfinite  NaN advantages (-> NaN gradients) at one step and +inf activations feeding the LM
             head (-> non-finite logits) at another: both updates are skipped and counted, the
             parameters stay unchanged at those steps and finite throughout, training goes on.
  ckpt       a data file of the newest checkpoint truncated: the re-run warns naming it, resumes
             from the previous one, equals the uninterrupted run, and leaves a readable newest step.
  hf         bad --init_from_hf folders: one `error:` line naming the file (and tensor), exit != 0.
  rewards    hostile completions through RewardPool workers: reward 0, bounded time and memory.
  data       bad GSM8K files in data.manual_dir through the trainer: bad rows skipped and logged
             with file:row; an empty file is one error naming it.
  config     CLI config abuse: one line, exit != 0, nothing compiled, no checkpoint written.
  soak       --soak-steps steps, checkpoints every 10, keep 3: disk, host memory (RSS) and open
             file descriptors of the trainer sampled over time.

Phases are hit with a test-only `sitecustomize` put on PYTHONPATH of the killed runs (the
command line is unchanged): it wraps `rollout.collect`, the compiled train step and
`Checkpointer.save` to append `{"t", "event"}` lines to $ICT_FAULTS_MARKERS (optionally sleeping,
$ICT_FAULTS_SLEEP="sample=2,step=8"); the product has no fault hooks.
`tests/test_faults.py` runs the same functions with small settings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METRIC_KEYS = ("reward_mean", "loss", "entropy", "grad_norm")
RTOL, ATOL = 1e-4, 1e-6

# Start-up code (a sitecustomize.py's) that patches a module right after it is first imported:
# `sys.meta_path.insert(0, _PatchOnImport({name: patch(module)}))`. SHIM below uses it, and so does
# tests/host_cache.py.
ON_IMPORT = textwrap.dedent("""
    import importlib.abc, importlib.machinery

    class _PatchOnImport(importlib.abc.MetaPathFinder):
      def __init__(self, patches):
        self.patches = patches
      def find_spec(self, name, path, target=None):
        if name not in self.patches:
          return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
          return spec
        run = spec.loader.exec_module
        def exec_module(module):
          run(module)
          self.patches[name](module)
        spec.loader.exec_module = exec_module
        return spec
""")

SHIM = ON_IMPORT + textwrap.dedent('''
    """Test-only phase markers for benchmarks/faults.py (see its docstring)."""
    import json, os, sys, time

    _MARKERS = os.environ.get("ICT_FAULTS_MARKERS")
    _SLEEP = dict((k, float(v)) for k, v in (kv.split("=") for kv in
                  os.environ.get("ICT_FAULTS_SLEEP", "").split(",") if kv))

    def _mark(event, **kw):
      with open(_MARKERS, "a") as f:
        f.write(json.dumps({"t": time.time(), "event": event, **kw}) + "\\n")

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

    _PATCHES = {"ict_jax.rollout": _rollout, "ict_jax.train_step": _train_step,
                "ict_jax.checkpoint": _checkpoint}

    if _MARKERS:
      sys.meta_path.insert(0, _PatchOnImport(_PATCHES))
''')


# ---- running the CLI ---------------------------------------------------------------------------
def env(devices: int = 1, **extra) -> dict:
  e = dict(os.environ)
  e.update(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
      TF_CPP_MIN_LOG_LEVEL="3",
      HF_HUB_OFFLINE="1",
      TRANSFORMERS_OFFLINE="1",
      PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [e.get("PYTHONPATH")] if p]),
  )
  e.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ict_jax_faults_jax_cache"))
  e.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  e.update({k: str(v) for k, v in extra.items()})
  return e


def quick_flags(
    steps: int,
    every: int,
    *,
    sft: int = 20,
    prompts: int = 4,
    group: int = 4,
    keep: int = 3,
    data_dir: str = "",
    extra=(),
) -> list[str]:
  """The one-step tiny config (configs/tiny_arith.py, `tiny_config()`), shortened as
  tests/test_train.py's `_quick`, as CLI flags: 20 warm-start steps already give it rewards and
  gradients (the default's worked solutions need hundreds)."""
  flags = [
      f"--config={REPO / 'configs' / 'tiny_arith.py'}",
      f"--config.train.steps={steps}",
      f"--config.train.checkpoint_every={every}",
      f"--config.warm_start.sft_steps={sft}",
      f"--config.rollout.prompts_per_step={prompts}",
      f"--config.rollout.group_size={group}",
      f"--config.train.keep_checkpoints={keep}",
      "--config.mesh.fsdp=1",
  ]
  if data_dir:
    flags.append(f"--config.data.data_dir={data_dir}")
  return flags + list(extra)


class Run:
  """One `python -m ict_jax.train` process; stdout/stderr go to files in `logdir`."""

  def __init__(
      self,
      workdir,
      flags,
      logdir,
      *,
      name="run",
      markers=False,
      sleep="",
      devices=1,
      module="ict_jax.train",
      extra_env=None,
  ):
    # a gs:// workdir stays a string (Path would fold "gs://b" into "gs:/b")
    self.workdir = workdir if "://" in os.fspath(workdir) else Path(workdir)
    self.logdir = Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    self.err_path, self.out_path = self.logdir / f"{name}.err", self.logdir / f"{name}.out"
    self.markers = self.logdir / f"{name}.markers" if markers else None
    extra = dict(extra_env or {})
    if markers:
      shim_dir = self.logdir / "shim"
      shim_dir.mkdir(exist_ok=True)
      (shim_dir / "sitecustomize.py").write_text(SHIM)
      self.markers.write_text("")
      e = env(devices, ICT_FAULTS_MARKERS=self.markers, ICT_FAULTS_SLEEP=sleep, **extra)
      e["PYTHONPATH"] = os.pathsep.join([str(shim_dir), e["PYTHONPATH"]])
    else:
      e = env(devices, **extra)
    # the config file before its overrides (absl reads --config.a.b only after --config)
    flags = sorted(flags, key=lambda f: not f.startswith("--config="))
    self.cmd = [sys.executable, "-m", module, f"--workdir={self.workdir}", *flags]
    self.t0 = time.monotonic()
    with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
      self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=e, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    self.pid = self.proc.pid

  def events(self) -> list[dict]:
    if self.markers is None or not self.markers.exists():
      return []
    return [json.loads(line) for line in self.markers.read_text().splitlines() if line.strip()]

  def wait_event(self, event: str, count: int = 1, timeout: float = 900.0) -> bool:
    """Poll until `event` has happened `count` times in this process; False if it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if sum(e["event"] == event for e in self.events()) >= count:
        return True
      if self.proc.poll() is not None:
        return False
      time.sleep(0.02)
    raise TimeoutError(f"{event} x{count} not seen in {timeout} s ({self.err_path})")

  def wait(self, timeout: float = 1800.0) -> int:
    rc = self.proc.wait(timeout)
    self.seconds = time.monotonic() - self.t0
    return rc

  def stderr(self) -> str:
    return self.err_path.read_text(errors="replace")

  def error_lines(self) -> list[str]:
    """Non-empty stderr lines, progress-bar redraws (\\r) split out."""
    text = self.stderr().replace("\r", "\n")
    return [line for line in text.splitlines() if line.strip()]


def run_to_end(workdir, flags, logdir, name, timeout=1800.0, **kw) -> Run:
  r = Run(workdir, flags, logdir, name=name, **kw)
  rc = r.wait(timeout)
  if rc != 0:
    raise RuntimeError(f"{name}: exit {rc}; stderr tail:\n" + r.stderr()[-3000:])
  return r


def metrics(workdir) -> list[dict]:
  from ict_jax.logs import read_log

  return read_log(workdir, "metrics")


def resumed_from(stderr: str) -> int:
  """The step the run restored (0 when it started from scratch)."""
  found = re.findall(r"resumed from step (\d+)", stderr)
  return int(found[-1]) if found else 0


def checkpoint_dirs(workdir) -> tuple[list[int], list[str]]:
  """(complete step directories, names of anything else: in-flight / killed temporaries)."""
  d = Path(workdir) / "checkpoints"
  if not d.is_dir():
    return [], []
  steps, other = [], []
  for p in d.iterdir():
    if p.is_dir() and p.name.isdigit():
      steps.append(int(p.name))
    elif p.is_dir():
      other.append(p.name)
  return sorted(steps), sorted(other)


def compare(a: list[dict], b: list[dict], keys=METRIC_KEYS) -> dict:
  """Largest |a - b| / (atol + rtol |a|) over steps and keys (<= 1: equal to tolerance)."""
  by_step = {r["step"]: r for r in a}
  worst, where = 0.0, None
  if [r["step"] for r in b] != sorted(by_step)[: len(b)] or not b:
    return {"ok": False, "why": f"steps {[r['step'] for r in b]} vs {sorted(by_step)}"}
  for rb in b:
    ra = by_step[rb["step"]]
    for k in keys:
      x, y = float(ra[k]), float(rb[k])
      err = abs(x - y) / (ATOL + RTOL * abs(x))
      if err > worst:
        worst, where = err, f"step {rb['step']} {k}: {x!r} vs {y!r}"
  return {"ok": worst <= 1.0, "worst": worst, "where": where, "steps": len(b)}


def du(path) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def row(fault, done, expected, observed, passed, **details) -> dict:
  return {"fault": fault, "done": done, "expected": expected, "observed": observed, "passed": bool(passed), **details}


# ---- kill -9 -----------------------------------------------------------------------------------
def reference_run(root, steps, every, data_dir) -> tuple[Path, list[dict], Run]:
  workdir = Path(root) / "reference"
  r = run_to_end(workdir, quick_flags(steps, every, data_dir=data_dir), Path(root) / "logs", "reference")
  return workdir, metrics(workdir), r


def _kill_once(workdir, flags, logdir, name, phase, rng, ref_rows) -> dict:
  """Start the run with markers, SIGKILL it inside `phase`; what was observed."""
  r = Run(workdir, flags, logdir, name=name, markers=True)
  nth = rng.randint(1, 2)
  timings = {"sample": [x["sample_s"] for x in ref_rows], "step": [x["step_s"] for x in ref_rows[1:]]}
  info = {"phase": phase, "nth": nth}
  if phase in ("sample", "step"):
    if not r.wait_event(f"{phase}_start", nth):
      r.wait()
      return {**info, "hit": False, "why": "run ended first", "rc": r.proc.returncode}
    # a random moment early in the phase (the shortest one of the reference run), so that a
    # loaded machine's polling latency does not carry the kill past its end
    time.sleep(rng.uniform(0.0, 0.25 if phase == "sample" else 0.5) * min(timings[phase][1:] or [0.0]))
    before = dict(zip(("steps", "other"), checkpoint_dirs(workdir)))
    r.proc.send_signal(signal.SIGKILL)
    r.wait()
    ev = [e["event"] for e in r.events() if e["event"].startswith(("sample", "step"))]
    info["hit"] = bool(ev) and ev[-1] == f"{phase}_start"
    info["last_event"] = ev[-1] if ev else None
  else:  # an async save: kill while Orbax's temporary directory is there
    if not r.wait_event("save_start", nth):
      r.wait()
      return {**info, "hit": False, "why": "run ended first", "rc": r.proc.returncode}
    save_step = [e for e in r.events() if e["event"] == "save_start"][nth - 1]["step"]
    deadline, seen = time.monotonic() + 60, None
    while time.monotonic() < deadline and r.proc.poll() is None:
      steps, other = checkpoint_dirs(workdir)
      seen = [o for o in other if o.startswith(f"{save_step}.")]
      if seen or save_step in steps:
        break
      time.sleep(0.005)
    before = {"steps": checkpoint_dirs(workdir)[0], "other": seen}
    r.proc.send_signal(signal.SIGKILL)
    r.wait()
    steps, other = checkpoint_dirs(workdir)
    info["save_step"] = save_step
    info["hit"] = save_step not in steps and any(o.startswith(f"{save_step}.") for o in other)
    info["left_behind"] = other
  rows = metrics(workdir)
  info.update(
      rc=r.proc.returncode,
      last_logged=rows[-1]["step"] if rows else 0,
      complete=[s for s in checkpoint_dirs(workdir)[0]],
      seconds=round(r.seconds, 1),
      before=before,
  )
  return info


def kill_resume(
    root, *, kills=10, steps=None, every=2, seed=0, data_dir="", ref=None, phases=("sample", "step", "save")
) -> dict:
  """SIGKILL `kills` times (cycling through `phases`), re-running the same command each time."""
  root = Path(root)
  data_dir = data_dir or str(root / "data")
  steps = steps or 4 + 2 * kills
  rng = random.Random(seed)
  ref_dir, ref_rows, _ = ref or reference_run(root, steps, every, data_dir)
  workdir, logdir = root / "killed", root / "logs"
  flags = quick_flags(steps, every, data_dir=data_dir)
  cycles = []
  for i, phase in enumerate(phases[i % len(phases)] for i in range(kills)):
    info = _kill_once(workdir, flags, logdir, f"kill{i}", phase, rng, ref_rows)
    cycles.append(info)
    if info.get("rc") == 0:  # finished before the kill: nothing more to interrupt
      break
  final = run_to_end(workdir, flags, logdir, "final")
  # each re-run resumed from the newest complete checkpoint the kill left
  resumes = [resumed_from((logdir / f"kill{i}.err").read_text(errors="replace")) for i in range(1, len(cycles))]
  resumes.append(resumed_from(final.stderr()))
  for info, start in zip(cycles, resumes):
    info["resumed_from"] = start
    info["expected_resume"] = max(info.get("complete") or [0])
    info["lost"] = info.get("last_logged", 0) - start
  cmp = compare(ref_rows, metrics(workdir))
  leftovers = checkpoint_dirs(workdir)[1]
  ok = (
      all(c["hit"] for c in cycles)
      and all(c["resumed_from"] == c["expected_resume"] for c in cycles)
      and all(0 <= c["lost"] <= every for c in cycles)
      and cmp["ok"]
      and not leftovers
  )
  hits = {p: sum(c["hit"] and c["phase"] == p for c in cycles) for p in ("sample", "step", "save")}
  return row(
      "kill -9 (sampling / step / async save)",
      f"{len(cycles)} SIGKILLs of a {steps}-step run (checkpoint_every={every}), same command re-run each time",
      f"resume from newest complete checkpoint, <= {every} steps lost, metrics == uninterrupted run",
      f"phases hit {hits}; resumed from {[c['resumed_from'] for c in cycles]} (expected "
      f"{[c['expected_resume'] for c in cycles]}); lost {[c['lost'] for c in cycles]} steps; "
      f"{', '.join(l for c in cycles for l in c.get('left_behind', []))[:80] or 'no'} temp dirs left by killed saves, "
      f"{len(leftovers)} after resume; metrics max err {cmp.get('worst', float('nan')):.2g} x tol over {cmp.get('steps')} steps",
      ok,
      cycles=cycles,
      compare=cmp,
  )


# ---- SIGTERM -----------------------------------------------------------------------------------
def _sigterm_once(workdir, flags, logdir, name, phase, grace, sleep) -> dict:
  r = Run(workdir, flags + [f"--config.train.sigterm_grace_s={grace}"], logdir, name=name, markers=True, sleep=sleep)
  # the first step (compile) measured, then SIGTERM inside the second step's `phase`
  assert r.wait_event("step_end", 1), r.stderr()[-2000:]
  assert r.wait_event(f"{phase}_start", 2), r.stderr()[-2000:]
  t0 = time.monotonic()
  r.proc.send_signal(signal.SIGTERM)
  rc = r.wait()
  elapsed = time.monotonic() - t0
  rows = metrics(workdir)
  steps, other = checkpoint_dirs(workdir)
  last = rows[-1]["step"] if rows else 0
  return {
      "phase": phase,
      "grace_s": grace,
      "rc": rc,
      "exit_s": round(elapsed, 2),
      "last_logged": last,
      "saved": steps,
      "temp_dirs": other,
      "ok": rc == 0 and elapsed <= grace and steps and steps[-1] == last and not other,
  }


SIGTERM_CASES = (("step", 30.0, ""), ("sample", 8.0, "sample=1,step=12"))  # phase, grace s, sleeps


def sigterm(root, *, data_dir="", ref=None, steps=8, every=4, cases=SIGTERM_CASES) -> dict:
  """SIGTERM in the step (it fits the grace) and in sampling (the step would not fit)."""
  root = Path(root)
  data_dir = data_dir or str(root / "data")
  ref_dir, ref_rows, _ = ref or reference_run(root, steps, every, data_dir)
  logdir, flags = root / "logs", quick_flags(steps, every, data_dir=data_dir)
  results = []
  for phase, grace, sleep in cases:
    workdir = root / f"sigterm_{phase}"
    info = _sigterm_once(workdir, flags, logdir, f"sigterm_{phase}", phase, grace, sleep)
    final = run_to_end(workdir, flags, logdir, f"sigterm_{phase}_resume")
    info["resumed_from"] = resumed_from(final.stderr())
    info["compare"] = compare(ref_rows, metrics(workdir))
    info["ok"] = bool(info["ok"] and info["resumed_from"] == info["last_logged"] and info["compare"]["ok"])
    results.append(info)
  cases = results
  return row(
      "SIGTERM",
      "SIGTERM during a train step (grace 30 s); during sampling, the step (slowed to 12 s) not fitting the grace (8 s)",
      "final save of the last completed step, exit 0 within train.sigterm_grace_s; resume == uninterrupted",
      "; ".join(
          f"{c['phase']}: rc {c['rc']} after {c['exit_s']} s (grace {c['grace_s']:.0f}), saved {c['saved']}, "
          f"last logged {c['last_logged']}, resumed {c['resumed_from']}, metrics "
          f"{'equal' if c['compare']['ok'] else 'DIFFER'}"
          for c in cases
      ),
      all(c["ok"] for c in cases),
      cases=cases,
  )


# ---- non-finite values ---------------------------------------------------------------------------
def _nonfinite_child(workdir: str, steps: int, nan_step: int, inf_step: int) -> None:
  """Runs in a subprocess: train() with NaN advantages at `nan_step` and +inf activations before
  the LM head at `inf_step` (1-based), recording per step whether the parameters changed."""
  import jax
  import numpy as np

  import ict_jax.train as tr
  import ict_jax.train_step as ts
  from ict_jax import configs

  calls, record = [0], []
  collect, logp_and_stats, make_step = tr.collect, ts.completion_logp_and_stats, ts.make_train_step

  def faulty_collect(*a, **kw):
    roll = collect(*a, **kw)
    calls[0] += 1
    step, batch = calls[0], roll.batch

    def with_faults():
      b = batch()
      b["logit_fault"] = np.full(len(b["advantages"]), np.inf if step == inf_step else 0.0, np.float32)
      if step == nan_step:
        b["advantages"] = np.full_like(b["advantages"], np.nan)
      return b

    roll.batch = with_faults
    return roll

  class FaultyModel:  # hidden states + fault[:, None, None] -> non-finite logits on that step

    def __init__(self, model, fault):
      self.model, self.fault, self.cfg = model, fault, model.cfg

    def hidden_states(self, ids, mask):
      return self.model.hidden_states(ids, mask) + self.fault[:, None, None]

    def head_weight(self):
      return self.model.head_weight()

  def faulty_logp_and_stats(model, batch, **kw):
    if "logit_fault" in batch:
      model = FaultyModel(model, batch["logit_fault"])
    return logp_and_stats(model, batch, **kw)

  def watched_step(*a, **kw):
    fn = make_step(*a, **kw)

    def step(state, batch, ref_params=None):
      before = jax.device_get(state.params)
      out = fn(state, batch, ref_params)
      after = jax.device_get(out[0].params)
      pairs = list(zip(jax.tree.leaves(before), jax.tree.leaves(after)))
      record.append(
          {
              "delta": float(max(np.abs(b - a).max() for a, b in pairs)),
              "finite": bool(all(np.isfinite(b).all() for _, b in pairs)),
          }
      )
      return out

    return step

  tr.collect, ts.completion_logp_and_stats, ts.make_train_step = (faulty_collect, faulty_logp_and_stats, watched_step)
  c = configs.tiny_config()
  c.warm_start.sft_steps, c.rollout.prompts_per_step, c.rollout.group_size = 20, 4, 4
  c.train.steps, c.train.checkpoint_every, c.mesh.fsdp = steps, steps, 1
  history = tr.train(c, workdir, progress=False)
  out = [
      {k: h[k] for k in ("step", "loss", "grad_norm", "skipped", "total_skipped")} | p for h, p in zip(history, record)
  ]
  Path(workdir, "nonfinite.json").write_text(json.dumps(out))


def nonfinite(root, *, steps=7, nan_step=3, inf_step=5) -> dict:
  root = Path(root)
  workdir = root / "nonfinite"
  r = Run(
      workdir,
      [],
      root / "logs",
      name="nonfinite",
      module="benchmarks.faults",
      extra_env={"ICT_FAULTS_CHILD": json.dumps(["nonfinite", str(workdir), steps, nan_step, inf_step])},
  )
  rc = r.wait()
  if rc != 0:
    return row("non-finite logits / gradients", "", "", f"child failed (exit {rc}): {r.stderr()[-300:]}", False)
  rec = json.loads((workdir / "nonfinite.json").read_text())
  faults = {nan_step, inf_step}
  skipped = [int(x["skipped"]) for x in rec]
  ok = (
      len(rec) == steps
      and skipped == [int(x["step"] in faults) for x in rec]
      and int(rec[-1]["total_skipped"]) == len(faults)
      and all(x["delta"] == 0.0 for x in rec if x["step"] in faults)
      and all(x["finite"] for x in rec)
      and all(x["loss"] == x["loss"] and abs(x["loss"]) != float("inf") for x in rec if x["step"] not in faults)
      and any(x["delta"] > 0 for x in rec if x["step"] > max(faults))
  )
  return row(
      "non-finite logits / gradients",
      f"NaN advantages at step {nan_step} (NaN grads), +inf activations into the LM head at step {inf_step} "
      f"(non-finite logits), {steps} steps in-process",
      "update skipped and counted (skipped, total_skipped), params unchanged there and finite, training continues",
      f"skipped per step {skipped}, total_skipped {int(rec[-1]['total_skipped'])}; loss at faults "
      f"{[rec[s - 1]['loss'] for s in sorted(faults)]}; param change at faults "
      f"{[rec[s - 1]['delta'] for s in sorted(faults)]}, after {max(rec[s]['delta'] for s in range(max(faults), steps)):.2g}; "
      f"params finite at every step: {all(x['finite'] for x in rec)}",
      ok,
      steps=rec,
  )


# ---- truncated checkpoint ------------------------------------------------------------------------
def truncated_checkpoint(root, *, data_dir="", ref=None, steps=6, every=2) -> dict:
  """Truncate the biggest data file of the newest step of a finished run; re-run twice."""
  root = Path(root)
  data_dir = data_dir or str(root / "data")
  ref_dir, ref_rows, _ = ref or reference_run(root, steps, every, data_dir)
  workdir, logdir = root / "truncated", root / "logs"
  shutil.copytree(ref_dir, workdir)
  newest = checkpoint_dirs(workdir)[0][-1]
  step_dir = workdir / "checkpoints" / str(newest)
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
  bad = max(files, key=lambda p: p.stat().st_size)
  size = bad.stat().st_size
  with open(bad, "r+b") as f:
    f.truncate(size // 2)
  flags = quick_flags(steps, every, data_dir=data_dir)
  first = run_to_end(workdir, flags, logdir, "truncated_rerun")
  warned = [l for l in first.error_lines() if "unreadable" in l and str(step_dir) in l]
  start = resumed_from(first.stderr())
  cmp = compare(ref_rows, metrics(workdir))
  second = run_to_end(workdir, flags, logdir, "truncated_rerun2")
  start2 = resumed_from(second.stderr())
  aside = (
      sorted(p.name for p in (workdir / "checkpoints_unreadable").glob("*") if p.is_dir())
      if (workdir / "checkpoints_unreadable").exists()
      else []
  )
  ok = bool(warned) and start == newest - every and cmp["ok"] and start2 == newest
  return row(
      "checkpoint truncated on disk",
      f"{bad.relative_to(workdir)} of step {newest} cut to {size // 2} of {size} bytes; same command re-run twice",
      f"warning naming checkpoints/{newest}, resume from {newest - every}, metrics == uninterrupted, "
      f"then step {newest} readable again",
      f"warning: {(warned[0].split('ict_jax.checkpoint: ')[-1][:110] + '...') if warned else 'NONE'}; resumed from "
      f"{start}; metrics {'equal' if cmp['ok'] else 'DIFFER'} ({cmp.get('steps')} steps); next re-run resumed from {start2}; "
      f"checkpoints_unreadable/ holds {aside}",
      ok,
      compare=cmp,
      resumed=[start, start2],
      set_aside=aside,
  )


# ---- bad model folders ---------------------------------------------------------------------------
def _hf_folder(path: Path) -> None:
  """A small valid Qwen2 folder (vocabulary of the bundled tokenizer), written by ict_jax."""
  from flax import nnx

  from ict_jax import save_pretrained
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import Qwen2

  cfg = Qwen2Config(
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=256,
  )
  save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(params=0)), str(path))


def _rewrite(path: Path, mutate) -> None:
  from safetensors.numpy import load_file, save_file

  f = path / "model.safetensors"
  tensors = load_file(str(f))
  mutate(tensors)
  save_file(tensors, str(f), metadata={"format": "pt"})


def _set_model_type(path: Path) -> None:
  cfg = json.loads((path / "config.json").read_text())
  cfg["model_type"] = "llama"
  (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path: Path) -> None:
  f = path / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[: len(data) // 2])


HF_FAULTS = {  # name -> (mutation, words the error line must contain)
    "wrong-shaped tensor": (
        lambda p: _rewrite(
            p,
            lambda t: t.update(
                {"model.layers.0.self_attn.k_proj.weight": __import__("numpy").zeros((8, 15), "float32")}
            ),
        ),
        ("model.safetensors", "model.layers.0.self_attn.k_proj.weight", "(8, 15)"),
    ),
    "missing tensor": (
        lambda p: _rewrite(p, lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
        ("model.layers.0.mlp.up_proj.weight", "missing"),
    ),
    "bad config.json": (lambda p: (p / "config.json").write_text("{not json"), ("config.json", "JSON")),
    "truncated safetensors": (_truncate, ("model.safetensors", "truncated")),
    "model_type llama": (_set_model_type, ("config.json", "llama")),
}


def bad_model_folders(root, *, names=None, data_dir="") -> dict:
  root = Path(root)
  data_dir = data_dir or str(root / "data")
  base = root / "hf_base"
  if not base.exists():
    _hf_folder(base)
  import contextlib

  from ict_jax.data import prepare

  with contextlib.redirect_stdout(sys.stderr):  # tfds prints; stdout is the table's
    prepare("synthetic_arith", data_dir, config="level1")  # built already, as on any re-run
  cases = []
  for name in names or HF_FAULTS:
    mutate, needles = HF_FAULTS[name]
    folder = root / ("hf_" + re.sub(r"\W+", "_", name))
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    mutate(folder)
    flags = quick_flags(2, 1, sft=0, data_dir=data_dir) + [f"--init_from_hf={folder}"]
    r = Run(root / f"w_{folder.name}", flags, root / "logs", name=folder.name)
    rc = r.wait()
    lines = r.error_lines()
    errors = [l for l in lines if "error:" in l]
    ok = (
        rc != 0
        and len(lines) == 1
        and len(errors) == 1
        and all(n in errors[0] for n in needles)
        and "Traceback" not in r.stderr()
        and not metrics(r.workdir)
    )
    cases.append(
        {
            "name": name,
            "rc": rc,
            "stderr_lines": len(lines),
            "error": errors[0] if errors else None,
            "seconds": round(r.seconds, 1),
            "ok": ok,
        }
    )
  return row(
      "bad --init_from_hf folders",
      ", ".join(c["name"] for c in cases) + " (CLI)",
      "exit != 0, stderr is one `error:` line naming the file (and tensor), no traceback",
      "; ".join(
          f"{c['name']}: rc {c['rc']}, {c['stderr_lines']} stderr line(s), "
          f"`{(c['error'] or 'NO ERROR LINE').split('error: ')[-1][:90]}`"
          for c in cases
      ),
      all(c["ok"] for c in cases),
      cases=cases,
  )


# ---- hostile rewards -----------------------------------------------------------------------------
HOSTILE = {
    "huge number": r"\boxed{" + "9" * 200_000 + "}",
    "huge power tower": r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{} nested 10,000 deep": "\\boxed{" * 10_000 + "5" + "}" * 10_000,
    "1 MB string": "x" * (1 << 20) + r" \boxed{6}",
    "invalid UTF-8": b"\xff\xfe\xc3\x28 \\boxed{\xed\xa0\x80 6}",
    "sympy hang": r"\boxed{10^{10^{10}} - 10^{10^{10}} + \gcd(10^{10^{10}}, 2)}",
}


def _rss_mb(pids) -> dict:
  import psutil

  out = {}
  for pid in pids:
    try:
      out[pid] = psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
      pass
  return out


def hostile_rewards(*, rounds=3, workers=2, timeout_s=5.0) -> dict:
  import psutil

  from ict_jax.rewards import RewardPool

  me = psutil.Process()
  texts, golds = list(HOSTILE.values()), ["7"] * len(HOSTILE)
  with RewardPool(num_workers=workers, timeout_s=timeout_s, max_memory_mb=2048) as pool:
    pool.score_batch("math", [r"\boxed{7}"], ["7"])  # warm: the workers imported sympy
    base = {"parent": me.memory_info().rss / 2**20, "workers": sum(_rss_mb(c.pid for c in me.children()).values())}
    times, all_rewards, stats = [], [], []
    for _ in range(rounds):
      t0 = time.monotonic()
      rewards, st = pool.score_batch("math", texts, golds)
      times.append(time.monotonic() - t0)
      all_rewards.append(rewards.tolist())
      stats.append({k: st[k] for k in ("timeouts", "errors", "respawns")})
    sane, _ = pool.score_batch("math", [r"\boxed{7}"], ["7"])  # still answers correctly
    after = {
        "parent": me.memory_info().rss / 2**20,
        "workers": sum(_rss_mb(c.pid for c in me.children()).values()),
        "max_worker": max(_rss_mb(c.pid for c in me.children()).values()),
    }
  bound = timeout_s * -(-len(texts) // workers) + 5.0
  ok = (
      all(v == 0.0 for r in all_rewards for v in r)
      and max(times) <= bound
      and sane[0] == 1.0
      and after["parent"] - base["parent"] < 100
      and after["max_worker"] < 2048
  )
  return row(
      "hostile model outputs -> RewardPool",
      f"{', '.join(HOSTILE)}; {rounds} rounds through {workers} workers (timeout {timeout_s} s)",
      f"reward 0 each, every batch < {bound:.0f} s, parent RSS + < 100 MB, workers < 2048 MB",
      f"rewards all 0: {all(v == 0.0 for r in all_rewards for v in r)}; batch s {[round(t, 2) for t in times]}; "
      f"timeouts/errors {[(s['timeouts'], s['errors']) for s in stats]}; parent RSS {base['parent']:.0f} -> "
      f"{after['parent']:.0f} MB; workers {base['workers']:.0f} -> {after['workers']:.0f} MB "
      f"(largest {after['max_worker']:.0f}); then \\boxed{{7}} -> {sane[0]:.0f}",
      ok,
      times=times,
      stats=stats,
  )


# ---- bad data files ------------------------------------------------------------------------------
def _write_gsm8k(manual: Path, huge_mb: int) -> dict:
  """train.jsonl with good rows and bad ones; returns {row: reason word} of the bad rows."""
  manual.mkdir(parents=True, exist_ok=True)
  good = [
      json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}).encode()
      for i in range(1, 9)
  ]
  lines = [
      good[0],
      json.dumps({"question": "no answer field"}).encode(),
      good[1],
      json.dumps({"answer": "#### 3"}).encode(),
      good[2],
      b'{"question": "caf\xe9 \xff", "answer": "#### 1"}',
      good[3],
      b'{"question": "' + b"x" * (huge_mb << 20) + b'", "answer": "#### 1"',
      good[4],
      b'{"question": "' + b"y" * (huge_mb << 20) + b'", "answer": "#### 1"}',
      good[5],
  ]
  with open(manual / "train.jsonl", "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  (manual / "test.jsonl").write_bytes(b"\n".join(good[6:]) + b"\n")
  return {2: "'answer'", 4: "'question'", 6: "UTF-8", 8: "invalid JSON", 10: "characters"}


def bad_data(root, *, huge_mb=100) -> dict:
  root = Path(root)
  manual = root / "gsm8k_manual"
  bad_rows = _write_gsm8k(manual, huge_mb)
  flags = [
      "--config.data.name=gsm8k",
      "--config.data.config=",
      f"--config.data.manual_dir={manual}",
      "--config.data.prompt_style=chat",
      "--config.reward.kind=math",
      "--config.data.max_prompt_len=128",
      "--config.rollout.max_new_tokens=4",
      *quick_flags(1, 1, sft=0, prompts=2, group=2),
  ]
  import psutil

  r = Run(root / "w_gsm8k", flags, root / "logs", name="gsm8k_bad_rows")
  peak = 0.0
  while r.proc.poll() is None:
    try:
      peak = max(peak, psutil.Process(r.pid).memory_info().rss / 2**20)
    except psutil.NoSuchProcess:
      break
    time.sleep(0.2)
  rc = r.wait()
  text = r.stderr()
  logged = {n: any(f"train.jsonl:{n}" in l and word in l for l in text.splitlines()) for n, word in bad_rows.items()}
  built = list((root / "w_gsm8k" / "data" / "gsm8k").rglob("metadata.json"))  # builder.info.metadata
  skipped = json.loads(built[0].read_text()).get("skipped_rows", {}).get("train", []) if built else []
  saved = {n: any(e["file"] == "train.jsonl" and e["row"] == n for e in skipped) for n in bad_rows}
  kept = len(metrics(root / "w_gsm8k")) == 1
  # an empty file: one error naming it
  empty = root / "gsm8k_empty"
  empty.mkdir(exist_ok=True)
  (empty / "train.jsonl").write_text("")
  (empty / "test.jsonl").write_bytes(b'{"question": "q", "answer": "#### 1"}\n')
  flags_e = [f if not f.startswith("--config.data.manual_dir") else f"--config.data.manual_dir={empty}" for f in flags]
  e = Run(root / "w_gsm8k_empty", flags_e, root / "logs", name="gsm8k_empty")
  rc_e = e.wait()
  err_lines = [l for l in e.error_lines() if "error:" in l]
  ok_e = (
      rc_e != 0 and len(err_lines) == 1 and str(empty / "train.jsonl") in err_lines[0] and "Traceback" not in e.stderr()
  )
  ok = rc == 0 and kept and all(logged.values()) and all(saved.values()) and ok_e
  return row(
      "bad GSM8K files (trainer CLI)",
      f"train.jsonl: missing 'answer', missing 'question', non-UTF-8, {huge_mb} MB single lines (unterminated JSON; "
      f"a valid row with a {huge_mb} MB question), 6 good rows; and an empty train.jsonl",
      "bad rows skipped, each logged with file:row and saved in the dataset's metadata.json; training runs; empty file -> one "
      "error naming it",
      f"rc {rc}, steps run {len(metrics(root / 'w_gsm8k'))}; logged {sorted(n for n, v in logged.items() if v)} of "
      f"{sorted(bad_rows)}; in metadata.json {sorted(n for n, v in saved.items() if v)}; peak RSS {peak:.0f} MB, "
      f"{r.seconds:.0f} s; empty: rc {rc_e}, `{(err_lines[0].split('error: ')[-1][:100]) if err_lines else 'NO ERROR LINE'}`",
      ok,
      peak_rss_mb=peak,
  )


# ---- config abuse --------------------------------------------------------------------------------
CONFIG_FAULTS = {  # name -> (flags, devices, needle)
    "unknown key": (["--config.train.stepz=3"], 1, "stepz"),
    "wrong type": (["--config.train.steps=abc"], 1, "steps"),
    "negative steps": (["--config.train.steps=-5"], 1, "config.train.steps: expected > 0"),
    "mesh 3 on 8 devices": (["--config.mesh.fsdp=3"], 8, "mesh"),
    "top_fraction 1.5": (["--config.ict.top_fraction=1.5"], 1, "config.ict.top_fraction"),
    "top_fraction 0": (["--config.ict.top_fraction=0"], 1, "config.ict.top_fraction"),
}


def config_abuse(root, *, names=None) -> dict:
  root = Path(root)
  cases = []
  for name in names or CONFIG_FAULTS:
    flags, devices, needle = CONFIG_FAULTS[name]
    workdir = root / ("cfg_" + re.sub(r"\W+", "_", name))
    r = Run(workdir, flags, root / "logs", name=workdir.name, devices=devices, extra_env={"JAX_LOG_COMPILES": "1"})
    rc = r.wait()
    lines = r.error_lines()
    compiled = any("Compiling" in l or "Finished XLA compilation" in l for l in lines)
    ok = rc != 0 and len(lines) == 1 and needle in lines[0] and not compiled and not (workdir / "checkpoints").exists()
    cases.append(
        {
            "name": name,
            "rc": rc,
            "lines": lines[:3],
            "seconds": round(r.seconds, 1),
            "compiled": compiled,
            "checkpoints": (workdir / "checkpoints").exists(),
            "ok": ok,
        }
    )
  return row(
      "config abuse (CLI)",
      ", ".join(c["name"] for c in cases),
      "one stderr line naming the key, exit != 0, no compilation (JAX_LOG_COMPILES=1), no checkpoints/",
      "; ".join(
          f"{c['name']}: rc {c['rc']}, {len(c['lines'])} line(s) in {c['seconds']} s, compiled "
          f"{c['compiled']}, checkpoints/ {c['checkpoints']}"
          for c in cases
      ),
      all(c["ok"] for c in cases),
      cases=cases,
  )


# ---- soak ----------------------------------------------------------------------------------------
def soak(root, *, steps=200, every=10, keep=3, data_dir="", interval=0.5) -> dict:
  import psutil

  root = Path(root)
  data_dir = data_dir or str(root / "data")
  workdir = root / "soak"
  r = Run(workdir, quick_flags(steps, every, keep=keep, data_dir=data_dir), root / "logs", name="soak")
  proc = psutil.Process(r.pid)
  samples = []
  while r.proc.poll() is None:
    try:
      rss = proc.memory_info().rss / 2**20
      fds = proc.num_fds()
    except psutil.NoSuchProcess:
      break
    rows = metrics(workdir)
    ck = workdir / "checkpoints"
    disk = du(ck) / 2**20 if ck.exists() else 0.0
    samples.append(
        {
            "t": time.monotonic() - r.t0,
            "step": rows[-1]["step"] if rows else 0,
            "rss_mb": rss,
            "fds": fds,
            "ckpt_mb": disk,
            "ckpt_dirs": sum(1 for _ in ck.iterdir()) if ck.exists() else 0,
        }
    )
    time.sleep(interval)
  rc = r.wait()
  after = [s for s in samples if s["step"] >= 20]
  if rc != 0 or not after:
    return row("soak", f"{steps} steps", "", f"exit {rc}, {len(after)} samples after step 20", False, samples=samples)
  # RSS and fds saw-tooth with the checkpoint cycle (a save holds buffers and files open), so
  # whole cycles are compared: the first one after step 20 against every later one.
  span = 2 * every
  base = [s for s in after if s["step"] < 20 + span]
  late = [s for s in after if s["step"] >= 20 + span]
  windows: dict[int, list[dict]] = {}
  for s in late:
    windows.setdefault(s["step"] // span, []).append(s)
  rss_base, rss_late = max(s["rss_mb"] for s in base), max((s["rss_mb"] for s in late), default=0.0)
  growth = rss_late / rss_base - 1
  fd_floor = min(s["fds"] for s in base)
  fd_floors = [min(s["fds"] for s in w) for _, w in sorted(windows.items())]
  one_ckpt = du(workdir / "checkpoints" / str(steps)) / 2**20
  ok = (
      bool(late)
      and growth <= 0.10
      and max(fd_floors, default=fd_floor) <= fd_floor + 2
      and max(s["ckpt_dirs"] for s in samples) <= keep + 1
      and max(s["ckpt_mb"] for s in samples) <= (keep + 1) * one_ckpt * 1.05
      and checkpoint_dirs(workdir)[0] == list(range(steps - (keep - 1) * every, steps + 1, every))
  )
  return row(
      "soak",
      f"{steps} steps, checkpoint every {every}, keep {keep}; RSS, open fds and checkpoint bytes of the trainer "
      f"sampled every {interval} s ({len(samples)} samples)",
      f"disk bounded by keep+1 checkpoints; max RSS of later {span}-step cycles <= 1.10 x the first cycle after "
      "step 20; fd floor per cycle does not rise",
      f"{r.seconds:.0f} s; RSS max steps 20-{20 + span} {rss_base:.0f} MB, later {rss_late:.0f} MB ({100 * growth:+.1f}%); "
      f"fds floor {fd_floor} then per cycle {sorted(set(fd_floors))}, peaks {max(s['fds'] for s in after)} during "
      f"saves; checkpoints/ at most {max(s['ckpt_dirs'] for s in samples)} dirs, {max(s['ckpt_mb'] for s in samples):.0f} MB "
      f"(one = {one_ckpt:.0f} MB); final {checkpoint_dirs(workdir)[0]}",
      ok,
      samples=samples[:: max(1, len(samples) // 100)],
  )


# ---- the table -----------------------------------------------------------------------------------
def markdown(rows: list[dict]) -> str:
  esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
  out = ["| fault | what was done | expected | observed | result |", "|---|---|---|---|---|"]
  for r in rows:
    out.append(
        f"| {esc(r['fault'])} | {esc(r['done'])} | {esc(r['expected'])} | {esc(r['observed'])} | "
        f"{'PASS' if r['passed'] else 'FAIL'} |"
    )
  return "\n".join(out)


ALL = ("config", "hf", "data", "rewards", "nonfinite", "ckpt", "sigterm", "kill", "soak")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {ALL}")
  ap.add_argument("--kills", type=int, default=10)
  ap.add_argument("--soak-steps", type=int, default=200)
  ap.add_argument("--huge-mb", type=int, default=100)
  ap.add_argument("--root", default="", help="working directory (default: a new temporary one)")
  ap.add_argument("--json", default="", help="also write the rows here")
  args = ap.parse_args(argv)
  root = Path(args.root or tempfile.mkdtemp(prefix="ict_faults_"))
  root.mkdir(parents=True, exist_ok=True)
  only = [x for x in args.only.split(",") if x]
  unknown = sorted(set(only) - set(ALL))
  if unknown:
    ap.error(f"--only: unknown {unknown}; known {ALL}")
  data_dir = str(root / "data")
  rows, refs = [], {}

  def ref(steps, every):
    if (steps, every) not in refs:
      refs[steps, every] = reference_run(root / f"ref_{steps}_{every}", steps, every, data_dir)
    return refs[steps, every]

  for name in only:
    t0 = time.monotonic()
    try:
      if name == "config":
        r = config_abuse(root)
      elif name == "hf":
        r = bad_model_folders(root, data_dir=data_dir)
      elif name == "data":
        r = bad_data(root, huge_mb=args.huge_mb)
      elif name == "rewards":
        r = hostile_rewards()
      elif name == "nonfinite":
        r = nonfinite(root)
      elif name == "ckpt":
        r = truncated_checkpoint(root, data_dir=data_dir, ref=ref(8, 4), steps=8, every=4)
      elif name == "sigterm":
        r = sigterm(root, data_dir=data_dir, ref=ref(8, 4), steps=8, every=4)
      elif name == "kill":
        steps = 4 + 2 * args.kills
        r = kill_resume(root, kills=args.kills, steps=steps, every=2, data_dir=data_dir, ref=ref(steps, 2))
      else:
        r = soak(root, steps=args.soak_steps, data_dir=data_dir)
    except Exception as e:  # a harness failure is a FAIL row, not a lost table
      r = row(name, "", "", f"harness error {type(e).__name__}: {str(e)[:300]}", False)
    r["seconds"] = round(time.monotonic() - t0, 1)
    rows.append(r)
    print(f"[{name}] {'PASS' if r['passed'] else 'FAIL'} in {r['seconds']} s", file=sys.stderr, flush=True)
  print(markdown(rows))
  summary = {
      "root": str(root),
      "passed": sum(r["passed"] for r in rows),
      "total": len(rows),
      "rows": [{k: r[k] for k in ("fault", "passed", "observed", "seconds")} for r in rows],
  }
  print(json.dumps(summary, indent=1))
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
  return 0 if all(r["passed"] for r in rows) else 1


def _child() -> None:
  kind, *rest = json.loads(os.environ["ICT_FAULTS_CHILD"])
  if kind == "nonfinite":
    workdir, steps, nan_step, inf_step = rest
    _nonfinite_child(workdir, int(steps), int(nan_step), int(inf_step))


if __name__ == "__main__":
  sys.path.insert(0, str(REPO))  # `python benchmarks/faults.py` puts benchmarks/, not the repo, first
  if os.environ.get("ICT_FAULTS_CHILD"):
    _child()
  else:
    sys.exit(main())
