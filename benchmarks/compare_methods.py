"""GRPO vs 20-Entropy vs STAPO vs ICT, each at its own learning rate, pass@k to k=64, on CPU.

    python benchmarks/compare_methods.py            # the full sweep (--dry_run: its plan and CPU time)
        [--settings level1,level4,steps] [--seeds 0,...,7] [--lrs 1e-4,2e-4,3e-4,5e-4]
        [--methods grpo,entropy,stapo,ict] [--ablations score=kl,...] [--steps 800] [--out DIR]

The tiny model on `synthetic_chain` (`configs.chain_config()`, the default run), in three settings
(`SETTINGS`): level 1 rewarded on the boxed answer (the default run's task), level 4 (+ and -,
operands 0..9: harder) and level 1 rewarded by the `chain_steps` verifier (every worked step and
the box must be right). Per setting, under `<out>/<setting>/`:

1. Splits. The first `--val_prompts` problems of the training split are VALIDATION problems: held
   out of the warm-start and of RL (which see `train[V:]`), drawn from the training distribution
   and disjoint from the test split, which only step 3 reads.
2. Each method at its own lr. One supervised warm-start (shared by every run, saved as a Hugging
   Face folder); then for each method, each lr of `--lrs` and each selection seed the same RL
   budget (`--steps` steps) with `ict_jax.train.train`, ending on validation (`--val_samples`
   samples a problem; `validate_one` evaluates the final checkpoint again with the run's periodic
   eval key, for pass@4). A method's lr is the grid's argmax of its validation pass@4 (the paper's
   metric; `--select_by pass@1`: the run's last periodic eval, as the committed level1/level4/steps
   sweeps chose) averaged over the selection seeds (ties: the first in the grid); `select_lrs` sees
   validation numbers only, and no test evaluation exists before it has chosen (`sweep`);
   `--validation_only` stops there (`validation.md`, `validation.json`). The ablations
   (`[method+]key=value[+key=value]` over `ict.score`, `ict.keep`, `ict.top_fraction`,
   `ict.reference` for ICT, the default method, and `loss.selected_norm` for any method, e.g.
   `entropy+selected_norm=response`) run at their method's chosen lr; a variant of `--methods`
   (`--methods ict,ict+selected_norm=response`) gets its own lr grid.
3. Held-out test, at the chosen lr only: every seed's final checkpoint samples `--test_samples`
   (64) completions for each of the first `--test_prompts` test problems at the rollout
   temperature, with one key per seed shared by every method and by the warm-start (common random
   numbers); the per-problem correct counts give pass@k for k = 1..n by the unbiased estimator.

Writes `table.md` (per variant: the chosen lr, pass@4/1/16/64 mean ± std [min, max] over seeds (pass@4,
the paper's metric, first), the paired differences to GRPO and to the warm-start on the same seeds at
pass@4/1/64 (mean ± standard error, std / sqrt(n), and the seeds below 0), and the ICT paper's
signature of the selected tokens, `selected_prob` and `selected_high_entropy` (each run's mean over
its steps; "–" for runs from before the metrics), beside the paper's ~0.18 and ~50%; the signature
per JS reference reading; the validation grid; the test problems that no RL run solves, with their
text, the cap they put on pass@64 and pass@64 on the other problems; `benchmarks/compare_tables.py`),
`passk.png` (pass@k for k = 1..64: mean and min-max band over seeds per method), `curves.png`
(reward, entropies and selected fraction over the steps at the chosen lrs) and `results.json`.
Every finished run writes `runs/<variant>_lr<lr>_seed<s>/result.json` (and `test.json`) and is not
run again, so an interrupted sweep resumes; `--report` only rebuilds the reports (from
`results.json` where the runs' files are not there). One process runs
the sweep (XLA uses both cores of a 2-core box); `--dry_run` prints the number of runs and the
expected CPU time (`CPU_S`, measured on a 2-core AMD EPYC box, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import zlib
from typing import NamedTuple

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/ict_jax_bench_jax_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ict_jax import config as config_lib  # noqa: E402
from ict_jax import configs  # noqa: E402
from ict_jax.logs import read_log  # noqa: E402
from benchmarks.compare_tables import (  # noqa: E402,F401  (the tables' names, as before, here too)
    ABLATION_KEYS,
    BASELINE,
    KS,
    LOSS_KEYS,
    METHODS,
    NAMES,
    REFERENCE,
    SIGNATURE,
    order,
    paired,
    parse_variant,
    signature,
    summarize,
    table,
    unsolved_problems,
    select_lrs,
    unsolved_report,
    val_metric,
    validation_report,
    validation_table,
    variant_name,
)

ABLATIONS = (
    "score=kl",
    "score=entropy",
    "score=random",
    "top_fraction=0.2",
    "top_fraction=0.3",
    "top_fraction=0.9+keep=frequent",
    "reference=sequence_mean",
    "reference=others_mean",
)
CURVES = (
    ("reward_mean", "reward"),
    ("entropy", "Shannon entropy (nats)"),
    ("renyi2", "Renyi-2 entropy H2 (nats)"),
    ("selected_frac", "selected fraction"),
)
LRS = (1e-4, 2e-4, 3e-4, 5e-4)
SETTINGS = {
    "level1": {"level": 1, "reward": "answer"},  # the default run's task
    "level4": {"level": 4, "reward": "answer"},  # + and -, operands 0..9
    "steps": {"level": 1, "reward": "chain_steps"},  # every worked step must be right
}
# CPU seconds on the 2-core AMD EPYC box (benchmarks/RESULTS.md, "Each method at its own lr"):
# a warm-start, an RL step (16 prompts x 8) and one test sample (64 a problem)
CPU_S = {"warm_start": 120.0, "rl_step": 0.4, "test_sample": 0.002}


class Setting(NamedTuple):
  """One setting's runs: where they go and what every run of it shares."""

  out: str
  level: int
  reward: str
  steps: int
  val_prompts: int
  val_samples: int
  test_prompts: int
  test_samples: int
  overrides: tuple = ()  # (("section.key", value), ...) from --set

  @property
  def data_dir(self) -> str:
    return os.path.join(os.path.dirname(os.path.normpath(self.out)), "data")  # shared by the settings


