"""GRPO vs 20-Entropy vs STAPO vs ICT on the tiny model and the synthetic task, on CPU.

    python benchmarks/compare_methods.py [--seeds 0,1,2] [--steps 30] [--out benchmarks/compare]

One supervised warm-start (shared by every run, saved as a Hugging Face folder), then for each
method and seed the same RL budget (`--steps` steps of prompts_per_step x G samples) with
`ict_jax.train.train`. Writes `<out>/curves.png` (reward, Shannon entropy, Renyi-2 entropy and
selected fraction over steps: mean and min-max band across seeds), `<out>/table.md` (final
pass@1 / pass@4 on the held-out test split, n=4 samples per problem, mean +- std over seeds),
`<out>/results.json`, and prints a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/ict_jax_bench_jax_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ict_jax import config as config_lib  # noqa: E402
from ict_jax.logs import read_log  # noqa: E402

METHODS = ("grpo", "entropy", "stapo", "ict")
CURVES = (("reward_mean", "reward"), ("entropy", "Shannon entropy (nats)"),
          ("renyi2", "Renyi-2 entropy H2 (nats)"), ("selected_frac", "selected fraction"))


def warm_started_hf(out: str, steps: int) -> str:
  """Run the tiny default's supervised warm-start once and save it as an HF folder."""
  from ict_jax.models.hf import save_pretrained
  from ict_jax.setup import abstract_params, make_mesh, model_config
  from ict_jax.tokenizer import Tokenizer
  from ict_jax.train import init_params, load_examples, warm_start
  hf_dir = os.path.join(out, "warm_start_hf")
  if os.path.exists(os.path.join(hf_dir, "config.json")):
    return hf_dir
  c = config_lib.tiny_config()
  c.warm_start.sft_steps = steps
  cfg = config_lib.validate(c)
  mesh = make_mesh(cfg)
  mcfg = model_config(cfg, "")
  graphdef, _, psh = abstract_params(mcfg, mesh)
  params = init_params(mcfg, cfg.train.seed, mesh, psh)
  params = warm_start(graphdef, params, cfg, Tokenizer(), load_examples(cfg, "train", out), mesh)
  save_pretrained(nnx.merge(graphdef, params), hf_dir)
  return hf_dir


def run_one(method: str, seed: int, hf_dir: str, out: str, steps: int) -> dict:
  from ict_jax.data import load_split
  from ict_jax.eval.loading import load_workdir
  from ict_jax.eval.run import evaluate
  from ict_jax.tokenizer import Tokenizer
  from ict_jax.train import train
  workdir = os.path.join(out, "runs", f"{method}_seed{seed}")
  c = config_lib.tiny_config()
  c.ict.method = method
  c.train.seed = seed
  c.train.steps = steps
  c.train.checkpoint_every = steps
  c.warm_start.sft_steps = 0
  c.data.data_dir = os.path.join(out, "data")
  t0 = time.perf_counter()
  history = train(c, workdir, init_from_hf=hf_dir, progress=False)
  if len(history) < steps:  # resumed from a finished run: read the log instead
    history = read_log(workdir, "metrics")
  train_s = time.perf_counter() - t0
  loaded, mesh = load_workdir(workdir)
  test = load_split("synthetic_arith", "test", data_dir=c.data.data_dir, config="level1")
  res = evaluate(loaded.model, Tokenizer(), [test[i] for i in range(len(test))], answer_type="answer",
                 n=4, ks=(1, 4), max_new_tokens=c.rollout.max_new_tokens, temperature=1.0,
                 prompt_style="plain", rng=jax.random.key(1000 + seed), mesh=mesh, batch_size=20)
  return {"method": method, "seed": seed, "train_s": train_s,
          "curves": {k: [h[k] for h in history] for k, _ in CURVES},
          "pass@1": res["pass@1"], "pass@4": res["pass@4"]}


def plot(results: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
  colors = {"grpo": "tab:blue", "entropy": "tab:orange", "stapo": "tab:green", "ict": "tab:red"}
  names = {"grpo": "GRPO", "entropy": "20-Entropy", "stapo": "STAPO", "ict": "ICT"}
  for ax, (key, label) in zip(axes, CURVES):
    for m in METHODS:
      runs = np.array([r["curves"][key] for r in results if r["method"] == m])
      if not len(runs):
        continue
      x = np.arange(1, runs.shape[1] + 1)
      ax.plot(x, runs.mean(0), color=colors[m], label=names[m])
      ax.fill_between(x, runs.min(0), runs.max(0), color=colors[m], alpha=0.15)
    ax.set_xlabel("RL step")
    ax.set_title(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle("tiny Qwen2, synthetic addition: mean and min-max over seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
  lines = ["| method | pass@1 | pass@4 | final reward (last 5 steps) | entropy (last 5) |",
           "|---|---|---|---|---|"]
  for m in METHODS:
    rs = [r for r in results if r["method"] == m]
    if not rs:
      continue
    cell = lambda v: f"{np.mean(v):.3f} +- {np.std(v):.3f}"
    lines.append(f"| {m} | {cell([r['pass@1'] for r in rs])} | {cell([r['pass@4'] for r in rs])} | "
                 f"{cell([np.mean(r['curves']['reward_mean'][-5:]) for r in rs])} | "
                 f"{cell([np.mean(r['curves']['entropy'][-5:]) for r in rs])} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--sft_steps", type=int, default=config_lib.tiny_config().warm_start.sft_steps)
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--out", default="benchmarks/compare")
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  t0 = time.perf_counter()
  hf_dir = warm_started_hf(a.out, a.sft_steps)
  results = [run_one(m, int(s), hf_dir, a.out, a.steps)
             for s in a.seeds.split(",") for m in a.methods.split(",")]
  plot(results, os.path.join(a.out, "curves.png"))
  md = table(results)
  with open(os.path.join(a.out, "table.md"), "w") as f:
    f.write(md)
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump(results, f)
  summary = {"seconds": time.perf_counter() - t0, "steps": a.steps, "seeds": a.seeds,
             "final": {m: {k: float(np.mean([r[k] for r in results if r["method"] == m]))
                           for k in ("pass@1", "pass@4")} for m in a.methods.split(",")}}
  print(md)
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
