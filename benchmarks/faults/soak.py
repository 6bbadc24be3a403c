"""Soak: --soak-steps steps, checkpoints every 10, keep 3; disk, host memory (RSS) and open file
descriptors of the trainer sampled over time, whole checkpoint cycles compared."""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.faults.harness import Run, checkpoint_dirs, du, metrics, quick_flags, row
from benchmarks.faults.registry import Context, scenario


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
            "ckpt_dirs": len(os.listdir(ck)) if ck.exists() else 0,
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


@scenario("soak")
def _run(ctx: Context) -> dict:
  return soak(ctx.root, steps=ctx.soak_steps, data_dir=ctx.data_dir)
