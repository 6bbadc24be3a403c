"""The embedded CPU default (what `python -m ict_jax.train` runs with no flags).

A tiny Qwen2 with the real Qwen2.5 vocabulary, synthetic single-digit addition with bare
prompts ("3+5=" -> "8"), a short supervised warm-start so the policy sometimes succeeds, then
ICT (dense GRPO for the first 10 steps), with pass@1 / pass@4 on the held-out problems every 20
steps. Finishes in minutes on 2 CPU cores; the reward rises. configs/tiny_chain.py is the same
model on the worked-solution task `synthetic_chain`.
"""

from ict_jax.config import tiny_config


def get_config():
  return tiny_config()
