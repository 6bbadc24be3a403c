"""The presets shipped with the package, one module each with its experiment notes; `configs/*.py`
at the repository root load them. Each module's `get_config()` makes it a `--config` file.

  tiny.py        `chain_config()`: the embedded default (`python -m ict_jax.train` with no --config)
  tiny_arith.py  `tiny_config()`: the one-step task, the base of the tests' quick runs

The paper's settings are `ict_jax/paper_config.py` (configs/qwen2_5_*_math.py).
"""

from ict_jax.configs.tiny import chain_config
from ict_jax.configs.tiny_arith import tiny_config

__all__ = ["chain_config", "tiny_config"]
