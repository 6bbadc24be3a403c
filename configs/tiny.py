"""The embedded CPU default (what `python -m ict_jax.train` runs with no flags).

A tiny Qwen2 with the real Qwen2.5 vocabulary on `synthetic_chain` level 1 ("3+1+4=" ->
"3+1=4,4+4=8;\\boxed{8}": a worked solution of two steps, rewarded on the boxed answer), a short
supervised warm-start on the worked solutions so the policy sometimes succeeds, then ICT (dense
GRPO for the first 10 steps) with pass@1 / pass@4 on the 25 held-out problems every 20 steps.
Finishes in minutes on 2 CPU cores; the reward rises (benchmarks/RESULTS.md).
"""
from ict_jax.config import tiny_config


def get_config():
  return tiny_config()
