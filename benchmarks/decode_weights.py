"""The decode step of the rollout-copy layouts (`rollout.decode_weights`), compiled for an
absent accelerator: the bytes a chip reads a step and the collectives it runs (issue 41, item 2).

    python benchmarks/decode_weights.py [--model qwen2_5_1_5b] [--target v5e-8] [--rows 1024]
        [--samples 8] [--prompt_len 512] [--slots 2048] [--bound 256] [--decode_attention pallas]
        [--greedy] [--layers N] [--layouts replicated,tensor,mlp]

For each layout, `ict_jax.aot.sampler.compile_decode_step` (the sampler's while-loop body: one
token for every row, the KV cache donated, the layer scan unrolled) on the target's compile-only
devices, mesh (1, chips, 1) as the paper recipes', rows over ("data", "fsdp"), bf16. Per chip:
`weight_bytes` (the rollout copy's shards), `bytes_accessed` (`cost_analysis()` with MSA off, as
`ict_jax.aot` counts a step: `HBM_BYTES_OPTIONS`, and XLA's collective matmuls off:
`NO_WINDOWED_EINSUM`, so that no loop hides bytes from it; `while_loops` counts any left), and
from the optimised HLO each collective (`all-gather`, `reduce-scatter`, `all-reduce`,
`all-to-all`, `collective-permute`; an async -start/-done pair once) with its output bytes and the
bytes a chip receives over the interconnect (`ici_bytes`: all-gather (n-1)/n of its output,
reduce-scatter (n-1) x its output, all-reduce 2 (n-1)/n, all-to-all (n-1)/n, collective-permute
all of it, n the replica group's size). `ici_s` = ici_bytes / the chip's one-way ICI bandwidth
(`ICI_GB_S`: v5e 1,600 Gbps = 200 GB/s a direction, cloud.google.com/tpu/docs/v5e: "400 GBps
bidirectional"), next to `hbm_s` = bytes_accessed / its HBM bandwidth. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import ict_jax.aot._env  # noqa: E402,F401  (before jax: the compilers' folder, CPU as the runtime)

ICI_GB_S = {"v5e-8": 200.0, "v4-8": 300.0, "v5p-32": 600.0, "v6e-8": 400.0}  # one way, a chip (GB/s)
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "u64": 8}
_OP = re.compile(
    r"=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(" + "|".join(_KINDS) + r")(-start)?\((.*)$", re.M
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


# XLA:TPU turns a matmul next to a reduce-scatter / all-gather into a loop of collective-permutes
# ("windowed einsum", a collective matmul), whose body `cost_analysis()` counts once: off, so every
# byte of the step is counted (the collectives are then plain all-reduces / all-gathers)
NO_WINDOWED_EINSUM = {
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
}


def _array_bytes(text: str) -> list[int]:
  """The bytes of each non-scalar array in an HLO shape (an async start's u32[] contexts dropped)."""
  out = []
  for dtype, dims in _ARRAY.findall(text):
    if not dims:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    out.append(n * _DTYPE_BYTES.get(dtype, 4))
  return out


def _group_size(rest: str, chips: int) -> int:
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
  if m:
    return len(m.group(1).split(","))
  return chips


def collectives(hlo_text: str, chips: int) -> dict:
  """{kind: {count, bytes (outputs), ici_bytes (received a chip)}} of optimised HLO text."""
  out = {k: dict(count=0, bytes=0, ici_bytes=0.0) for k in _KINDS}
  for shape, kind, start, rest in _OP.findall(hlo_text):
    sizes = _array_bytes(shape)
    # an async start's shape is (operands..., outputs...): its output is the second half
    size = sum(sizes[len(sizes) // 2 :]) if start and shape.startswith("(") else sum(sizes)
    n = _group_size(rest, chips)
    factor = {
        "all-gather": (n - 1) / n,
        "reduce-scatter": n - 1,
        "all-reduce": 2 * (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "collective-permute": 1.0,
    }[kind]
    out[kind]["count"] += 1
    out[kind]["bytes"] += size
    out[kind]["ici_bytes"] += factor * size
  return out


def measure(args, layout: str) -> dict:
  import jax

  from ict_jax import sampling, sharding
  from ict_jax.aot.sampler import HBM_BYTES_OPTIONS, compile_decode_step, decode_cache
  from ict_jax.aot.targets import TARGETS, target_devices
  from ict_jax.models.config import Qwen2Config

  target = TARGETS[args.target]
  mesh = sharding.make_mesh((1, target.chips, 1), devices=target_devices(target))
  cfg = Qwen2Config.preset(args.model, dtype="bfloat16", param_dtype="bfloat16", decode_attention=args.decode_attention)
  if args.layers:
    cfg = cfg.replace(num_hidden_layers=args.layers)
  policy = sampling.abstract_rollout_policy(cfg, dtype="bfloat16", mesh=mesh, weights=layout)
  cache = decode_cache(cfg, mesh, args.rows, args.slots, "bfloat16")
  prompts = decode_cache(cfg, mesh, args.rows // args.samples, args.prompt_len, "bfloat16")
  kw = dict(greedy=args.greedy, top_k=0, use_top_p=False)
  t0 = time.perf_counter()
  opts = dict(HBM_BYTES_OPTIONS, **NO_WINDOWED_EINSUM) if target.platform == "tpu" else None
  compiled = compile_decode_step(policy, mesh, cache, prompts, kw, args.bound, opts)
  compile_s = time.perf_counter() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  weight_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(policy.state))  # one chip's shards
  text = compiled.as_text()
  coll = collectives(text, target.chips)
  ici = sum(c["ici_bytes"] for c in coll.values())
  return dict(
      layout=layout,
      compile_s=round(compile_s, 1),
      weight_bytes=weight_bytes,
      weight_bytes_total=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(policy.state)),
      bytes_accessed=float(cost["bytes accessed"]),
      argument_bytes=int(mem.argument_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
      collectives=coll,
      ici_bytes=ici,
      while_loops=len(re.findall(r"\swhile\(", text)),  # loops cost_analysis would count once
      hbm_s=float(cost["bytes accessed"]) / (target.hbm_tb_s * 1e12),
      ici_s=ici / (ICI_GB_S.get(args.target, float("nan")) * 1e9),
  )


def _shard_bytes(x) -> int:
  shape = x.sharding.shard_shape(x.shape)
  n = 1
  for d in shape:
    n *= d
  return n * x.dtype.itemsize


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="qwen2_5_1_5b")
  p.add_argument("--target", default="v5e-8")
  p.add_argument("--rows", type=int, default=1024)
  p.add_argument("--samples", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=512)
  p.add_argument("--slots", type=int, default=2048)
  p.add_argument("--bound", type=int, default=256)
  p.add_argument("--decode_attention", default="pallas")
  p.add_argument("--greedy", action="store_true")
  p.add_argument("--layers", type=int, default=0, help="the preset's layers (0), or fewer: a shorter compile")
  p.add_argument("--layouts", default="replicated,tensor,mlp")
  args = p.parse_args(argv)
  runs = {layout: measure(args, layout) for layout in args.layouts.split(",")}
  out = dict(vars(args), runs=runs)
  if {"replicated", "tensor"} <= set(runs):
    r, t = runs["replicated"], runs["tensor"]
    out["bytes_saved"] = r["bytes_accessed"] - t["bytes_accessed"]
    out["weight_bytes_saved"] = r["weight_bytes"] - t["weight_bytes"]  # ~7/8 of the weights on 8 chips
    out["bytes_saved_over_weight_bytes_saved"] = out["bytes_saved"] / out["weight_bytes_saved"]
    out["weight_share"] = t["weight_bytes"] / t["weight_bytes_total"]
    out["step_s_replicated"] = r["hbm_s"] + r["ici_s"]
    out["step_s_tensor"] = t["hbm_s"] + t["ici_s"]
  if {"tensor", "mlp"} <= set(runs):  # the attention whole on every chip: weights read against rows moved
    t, m = runs["tensor"], runs["mlp"]
    out["mlp_bytes_over_tensor"] = m["bytes_accessed"] / t["bytes_accessed"]
    out["mlp_ici_bytes_over_tensor"] = m["ici_bytes"] / t["ici_bytes"] if t["ici_bytes"] else float("nan")
    out["step_s_mlp"] = m["hbm_s"] + m["ici_s"]
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
