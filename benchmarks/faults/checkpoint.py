"""A truncated checkpoint: a data file of the newest checkpoint cut in half. The re-run warns naming
it, resumes from the previous one, equals the uninterrupted run, and leaves a readable newest step."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.faults.harness import (
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


@scenario("ckpt")
def _run(ctx: Context) -> dict:
  return truncated_checkpoint(ctx.root, data_dir=ctx.data_dir, ref=ctx.ref(8, 4), steps=8, every=4)
