"""Finding the final answer box in a completion: ``\\boxed{...}``, ``\\fbox{...}``, ``\\boxed 5``.

Everything here is linear in the length of the text and uses no recursion, so a 1 MB completion or
``\\boxed{`` nested 10,000 deep costs one regex pass plus one pass over the braces.
"""

from __future__ import annotations

import re

# `\boxed{` / `\fbox{` (optionally with spaces before the brace); group 1 ends on the brace.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*(\{)")
# `\boxed 5` form: a single token after a space, as in some Minerva-style outputs.
_BOX_SPACE = re.compile(r"\\boxed[ \t]+([^\s${}\\]+)")
# Tokens that matter for brace matching. `\{`, `\}` and `\\` are escapes and do not count.
_BRACE_TOKEN = re.compile(r"\\[{}\\]|[{}]")


def _matched_boxes(text: str) -> list[tuple[int, int, int]]:
  """All brace-form boxes whose brace closes: ``(start, content_start, content_end)``, by start.

  One pass with a stack over the brace tokens from the first box on; an unmatched ``}`` is
  ignored and a ``{`` never closed leaves its box out.
  """
  opens = {}  # brace index -> start of the `\boxed` command
  first = None
  for m in _BOX_OPEN.finditer(text):
    opens[m.start(1)] = m.start()
    if first is None:
      first = m.start()
  if first is None:
    return []
  found = []
  stack: list[int] = []
  for tok in _BRACE_TOKEN.finditer(text, first):
    ch = tok.group()
    if ch == "{":
      stack.append(tok.start())
    elif ch == "}" and stack:
      open_at = stack.pop()
      start = opens.get(open_at)
      if start is not None:
        found.append((start, open_at + 1, tok.start()))
  found.sort()
  return found


def boxed_spans(text: str) -> list[tuple[int, int, int]]:
  """Every closed box in ``text`` as ``(start, content_start, content_end)``, sorted by start."""
  spans = _matched_boxes(text)
  spans.extend((m.start(), m.start(1), m.end(1)) for m in _BOX_SPACE.finditer(text))
  spans.sort()
  return spans


def _last_box(text) -> tuple[int, int] | None:
  """(content_start, content_end) of the box that starts last, the one the answer is read from;
  None when ``text`` is not a string or holds no closed box."""
  if not isinstance(text, str) or "\\" not in text:
    return None
  spans = boxed_spans(text)
  return spans[-1][1:] if spans else None


def answer_end(text: str) -> int | None:
  """Index just past the final box, the one ``extract_boxed`` reads (its closing brace, or the
  end of a ``\\boxed 5`` token); ``None`` when there is no closed box."""
  last = _last_box(text)
  if last is None:
    return None
  lo, hi = last
  return hi + 1 if text[lo - 1] == "{" else hi


def extract_boxed(text: str) -> str | None:
  """Content of the last box (the one that starts last), stripped; ``None`` when there is none.

  ``\\boxed{a} then \\boxed{b}`` gives ``"b"``; nested boxes give the innermost one; a box whose
  brace never closes is skipped in favour of the previous closed one; ``\\boxed{}`` gives ``""``.
  """
  last = _last_box(text)
  return None if last is None else text[last[0] : last[1]].strip()
