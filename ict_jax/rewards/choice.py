"""Multiple-choice answers: the option letter A-J a completion commits to.

Priority (the first rule that finds a letter wins):
1. the last ``\\boxed{}``: ``\\boxed{C}``, ``\\boxed{(C)}``, ``\\boxed{\\text{C}}``,
   ``\\boxed{C. 42}``;
2. the last "answer is (C)" / "Answer: C" / "answer is **C**" (the word "answer" in any case,
   the letter in capitals);
3. a final standalone capital letter: "... so we pick (C)." / "...\\n\\nC".
Letters inside words ("Carbon", "A lot") never count; the last 10,000 characters are enough to
look at, so a 1 MB completion costs the same as a short one.
"""

from __future__ import annotations

import re

from ict_jax.rewards.extract import extract_boxed

LETTERS = "ABCDEFGHIJ"
_TAIL_CHARS = 10_000
_BOXED_LETTER = re.compile(r"^\(?\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*\(?)?([A-J])\)?\s*\}?\s*\)?(?:$|[.:)\s])")
_ANSWER_IS = re.compile(
    r"answer(?:\s+is|\s*:|\s+would\s+be|\s+should\s+be)?\s*[:\-]?\s*(?:option\s+|choice\s+)?"
    r"[*_$\\{(\[\s]*(?:\\text\{|\\textbf\{|\\mathrm\{)?\(?([A-J])\)?(?![A-Za-z0-9])",
    re.I,
)
_FINAL_LETTER = re.compile(r"(?:^|[\s(\[*:])\(?([A-J])\)?[\s.)\]*!]*$")


def normalize_letter(gold: str | int) -> str | None:
  """``"C"``, ``"(C)"``, ``"c"``, ``" C. "`` and index ``2`` all give ``"C"``; else None."""
  if isinstance(gold, int) and not isinstance(gold, bool):
    return LETTERS[gold] if 0 <= gold < len(LETTERS) else None
  if not isinstance(gold, str):
    return None
  s = gold.strip().strip("()[]. ").upper()
  return s if len(s) == 1 and s in LETTERS else None


def extract_choice(completion: str) -> str | None:
  """The option letter ``completion`` commits to, or None."""
  if not isinstance(completion, str):
    return None
  text = completion[-_TAIL_CHARS:]
  boxed = extract_boxed(text)
  if boxed:
    m = _BOXED_LETTER.match(boxed)
    if m:
      return m.group(1)
  last = None
  for m in _ANSWER_IS.finditer(text):
    if m.group(1).isupper():
      last = m.group(1)
  if last is not None:
    return last
  m = _FINAL_LETTER.search(text[-200:])
  return m.group(1) if m else None


def choice_reward(completion: str, gold_letter: str | int) -> float:
  """1.0 when the committed letter equals ``gold_letter`` (see ``normalize_letter``), else 0.0."""
  gold = normalize_letter(gold_letter)
  if gold is None:
    return 0.0
  return 1.0 if extract_choice(completion) == gold else 0.0
