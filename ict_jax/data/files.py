"""`data.name = "files"`: a split read from the user's own files, TRL style.

    src = load_files("data/train-*.jsonl,extra.parquet", prompt_field="prompt", answer_field="solution")
    src[0] -> {"prompt": "...", "answer": "...", "id": "data/train-0.jsonl:1", <every other column>}

A spec is comma-separated; each item is a path or a glob of `.jsonl` / `.json` / `.parquet` files, or
`hf:NAME[:SPLIT]` (`hf:NAME:CONFIG:SPLIT` for a dataset with configs) loaded with
`datasets.load_dataset(NAME, CONFIG, split=SPLIT)`: a hub id (downloaded when online, from the
`datasets` cache offline) or a local folder of data files; SPLIT defaults to the split being read
(data.train_split / data.eval_split).

Each row becomes an example (`FileExample`, a dict) whose "prompt" is the `prompt_field` column
(a string, or TRL's conversational format: a list of chat messages `[{"role", "content"}]`), whose
"answer" is the `answer_field` column (a string, or a number as its text: what the built-in rewards
and pass@k compare against) and which keeps every column of the row as it is, with an "id"
(`file:line`) when the row has none. A row missing either field, or holding null or another type
there, is skipped, logged with its file and line and counted (`FileSource.skipped`, as the tfds
builders' `readers.SkipLog`). A glob matching nothing, an unknown extension, a file that cannot be
read or has no usable row is one `ConfigError` naming it and the key.

JSON Lines and JSON files are read line by line by `readers.read_rows`, which skips a line that is
not JSON or not UTF-8 with its line number; `datasets`' JSON loader fails the whole file at such a
line without naming it, and reads a column holding strings and numbers as JSON (the string "1"
comes back as the number 1). Parquet files and `hf:` datasets go through `datasets.load_dataset`
(rows numbered from 1).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ict_jax.data import readers
from ict_jax.errors import ConfigError

FILES = "files"  # the data.name that reads data.train_files / data.eval_files
SUFFIXES = readers.JSON_SUFFIXES + readers.PARQUET_SUFFIXES
HF_PREFIX = "hf:"


class FileExample(dict):
  """A row of a file split. Its prompt is "prompt" in either prompt style (a tfds example's
  chat prompt is its "question"), so a "question" column of the user's stays a column."""


@dataclasses.dataclass
class FileSource:
  """Random access to the examples of a file split; `skipped` holds the rows left out."""

  examples: list[FileExample]
  skipped: readers.SkipLog
  files: list[str]  # the files (and hf: datasets) read, in order

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, index: int) -> FileExample:
    return FileExample(self.examples[index])  # a copy: a consumer's edit stays its own

  def __getitems__(self, indices: Iterable[int]) -> list[FileExample]:
    return [self[i] for i in indices]


def _check_messages(value: list, field: str) -> None:
  if not value:
    raise readers.RowError(f"field {field!r} is an empty list, expected chat messages")
  chars = 0
  for k, m in enumerate(value):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise readers.RowError(
          f"field {field!r}[{k}] is not a chat message {{'role': str, 'content': str}} (got {str(m)[:80]!r})"
      )
    chars += len(m["content"])
  if chars > readers.MAX_FIELD_CHARS:
    raise readers.RowError(f"field {field!r} has {chars:,} characters, over the limit of {readers.MAX_FIELD_CHARS:,}")


def _not_null(row: dict[str, Any], field: str) -> Any:
  if field in row and row[field] is None:
    raise readers.RowError(f"field {field!r} is null")
  return row.get(field)


def prompt_of(row: dict[str, Any], field: str) -> str | list:
  """The row's prompt: a non-empty string or a list of chat messages; RowError otherwise."""
  value = _not_null(row, field)
  if isinstance(value, list):
    _check_messages(value, field)
    return value
  if value is not None and not isinstance(value, str):
    raise readers.RowError(f"field {field!r} is {type(value).__name__}, expected a string or a list of chat messages")
  return readers.require_text(row, field)


def answer_of(row: dict[str, Any], field: str) -> str:
  """The row's answer as text: a non-empty string, or a finite number's text; RowError otherwise."""
  value = _not_null(row, field)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if not math.isfinite(value):
      raise readers.RowError(f"field {field!r} is {value}, expected a string or a finite number")
    return str(value)
  if value is not None and not isinstance(value, str):
    raise readers.RowError(f"field {field!r} is {type(value).__name__}, expected a string or a number")
  return readers.require_text(row, field)


def to_example(row: dict[str, Any], where: str, *, prompt_field: str, answer_field: str) -> FileExample:
  """One row -> its example (every column kept; "prompt", "answer" and, when absent, "id" set)."""
  prompt, answer = prompt_of(row, prompt_field), answer_of(row, answer_field)
  example = FileExample(row)
  example.update(prompt=prompt, answer=answer)
  if example.get("id") is None:
    example["id"] = where
  return example


