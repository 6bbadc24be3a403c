"""benchmarks/compare_methods.py's bookkeeping: variants, the seed statistics and the paired
difference to ICT against numpy, the table (the runs themselves are train() calls)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cm():
  spec = importlib.util.spec_from_file_location(
      "compare_methods", os.path.join(ROOT, "benchmarks", "compare_methods.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_variants(cm):
  assert cm.parse_variant("stapo") == {"method": "stapo"}
  assert cm.parse_variant("top_fraction=0.9+keep=frequent") == {
      "method": "ict",
      "top_fraction": 0.9,
      "keep": "frequent",
  }
  for v in cm.ABLATIONS:
    cm.parse_variant(v)
  with pytest.raises(ValueError, match="bad variant"):
    cm.parse_variant("lr=3")


def test_summary_and_paired_difference(cm):
  rng = np.random.default_rng(0)
  p1 = {(v, s): float(rng.random()) for v in ("ict", "grpo") for s in range(5)}
  runs = [{"variant": v, "seed": s, "pass@1": p1[v, s], "pass@4": min(1.0, 2 * p1[v, s])} for (v, s) in p1]
  runs.append({"variant": "score=kl", "seed": 7, "pass@1": 0.5, "pass@4": 0.5})  # no ICT seed 7
  summary = cm.summarize(runs)
  g = np.array([p1["grpo", s] for s in range(5)])
  i = np.array([p1["ict", s] for s in range(5)])
  assert summary["grpo"]["pass@1"]["mean"] == pytest.approx(g.mean())
  assert summary["grpo"]["pass@1"]["std"] == pytest.approx(g.std(ddof=1))
  assert summary["grpo"]["diff@1"]["mean"] == pytest.approx((g - i).mean())
  assert summary["grpo"]["diff@1"]["std"] == pytest.approx((g - i).std(ddof=1))
  assert "diff@1" not in summary["ict"] and "diff@1" not in summary["score=kl"]
  md = cm.table(summary)
  lines = md.splitlines()
  assert lines[2].startswith("| GRPO | 5 |") and lines[3].startswith("| ICT | 5 |")
  assert lines[4].startswith("| ICT score=kl | 1 |")


def test_warm_start_row_and_paired_gain(cm):
  """The warm-start (no RL) row comes first, and every variant's change over it is paired by seed."""
  rng = np.random.default_rng(1)
  base = {s: float(rng.random()) for s in range(4)}
  ict = {s: float(rng.random()) for s in range(5)}  # seed 4 has no warm-start evaluation
  runs = [{"variant": cm.BASELINE, "seed": s, "pass@1": p, "pass@4": p} for s, p in base.items()]
  runs += [{"variant": "ict", "seed": s, "pass@1": p, "pass@4": p} for s, p in ict.items()]
  summary = cm.summarize(runs)
  gain = np.array([ict[s] - base[s] for s in range(4)])
  assert summary["ict"]["gain@1"] == pytest.approx({"mean": gain.mean(), "std": gain.std(ddof=1), "n": 4})
  assert "gain@1" not in summary[cm.BASELINE]
  assert summary[cm.BASELINE]["diff@1"]["n"] == 4  # the warm-start minus ICT, on the seeds both have
  lines = cm.table(summary).splitlines()
  assert lines[2].startswith("| warm-start (no RL) | 4 |") and lines[3].startswith("| ICT | 5 |")
  assert lines[3].endswith(f"| {100 * gain.mean():+.1f} ± {100 * gain.std(ddof=1):.1f} (n=4) |")
