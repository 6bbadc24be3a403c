"""Verifiable rewards: math (``\\boxed{}`` + math-verify), multiple choice, format.

Every reward is ``fn(completion: str, gold) -> float`` in {0.0, 1.0}, never raises for any model
output, never imports JAX and never ``eval``s text. ``score(kind, completion, gold)`` sanitises
and truncates the input (see ``registry``); ``RewardPool`` runs it in killable worker processes.
Reward functions with TRL's signature (``fn(prompts, completions, **columns)``, `reward.funcs`) are
loaded, called and checked by ``functions``, in the same workers.
"""

from __future__ import annotations

from ict_jax.rewards.choice import choice_reward, extract_choice
from ict_jax.rewards.extract import extract_boxed
from ict_jax.rewards.format import format_reward
from ict_jax.rewards.functions import RewardFunction
from ict_jax.rewards.math import math_equal, math_reward
from ict_jax.rewards.pool import RewardPool
from ict_jax.rewards.registry import MAX_COMPLETION_CHARS, REWARDS, sanitize, score

__all__ = [
    "MAX_COMPLETION_CHARS",
    "REWARDS",
    "RewardFunction",
    "RewardPool",
    "choice_reward",
    "extract_boxed",
    "extract_choice",
    "format_reward",
    "math_equal",
    "math_reward",
    "sanitize",
    "score",
]
