"""The tiny model on the reasoning task `synthetic_chain` level 1 (worked two-step solutions,
"3+1+4=" -> "3+1=4,4+4=8;\\boxed{8}"): warm-start on the worked solutions, then ICT, with pass@1 /
pass@4 on the held-out problems every 20 steps.

    python -m ict_jax.train --config configs/tiny_chain.py --workdir runs/chain

Not yet the default: the reward does not clearly rise yet (the warm-start now lands partly right,
T=1 pass@1 0.30 / pass@8 0.81, but RL at lr 5e-4 collapses the box's format and at 1e-4-2e-4 the
reward stays flat or drifts down; with 16 prompts a step at 1e-4 it rises steadily but by only
+0.02-0.07 between the first and last fifths of 40 steps (seeds 0-3), against the +0.15 the default needs;
benchmarks/RESULTS.md), so the values still need tuning.
"""

from ict_jax.config import chain_config


def get_config():
  return chain_config()
