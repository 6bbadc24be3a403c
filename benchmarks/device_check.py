"""The accelerator figures of a run, on the chip at hand: the train step's tokens/s and MFU on
real tokens, and decode MBU, each against the lower bound of `ict_jax.aot.plan` for that chip.

One process, one device, the config's model with random weights (its `model.path` if it holds a
`config.json`, else the Qwen2.5 preset in the file name; `benchmarks/step.py`'s `model_config`),
so it needs no checkpoint, no dataset and no tokenizer: the short script to run when an H200 is
lent (issue 25, item 7), and a CPU smoke run of the same code on tiny shapes.

- update: `--prompts` x G rows whose prompt / completion lengths are drawn from the plan's
  `LengthDistribution` (seed 0) within the config's `data.max_prompt_len` / `rollout.max_new_tokens`,
  trimmed (`TrainBatch.trim`) and, with `train.token_budget` > 0, packed
  (`packing.pack_batch`) as train.py does; the config's step (`StepConfig.from_config`, warm-up
  off, so ICT selects), compiled once, `--repeats` timed steps (median). `mfu`, `padded_fraction`
  and `model_tflops_per_chip` are `throughput.Throughput.step_metrics` on the rows' real tokens;
  `update_bound_s` = `plan.update_flops` of those rows at the chip's peak, `update_s_over_bound` =
  step_s / that (1 / the MFU of the plan's FLOP count).
- decode: `ict_jax.generate` of `--decode_rows` rows (prompts of `--decode_prompt` tokens, G
  samples each, EOS off so every row runs to the end, T = 1) with the rollout copy the trainer
  makes (`make_rollout_policy`: `rollout.dtype`, the `--decode_weights` layout, default the
  config's `rollout.decode_weights`, over the local chips: on one chip both layouts are the same
  program), once with `--new`
  new tokens and once with new / 2 + 1 (the same length bucket: one compiled program); the step's
  time = the difference / the steps between, so prefill and dispatch drop out. `decode_mbu` = the
  bytes those steps must read (the rollout weights, the prompts' keys/values once a prompt and the
  completion slots filled so far, as the plan's minimum counts them) / their time / the chip's HBM
  bandwidth; `decode_s_over_bound` = 1 / `decode_mbu`. `prefill_s` = the short call less its
  decode steps; `rollout_tokens_per_s` = the long call's tokens / its time (prefill included).
  `--decode_only` skips the update: the rollout alone.

Peaks: dense bf16 TFLOP/s from `throughput.chip_peak` (a CPU's is measured), HBM TB/s from the
`ict_jax.aot` target of the same chip (`--hbm_tb_s` for another; none on a CPU: MBU is null).

    python benchmarks/device_check.py --config configs/qwen2_5_1_5b_math.py [--prompts 16]
        [--decode_rows 256] [--new 2048] [--repeats 3] [--json OUT]
    python benchmarks/device_check.py --config configs/qwen2_5_1_5b_math.py --decode_only  # a 1.5B bf16 rollout
    python benchmarks/device_check.py --config configs/qwen2_5_0_5b_math.py --smoke   # CPU

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

# device_kind substring (lower case) -> the `ict_jax.aot` target whose chip it is; the first match
# wins, so the longer names come first ("tpu v5 lite" is a v5e, "tpu v5" alone a v5p)
HBM_TARGET = (
    ("h200", "h200-8"),
    ("h100", "h100-8"),
    ("tpu v6", "v6e-8"),
    ("tpu v5 lite", "v5e-8"),
    ("tpu v5e", "v5e-8"),
    ("tpu v5", "v5p-32"),
    ("tpu v4", "v4-8"),
)
SMOKE = dict(
    layers=1,
    vocab=512,
    prompts=2,
    max_prompt=32,
    decode_rows=16,
    decode_prompt=16,
    new=32,
    repeats=2,
    micro_batch=0,
    dtype="float32",
    rollout_dtype="float32",
    max_new=64,
    length_scale=32.0,
)


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="a configs/*.py file")
  ap.add_argument("--prompts", type=int, default=16, help="prompts of the timed update (x G rows)")
  ap.add_argument("--max_prompt", type=int, default=0, help="0: the config's data.max_prompt_len")
  ap.add_argument("--max_new", type=int, default=0, help="0: the config's rollout.max_new_tokens")
  ap.add_argument("--decode_rows", type=int, default=256, help="rows decoded at once (prompts x G)")
  ap.add_argument("--decode_prompt", type=int, default=256, help="prompt tokens of each decoded row")
  ap.add_argument("--new", type=int, default=0, help="new tokens of the long decode (0: max_new)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--micro_batch", type=int, default=-1, help="update rows a micro-batch (-1: the config's)")
  ap.add_argument("--token_budget", type=int, default=-1, help="packed row tokens (-1: the config's, 0: padded)")
  ap.add_argument("--micro_batch_tokens", type=int, default=-1, help="-1: the config's train.micro_batch_tokens")
  ap.add_argument("--length_scale", type=float, default=1.0, help="divide the distribution's lengths by this")
  ap.add_argument("--hbm_tb_s", type=float, default=0.0, help="HBM TB/s a chip (0: by the device kind)")
  ap.add_argument("--dtype", default="", help="compute dtype of the update (default: the config's)")
  ap.add_argument("--rollout_dtype", default="", help="decode dtype (default: the config's rollout.dtype)")
  ap.add_argument("--attention", default="", help="model.attention (default: the config's)")
  ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
  ap.add_argument("--vocab", type=int, default=0, help="override vocab_size")
  ap.add_argument("--decode_weights", default="", help="the rollout copy's layout (default: rollout.decode_weights)")
  ap.add_argument("--decode_only", action="store_true", help="time the rollout only (prefill + decode)")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes: " + json.dumps(SMOKE))
  ap.add_argument("--json", default="", help="also write the JSON here")
  args = ap.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      setattr(args, k, v)
  args.method, args.chunk = "", 0  # benchmarks/step.py's
  return args


def hbm_tb_s(device_kind: str) -> float | None:
  from ict_jax.aot.targets import TARGETS

  kind = device_kind.lower()
  return next((TARGETS[t].hbm_tb_s for key, t in HBM_TARGET if key in kind), None)


def update(args, cfg, mcfg, model, peak_tflops: float) -> dict:
  import jax
  import numpy as np
  from flax import nnx

  from benchmarks.length import length_batch
  from benchmarks.step import median_time as timed
  from benchmarks.step import step_config
  from ict_jax import packing, throughput
  from ict_jax import train_step as ts
  from ict_jax.aot import plan
  from ict_jax.length_model import LengthDistribution

  g, k = cfg.rollout.group_size, args.length_scale
  d = LengthDistribution()
  dist = dataclasses.replace(
      d,
      prompt_median=d.prompt_median / k,
      prompt_min=max(1, round(d.prompt_min / k)),
      completion_median=d.completion_median / k,
      completion_min=max(1, round(d.completion_min / k)),
  )
  p, c = dist.sample(np.random.default_rng(0), args.prompts, g, args.max_prompt, args.max_new)
  rows_p = np.repeat(p, g)
  batch = length_batch(np.random.default_rng(1), rows_p, c, args.max_prompt, args.max_new, mcfg.vocab_size)
  batch = batch.trim(completion_len=int(c.max()))
  pick = lambda arg, default: default if arg < 0 else arg  # the flag, else the config's
  budget, micro = pick(args.token_budget, cfg.train.token_budget), pick(args.micro_batch, cfg.train.micro_batch_size)
  if budget:  # as train.py packs (one device: rows a multiple of 1)
    from ict_jax.config import ConfigError, check_packing_attention

    try:
      check_packing_attention(mcfg.attention, jax.devices())  # cudnn: cuDNN's sequence packing, Hopper+
    except ConfigError as e:
      raise SystemExit(f"--token_budget {budget}: {e} (here: --token_budget 0, or --attention dot_product)") from None
    mb_tokens = pick(args.micro_batch_tokens, cfg.train.micro_batch_tokens)
    batch = packing.pack_batch(
        batch, token_budget=budget, group_size=g, micro_batch_size=micro, balance=True, micro_batch_tokens=mb_tokens
    )
  scfg = dataclasses.replace(step_config(args, cfg), micro_batch_size=micro)
  graphdef, state = nnx.split(model)
  optimizer = ts.make_optimizer(cfg.optim, total_steps=100)
  train_state = ts.init_train_state(state.to_pure_dict(), optimizer)
  dev_batch = batch.map_rows(jax.numpy.asarray)
  t = time.perf_counter()
  step = ts.make_train_step(graphdef, scfg, optimizer).lower(train_state, dev_batch, None).compile()
  compile_s = time.perf_counter() - t
  box = {"state": train_state}

  def run():
    box["state"], metrics, logp = step(box["state"], dev_batch, None)
    jax.block_until_ready((box["state"], metrics, logp))
    box["metrics"] = metrics

  run()  # warm-up
  step_s, all_s = timed(run, args.repeats)
  lengths = rows_p + c
  tp = throughput.Throughput(mcfg, num_chips=1, peak=("", peak_tflops, ""))
  executed = batch.executed_positions()
  m = tp.step_metrics(lengths=lengths, executed=executed, passes=1, step_s=step_s, tokens=0, iteration_s=step_s)
  bound_s = plan.update_flops(mcfg, rows_p, c, passes=1, with_ref=cfg.loss.beta > 0) / (peak_tflops * 1e12)
  return {
      "rows": int(len(c)),
      "token_budget": budget,
      "real_tokens": int(lengths.sum()),
      "executed_positions": executed,
      "capped_fraction": float(np.mean(c == args.max_new)),
      "prompt_lens": rows_p.tolist(),  # a row's
      "completion_lens": c.tolist(),
      "compile_s": round(compile_s, 2),
      "step_s": step_s,
      "all_step_s": [round(x, 4) for x in all_s],
      "real_tokens_per_s": float(lengths.sum()) / step_s,
      **{k: v for k, v in m.items() if k != "tokens_per_s_per_chip"},  # that one counts a whole iteration
      "update_bound_s": bound_s,
      "update_s_over_bound": step_s / bound_s,
      "selected_frac": float(box["metrics"]["selected_frac"]),
  }


def decode(args, cfg, mcfg, model, bw_tb_s: float | None) -> dict:
  import jax
  import numpy as np

  from jax.sharding import Mesh

  from flax import nnx

  import ict_jax
  from benchmarks.step import median_time as timed
  from ict_jax import setup as setup_lib
  from ict_jax import sharding
  from ict_jax.sampling import bucket_length, kv_bytes, make_rollout_policy

  g, n = cfg.rollout.group_size, args.new or args.max_new
  dtype = args.rollout_dtype or setup_lib.rollout_dtype(cfg, Mesh(np.array(jax.devices()[:1]), ("data",)))
  half = n // 2 + 1
  if bucket_length(half) != bucket_length(n):
    raise SystemExit(f"--new {n}: {half} and {n} fall in different length buckets; use a power of two")
  prompts = args.decode_rows // g
  rng = np.random.default_rng(2)
  ids = rng.integers(1, mcfg.vocab_size, (prompts, args.decode_prompt)).astype(np.int32)
  mask = np.ones_like(ids)
  # the rollout copy as the trainer makes it: the rollout dtype, the layout over the local chips
  mesh = sharding.make_mesh((1, -1, 1), devices=jax.local_devices())
  weights_layout = args.decode_weights or cfg.rollout.decode_weights
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    policy = make_rollout_policy(
        graphdef, nnx.state(model, nnx.Param).to_pure_dict(), dtype=dtype, mesh=mesh, weights=weights_layout
    )
  chip_weights = max(sharding.bytes_per_device(policy.state).values())

  def run(new: int):
    out = ict_jax.generate(
        policy,
        ids,
        mask,
        max_new_tokens=new,
        rng=jax.random.key(0),
        eos_token_ids=(),
        num_samples=g,
        decode_batch_size=args.decode_rows,
        return_logprobs=False,
        mesh=mesh,
    )
    jax.block_until_ready(out)
    return out

  t = time.perf_counter()
  out = run(n)  # compile + warm-up
  first_s = time.perf_counter() - t
  if int(np.asarray(out[1]).sum()) != args.decode_rows * n:
    raise SystemExit("decode: some row stopped early although EOS is off")
  long_s, all_long = timed(lambda: run(n), args.repeats)
  short_s, all_short = timed(lambda: run(half), args.repeats)
  step_s = (long_s - short_s) / (n - half)
  prefill_s = short_s - (half - 1) * step_s  # a call: the prefill, then half - 1 decode steps
  # what steps half .. n - 1 must read a chip (the plan's minimum): its share of the rollout weights
  # (an untied input embedding is gathered, not read), each prompt's keys/values once, and the
  # completion slots filled before the step (the rows, and so the KV cache, split over the chips)
  embed = 0 if mcfg.tie_word_embeddings else mcfg.vocab_size * mcfg.hidden_size
  itemsize = np.dtype(dtype).itemsize
  weights = (mcfg.num_params() - embed) * itemsize * chip_weights / (mcfg.num_params() * itemsize)
  slot = kv_bytes(mcfg, 1, None, dtype)  # one slot's keys and values, all layers
  filled = float(np.mean(np.arange(half, n)))  # completion slots written before an average step
  step_bytes = weights + slot * (prompts * args.decode_prompt + args.decode_rows * filled) / mesh.size
  out = {
      "decode_weights": weights_layout,
      "chips": mesh.size,
      "chip_weight_bytes": chip_weights,
      "prefill_s": prefill_s,
      "rollout_tokens_per_s": args.decode_rows * n / long_s,  # prefill + decode, a whole call
      "rows": args.decode_rows,
      "prompt": args.decode_prompt,
      "new": n,
      "half": half,
      "dtype": dtype,
      "first_call_s": round(first_s, 2),
      "long_s": long_s,
      "short_s": short_s,
      "all_long_s": [round(x, 4) for x in all_long],
      "all_short_s": [round(x, 4) for x in all_short],
      "step_s": step_s,
      "tokens_per_s": args.decode_rows / step_s,
      "step_min_bytes": step_bytes,
      "hbm_tb_s": bw_tb_s,
  }
  if bw_tb_s:
    out["decode_bound_step_s"] = step_bytes / (bw_tb_s * 1e12)
    out["decode_mbu"] = step_bytes / step_s / (bw_tb_s * 1e12)
    out["decode_s_over_bound"] = 1 / out["decode_mbu"]
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax

  from benchmarks.step import load_config, model_config
  from ict_jax import throughput
  from ict_jax.models.qwen2 import init_model

  cfg = load_config(args.config)
  args.max_prompt = args.max_prompt or cfg.data.max_prompt_len
  args.max_new = args.max_new or cfg.rollout.max_new_tokens
  mcfg = model_config(args, cfg)
  if args.attention:
    from ict_jax.setup import resolve_attention

    mcfg = mcfg.replace(attention=resolve_attention(args.attention, dtype=mcfg.dtype))
  model = init_model(mcfg, seed=0)
  device = jax.devices()[0]
  chip, peak, source = throughput.chip_peak(device)
  bw = args.hbm_tb_s or hbm_tb_s(device.device_kind)
  result = {
      "config": args.config,
      "device": device.device_kind,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "chip": chip,
      "peak_tflops": peak,
      "peak_source": source,
      "model": dict(layers=mcfg.num_hidden_layers, hidden=mcfg.hidden_size, vocab=mcfg.vocab_size, dtype=mcfg.dtype),
      "update": None if args.decode_only else update(args, cfg, mcfg, model, peak),
      "decode": decode(args, cfg, mcfg, model, bw),
  }
  text = json.dumps(result, indent=1)
  print(text, flush=True)
  if args.json:
    with open(args.json, "w") as f:
      f.write(text)
  return result


if __name__ == "__main__":
  main()
