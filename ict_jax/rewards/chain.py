"""``chain_steps``: the ``synthetic_chain`` verifier that checks the worked steps, not just the box.

    chain_steps_reward("3+5=8,8+2=10;\\boxed{10}", "3+5+2=10") -> 1.0
    chain_steps_reward("3+5=9,9+2=10;\\boxed{10}", "3+5+2=10") -> 0.0   (a wrong step)

The gold is the problem with its answer, ``<prompt><answer>`` of the example ("3+5+2=10";
``gold_text``), so the verifier knows the operands. A completion scores 1.0 only when all of these
hold (anything else, including text it cannot read, scores 0.0; it never raises):

* the last ``\\boxed{}`` holds the problem's answer (an integer; text after the box is ignored,
  as the answer-only verifier ignores it);
* the text before that box is the worked steps, separated by ``,`` or ``;``; spaces anywhere in a
  step are allowed ("3 + 5 = 8"), empty pieces ("8+2=10;;") are skipped, any other piece that is
  not one equation ``a + b = r`` / ``a - b = r`` of non-negative integers fails the completion;
* **every step**: there is exactly one step per operator of the problem (a missing step or an
  extra step fails), each step's arithmetic is right, each step after the first uses the previous
  step's result as one operand, and the other operands (the first step's two, one per later step)
  are the problem's operands, each used once (any order: "5+2=7,3+7=10" works 3+5+2 right to
  left, as the task's own solutions do);
* the last step's result is the boxed answer.

Which sign each operand carries is not checked step by step (on ``a - b + c`` the steps
"a+c=x,x-b=y" are a right reordering); a step that flips a sign changes the chain's value, so it
fails on the final answer unless the flip cancels out exactly.
"""

from __future__ import annotations

import re
from collections import Counter

from ict_jax.rewards.extract import boxed_spans

_STEP = re.compile(r"^\s*(\d{1,9})\s*([+-])\s*(\d{1,9})\s*=\s*(\d{1,9})\s*$")
_GOLD = re.compile(r"^\s*(\d{1,9})((?:\s*[+-]\s*\d{1,9})+)\s*=\s*(\d{1,9})\s*$")
_TERM = re.compile(r"([+-])\s*(\d{1,9})")
_SEPARATORS = re.compile(r"[,;]")


def parse_gold(gold: str) -> tuple[list[int], int] | None:
  """ "3+5+2=10" -> ([3, 5, 2], 10); None when `gold` is not such an equation."""
  m = _GOLD.match(gold) if isinstance(gold, str) else None
  if m is None:
    return None
  operands = [int(m.group(1))] + [int(b) for _, b in _TERM.findall(m.group(2))]
  return operands, int(m.group(3))


def parse_steps(work: str) -> list[tuple[int, str, int, int]] | None:
  """ "3+5=8, 8+2=10;" -> [(3, "+", 5, 8), (8, "+", 2, 10)]; None when a piece is no equation."""
  steps = []
  for piece in _SEPARATORS.split(work):
    if not piece.strip():
      continue
    m = _STEP.match(piece)
    if m is None:
      return None
    steps.append((int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))))
  return steps


def _steps_right(steps: list[tuple[int, str, int, int]], operands: list[int]) -> bool:
  if len(steps) != len(operands) - 1:
    return False
  used: list[int] = []
  previous = None
  for a, op, b, r in steps:
    if (a + b if op == "+" else a - b) != r:
      return False
    if previous is None:
      used += [a, b]
    elif a == previous:
      used.append(b)
    elif b == previous:
      used.append(a)
    else:
      return False
    previous = r
  return Counter(used) == Counter(operands)


def chain_steps_reward(completion: str, gold: str) -> float:
  """1.0 when the worked steps and the boxed answer of `completion` are right for the problem
  `gold` ("3+5+2=10"), else 0.0 (the rules: the module docstring)."""
  parsed = parse_gold(gold)
  if parsed is None or not isinstance(completion, str):
    return 0.0
  operands, answer = parsed
  spans = boxed_spans(completion)
  if not spans:
    return 0.0
  start, lo, hi = spans[-1]  # the last box, as the answer-only verifier reads it
  boxed = completion[lo:hi].strip()
  if not boxed.isdigit() or len(boxed) > 9 or int(boxed) != answer:
    return 0.0
  steps = parse_steps(completion[:start])
  if not steps or not _steps_right(steps, operands) or steps[-1][3] != answer:
    return 0.0
  return 1.0
