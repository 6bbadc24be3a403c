"""Evaluation-only benchmarks from the user's local files (tfds ``manual_dir``), one split ``test``.

``math500``   MATH-500 (HuggingFaceH4/MATH-500): rows like MATH's (``problem``, ``solution``, ``answer``).
``aime``      AIME problems, configs ``2023``, ``2024``, ``2025`` (``all`` keeps every row): fields
              ``problem`` and ``answer`` (``Problem``/``question``, ``Answer`` accepted); rows that
              name another year (a ``year`` field, or a year in ``url`` / ``ID`` / ``id``) are left out.
``mmlu_stem`` MMLU (cais/mmlu layout: ``question``, ``choices`` list, ``answer`` index or letter,
              ``subject``, or the subject as the sub-folder name), restricted to STEM_SUBJECTS.
``gpqa``      GPQA (``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``), the four options
              shuffled per question by a seed (config ``seed``) and the crc32 of the question.

Multiple-choice questions carry their options in ``question`` and ``prompt`` as lines
``(A) ...``; ``answer`` is the correct letter. Test-only benchmarks are often exported with their
only split named ``train`` (Hugging Face parquet): ``test*`` files are used when present, else
``train*`` files, and the examples form the split ``test`` either way, in file order.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ict_jax.data import readers
from ict_jax.data.manual import ManualFileBuilder
from ict_jax.data.math import Math

LETTERS = "ABCDEFGHIJ"

# MMLU's STEM category as lm-evaluation-harness groups it (mmlu_stem, 19 subjects).
STEM_SUBJECTS: frozenset[str] = frozenset(
    {
        "abstract_algebra",
        "anatomy",
        "astronomy",
        "college_biology",
        "college_chemistry",
        "college_computer_science",
        "college_mathematics",
        "college_physics",
        "computer_security",
        "conceptual_physics",
        "electrical_engineering",
        "elementary_mathematics",
        "high_school_biology",
        "high_school_chemistry",
        "high_school_computer_science",
        "high_school_mathematics",
        "high_school_physics",
        "high_school_statistics",
        "machine_learning",
    }
)


def format_choices(question: str, options: Sequence[str]) -> str:
  """The question, a blank line, then one ``(A) option`` line per option."""
  lines = [f"({LETTERS[i]}) {str(o).strip()}" for i, o in enumerate(options)]
  return question.strip() + "\n\n" + "\n".join(lines)


def _first_text(row: dict[str, Any], fields: Sequence[str]) -> str:
  """The first of ``fields`` present in ``row`` as stripped text (numbers accepted)."""
  for field in fields:
    value = row.get(field)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
      return str(int(value))
    if isinstance(value, str) and value.strip():
      return value.strip()
    if value is not None and not isinstance(value, str):
      raise readers.RowError(f"field {field!r} is {type(value).__name__}, expected a string")
  raise readers.RowError(f"missing field {' / '.join(map(repr, fields))} (row has {sorted(row)})")


def _ordered_info(builder: ManualFileBuilder) -> tfds.core.DatasetInfo:
  """DatasetInfo keeping the examples in file order (tfds shuffles by key hash otherwise), so
  ``--limit N`` takes a file's first N problems."""
  return builder.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(builder._features()),
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,
  )


class EvalFileBuilder(ManualFileBuilder, skip_registration=True):
  """One ``test`` split from the ``test*`` (else ``train*``) files; ``_keep`` filters rows silently
  (subset selection, not errors); filtered counts go to ``info.metadata["filtered_rows"]``."""

  SPLITS = ("test",)
  FILE_SPLITS: ClassVar[tuple[str, ...]] = ("test", "train")

  def _info(self) -> tfds.core.DatasetInfo:
    return _ordered_info(self)

  def _keep(self, row: dict[str, Any], file_name: str) -> bool:
    return True

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    root, files = readers.manual_split_files(
        dl_manager, self.name, self.FILE_SPLITS, self.SUBDIRS, self.MANUAL_DOWNLOAD_INSTRUCTIONS
    )
    paths = files[next(s for s in self.FILE_SPLITS if s in files)]
    return {"test": self._generate_examples(root, paths, "test")}

  def _generate_examples(self, root: Path, paths: list[Path], split: str) -> Iterator[tuple[str, dict]]:
    before = len(self.skipped.entries)
    kept = filtered = 0
    for path in paths:
      name = path.relative_to(root).as_posix()
      for row_no, row in readers.read_rows(path, name, self.skipped):
        if not self._keep(row, name):
          filtered += 1
          continue
        example_id = f"{self.name}/{name}:{row_no}"
        try:
          example = self._row_to_example(row, example_id)
        except readers.RowError as e:
          self.skipped.skip(name, row_no, str(e))
          continue
        kept += 1
        yield example_id, example
    skipped = self.skipped.entries[before:]
    self.info.metadata.setdefault("skipped_rows", {})[split] = list(skipped)
    self.info.metadata.setdefault("filtered_rows", {})[split] = filtered
    if kept == 0:
      names = [p.relative_to(root).as_posix() for p in paths]
      raise ValueError(
          f"{self.name} {split}: no usable row in {names} under {root} ({filtered} rows outside "
          f"the {self.builder_config.name if self.builder_config else 'selected'} subset, "
          f"{len(skipped)} skipped; first: {skipped[:3]})"
      )


