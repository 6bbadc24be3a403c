"""One report at one learning rate (or each variant at its own) from finished sweep runs: the
equal-lr controls of issue 42 and the test at a validation grid's choice.

    python benchmarks/assemble_sweep.py --setting level4 --lr 1e-4 \
        --sources benchmarks/compare_sweep/level4/results.json,/scratch/eq1e-4/level4 \
        --out benchmarks/compare_sweep/equal_lr1e-4

`compare_methods.py` picks each method's lr by validation and reports every method at its own lr.
Here every variant is reported at the one `--lr` (or, with `--chosen grpo=1e-4,ict=5e-5`, each at
the lr a validation grid chose: `compare_methods.py --validation_only`): the runs are gathered from `--sources`, each a
committed `results.json` or a sweep's setting folder (`<out>/<setting>`, whose `runs/*/result.json`
and `test.json` are read, the signature from a run's metrics log when its result.json predates
it). The validation and test records at `--lr` are kept, and the warm-start's tests (lr None);
where two sources hold the same (variant, lr, seed) the first source's is kept, and a second with
different counts is listed under "conflicts" in the printed JSON (the rerun that checked the
sweep's reproducibility must show none for RL runs). Writes `<out>/<setting>/results.json` with
every variant's lr set to `--lr`, then `compare_methods.report` builds `table.md` and the figures
from it (so `compare_methods.py --settings SETTING --out OUT --report` rebuilds them too).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import compare_methods as cm  # noqa: E402
from ict_jax.logs import read_log  # noqa: E402

Key = tuple  # (variant, lr, seed)


def _from_runs(folder: str) -> tuple[list[dict], list[dict]]:
  """(validation, tests) records of the finished runs under `folder`/runs."""
  validation, tests = [], []
  for path in sorted(glob.glob(os.path.join(folder, "runs", "*", "result.json"))):
    r = json.load(open(path))
    if "signature" not in r:
      r = {**r, "signature": cm.signature(read_log(os.path.dirname(path)))}
    validation.append(r)
  tests = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "runs", "*", "test.json")))]
  return validation, tests


def load_source(source: str) -> tuple[list[dict], list[dict]]:
  if source.endswith(".json"):
    results = json.load(open(source))
    return results["validation"], results["tests"]
  if not os.path.isdir(os.path.join(source, "runs")):
    raise SystemExit(f"assemble_sweep: {source}: expected a results.json or a setting folder with runs/")
  return _from_runs(source)


def gather(sources: list[tuple[list[dict], list[dict]]], lr) -> tuple[list[dict], list[dict], list[dict]]:
  """(validation, tests, conflicts): the records at `lr` (a float, or {variant: lr}: each variant
  at its own; tests also the warm-start's, lr None), the first source's where several hold the
  same (variant, lr, seed)."""
  at = (lambda r: r["lr"] == lr.get(r["variant"])) if isinstance(lr, dict) else (lambda r: r["lr"] == lr)
  validation: dict[Key, dict] = {}
  tests: dict[Key, dict] = {}
  conflicts = []
  for val, tst in sources:
    for r in val:
      if at(r):
        validation.setdefault((r["variant"], r["lr"], r["seed"]), r)
    for r in tst:
      if not (at(r) or r["lr"] is None):
        continue
      key = (r["variant"], r["lr"], r["seed"])
      if key in tests and tests[key]["counts"] != r["counts"]:
        conflicts.append({"variant": key[0], "lr": key[1], "seed": key[2]})
      tests.setdefault(key, r)
  return list(validation.values()), list(tests.values()), conflicts


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--setting", required=True, choices=list(cm.SETTINGS))
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument("--lr", type=float, help="every variant at this lr")
  which.add_argument("--chosen", help="each variant at its own lr: grpo=1e-4,ict=5e-5 (a validation grid's choice)")
  p.add_argument("--sources", required=True, help="comma-separated results.json files / setting folders")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  lr = a.lr
  if a.chosen:
    try:
      lr = {v: float(x) for v, x in (kv.split("=") for kv in a.chosen.split(","))}
    except ValueError:
      p.error(f"--chosen: expected variant=lr,... (grpo=1e-4,ict=5e-5), got {a.chosen!r}")
  validation, tests, conflicts = gather([load_source(s) for s in a.sources.split(",") if s], lr)
  variants = sorted({r["variant"] for r in tests if r["lr"] is not None})
  out = os.path.join(a.out, a.setting)
  os.makedirs(out, exist_ok=True)
  chosen = {v: lr[v] if a.chosen else lr for v in variants}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"chosen_lr": chosen, "summary": {}, "validation": validation, "tests": tests}, f)
  level = cm.SETTINGS[a.setting]["level"]
  at = "each method at its validation-chosen lr" if a.chosen else f"every method at lr {lr:g}"
  cm.report(out, f"tiny Qwen2, synthetic_chain level {level}, {at}: mean and min-max over seeds")
  summary = {"setting": a.setting, "lr": chosen if a.chosen else lr, "variants": variants, "tests": len(tests)}
  summary["conflicts"] = conflicts
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  main()
