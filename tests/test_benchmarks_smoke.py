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


# ---- every script of benchmarks/, at tiny shapes ------------------------------------------------
# Each script in benchmarks/ (a .py file, or a package run as `python -m benchmarks.NAME`) -> the
# test that runs it: a test of this module, or another test file that runs it (which must name the
# script, or import the package). A new script without an entry fails
# test_every_benchmark_script_has_a_smoke_run.
SMOKE = {
    "aot_table.py": "test_aot_table_compiles_one_recipe_into_its_own_folder",
    "assemble_sweep.py": "tests/test_compare_methods.py",
    "compaction.py": "test_compaction_same_tokens_fewer_row_steps",
    "compare_logs.py": "test_compare_logs_identical_and_different",
    "compare_methods.py": "test_compare_methods_one_seed_one_step",
    "compare_tables.py": "tests/test_compare_methods.py",
    "compile_head.py": "test_compile_head_tiny_on_v5e_8",
    "compile_step.py": "test_compile_step_tiny_on_v5e_8",
    "decode_weights.py": "tests/test_decode_weights.py",
    "device_check.py": "test_device_check_smoke_packed_and_padded",
    "draw_bytes.py": "test_draw_bytes_tiny_on_v5e_8",
    "faults": "tests/test_faults.py",
    "fma_rate.py": "test_fma_rate_prints_json",
    "iteration.py": "test_iteration_smoke_prints_consistent_json",
    "length.py": "test_length_trims_to_the_bucket",
    "sampling.py": "test_sampling_runs_standalone_from_any_directory",
    "selection.py": "test_selection_tiny",
    "step.py": "test_step_tiny_matches_torch",
    "warm_start_sweep.py": "test_warm_start_sweep_one_spec",
}


def test_every_benchmark_script_has_a_smoke_run():
  bench = os.path.join(ROOT, "benchmarks")
  packages = [f for f in os.listdir(bench) if os.path.isfile(os.path.join(bench, f, "__main__.py"))]
  scripts = sorted([f for f in os.listdir(bench) if f.endswith(".py")] + packages)
  assert scripts == sorted(SMOKE), "add the new benchmark script to SMOKE, with a smoke test"
  for script, where in SMOKE.items():
    if where.startswith("tests/"):
      needle = f'"{script}"' if script.endswith(".py") else f"from benchmarks.{script} import"
      with open(os.path.join(ROOT, where)) as f:
        assert needle in f.read(), f"{where} does not run benchmarks/{script}"
    else:
      assert callable(globals().get(where)), f"{script}: no test named {where} in this module"