def base_config(s: Setting, train_steps: int | None = None):
  """chain_config() at the setting's level and verifier, RL on `train[V:]`, the run's periodic
  evaluation once at the end on the validation problems `train[:V]`."""
  c = configs.chain_config()
  # the comparison's "ICT" is the paper's top 10%; the default run's 30% (chain_config) is the
  # `top_fraction=0.3` ablation
  c.ict.top_fraction = 0.1
  c.data.config, c.reward.kind = f"level{s.level}", s.reward
  c.data.train_split, c.data.eval_split = f"train[{s.val_prompts}:]", f"train[:{s.val_prompts}]"
  steps = s.steps if train_steps is None else train_steps
  c.train.steps = c.train.checkpoint_every = c.train.eval_every = steps
  c.train.eval_samples, c.train.eval_prompts = s.val_samples, s.val_prompts
  c.data.data_dir = s.data_dir
  for key, value in s.overrides:
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  return c


def warm_started_hf(s: Setting, sft_steps: int) -> str:
  """The setting's supervised warm-start on `train[V:]` (never the validation problems), saved
  as an HF folder with its task_vocab.json (built from every split: the folder's tokenizer)."""
  from flax import nnx
  from ict_jax.models.hf import save_pretrained
  from ict_jax.setup import abstract_params, make_mesh, make_tokenizer, model_config
  from ict_jax.build import load_examples, warm_start
  from ict_jax.setup import init_params

  hf_dir = os.path.join(s.out, "warm_start_hf")
  if os.path.exists(os.path.join(hf_dir, "config.json")):
    return hf_dir
  c = base_config(s)
  c.warm_start.sft_steps = sft_steps
  cfg = config_lib.validate(c)
  v = c.copy_and_resolve_references()
  v.data.train_split, v.data.eval_split = "train", "test"  # every problem's tokens
  vocab = config_lib.validate(v)
  mesh = make_mesh(cfg)
  tok = make_tokenizer(vocab, hf_dir, "", lambda split: load_examples(vocab, split, s.out))  # saved in hf_dir
  mcfg = model_config(cfg, "", mesh, tok)
  graphdef, _, psh = abstract_params(mcfg, mesh)
  params = init_params(mcfg, cfg.train.seed, mesh, psh)
  params = warm_start(graphdef, params, cfg, tok, load_examples(cfg, cfg.data.train_split, s.out), mesh)
  save_pretrained(nnx.merge(graphdef, params), hf_dir)
  return hf_dir


