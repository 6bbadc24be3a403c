"""ict-jax: RLVR for Qwen2.5 in JAX/Flax with ICT (Independent Combinatorial Tokens) selection.

Public names are resolved lazily so that ``import ict_jax`` does no work and imports no JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_pretrained": "ict_jax.models.hf",
    "save_pretrained": "ict_jax.models.hf",
    "Qwen2": "ict_jax.models.qwen2",
    "Qwen2Config": "ict_jax.models.qwen2",
    "Tokenizer": "ict_jax.tokenizer",
    "generate": "ict_jax.sampling",
    "grpo": None,
    "selection": None,
}


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'ict_jax' has no attribute {name!r}")
  module = _LAZY[name]
  if module is None:
    return importlib.import_module(f"ict_jax.{name}")
  return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
