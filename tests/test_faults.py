"""Faults end to end through `python -m ict_jax.train` (1 CPU device per run).

The harness is `python -m benchmarks.faults` (benchmarks/faults/), which runs the same functions at
full size (10 kills, a 100 MB line, a 200-step soak) and prints the table for benchmarks/RESULTS.md;
here each fault runs once, small. Every CLI run is a fresh process, so this file is slow on a busy machine (minutes).
What the sibling files already check in-process (message texts of bad model folders and config
keys, checkpoint fallback on one Checkpointer, the reward guards) is not repeated: these tests
check what only the whole program shows (exit codes, stderr, resume, metrics across processes).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.faults import (
    checkpoint,
    cli,
    config_abuse,
    data_files,
    harness,
    hook,
    kill,
    model_folders,
    nonfinite,
    registry,
    rewards,
    sigterm,
    soak,
)

REPO = Path(__file__).resolve().parent.parent

STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root):
  """One uninterrupted run every resumed run is compared with."""
  ref_dir, rows, run = harness.reference_run(root / "ref", STEPS, EVERY, str(root / "data"))
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert harness.checkpoint_dirs(ref_dir) == ([2, 4, 6], [])
  # the reference learns something, so equal metrics mean equal parameters, not zeros
  assert any(r["grad_norm"] > 0 for r in rows) and len({round(r["entropy"], 6) for r in rows}) > 1
  return ref_dir, rows, run


def test_compare_detects_a_difference():
  a = [{"step": 1, "reward_mean": 0.5, "loss": 0.1, "entropy": 1.0, "grad_norm": 0.3}]
  b = [dict(a[0], entropy=1.0 + 2e-4)]
  assert harness.compare(a, a)["ok"] and not harness.compare(a, b)["ok"]
  assert not harness.compare(a, [])["ok"] and not harness.compare(a, [dict(a[0], step=2)])["ok"]


def test_kill9_in_step_and_in_async_save_resumes_exactly(root, reference):
  out = kill.kill_resume(
      root / "kill",
      kills=2,
      steps=STEPS,
      every=EVERY,
      data_dir=str(root / "data"),
      ref=reference,
      phases=("step", "save"),
  )
  cycles = out["cycles"]
  assert [c["phase"] for c in cycles] == ["step", "save"], cycles
  for c in cycles:
    assert c["rc"] == -9 and c["hit"], c  # killed, inside the phase it aimed at
    assert c["resumed_from"] == max(c["complete"] or [0]), c  # newest complete checkpoint
    assert 0 <= c["lost"] <= EVERY, c
  save = cycles[1]
  assert save["save_step"] not in save["complete"] and save["left_behind"], save  # the save was in flight
  assert out["compare"]["ok"] and out["compare"]["steps"] == STEPS, out["compare"]
  assert out["passed"], out["observed"]
  assert harness.checkpoint_dirs(root / "kill" / "killed")[1] == []  # the killed save's temp dir is gone


def test_sigterm_during_sampling_drops_a_step_that_cannot_fit_the_grace(root, reference):
  out = sigterm.sigterm(
      root / "term",
      data_dir=str(root / "data"),
      ref=reference,
      steps=STEPS,
      every=EVERY,
      cases=(("sample", 8.0, "sample=1,step=12"),),
  )
  (c,) = out["cases"]
  assert c["rc"] == 0 and c["exit_s"] <= c["grace_s"], c  # an 8 s step was not started
  assert c["saved"][-1] == c["last_logged"] == 1 and c["temp_dirs"] == [], c
  assert c["resumed_from"] == 1 and c["compare"]["ok"], c  # the data position was rewound too
  assert out["passed"]


def test_nonfinite_updates_are_skipped_counted_and_training_continues(root):
  out = nonfinite.nonfinite(root, steps=6, nan_step=2, inf_step=4)
  rec = out["steps"]
  assert [r["step"] for r in rec] == list(range(1, 7))
  assert [r["skipped"] for r in rec] == [0, 1, 0, 1, 0, 0]
  assert [r["total_skipped"] for r in rec] == [0, 1, 1, 2, 2, 2]
  assert math.isnan(rec[1]["loss"]) and not math.isfinite(rec[3]["loss"])
  assert rec[1]["delta"] == 0.0 and rec[3]["delta"] == 0.0  # nothing applied
  assert all(r["finite"] for r in rec)
  assert all(np.isfinite(r["loss"]) for r in rec if r["step"] not in (2, 4))
  assert rec[4]["delta"] > 0 or rec[5]["delta"] > 0  # updates resume
  assert out["passed"], out["observed"]


def test_truncated_newest_checkpoint_falls_back_then_is_replaced(root, reference):
  out = checkpoint.truncated_checkpoint(
      root / "trunc", data_dir=str(root / "data"), ref=reference, steps=STEPS, every=EVERY
  )
  assert out["passed"], out["observed"]


@pytest.mark.parametrize("name", ["wrong-shaped tensor", "truncated safetensors"])
def test_bad_model_folder_is_one_error_line(root, name):
  out = model_folders.bad_model_folders(root, names=[name], data_dir=str(root / "data"))
  (c,) = out["cases"]
  assert c["rc"] != 0 and c["error"], c
  assert c["ok"], c


def test_hostile_completions_score_zero_in_bounded_time_and_memory():
  out = rewards.hostile_rewards(rounds=2, workers=2, timeout_s=5.0)
  assert out["passed"], out["observed"]
  assert max(out["times"]) < 5.0 * 3 + 5.0


def test_soak_keeps_disk_memory_and_open_files_bounded(root):
  """soak.py at the smallest size that has later checkpoint cycles to compare (steps 20..24 the
  first cycle, 24..32 the later ones): disk within keep + 1 checkpoints, the newest kept."""
  out = soak.soak(root, steps=32, every=2, keep=3, data_dir=str(root / "data"), interval=0.1)
  samples = out["samples"]
  assert samples and max(s["step"] for s in samples) >= 24, out["observed"]
  assert max(s["ckpt_dirs"] for s in samples) <= 4
  assert harness.checkpoint_dirs(root / "soak")[0] == [28, 30, 32]
  assert out["passed"], out["observed"]


def test_bad_gsm8k_rows_are_skipped_and_an_empty_file_is_named(root):
  out = data_files.bad_data(root, huge_mb=4)
  assert out["passed"], out["observed"]


@pytest.mark.parametrize("name", ["negative steps", "mesh 3 on 8 devices"])
def test_config_abuse_fails_before_compiling(root, name):
  out = config_abuse.config_abuse(root, names=[name])
  (c,) = out["cases"]
  assert c["rc"] != 0 and len(c["lines"]) == 1 and not c["compiled"] and not c["checkpoints"], c
  assert c["ok"], c


def test_table_lists_every_row():
  rows = [harness.row("a|b", "x", "y", "z", True), harness.row("c", "x", "y", "z", False)]
  text = harness.markdown(rows).splitlines()
  assert len(text) == 4 and text[2].endswith("| PASS |") and text[3].endswith("| FAIL |")
  assert "a\\|b" in text[2]
  json.dumps(rows)


def test_scenarios_are_registered_in_the_table_order():
  order = ("config", "hf", "data", "rewards", "nonfinite", "ckpt", "sigterm", "kill", "soak")
  assert cli.ALL == order and sorted(registry.SCENARIOS) == sorted(order)


def test_main_runs_the_chosen_scenarios_and_a_harness_error_is_a_fail_row(tmp_path, monkeypatch, capsys):
  seen = []

  def fine(ctx):
    seen.append(ctx)
    return harness.row("fine", "x", "y", "z", True)

  def broken(ctx):
    raise RuntimeError("boom")

  monkeypatch.setitem(registry.SCENARIOS, "config", fine)
  monkeypatch.setitem(registry.SCENARIOS, "hf", broken)
  out, root = tmp_path / "rows.json", tmp_path / "root"
  assert cli.main(["--only", "config", "--root", str(root), "--kills", "3", "--json", str(out)]) == 0
  (ctx,) = seen
  assert (ctx.root, ctx.kills, ctx.soak_steps, ctx.huge_mb, ctx.data_dir) == (root, 3, 200, 100, str(root / "data"))
  assert [r["fault"] for r in json.loads(out.read_text())] == ["fine"]
  assert cli.main(["--only", "hf,config", "--root", str(root), "--json", str(out)]) == 1
  rows = json.loads(out.read_text())
  assert [(r["fault"], r["passed"]) for r in rows] == [("hf", False), ("fine", True)]
  assert rows[0]["observed"] == "harness error RuntimeError: boom"
  table = capsys.readouterr().out
  assert "| hf |  |  | harness error RuntimeError: boom | FAIL |" in table and '"passed": 1' in table


def test_context_runs_each_reference_once(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(registry, "reference_run", lambda *a: calls.append(a) or len(calls))
  ctx = registry.Context(tmp_path)
  assert ctx.ref(8, 4) == ctx.ref(8, 4) == 1 and ctx.ref(6, 2) == 2
  assert calls == [
      (tmp_path / "ref_8_4", 8, 4, str(tmp_path / "data")),
      (tmp_path / "ref_6_2", 6, 2, str(tmp_path / "data")),
  ]


def test_a_scenario_name_registers_once():
  with pytest.raises(ValueError, match="'kill' registered twice"):
    registry.scenario("kill")(lambda ctx: None)


def test_patch_on_import_patches_its_module_after_the_module_code_and_no_other(tmp_path, monkeypatch):
  for name in ("faults_probe_patched", "faults_probe_other"):
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.delitem(sys.modules, name, raising=False)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
  seen = []
  finder = hook.install({"faults_probe_patched": lambda m: seen.append(m.VALUE) or setattr(m, "VALUE", 2)})
  assert sys.meta_path[0] is finder
  import faults_probe_other  # pylint: disable=import-outside-toplevel,import-error
  import faults_probe_patched  # pylint: disable=import-outside-toplevel,import-error

  assert faults_probe_patched.VALUE == 2 and seen == [1] and faults_probe_other.VALUE == 1
  monkeypatch.delitem(sys.modules, "faults_probe_patched")
  monkeypatch.delitem(sys.modules, "faults_probe_other")


def test_command_line_lists_the_scenarios():
  """`python -m benchmarks.faults` from the repository root; an unknown --only names the known ones."""
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.faults", "--only", "config,nope"],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 2 and proc.stdout == "", proc.stderr
  assert (
      "--only: unknown ['nope']; known ('config', 'hf', 'data', 'rewards', 'nonfinite', 'ckpt', 'sigterm'"
      in proc.stderr
  )