def run_dir(s: Setting, variant: str, lr: float | None, seed: int) -> str:
  name = f"{variant}_seed{seed}" if lr is None else f"{variant}_lr{lr:g}_seed{seed}"
  return os.path.join(s.out, "runs", name)


def run_one(s: Setting, variant: str, lr: float, seed: int, hf_dir: str) -> dict:
  """One RL run from the warm-start; its result holds validation pass@1, never a test number."""
  from ict_jax.train import train

  workdir = run_dir(s, variant, lr, seed)
  done = os.path.join(workdir, "result.json")
  if os.path.exists(done):
    return json.load(open(done))
  c = base_config(s)
  for key, value in parse_variant(variant).items():  # ICT's keys and the method: ict.*; the loss's: loss.*
    setattr(c.loss if key in LOSS_KEYS else c.ict, key, value)
  c.optim.learning_rate, c.train.seed, c.warm_start.sft_steps = lr, seed, 0
  t0 = time.perf_counter()
  train(c, workdir, init_from_hf=hf_dir, progress=False)
  history = read_log(workdir, "metrics")
  result = {
      "variant": variant,
      "lr": lr,
      "seed": seed,
      "steps": len(history),
      "train_s": time.perf_counter() - t0,
      "curves": {k: [h.get(k, float("nan")) for h in history] for k, _ in CURVES},
      "val_pass@1": history[-1]["eval_pass_at_1"],
      "signature": signature(history),
  }
  with open(done, "w") as f:
    json.dump(result, f)
  return result


def test_one(s: Setting, variant: str, lr: float | None, seed: int, hf_dir: str) -> dict:
  """The held-out test of a run's final checkpoint (the warm-start itself for BASELINE):
  `test_samples` completions of each of the first `test_prompts` test problems, with the seed's
  key; keeps the per-problem correct counts."""
  import jax
  import jax.numpy as jnp
  from ict_jax.data.prompts import MATH_INSTRUCTION
  from ict_jax.eval.loading import load_workdir
  from ict_jax.eval.run import evaluate
  from ict_jax.models.hf import load_pretrained
  from ict_jax.rewards.pool import RewardPool
  from ict_jax.setup import make_mesh
  from ict_jax.task_vocab import load_tokenizer
  from ict_jax.build import load_examples

  workdir = run_dir(s, variant, lr, seed)
  done = os.path.join(workdir, "test.json")
  if os.path.exists(done):
    return json.load(open(done))
  cfg = config_lib.validate(base_config(s, train_steps=1))
  if variant == BASELINE:
    mesh = make_mesh(cfg)
    model = load_pretrained(hf_dir, jnp.dtype(cfg.model.dtype), mesh=mesh)
  else:
    loaded, mesh = load_workdir(workdir)
    model = loaded.model
  source = load_examples(cfg, "test", s.out)
  examples = [source[i] for i in range(min(len(source), s.test_prompts))]
  key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(b"compare_methods test") & 0x7FFFFFFF)
  with RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool:
    res = evaluate(
        model,
        load_tokenizer(hf_dir),
        examples,
        answer_type=cfg.reward.kind,
        n=s.test_samples,
        ks=(1,),
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        prompt_style=cfg.data.prompt_style,
        instruction=MATH_INSTRUCTION,  # as the rollouts' chat prompts
        rng=key,
        mesh=mesh,
        reward_pool=pool,
        batch_size=max(1, min(len(examples), 8)),
        max_prompt_len=cfg.data.max_prompt_len,
    )
  counts = [p["num_correct"] for p in res["per_problem"]]
  result = {"variant": variant, "lr": lr, "seed": seed, "n": s.test_samples, "counts": counts, "test_s": res["seconds"]}
  os.makedirs(workdir, exist_ok=True)
  with open(done, "w") as f:
    json.dump(result, f)
  return result