def expand(spec: str, what: str) -> list[str]:
  """The items of a comma-separated spec: `hf:` items as they are, each path or glob as the files
  it matches (sorted; each once). ConfigError naming `what` (the setting) for a glob that matches nothing, a
  folder or an unknown extension."""
  items: list[str] = []
  for item in (part.strip() for part in spec.split(",")):
    if not item:
      raise ConfigError(f"{what}: an empty item in {spec!r} (expected comma-separated paths or globs)")
    if item.startswith(HF_PREFIX):
      items.append(item)
      continue
    path = os.path.expanduser(item)
    if any(c in path for c in "*?["):
      matches = sorted(glob.glob(path, recursive=True))
      if not matches:
        raise ConfigError(f"{what}: no file matches {item!r}")
    elif not os.path.exists(path):
      raise ConfigError(f"{what}: {item}: no such file")
    else:
      matches = [path]
    for match in matches:
      if os.path.isdir(match):
        raise ConfigError(f"{what}: {match} is a folder; name its files (e.g. {match}/*.jsonl) or hf:{match}")
      if Path(match).suffix not in SUFFIXES:
        raise ConfigError(
            f"{what}: {match}: unsupported file type {Path(match).suffix!r}; expected .jsonl, .json or "
            ".parquet (or hf:NAME[:SPLIT] for a Hugging Face dataset)"
        )
      if match not in items:
        items.append(match)
  return items


def parse_hf(item: str, default_split: str) -> tuple[str, str | None, str]:
  """`hf:NAME[:SPLIT]` or `hf:NAME:CONFIG:SPLIT` -> (NAME, CONFIG or None, SPLIT)."""
  parts = item[len(HF_PREFIX) :].split(":")
  if len(parts) > 3 or not all(parts):
    raise ValueError(f"{item!r}: expected hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
  if len(parts) == 3:
    return parts[0], parts[1], parts[2]
  return parts[0], None, parts[1] if len(parts) == 2 else default_split


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _dataset_rows(item: str, what: str, default_split: str) -> Iterator[tuple[int, dict[str, Any]]]:
  """Rows of a Parquet file or an `hf:` dataset, through `datasets.load_dataset`, numbered from 1."""
  import datasets

  try:
    if item.startswith(HF_PREFIX):
      name, config, split = parse_hf(item, default_split)
      ds = datasets.load_dataset(name, config, split=split)
    else:
      ds = datasets.load_dataset("parquet", data_files=[item], split="train")
  except Exception as e:  # datasets raises many types (not found, no such split, corrupt file, offline)
    raise ConfigError(f"{what}: {item}: cannot load ({_first_line(e)})") from None
  if len(ds) == 0:
    raise ConfigError(f"{what}: {item} is empty: it has no rows")
  yield from enumerate(ds, start=1)


def _rows(item: str, what: str, default_split: str, skips: readers.SkipLog) -> Iterator[tuple[int, dict[str, Any]]]:
  if item.startswith(HF_PREFIX) or Path(item).suffix in readers.PARQUET_SUFFIXES:
    yield from _dataset_rows(item, what, default_split)
    return
  try:  # the reader's errors (an empty file, a broken JSON array); not the caller's RowErrors
    yield from readers.read_rows(Path(item), item, skips)
  except ValueError as e:
    raise ConfigError(f"{what}: {e}") from None


def load_files(
    spec: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    default_split: str = "train",
    what: str = "config.data.train_files",
    dataset: str = "files train",
) -> FileSource:
  """The examples of every file of `spec` (module docstring), in order. `what` names the setting
  in errors, `dataset` the split in the skipped rows' warnings."""
  skips, examples = readers.SkipLog(dataset), []
  items = expand(spec, what)
  for item in items:
    kept, before = 0, skips.count(item)
    for line, row in _rows(item, what, default_split, skips):
      try:
        examples.append(to_example(row, f"{item}:{line}", prompt_field=prompt_field, answer_field=answer_field))
        kept += 1
      except readers.RowError as e:
        skips.skip(item, line, str(e))
    skipped = skips.count(item) - before
    if kept == 0:
      first = next((e for e in skips.entries if e["file"] == item), None)
      why = f"; line {first['row']}: {first['reason']}" if first else ""
      raise ConfigError(
          f"{what}: {item} has no usable row ({skipped} skipped{why}); each row needs "
          f"{prompt_field!r} (data.prompt_field) and {answer_field!r} (data.answer_field)"
      )
    if skipped:
      readers.logger.warning("%s: %s: kept %d rows, skipped %d", dataset, item, kept, skipped)
  return FileSource(examples, skips, items)


@dataclasses.dataclass(frozen=True)
class FileSplit:
  """A split of files: `spec` (module docstring), its columns, the split an `hf:` item without one
  reads and the setting that named it (for errors)."""

  spec: str
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  split: str = "train"
  what: str = "config.data.train_files"

  def load(self) -> FileSource:
    """The examples (none when `spec` is empty)."""
    dataset = f"files {self.split}"
    if not self.spec:
      return FileSource([], readers.SkipLog(dataset), [])
    return load_files(
        self.spec,
        prompt_field=self.prompt_field,
        answer_field=self.answer_field,
        default_split=self.split,
        what=self.what,
        dataset=dataset,
    )


def config_split(data, split: str) -> FileSplit:
  """The split `split` of a run whose data.name is "files" (`data`: its DataConfig): the files of
  data.train_files for data.train_split, of data.eval_files for data.eval_split (none given: no
  example; the config's checks require them where a run evaluates)."""
  if split == data.train_split:
    key = "train_files"
  elif split == data.eval_split:
    key = "eval_files"
  else:
    raise ConfigError(
        f"config.data.name='files': split {split!r} is neither data.train_split ({data.train_split!r}, "
        f"read from data.train_files) nor data.eval_split ({data.eval_split!r}, read from data.eval_files)"
    )
  return FileSplit(getattr(data, key), data.prompt_field, data.answer_field, split, f"config.data.{key}")
