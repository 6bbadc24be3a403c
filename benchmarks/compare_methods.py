"""GRPO vs 20-Entropy vs STAPO vs ICT, plus an ICT ablation sweep, on synthetic_chain, on CPU.

    python benchmarks/compare_methods.py [--seeds 0,1,2,3,4] [--steps 60] [--out benchmarks/compare]
        [--methods grpo,entropy,stapo,ict] [--ablations score=kl,score=random,top_fraction=0.3,...]

The tiny model on synthetic_chain level 1 (`config.chain_config()`, the default run's configs/tiny.py). One
supervised warm-start (shared by every run, saved as a Hugging Face folder), then for each
variant and seed the same RL budget (`--steps` steps of the default's prompts x G samples) with
`ict_jax.train.train`, and a final evaluation on held-out problems with the trainer's periodic
evaluation (`train.eval_every = steps`: pass@1 and pass@4 over `--eval_prompts` problems of the
test split, 4 samples each, at the rollout temperature; the same key for every run). A variant is
a method (`grpo`, `entropy`, `stapo`, `ict`) or an ICT ablation `key=value[+key=value]` over
`ict.score`, `ict.keep`, `ict.top_fraction`, `ict.reference` (e.g. `top_fraction=0.9+keep=frequent`).

The warm-start itself is evaluated the same way once per seed (the row "warm-start (no RL)"), so
the table also gives each variant's paired change over its starting point.

Every finished run writes `<out>/runs/<variant>_seed<s>/result.json` and is not run again, so an
interrupted sweep resumes; `--report` only rebuilds the report from the finished runs. Writes
`<out>/table.md` (pass@1 / pass@4: mean, std, min-max over seeds, and the paired differences to
ICT and to the warm-start on the same seeds), `<out>/curves.png` (reward, Shannon entropy, Renyi-2
entropy and selected fraction over steps: mean and min-max band across seeds, methods only),
`<out>/results.json`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/ict_jax_bench_jax_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ict_jax import config as config_lib  # noqa: E402
from ict_jax.logs import read_log  # noqa: E402

METHODS = ("grpo", "entropy", "stapo", "ict")
NAMES = {"grpo": "GRPO", "entropy": "20-Entropy", "stapo": "STAPO", "ict": "ICT", "warm-start": "warm-start (no RL)"}
BASELINE = "warm-start"  # the shared warm-start itself, evaluated with each seed's key
ABLATIONS = (
    "score=kl",
    "score=entropy",
    "score=random",
    "top_fraction=0.2",
    "top_fraction=0.3",
    "top_fraction=0.9+keep=frequent",
    "reference=sequence_mean",
)
ABLATION_KEYS = {"score": str, "keep": str, "top_fraction": float, "reference": str}
CURVES = (
    ("reward_mean", "reward"),
    ("entropy", "Shannon entropy (nats)"),
    ("renyi2", "Renyi-2 entropy H2 (nats)"),
    ("selected_frac", "selected fraction"),
)
KS = (1, 4)


def parse_variant(variant: str) -> dict:
  """ "ict" / "grpo" / ... -> {"method": ...}; "score=kl+top_fraction=0.2" -> ICT with those keys."""
  if variant in METHODS:
    return {"method": variant}
  out = {"method": "ict"}
  for part in variant.split("+"):
    key, sep, value = part.partition("=")
    if not sep or key not in ABLATION_KEYS:
      raise ValueError(
          f"bad variant {variant!r}: expected a method {METHODS} or key=value with key in " f"{sorted(ABLATION_KEYS)}"
      )
    out[key] = ABLATION_KEYS[key](value)
  return out


def base_config(steps: int, data_dir: str, eval_prompts: int):
  c = config_lib.chain_config()
  # the comparison's "ICT" is the paper's top 10%; the default run's 30% (chain_config) is the
  # `top_fraction=0.3` ablation
  c.ict.top_fraction = 0.1
  c.train.steps = steps
  c.train.checkpoint_every = steps
  c.train.eval_every, c.train.eval_samples, c.train.eval_prompts = steps, max(KS), eval_prompts
  c.data.data_dir = data_dir
  return c


def _override(c, overrides: dict | None) -> None:
  """Apply `--set` overrides ({"section.key": value}) to the config `c` in place."""
  for key, value in (overrides or {}).items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)


def warm_started_hf(out: str, steps: int, overrides: dict | None = None) -> str:
  """Run chain_config()'s supervised warm-start once and save it as an HF folder (with its
  task_vocab.json: the folder's tokenizer, which every run from it uses)."""
  from flax import nnx
  from ict_jax.models.hf import save_pretrained
  from ict_jax.setup import abstract_params, make_mesh, make_tokenizer, model_config
  from ict_jax.train import init_params, load_examples, warm_start

  hf_dir = os.path.join(out, "warm_start_hf")
  if os.path.exists(os.path.join(hf_dir, "config.json")):
    return hf_dir
  c = config_lib.chain_config()
  _override(c, overrides)  # e.g. model.vocab=qwen: the shared warm-start is that model's
  c.warm_start.sft_steps = steps
  c.data.data_dir = os.path.join(out, "data")
  cfg = config_lib.validate(c)
  mesh = make_mesh(cfg)
  tok = make_tokenizer(cfg, hf_dir, "", lambda split: load_examples(cfg, split, out))  # saved in hf_dir
  mcfg = model_config(cfg, "", mesh, tok)
  graphdef, _, psh = abstract_params(mcfg, mesh)
  params = init_params(mcfg, cfg.train.seed, mesh, psh)
  params = warm_start(graphdef, params, cfg, tok, load_examples(cfg, "train", out), mesh)
  save_pretrained(nnx.merge(graphdef, params), hf_dir)
  return hf_dir