def validate_one(s: Setting, variant: str, lr: float, seed: int, hf_dir: str) -> dict:
  """A finished run's result.json with "val": its final checkpoint's validation pass@1, pass@4 (the
  paper's metric) and pass@`val_samples` on the validation problems `train[:V]`, by the run's own
  periodic eval (same problems, samples and key), evaluated again from the checkpoint. One code
  path for every run of a grid, including runs trained before the periodic eval reported pass@4."""
  from ict_jax.eval.loading import load_workdir
  from ict_jax.eval.periodic import PREFIX, PeriodicEval
  from ict_jax.rewards.pool import RewardPool
  from ict_jax.task_vocab import load_tokenizer
  from ict_jax.build import load_examples

  done = os.path.join(run_dir(s, variant, lr, seed), "result.json")
  result = json.load(open(done))
  if "val" in result:
    return result
  c = base_config(s)
  c.train.seed = seed  # the periodic eval's key
  cfg = config_lib.validate(c)
  loaded, mesh = load_workdir(os.path.dirname(done))
  ev = PeriodicEval.from_config(cfg, load_tokenizer(hf_dir), load_examples(cfg, cfg.data.eval_split, s.out), mesh=mesh)
  with RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool:
    metrics = ev(loaded.model, reward_pool=pool)
  result["val"] = {k[len(PREFIX) :].replace("_at_", "@"): v for k, v in metrics.items() if "_at_" in k}
  with open(done, "w") as f:
    json.dump(result, f)
  return result


def sweep(
    methods, ablations, lrs, seeds, selection_seeds, ablation_seeds, run, test, log=print, select_by="pass@1",
    validation_only=False,
) -> dict:  # fmt: skip
  """The order that keeps the test out of the choice: every validation run, then `select_lrs` (by
  validation `select_by`), then the chosen-lr runs of the other seeds and, only now, the test
  evaluations (none with `validation_only`: the lrs are chosen, the test budget not yet spent).
  `run(variant, lr, seed) -> validation record`, `test(variant, lr, seed) -> test record`."""
  validation = [run(m, lr, sd) for m in methods for lr in lrs for sd in selection_seeds]
  for r in validation:
    log({**{k: r[k] for k in ("variant", "lr", "seed")}, f"val_{select_by}": val_metric(r, select_by)})
  chosen = select_lrs(validation, lrs, selection_seeds, select_by)
  for v in ablations:  # each at its method's chosen lr (ICT's for ICT's ablations)
    method = parse_variant(v)["method"]
    if method not in chosen:
      raise ValueError(f"the ablation {v} runs at {method}'s chosen lr: add {method} to --methods")
    chosen[v] = chosen[method]
  log({"chosen_lr": chosen})
  if validation_only:
    return chosen
  tests = [test(BASELINE, None, sd) for sd in seeds]
  for variant in [*methods, *ablations]:
    for sd in ablation_seeds if variant in ablations else seeds:
      run(variant, chosen[variant], sd)
      tests.append(test(variant, chosen[variant], sd))
  for r in tests:
    log(
        {"variant": r["variant"], "lr": r["lr"], "seed": r["seed"], "test_pass@1": float(np.mean(r["counts"])) / r["n"]}
    )
  return chosen


COLORS = {"grpo": "tab:blue", "entropy": "tab:orange", "stapo": "tab:green", "ict": "tab:red", BASELINE: "tab:gray"}


def plot_passk(summary: dict[str, dict], path: str, title: str) -> None:
  """pass@k against k (log scale) per method and the warm-start: mean and min-max band over seeds."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v in (BASELINE, *METHODS):
    if v not in summary:
      continue
    curves = np.array(summary[v]["curve"])
    k = np.arange(1, curves.shape[1] + 1)
    lr = "" if summary[v]["lr"] is None else f", lr {summary[v]['lr']:g}"
    ax.plot(k, curves.mean(0), color=COLORS[v], label=f"{NAMES[v]} ({len(curves)} seeds{lr})")
    ax.fill_between(k, curves.min(0), curves.max(0), color=COLORS[v], alpha=0.15)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("k (samples per problem)")
  ax.set_ylabel("pass@k (held-out test)")
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_curves(runs: list[dict], path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
  for ax, (key, label) in zip(axes, CURVES):
    for m in METHODS:
      curves = [r["curves"][key] for r in runs if r["variant"] == m]
      if not curves:
        continue
      n = min(map(len, curves))
      curves = np.array([c[:n] for c in curves], dtype=np.float64)
      x = np.arange(1, n + 1)
      ax.plot(x, np.nanmean(curves, 0), color=COLORS[m], label=f"{NAMES[m]} ({len(curves)} seeds)")
      ax.fill_between(x, np.nanmin(curves, 0), np.nanmax(curves, 0), color=COLORS[m], alpha=0.15)
    ax.set_xlabel("RL step")
    ax.set_title(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _load(out: str) -> tuple[list[dict], list[dict], dict, bool]:
  """(validation records, test records, chosen lrs, from_runs): the runs' files under `out`/runs, or,
  where no run's test.json is there (a checkout of the committed sweep), `out`/results.json. A run's
  result.json written before it carried the signature gets it from the run's metrics log, if any."""

  def load(name):
    return [(p, json.load(open(p))) for p in sorted(glob.glob(os.path.join(out, "runs", "*", name)))]

  validation = [
      r if "signature" in r else {**r, "signature": signature(read_log(os.path.dirname(p)))}
      for p, r in load("result.json")
  ]
  tests = [r for _, r in load("test.json")]
  chosen_path, saved = os.path.join(out, "chosen_lr.json"), os.path.join(out, "results.json")
  if tests and os.path.exists(chosen_path):
    return validation, tests, json.load(open(chosen_path)), True
  if os.path.exists(saved):
    results = json.load(open(saved))
    return results["validation"], results["tests"], results["chosen_lr"], False
  raise SystemExit(f"no test results under {out}/runs (or no {chosen_path}), no {saved}: nothing to report")


