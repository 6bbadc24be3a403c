"""Two runs' per-step metrics, compared line by line: identical, or the first differences.

    python benchmarks/compare_logs.py runs/before runs/after       # prints JSON

Every metric of every step is compared exactly (floats bit for bit, NaN equal to NaN), except the
wall-time ones (seconds, rates, MFU), which differ between any two runs. A refactor that keeps
the program the same keeps every other number: `benchmarks/RESULTS.md` records the default run
compared before and after a redesign this way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ict_jax.logs import read_log  # noqa: E402

TIMING_WORDS = ("_s", "per_s", "mfu", "flops", "tok_s")  # wall-time metrics: step_s, tokens_per_s, ...


def is_timing(key: str) -> bool:
  return key.endswith("_s") or any(w in key for w in TIMING_WORDS[1:])


def same(a, b) -> bool:
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  return a == b


def compare(a: list[dict], b: list[dict], max_diffs: int = 20) -> dict:
  """{"steps_compared", "lines", "differences": [{"step", "key", "a", "b"}], "identical"}."""
  diffs = []
  for x, y in zip(a, b):
    for key in sorted(set(x) | set(y)):
      if is_timing(key):
        continue
      if key not in x or key not in y or not same(x[key], y[key]):
        diffs.append({"step": x.get("step"), "key": key, "a": x.get(key), "b": y.get(key)})
  compared = min(len(a), len(b))
  return {
      "steps_compared": compared,
      "lines": [len(a), len(b)],
      "keys_compared": sorted(k for k in (a[0] if a else {}) if not is_timing(k)),
      "differences": diffs[:max_diffs],
      "identical": not diffs and len(a) == len(b),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("a", help="a workdir (its metrics log)")
  p.add_argument("b", help="another workdir")
  args = p.parse_args(argv)
  out = compare(read_log(args.a), read_log(args.b))
  print(json.dumps(out))
  return 0 if out["identical"] else 1


if __name__ == "__main__":
  sys.exit(main())