def run_one(
    variant: str, seed: int, hf_dir: str, out: str, steps: int, eval_prompts: int, overrides: dict | None = None
) -> dict:
  from ict_jax.train import train

  workdir = os.path.join(out, "runs", f"{variant}_seed{seed}")
  done = os.path.join(workdir, "result.json")
  if os.path.exists(done):
    return json.load(open(done))
  c = base_config(steps, os.path.join(out, "data"), eval_prompts)
  for key, value in parse_variant(variant).items():
    setattr(c.ict, key, value)
  _override(c, overrides)
  c.train.seed = seed
  c.warm_start.sft_steps = 0
  t0 = time.perf_counter()
  train(c, workdir, init_from_hf=hf_dir, progress=False)
  history = read_log(workdir, "metrics")
  last = history[-1]
  result = {
      "variant": variant,
      "seed": seed,
      "steps": len(history),
      "train_s": time.perf_counter() - t0,
      "curves": {k: [h[k] for h in history] for k, _ in CURVES},
      **{f"pass@{k}": last[f"eval_pass_at_{k}"] for k in KS},
  }
  with open(done, "w") as f:
    json.dump(result, f)
  return result


def baseline_one(seed: int, hf_dir: str, out: str, eval_prompts: int, overrides: dict | None = None) -> dict:
  """The warm-start before any RL step, evaluated exactly as a run's final evaluation (the same
  problems, samples and key: `PeriodicEval` of the run's config with `train.seed = seed`), so
  each method's paired change over the starting point can be read off the table."""
  import jax.numpy as jnp
  from flax import nnx
  from ict_jax.eval.periodic import PeriodicEval
  from ict_jax.models.hf import load_pretrained
  from ict_jax.rewards.pool import RewardPool
  from ict_jax.setup import make_mesh
  from ict_jax.task_vocab import load_tokenizer
  from ict_jax.train import load_examples

  workdir = os.path.join(out, "runs", f"{BASELINE}_seed{seed}")
  done = os.path.join(workdir, "result.json")
  if os.path.exists(done):
    return json.load(open(done))
  c = base_config(1, os.path.join(out, "data"), eval_prompts)
  _override(c, overrides)
  c.train.seed = seed
  cfg = config_lib.validate(c)
  mesh = make_mesh(cfg)
  model = load_pretrained(hf_dir, jnp.dtype(cfg.model.dtype), mesh=mesh)
  graphdef, params = nnx.split(model, nnx.Param)
  ev = PeriodicEval.from_config(cfg, load_tokenizer(hf_dir), load_examples(cfg, cfg.data.eval_split, out), mesh=mesh)
  with RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool:
    res = ev((graphdef, params.to_pure_dict()), pool)
  result = {"variant": BASELINE, "seed": seed, "steps": 0, **{f"pass@{k}": res[f"eval_pass_at_{k}"] for k in KS}}
  os.makedirs(workdir, exist_ok=True)
  with open(done, "w") as f:
    json.dump(result, f)
  return result


def _paired(runs: dict, other: dict, k: int) -> dict | None:
  """mean / std of runs[s] - other[s] in pass@k over the seeds both have (None if none)."""
  common = sorted(set(runs) & set(other))
  if not common:
    return None
  d = np.array([runs[s][f"pass@{k}"] - other[s][f"pass@{k}"] for s in common])
  return {"mean": float(d.mean()), "std": float(d.std(ddof=1)) if len(d) > 1 else 0.0, "n": len(common)}


def summarize(results: list[dict]) -> dict[str, dict]:
  """Per variant: seeds, mean / std / min / max of pass@k, the paired difference to ICT (variant
  minus ICT on the seeds both have) and the paired change over the warm-start (variant minus the
  warm-start evaluated with the same seed's key)."""
  by = {}
  for r in results:
    by.setdefault(r["variant"], {})[r["seed"]] = r
  ict, base = by.get("ict", {}), by.get(BASELINE, {})
  out = {}
  for variant, runs in by.items():
    row = {"seeds": sorted(runs)}
    for k in KS:
      v = np.array([runs[s][f"pass@{k}"] for s in sorted(runs)])
      row[f"pass@{k}"] = {
          "mean": float(v.mean()),
          "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          "min": float(v.min()),
          "max": float(v.max()),
      }
      for name, ref, skip in ((f"diff@{k}", ict, "ict"), (f"gain@{k}", base, BASELINE)):
        d = None if variant == skip else _paired(runs, ref, k)
        if d is not None:
          row[name] = d
    out[variant] = row
  return out


