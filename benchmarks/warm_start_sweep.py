"""How far the supervised warm-start of `configs.chain_config()` gets: loss and T=1 pass@1 / pass@8.

    python benchmarks/warm_start_sweep.py level1:3e-3:300:0:150 [LEVEL:LR:STEPS:SEED[:CHECKPOINT...] ...]

Each spec runs one warm-start (`ict_jax.build.warm_start`, the trainer's own) of `chain_config()`
with that data level, learning rate, step count and seed, and at each checkpoint step (and at the
end) samples 8 completions at temperature 1 for the first 32 problems of the train and the test
split and prints one JSON line: pass@1, pass@8 and the mean response length of each split, the
warm-start's wall seconds, and three completions of the first test problem. RL from verifiable
rewards raises the T=1 reward fastest from a policy that is partly right (pass@1 well below
pass@8), which is what this measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ict_jax import config as config_lib  # noqa: E402
from ict_jax import configs  # noqa: E402
from ict_jax.eval.run import evaluate  # noqa: E402
from ict_jax.setup import abstract_params, make_mesh, make_tokenizer, model_config  # noqa: E402
from ict_jax.build import load_examples, warm_start  # noqa: E402
from ict_jax.setup import init_params  # noqa: E402


def run(level: str, lr: float, steps: int, seed: int, checkpoints=(), workdir: str = "/tmp/warm_start_sweep"):
  c = configs.chain_config()
  c.data.config, c.warm_start.sft_learning_rate, c.train.seed = level, lr, seed
  cfg = config_lib.validate(c)
  mesh = make_mesh(cfg)
  train_src, test_src = load_examples(cfg, "train", workdir), load_examples(cfg, "test", workdir)
  # chain_config's task vocabulary (a file per level: the levels' texts differ)
  tok = make_tokenizer(cfg, os.path.join(workdir, level), "", lambda split: load_examples(cfg, split, workdir))
  mcfg = model_config(cfg, "", mesh, tok)
  graphdef, _, shardings = abstract_params(mcfg, mesh)
  params, done = init_params(mcfg, seed, mesh, shardings), 0
  for upto in sorted(set(checkpoints) | {steps}):
    c.warm_start.sft_steps = upto - done  # continues the same run (a new batch order per chunk)
    c.train.seed = seed if done == 0 else seed * 1000 + done
    t0 = time.perf_counter()
    params = warm_start(graphdef, params, config_lib.validate(c), tok, train_src, mesh)
    out = {"level": level, "lr": lr, "steps": upto, "seed": seed, "sft_s": round(time.perf_counter() - t0, 1)}
    done = upto
    for name, src in (("train", train_src), ("test", test_src)):
      res = evaluate(
          (graphdef, params),
          tok,
          [src[i] for i in range(min(len(src), 32))],
          answer_type="answer",
          n=8,
          ks=(1, 8),
          max_new_tokens=cfg.rollout.max_new_tokens,
          temperature=1.0,
          prompt_style="plain",
          rng=seed,
          mesh=mesh,
          batch_size=8,
          max_prompt_len=cfg.data.max_prompt_len,
      )
      out[name] = {k: round(float(res[k]), 3) for k in ("pass@1", "pass@8", "mean_response_tokens")}
      if name == "test":
        first = res["per_problem"][0]
        out["example"] = first["prompt"] + " -> " + " | ".join(first["completions"][:3])
    print(json.dumps(out), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("specs", nargs="+", help="LEVEL:LR:STEPS:SEED[:CHECKPOINT...], e.g. level1:3e-3:300:0:150")
  p.add_argument("--workdir", default="/tmp/warm_start_sweep", help="where the dataset is built")
  args = p.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
  for spec in args.specs:
    level, lr, steps, seed, *cps = spec.split(":")
    run(level, float(lr), int(steps), int(seed), [int(x) for x in cps], args.workdir)


if __name__ == "__main__":
  main()
