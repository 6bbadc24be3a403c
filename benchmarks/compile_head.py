"""Compile time of the train step's LM head alone (fused log-probs + ICT statistics, ICT's top-k
selection, and the gradient through the custom VJP with its sparse and dense backward), for the
1.5B paper step's micro-batch on a TPU v5p-32 (compile-only devices, as `compile_step.py`).

    python benchmarks/compile_head.py [--target v5p-32] [--rows 64 --columns 2048 --hidden 1536
        --vocab 151936] [--chunk 128]

h [rows, columns, hidden] bf16 and ids/mask [rows, columns] sharded by rows over fsdp (all the
target's chips), the tied head [vocab, hidden] float32 sharded like the embedding; the defaults
are the 1.5B paper step's micro-batch. Prints one JSON line: compile CPU seconds, wall, the
1-minute load average, the shapes and the temporaries per chip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_step  # noqa: E402  (first: ict_jax.aot's compilers and compile-only devices)

G = 8  # the paper's group size


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", default="v5p-32", choices=compile_step.TPU_TARGETS)
  ap.add_argument("--rows", type=int, default=64, help="sequences of the micro-batch")
  ap.add_argument("--columns", type=int, default=2048, help="completion positions")
  ap.add_argument("--hidden", type=int, default=1536)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--chunk", type=int, default=128, help="completion positions per LM-head chunk")
  args = ap.parse_args(argv)
  n, c, d, v = args.rows, args.columns, args.hidden, args.vocab
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ict_jax import aot, lm_head, selection, sharding

  try:
    devices = compile_step._devices(args.target)
  except aot.AotError as e:  # libtpu missing: the install line
    print(f"compile_head: error: {e}", file=sys.stderr)
    return 2
  if n % len(devices) or n % G:
    print(f"compile_head: error: --rows {n} must be a multiple of {len(devices)} chips and of G {G}", file=sys.stderr)
    return 2
  mesh = sharding.make_mesh({"data": 1, "fsdp": len(devices), "tensor": 1}, devices=devices)
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  h = jax.ShapeDtypeStruct((n, c, d), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
  ids = jax.ShapeDtypeStruct((n, c), jnp.int32, sharding=rows)
  mask = jax.ShapeDtypeStruct((n, c), jnp.int32, sharding=rows)

  def loss(h, w, ids, mask):
    logp, stats = lm_head.logp_and_stats(
        h,
        w,
        ids,
        mask,
        temperature=1.0,
        group_size=G,
        chunk_size=args.chunk,
        grad_rows=lm_head.sparse_grad_rows("ict", 0.1, 0.2, n, c),
        vocab_major=True,
    )
    return jnp.sum(jnp.where(selection.ict_mask(stats["js"], mask, 0.1), logp, 0.0))

  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, ids, mask)
  t0, c0 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t1, c1 = time.perf_counter(), time.process_time()
  out = dict(
      target=args.target,
      chips=len(devices),
      rows=n,
      columns=c,
      hidden=d,
      vocab=v,
      chunk=args.chunk,
      compile_cpu_s=round(c1 - c0, 1),
      compile_s=round(t1 - t0, 1),
      load_avg_1m=round(os.getloadavg()[0], 1),
      temp_gib=round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3),
  )
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
