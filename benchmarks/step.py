"""One RL train step: ict_jax's jitted GRPO/ICT step vs the equivalent PyTorch step, same weights.

Default ("bench"): vocab 151936, hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 704, tied head
(the "bench" preset), float32, random weights (transformers' init, saved with `save_pretrained`,
loaded by both). Batch 8 sequences = 1 prompt x G=8, prompt 64 (left-padded, 48..64 real tokens)
+ completion 192 (96..192 real tokens), temperature 1.

- ours: `train_step.make_train_step` with method=ict (default; `--method`): one forward to the
  final hidden states, the fused chunked LM head over the completion positions with log-probs,
  entropy, Renyi-2 and the ICT JS score, top-10% selection, Sparse-GRPO loss, backward, global-norm
  clip, AdamW (optax), state donated. Warm-up step (includes compile) excluded; `compile_s` is the
  explicit `lower().compile()` time.
- torch: `transformers` Qwen2ForCausalLM (sdpa attention), `logits_to_keep=C+1` as TRL does,
  log_softmax + gather, the clipped GRPO surrogate with per-sequence mean, backward,
  `clip_grad_norm_(1.0)`, `torch.optim.AdamW`; no token selection (plain GRPO), so ours does
  strictly more work per step.

Each framework runs in its own subprocess (fair peak memory: the parent reads each child's
`ru_maxrss` with `os.wait4`). CPU threads: each child pins itself to the first `--threads` cores
with `os.sched_setaffinity` (what `taskset -c 0-1` does) before JAX or torch start; XLA:CPU sizes
its thread pools from the CPUs the process may run on, and torch gets
`torch.set_num_threads(--threads)`. The JAX child also gets
XLA_FLAGS=--xla_cpu_multi_thread_eigen=true (XLA's default; "intra_op_parallelism_threads" is a
TensorFlow session option that XLA ignores).
Model FLOP/s = `Qwen2Config.flops_per_token(S) * N * S / step_s` (6 x matmul parameters incl. the
LM head + 6 L H_q d_head S for causal attention, the PaLM/Megatron convention) against a float32
`jnp.dot` of two 2048x2048 matrices timed in the same child.

    python benchmarks/step.py [--threads 2] [--repeats 3] [--method ict]
    python benchmarks/step.py --config configs/qwen2_5_1_5b_math.py --dtype bfloat16 \
        [--layers 2] [--batch 16 --prompt 256 --completion 768] [--peak_tflops 790]

`--layers`, `--vocab` and the shape flags shrink either model (the CI smoke test runs
`--layers 1 --vocab 512` on a few tokens).

With `--config`, the model of that config (its `model.path` if it exists, else the Qwen2.5 preset
named in the file name) gets random weights, the step settings come from the config, and there is
no torch run; tokens/s and MFU = model FLOP/s / (peak_tflops * 1e12) are reported (peak default
790 = H200 dense bf16). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

BENCH_SHAPE = dict(batch=8, prompt=64, completion=192)
CONFIG_SHAPE = dict(batch=16, prompt=256, completion=768)
FORMULA = (
    "MFU = flops_per_token(S) * N * S / step_s / (peak_tflops * 1e12); flops_per_token = "
    "6 * (L * (D*H*Dh + 2*D*K*Dh + H*Dh*D + 3*D*F) + D*V) + 6 * L * H * Dh * S"
)


def _pin(threads: int) -> list[int]:
  cpus = sorted(os.sched_getaffinity(0))
  if threads and len(cpus) > threads:
    os.sched_setaffinity(0, cpus[:threads])
  return sorted(os.sched_getaffinity(0))


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="", help="a configs/*.py file: its model with random weights")
  ap.add_argument("--dtype", default="", help="compute dtype (default: float32, or the config's)")
  ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
  ap.add_argument("--vocab", type=int, default=0, help="override vocab_size (small runs)")
  ap.add_argument("--batch", type=int, default=0)
  ap.add_argument("--prompt", type=int, default=0)
  ap.add_argument("--completion", type=int, default=0)
  ap.add_argument("--micro_batch", type=int, default=0, help="0: the whole batch")
  ap.add_argument("--chunk", type=int, default=0, help="LM-head / statistics chunk (default: 16, or the config's)")
  ap.add_argument("--method", default="", help="grpo | entropy | stapo | ict (default: ict, or the config's)")
  ap.add_argument("--threads", type=int, default=2, help="CPU cores to pin to (0: all)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--peak_tflops", type=float, default=790.0)
  ap.add_argument("--no_torch", action="store_true")
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  ap.add_argument("--workdir", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  shape = CONFIG_SHAPE if args.config else BENCH_SHAPE
  for k, v in shape.items():
    if not getattr(args, k):
      setattr(args, k, v)
  return args


# ---- model / step settings (imported by benchmarks/selection.py) ------------------------------
def load_config(path: str):
  import importlib.util

  from ict_jax import config as config_lib

  spec = importlib.util.spec_from_file_location("bench_config", path)
  if spec is None or spec.loader is None:
    raise SystemExit(f"--config {path}: not a Python file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.validate(module.get_config())


def model_config(args, cfg=None):
  """Qwen2Config: "bench", or the config's model (its HF folder, else the preset in the name)."""
  from ict_jax.models.config import PRESETS, Qwen2Config

  from ict_jax.setup import resolve_kernels

  if cfg is None:  # kernels "auto": the XLA:CPU formulations on one CPU device (this benchmark's)
    mcfg = Qwen2Config.preset(
        "bench", dtype=args.dtype or "float32", param_dtype="float32", kernels=resolve_kernels("auto")
    )
  else:
    if cfg.model.path and os.path.exists(os.path.join(cfg.model.path, "config.json")):
      with open(os.path.join(cfg.model.path, "config.json")) as f:
        mcfg = Qwen2Config.from_hf_dict(json.load(f))
    else:
      stem = os.path.basename(args.config)
      names = sorted((n for n in PRESETS if n in stem), key=len, reverse=True)
      if not names and cfg.model.path:
        raise SystemExit(
            f"--config {args.config}: model.path {cfg.model.path!r} has no "
            f"config.json and the file name names no preset of {sorted(PRESETS)}"
        )
      mcfg = Qwen2Config.preset(names[0] if names else cfg.model.preset)
    from ict_jax.setup import resolve_attention

    dtype = args.dtype or cfg.model.dtype
    mcfg = mcfg.replace(
        dtype=dtype,
        param_dtype=cfg.model.param_dtype,
        remat_policy=cfg.model.remat_policy,
        attention=resolve_attention(cfg.model.attention, dtype=dtype),
        kernels=resolve_kernels(cfg.model.kernels),
    )
  if args.layers:
    mcfg = mcfg.replace(num_hidden_layers=args.layers)
  if args.vocab:
    mcfg = mcfg.replace(vocab_size=args.vocab)
  return mcfg


