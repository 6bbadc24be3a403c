"""Math answer checking: ``math_equal`` on two answers, ``math_reward`` on a completion.

Pipeline for ``math_equal(pred, gold)`` (cheapest first; True as soon as one step agrees):
1. take the last ``\\boxed{}`` of each side if it has one, else the whole string;
2. compare ``answer_key``s (normalised strings: ``$``, ``\\text{}``, units, trailing periods,
   ``\\dfrac``, ``\\left``/``\\right``, thousands commas, whitespace);
3. compare as exact numbers (``0.5 == \\frac{1}{2} == 1/2``, percentages);
4. math-verify (``math_verify.parse`` + ``verify``) when it is installed, on the cleaned answers,
   behind two guards: ``_latex_is_tame`` refuses strings that latex2sympy would evaluate eagerly
   (``\\gcd`` of huge powers, huge ``\\binom``, matrix builders, 400-digit numerals, deep nesting,
   answers over ``MAX_ANSWER_CHARS``) and ``guard.is_safe`` refuses parsed expressions whose numbers
   are absurd (``10^{10^{10}}``). Refused answers are simply not equal (unless step 2/3 matched).

math-verify runs with its signal timeouts off (they only work in the main thread); the hard time
limit is ``RewardPool``'s, which kills a worker process that overruns. Nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable

from ict_jax.rewards.extract import extract_boxed
from ict_jax.rewards.guard import is_safe
from ict_jax.rewards.normalize import answer_key, clean_answer, numbers_equal

MAX_ANSWER_CHARS = 1_000  # longer answers are compared as strings/numbers only, never parsed
MAX_NESTING = 32  # bracket depth above which an answer is not parsed
_BIG_NUMERAL = re.compile(r"\d{401}")
_MATRIX_BUILDERS = re.compile(r"zeros|ones|eye|diag|orth|vstack|hstack")
_EAGER = re.compile(r"gcd|lcm|binom|choose|Gamma|Pi\b")
_SMALL_LITERALS_ONLY = re.compile(r"^[\\a-zA-Z{}()\[\],.\s+\-/0-9]*$")
_LONG_DIGITS = re.compile(r"\d{6}")


@functools.lru_cache(maxsize=1)
def _load_math_verify() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
  """``(parse, verify)`` from math-verify, or None when it is not installed."""
  try:
    from math_verify import parse, verify
  except ImportError:
    return None
  # We switch its signal-based timeouts off on purpose (the pool enforces time); silence the
  # one-off warning about that in every worker.
  for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).setLevel(logging.ERROR)
  return parse, verify


def math_verify_available() -> bool:
  return _load_math_verify() is not None


def warm_up() -> None:
  """Import math-verify and run one comparison, so the first real item is not slow."""
  _math_verify_equal("x+1", "1+x")


def _max_nesting(s: str) -> int:
  depth = best = 0
  for ch in s:
    if ch in "{([":
      depth += 1
      best = max(best, depth)
    elif ch in "})]" and depth:
      depth -= 1
  return best


def _latex_is_tame(s: str) -> bool:
  """String-level screen run before latex2sympy, which evaluates some constructs eagerly."""
  if not s or len(s) > MAX_ANSWER_CHARS or _BIG_NUMERAL.search(s):
    return False
  if _max_nesting(s) > MAX_NESTING or _MATRIX_BUILDERS.search(s):
    return False
  if _EAGER.search(s):  # gcd/lcm/binom are computed while parsing: small literals only
    return bool(_SMALL_LITERALS_ONLY.match(s)) and not _LONG_DIGITS.search(s)
  return True


def _math_verify_equal(pred: str, gold: str) -> bool:
  loaded = _load_math_verify()
  if loaded is None or not (_latex_is_tame(pred) and _latex_is_tame(gold)):
    return False
  parse, verify = loaded
  try:
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
      return False
    if not all(is_safe(x) for x in (*gold_parsed, *pred_parsed)):
      return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
  except Exception:  # a verifier never raises into training; RecursionError included
    return False


def _answer_text(s: str) -> str | None:
  if not isinstance(s, str):
    return None
  if "\\boxed" in s or "\\fbox" in s:
    return extract_boxed(s)
  return s


def math_equal(pred: str, gold: str, *, use_math_verify: bool = True) -> bool:
  """True when answer ``pred`` equals answer ``gold`` (see the module docstring for the steps)."""
  p, g = _answer_text(pred), _answer_text(gold)
  if not p or not g:
    return False
  p_key, g_key = answer_key(p), answer_key(g)
  if not p_key or not g_key:
    return False
  if p_key == g_key:
    return True
  p_clean, g_clean = clean_answer(p), clean_answer(g)
  if numbers_equal(p_clean, g_clean):
    return True
  return use_math_verify and _math_verify_equal(p_clean, g_clean)


def math_reward(completion: str, gold: str) -> float:
  """1.0 when the last ``\\boxed{}`` of ``completion`` equals ``gold``, else 0.0 (no box: 0.0)."""
  answer = extract_boxed(completion) if isinstance(completion, str) else None
  if not answer:
    return 0.0
  return 1.0 if math_equal(answer, gold) else 0.0


def answer_reward(completion: str, gold: str) -> float:
  """For bare-answer tasks (the synthetic "3+5=" -> "8"): the last ``\\boxed{}`` when there is
  one, else the whole completion, compared with ``gold`` by ``math_equal`` (without
  math-verify: a bare answer is a number or a short expression)."""
  if not isinstance(completion, str):
    return 0.0
  answer = extract_boxed(completion) if ("\\boxed" in completion or "\\fbox" in completion) else completion.strip()
  if not answer:
    return 0.0
  return 1.0 if math_equal(answer, gold, use_math_verify=False) else 0.0
