"""benchmarks/compare_methods.py's bookkeeping: variants, the lr choice on validation (argmax, and
no test evaluation before it), pass@k to k=64 and the paired differences against numpy and exact
binomials, the table (the runs themselves are train() calls: tests/test_benchmarks_smoke.py)."""

from __future__ import annotations

import importlib.util
import math
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


def _pass_at_k(counts, n, k) -> float:
  """The unbiased estimator from exact binomials, 1 - C(n-c, k) / C(n, k), averaged."""
  return float(np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in counts]))


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


def test_select_lrs_is_the_argmax_of_mean_validation(cm):
  rng = np.random.default_rng(0)
  lrs, seeds = [1e-4, 2e-4, 3e-4, 5e-4], [0, 1, 2]
  val = rng.random((2, len(lrs), 5))  # variant x lr x seed (seeds 3, 4 are not selection seeds)
  val[1, :, :3] = 0.25  # a four-way tie: the first lr of the grid
  records = [
      {"variant": v, "lr": lr, "seed": s, "val_pass@1": float(val[i, j, s])}
      for i, v in enumerate(("grpo", "ict"))
      for j, lr in enumerate(lrs)
      for s in range(5)
  ]
  chosen = cm.select_lrs(records, lrs, seeds)
  assert chosen == {"grpo": lrs[int(np.argmax(val[0, :, :3].mean(1)))], "ict": 1e-4}
  with pytest.raises(ValueError, match=r"grpo at lr 0.0001 has no validation result for seeds \[7\]"):
    cm.select_lrs(records, lrs, [0, 7])


def test_sweep_chooses_on_validation_before_any_test(cm):
  """The fake test scores are the reverse of validation, so a choice that peeked would differ; no
  test runs before the last validation run, and only the chosen lrs are tested."""
  lrs = [1e-4, 3e-4, 5e-4]
  best = {"grpo": 3e-4, "ict": 5e-4}
  events = []

  def run(v, lr, sd):
    events.append(("run", v, lr, sd))
    val = 0.9 if lr == best.get(v, best["ict"]) else 0.1 * lrs.index(lr)
    return {"variant": v, "lr": lr, "seed": sd, "val_pass@1": val}

  def test(v, lr, sd):
    events.append(("test", v, lr, sd))
    return {"variant": v, "lr": lr, "seed": sd, "n": 4, "counts": [4 if lr == lrs[0] else 0]}

  chosen = cm.sweep(["grpo", "ict"], ["score=kl"], lrs, [0, 1, 2], [0, 1], [0], run, test, log=lambda r: None)
  assert chosen == {**best, "score=kl": best["ict"]}
  first_test = next(i for i, e in enumerate(events) if e[0] == "test")
  validation = [e for e in events[:first_test] if e[0] == "run"]
  assert validation == [("run", v, lr, s) for v in ("grpo", "ict") for lr in lrs for s in (0, 1)]
  tested = [e[1:] for e in events if e[0] == "test"]
  assert tested == [("warm-start", None, s) for s in (0, 1, 2)] + [
      (v, chosen[v], s) for v, seeds in (("grpo", (0, 1, 2)), ("ict", (0, 1, 2)), ("score=kl", (0,))) for s in seeds
  ]
  # every tested (variant, lr, seed) was trained first
  for i, e in enumerate(events):
    if e[0] == "test" and e[1] != "warm-start":
      assert ("run", *e[1:]) in events[:i]


def test_summary_passk_to_64_and_paired_differences(cm):
  rng = np.random.default_rng(1)
  n, problems, seeds = 64, 5, [0, 1, 2]
  chosen = {"grpo": 2e-4, "ict": 5e-4, "warm-start": None}
  counts = {(v, s): rng.integers(0, n + 1, problems).tolist() for v in chosen for s in seeds}
  tests = [{"variant": v, "lr": chosen[v], "seed": s, "n": n, "counts": c} for (v, s), c in counts.items()]
  tests.append({"variant": "ict", "lr": 1e-4, "seed": 0, "n": n, "counts": [n] * problems})  # not chosen: ignored
  summary = cm.summarize(tests, chosen)
  assert summary["ict"]["seeds"] == seeds and summary["ict"]["lr"] == 5e-4
  for v in chosen:
    curve = np.array(summary[v]["curve"])
    want = np.array([[_pass_at_k(counts[v, s], n, k) for k in range(1, n + 1)] for s in seeds])
    assert curve.shape == (3, 64) and np.allclose(curve, want, atol=1e-12)
    assert np.all(np.diff(curve, axis=1) >= -1e-12)
  for k in cm.KS:
    p = np.array([_pass_at_k(counts["ict", s], n, k) for s in seeds])
    g = np.array([_pass_at_k(counts["grpo", s], n, k) for s in seeds])
    b = np.array([_pass_at_k(counts["warm-start", s], n, k) for s in seeds])
    assert summary["ict"][f"pass@{k}"]["mean"] == pytest.approx(p.mean())
    assert summary["ict"][f"pass@{k}"]["std"] == pytest.approx(p.std(ddof=1))
    assert summary["ict"][f"diff@{k}"] == pytest.approx({"mean": (p - g).mean(), "std": (p - g).std(ddof=1), "n": 3})
    assert summary["ict"][f"gain@{k}"] == pytest.approx({"mean": (p - b).mean(), "std": (p - b).std(ddof=1), "n": 3})
  assert "diff@1" not in summary["grpo"] and "gain@1" not in summary["warm-start"]
  validation = [
      {"variant": v, "lr": lr, "seed": s, "val_pass@1": 0.5}
      for v in ("grpo", "ict")
      for lr in (2e-4, 5e-4)
      for s in seeds
  ]
  lines = cm.table(summary, validation).splitlines()
  assert lines[0].count("pass@") == 3 * len(cm.KS)
  assert [line.split(" | ")[:3] for line in lines[2:5]] == [
      ["| warm-start (no RL)", "–", "3"],
      ["| GRPO", "0.0002", "3"],
      ["| ICT", "0.0005", "3"],
  ]
  assert "| GRPO | 50.0* (n=3) | 50.0 (n=3) |" in lines and "| ICT | 50.0 (n=3) | 50.0* (n=3) |" in lines


def test_signature_is_the_mean_over_steps_and_over_the_last_tenth(cm):
  """A run's selected_prob / selected_high_entropy: the mean of its metrics log over all steps and
  over the last 10% (ceil, at least one step), NaN steps (no token selected) left out; an old
  log without the metrics gives nothing."""
  rng = np.random.default_rng(5)
  p, h = rng.random(23), rng.random(23)
  p[3] = np.nan
  history = [{"selected_prob": a, "selected_high_entropy": b, "loss": 0.0} for a, b in zip(p, h)]
  got = cm.signature(history)
  assert got["selected_prob"] == pytest.approx({"mean": np.nanmean(p), "last10": p[-3:].mean()})
  assert got["selected_high_entropy"] == pytest.approx({"mean": h.mean(), "last10": h[-3:].mean()})
  assert cm.signature([{"loss": 1.0}] * 5) == {}
  assert cm.signature(history[:4])["selected_high_entropy"]["last10"] == pytest.approx(h[3])
