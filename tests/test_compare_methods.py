"""benchmarks/compare_methods.py's bookkeeping: variants, the lr choice on validation (argmax, and
no test evaluation before it), pass@k to k=64 and the paired differences against numpy and exact
binomials, the table (the runs themselves are train() calls: tests/test_benchmarks_smoke.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil

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
  assert cm.parse_variant("entropy+selected_norm=response") == {"method": "entropy", "selected_norm": "response"}
  assert cm.parse_variant("ict+selected_norm=response+score=kl") == {
      "method": "ict",
      "selected_norm": "response",
      "score": "kl",
  }
  assert cm.parse_variant("selected_norm=response") == {"method": "ict", "selected_norm": "response"}
  assert cm.variant_name("entropy+selected_norm=response") == "20-Entropy selected_norm=response"
  assert cm.variant_name("score=kl") == "ICT score=kl" and cm.variant_name("ict") == "ICT"
  for bad in ("entropy+score=kl", "ict+selected_norm=tokens", "reference=group", "grpo+lr=3"):
    with pytest.raises(ValueError, match="bad variant"):
      cm.parse_variant(bad)
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


def test_select_lrs_by_validation_pass_at_4(cm, tables):
  """Validated records ("val") are chosen on the metric asked for, not on pass@1; a record without
  it (trained before the periodic eval reported pass@4) is a clear error, not a silent pass@1."""
  lrs = [1e-4, 5e-4]
  val = {1e-4: {"pass@1": 0.30, "pass@4": 0.40}, 5e-4: {"pass@1": 0.20, "pass@4": 0.50}}
  records = [{"variant": "grpo", "lr": lr, "seed": s, "val": val[lr], "val_pass@1": 0.0} for lr in lrs for s in (0, 1)]
  assert cm.select_lrs(records, lrs, [0, 1], "pass@4") == {"grpo": 5e-4}
  assert cm.select_lrs(records, lrs, [0, 1], "pass@1") == {"grpo": 1e-4}  # "val" first, where it is there
  old = [{"variant": "ict", "lr": 1e-4, "seed": 0, "val_pass@1": 0.3}]
  assert cm.select_lrs(old, [1e-4], [0]) == {"ict": 1e-4}
  with pytest.raises(ValueError, match="ict lr 0.0001 seed 0: no validation pass@4"):
    cm.select_lrs(old, [1e-4], [0], "pass@4")
  lines = tables.validation_table(records, {"grpo": 5e-4})
  assert lines[0].startswith("Validation pass@4 / pass@1")
  assert lines[-1] == "| GRPO | 40.0 / 30.0 (n=2) | 50.0 / 20.0* (n=2) |"
  assert tables.validation_table(old, {})[-1] == "| ICT | 30.0 (n=1) |"  # pass@1 only: not validated again


def test_sweep_validation_only_runs_no_test(cm):
  events = []

  def run(v, lr, sd):
    events.append(("run", v, lr, sd))
    return {"variant": v, "lr": lr, "seed": sd, "val": {"pass@4": lr}}

  chosen = cm.sweep(
      ["grpo"], [], [1e-4, 5e-4], [0, 1, 2], [0, 1], [], run, lambda *a: events.append(("test", *a)),
      log=lambda r: None, select_by="pass@4", validation_only=True,
  )  # fmt: skip
  assert chosen == {"grpo": 5e-4}
  assert events == [("run", "grpo", lr, s) for lr in (1e-4, 5e-4) for s in (0, 1)]


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
    for name, ref in ((f"diff@{k}", g), (f"gain@{k}", b)):
      d = p - ref
      assert summary["ict"][name] == pytest.approx(
          {"mean": d.mean(), "std": d.std(ddof=1), "se": d.std(ddof=1) / np.sqrt(3), "n": 3, "below": (d < 0).sum()}
      )
  assert "diff@1" not in summary["grpo"] and "gain@1" not in summary["warm-start"]
  validation = [
      {"variant": v, "lr": lr, "seed": s, "val_pass@1": 0.5}
      for v in ("grpo", "ict")
      for lr in (2e-4, 5e-4)
      for s in seeds
  ]
  lines = cm.table(summary, validation).splitlines()
  # pass@k for every k of KS, pass@4 first; paired differences (to GRPO, to the warm-start) at 4, 1, 64
  head = lines[0].split(" | ")
  assert lines[0].count("pass@") == len(cm.KS) + 2 * 3 and head[3].startswith("pass@4 mean")
  assert [h.split(" ")[0] for h in head[3:13]] == ["pass@4", "pass@1", "pass@16", "pass@64"] + [
      "pass@4",
      "pass@1",
      "pass@64",
  ] * 2
  assert lines[3].endswith("| – | – |")  # runs from before the signature metrics: no value
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


@pytest.fixture(scope="module")
def tables():
  """benchmarks/compare_tables.py, which compare_methods.py imports its tables from."""
  spec = importlib.util.spec_from_file_location("compare_tables", os.path.join(ROOT, "benchmarks", "compare_tables.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_paired_differences_and_their_standard_error(tables):
  a, b = np.array([0.5, 0.7, 0.2, 0.9, 0.4]), np.array([0.6, 0.4, 0.3, 0.5, 0.1])
  d = a - b
  got = tables.paired(a, b)
  assert got["mean"] == pytest.approx(d.mean()) and got["std"] == pytest.approx(np.std(d, ddof=1))
  assert got["se"] == pytest.approx(np.sqrt(np.sum((d - d.mean()) ** 2) / 4) / np.sqrt(5))
  assert (got["n"], got["below"]) == (5, 2)
  one = tables.paired([0.5], [0.25])
  assert one["mean"] == 0.25 and one["std"] == 0.0 and np.isnan(one["se"]) and one["below"] == 0


def test_unsolved_problems_and_pass_at_k_without_them(tables):
  """Problems 1 and 3 are 0/n in every RL run (GRPO and ICT, two lrs of ICT included); problem 0 is
  solved by one ICT run only (at an lr not chosen), problem 3 by the warm-start only (not RL)."""
  n = 4
  tests = [
      {"variant": "warm-start", "lr": None, "seed": 0, "n": n, "counts": [1, 0, 2, 3, 1]},
      {"variant": "grpo", "lr": 1e-4, "seed": 0, "n": n, "counts": [0, 0, 4, 0, 2]},
      {"variant": "grpo", "lr": 1e-4, "seed": 1, "n": n, "counts": [0, 0, 1, 0, 0]},
      {"variant": "ict", "lr": 1e-4, "seed": 0, "n": n, "counts": [0, 0, 3, 0, 4]},
      {"variant": "ict", "lr": 5e-4, "seed": 1, "n": n, "counts": [2, 0, 3, 0, 1]},
  ]
  assert tables.unsolved_problems(tests) == [1, 3]
  assert tables.unsolved_problems(tests[:1]) == [] and tables.unsolved_problems([]) == []
  assert tables.unsolved_problems(tests, exclude=()) == [1]  # the warm-start solved problem 3
  rest = tables.without_problems(tests, [1, 3])
  assert [r["counts"] for r in rest[:2]] == [[1, 2, 1], [0, 4, 2]] and rest[0]["seed"] == 0
  md = tables.unsolved_report(tests, {"grpo": 1e-4, "ict": 1e-4, "warm-start": None}, texts=lambda i: f"<{i}>", k=4)
  assert "2 of 5 test problems are solved by no RL run (4 runs, 0 of 4 samples each)" in md
  assert "pass@4 is at most 60.0% for every method" in md
  assert "- test problem 1: <1> (warm-start: 0 correct)" in md and "- test problem 3: <3> (warm-start: 3 correct)" in md
  # with k = n = 4, pass@4 of a problem is 1 if any sample is right: on problems 0, 2, 4 GRPO solves
  # 2/3 (seed 0) and 1/3 (seed 1), ICT at its chosen lr 2/3 (seed 0), the warm-start 3/3
  grpo = np.array([2 / 3, 1 / 3])
  assert f"- GRPO: {100 * grpo.mean():.1f} ± {100 * grpo.std(ddof=1):.1f}\n" in md
  assert "- ICT: 66.7 ± 0.0, − GRPO +0.0 (n=1, 0 below)" in md  # one pair: no standard error
  assert "- warm-start (no RL): 100.0 ± 0.0, − GRPO +33.3 (n=1, 0 below)" in md
  solved = {"variant": "ict", "lr": 1e-4, "seed": 0, "n": n, "counts": [1, 1, 4, 1, 1]}
  assert tables.unsolved_report(tests[:1] + [solved], {}).startswith("Every test problem is solved by at least one")
  assert "pass@4 is at most 60.0%" in tables.unsolved_report(tests, {}, k=64)  # k above n: pass@n
  nothing = tables.unsolved_report([{**r, "counts": [0] * 5} for r in tests], {}, k=4)  # no problem left
  assert "5 of 5 test problems" in nothing and "at most 0.0%" in nothing and "on the other" not in nothing


def test_signature_per_method_and_js_reference_in_the_tables(cm, tmp_path):
  """The summary carries each variant's signature at its chosen lr (mean ± std over seeds of the
  runs' means and last-10% means); the tables show it beside the paper's values, per JS reference
  reading, and "–" where the runs are older than the metrics. `--report` rebuilds from results.json
  when the runs are not there."""
  n, seeds = 4, [0, 1]
  chosen = {"grpo": 5e-4, "ict": 1e-4, "reference=others_mean": 1e-4, "warm-start": None}
  tests = [{"variant": v, "lr": lr, "seed": s, "n": n, "counts": [1, 2, 0]} for v, lr in chosen.items() for s in seeds]
  sig = {0: (0.7, 0.9, 1.0, 1.0), 1: (0.5, 0.6, 0.5, 0.75)}  # seed -> prob mean, last10, share mean, last10
  validation = [
      {"variant": v, "lr": chosen[v], "seed": s, "val_pass@1": 0.1}
      | (
          {}
          if v == "grpo"  # GRPO's runs predate the metrics
          else {
              "signature": {
                  "selected_prob": {"mean": sig[s][0], "last10": sig[s][1]},
                  "selected_high_entropy": {"mean": sig[s][2], "last10": sig[s][3]},
              }
          }
      )
      for v in ("grpo", "ict", "reference=others_mean")
      for s in seeds
  ]
  validation.append({**validation[-1], "lr": 5e-4, "signature": {"selected_prob": {"mean": 9.0, "last10": 9.0}}})
  summary = cm.summarize(tests, chosen, validation)
  got = summary["ict"]["signature"]
  assert got["seeds"] == seeds and "signature" not in summary["grpo"] and "signature" not in summary["warm-start"]
  assert got["selected_prob"]["mean"]["mean"] == pytest.approx(0.6)
  assert got["selected_prob"]["mean"]["std"] == pytest.approx(np.std([0.7, 0.5], ddof=1))
  assert got["selected_high_entropy"]["last10"]["mean"] == pytest.approx(0.875)
  assert summary["reference=others_mean"]["signature"]["selected_prob"]["mean"]["mean"] == pytest.approx(0.6)
  md = cm.table(summary, validation)
  lines = md.splitlines()
  assert "selected p (paper ~0.18)" in lines[0] and "share above median H, % (paper ~50%)" in lines[0]
  (grpo,) = [line for line in lines if line.startswith("| GRPO | 0.0005 |")]
  assert grpo.endswith("| – | – |")
  (ict,) = [line for line in lines if line.startswith("| ICT | 0.0001 |")]
  assert ict.endswith(f"| 0.60 ± {np.std([0.7, 0.5], ddof=1):.2f} (last 10%: 0.75) | 75.00 ± 35.36 (last 10%: 87.50) |")
  assert "| ICT | active_mean | 2 | 0.60" in md and "| ICT reference=others_mean | others_mean | 2 | 0.60" in md
  # --report from results.json alone (no runs/ folder): the same records back
  out = tmp_path / "level1"
  out.mkdir()
  (out / "results.json").write_text(
      json.dumps({"chosen_lr": chosen, "summary": {}, "validation": validation, "tests": tests})
  )
  assert cm._load(str(out)) == (validation, tests, chosen, False)
  # from the runs' files: a result.json from before the signature gets it from its run's metrics log
  from etils import epath
  from ict_jax.logs import JsonlLog

  run = out / "runs" / "ict_lr0.0001_seed0"
  run.mkdir(parents=True)
  (out / "chosen_lr.json").write_text(json.dumps(chosen))
  old = {"variant": "ict", "lr": 1e-4, "seed": 0, "val_pass@1": 0.1}
  (run / "result.json").write_text(json.dumps(old))
  (run / "test.json").write_text(json.dumps(tests[0]))
  log = JsonlLog(epath.Path(run) / "metrics", 0)
  for step, (p, h) in enumerate(((0.5, 1.0), (0.7, 0.0)), 1):
    log.write(step, [{"step": step, "selected_prob": p, "selected_high_entropy": h}])
  (got,), _, _, from_runs = cm._load(str(out))
  assert from_runs and {k: got[k] for k in old} == old
  assert got["signature"]["selected_prob"] == pytest.approx({"mean": 0.6, "last10": 0.7})
  with pytest.raises(SystemExit, match="nothing to report"):
    cm._load(str(tmp_path))


def test_assemble_sweep_reports_every_variant_at_one_lr(tmp_path):
  """benchmarks/assemble_sweep.py: the records at --lr from a committed results.json and a sweep's
  run folders, the warm-start's tests too, the first source winning a duplicate (a conflict listed
  when its counts differ), every variant's lr set to --lr and table.md built from them."""
  spec = importlib.util.spec_from_file_location("assemble_sweep", os.path.join(ROOT, "benchmarks", "assemble_sweep.py"))
  asm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(asm)
  n, seeds = 4, [0, 1]
  rec = lambda v, lr, s, counts: {"variant": v, "lr": lr, "seed": s, "n": n, "counts": counts}  # noqa: E731
  committed = tmp_path / "results.json"
  committed.write_text(
      json.dumps(
          {
              "chosen_lr": {"grpo": 5e-4, "ict": 1e-4},
              "summary": {},
              "validation": [
                  {"variant": v, "lr": lr, "seed": s, "val_pass@1": 0.1}
                  for v, lr in (("grpo", 5e-4), ("ict", 1e-4))
                  for s in seeds
              ],
              "tests": [rec("warm-start", None, s, [0, 1, 0]) for s in seeds]
              + [rec("grpo", 5e-4, s, [4, 4, 0]) for s in seeds]
              + [rec("ict", 1e-4, s, [1, 2, 0]) for s in seeds],
          }
      )
  )
  sweep = tmp_path / "eq" / "level4"
  for s in seeds:
    run = sweep / "runs" / f"grpo_lr0.0001_seed{s}"
    run.mkdir(parents=True)
    (run / "result.json").write_text(
        json.dumps({"variant": "grpo", "lr": 1e-4, "seed": s, "val_pass@1": 0.2, "signature": {}})
    )
    (run / "test.json").write_text(json.dumps(rec("grpo", 1e-4, s, [2, 3, 1])))
  ws = sweep / "runs" / "warm-start_seed0"
  ws.mkdir(parents=True)
  (ws / "test.json").write_text(json.dumps(rec("warm-start", None, 0, [1, 1, 1])))  # re-evaluated: differs
  out = tmp_path / "out"
  got = asm.main(["--setting", "level4", "--lr", "1e-4", "--sources", f"{committed},{sweep}", "--out", str(out)])
  assert got["variants"] == ["grpo", "ict"] and got["tests"] == 2 + 2 + 2
  assert got["conflicts"] == [{"variant": "warm-start", "lr": None, "seed": 0}]
  results = json.loads((out / "level4" / "results.json").read_text())
  assert results["chosen_lr"] == {"grpo": 1e-4, "ict": 1e-4}
  summary = results["summary"]
  assert summary["warm-start"]["pass@1"]["mean"] == pytest.approx(1 / 12)  # the committed source's, first
  assert summary["grpo"]["pass@1"]["mean"] == pytest.approx(6 / 12) and summary["grpo"]["seeds"] == seeds
  # each variant at its own lr (a validation grid's choice): GRPO's 5e-4 runs beside ICT's 1e-4
  own = tmp_path / "own"
  got = asm.main(
      ["--setting", "level4", "--chosen", "grpo=5e-4,ict=1e-4", "--sources", str(committed), "--out", str(own)]
  )
  assert got["lr"] == {"grpo": 5e-4, "ict": 1e-4} and got["tests"] == 2 + 2 + 2
  mine = json.loads((own / "level4" / "results.json").read_text())["summary"]
  assert mine["grpo"]["lr"] == 5e-4 and mine["grpo"]["pass@1"]["mean"] == pytest.approx(8 / 12)
  with pytest.raises(SystemExit):
    asm.main(["--setting", "level4", "--chosen", "grpo:5e-4", "--sources", str(committed), "--out", str(own)])
  # ICT minus GRPO at the same lr, paired by seed: (3 - 6) / 12 on both seeds
  assert summary["ict"]["diff@1"]["mean"] == pytest.approx(-3 / 12)
  assert "| GRPO | 0.0001 |" in (out / "level4" / "table.md").read_text()
  with pytest.raises(SystemExit, match="expected a results.json or a setting folder"):
    asm.main(["--setting", "level4", "--lr", "1e-4", "--sources", str(tmp_path / "nothing"), "--out", str(out)])


