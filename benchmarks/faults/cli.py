"""The command line of benchmarks/faults: the scenarios (--only's subset) in the table's order,
the Markdown table and a JSON summary on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import benchmarks.faults
from benchmarks.faults.harness import markdown, row
from benchmarks.faults.registry import SCENARIOS, Context

from benchmarks.faults import config_abuse, model_folders, data_files, rewards  # isort: skip
from benchmarks.faults import nonfinite, checkpoint, sigterm, kill, soak  # isort: skip

# the scenario modules, which register themselves when imported, in the table's order
MODULES = (config_abuse, model_folders, data_files, rewards, nonfinite, checkpoint, sigterm, kill, soak)
ALL = tuple(name for m in MODULES for name, fn in SCENARIOS.items() if fn.__module__ == m.__name__)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="python -m benchmarks.faults", description=benchmarks.faults.__doc__.splitlines()[0]
  )
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
  ctx = Context(root, kills=args.kills, soak_steps=args.soak_steps, huge_mb=args.huge_mb)
  rows = []
  for name in only:
    t0 = time.monotonic()
    try:
      r = SCENARIOS[name](ctx)
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
