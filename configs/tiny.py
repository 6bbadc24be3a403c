"""The embedded CPU default (what `python -m ict_jax.train` runs with no flags).

The tiny Qwen2 over the task vocabulary (the ~30 Qwen2.5 tokens of the task's text) on
`synthetic_chain` level 1, worked two-step solutions ("3+1+4=" -> "3+1=4,4+4=8;\\boxed{8}"),
rewarded on the boxed answer (a truncated completion scores 0): a supervised warm-start on the
worked solutions, then 800 ICT steps (dense GRPO for the first 10, then the top 30% of each
response's tokens), with pass@1 / pass@4 on the 25 held-out problems every 100 steps. About
2.5 minutes on 2 CPU cores (2 min 16 s on a quiet AMD EPYC box); on eight seeds on an AMD EPYC
box the reward rose by +0.24..+0.42 (benchmarks/RESULTS.md, "The default run on AMD EPYC").
configs/tiny_arith.py is the one-step task.
"""

from ict_jax.configs.tiny import get_config  # one source: the preset shipped with the package
