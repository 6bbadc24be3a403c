"""`python -m ict_jax.aot`: the tiny config compiled for absent TPU / GPU targets, through the CLI.

Each compile runs in its own process (the CLI, as a user runs it): aot makes the CPU the only
runtime backend and loads libtpu / the CUDA plugin as compilers of compile-only devices. Shapes
are kept small (16-32 rows, 32-token sequences) so each compile takes seconds.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny model (the full Qwen2.5 vocabulary: configs/tiny_arith.py), 2 prompts x G 8 = 16 rows, prompt bucket 16, 16 completion columns
SMALL = ["--config", "configs/tiny_arith.py", "--config.rollout.prompts_per_step=2", "--completion_len", "16"]
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
    proc, report = aot(
        *SMALL,
        *MESH_2X4,
        "--target",
        "v5e-8",
        "--part",
        "train",
        f"--config.train.micro_batch_size={mb}",
        json_path=path,
    )
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


def test_packed_step_compiles_at_its_largest_batch(tpu_small, tmp_path):
  """train.token_budget: the packed step train.py runs, at its largest batch (every sequence at
  full length: the most micro-batches, the widest head), micro-batches by tokens. 32 sequences of
  16 + 16 tokens in rows of 32 and micro-batches of 512 tokens: 16 one-sequence rows each, two
  micro-batches; the compiled step's temporaries are about the padded step's of 16 rows (the same
  16 x 32 decoder positions a micro-batch; packing adds segment ids and the head's gathers)."""
  args = ["--config.train.token_budget=32", "--config.train.micro_batch_tokens=512"]
  proc, r = aot(*SMALL, *MESH_2X4, "--target", "v5e-8", "--part", "train", *args, json_path=tmp_path / "p.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert r["fits"] is True
  pk = r["shapes"]["packed"]
  assert pk == dict(
      token_budget=32, micro_batch_tokens=512, width=32, micro_batches=2, packed_rows_per_micro_batch=16, head_width=16
  )
  assert r["shapes"]["micro_batch_size"] == 16 and "2 micro-batches x 16 rows of 32 tokens" in proc.stdout
  padded = tpu_small[16][1]  # the same 32 rows, padded, micro-batches of 16 rows
  assert r["model_flops_per_step"] == padded["model_flops_per_step"]
  assert r["temp_bytes"] == pytest.approx(padded["temp_bytes"], rel=0.25)


def test_packed_step_compiles_on_gpu_with_cudnns_sequence_packing(tmp_path):
  """The packed step on h100-8 in bfloat16, where auto attention is cudnn: cuDNN's sequence
  packing (the runs as ragged offsets) compiles, forward and backward, for the Hopper target."""
  args = ["--config.model.dtype=bfloat16", "--config.train.token_budget=32", "--config.train.micro_batch_tokens=512"]
  proc, r = aot(*SMALL, *MESH_2X4, "--target", "h100-8", "--part", "train", *args, json_path=tmp_path / "g.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert r["shapes"]["attention"] == "cudnn" and r["cudnn_attention_calls"] == 2 and r["fits"] is True
  assert r["shapes"]["packed"]["micro_batches"] == 2 and r["shapes"]["packed"]["width"] == 32


def test_default_config_compiles_over_its_task_vocabulary(tmp_path):
  """configs/tiny.py (model.vocab="task"): aot builds the task vocabulary from the task's data, as
  the trainer does, and compiles the 128-row model (20 tokens of synthetic_chain level 1)."""
  from ict_jax.models.config import Qwen2Config

  proc, r = aot(
      "--config", "configs/tiny.py", "--config.rollout.prompts_per_step=2", "--completion_len", "16",
      "--target", "v5e-8", "--part", "train", json_path=tmp_path / "default.json",
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  s = r["shapes"]
  seq = s["prompt_len"] + s["completion_len"]
  expected = Qwen2Config.preset("tiny", vocab_size=128).flops_per_token(seq) * s["rows"] * seq
  assert r["model_flops_per_step"] == pytest.approx(expected, rel=1e-12) and r["fits"] is True


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
      "configs/tiny_arith.py",
      "--config.rollout.prompts_per_step=16",
      "--config.model.remat_policy=none",
      "--config.model.attention=einsum",
      "--completion_len",
      "8176",
      "--target",
      "v5e-8",
      "--part",
      "train",
      json_path=tmp_path / "big.json",
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert r["fits"] is False and r["compiler_accepted"] is False
  assert r["peak_bytes_per_device"] > r["hbm_bytes_per_device"]
  assert "RESOURCE_EXHAUSTED" in r["error"]
  assert "DOES NOT FIT" in proc.stdout
  assert "--config.train.micro_batch_size" in proc.stdout  # says which setting to lower


def test_gpu_target_compiles_and_compares_peak_with_hbm(tmp_path):
  """--part both (the default): the train step and the sampler, one JSON, fits only if both do.
  bfloat16 compute: model.attention=auto is cudnn on GPU, and the cuDNN attention is what
  compiles (this machine has no cuDNN library: JAX's version probe is answered for the trace),
  with the 4 query heads over tensor 4 and the 2 KV heads repeated to match (cuDNN's partitioner
  takes q, k and v sharded alike)."""
  args = (*SMALL, *MESH_2X4, "--config.model.dtype=bfloat16", "--target", "h100-8")
  proc, r = aot(*args, json_path=tmp_path / "gpu.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert r["shapes"]["attention"] == "cudnn" and r["sampler"]["shapes"]["attention"] == "cudnn"
  assert r["cudnn_attention_calls"] >= 2  # the forward and backward custom calls of the step
  assert r["sampler"]["cudnn_attention_calls"] >= 1  # the prefill
  assert "attention: cudnn (" in proc.stdout and "dot_product" not in proc.stdout
  assert r["fits"] is True and r["part"] == "both"
  assert r["hbm_bytes_per_device"] == int(84978434048 * 0.90)  # spec's HBM x launch's 0.90
  assert 0 < r["peak_bytes_per_device"] < r["hbm_bytes_per_device"]
  assert all(type(v) is int for v in r["collectives"].values())
  s = r["sampler"]
  assert s["program"] == "sampler" and s["fits"] is True and s["hbm_bytes_per_device"] == r["hbm_bytes_per_device"]
  assert 0 < s["peak_bytes_per_device"] < s["hbm_bytes_per_device"]
  # the CUDA plugin's compile-only executable has no cost analysis: no decode bytes, and it says so
  assert s["decode_step_bytes"] is None and s["decode_bytes_ratio"] is None
  assert "no cost analysis" in s["shapes"]["note"] and s["decode_step_min_bytes"] > 0
  assert "train_step on h100-8" in proc.stdout and "sampler on h100-8" in proc.stdout


# ---- the sampler ------------------------------------------------------------------------------
# 16 rows over fsdp 8, 32 completion columns: two decode phases (read bounds 16 and 32)
# the replicated decode layout (the rollout copy whole on every chip), whose bytes these tests
# derive by hand; the tensor layout's (1/8 of the weights a chip) are tests/test_decode_weights.py's
# and tests/test_aot_bound.py's
SAMPLE = [
    *SMALL, "--completion_len", "32", "--target", "v5e-8", "--part", "sample",
    "--config.rollout.decode_weights=replicated",
]  # fmt: skip
# the step bound's lengths, made exact: every prompt at the 16-column cap (median 120 clipped to
# [20, 16]), every completion 24 tokens (sigma 0, none capped)
FIXED_LENGTHS = ["--completion_median=24", "--completion_sigma=0", "--capped_share=0"]


@pytest.fixture(scope="module")
def sampler_small(tmp_path_factory):
  """The tiny sampler on v5e-8 decoding its 16 rows 8 at a time (2 sub-batches) and all at once."""
  out = {}
  for dbs in (8, 16):
    path = tmp_path_factory.mktemp("aot") / f"dbs{dbs}.json"
    proc, report = aot(*SAMPLE, *FIXED_LENGTHS, f"--config.rollout.decode_batch_size={dbs}", json_path=path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[dbs] = (proc, report)
  return out


def _kv_bytes_per_chip(rows_per_chip: int, cache_len: int) -> int:
  from ict_jax.models.config import Qwen2Config

  c = Qwen2Config.preset("tiny")
  return 2 * c.num_hidden_layers * rows_per_chip * c.num_key_value_heads * cache_len * c.head_dim * 2  # bf16


def test_sampler_report_and_decode_step_minimum(sampler_small):
  from ict_jax.models.config import Qwen2Config

  proc, r = sampler_small[16]
  s = r["sampler"]
  assert r["part"] == "sample" and r["fits"] is True and "model_flops_per_step" not in r  # no train step
  for key in ("fits", "peak_bytes_per_device", "decode_step_bytes", "decode_step_min_bytes", "decode_bytes_ratio"):
    assert key in s, key
  assert s["decode_batch_size"] == 16 and s["shapes"]["sub_batches"] == 1 and s["shapes"]["rows_per_device"] == 2
  assert s["decode_bytes_options"] == {"xla_msa_enable": False}  # TPU bytes counted without VMEM staging
  # each of the 2 prompts prefilled once, its keys/values read by its 8 rows
  assert s["prefill_rows"] == 2 and s["shapes"]["samples_per_prompt"] == 8
  c = Qwen2Config.preset("tiny")
  assert s["prefill_flops"] == 2 * 16 * c.flops_per_token(16, training=False)
  # 32 completion columns are two decode phases: steps 1..31 read 2 x 16 prompt slots and 16 rows x
  # 16 completion slots (steps 1..16) or x 32 (17..31), of which 2 x 16 + 16 x (i - 1) are written
  assert s["shapes"]["decode_phases"] == [16, 32]
  assert s["kv_read_over_filled"] == pytest.approx((31 * 32 + 16 * (16 * 16 + 15 * 32)) / (31 * 32 + 16 * 465))
  # the minimum a step reads: the bf16 rollout copy, whole on every chip (tensor 1; fsdp holds no
  # weight when decoding), this chip's 2 rows of the 32 completion slots and the 2 prompts' 16
  # slots (2 prompts do not split over 8 chips: each chip holds both)
  weights = c.num_params() * 2
  assert s["decode_step_min_bytes"] == weights + _kv_bytes_per_chip(2, 32) + _kv_bytes_per_chip(2, 16)
  assert s["shapes"]["prompt_kv_cache_bytes"] == _kv_bytes_per_chip(2, 16)
  assert s["decode_bytes_ratio"] >= 1.0  # nothing reads less than every weight and the cache once
  assert s["decode_bytes_ratio"] == pytest.approx(s["decode_step_bytes"] / s["decode_step_min_bytes"])
  # the train state stays on the chips while sampling: float32 params + two Adam moments over 8
  assert s["resident_bytes"] >= 12 * Qwen2Config.preset("tiny").num_params() // 8
  assert s["margin_bytes"] == s["hbm_bytes_per_device"] - s["peak_bytes_per_device"] - s["resident_bytes"]
  assert "one decode step reads/writes" in proc.stdout and "decode batch 16" in proc.stdout


def test_an_untied_input_embedding_is_not_in_the_decode_minimum(tmp_path):
  """A prefill or decode step gathers one row of an untied input embedding (7B's) a token and never
  reads the table: the minimum is the other weights + the KV cache, and the step reads at least it."""
  import dataclasses

  from ict_jax.models.config import Qwen2Config

  c = dataclasses.replace(Qwen2Config.preset("tiny"), tie_word_embeddings=False)
  model = tmp_path / "untied"
  model.mkdir()
  (model / "config.json").write_text(json.dumps(c.to_hf_dict()))
  flags = [*SAMPLE, *FIXED_LENGTHS, "--config.rollout.decode_batch_size=16", f"--config.model.path={model}"]
  proc, r = aot(*flags, json_path=tmp_path / "r.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  s = r["sampler"]
  assert s["shapes"]["rollout_policy_bytes"] == c.num_params() * 2  # the bf16 copy, whole on every chip
  weights = (c.num_params() - c.vocab_size * c.hidden_size) * 2
  assert s["shapes"]["rollout_weights_read_bytes"] == weights
  assert s["decode_step_min_bytes"] == weights + _kv_bytes_per_chip(2, 32) + _kv_bytes_per_chip(2, 16)
  assert s["decode_bytes_ratio"] >= 1.0


def test_bigger_decode_batch_needs_more_sampler_memory(sampler_small):
  small, big = sampler_small[8][1]["sampler"], sampler_small[16][1]["sampler"]
  assert small["decode_batch_size"] == 8 and small["shapes"]["sub_batches"] == 2
  assert small["prefill_rows"] == big["prefill_rows"] == 2  # a sub-batch of 8 is one whole group
  # the decode batch's KV cache: twice the rows, twice the bytes. (The whole program's temporaries
  # no longer order so on this tiny model: since the per-row draw keys (issue 41) the 2 x 8-row
  # program holds 5.5 MB of temporaries against the 16-row one's 2.7 MB, the [rows, 151,936]
  # vocabulary draws dominating a model this small; noted in RESULTS, not yet explained.)
  assert big["shapes"]["kv_cache_bytes"] == 2 * small["shapes"]["kv_cache_bytes"]
  assert big["argument_bytes"] == small["argument_bytes"]  # same weights, same prompts
  # one more row a chip (its 32 completion slots) and one more prompt (16 slots) to read each step
  assert big["decode_step_min_bytes"] - small["decode_step_min_bytes"] == _kv_bytes_per_chip(1, 48)
  # a step of the bigger batch reads the weights for twice the rows: fewer bytes a row (not more
  # bytes in all: compiled for 1 row a chip, XLA fuses the head differently, 42.3 against 40.2 MB)
  assert big["decode_step_bytes"] / 16 < small["decode_step_bytes"] / 8


def test_every_decode_phase_has_its_bytes_against_weights_and_its_kv(sampler_small):
  """One compiled decode step a phase: the bytes it reads against the bf16 rollout copy + the
  prompt cache + the completion slots that phase reads (its bound); the last phase is the whole
  cache (decode_step_bytes)."""
  from ict_jax.models.config import Qwen2Config

  r = sampler_small[16][1]
  s = r["sampler"]
  weights = Qwen2Config.preset("tiny").num_params() * 2
  assert s["decode_phase_min_bytes"] == [
      weights + _kv_bytes_per_chip(2, 16) + _kv_bytes_per_chip(2, bound) for bound in (16, 32)
  ]
  ratios = s["decode_phase_bytes_over_weights_kv"]
  assert len(ratios) == 2 and all(x > 0 for x in ratios)
  assert ratios == pytest.approx([b / m for b, m in zip(s["decode_phase_bytes"], s["decode_phase_min_bytes"])])
  assert s["decode_phase_bytes"][-1] == s["decode_step_bytes"]
  assert r["decode_phase_bytes_over_weights_kv"] == ratios  # and at the top of the JSON
  assert "decode phases [16, 32]: step bytes / (weights + that phase's KV)" in sampler_small[16][0].stdout
  # on TPU the fused decode kernel (decode_attention auto -> pallas), 2 rows a chip: 2 layers x 2
  # row blocks (a row each: two blocks for a megacore's two cores) x (the prompt block + one cache block)
  assert s["shapes"]["decode_attention"] == "pallas"
  assert s["decode_phase_grid_steps"] == [8, 8]
  assert "decode phases' Pallas grid steps a step: 8, 8" in sampler_small[16][0].stdout


def test_step_time_lower_bound_is_the_hand_formula(sampler_small):
  """FIXED_LENGTHS: 2 prompts of 16 tokens, 16 completions of 24. The bound: the update's FLOPs
  (3 x forward: the decoder on 40 tokens a row, the head on its 24 completion tokens) at 8 x v5e's
  197 TFLOP/s; the prefill (2 prompts, the head on their last token) at max(FLOPs at the peak, the
  rollout weights + prompt cache at 819 GB/s); decode steps 1..23 (16 in the phase of bound 16, 7
  in the phase of 32) at max(bytes / 819 GB/s, FLOPs / 197 TFLOP/s) of that phase's compiled step."""
  import importlib.util

  from ict_jax.models.config import Qwen2Config

  peak, bw = 197e12, 819e9  # a v5e chip: Cloud TPU docs
  r = sampler_small[16][1]
  s = r["sampler"]
  b = s["step_bound"]
  c = Qwen2Config.preset("tiny")
  head = 2 * c.hidden_size * c.vocab_size
  fwd = lambda n: c.flops_per_token(n, training=False) - head  # the decoder, a token
  update = 16 * 3 * (40 * fwd(40) + 24 * head)
  assert b["update_flops"] == pytest.approx(update, rel=1e-9) and b["update_s"] == pytest.approx(update / (8 * peak))
  prefill = 2 * (16 * fwd(16) + head)
  assert b["prefill_flops"] == pytest.approx(prefill, rel=1e-9)
  prefill_bytes = s["shapes"]["rollout_policy_bytes"] + s["shapes"]["prompt_kv_cache_bytes"]
  assert b["prefill_s"] == pytest.approx(max(prefill / (8 * peak), prefill_bytes / bw))
  assert b["decode_steps_per_phase"] == [16, 7] and b["decode_phases"] == [16, 32]
  assert b["decode_phase_bytes"] == s["decode_phase_bytes"] and b["decode_phase_flops"] == s["decode_phase_flops"]
  decode = sum(n * max(x / bw, f / peak) for n, x, f in zip((16, 7), s["decode_phase_bytes"], s["decode_phase_flops"]))
  assert b["decode_s"] == pytest.approx(decode)
  bound = update / (8 * peak) + max(prefill / (8 * peak), prefill_bytes / bw) + decode
  assert r["step_time_lower_bound_s"] == pytest.approx(bound) == s["step_time_lower_bound_s"]
  assert b["real_tokens"] == 16 * 40 and b["capped_fraction"] == 0
  spec = importlib.util.spec_from_file_location("tiny_arith", os.path.join(ROOT, "configs", "tiny_arith.py"))
  cfg = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg)
  steps = cfg.get_config().train.steps
  assert b["train_steps"] == steps and r["hours_lower_bound"] == pytest.approx(bound * steps / 3600)
  assert "step time LOWER BOUND on v5e-8 (not a measurement" in sampler_small[16][0].stdout


def test_length_distribution_matches_its_parameters():
  """The default distribution (issue 25's): log-normal medians, clipping, the capped share."""
  import numpy as np

  from ict_jax.length_model import LengthDistribution

  d = LengthDistribution()
  prompts, completions = d.sample(np.random.default_rng(0), 20000, 8, 512, 2048)
  assert prompts.shape == (20000,) and completions.shape == (160000,)
  assert prompts.min() >= 20 and prompts.max() <= 512 and completions.min() >= 16 and completions.max() == 2048
  assert np.median(prompts) == pytest.approx(120, rel=0.02)
  capped = completions == 2048
  # 15% set to the cap, plus the log-normal's own tail above it: P(z > ln(2048 / 450) / 0.7)
  tail = 0.5 * math.erfc(math.log(2048 / 450) / 0.7 / math.sqrt(2))
  assert capped.mean() == pytest.approx(0.15 + 0.85 * tail, abs=0.005)
  assert np.median(completions[~capped]) == pytest.approx(450, rel=0.02)
  with pytest.raises(ValueError, match="capped_share"):
    LengthDistribution(capped_share=1.5)


def test_decode_batch_auto_is_sized_from_the_targets_hbm(sampler_small, tmp_path):
  """auto: the most rows whose KV cache and logits fit 0.8 of what the HBM leaves free next to the
  train state and the rollout copy (`sampling.auto_decode_batch_size`). At the v5e chip's 15.75
  GiB that is all 16 rows; with --hbm_gib leaving room for 1.5 rows a chip, 8 (1 a chip)."""
  from ict_jax.models.config import Qwen2Config

  s = sampler_small[16][1]["sampler"]
  proc, r = aot(*SAMPLE, "--config.rollout.decode_batch_size=auto", json_path=tmp_path / "auto.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert r["sampler"]["decode_batch_size"] == 16
  # a row's 32 completion slots + 8 f32 [V], plus its prompt's 16 slots (16 rows: 2 prompts on
  # every chip, one a row; 8 rows: 1 prompt)
  row = _kv_bytes_per_chip(1, 48) + 8 * Qwen2Config.preset("tiny").vocab_size * 4
  hbm = s["resident_bytes"] + s["shapes"]["rollout_policy_bytes"] + 1.5 * row / 0.8
  proc, r = aot(
      *SAMPLE, "--config.rollout.decode_batch_size=auto", f"--hbm_gib={hbm / 2**30}", json_path=tmp_path / "a2.json"
  )
  assert r["sampler"]["decode_batch_size"] == 8, proc.stdout + proc.stderr[-2000:]
  # less than the train state + the rollout copy: not one row a chip fits; one a chip is compiled
  # and reported as not fitting (exit 1), not refused as bad input
  hbm = 0.9 * (s["resident_bytes"] + s["shapes"]["rollout_policy_bytes"])
  proc, r = aot(
      *SAMPLE, "--config.rollout.decode_batch_size=auto", f"--hbm_gib={hbm / 2**30}", json_path=tmp_path / "a3.json"
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert r["sampler"]["decode_batch_size"] == 8 and r["sampler"]["fits"] is False
  assert "not one row a chip fits" in r["sampler"]["shapes"]["note"]


def test_sampler_that_does_not_fit_exits_1_and_names_the_setting(sampler_small, tmp_path):
  """A usable HBM (--hbm_gib) below the 16-row sampler's peak + the train state: fits false, exit 1."""
  s = sampler_small[16][1]["sampler"]
  hbm = 0.9 * (s["peak_bytes_per_device"] + s["resident_bytes"])
  proc, r = aot(
      *SAMPLE, "--config.rollout.decode_batch_size=16", f"--hbm_gib={hbm / 2**30}", json_path=tmp_path / "o.json"
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert r["fits"] is False and r["sampler"]["fits"] is False and r["sampler"]["margin_bytes"] < 0
  assert "DOES NOT FIT" in proc.stdout and "--config.rollout.decode_batch_size" in proc.stdout


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
        (["--target", "v5e-8", "--config.rollout.decode_batch_size=5"], ["decode_batch_size: 5 does not divide"]),
        (["--target", "v5e-8", "--hbm_gib=-1"], ["--hbm_gib must be >= 0"]),
        (["--target", "v5e-8", "--capped_share=1.5"], ["--capped_share must be in [0, 1], got 1.5"]),
        (
            ["--target", "v5e-8", "--config.rollout.max_new_tokenz=8"],
            ["unknown config key 'max_new_tokenz' in --config.rollout.max_new_tokenz=8: did you mean"],
        ),
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
