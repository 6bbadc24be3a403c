"""`python -m ict_jax.aot`: the tiny config compiled for absent TPU / GPU targets, through the CLI.

Each compile runs in its own process (the CLI, as a user runs it): aot makes the CPU the only
runtime backend and loads libtpu / the CUDA plugin as compilers of compile-only devices. Shapes
are kept small (16-32 rows, 32-token sequences) so each compile takes seconds.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny model, 2 prompts x G 8 = 16 rows, prompt bucket 16, 16 completion columns
SMALL = ["--config", "configs/tiny.py", "--config.rollout.prompts_per_step=2", "--completion_len", "16"]
# 4 prompts = 32 rows over fsdp 2 x tensor 4: a micro-batch of 16 puts one whole group on each
# row shard, one of 32 two (groups stay on their chips, so only the row count differs)
MESH_2X4 = ["--config.rollout.prompts_per_step=4", "--config.mesh.fsdp=2", "--config.mesh.tensor=4"]


def aot(*args, json_path=None):
  cmd = [sys.executable, "-m", "ict_jax.aot", *args]
  if json_path:
    cmd += ["--json", str(json_path)]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  report = json.load(open(json_path)) if json_path and os.path.exists(json_path) else None
  return proc, report


@pytest.fixture(scope="module")
def tpu_small(tmp_path_factory):
  """v5e-8 (fsdp 2 x tensor 4), micro-batches of 16 and of 32 rows."""
  out = {}
  for mb in (16, 32):
    path = tmp_path_factory.mktemp("aot") / f"mb{mb}.json"
    proc, report = aot(*SMALL, *MESH_2X4, "--target", "v5e-8", f"--config.train.micro_batch_size={mb}", json_path=path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[mb] = (proc, report)
  return out


def test_report_has_the_keys_and_fits(tpu_small):
  proc, r = tpu_small[16]
  for key in (
      "fits",
      "peak_bytes_per_device",
      "hbm_bytes_per_device",
      "compile_s",
      "collectives",
      "model_flops_per_step",
      "temp_bytes",
      "argument_bytes",
      "generated_code_bytes",
      "margin_bytes",
  ):
    assert key in r, key
  assert r["fits"] is True and r["compiler_accepted"] is True and r["target"] == "v5e-8"
  assert r["hbm_bytes_per_device"] == int(15.75 * 2**30)  # libtpu's usable HBM of a v5e chip
  assert 0 < r["peak_bytes_per_device"] < r["hbm_bytes_per_device"]
  assert r["margin_bytes"] == r["hbm_bytes_per_device"] - r["peak_bytes_per_device"]
  assert r["peak_bytes_per_device"] == (
      r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"] + r["generated_code_bytes"]
  )
  assert r["shapes"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
  assert r["shapes"]["kernels"] == "portable"  # model.kernels "auto" on the TPU topology's devices
  assert r["compile_s"] > 0
  assert "fits, margin" in proc.stdout and "collectives:" in proc.stdout


def test_collective_counts_are_ints_and_fsdp_gathers(tpu_small):
  c = tpu_small[16][1]["collectives"]
  assert all(type(v) is int and v >= 0 for v in c.values())
  assert sum(c.values()) > 0  # weights split over 8 chips cannot compile without collectives


def test_model_flops_are_flops_per_token_times_tokens(tpu_small):
  from ict_jax.models.config import Qwen2Config

  r = tpu_small[16][1]
  s = r["shapes"]
  assert (s["rows"], s["prompt_len"], s["completion_len"]) == (32, 16, 16)
  seq = s["prompt_len"] + s["completion_len"]
  expected = Qwen2Config.preset("tiny").flops_per_token(seq) * s["rows"] * seq
  assert r["model_flops_per_step"] == pytest.approx(expected, rel=1e-12)


def test_bigger_micro_batch_needs_more_temporaries(tpu_small):
  small, big = tpu_small[16][1], tpu_small[32][1]
  assert big["shapes"]["micro_batch_size"] == 32 and small["shapes"]["micro_batch_size"] == 16
  assert big["temp_bytes"] > small["temp_bytes"]
  assert big["argument_bytes"] == small["argument_bytes"]  # same state, same batch


def test_oversized_config_does_not_fit_and_exits_1(tmp_path):
  """8192-token sequences, einsum attention without remat: the saved f32 scores alone are ~1 GiB
  a row."""
  proc, r = aot(
      "--config",
      "configs/tiny.py",
      "--config.rollout.prompts_per_step=16",
      "--config.model.remat_policy=none",
      "--config.model.attention=einsum",
      "--completion_len",
      "8176",
      "--target",
      "v5e-8",
      json_path=tmp_path / "big.json",
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert r["fits"] is False and r["compiler_accepted"] is False
  assert r["peak_bytes_per_device"] > r["hbm_bytes_per_device"]
  assert "RESOURCE_EXHAUSTED" in r["error"]
  assert "DOES NOT FIT" in proc.stdout
  assert "--config.train.micro_batch_size" in proc.stdout  # says which setting to lower


def test_gpu_target_compiles_and_compares_peak_with_hbm(tmp_path):
  proc, r = aot(*SMALL, "--target", "h100-8", json_path=tmp_path / "gpu.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert r["fits"] is True
  assert r["hbm_bytes_per_device"] == int(84978434048 * 0.90)  # spec's HBM x launch's 0.90
  assert 0 < r["peak_bytes_per_device"] < r["hbm_bytes_per_device"]
  assert all(type(v) is int for v in r["collectives"].values())


@pytest.mark.parametrize(
    "args, words",
    [
        (["--target", "v7-1024"], ["--target 'v7-1024': unknown", "v5e-8", "h200-8"]),
        (["--target", "v5p-32", "--config.mesh.fsdp=8"], ["v5p-32 has 16 chips", "needs 8 devices"]),
        (
            ["--target", "v5e-8", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"],
            ["v5e-8 has 8 chips", "needs 4 devices"],
        ),
        (["--target", "v5p-32"], ["micro_batch_size: a micro-batch of 8 rows", "= 16 devices"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
  extra = ["--config.train.micro_batch_size=8"] if args == ["--target", "v5p-32"] else []
  proc, _ = aot(*SMALL, *args, *extra)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("ict_jax.aot: error:"), proc.stderr
  for w in words:
    assert w in lines[0], lines[0]
