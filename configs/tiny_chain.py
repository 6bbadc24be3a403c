"""The tiny model on the reasoning task `synthetic_chain` level 1 (worked two-step solutions,
"3+1+4=" -> "3+1=4,4+4=8;\\boxed{8}"): warm-start on the worked solutions, then ICT, with pass@1 /
pass@4 on the held-out problems every 20 steps.

    python -m ict_jax.train --config configs/tiny_chain.py --workdir runs/chain

Not yet the default: with these values the reward did not clearly rise (seed 0 fell; see
benchmarks/RESULTS.md), so the values still need tuning.
"""

from ict_jax.config import chain_config


def get_config():
  return chain_config()