def table(summary: dict[str, dict]) -> str:
  """Markdown: the warm-start, the methods, then the ablations; values in percent."""
  head = (
      ["variant", "seeds"]
      + [f"pass@{k} mean ± std [min, max]" for k in KS]
      + [f"pass@{k} − ICT (paired)" for k in KS]
      + [f"pass@{k} − warm-start (paired)" for k in KS]
  )
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  order = [v for v in (BASELINE, *METHODS) if v in summary]
  order += sorted(v for v in summary if v not in order)
  for v in order:
    row = summary[v]
    cells = [NAMES.get(v, f"ICT {v}"), str(len(row["seeds"]))]
    for k in KS:
      p = row[f"pass@{k}"]
      cells.append(f"{100 * p['mean']:.1f} ± {100 * p['std']:.1f} [{100 * p['min']:.1f}, {100 * p['max']:.1f}]")
    for name in [f"diff@{k}" for k in KS] + [f"gain@{k}" for k in KS]:
      d = row.get(name)
      cells.append("–" if d is None else f"{100 * d['mean']:+.1f} ± {100 * d['std']:.1f} (n={d['n']})")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
  colors = {"grpo": "tab:blue", "entropy": "tab:orange", "stapo": "tab:green", "ict": "tab:red"}
  for ax, (key, label) in zip(axes, CURVES):
    for m in METHODS:
      runs = [r["curves"][key] for r in results if r["variant"] == m]
      if not runs:
        continue
      n = min(map(len, runs))
      runs = np.array([r[:n] for r in runs])
      x = np.arange(1, n + 1)
      ax.plot(x, runs.mean(0), color=colors[m], label=f"{NAMES[m]} ({len(runs)} seeds)")
      ax.fill_between(x, runs.min(0), runs.max(0), color=colors[m], alpha=0.15)
    ax.set_xlabel("RL step")
    ax.set_title(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def report(out: str, title: str) -> dict:
  results = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "runs", "*", "result.json")))]
  if not results:
    raise SystemExit(f"no finished runs under {out}/runs")
  summary = summarize(results)
  md = table(summary)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(md)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"summary": summary, "runs": results}, f)
  plot(results, os.path.join(out, "curves.png"), title)
  print(md)
  return summary


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2,3,4")
  p.add_argument("--ablation_seeds", default="", help="seeds of the ablations (default: --seeds)")
  p.add_argument("--steps", type=int, default=config_lib.chain_config().train.steps)
  p.add_argument("--sft_steps", type=int, default=config_lib.chain_config().warm_start.sft_steps)
  p.add_argument("--eval_prompts", type=int, default=200, help="held-out problems evaluated")
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--ablations", default=",".join(ABLATIONS), help="'' for none")
  p.add_argument("--set", default="", help="extra config overrides, e.g. rollout.prompts_per_step=4")
  p.add_argument("--out", default="benchmarks/compare")
  p.add_argument("--report", action="store_true", help="only rebuild the report from finished runs")
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  title = "tiny Qwen2 on synthetic_chain: mean and min-max over seeds"
  if not a.report:
    overrides = {}
    for kv in filter(None, a.set.split(",")):
      key, value = kv.split("=")
      section, name = key.split(".")
      old = getattr(getattr(config_lib.chain_config(), section), name)
      if isinstance(old, bool) and value not in ("True", "False"):
        p.error(f"--set {key}: expected True or False, got {value!r}")
      overrides[key] = value == "True" if isinstance(old, bool) else type(old)(value)
    hf_dir = warm_started_hf(a.out, a.sft_steps, overrides)
    seeds = [int(s) for s in a.seeds.split(",")]
    ab_seeds = [int(s) for s in (a.ablation_seeds or a.seeds).split(",")]
    variants = [(m, s) for s in seeds for m in a.methods.split(",") if m]
    variants += [(v, s) for s in ab_seeds for v in a.ablations.split(",") if v]
    for v, _ in variants:
      parse_variant(v)  # fail before any run
    for s in seeds:
      r = baseline_one(s, hf_dir, a.out, a.eval_prompts, overrides)
      print(json.dumps({"variant": BASELINE, "seed": s, "pass@1": r["pass@1"], "pass@4": r["pass@4"]}), flush=True)
    for v, s in variants:
      t0 = time.perf_counter()
      r = run_one(v, s, hf_dir, a.out, a.steps, a.eval_prompts, overrides)
      print(
          json.dumps(
              {
                  "variant": v,
                  "seed": s,
                  "pass@1": r["pass@1"],
                  "pass@4": r["pass@4"],
                  "s": round(time.perf_counter() - t0, 1),
              }
          ),
          flush=True,
      )
  return report(a.out, title)


if __name__ == "__main__":
  main()