def _run_script(script: str, *args: str, cwd=ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
  """`python benchmarks/SCRIPT ARGS` as a user runs it: one CPU device (not the test setup's 8),
  cheap XLA:CPU code generation."""
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env["XLA_FLAGS"] = (flags + " " + CHEAP_XLA).strip()
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
      capture_output=True,
      text=True,
      env=env,
      cwd=cwd,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _json_lines(proc) -> list[dict]:
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _tiny_params() -> int:
  from ict_jax.models.config import Qwen2Config

  return Qwen2Config.preset("tiny").num_params()


def test_aot_table_compiles_one_recipe_into_its_own_folder(tmp_path):
  """One recipe on the tiny model through `python -m ict_jax.aot` (both programs), its JSONs in
  --out; --no_docs leaves README.md, launch/README.md and RESULTS.md untouched."""
  docs = [os.path.join(ROOT, p) for p in ("README.md", os.path.join("launch", "README.md"), "benchmarks/RESULTS.md")]
  before = [open(p).read() for p in docs]
  name = "0.5b_v5e-8_mb16"
  tiny = "--config.model.preset=tiny --config.rollout.prompts_per_step=2 --prompt_len 16 --completion_len 16"
  proc = _run_script("aot_table.py", "--only", name, "--out", str(tmp_path), "--no_docs", f"--aot_args={tiny}")
  assert [open(p).read() for p in docs] == before
  reports = json.load(open(tmp_path / "aot.json"))
  assert sorted(reports) == ["sample", "train"] and list(reports["train"]) == [name] == list(reports["sample"])
  train, sample = reports["train"][name], reports["sample"][name]
  assert train["command"].endswith(f"{tiny} --part train --json {tmp_path}/aot/{name}.train.json")
  assert train["fits"] is True and train["shapes"]["micro_batch_size"] == 16 and train["chips"] == 8
  assert train["shapes"]["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  sampler = sample["sampler"]
  for key in ("peak_bytes_per_device", "resident_bytes", "decode_batch_size", "decode_step_bytes", "fits"):
    assert key in sampler, key
  # what stays on the chips while sampling: float32 parameters + Adam's two moments, 12 B a
  # parameter over the 8 chips (launch/README.md's arithmetic; small vectors replicate)
  assert sampler["resident_bytes"] == pytest.approx(12 * _tiny_params() / 8, rel=1e-3)
  row = next(line for line in proc.stdout.splitlines() if line.startswith("| 0.5B | v5e-8 | 1, 8, 1 | 16 |"))
  assert ", yes |" in row and "not measured" not in row


def test_compare_methods_one_seed_one_step(tmp_path):
  """The comparison's own loop (warm-start, RL run ending on validation, the checkpoint validated
  again for pass@4, lr choice, held-out test of the checkpoint, report) on one setting, seed, lr
  and step, then a validation-only grid over the finished run; tests/test_compare_methods.py
  checks its statistics and the order that keeps the test out of the lr choice."""
  args = (
      "compare_methods.py", "--settings", "level1", "--seeds", "0", "--lrs", "3e-4", "--steps", "1",
      "--sft_steps", "1", "--val_prompts", "4", "--val_samples", "4", "--test_prompts", "3",
      "--test_samples", "4", "--methods", "ict", "--ablations", "", "--set", "rollout.prompts_per_step=2",
      "--out", str(tmp_path),
  )  # fmt: skip
  rows = _json_lines(_run_script(*args))
  plan = rows[0]["plan"]
  assert (plan["rl_runs"], plan["test_evals"], plan["settings"]) == (1, 2, ["level1"]) and plan["expected_cpu_h"] > 0
  assert [(r["variant"], r["lr"], r["seed"]) for r in rows if "val_pass@4" in r] == [("ict", 3e-4, 0)]
  assert [r["chosen_lr"] for r in rows if "chosen_lr" in r] == [{"ict": 3e-4}]
  tests = [(r["variant"], r["lr"], r["seed"], r["test_pass@1"]) for r in rows if "test_pass@1" in r]
  assert [t[:3] for t in tests] == [("warm-start", None, 0), ("ict", 3e-4, 0)] and all(0 <= t[3] <= 1 for t in tests)
  out = tmp_path / "level1"
  results = json.load(open(out / "results.json"))
  assert set(results) == {"chosen_lr", "summary", "validation", "tests"}
  assert [len(t["counts"]) for t in results["tests"]] == [3, 3] and {t["n"] for t in results["tests"]} == {4}
  (sig,) = [r["signature"] for r in results["validation"]]  # the run's selected tokens, from its metrics log
  assert set(sig) == {"selected_prob", "selected_high_entropy"}
  assert all(0 <= v["mean"] <= 1 and v["mean"] == v["last10"] for v in sig.values())  # one step
  assert "ICT | active_mean | 1 |" in (out / "table.md").read_text()
  assert (out / "passk.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0
  assert "| ICT | 0.0003 | 1 |" in (out / "table.md").read_text()
  (record,) = results["validation"]  # validated again from the checkpoint: the periodic eval's numbers
  assert record["val"]["pass@1"] == record["val_pass@1"] and record["val"]["pass@1"] <= record["val"]["pass@4"]
  assert "Validation pass@4 / pass@1" in (out / "table.md").read_text()
  rows = _json_lines(_run_script(*args, "--validation_only"))  # the finished run: no training, no test
  assert rows[0]["plan"]["test_evals"] == 0 and not [r for r in rows if "test_pass@1" in r]
  assert json.load(open(out / "validation.json"))["chosen_lr"] == {"ict": 3e-4}
  assert "Chosen at the grid's edge (extend the grid): ICT." in (out / "validation.md").read_text()


def test_compile_head_tiny_on_v5e_8():
  proc = _run_script(
      "compile_head.py", "--target", "v5e-8", "--rows", "16", "--columns", "32", "--hidden", "64", "--vocab", "1024",
      "--chunk", "16",
  )  # fmt: skip
  (out,) = _json_lines(proc)
  assert (out["target"], out["chips"], out["rows"], out["columns"], out["vocab"]) == ("v5e-8", 8, 16, 32, 1024)
  assert out["compile_s"] > 0 and out["compile_cpu_s"] >= 0 and out["temp_gib"] >= 0 and "load_avg_1m" in out


def test_compile_step_tiny_on_v5e_8():
  proc = _run_script(
      "compile_step.py", "--config", "configs/tiny_arith.py", "--preset", "tiny", "--target", "v5e-8",
      "--rows", "16", "--micro_batch", "16", "--prompt", "16", "--completion", "16",
  )  # fmt: skip
  (out,) = _json_lines(proc)
  assert out["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and (out["rows"], out["micro_batch"]) == (16, 16)
  for key in ("lower_s", "compile_s", "compile_cpu_s", "temp_gib", "output_gib", "load_avg_1m"):
    assert out[key] >= 0, key
  # the arguments a chip holds: the float32 state (12 B a parameter) over 8 chips + the batch
  assert out["argument_gib"] == pytest.approx(12 * _tiny_params() / 8 / 2**30, abs=6e-4)
  assert out["collectives"]["all-gather"] > 0  # FSDP gathers the weights


def test_draw_bytes_tiny_on_v5e_8():
  """The head + draw of 8 rows over 4096 ids on one v5e chip: plain sampling accesses at most one
  logits array more than greedy, and greedy at least what the head and its maximum do; a key a
  row (the decode loop's draw) accesses what one key does, give or take one logits array."""
  proc = _run_script("draw_bytes.py", "--target", "v5e-8", "--rows", "8", "--hidden", "64", "--vocab", "4096")
  (out,) = _json_lines(proc)
  assert (out["target"], out["rows"], out["vocab"]) == ("v5e-8", 8, 4096)
  for msa in ("", "_no_msa"):
    assert out[f"head_max_mib{msa}"] <= out[f"greedy_mib{msa}"]
    assert out[f"plain_mib{msa}"] <= out[f"greedy_mib{msa}"] + out["logits_mib"]
    assert abs(out[f"row_keys_mib{msa}"] - out[f"plain_mib{msa}"]) <= out["logits_mib"]


def test_device_check_smoke_packed_and_padded(tmp_path):
  """The accelerator check on tiny shapes, padded and packed: the same rows, fewer executed
  positions packed; MFU, the padded share and decode MBU are what their definitions give from the
  lengths, the model's FLOPs a token, its parameter count and the timings the script reports."""
  import numpy as np

  from ict_jax.models.config import Qwen2Config

  runs = {}
  for budget in (0, 96):
    out = tmp_path / f"{budget}.json"
    args = ["--config", "configs/qwen2_5_0_5b_math.py", "--smoke", "--token_budget", str(budget)]
    _run_script("device_check.py", *args, "--hbm_tb_s", "0.05", "--json", str(out))
    runs[budget] = json.loads(out.read_text())
  padded, packed = runs[0]["update"], runs[96]["update"]
  assert padded["completion_lens"] == packed["completion_lens"] and padded["real_tokens"] == packed["real_tokens"]
  assert packed["real_tokens"] <= packed["executed_positions"] < padded["executed_positions"]
  mcfg = Qwen2Config.preset("qwen2_5_0_5b").replace(num_hidden_layers=1, vocab_size=512)
  for run in runs.values():
    up, dec = run["update"], run["decode"]
    lengths = np.add(up["prompt_lens"], up["completion_lens"])
    assert up["real_tokens"] == lengths.sum()
    assert up["padded_fraction"] == pytest.approx(1 - lengths.sum() / up["executed_positions"])
    flops = sum(mcfg.flops_per_token(int(n)) * int(n) for n in lengths)
    assert up["mfu"] == pytest.approx(flops / up["step_s"] / 1e12 / run["peak_tflops"], rel=1e-6)
    # decode: steps half .. new - 1 read the float32 weights, 1 prompt x 16 slots, the filled slots
    rows, new, half = dec["rows"], dec["new"], dec["half"]
    assert (rows, new, half, dec["prompt"]) == (16, 32, 17, 16)
    assert dec["step_s"] == pytest.approx((dec["long_s"] - dec["short_s"]) / (new - half))
    slot = 2 * 1 * mcfg.num_key_value_heads * mcfg.head_dim * 4
    want = mcfg.num_params() * 4 + slot * (rows // 8 * 16 + rows * np.mean(np.arange(half, new)))
    assert dec["step_min_bytes"] == pytest.approx(want)
    assert dec["decode_mbu"] == pytest.approx(want / dec["step_s"] / 0.05e12)


def test_fma_rate_prints_json():
  import shutil

  out = json.loads(_run_script("fma_rate.py", "--iters", "200000", "--repeats", "1").stdout)
  assert (out["threads"], out["iters"], out["repeats"]) == (2, 200000, 1) and out["cpus"]
  if shutil.which("cc") or shutil.which("gcc"):
    assert out["gflops"] > 0
  else:
    assert out["gflops"] is None


def test_compaction_same_tokens_fewer_row_steps():
  """The compaction benchmark at tiny shapes: the same tokens both ways (the script asserts it),
  row-steps counted from the programs, never fewer than the tokens, fewer with compaction."""
  proc = _run_script(
      "compaction.py", "--preset", "tiny", "--vocab", "512", "--prompts", "4", "--group", "2", "--prompt", "8",
      "--new", "32", "--median", "6", "--capped", "0.15", "--repeats", "1",
  )  # fmt: skip
  (out,) = _json_lines(proc)
  assert out["same_tokens"] and out["rows"] == 8 and out["phases"] == [16, 32]
  steps = out["row_steps"]
  assert out["tokens_generated"] - out["rows"] <= steps["compacted"] < steps["full"]  # token 0 is the prefill's
  assert out["stretch_rows_compacted"][0] == 8 and out["stretch_rows_compacted"][-1] < 8
  assert min(out["wall_s_best"].values()) > 0


def test_length_trims_to_the_bucket():
  from ict_jax.sampling import bucket_length

  proc = _run_script(
      "length.py", "--max_new", "32", "--lengths", "8,32", "--batch", "8", "--prompt", "8", "--vocab", "256",
      "--hidden", "32", "--layers", "1", "--repeats", "1", "--flop_batches", "2", "--dist_rows", "16",
      "--dist_timed", "1",
  )  # fmt: skip
  (out,) = _json_lines(proc)
  assert [r["width"] for r in out["trimmed"]] == [min(32, bucket_length(8)), 32]
  assert out["untrimmed"]["width"] == 32 and out["untrimmed"]["longest"] == 8
  assert out["trimmed"][0]["temp_bytes"] < out["untrimmed"]["temp_bytes"]  # fewer columns, fewer bytes
  assert all(r["step_s"] > 0 for r in out["trimmed"]) and out["backend"] == "cpu"
  assert set(out["distributions"]) == {"capped15", "uncapped"}
  for dist in out["distributions"].values():  # packing executes fewer FLOPs than padding, never below real
    ratio = dist["executed_over_real_flops"]
    assert 1.0 <= ratio["packed"] < ratio["padded"]
    assert 1.0 <= dist["decoder_executed_over_real_flops"]["packed"] <= ratio["packed"]
    assert min(dist["cpu_step_s"][k] for k in ("padded", "packed", "packed_tokens")) > 0
    assert 1.0 <= dist["decoder_executed_over_real_flops"]["packed_tokens"] < ratio["padded"]


def test_selection_tiny():
  """`python benchmarks/selection.py` once crashed (`'Head' object has no attribute 'cfg'`)."""
  proc = _run_script(
      "selection.py", "--preset", "tiny", "--vocab", "512", "--batch", "8", "--prompt", "8", "--completion", "16",
      "--chunk", "8", "--repeats", "1",
  )  # fmt: skip
  (out,) = _json_lines(proc)
  assert (out["model"], out["vocab"], out["completion_len"]) == ("tiny", 512, 16)
  assert out["overhead_ratio"] == pytest.approx(out["ict_step_s"] / out["grpo_step_s"], rel=1e-2)
  assert out["selected_frac"]["grpo"] == 1.0 and 0 < out["selected_frac"]["ict"] < 0.5
  assert out["selected_frac"]["ict_sequence_mean"] == out["selected_frac"]["ict"]  # same k per response
  refs = out["references"]
  assert set(refs) == {"active_mean", "sequence_mean"} and all(
      r["temp_bytes"] > 0 and r["step_s"] > 0 for r in refs.values()
  )
  assert refs["active_mean"]["step_s"] == out["ict_step_s"]
  rows = out["sparse_rows"]
  assert 0 < rows["selected"] <= rows["capacity"] < rows["of"] == 8 * 16
  assert set(out["breakdown"]) == {
      "logp_only_no_remat_fwd_bwd_s",
      "logp_only_fwd_bwd_s",
      "fused_dense_fwd_bwd_s",
      "fused_sparse_fwd_bwd_s",
      "fused_forward_only_s",
  }
  assert all(len(v) == 1 for v in out["all_s"].values())


@pytest.mark.skipif(not (_have("torch") and _have("transformers")), reason="needs torch, transformers")
def test_step_tiny_matches_torch():
  proc = _run_script(
      "step.py", "--layers", "1", "--vocab", "512", "--batch", "8", "--prompt", "8", "--completion", "16",
      "--chunk", "8", "--repeats", "1",
  )  # fmt: skip
  out = _json_lines(proc)[-1]
  assert out["model"]["vocab"] == 512 and out["model"]["layers"] == 1 and out["tokens_per_step"] == 8 * 24
  assert out["logp_max_abs_diff"] < 1e-4  # the same weights and batch through PyTorch
  assert out["speedup_vs_torch"] == pytest.approx(out["torch"]["step_s"] / out["ours"]["step_s"], rel=1e-2)
  assert out["ours"]["method"] == "ict" and 0 < out["ours"]["selected_frac"] < 0.5


def test_warm_start_sweep_one_spec(tmp_path):
  proc = _run_script("warm_start_sweep.py", "level1:3e-3:2:0", "--workdir", str(tmp_path))
  (out,) = _json_lines(proc)
  assert (out["level"], out["lr"], out["steps"], out["seed"]) == ("level1", 0.003, 2, 0)
  for split in ("train", "test"):
    r = out[split]
    assert 0 <= r["pass@1"] <= r["pass@8"] <= 1 and r["mean_response_tokens"] > 0
  assert " -> " in out["example"]


def test_compare_logs_identical_and_different(tmp_path):
  """benchmarks/compare_logs.py: two runs' metrics logs, every non-timing metric exact."""
  from ict_jax.logs import JsonlLog
  from etils import epath

  rows = [{"step": s, "loss": 0.5 / s, "entropy": float("nan"), "step_s": 1.0 + s} for s in (1, 2, 3)]
  for name, table in (
      ("a", rows),
      ("b", [dict(r, step_s=9.0) for r in rows]),
      ("c", rows[:2] + [dict(rows[2], loss=0.1)]),
  ):
    JsonlLog(epath.Path(tmp_path / name / "metrics"), 0).write(3, table)
  same = _run_script("compare_logs.py", str(tmp_path / "a"), str(tmp_path / "b"))
  assert same.returncode == 0, same.stderr
  out = json.loads(same.stdout)
  assert out["identical"] and out["steps_compared"] == 3 and out["keys_compared"] == ["entropy", "loss", "step"]
  script = os.path.join(ROOT, "benchmarks", "compare_logs.py")
  other = subprocess.run(
      [sys.executable, script, str(tmp_path / "a"), str(tmp_path / "c")], capture_output=True, text=True
  )
  assert other.returncode == 1, other.stderr
  assert json.loads(other.stdout)["differences"] == [{"step": 3, "key": "loss", "a": 0.5 / 3, "b": 0.1}]
