"""String normalisation of final answers and an exact number reader; no sympy, no ``eval``.

``clean_answer`` keeps the LaTeX meaning (it is what math-verify sees); ``answer_key`` also drops
whitespace and is what two answers are compared by as strings; ``to_number`` reads plain numbers,
fractions and percentages exactly as ``fractions.Fraction``.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Unit words dropped after a number ("12 dollars", "3 cm^2"); single letters are not units here
# because they are usually variables.
_UNIT_WORDS = (
    "dollars?|cents?|units?|square|cubic|inches|inch|feet|foot|ft|yards?|yd|miles?|mph|"
    "km/h|kph|km|cm|mm|meters?|metres?|gm|grams?|kg|kilograms?|pounds?|lbs?|oz|ounces?|"
    "seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|degrees?|"
    "liters?|litres?|ml|gallons?|points?|ways?|people|students?|meals?|edges?|integers?|"
    "digits?"
)
_TRAILING_UNIT = re.compile(r"(?<=[0-9}.)])(?:(?:\s|\\[,;: !]|~)*(?:" + _UNIT_WORDS + r")(?:\^\{?[23]\}?)?)+\s*$", re.I)
# `12\text{ cm}`, `5\mbox{m}^2`: a text group of letters after a number is a unit.
_TRAILING_TEXT_UNIT = re.compile(
    r"(?<=[0-9}.)])\s*\\(?:text|mbox|textrm|mathrm)\s*\{\s*[A-Za-z/ .]*\}(?:\^\{?[23]\}?)?\s*$"
)
_TEXT_GROUP = re.compile(r"\\(?:text|mbox|textrm|textbf|textit|mathrm|mathbf|mathit|operatorname)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree")
_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_PERCENT_WORD = re.compile(r"\s*(?:percent|per\s*cent)\s*$", re.I)
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER = re.compile(r"^([-+]?)(\d+(?:\.\d*)?|\.\d+)(?:e([-+]?\d{1,4}))?$", re.I)
_FRAC = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$|^([-+]?)\\frac(\d)(\d)$")
_SLASH = re.compile(r"^([-+]?\d+)/([-+]?\d+)$")
_MAX_DIGITS = 400  # longer numerals are not read as numbers (int() of huge strings is slow)


def _strip_dollars(s: str) -> str:
  s = s.strip()
  while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
    s = s[1:-1].strip()
  return s.replace("\\$", "").replace("$", "")


def clean_answer(ans: str) -> str:
  """Normalise a final answer string without changing its mathematical meaning.

  Order: math delimiters and ``\\$``; ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``;
  trailing text units (``\\text{ cm}``, ``\\mbox{ cm}``); unwrap remaining ``\\text{...}``;
  degrees, LaTeX spacing, ``{,}``; trailing unit words; trailing periods; thousands commas in a
  plain number (``1,000``). Whitespace is collapsed, not removed.
  """
  s = _strip_dollars(ans)
  s = s.replace("\\left", "").replace("\\right", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = s.replace("\\displaystyle", "").replace("{,}", "")
  s = _TRAILING_TEXT_UNIT.sub("", s)
  for _ in range(8):  # innermost text groups first; nesting deeper than this is left alone
    s2 = _TEXT_GROUP.sub(r"\1", s)
    if s2 == s:
      break
    s = s2
  s = _DEGREES.sub("", s)
  s = _SPACING.sub(" ", s)
  s = " ".join(s.split())
  s = _PERCENT_WORD.sub("\\%", s)
  for _ in range(3):
    s = _TRAILING_UNIT.sub("", s).strip()
    s = s.rstrip(".").strip()
  if _THOUSANDS.match(s):
    s = s.replace(",", "")
  return s


def answer_key(ans: str) -> str:
  """``clean_answer`` without any whitespace; words made only of letters compare casefolded."""
  s = "".join(clean_answer(ans).split())
  if len(s) > 1 and s.isalpha():
    s = s.casefold()
  return s


def to_number(ans: str) -> tuple[Fraction, bool, bool] | None:
  """Read ``ans`` (already cleaned) as an exact number: ``(value, is_decimal, is_percent)``.

  Accepts integers, decimals, ``1e3``, ``a/b``, ``\\frac{a}{b}``, ``\\frac12`` and a trailing
  ``%``/``\\%``; anything else (expressions, huge numerals) gives ``None``.
  """
  s = "".join(ans.split())
  percent = s.endswith("\\%") or s.endswith("%")
  if percent:
    s = s[:-2] if s.endswith("\\%") else s[:-1]
  if not s or len(s) > _MAX_DIGITS:
    return None
  m = _NUMBER.match(s)
  if m:
    value = Fraction(m.group(2)) * (10 ** int(m.group(3)) if m.group(3) else 1)
    if m.group(1) == "-":
      value = -value
    is_decimal = "." in m.group(2) or m.group(3) is not None
    return (value / 100 if percent else value), is_decimal, percent
  m = _FRAC.match(s) or _SLASH.match(s)
  if m:
    groups = [g for g in m.groups() if g is not None]
    sign = groups[0] if len(groups) == 3 else ""
    num, den = int(groups[-2]), int(groups[-1])
    if den == 0:
      return None
    value = Fraction(num, den) * (-1 if sign == "-" else 1)
    return (value / 100 if percent else value), False, percent
  return None


def numbers_equal(pred: str, gold: str, rel_tol: float = 1e-6) -> bool:
  """Exact equality of two cleaned numeric answers (``0.5 == \\frac{1}{2} == 1/2 == 50\\%``).

  A decimal on either side may differ by ``rel_tol`` (``0.333333`` vs ``1/3``). A percentage
  matches both its fraction and its bare number (``50\\%`` equals ``0.5`` and ``50``), as
  math-verify does.
  """
  a, b = to_number(pred), to_number(gold)
  if a is None or b is None:
    return False
  candidates_a = {a[0], a[0] * 100} if a[2] else {a[0]}
  candidates_b = {b[0], b[0] * 100} if b[2] else {b[0]}
  decimal = a[1] or b[1]
  for x in candidates_a:
    for y in candidates_b:
      if x == y:
        return True
      if decimal and abs(x - y) <= Fraction(rel_tol) * max(1, abs(y)):
        return True
  return False
