"""Benchmark answer types -> reward functions (and ``RewardPool`` kinds).

``"math_boxed"``: the last ``\\boxed{}`` of the completion must equal the gold answer
(``rewards.math_reward``); ``"choice"``: the committed option letter A-J must equal the gold letter
(``rewards.choice_reward``).
"""

from __future__ import annotations

from ict_jax.rewards.registry import REWARDS, RewardFn, score

ANSWER_TYPE_TO_KIND: dict[str, str] = {
    "math_boxed": "math",
    "choice": "choice",
    "answer": "answer",
    "chain_steps": "chain_steps",
}


def reward_kind(answer_type: str) -> str:
  """The ``RewardPool``/``rewards.score`` kind that checks ``answer_type``."""
  if answer_type not in ANSWER_TYPE_TO_KIND:
    raise KeyError(
        f"ict_jax.eval.checkers: unknown answer type {answer_type!r}; " f"expected one of {sorted(ANSWER_TYPE_TO_KIND)}"
    )
  return ANSWER_TYPE_TO_KIND[answer_type]


def checker(answer_type: str) -> RewardFn:
  """The reward function ``fn(completion, gold) -> 1.0 | 0.0`` for ``answer_type``."""
  return REWARDS[reward_kind(answer_type)]


def is_correct(answer_type: str, completion: str, gold: object) -> bool:
  """In-process check (sanitised and truncated like the pool); for bulk use ``RewardPool``."""
  return score(reward_kind(answer_type), completion, gold) == 1.0
