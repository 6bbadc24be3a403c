"""Bytes one TPU chip's decode head + draw accesses, compiled here for an absent TPU.

    python benchmarks/draw_bytes.py [--target v5p-32] [--rows 64,128] [--hidden 896] [--vocab 151936]

The decode step's last part alone, as the sampler runs it: the head (`Qwen2.next_token_logits`'s
einsum, float32 logits [rows, V]) and `sampling.rules._sample_step` at temperature 0 (greedy)
and 1 (plain sampling, the paper configs', with one key, and `row_keys`: a key a row, as the
decode loop draws since `sampling.rules.row_keys`), plus the head and its row maximum only (the
least any of them can access: the embedding read once). Each is compiled for one chip of --target
(libtpu, compile only) with and without memory-space assignment (`xla_msa_enable`; without it
`cost_analysis()` counts HBM traffic, with it also every VMEM staging copy and read). Prints one
JSON line per row count: MiB accessed per program and setting, and the logits' MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

# first, before JAX starts: ict_jax.aot puts the compilers' folder on sys.path (as compile_step.py)
from ict_jax import aot  # noqa: E402

VOCAB = 151_936  # Qwen2.5's


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", default="v5p-32", help="a TPU target of ict_jax.aot")
  p.add_argument("--rows", default="64,128", help="rows a chip, comma-separated")
  p.add_argument("--hidden", type=int, default=896, help="model width (0.5B: 896, 1.5B: 1536)")
  p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (Qwen2.5's by default)")
  a = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from ict_jax.sampling import rules

  target = aot.TARGETS[a.target]
  if target.platform != "tpu":
    p.error(f"--target {a.target}: a TPU target is needed (the CUDA plugin gives no cost analysis)")
  mesh = Mesh(np.array(aot.target_devices(target)[:1]), ("chip",))
  one = NamedSharding(mesh, P())
  key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype

  def draws(logits, key, kind):
    t = jnp.float32(1.0)
    if kind == "head_max":
      return jnp.max(logits, axis=-1), jnp.argmax(logits, axis=-1)
    if kind == "row_keys":  # [rows] keys, row r's fold_in(fold_in(key, r), step)
      key = rules.row_keys(key, jnp.arange(logits.shape[0], dtype=jnp.int32), 0)
    return rules._sample_step(logits, key, t, t, greedy=kind == "greedy", top_k=0, use_top_p=False)

  out = []
  for rows in (int(r) for r in a.rows.split(",")):
    record = {
        "target": a.target,
        "rows": rows,
        "hidden": a.hidden,
        "vocab": a.vocab,
        "logits_mib": rows * a.vocab * 4 / 2**20,
    }
    args = (
        jax.ShapeDtypeStruct((rows, a.hidden), jnp.bfloat16, sharding=one),  # h after the final norm
        jax.ShapeDtypeStruct((a.vocab, a.hidden), jnp.bfloat16, sharding=one),  # the tied embedding
        jax.ShapeDtypeStruct((), key_dtype, sharding=one),
    )
    for kind in ("head_max", "greedy", "plain", "row_keys"):
      for msa in (True, False):

        def program(h, w, key, kind=kind):
          logits = jnp.einsum("BD,VD->VB", h, w, preferred_element_type=jnp.float32).T  # as the model
          return draws(logits, key, kind)

        opts = {} if msa else {"xla_msa_enable": False}
        compiled = jax.jit(program, compiler_options=opts).lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        record[f"{kind}_mib{'' if msa else '_no_msa'}"] = round(cost["bytes accessed"] / 2**20, 1)
    print(json.dumps(record), flush=True)
    out.append(record)
  return out


if __name__ == "__main__":
  main()