def step_config(args, cfg=None, method: str | None = None):
  from ict_jax import train_step as ts
  from ict_jax.config import IctConfig

  if cfg is None:
    # chunk 16: the default (tiny, CPU) config's ict.chunk_size; [8, 16, V] float32 blocks
    base = ts.StepConfig(IctConfig(method="ict", warmup_steps=0, chunk_size=16), group_size=8, temperature=1.0)
  else:
    base = ts.StepConfig.from_config(cfg)
  import dataclasses

  ict = dataclasses.replace(
      base.ict,
      method=method or args.method or base.ict.method,
      warmup_steps=0,
      chunk_size=args.chunk or base.ict.chunk_size,
  )
  return dataclasses.replace(base, ict=ict, micro_batch_size=args.micro_batch)


def make_batch(args, vocab: int, group_size: int, seed: int = 0) -> dict:
  """Left-padded prompts (G rollouts share one), right-padded completions, mixed-sign A: numpy
  arrays by `TrainBatch` field name (batch.npz, which the torch child reads too; `JaxStep` makes
  the `TrainBatch`)."""
  import numpy as np

  rng = np.random.RandomState(seed)
  n, p, c = args.batch, args.prompt, args.completion
  if n % group_size:
    raise SystemExit(f"--batch {n} must be a multiple of group_size {group_size}")
  plen = np.repeat(rng.randint(p * 3 // 4, p + 1, n // group_size), group_size)
  pmask = (np.arange(p)[None] >= p - plen[:, None]).astype(np.int32)
  pids = np.repeat(rng.randint(1, vocab, (n // group_size, p)), group_size, 0) * pmask
  pids = pids.astype(np.int32)
  clen = rng.randint(c // 2, c + 1, n)
  cmask = (np.arange(c)[None] < clen[:, None]).astype(np.int32)
  cids = rng.randint(1, vocab, (n, c)).astype(np.int32) * cmask
  adv = rng.randn(n).astype(np.float32)
  return dict(prompt_ids=pids, prompt_mask=pmask, completion_ids=cids, completion_mask=cmask, advantages=adv)


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times), times


def jax_matmul_gflops(repeats: int = 5) -> float:
  import jax
  import jax.numpy as jnp

  k = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k[0], (2048, 2048), jnp.float32)
  b = jax.random.normal(k[1], (2048, 2048), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  t, _ = median_time(lambda: dot(a, b).block_until_ready(), repeats)
  return 2 * 2048**3 / t / 1e9


class JaxStep:
  """A compiled train step with its state; `run()` does one step (state donated and threaded)."""

  def __init__(self, graphdef, params, scfg, optimizer, batch):
    import jax
    from ict_jax import train_step as ts
    from ict_jax.batch import TrainBatch

    self.state = ts.init_train_state(params, optimizer)
    self.batch = TrainBatch(**batch).map_rows(jax.numpy.asarray)
    jitted = ts.make_train_step(graphdef, scfg, optimizer)
    t = time.perf_counter()
    self.compiled = jitted.lower(self.state, self.batch, None).compile()
    self.compile_s = time.perf_counter() - t

  def run(self):
    import jax

    self.state, self.metrics, self.logp = self.compiled(self.state, self.batch, None)
    jax.block_until_ready((self.state, self.metrics, self.logp))
    return self


# ---- children ---------------------------------------------------------------------------------
def child_jax(args) -> dict:
  import jax
  import numpy as np
  from flax import nnx

  from ict_jax import train_step as ts
  from ict_jax.config import OptimConfig

  cfg = load_config(args.config) if args.config else None
  mcfg = model_config(args, cfg)
  if cfg is None:
    from ict_jax.models.hf import load_pretrained

    model = load_pretrained(os.path.join(args.workdir, "weights"), dtype=mcfg.dtype, kernels=mcfg.kernels)
    optim = OptimConfig(learning_rate=1e-6, max_grad_norm=1.0)
  else:
    from ict_jax.models.qwen2 import init_model

    model = init_model(mcfg, seed=0)
    optim = cfg.optim
  graphdef, state = nnx.split(model)
  params = state.to_pure_dict()
  del model, state
  scfg = step_config(args, cfg)
  batch = dict(np.load(os.path.join(args.workdir, "batch.npz")))
  optimizer = ts.make_optimizer(optim, total_steps=100)
  t = time.perf_counter()
  step = JaxStep(graphdef, params, scfg, optimizer, batch)
  del params
  step.run()  # warm-up
  first_s = time.perf_counter() - t
  np.save(os.path.join(args.workdir, "logp_jax.npy"), np.asarray(step.logp))
  step_s, all_s = median_time(step.run, args.repeats)
  n, s = args.batch, args.prompt + args.completion
  flops = mcfg.flops_per_token(s) * n * s
  out = {
      "step_s": step_s,
      "all_step_s": [round(x, 4) for x in all_s],
      "compile_s": round(step.compile_s, 2),
      "first_step_s": round(first_s, 2),
      "tokens_per_s": n * s / step_s,
      "model_tflops_per_s": flops / step_s / 1e12,
      "step_model_tflop": flops / 1e12,
      "method": scfg.ict.method,
      "chunk_size": scfg.ict.chunk_size,
      "selected_frac": float(step.metrics["selected_frac"]),
      "loss": float(step.metrics["loss"]),
      "device": str(jax.devices()[0].device_kind),
      "backend": jax.default_backend(),
      "jax": jax.__version__,
  }
  if jax.default_backend() == "cpu":
    out["matmul_2048_gflops"] = jax_matmul_gflops()
  return out


def child_torch(args) -> dict:
  import numpy as np
  import torch
  import transformers

  torch.set_num_threads(args.threads or os.cpu_count())
  model = transformers.Qwen2ForCausalLM.from_pretrained(
      os.path.join(args.workdir, "weights"), dtype=torch.float32
  ).train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
  b = {k: torch.from_numpy(v) for k, v in np.load(os.path.join(args.workdir, "batch.npz")).items()}
  ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1).long()
  mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1).long()
  positions = (mask.cumsum(1) - 1).clamp(min=0)  # same positions as ours for left padding
  cids, cmask = b["completion_ids"].long(), b["completion_mask"].float()
  adv = b["advantages"][:, None]
  c, eps = cids.shape[1], 0.2

  def step():
    logits = (
        model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=c + 1, use_cache=False)
        .logits[:, :-1]
        .float()
    )  # [N, C, V]
    logp = torch.log_softmax(logits, -1).gather(-1, cids[..., None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    loss = ((per_token * cmask).sum(1) / cmask.sum(1).clamp(min=1)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return logp.detach()

  t = time.perf_counter()
  logp = step()  # warm-up
  first_s = time.perf_counter() - t
  np.save(os.path.join(args.workdir, "logp_torch.npy"), logp.numpy())
  step_s, all_s = median_time(step, args.repeats)
  a = torch.randn(2048, 2048)
  a @ a
  mm_s, _ = median_time(lambda: a @ a, 5)
  n, s = ids.shape
  return {
      "step_s": step_s,
      "all_step_s": [round(x, 4) for x in all_s],
      "first_step_s": round(first_s, 2),
      "tokens_per_s": n * s / step_s,
      "matmul_2048_gflops": 2 * 2048**3 / mm_s / 1e9,
      "torch": torch.__version__,
      "transformers": transformers.__version__,
  }


def run_child(kind: str, args, workdir: str) -> dict:
  """Run one framework in a fresh process; adds its peak RSS (ru_maxrss of that child)."""
  argv = [a for a in sys.argv[1:]] + ["--child", kind, "--workdir", workdir]
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE)
  out = proc.stdout.read().decode()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise SystemExit(f"benchmarks/step.py: the {kind} child failed (exit {proc.returncode})")
  result = json.loads(out.strip().splitlines()[-1])
  result["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)  # Linux: KiB
  return result


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.child:
    cpus = _pin(args.threads)
    if not args.config:
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.child == "jax" and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
      flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true"
      os.environ["XLA_FLAGS"] = flags.strip()
    result = child_jax(args) if args.child == "jax" else child_torch(args)
    result["cpus"] = cpus
    print(json.dumps(result))
    return

  import numpy as np

  cfg = load_config(args.config) if args.config else None
  mcfg = model_config(args, cfg)
  scfg = step_config(args, cfg)
  with_torch = cfg is None and not args.no_torch
  with tempfile.TemporaryDirectory() as tmp:
    batch = make_batch(args, mcfg.vocab_size, scfg.group_size)
    np.savez(os.path.join(tmp, "batch.npz"), **batch)
    if cfg is None:  # shared random weights, written once by transformers
      import torch
      import transformers

      skip = ("architectures", "model_type", "torch_dtype")
      hf_cfg = transformers.Qwen2Config(**{k: v for k, v in mcfg.to_hf_dict().items() if k not in skip})
      torch.manual_seed(0)
      transformers.Qwen2ForCausalLM(hf_cfg).float().save_pretrained(os.path.join(tmp, "weights"))
    ours = run_child("jax", args, tmp)
    theirs = run_child("torch", args, tmp) if with_torch else None
    logp_diff = None
    if theirs is not None:
      a = np.load(os.path.join(tmp, "logp_jax.npy"))
      b = np.load(os.path.join(tmp, "logp_torch.npy"))
      logp_diff = float(np.abs((a - b) * batch["completion_mask"]).max())

  n, s = args.batch, args.prompt + args.completion
  report = {
      "benchmark": "train_step",
      "method": ours["method"],
      "model": {
          "vocab": mcfg.vocab_size,
          "hidden": mcfg.hidden_size,
          "layers": mcfg.num_hidden_layers,
          "heads": mcfg.num_attention_heads,
          "kv_heads": mcfg.num_key_value_heads,
          "mlp": mcfg.intermediate_size,
          "tied": mcfg.tie_word_embeddings,
          "dtype": mcfg.dtype,
          "param_dtype": mcfg.param_dtype,
          "remat_policy": mcfg.remat_policy,
          "params": mcfg.num_params(),
      },
      "batch": n,
      "prompt_len": args.prompt,
      "completion_len": args.completion,
      "tokens_per_step": n * s,
      "group_size": scfg.group_size,
      "chunk_size": scfg.ict.chunk_size,
      "micro_batch": args.micro_batch or n,
      "threads": args.threads,
      "repeats": args.repeats,
      "flops_per_token": mcfg.flops_per_token(s),
      "ours": ours,
  }
  if theirs is not None:
    report["torch"] = theirs
    report["speedup_vs_torch"] = theirs["step_s"] / ours["step_s"]
    report["memory_ratio_vs_torch"] = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
    report["logp_max_abs_diff"] = logp_diff
  if "matmul_2048_gflops" in ours:
    rate = ours["model_tflops_per_s"] * 1e3
    report["fraction_of_jnp_dot_rate"] = rate / ours["matmul_2048_gflops"]
  if ours["backend"] != "cpu" or cfg is not None:
    report["peak_tflops"] = args.peak_tflops
    report["mfu"] = ours["model_tflops_per_s"] / args.peak_tflops
    report["mfu_formula"] = FORMULA
  report["python"] = platform.python_version()
  report["load_avg_1m"] = os.getloadavg()[0]
  print(json.dumps(_rounded(report)))


def _rounded(x):
  """Floats to 4 significant digits, recursively (readable JSON)."""
  if isinstance(x, float):
    return float(f"{x:.4g}")
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_rounded(v) for v in x]
  return x


if __name__ == "__main__":
  main()