def test_validation_report_chooses_over_complete_lrs_and_names_the_missing(tables, tmp_path):
  """An interim grid: a variant is chosen over the lrs every selection seed has finished and
  validated; the points not there yet (or trained, not yet validated for pass@4) are named."""
  val = {(1e-4, 0): 0.2, (1e-4, 1): 0.4, (5e-4, 0): 0.5, (5e-4, 1): 0.5, (1e-3, 0): 0.9}
  for (lr, sd), p4 in val.items():
    os.makedirs(tmp_path / "runs" / f"grpo_lr{lr:g}_seed{sd}")
    record = {"variant": "grpo", "lr": lr, "seed": sd, "train_s": 360.0, "val_pass@1": 0.1, "curves": {}}
    record["val"] = {"pass@1": p4 / 4, "pass@4": p4}
    json.dump(record, open(tmp_path / "runs" / f"grpo_lr{lr:g}_seed{sd}" / "result.json", "w"))
  unvalidated = {"variant": "ict", "lr": 1e-4, "seed": 0, "train_s": 1.0, "val_pass@1": 0.3}
  os.makedirs(tmp_path / "runs" / "ict_lr0.0001_seed0")
  json.dump(unvalidated, open(tmp_path / "runs" / "ict_lr0.0001_seed0" / "result.json", "w"))
  out = tables.validation_report(str(tmp_path), [1e-4, 5e-4, 1e-3], [0, 1], ["grpo", "ict"], "pass@4")
  assert out["chosen_lr"] == {"grpo": 5e-4} and out["edge"] == []  # 1e-3 has seed 0 only
  assert out["missing"] == [("grpo", 1e-3, 1)] + [("ict", lr, sd) for lr in (1e-4, 5e-4, 1e-3) for sd in (0, 1)]
  md = (tmp_path / "validation.md").read_text()
  assert "| GRPO | 30.0 / 7.5 (n=2) | 50.0 / 12.5* (n=2) | 90.0 / 22.5 (n=1) |" in md
  assert "Not run yet (chosen over the complete lrs only): GRPO lr 0.001 seed 1, ICT lr 0.0001 seed 0" in md
  assert "RL wall time: 0.50 h over 5 runs." in md
  saved = json.load(open(tmp_path / "validation.json"))
  assert saved["chosen_lr"] == {"grpo": 5e-4} and all("curves" not in r for r in saved["validation"])
  shutil.rmtree(tmp_path / "runs")  # a checkout of the committed grid: rebuilt from validation.json
  assert tables.validation_report(str(tmp_path), [1e-4, 5e-4, 1e-3], [0, 1], ["grpo", "ict"], "pass@4") == out
  assert (tmp_path / "validation.md").read_text() == md