class Math500(Math, skip_registration=True):
  """MATH-500, the 500-problem MATH test subset of "Let's Verify Step by Step"."""

  name = "math500"
  SPLITS = ("test",)
  SUBDIRS = ()
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put MATH-500's test.jsonl (github.com/openai/prm800k, prm800k/math_splits/test.jsonl, or the
    Hugging Face dataset HuggingFaceH4/MATH-500) into the manual directory. Each row needs
    "problem" and "solution" (or "answer"); "level" and "subject" are kept.
    """


# ---- AIME --------------------------------------------------------------------------------------
@dataclasses.dataclass
class AimeConfig(tfds.core.BuilderConfig):
  year: int = 0  # 0: every row


def row_year(row: dict[str, Any]) -> int | None:
  """The competition year a row names: its ``year`` field, else the first 19xx/20xx in its
  ``url``, ``ID`` or ``id``; None when it names none."""
  year = row.get("year", row.get("Year"))
  if year is not None and re.fullmatch(r"\s*\d{4}\s*", str(year)):
    return int(year)
  for field in ("url", "ID", "id"):
    match = re.search(r"(?<!\d)((?:19|20)\d{2})(?!\d)", str(row.get(field) or ""))
    if match:
      return int(match.group(1))
  return None


class Aime(EvalFileBuilder, skip_registration=True):
  """American Invitational Mathematics Examination problems (integer answers 0-999)."""

  name = "aime"
  VERSION = tfds.core.Version("1.0.0")
  SUBDIRS = ("*",)
  BUILDER_CONFIGS = [
      AimeConfig(name=str(y), description=f"AIME {y} (I and II)", year=y) for y in (2023, 2024, 2025)
  ] + [AimeConfig(name="all", description="every row")]
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put the AIME problems of the year into the manual directory as test.jsonl / train.jsonl or
    parquet (e.g. Hugging Face AI-MO/aimo-validation-aime, Maxwell-Jia/AIME_2024,
    yentinglin/aime_2025). Each row needs "problem" (or "Problem" / "question") and "answer"
    (or "Answer"); rows whose "year" / "url" / "ID" names another year are left out.
    """

  def _features(self) -> dict[str, Any]:
    return {
        "id": tfds.features.Text(),
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
        "year": tfds.features.Scalar(dtype=np.int32),
    }

  def _keep(self, row: dict[str, Any], file_name: str) -> bool:
    want, year = self.builder_config.year, row_year(row)
    return not want or year is None or year == want

  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    question = _first_text(row, ("problem", "Problem", "question"))
    answer = _first_text(row, ("answer", "Answer"))
    year = row_year(row) or self.builder_config.year
    return {
        "id": str(row.get("id") or row.get("ID") or example_id),
        "question": question,
        "answer": answer,
        "prompt": question,
        "year": year,
    }


# ---- MMLU-STEM ---------------------------------------------------------------------------------
def _options(value: Any, field: str) -> list[str]:
  if isinstance(value, np.ndarray):
    value = value.tolist()
  if not isinstance(value, (list, tuple)) or not 2 <= len(value) <= len(LETTERS):
    raise readers.RowError(f"field {field!r} must be a list of 2-{len(LETTERS)} options, got {value!r:.80}")
  out = [str(v).strip() for v in value]
  if not all(out):
    raise readers.RowError(f"field {field!r} has an empty option")
  return out


