"""The harness of benchmarks/faults: `python -m ict_jax.train` as a subprocess (`Run`), what a run
left behind (metrics, checkpoint directories, the step it resumed from), metric comparison and the
table rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.faults.markers import HOOKS_FLAG

REPO = Path(__file__).resolve().parents[2]
METRIC_KEYS = ("reward_mean", "loss", "entropy", "grad_norm")
RTOL, ATOL = 1e-4, 1e-6


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
    if markers:  # markers.py's hook, through the trainer's --hooks flag
      self.markers.write_text("")
      e = env(devices, ICT_FAULTS_MARKERS=self.markers, ICT_FAULTS_SLEEP=sleep, **extra)
      flags = [*flags, HOOKS_FLAG]
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
  """Bytes of the files under `path`, read while a run may be deleting them (an old checkpoint
  removed mid-walk): a file or folder gone by the time it is read counts 0."""
  total = 0
  for folder, _, files in os.walk(path):  # os.walk skips a folder that vanished under it
    for name in files:
      try:
        total += os.stat(os.path.join(folder, name)).st_size
      except FileNotFoundError:
        pass
  return total


def row(fault, done, expected, observed, passed, **details) -> dict:
  return {"fault": fault, "done": done, "expected": expected, "observed": observed, "passed": bool(passed), **details}


def reference_run(root, steps, every, data_dir) -> tuple[Path, list[dict], Run]:
  """The uninterrupted run that the killed, signalled and truncated ones are compared with."""
  workdir = Path(root) / "reference"
  r = run_to_end(workdir, quick_flags(steps, every, data_dir=data_dir), Path(root) / "logs", "reference")
  return workdir, metrics(workdir), r


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
