"""SIGTERM during a step (the step finishes, is saved, exit 0 within train.sigterm_grace_s) and
during sampling when the step would not fit in the grace period (the step is dropped, the last
completed state saved, exit 0 in time); the continued runs equal an uninterrupted one."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from benchmarks.faults.harness import (
    Run,
    checkpoint_dirs,
    compare,
    metrics,
    quick_flags,
    reference_run,
    resumed_from,
    row,
    run_to_end,
)
from benchmarks.faults.registry import Context, scenario


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


@scenario("sigterm")
def _run(ctx: Context) -> dict:
  return sigterm(ctx.root, data_dir=ctx.data_dir, ref=ctx.ref(8, 4), steps=8, every=4)
