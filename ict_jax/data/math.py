"""MATH (Hendrycks et al. 2021) from the user's local copy: fields ``problem`` and ``solution``; the
answer is the content of the LAST ``\\boxed{...}`` of the solution (braces matched), ``level`` and
``type`` are kept. MATH-500-style files (``subject``, ``answer`` columns) are accepted too."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from ict_jax.data import readers
from ict_jax.data.manual import ManualFileBuilder

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

  Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; escaped braces
  ``\\{ \\}`` are content. None when there is no box or the last one is not closed.
  """
  start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
  if start < 0:
    return None
  k = start + len(command)
  if text.startswith(" ", k):  # "\boxed 5": the token up to whitespace or "$"
    match = re.match(r" +([^\s$]+)", text[k:])
    return match.group(1) if match else None
  if not text.startswith("{", k):
    return None
  depth = 0
  i = k
  while i < len(text):
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[k + 1 : i].strip()
    i += 1
  return None


def parse_level(value: Any) -> int:
  """``"Level 3"``, ``3`` or ``"3"`` -> 3; anything else (``"Level ?"``, missing) -> 0."""
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  match = re.fullmatch(r"\s*(?:Level\s*)?(\d+)\s*", str(value)) if value is not None else None
  return int(match.group(1)) if match else 0


class Math(ManualFileBuilder, skip_registration=True):
  """MATH competition problems."""

  name = "math"
  VERSION = tfds.core.Version("1.0.0")
  SPLITS = ("train", "test")
  SUBDIRS = ("*",)
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put MATH's train.jsonl and test.jsonl, or train-*.parquet and test-*.parquet, into the
    manual directory (one sub-folder level is searched too, e.g. the per-subject folders
    algebra/train-00000-of-00001.parquet of the Hugging Face dataset EleutherAI/hendrycks_math;
    HuggingFaceH4/MATH-500's test.jsonl gives a test split only). Each row needs the fields
    "problem" and "solution" (final answer in \\boxed{}); "level" and "type" (or "subject") are kept.
    """

  def _features(self) -> dict[str, Any]:
    return {
        "id": tfds.features.Text(),
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
        "solution": tfds.features.Text(),
        "level": tfds.features.Scalar(dtype=np.int32),
        "type": tfds.features.Text(),
    }

  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    question = readers.require_text(row, "problem").strip()
    solution = readers.require_text(row, "solution")
    answer = last_boxed(solution)
    if not answer:
      given = row.get("answer")
      if not (isinstance(given, str) and given.strip()):
        raise readers.RowError("field 'solution' has no \\boxed{...} answer")
      answer = given.strip()
    kind = row.get("type") or row.get("subject") or ""
    return {
        "id": str(row.get("unique_id") or example_id),
        "question": question,
        "answer": answer,
        "prompt": question,
        "solution": solution,
        "level": parse_level(row.get("level")),
        "type": str(kind),
    }
