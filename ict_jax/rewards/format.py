"""Format reward: did the completion reason and then commit to exactly one boxed answer?"""

from __future__ import annotations

from ict_jax.rewards.extract import boxed_spans

MIN_REASONING_CHARS = 10


def format_reward(completion: str, gold: object = None) -> float:
  """1.0 when ``completion`` holds exactly one closed box (``\\boxed{...}``/``\\fbox{...}``,
  nested boxes count separately) with non-empty content, and at least ``MIN_REASONING_CHARS``
  non-space characters of text before it; else 0.0. ``gold`` is ignored (registry signature)."""
  if not isinstance(completion, str):
    return 0.0
  spans = boxed_spans(completion)
  if len(spans) != 1:
    return 0.0
  start, lo, hi = spans[0]
  if not completion[lo:hi].strip():
    return 0.0
  reasoning = "".join(completion[:start].split())
  return 1.0 if len(reasoning) >= MIN_REASONING_CHARS else 0.0
