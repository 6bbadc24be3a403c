"""GSM8K (Cobbe et al. 2021) from the user's local copy: fields ``question`` and ``answer``, the
final answer after ``####`` (thousands separators removed)."""

from __future__ import annotations

from typing import Any

import tensorflow_datasets as tfds

from ict_jax.data import readers
from ict_jax.data.manual import ManualFileBuilder


def final_answer(solution: str) -> str | None:
  """Text after the last ``####`` with commas and surrounding whitespace removed, or None."""
  if "####" not in solution:
    return None
  answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
  return answer or None


class Gsm8k(ManualFileBuilder, skip_registration=True):
  """GSM8K grade-school math word problems."""

  name = "gsm8k"
  VERSION = tfds.core.Version("1.0.0")
  SPLITS = ("train", "test")
  SUBDIRS = ("main",)
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put GSM8K's train.jsonl and test.jsonl (github.com/openai/grade-school-math,
    grade_school_math/data/) or train-*.parquet and test-*.parquet (Hugging Face dataset
    openai/gsm8k, config "main", also accepted inside a main/ sub-folder) into the manual
    directory. Each row needs the fields "question" and "answer" (the solution, whose final
    answer follows "####").
    """

  def _features(self) -> dict[str, Any]:
    return {
        "id": tfds.features.Text(),
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
        "solution": tfds.features.Text(),
    }

  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    question = readers.require_text(row, "question").strip()
    solution = readers.require_text(row, "answer")
    answer = final_answer(solution)
    if answer is None:
      raise readers.RowError("field 'answer' has no final answer after '####'")
    return {"id": example_id, "question": question, "answer": answer, "prompt": question, "solution": solution}
