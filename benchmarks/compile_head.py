"""Compile time of the train step's LM head alone (fused log-probs + ICT statistics, ICT's top-k
selection, and the gradient through the custom VJP with its sparse and dense backward), for the
1.5B paper step's micro-batch on a TPU v5p-32 (compile-only devices, as `compile_step.py`).

    PYTHONPATH=. python benchmarks/compile_head.py

h [64, 2048, 1536] bf16 and ids/mask [64, 2048] sharded by rows over fsdp 16, the tied head
[151936, 1536] float32 sharded like the embedding. Prints one JSON line: compile CPU seconds,
wall, the 1-minute load average and the temporaries per chip.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_step  # noqa: E402  (libtpu location and the v5p-32 compile-only devices)

N, C, D, V, G = 64, 2048, 1536, 151936, 8


def main() -> int:
  if not os.path.isdir(compile_step.LIBS_DIR):
    print(f"compile_head: error: no libtpu in {compile_step.LIBS_DIR}", file=sys.stderr)
    return 2
  sys.path.insert(0, compile_step.LIBS_DIR)
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ict_jax import lm_head, selection, sharding

  mesh = sharding.make_mesh({"data": 1, "fsdp": 16, "tensor": 1}, devices=compile_step._devices("v5p-32"))
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  h = jax.ShapeDtypeStruct((N, C, D), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((V, D), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
  ids = jax.ShapeDtypeStruct((N, C), jnp.int32, sharding=rows)
  mask = jax.ShapeDtypeStruct((N, C), jnp.int32, sharding=rows)

  def loss(h, w, ids, mask):
    logp, stats = lm_head.logp_and_stats(
        h,
        w,
        ids,
        mask,
        temperature=1.0,
        group_size=G,
        chunk_size=128,
        grad_rows=lm_head.sparse_grad_rows("ict", 0.1, 0.2, N, C),
        vocab_major=True,
    )
    return jnp.sum(jnp.where(selection.ict_mask(stats["js"], mask, 0.1), logp, 0.0))

  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, ids, mask)
  t0, c0 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t1, c1 = time.perf_counter(), time.process_time()
  out = dict(
      compile_cpu_s=round(c1 - c0, 1),
      compile_s=round(t1 - t0, 1),
      load_avg_1m=round(os.getloadavg()[0], 1),
      temp_gib=round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3),
  )
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