def problem_texts(s: Setting):
  """index -> the setting's test problem i as the test saw it (`test_one`'s order), loaded once."""
  from ict_jax.build import load_examples

  cache: list = []

  def text(i: int) -> str:
    if not cache:
      cache.append(load_examples(config_lib.validate(base_config(s, train_steps=1)), "test", s.out))
    ex = cache[0][i]
    return f"`{ex['prompt']}` (answer {ex['answer']}, `{ex['solution']}`)"

  return text


def report(out: str, title: str, texts=None) -> dict:
  """Rebuilds table.md (the test table, the signature, the problems no RL run solves with their
  text from `texts`, index -> str), results.json and the figures (curves.png only from runs that
  kept their curves)."""
  validation, tests, chosen, from_runs = _load(out)
  summary = summarize(tests, chosen, validation)
  sizes = sorted({(len(r["counts"]), r["n"]) for r in tests})
  md = "Held-out test: " + ", ".join(f"{p} problems x {n} samples" for p, n in sizes) + "\n\n"
  md += table(summary, validation)
  md += "\n" + unsolved_report(tests, chosen, texts, k=max(KS))
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(md)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"chosen_lr": chosen, "summary": summary, "validation": validation, "tests": tests}, f)
  plot_passk(summary, os.path.join(out, "passk.png"), title)
  picked = [r for r in validation if r["lr"] == chosen.get(r["variant"]) and "curves" in r]
  if picked:
    plot_curves(picked, os.path.join(out, "curves.png"), title + ", at the chosen lrs")
  source = "" if from_runs else " (rebuilt from results.json)"
  print(f"## {out}{source}\n\n{md}", flush=True)
  return summary


