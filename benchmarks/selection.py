"""ICT's overhead: the train step with method=ict vs method=grpo, same batch, same model.

Model "bench" (vocab 151936, hidden 256, 4 layers, 4/2 heads, MLP 704, tied), float32, random
weights; 8 sequences = 1 prompt x G=8, prompt 64 + completion 192, the whole batch in one
micro-batch, chunk 128 (`--chunk`). Both steps and the breakdown's functions are compiled first,
then timed interleaved (`--repeats` rounds, medians) so that all see the same background load. The goal is
ict_step_s / grpo_step_s <= 1.10.

Note: the grpo step also computes the JS score (for its `js_*` metrics). Since ICT trains only
its selected ~10% of the tokens, its LM-head backward runs on those rows alone (`lm_head.py`), so
the ict step is cheaper than the grpo step. The `breakdown` times the LM-head pass alone (hidden
states -> per-token log-probs): forward + backward of a plain chunked log-prob head without and
with per-chunk `jax.checkpoint` (no statistics; what a plain GRPO step needs), the fused head with
entropy, Renyi-2 and JS and a gradient on every row (`fused_dense`, what the grpo step runs) or on
ICT's selected rows only (`fused_sparse`, what the ict step runs), and the fused forward alone;
`forward_share_of_ict_step` is that forward / the ict step. `references` sets the ict step with
`ict.reference=active_mean` (the default) beside `sequence_mean` (each response's own mean
distribution, which needs a first pass over the response's chunks): median step time and the
compiled step's temporary bytes (`memory_analysis().temp_size_in_bytes`). Threads: the process is pinned to
the first `--threads` cores (`os.sched_setaffinity`, like `taskset`) before JAX starts. Prints
one JSON object.

    python benchmarks/selection.py [--threads 2] [--repeats 3] [--chunk 128]
        [--preset bench] [--vocab V] [--batch 8 --prompt 64 --completion 192]

`--preset` (any `Qwen2Config` preset, e.g. "tiny"), `--vocab` and the shape flags shrink the run; the CI smoke
test (tests/test_benchmarks_smoke.py) runs it that way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_bench  # noqa: E402  (benchmarks/step.py: batch, step wrapper, pinning)


class HeadPass(NamedTuple):
  """`_head_variants`' result: the head's inputs, ICT's rows and the variants to time."""

  h: Any  # [N, C, D] final hidden states at the completion positions
  w: Any  # the head weight as the step takes it ([V, D] when tied)
  n: int  # rows
  c: int  # completion columns
  ict_rows: Any  # [N, C] bool: ICT's selected tokens
  capacity: int  # the sparse backward's row capacity
  variants: dict  # name -> (h, w) -> loss, each timed forward + backward
  forward: Any  # (h, w) -> the fused forward alone


