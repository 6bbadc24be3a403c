"""Step time and compiled temporaries follow the real completion length (`train_step.trim_batch`).

One batch of `--batch` rows (G = 8) whose completions are padded to `--max_new` columns, as the
sampler returns them, with the longest completion `L` real tokens; for each L the step runs on
the trimmed batch (width `bucket_length(L)`), and once on the untrimmed batch (width max_new,
what the step trained on before). For each width: the compiled step's per-device temporaries
(`jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes`) and the median wall time
of `--repeats` steps (compilation excluded). Model: a small Qwen2 (`--vocab`, `--hidden`,
`--layers`), float32, ICT past its warm-up, on one CPU device. Prints one JSON object.

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

from ict_jax import train_step as ts  # noqa: E402
from ict_jax.config import OptimConfig  # noqa: E402
from ict_jax.models.config import Qwen2Config  # noqa: E402
from ict_jax.models.qwen2 import init_model  # noqa: E402
from ict_jax.setup import resolve_kernels  # noqa: E402

G = 8


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
  return ap.parse_args(argv)


def make_batch(args, longest: int, seed: int = 0) -> dict:
  """Completions of longest // 2 .. longest real tokens, right-padded to max_new columns."""
  rng = np.random.default_rng(seed)
  n, p = args.batch, args.prompt
  lengths = rng.integers(max(1, longest // 2), longest + 1, n)
  lengths[0] = longest
  cmask = (np.arange(args.max_new)[None] < lengths[:, None]).astype(np.int32)
  prompt = np.repeat(rng.integers(1, args.vocab, (n // G, p)), G, 0).astype(np.int32)
  return dict(
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
      ts.StepConfig(group_size=G, method="ict", warmup_steps=0, max_completion_length=args.max_new),
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
        width=int(batch["completion_ids"].shape[1]),
        temp_bytes=int(mem.temp_size_in_bytes),
        step_s=round(statistics.median(times[1:]), 4),
    )

  runs = []
  for longest in (int(x) for x in args.lengths.split(",")):
    full = make_batch(args, longest)
    runs.append(dict(longest=longest, real_tokens=int(full["completion_mask"].sum()), **measure(ts.trim_batch(full))))
  untrimmed = dict(longest=runs[0]["longest"], **measure(make_batch(args, runs[0]["longest"])))
  out = dict(
      max_new_tokens=args.max_new,
      batch=args.batch,
      prompt=args.prompt,
      model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers),
      backend=jax.default_backend(),
      trimmed=runs,
      untrimmed=untrimmed,
      command="python benchmarks/length.py " + " ".join(sys.argv[1:] if argv is None else argv),
  )
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