def plan(a, settings) -> dict:
  """The runs the command will make and their expected CPU time (`CPU_S`)."""
  n_methods, n_lrs = len(a.methods), len(a.lrs)
  per = {
      "rl_runs": n_methods * n_lrs * len(a.selection_seeds)
      + n_methods * len(set(a.seeds) - set(a.selection_seeds))
      + len(a.ablations) * len(a.ablation_seeds),
  }
  per["test_evals"] = len(a.seeds) * (1 + n_methods) + len(a.ablations) * len(a.ablation_seeds)
  if a.validation_only:  # the grid on the selection seeds, nothing after the choice
    per = {"rl_runs": n_methods * n_lrs * len(a.selection_seeds), "test_evals": 0}
  cpu = CPU_S["warm_start"] + per["rl_runs"] * a.steps * CPU_S["rl_step"]
  cpu += per["test_evals"] * a.test_prompts * a.test_samples * CPU_S["test_sample"]
  return {**per, "settings": list(settings), "expected_cpu_h": round(len(settings) * cpu / 3600, 2)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  csv = lambda typ: lambda text: [typ(x) for x in text.split(",") if x]  # noqa: E731
  p.add_argument("--settings", type=csv(str), default=list(SETTINGS), help=f"of {list(SETTINGS)}")
  p.add_argument("--seeds", type=csv(int), default=list(range(8)))
  p.add_argument("--selection_seeds", type=csv(int), default=None, help="seeds the lr is chosen on (--seeds)")
  p.add_argument("--ablation_seeds", type=csv(int), default=None, help="seeds of the ablations (--seeds)")
  p.add_argument("--lrs", type=csv(float), default=list(LRS), help="the lr grid of every method")
  p.add_argument("--steps", type=int, default=configs.chain_config().train.steps)
  p.add_argument("--sft_steps", type=int, default=configs.chain_config().warm_start.sft_steps)
  p.add_argument("--val_prompts", type=int, default=25, help="validation problems, the first of the train split")
  p.add_argument("--val_samples", type=int, default=8, help="samples per validation problem")
  p.add_argument("--test_prompts", type=int, default=100, help="test problems (at most the split's)")
  p.add_argument("--test_samples", type=int, default=max(KS), help="samples per test problem")
  p.add_argument("--methods", type=csv(str), default=list(METHODS))
  p.add_argument("--ablations", type=csv(str), default=list(ABLATIONS), help="'' for none")
  p.add_argument("--set", default="", help="extra config overrides, e.g. rollout.prompts_per_step=4")
  p.add_argument("--out", default="benchmarks/compare")
  p.add_argument(
      "--select_by", default="pass@4", choices=("pass@4", "pass@1"), help="validation metric of the lr choice"
  )
  p.add_argument("--validation_only", action="store_true", help="choose the lrs, no test: validation.md")
  p.add_argument("--report", action="store_true", help="only rebuild the reports from finished runs")
  p.add_argument("--dry_run", action="store_true", help="print the plan and its expected CPU time")
  a = p.parse_args(argv)
  a.selection_seeds = a.seeds if a.selection_seeds is None else a.selection_seeds
  if a.select_by != "pass@1" and a.val_samples < int(a.select_by.removeprefix("pass@")):
    p.error(
        f"--select_by {a.select_by} needs --val_samples >= {a.select_by.removeprefix('pass@')}, got {a.val_samples}"
    )
  a.ablation_seeds = a.seeds if a.ablation_seeds is None else a.ablation_seeds
  for name in a.settings:
    if name not in SETTINGS:
      p.error(f"--settings: unknown setting {name!r}; known {list(SETTINGS)}")
  for v in [*a.methods, *a.ablations]:
    try:
      parse_variant(v)  # fail before any run
    except ValueError as e:
      p.error(str(e))
  overrides = []
  for kv in filter(None, a.set.split(",")):
    key, value = kv.split("=")
    section, name = key.split(".")
    old = getattr(getattr(configs.chain_config(), section), name)
    if isinstance(old, bool) and value not in ("True", "False"):
      p.error(f"--set {key}: expected True or False, got {value!r}")
    overrides.append((key, value == "True" if isinstance(old, bool) else type(old)(value)))
  print(json.dumps({"plan": plan(a, a.settings)}), flush=True)
  if a.dry_run:
    return {}
  summaries = {}
  for name in a.settings:
    spec = SETTINGS[name]
    s = Setting(
        os.path.join(a.out, name), spec["level"], spec["reward"], a.steps, a.val_prompts, a.val_samples,
        a.test_prompts, a.test_samples, tuple(overrides),
    )  # fmt: skip
    title = f"tiny Qwen2, synthetic_chain level {s.level}, reward {s.reward}: mean and min-max over seeds"
    if not a.report:
      os.makedirs(s.out, exist_ok=True)
      hf_dir = warm_started_hf(s, a.sft_steps)

      def log(record, name=name):
        print(json.dumps({"setting": name, **record}), flush=True)

      def run(v, lr, sd, s=s, hf=hf_dir):
        result = run_one(s, v, lr, sd, hf)
        return result if a.select_by == "pass@1" else validate_one(s, v, lr, sd, hf)

      chosen = sweep(
          a.methods, a.ablations, a.lrs, a.seeds, a.selection_seeds, a.ablation_seeds,
          run=run, test=lambda v, lr, sd, s=s, hf=hf_dir: test_one(s, v, lr, sd, hf),
          log=log, select_by=a.select_by, validation_only=a.validation_only,
      )  # fmt: skip
      if not a.validation_only:  # validation_report writes the choice into validation.json
        with open(os.path.join(s.out, "chosen_lr.json"), "w") as f:
          json.dump(chosen, f)
    if a.validation_only:
      summaries[name] = validation_report(s.out, a.lrs, a.selection_seeds, a.methods, a.select_by)
    else:
      summaries[name] = report(s.out, title, problem_texts(s))
  return summaries


if __name__ == "__main__":
  main()
