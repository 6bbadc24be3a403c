"""benchmarks/iteration.py end to end on tiny shapes: it runs, prints one JSON object, every
completion has exactly --new-tokens tokens (EOS disabled) on both sides, and the reported
throughput is tokens per iteration / median iteration time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "iteration.py")
PROMPTS, GENERATIONS, NEW = 2, 4, 8  # --smoke shapes
TOKENS = PROMPTS * GENERATIONS * NEW
# cheap XLA:CPU code generation: compilation dominates a tiny run
CHEAP_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _have(module: str) -> bool:
  import importlib.util

  return importlib.util.find_spec(module) is not None


def _check_side(side: dict, iterations: int, warmup: int):
  assert len(side["iteration_s"]) == iterations and len(side["warmup_s"]) == warmup
  median = sorted(side["iteration_s"])[iterations // 2]
  assert side["median_s"] == pytest.approx(median, abs=1e-3)
  # median_s is rounded to 4 decimals; smoke iterations are short, so allow for that rounding
  rounding = 5e-5 / side["median_s"]
  assert side["tokens_per_s"] == pytest.approx(TOKENS / side["median_s"], rel=2e-3 + rounding)
  assert side["completion_tokens"] == [TOKENS] * (iterations + warmup)  # no early EOS


@pytest.mark.skipif(
    not (_have("torch") and _have("transformers") and _have("trl") and _have("datasets")),
    reason="needs torch, transformers, trl, datasets",
)
def test_iteration_smoke_prints_consistent_json():
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CHEAP_XLA).strip())
  proc = subprocess.run(
      [sys.executable, SCRIPT, "--smoke", "--iterations", "1", "--warmup", "1"],
      capture_output=True,
      text=True,
      env=env,
      cwd=ROOT,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  assert report["tokens_per_iteration"] == TOKENS
  assert (report["prompts"], report["generations"], report["new_tokens"]) == (PROMPTS, GENERATIONS, NEW)
  assert report["model"]["vocab"] == 512 and report["method"] == "ict"
  ours, trl = report["ours"], report["trl"]
  _check_side(ours, 1, 1)
  _check_side(trl, 1, 1)
  assert trl["prompt_tokens"] == [8]
  assert set(ours["median_parts_s"]) == {"sample_s", "reward_s", "rollout_other_s", "step_s"}
  assert sum(ours["median_parts_s"].values()) == pytest.approx(ours["median_s"], abs=5e-3)
  assert ours["cpus"] == trl["cpus"] and len(ours["cpus"]) <= 2
  assert report["ratio_ours_over_trl"] == pytest.approx(ours["tokens_per_s"] / trl["tokens_per_s"], rel=0.02)


@pytest.mark.skipif(not (_have("torch") and _have("transformers")), reason="needs torch, transformers")
def test_sampling_runs_standalone_from_any_directory(tmp_path):
  """`python benchmarks/sampling.py` needs no installed package or PYTHONPATH (it once failed
  with "No module named 'ict_jax'"); on tiny shapes its JSON is consistent with its timings."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CHEAP_XLA).strip()
  proc = subprocess.run(
      [
          sys.executable,
          os.path.join(ROOT, "benchmarks", "sampling.py"),
          "--batch",
          "2",
          "--prompt",
          "8",
          "--new",
          "4",
          "--repeats",
          "1",
          "--modes",
          "greedy",
      ],
      capture_output=True,
      text=True,
      env=env,
      cwd=tmp_path,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  greedy = out["results"]["greedy"]
  assert out["new_tokens"] == 4 and out["batch"] == 2
  assert greedy["ours_tokens_per_s"] == pytest.approx(2 * 4 / min(greedy["ours_s"]), rel=0.02)
  assert greedy["greedy_tokens_equal_fraction"] == 1.0  # same weights, same argmax
