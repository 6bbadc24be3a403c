"""Compile time and per-device memory of the train step, without running it (abstract inputs).

    python benchmarks/compile_step.py --config configs/qwen2_5_1_5b_math.py --preset qwen2_5_1_5b \
        [--target v5p-32 | --target cpu] [--rows 1024 --prompt 512 --completion 2048] \
        [--micro_batch 64] [--json out.json]

The step, its state and shardings come from the trainer's functions (`setup`, `train_step`); the
model's architecture comes from `--preset` (the config's model.path is not read). `--target
v5p-32` compiles for a TPU v5p-32 slice (16 chips, `v5:2x2x4` megacore), and any other TPU target
of `python -m ict_jax.aot`, through libtpu's compile-only devices as `ict_jax.aot` makes them
(libtpu from $ICT_JAX_AOT_LIBS, default ~/.cache/ict_jax/aot-libs, or installed next to JAX, as
`requirements-aot.txt` installs it); `--target cpu` compiles for this machine's CPU devices
(--xla_force_host_platform_device_count sets how many). Prints one JSON line: lower_s (tracing to
StableHLO), compile_s (XLA, wall) and compile_cpu_s (XLA, CPU time of all threads: steadier on a
shared machine), the 1-minute load average, memory_analysis() bytes per device, and the
compiled program's collectives by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

# First, before JAX starts: ict_jax.aot puts the compilers' folder on sys.path, makes the CPU the
# only runtime backend (a target's devices are compile-only) and turns the compilation cache off
# (compile_s is a compile, never a load).
from ict_jax import aot  # noqa: E402

TPU_TARGETS = [name for name, t in aot.TARGETS.items() if t.platform == "tpu"]


def _devices(target: str):
  """The CPU's devices, or a TPU target's compile-only devices (`ict_jax.aot.target_devices`)."""
  import jax

  if target == "cpu":
    return jax.devices()
  return aot.target_devices(aot.TARGETS[target])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--preset", required=True, help="Qwen2Config preset giving the architecture")
  p.add_argument("--target", default="v5p-32", choices=["cpu", *TPU_TARGETS])
  p.add_argument("--rows", type=int, default=0, help="rows per step (default: the config's)")
  p.add_argument("--micro_batch", type=int, default=0, help="default: the config's")
  p.add_argument("--prompt", type=int, default=512)
  p.add_argument("--completion", type=int, default=2048)
  p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (diagnostics)")
  p.add_argument("--set", action="append", default=[], help="config overrides key=value (python literal)")
  p.add_argument("--json", default="")
  args = p.parse_args(argv)
  import ast
  import importlib.util

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ict_jax import config as config_lib, sharding, train_step as ts
  from ict_jax.batch import TrainBatch
  from ict_jax.setup import abstract_params, model_config

  spec = importlib.util.spec_from_file_location("cfg_module", args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model.path, c.model.preset = "", args.preset
  c.train.token_budget = c.train.micro_batch_tokens = 0  # the padded step (`ict_jax.aot` compiles the packed one)
  if args.rows:
    c.rollout.prompts_per_step = args.rows // c.rollout.group_size
  if args.micro_batch:
    c.train.micro_batch_size = args.micro_batch
  for kv in args.set:
    key, value = kv.split("=", 1)
    node = c
    *parents, last = key.split(".")
    for k in parents:
      node = node[k]
    node[last] = ast.literal_eval(value) if value[:1] in "0123456789-[({'\"TF" else value
  cfg = config_lib.validate(c)
  try:
    devices = _devices(args.target)
  except aot.AotError as e:  # libtpu missing: the install line
    print(f"compile_step: error: {e}", file=sys.stderr)
    return 2
  mesh = sharding.make_mesh({"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}, devices=devices)
  mcfg = model_config(cfg, "", mesh)
  if args.layers:
    mcfg = mcfg.replace(num_hidden_layers=args.layers)
  graphdef, params, params_sharding = abstract_params(mcfg, mesh)
  optimizer = ts.make_optimizer(cfg.optim, cfg.train.steps)
  state_sharding = ts.train_state_shardings(optimizer, params, params_sharding, mesh)
  state_abs = jax.eval_shape(lambda p: ts.TrainState(jnp.int32(0), p, optimizer.init(p)), params)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state_abs, state_sharding)
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  rs = NamedSharding(mesh, P(("data", "fsdp")))
  # ids, masks and advantages only (no rollout's stop_pos / answer_end)
  batch = TrainBatch.abstract(rows, args.prompt, args.completion, sharding=rs).replace(stop_pos=None, answer_end=None)
  ref = params if cfg.loss.beta > 0 else None
  step = ts.make_train_step(
      graphdef, ts.StepConfig.from_config(cfg), optimizer, mesh=mesh, state_sharding=state_sharding
  )
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = step.jitted.lower(state, batch, ref)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  collectives = {
      kind: len(re.findall(rf"\s{kind}(?:-start)?\(", hlo))
      for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
  }
  out = dict(
      target=args.target,
      preset=args.preset,
      layers=mcfg.num_hidden_layers,
      rows=rows,
      micro_batch=cfg.train.micro_batch_size,
      prompt=args.prompt,
      completion=args.completion,
      mesh=dict(mesh.shape),
      model={k: getattr(mcfg, k) for k in ("dtype", "param_dtype") if hasattr(mcfg, k)},
      lower_s=round(t1 - t0, 1),
      compile_s=round(t2 - t1, 1),
      compile_cpu_s=round(c2 - c1, 1),
      load_avg_1m=round(os.getloadavg()[0], 1),
      temp_gib=round(mem.temp_size_in_bytes / 2**30, 3),
      argument_gib=round(mem.argument_size_in_bytes / 2**30, 3),
      output_gib=round(mem.output_size_in_bytes / 2**30, 3),
      collectives=collectives,
  )
  for k in ("remat_policy", "remat", "attention"):
    if hasattr(mcfg, k):
      out["model"][k] = getattr(mcfg, k)
  print(json.dumps(out))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
