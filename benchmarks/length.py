"""Step time and compiled temporaries follow the real completion length (`TrainBatch.trim`).

One batch of `--batch` rows (G = 8) whose completions are padded to `--max_new` columns, as the
sampler returns them, with the longest completion `L` real tokens; for each L the step runs on
the trimmed batch (width `bucket_length(L)`), and once on the untrimmed batch (width max_new,
what the step trained on before). For each width: the compiled step's per-device temporaries
(`jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes`) and the median wall time
of `--repeats` steps (compilation excluded). Model: a small Qwen2 (`--vocab`, `--hidden`,
`--layers`), float32, ICT past its warm-up, on one CPU device.

Then, per length distribution (`distributions`: "capped15" and "uncapped", reasoning-like: prompts
log-normal, median 120, sigma 0.6, clipped to [20, 512], one a group of G = 8; completions
log-normal, median 450, sigma 0.7, clipped to [16, 2048], 15% / none of them set to the 2048
cap), today's padded step (`TrainBatch.trim`) against the packed one (`packing.pack_batch`, rows of
min(token budget, padded width) tokens):
  executed_over_real_flops  over `--flop_batches` batches of the paper's shapes (128 prompts x
      G 8, prompts <= 512, completions <= 2048, Qwen2.5-1.5B, micro-batch `--paper_micro_batch`,
      packed rows a multiple of `--paper_devices`, micro-batches token-balanced as train.py
      makes them, `packing.balance_groups`): the FLOPs of the shapes the step compiles
      (the decoder on [rows, width] at `flops_per_token(width)`, attention's causal term
      included; the LM head on the positions it reads: padded [rows, completion width], packed
      the groups' live 128-column blocks) over the real tokens' (the decoder on each sequence at
      its own length, the head on its completion tokens);
      `decoder_executed_over_real_flops` is the decoder's share of that count alone.
      "packed_tokens": micro-batches formed by tokens (`train.micro_batch_tokens` =
      `--paper_micro_tokens`, default 32 rows of 2560 tokens: 4 a device on 8), as many whole
      groups a micro-batch as fit (`packing.token_micro_batches`), instead of a fixed row count.
  cpu_step_s  the mean over `--dist_timed` batches of the median step time of the model above on
      `--dist_rows` rows of the same distribution with every length divided by `--dist_scale`
      ("packed_tokens": micro-batches of `--dist_micro_rows` packed rows).
Prints one JSON object.

    python benchmarks/length.py [--max_new 512] [--lengths 16,64,256,512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ict_jax import packing  # noqa: E402
from ict_jax import train_step as ts  # noqa: E402
from ict_jax.batch import TrainBatch  # noqa: E402
from ict_jax.config import IctConfig, OptimConfig  # noqa: E402
from ict_jax.models.config import PRESETS, Qwen2Config  # noqa: E402
from ict_jax.models.qwen2 import init_model  # noqa: E402
from ict_jax.setup import resolve_kernels  # noqa: E402

G = 8
DISTRIBUTIONS = {"capped15": 0.15, "uncapped": 0.0}  # name -> share of completions at the cap
PAPER = dict(prompts=128, max_prompt=512, max_new=2048)
BLOCK = packing.HEAD_BLOCK


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--max_new", type=int, default=512, help="completion columns as sampled")
  ap.add_argument("--lengths", default="16,64,256,512", help="longest real completion, each run")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--vocab", type=int, default=32768)
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--flop_batches", type=int, default=20, help="paper-shape batches counted a distribution")
  ap.add_argument("--paper_micro_batch", type=int, default=0, help="rows a micro-batch (0: all 1024)")
  ap.add_argument("--paper_devices", type=int, default=8, help="data x fsdp: packed rows a multiple of it")
  ap.add_argument(
      "--paper_micro_tokens",
      type=int,
      default=32 * 2560,
      help="tokens a micro-batch of `packed_tokens` (0: not counted)",
  )
  ap.add_argument("--dist_micro_rows", type=int, default=4, help="packed rows a timed token-budget micro-batch")
  ap.add_argument("--dist_rows", type=int, default=64, help="rows of a timed batch (a multiple of 8)")
  ap.add_argument("--dist_scale", type=int, default=16, help="timed lengths are the paper's / this")
  ap.add_argument("--dist_timed", type=int, default=2, help="timed batches a distribution")
  return ap.parse_args(argv)


def sample_lengths(rng, capped: float, prompts: int, scale: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """(prompt, completion) lengths [prompts * G] of one batch, every length divided by `scale`."""
  p = np.repeat(np.clip(np.round(rng.lognormal(np.log(120), 0.6, prompts)), 20, 512), G)
  c = np.clip(np.round(rng.lognormal(np.log(450), 0.7, prompts * G)), 16, 2048)
  c[rng.random(c.size) < capped] = 2048
  shrink = lambda x: np.maximum(np.round(x / scale), 1).astype(np.int64)
  return shrink(p), shrink(c)


def length_batch(rng, p_len, c_len, max_prompt: int, max_new: int, vocab: int) -> TrainBatch:
  """A sampled batch as the rollout returns it: prompts left-padded to max_prompt, completions
  right-padded to max_new, the G rows of a group sharing their prompt."""
  n = len(p_len)
  pmask = (np.arange(max_prompt)[None] >= max_prompt - p_len[:, None]).astype(np.int32)
  prompt = np.repeat(rng.integers(1, vocab, (n // G, max_prompt)), G, 0) * pmask
  cmask = (np.arange(max_new)[None] < c_len[:, None]).astype(np.int32)
  return TrainBatch(
      prompt_ids=prompt.astype(np.int32),
      prompt_mask=pmask,
      completion_ids=(rng.integers(1, vocab, cmask.shape) * cmask).astype(np.int32),
      completion_mask=cmask,
      advantages=rng.normal(size=n).astype(np.float32),
  )


def update_flops(cfg: Qwen2Config, batch: TrainBatch) -> tuple[float, float, float, float]:
  """(executed, real, executed decoder, real decoder) training FLOPs of one step on `batch`
  (trimmed; packed when it has a packed layout): `flops_per_token` split into the decoder
  (attention's causal term at the width it runs on) and the LM head (6 D V a position)."""
  head = 6.0 * cfg.hidden_size * cfg.vocab_size
  decoder = lambda width: cfg.flops_per_token(int(width)) - head
  n, c = batch.completion_mask.shape
  if batch.packed is not None:
    rows, width = batch.packed.ids.shape
    head_positions = batch.packed.head_ids.size
  else:
    rows, width = n, batch.prompt_mask.shape[1] + c
    head_positions = n * c
  executed_decoder = rows * width * decoder(width)
  c_len = batch.completion_mask.sum(1)
  lengths = batch.prompt_mask.sum(1) + c_len
  real_decoder = float(sum(int(s) * decoder(s) for s in lengths))
  return (
      executed_decoder + head_positions * head,
      real_decoder + float(c_len.sum()) * head,
      executed_decoder,
      real_decoder,
  )


def flop_ratios(args, capped: float, seed: int) -> dict:
  """executed / real update FLOPs of the padded and the packed step over `--flop_batches` batches
  of the paper's shapes (Qwen2.5-1.5B)."""
  cfg, rng = PRESETS["qwen2_5_1_5b"], np.random.default_rng(seed)
  budget = PAPER["max_prompt"] + PAPER["max_new"]
  packs = {  # variant -> pack_batch's micro-batching
      # as train.py packs: whole groups reordered into token-balanced micro-batches of a row count
      "packed": dict(micro_batch_size=args.paper_micro_batch, balance=True),
      # micro-batches formed by tokens (train.micro_batch_tokens)
      **({"packed_tokens": dict(micro_batch_tokens=args.paper_micro_tokens)} if args.paper_micro_tokens else {}),
  }
  sums = {k: np.zeros(4) for k in ("padded", *packs)}
  shapes = {k: set() for k in sums}
  for _ in range(args.flop_batches):
    p_len, c_len = sample_lengths(rng, capped, PAPER["prompts"])
    full = length_batch(rng, p_len, c_len, PAPER["max_prompt"], PAPER["max_new"], 2)
    padded = full.trim()
    sums["padded"] += update_flops(cfg, padded)
    shapes["padded"].add(padded.completion_ids.shape + padded.prompt_ids.shape)
    for name, kwargs in packs.items():
      packed = packing.pack_batch(
          padded, token_budget=budget, group_size=G, block=BLOCK, multiple=args.paper_devices, **kwargs
      )
      sums[name] += update_flops(cfg, packed)
      shapes[name].add(packed.packed.ids.shape + packed.packed.head_ids.shape + (packed.packed.micro_batch_rows,))
  return dict(
      executed_over_real_flops={k: round(v[0] / v[1], 3) for k, v in sums.items()},
      decoder_executed_over_real_flops={k: round(v[2] / v[3], 3) for k, v in sums.items()},
      compiled_shapes={k: len(v) for k, v in shapes.items()},
  )


def make_batch(args, longest: int, seed: int = 0) -> TrainBatch:
  """Completions of longest // 2 .. longest real tokens, right-padded to max_new columns."""
  rng = np.random.default_rng(seed)
  n, p = args.batch, args.prompt
  lengths = rng.integers(max(1, longest // 2), longest + 1, n)
  lengths[0] = longest
  cmask = (np.arange(args.max_new)[None] < lengths[:, None]).astype(np.int32)
  prompt = np.repeat(rng.integers(1, args.vocab, (n // G, p)), G, 0).astype(np.int32)
  return TrainBatch(
      prompt_ids=prompt,
      prompt_mask=np.ones((n, p), np.int32),
      completion_ids=(rng.integers(1, args.vocab, cmask.shape) * cmask).astype(np.int32),
      completion_mask=cmask,
      advantages=rng.normal(size=n).astype(np.float32),
  )


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = Qwen2Config(
      vocab_size=args.vocab,
      hidden_size=args.hidden,
      intermediate_size=4 * args.hidden,
      num_hidden_layers=args.layers,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=args.prompt + args.max_new,
      kernels=resolve_kernels("auto"),  # "cpu" on one CPU device, as a run resolves it
  )
  graphdef, params = nnx.split(init_model(cfg, seed=0))
  opt = ts.make_optimizer(OptimConfig(learning_rate=1e-6), 100)
  step = ts.make_train_step(
      graphdef,
      ts.StepConfig(IctConfig(method="ict", warmup_steps=0), group_size=G, max_completion_length=args.max_new),
      opt,
      donate=False,
  )
  state = ts.init_train_state(params.to_pure_dict(), opt)

  def measure(batch) -> dict:
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    times = []
    for _ in range(args.repeats + 1):  # the first call warms caches
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(state, batch))
      times.append(time.perf_counter() - t0)
    return dict(
        width=int(batch.completion_ids.shape[1]),
        temp_bytes=int(mem.temp_size_in_bytes),
        step_s=round(statistics.median(times[1:]), 4),
    )

  def step_s(batch) -> float:
    """The median wall time of `--repeats` steps, through jit's cache (a shape compiles once)."""
    jax.block_until_ready(step(state, batch))  # compiles, warms caches
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step(state, batch))
      times.append(time.perf_counter() - t0)
    return statistics.median(times)

  runs = []
  for longest in (int(x) for x in args.lengths.split(",")):
    full = make_batch(args, longest)
    runs.append(dict(longest=longest, real_tokens=int(full.completion_mask.sum()), **measure(full.trim())))
  untrimmed = dict(longest=runs[0]["longest"], **measure(make_batch(args, runs[0]["longest"])))

  distributions = {}
  max_prompt, max_new = PAPER["max_prompt"] // args.dist_scale, PAPER["max_new"] // args.dist_scale
  for seed, (name, capped) in enumerate(DISTRIBUTIONS.items()):
    rng = np.random.default_rng(100 + seed)
    times = {"padded": [], "packed": [], "packed_tokens": []}
    for _ in range(args.dist_timed):
      p_len, c_len = sample_lengths(rng, capped, args.dist_rows // G, args.dist_scale)
      padded = length_batch(rng, p_len, c_len, max_prompt, max_new, args.vocab).trim()
      times["padded"].append(step_s(padded))
      packed = packing.pack_batch(
          padded, token_budget=max_prompt + max_new, group_size=G, block=max(BLOCK // args.dist_scale, 8)
      )
      times["packed"].append(step_s(packed))
      by_tokens = packing.pack_batch(
          padded,
          token_budget=max_prompt + max_new,
          group_size=G,
          block=max(BLOCK // args.dist_scale, 8),
          micro_batch_tokens=args.dist_micro_rows * (max_prompt + max_new),
      )
      times["packed_tokens"].append(step_s(by_tokens))
    distributions[name] = dict(
        **flop_ratios(args, capped, seed),
        cpu_step_s={k: round(float(np.mean(v)), 4) for k, v in times.items()},
    )
  out = dict(
      max_new_tokens=args.max_new,
      batch=args.batch,
      prompt=args.prompt,
      model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers),
      backend=jax.default_backend(),
      trimmed=runs,
      untrimmed=untrimmed,
      distributions=distributions,
      flop_model="qwen2_5_1_5b",
      cpu_distribution=dict(rows=args.dist_rows, scale=args.dist_scale, timed_batches=args.dist_timed),
      command="python benchmarks/length.py " + " ".join(sys.argv[1:] if argv is None else argv),
  )
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
