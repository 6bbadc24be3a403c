"""kill -9: SIGKILL during sampling, during the train step and during an async checkpoint save,
`kills` times in one run directory, the same command re-run each time. Checked: it resumes from the
newest complete checkpoint, at most checkpoint_every steps are lost, and the final metrics log
equals an uninterrupted run's step by step."""

from __future__ import annotations

import random
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


@scenario("kill")
def _run(ctx: Context) -> dict:
  steps = 4 + 2 * ctx.kills
  return kill_resume(ctx.root, kills=ctx.kills, steps=steps, every=2, data_dir=ctx.data_dir, ref=ctx.ref(steps, 2))
