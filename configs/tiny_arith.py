"""The one-step task: the tiny model (full Qwen2.5 vocabulary) on synthetic single-digit addition
with bare prompts ("3+5=" -> "8"), a short supervised warm-start, then ICT (dense GRPO for the first
20 steps). The default before the worked-solution task; its decisive token is the first, whose JS
score is 0, so it cannot show ICT's mechanism (benchmarks/RESULTS.md).

    python -m ict_jax.train --config configs/tiny_arith.py --workdir runs/arith
"""

from ict_jax.configs.tiny_arith import get_config  # one source: the preset shipped with the package