def answer_letter(value: Any, num_options: int) -> str:
  """Gold ``0``-based index or letter (``"C"``, ``"(c)"``) -> the letter; RowError otherwise."""
  s = value.strip().strip("()").strip().upper() if isinstance(value, str) else None
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    index = int(value)
  elif s and s.isdigit():
    index = int(s)
  elif s and len(s) == 1 and s in LETTERS:
    index = LETTERS.index(s)
  else:
    raise readers.RowError(f"field 'answer' must be an option index or letter, got {value!r}")
  if not 0 <= index < num_options:
    raise readers.RowError(f"field 'answer' {value!r} is not one of the {num_options} options")
  return LETTERS[index]


class MmluStem(EvalFileBuilder, skip_registration=True):
  """MMLU (Hendrycks et al. 2021) test questions of the STEM subjects."""

  name = "mmlu_stem"
  VERSION = tfds.core.Version("1.0.0")
  SUBDIRS = ("*",)
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put MMLU's test split in the Hugging Face cais/mmlu layout into the manual directory: either
    all/test-00000-of-00001.parquet (every subject, filtered to STEM here) or one sub-folder per
    subject (abstract_algebra/test-....parquet, ...), not both. Each row needs "question",
    "choices" (a list of options) and "answer" (index 0-3 or letter); "subject" (or the
    sub-folder name) selects the STEM subjects.
    """

  def _features(self) -> dict[str, Any]:
    return {
        "id": tfds.features.Text(),
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
        "subject": tfds.features.Text(),
    }

  @staticmethod
  def _subject(row: dict[str, Any], file_name: str) -> str:
    return str(row.get("subject") or PurePosixPath(file_name).parent.name or "")

  def _keep(self, row: dict[str, Any], file_name: str) -> bool:
    subject = self._subject(row, file_name)
    row["subject"] = subject
    return subject in STEM_SUBJECTS or subject in ("", ".")  # no subject given: kept

  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    question = readers.require_text(row, "question")
    if "choices" not in row:
      raise readers.RowError(f"missing field 'choices' (row has {sorted(row)})")
    options = _options(row["choices"], "choices")
    text = format_choices(question, options)
    return {
        "id": example_id,
        "question": text,
        "answer": answer_letter(row.get("answer"), len(options)),
        "prompt": text,
        "subject": str(row.get("subject", "")),
    }


# ---- GPQA --------------------------------------------------------------------------------------
@dataclasses.dataclass
class GpqaConfig(tfds.core.BuilderConfig):
  seed: int = 0


def shuffled_options(question: str, correct: str, incorrect: Sequence[str], seed: int) -> tuple[list[str], str]:
  """Options in an order fixed by ``(seed, crc32(question))`` and the letter of ``correct``."""
  options = [correct, *incorrect]
  order = np.random.default_rng([seed, zlib.crc32(question.encode("utf-8"))]).permutation(len(options))
  return [options[i] for i in order], LETTERS[int(np.flatnonzero(order == 0)[0])]


class Gpqa(EvalFileBuilder, skip_registration=True):
  """GPQA graduate-level science questions (Rein et al. 2023), four shuffled options."""

  name = "gpqa"
  VERSION = tfds.core.Version("1.0.0")
  SUBDIRS = ("*",)
  BUILDER_CONFIGS = [GpqaConfig(name="default", description="options shuffled with seed 0")]
  MANUAL_DOWNLOAD_INSTRUCTIONS = """
    Put one GPQA subset (the paper reports GPQA-Diamond) into the manual directory as JSON Lines
    or parquet, e.g. the Hugging Face dataset Idavidrein/gpqa's gpqa_diamond/train-*.parquet
    (CSV files: convert first). Each row needs "Question", "Correct Answer" and
    "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3".
    """

  def _features(self) -> dict[str, Any]:
    return {
        "id": tfds.features.Text(),
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
        "domain": tfds.features.Text(),
    }

  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    question = readers.require_text(row, "Question").strip()
    correct = readers.require_text(row, "Correct Answer").strip()
    wrong = [readers.require_text(row, f"Incorrect Answer {i}").strip() for i in (1, 2, 3)]
    options, letter = shuffled_options(question, correct, wrong, self.builder_config.seed)
    text = format_choices(question, options)
    domain = row.get("Subdomain") or row.get("High-level domain") or ""
    return {
        "id": str(row.get("Record ID") or example_id),
        "question": text,
        "answer": letter,
        "prompt": text,
        "domain": str(domain),
    }
