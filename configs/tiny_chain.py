"""The tiny model on the reasoning task `synthetic_chain` level 1 (worked two-step solutions,
"3+1+4=" -> "3+1=4,4+4=8;\\boxed{8}"): warm-start on the worked solutions, then ICT, with pass@1 /
pass@4 on the held-out problems every 20 steps.

    python -m ict_jax.train --config configs/tiny_chain.py --workdir runs/chain

Not the default: RL clearly moves the held-out pass rate (five seeds, `benchmarks/compare_methods.py`:
pass@1 23.6% after the warm-start -> 30.4% after 40 ICT steps, 33.2% after GRPO; pass@4 60.0% ->
71.2% / 77.6%), but the training reward rises by only +0.03..+0.12 between the first and last
8 of 40 ICT steps, against the +0.15 on 3 of 4 seeds the default needs (benchmarks/RESULTS.md).
"""

from ict_jax.config import chain_config


def get_config():
  return chain_config()
