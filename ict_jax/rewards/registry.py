"""The reward registry and ``score``, the one entry point the trainer and ``RewardPool`` use.

``score`` decodes bytes, replaces invalid UTF-8 and lone surrogates, keeps only the last
``MAX_COMPLETION_CHARS`` characters (the final answer lives at the end; this bounds time and memory
on runaway generations) and dispatches on ``kind``.
"""

from __future__ import annotations

from typing import Callable

from ict_jax.rewards.chain import chain_steps_reward
from ict_jax.rewards.choice import choice_reward
from ict_jax.rewards.format import format_reward
from ict_jax.rewards.math import answer_reward, math_reward

MAX_COMPLETION_CHARS = 10_000

RewardFn = Callable[[str, object], float]
REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "choice": choice_reward,
    "format": format_reward,
    "answer": answer_reward,
    "chain_steps": chain_steps_reward,
}
# what a run's reward.kind may name: every verifier but "format", which is added on top of one
# (reward.format_weight)
KINDS = tuple(kind for kind in REWARDS if kind != "format")


def gold_text(kind: str, example: dict) -> object:
  """What the verifier `kind` is given as the gold of `example`: its ``answer``, except for
  ``chain_steps``, which checks the worked steps and so needs the problem too:
  ``<prompt><answer>`` ("3+5+2=" + "10")."""
  if kind == "chain_steps":
    return f"{example['prompt']}{example['answer']}"
  return example["answer"]


def sanitize(text: str | bytes, max_chars: int = MAX_COMPLETION_CHARS) -> str:
  """Text a verifier may safely see: a str of valid UTF-8 (bad bytes become U+FFFD, lone
  surrogates '?'), at most the last ``max_chars`` characters."""
  if isinstance(text, (bytes, bytearray)):
    text = bytes(text[-4 * max_chars :]).decode("utf-8", errors="replace")
  if not isinstance(text, str):
    raise TypeError("ict_jax.rewards.sanitize: expected str or bytes, got " f"{type(text).__name__}")
  text = text[-max_chars:]
  return text.encode("utf-8", errors="replace").decode("utf-8")


def score(kind: str, completion: str | bytes, gold: object, rewards: dict[str, RewardFn] | None = None) -> float:
  """``rewards[kind](sanitize(completion), gold)`` as a float (REWARDS unless given)."""
  table = REWARDS if rewards is None else rewards
  if kind not in table:
    raise KeyError(f"ict_jax.rewards.score: unknown reward kind {kind!r}; " f"expected one of {sorted(table)}")
  if isinstance(gold, (str, bytes)):
    gold = sanitize(gold)
  return float(table[kind](sanitize(completion), gold))
