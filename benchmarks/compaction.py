"""Finished rows stop costing, on this CPU: the rollout's sampling with and without compaction.

A heavy-tailed length distribution, scripted: each row r gets a target length L_r drawn from a
log-normal (median --median tokens, sigma --sigma) with --capped of the rows at the --new cap, like
`ict_jax.aot`'s distribution; the rows are sampled once at temperature 1 with no stop token (the
EOS-free stream), and the stop tokens are the tokens at the rows' target positions (a row stops at
its first stop token, so a few rows end earlier than their target: the lengths reported are the
ones the rollout generates). Then `sampling.generate` as the `Collector` calls it (G samples a
prompt, no log-probs) with `compact_rows` False (every row decoded until the longest ends: one
program) and True (the finished rows dropped between stretches of the phases,
`sampling/compact.py`), interleaved --repeats times, best of each; the tokens and masks of both
must be equal.

Row-steps: the decode steps' rows summed over the rollout (each step after token 0 computes one
row per row of its batch): without compaction every row to the longest row's end, with it the rows
each phase kept, recorded from the phase programs' batch shapes in a separate (untimed) run.
`row_steps_over_tokens` is row-steps / the tokens generated (`ict_jax.aot`'s
live_row_steps_over_real for this rollout; 1.0 is the floor).

    python benchmarks/compaction.py [--prompts 8] [--group 4] [--new 256] [--threads 2] [--repeats 3]

Model: the "bench" preset (vocab 151936, hidden 256, 4 layers), float32, random weights, one CPU
device. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere


def _targets(rng, rows: int, new: int, median: float, sigma: float, capped: float):
  """Target lengths [rows] in [1, new]: log-normal, `capped` of them at the cap."""
  import numpy as np

  n = np.clip(np.round(median * np.exp(sigma * rng.randn(rows))), 1, new).astype(int)
  n[rng.permutation(rows)[: int(round(capped * rows))]] = new
  return n


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--group", type=int, default=4, help="samples a prompt (G)")
  ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
  ap.add_argument("--new", type=int, default=256, help="max_new_tokens")
  ap.add_argument("--median", type=float, default=56.0, help="median target length")
  ap.add_argument("--sigma", type=float, default=0.7)
  ap.add_argument("--capped", type=float, default=0.15, help="share of the rows at the cap")
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--preset", default="bench", help="Qwen2Config preset (tiny for a smoke run)")
  ap.add_argument("--vocab", type=int, default=0, help="override the preset's vocabulary (0: keep)")
  args = ap.parse_args()
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) > args.threads:
    os.sched_setaffinity(0, cpus[: args.threads])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import numpy as np
  from flax import nnx

  from ict_jax import sampling
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import Qwen2
  from ict_jax.sampling import compact

  cfg = Qwen2Config.preset(args.preset)
  if args.vocab:
    cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
  model = Qwen2(cfg, rngs=nnx.Rngs(jax.random.key(0)))
  rng = np.random.RandomState(0)
  ids = rng.randint(1, cfg.vocab_size, (args.prompts, args.prompt)).astype(np.int32)
  mask = np.ones_like(ids)
  rows = args.prompts * args.group
  kw = dict(max_new_tokens=args.new, temperature=1.0, rng=jax.random.key(1), pad_id=0, num_samples=args.group)
  kw.update(return_logprobs=False)

  def run(eos, compact_rows):
    out = sampling.generate(model, ids, mask, eos_token_ids=eos, compact_rows=compact_rows, **kw)
    return [np.asarray(x) for x in jax.block_until_ready(out)]

  stream = run((), False)[0]  # [rows, new]: the EOS-free stream
  targets = _targets(rng, rows, args.new, args.median, args.sigma, args.capped)
  eos = tuple(sorted({int(stream[r, t - 1]) for r, t in enumerate(targets) if t < args.new}))

  recorded = []  # (rows computed, steps) of each stretch (a program call) of the counting run
  open_, phase = compact._open, compact._phase

  def counting_open(*a, **k):
    c, live = open_(*a, **k)
    recorded.append((c.tok.shape[0], int(np.asarray(live)[0]) - 1))  # token 0 from the prefill
    return c, live

  def counting_phase(state, c, *a, **k):
    before, b = int(np.asarray(c.i)), c.tok.shape[0]
    c, live = phase(state, c, *a, **k)
    recorded.append((b, int(np.asarray(live)[0]) - before))
    return c, live

  compact._open, compact._phase = counting_open, counting_phase
  try:
    counted = run(eos, True)  # compiles every program the timed runs use
  finally:
    compact._open, compact._phase = open_, phase
  full = run(eos, False)
  for a, b in zip(full, counted):
    np.testing.assert_array_equal(a, b)
  lengths = full[1].sum(axis=1)
  tokens = int(lengths.sum())
  steps_full = int(min(lengths.max(), args.new)) - 1  # the loop ends with the longest row
  row_steps = {"full": rows * steps_full, "compacted": sum(b * s for b, s in recorded)}

  times = {"full": [], "compacted": []}
  for _ in range(args.repeats):
    for name, flag in (("full", False), ("compacted", True)):
      t0 = time.perf_counter()
      out = run(eos, flag)
      times[name].append(time.perf_counter() - t0)
      np.testing.assert_array_equal(out[0], full[0])
      np.testing.assert_array_equal(out[1], full[1])
  best = {k: min(v) for k, v in times.items()}
  phases = sampling.decode_phases(sampling.bucket_length(args.new))
  print(
      json.dumps(
          {
              "rows": rows,
              "max_new_tokens": args.new,
              "phases": list(phases),
              "lengths": {
                  "median": float(np.median(lengths)),
                  "mean": float(lengths.mean()),
                  "at_cap": float((lengths == args.new).mean()),
                  "max": int(lengths.max()),
              },
              "tokens_generated": tokens,
              "row_steps": row_steps,
              "row_steps_over_tokens": {k: v / tokens for k, v in row_steps.items()},
              "stretches": [list(x) for x in sampling.decode_stretches(phases)],
              "stretch_rows_compacted": [b for b, _ in recorded],
              "wall_s_best": best,
              "wall_s": times,
              "speedup": best["full"] / best["compacted"],
              "same_tokens": True,
              "stop_tokens": len(eos),
              "preset": args.preset,
              "cpus": cpus[: args.threads],
              "processor": platform.processor() or platform.machine(),
              "jax": jax.__version__,
          }
      )
  )


if __name__ == "__main__":
  main()
