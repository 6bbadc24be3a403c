"""Generation throughput: `ict_jax.generate` vs `transformers` `generate`, same weights, same run.

Model: vocab 151936, hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 704, tied head (the "bench"
preset), float32, random weights (transformers' init, saved with `save_pretrained`, loaded by ours).
Batch 8, prompt 64 (left-padded, 48..64 real tokens), 128 new tokens, EOS disabled so both generate
exactly 128 tokens per row. Both libraries get the same CPUs: the process is pinned to the first
`--threads` cores (`os.sched_setaffinity`, like `taskset`), which sizes XLA's CPU thread pool, and
torch gets `torch.set_num_threads(--threads)`. Warm-up runs are excluded from the timings; our
first call's compile time is reported separately.

    python benchmarks/sampling.py [--threads 2] [--repeats 3] [--modes greedy,sample] [--kernels auto]

`--kernels` is `model.kernels`: "auto" resolves to "cpu" here (one CPU device: the XLA:CPU
formulations of `ict_jax/cpu_paths.py`); "portable" times what TPU/GPU run, on this CPU.

Prints one JSON object: tokens/s of each (best of --repeats interleaved runs: ours, theirs, ours,
...), the ratio, every run's seconds, our compile time, settings.

The decode step against its physical floor: our step time is (best time for --new tokens - best
time for --new / 2 + 1 tokens) / the difference (the same compiled program: the number of new
tokens is a runtime input), so prefill and compile drop out. The floor is the step's
multiply-adds at this machine's float32 FMA rate, measured in the same run by
`benchmarks/fma_rate.py` (a C loop of independent FMAs, one process per pinned core; measured
between the runs, best of the run, so it sees the same background load):
`head_floor_ms` counts the tied LM head alone (batch x hidden x vocab MACs, the goal's
definition), `matmul_floor_ms` adds the decoder layers' weight MACs. `head_floor_fraction` =
head_floor_ms / step_ms (goal >= 0.85).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere


def _pin(threads: int) -> list[int]:
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) > threads:
    os.sched_setaffinity(0, cpus[:threads])
  return sorted(os.sched_getaffinity(0))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--modes", default="greedy,sample", help="greedy and/or sample (temperature 1)")
  ap.add_argument("--kernels", default="auto", choices=("auto", "portable", "cpu"), help="model.kernels")
  args = ap.parse_args()
  cpus = _pin(args.threads)  # before jax / torch create their thread pools
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  import ict_jax
  from ict_jax.models.config import Qwen2Config
  from ict_jax.sampling import bucket_length
  from ict_jax.setup import resolve_kernels
  from benchmarks.fma_rate import fma_gflops

  torch.set_num_threads(args.threads)
  cfg = Qwen2Config.preset("bench")
  hf_cfg = transformers.Qwen2Config(
      **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type", "torch_dtype")}
  )
  torch.manual_seed(0)
  hf = transformers.Qwen2ForCausalLM(hf_cfg).eval().float()
  with tempfile.TemporaryDirectory() as tmp:
    hf.save_pretrained(tmp)
    model = ict_jax.load_pretrained(tmp, dtype=jnp.float32, kernels=resolve_kernels(args.kernels))

  rng = np.random.RandomState(0)
  b, p, n = args.batch, args.prompt, args.new
  ids = rng.randint(0, cfg.vocab_size, (b, p)).astype(np.int32)
  lengths = rng.randint(p * 3 // 4, p + 1, b)
  mask = (np.arange(p)[None, :] >= p - lengths[:, None]).astype(np.int32)
  ids[mask == 0] = 0
  t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

  def run_hf(sample: bool, new: int):
    kw = {"do_sample": sample}
    if sample:  # plain temperature-1 sampling, like ours (transformers defaults top_k to 50)
      kw.update(temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
      out = hf.generate(
          input_ids=t_ids,
          attention_mask=t_mask,
          max_new_tokens=new,
          min_new_tokens=new,
          eos_token_id=None,
          pad_token_id=0,
          **kw,
      )
    assert out.shape == (b, p + new), out.shape
    return out

  def run_ours(sample: bool, seed: int, new: int = n):
    out = ict_jax.generate(
        model,
        ids,
        mask,
        max_new_tokens=new,
        temperature=1.0 if sample else 0.0,
        rng=jax.random.key(seed),
        eos_token_ids=(),
        pad_id=0,
    )
    jax.block_until_ready(out)
    assert out[0].shape == (b, new) and int(out[1].sum()) == b * new
    return out

  half = n // 2 + 1  # same length bucket as n: the same compiled program
  assert bucket_length(half) == bucket_length(n), (half, n)
  d, v, f, layers = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_hidden_layers
  qkvo = d * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
  head_macs = b * d * v
  matmul_macs = head_macs + b * layers * (qkvo + 3 * d * f)
  fma_all = [fma_gflops(args.threads)]  # measured again in every repeat: best of the run

  results = {}
  for mode in args.modes.split(","):
    sample = mode == "sample"
    t = time.perf_counter()
    first = run_ours(sample, 100)
    first_s = time.perf_counter() - t
    run_hf(sample, 4)  # warm-up
    ours_all, hf_all, half_all = [], [], []
    for i in range(args.repeats):  # interleaved, so both see the same background load
      t = time.perf_counter()
      run_ours(sample, i)
      ours_all.append(time.perf_counter() - t)
      t = time.perf_counter()
      run_ours(sample, i, half)
      half_all.append(time.perf_counter() - t)
      fma_all.append(fma_gflops(args.threads, repeats=1))
      t = time.perf_counter()
      run_hf(sample, n)
      hf_all.append(time.perf_counter() - t)
    ours_s, hf_s = min(ours_all), min(hf_all)
    entry = {
        "ours_tokens_per_s": round(b * n / ours_s, 1),
        "transformers_tokens_per_s": round(b * n / hf_s, 1),
        "speedup": round(hf_s / ours_s, 2),
        "ours_s": [round(x, 3) for x in ours_all],
        "transformers_s": [round(x, 3) for x in hf_all],
        "ours_compile_s": round(first_s - ours_s, 2),
    }
    step_s = (ours_s - min(half_all)) / (n - half)
    fma = None if fma_all[0] is None else max(fma_all)
    entry["decode_step_ms"] = round(1e3 * step_s, 2)
    if fma:
      entry["head_floor_ms"] = round(2e3 * head_macs / (fma * 1e9), 2)
      entry["matmul_floor_ms"] = round(2e3 * matmul_macs / (fma * 1e9), 2)
      entry["head_floor_fraction"] = round(2 * head_macs / (fma * 1e9) / step_s, 3)
    if not sample:  # same greedy tokens (float32 round-off can flip a near-tie, so reported only)
      ref = run_hf(False, n)[:, p:].numpy()
      entry["greedy_tokens_equal_fraction"] = float((np.asarray(first[0]) == ref).mean())
    results[mode] = entry

  print(
      json.dumps(
          {
              "benchmark": "sampling",
              "batch": b,
              "prompt_len": p,
              "new_tokens": n,
              "dtype": "float32",
              "model": {
                  "vocab": cfg.vocab_size,
                  "hidden": cfg.hidden_size,
                  "layers": cfg.num_hidden_layers,
                  "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads,
                  "mlp": cfg.intermediate_size,
                  "tied": cfg.tie_word_embeddings,
              },
              "threads": args.threads,
              "kernels": model.cfg.kernels,
              "cpus": cpus,
              "repeats": args.repeats,
              "fma_gflops": None if fma_all[0] is None else round(max(fma_all), 1),
              "load_average": [round(x, 2) for x in os.getloadavg()],
              "results": results,
              "versions": {
                  "jax": jax.__version__,
                  "torch": torch.__version__,
                  "transformers": transformers.__version__,
                  "python": platform.python_version(),
              },
          },
          indent=2,
      )
  )


if __name__ == "__main__":
  main()