def _head_variants(mcfg, graphdef, params, batch: dict, chunk_size: int, base) -> HeadPass:
  """The fused LM-head pass alone, on the model's final hidden states of `batch`: its variants
  (log-probs only, with and without remat; the fused head with entropies and JS, its gradient on
  every row or on ICT's selected rows) as (h, w) -> loss functions, the forward alone, and the
  ICT rows and sparse-backward capacity they use."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from ict_jax import lm_head, selection
  from ict_jax import train_step as ts
  from ict_jax.batch import TrainBatch

  model = nnx.merge(graphdef, params)
  b = TrainBatch(**batch).map_rows(jnp.asarray)
  n, p = b.prompt_ids.shape
  c = b.completion_ids.shape[1]
  h = model.hidden_states(
      jnp.concatenate([b.prompt_ids, b.completion_ids], 1),
      jnp.concatenate([b.prompt_mask, b.completion_mask], 1),
  )
  h = jax.block_until_ready(h[:, p - 1 : p + c - 1])  # [N, C, D]
  w, vocab_major = model.head_weight()  # as the step takes it: [V, D] when tied
  w_letters = "VD" if vocab_major else "DV"

  def logp_only(h, w, remat=True):  # the same chunking as the step, no statistics
    n_chunks = -(-c // min(chunk_size, c))
    k = -(-c // n_chunks)
    pad = n_chunks * k - c
    hs = jnp.moveaxis(jnp.pad(h, [(0, 0), (0, pad), (0, 0)]).reshape(n, n_chunks, k, -1), 1, 0)
    ids = jnp.pad(b.completion_ids, [(0, 0), (0, pad)])
    ids = jnp.moveaxis(ids.reshape(n, n_chunks, k), 1, 0)

    def chunk(hc, ic):
      logits = jnp.einsum(f"BTD,{w_letters}->BTV", hc, w, preferred_element_type=jnp.float32)
      return jnp.take_along_axis(logits, ic[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)

    chunk = jax.checkpoint(chunk) if remat else chunk  # remat: logits recomputed in backward
    return jax.lax.map(lambda a: chunk(*a), (hs, ids)).sum()

  class Head:  # duck-types what completion_logp_and_stats uses of the model: two methods and cfg

    def __init__(self, h, w):
      self.h, self.w = h, w
      self.cfg = mcfg  # cfg.kernels picks the head's formulation, as the step's model does

    def hidden_states(self, ids, mask):
      return jnp.pad(self.h, [(0, 0), (p - 1, 1), (0, 0)])  # positions p-1 .. p+c-2 are h

    def head_weight(self):
      return self.w, vocab_major

  _, stats0 = ts.completion_logp_and_stats(
      Head(h, w), b, temperature=1.0, group_size=base.group_size, chunk_size=chunk_size
  )
  # ICT's gradient pattern: the top 10% of each response's tokens by JS carry the gradient
  ict_rows = selection.ict_mask(stats0["js"], b.completion_mask.astype(bool), base.ict.top_fraction)
  g_ict = ict_rows.astype(jnp.float32)
  capacity = lm_head.sparse_grad_rows("ict", base.ict.top_fraction, base.ict.entropy_top_fraction, n, c)

  def fused(h, w, weights, grad_rows=0):
    logp, stats = ts.completion_logp_and_stats(
        Head(h, w), b, temperature=1.0, group_size=base.group_size, chunk_size=chunk_size, grad_rows=grad_rows
    )
    return jnp.sum(weights * logp) + 0.0 * sum(jnp.sum(v) for v in stats.values())

  ones = jnp.ones_like(g_ict)
  variants = {
      "logp_only_no_remat": lambda h, w: logp_only(h, w, remat=False),
      "logp_only": logp_only,
      "fused_dense": lambda h, w: fused(h, w, ones),  # what the grpo step's head pass runs
      "fused_sparse": lambda h, w: fused(h, w, g_ict, capacity),  # ... the ict step's
  }
  forward = lambda h, w: fused(h, w, ones)  # log-probs + statistics, no backward
  return HeadPass(h, w, n, c, ict_rows, capacity, variants, forward)


def _time_interleaved(runs: dict, repeats: int) -> dict[str, list[float]]:
  """Every run (all compiled) timed in interleaved rounds, so all see the same background load."""
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      t = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t)
  return times


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--completion", type=int, default=192)
  ap.add_argument("--chunk", type=int, default=128)
  ap.add_argument("--preset", default="bench", help="the model: a Qwen2Config preset")
  ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the preset's)")
  args = ap.parse_args(argv)
  cpus = step_bench._pin(args.threads)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from ict_jax import train_step as ts
  from ict_jax.config import IctConfig, OptimConfig
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import init_model

  from ict_jax.setup import resolve_kernels

  mcfg = Qwen2Config.preset(args.preset, kernels=resolve_kernels("auto"))  # "cpu" on one CPU device
  if args.vocab:
    mcfg = mcfg.replace(vocab_size=args.vocab)
  graphdef, state = nnx.split(init_model(mcfg, seed=0))
  params = state.to_pure_dict()
  base = ts.StepConfig(IctConfig(warmup_steps=0, chunk_size=args.chunk), group_size=8, temperature=1.0)
  batch = step_bench.make_batch(
      argparse.Namespace(batch=args.batch, prompt=args.prompt, completion=args.completion),
      mcfg.vocab_size,
      base.group_size,
  )
  optimizer = ts.make_optimizer(OptimConfig(learning_rate=1e-6, max_grad_norm=1.0), total_steps=100)

  steps = {}
  # "ict" is the default reference (active_mean); "ict_sequence_mean" the same step with ICT's
  # other reading of the reference (a response's own mean distribution: one more LM-head pass)
  variants_of_step = {"grpo": dict(method="grpo"), "ict": dict(method="ict")}
  variants_of_step["ict_sequence_mean"] = dict(method="ict", reference="sequence_mean")
  for name, kw in variants_of_step.items():
    scfg = dataclasses.replace(base, ict=dataclasses.replace(base.ict, **kw))
    s = step_bench.JaxStep(graphdef, jax.tree.map(jnp.copy, params), scfg, optimizer, batch)
    steps[name] = s.run()  # warm-up

  # ---- the fused LM-head pass alone: log-probs only / + entropies / + JS (as in the step)
  head = _head_variants(mcfg, graphdef, params, batch, args.chunk, base)
  h, w, variants, n, c, ict_rows, capacity = head.h, head.w, head.variants, head.n, head.c, head.ict_rows, head.capacity
  runs = {m: s.run for m, s in steps.items()}
  for name, fn in variants.items():
    g = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    jax.block_until_ready(g(h, w))  # compile + warm-up
    runs[name] = lambda g=g: jax.block_until_ready(g(h, w))
  forward = jax.jit(head.forward)  # log-probs + statistics, no backward
  jax.block_until_ready(forward(h, w))
  runs["fused_forward"] = lambda: jax.block_until_ready(forward(h, w))

  times = _time_interleaved(runs, args.repeats)
  med = {name: statistics.median(v) for name, v in times.items()}
  breakdown = {name + "_fwd_bwd_s": round(med[name], 4) for name in variants}
  breakdown["fused_forward_only_s"] = round(med["fused_forward"], 4)
  print(
      json.dumps(
          {
              "benchmark": "selection_overhead",
              "model": args.preset,
              "vocab": mcfg.vocab_size,
              "dtype": "float32",
              "batch": args.batch,
              "prompt_len": args.prompt,
              "completion_len": args.completion,
              "group_size": base.group_size,
              "chunk_size": args.chunk,
              "threads": args.threads,
              "cpus": cpus,
              "repeats": args.repeats,
              "grpo_step_s": round(med["grpo"], 4),
              "ict_step_s": round(med["ict"], 4),
              "overhead_ratio": round(med["ict"] / med["grpo"], 4),
              "goal_ratio": 1.10,
              "all_s": {m: [round(x, 4) for x in v] for m, v in times.items()},
              "compile_s": {m: round(s.compile_s, 2) for m, s in steps.items()},
              "selected_frac": {m: float(s.metrics["selected_frac"]) for m, s in steps.items()},
              "references": {  # the ict step per ict.reference: time and XLA's temporary buffers
                  ref: {
                      "step_s": round(med[m], 4),
                      "temp_bytes": int(steps[m].compiled.memory_analysis().temp_size_in_bytes),
                  }
                  for ref, m in (("active_mean", "ict"), ("sequence_mean", "ict_sequence_mean"))
              },
              "breakdown": breakdown,
              "sparse_rows": {"selected": int(ict_rows.sum()), "capacity": capacity, "of": n * c},
              "forward_share_of_ict_step": round(med["fused_forward"] / med["ict"], 4),
              "load_avg_1m": os.getloadavg()[0],
              "jax": jax.__version__,
          }
      )
  )


if __name__ == "__main__":
  main()
