"""Reading user-downloaded JSON Lines / Parquet files row by row, skipping and counting bad rows.

A bad row (invalid JSON, bytes that are not UTF-8, not an object, a required field missing,
empty or over ``MAX_FIELD_CHARS`` characters) is skipped, logged as a warning with ``file:row``
and recorded in a :class:`SkipLog`; it never stops a build. An empty file, or a split whose files
yield no usable row, is an error that names the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("ict_jax.data")

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
MAX_WARNINGS_PER_FILE = 20
# A text field longer than this is a broken or hostile row, not a prompt: no token budget fits it,
# and tokenizing it would stall every step that draws it (tens of seconds for 10 MB).
MAX_FIELD_CHARS = 1 << 20


class RowError(ValueError):
  """A row that cannot become an example; the message says why."""


@dataclasses.dataclass
class SkipLog:
  """Skipped rows of one dataset build: ``entries`` holds ``{"file", "row", "reason"}`` dicts."""

  dataset: str
  entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def skip(self, file: str, row: int, reason: str) -> None:
    self.entries.append({"file": file, "row": row, "reason": reason})
    in_file = sum(1 for e in self.entries if e["file"] == file)
    if in_file <= MAX_WARNINGS_PER_FILE:
      logger.warning("%s: skipping %s:%d: %s", self.dataset, file, row, reason)
    elif in_file == MAX_WARNINGS_PER_FILE + 1:
      logger.warning("%s: more skipped rows in %s; the rest are counted, not logged", self.dataset, file)

  def count(self, file: str | None = None) -> int:
    return sum(1 for e in self.entries if file is None or e["file"] == file)


def find_split_files(root: Path, split: str, subdirs: Sequence[str] = ()) -> list[Path]:
  """Files for ``split`` directly in ``root`` (``{split}.jsonl``, ``{split}-00000-of-00001.parquet``,
  ...); if there are none, in the sub-folders matching the glob patterns ``subdirs``."""

  def match(folder: Path) -> list[Path]:
    found = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
      if path.is_file() and path.suffix in JSON_SUFFIXES + PARQUET_SUFFIXES:
        stem = path.name[: -len(path.suffix)]
        if stem == split or stem.startswith(split + "-"):
          found.append(path)
    return found

  files = match(root)
  if not files:
    for pattern in subdirs:
      for folder in sorted(p for p in root.glob(pattern) if p.is_dir()):
        files.extend(match(folder))
  return files


def read_rows(path: Path, name: str, skips: SkipLog) -> Iterator[tuple[int, dict[str, Any]]]:
  """``(row number from 1, row dict)`` for every parseable row of a JSONL/JSON/Parquet file.

  ``name`` is how the file is named in messages (its path relative to the manual directory).
  """
  if path.suffix in PARQUET_SUFFIXES:
    yield from _read_parquet(path, name, skips)
  elif path.suffix in JSON_SUFFIXES:
    yield from _read_json(path, name, skips)
  else:
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected .jsonl, .json or .parquet")


def _read_json(path: Path, name: str, skips: SkipLog) -> Iterator[tuple[int, dict[str, Any]]]:
  data = path.read_bytes()
  if not data.strip():
    raise ValueError(f"{path} is empty: expected one JSON object per line")
  if path.suffix == ".json" and data.lstrip()[:1] == b"[":
    # a single JSON array of objects
    try:
      rows = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: not a valid JSON array ({e})") from None
    for row_no, row in enumerate(rows, start=1):
      if isinstance(row, dict):
        yield row_no, row
      else:
        skips.skip(name, row_no, f"element is {type(row).__name__}, not a JSON object")
    return
  for row_no, line in enumerate(data.split(b"\n"), start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
      skips.skip(name, row_no, f"not valid UTF-8 ({e.reason} at byte {e.start})")
      continue
    except json.JSONDecodeError as e:
      skips.skip(name, row_no, f"invalid JSON ({e.msg} at column {e.colno})")
      continue
    if not isinstance(row, dict):
      skips.skip(name, row_no, f"line is a JSON {type(row).__name__}, not an object")
      continue
    yield row_no, row


def _read_parquet(path: Path, name: str, skips: SkipLog) -> Iterator[tuple[int, dict[str, Any]]]:
  try:
    import pyarrow.parquet as pq
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"reading {path} needs pyarrow: pip install pyarrow") from e
  try:
    pf = pq.ParquetFile(os.fspath(path))
  except Exception as e:  # pyarrow raises several error types for a corrupt file
    raise ValueError(f"{path}: cannot read as Parquet ({e})") from None
  if pf.metadata.num_rows == 0:
    raise ValueError(f"{path} is empty: the Parquet file has no rows")
  row_no = 0
  for batch in pf.iter_batches(batch_size=1024):
    for row in batch.to_pylist():
      row_no += 1
      bad = [k for k, v in row.items() if isinstance(v, bytes) and not _is_utf8(v)]
      if bad:
        skips.skip(name, row_no, f"column {bad[0]!r} is not valid UTF-8")
        continue
      yield row_no, {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in row.items()}


def _is_utf8(b: bytes) -> bool:
  try:
    b.decode("utf-8")
    return True
  except UnicodeDecodeError:
    return False


def require_text(row: dict[str, Any], field: str) -> str:
  """``row[field]`` as a non-empty string, else :class:`RowError` naming the field."""
  if field not in row or row[field] is None:
    raise RowError(f"missing field {field!r} (row has {sorted(row)})")
  value = row[field]
  if not isinstance(value, str):
    raise RowError(f"field {field!r} is {type(value).__name__}, expected a string")
  if not value.strip():
    raise RowError(f"field {field!r} is empty")
  if len(value) > MAX_FIELD_CHARS:
    raise RowError(f"field {field!r} has {len(value):,} characters, over the limit of {MAX_FIELD_CHARS:,}")
  return value


def manual_split_files(
    dl_manager: Any, dataset: str, splits: Sequence[str], subdirs: Sequence[str], instructions: str
) -> tuple[Path, dict[str, list[Path]]]:
  """The manual directory of a tfds build and the files of each split found there.

  Raises FileNotFoundError, with the builder's instructions, when the directory is missing or
  empty, or holds no file for any of ``splits``.
  """
  try:
    root = Path(os.fspath(dl_manager.manual_dir))
  except AssertionError as e:  # tfds: "Manual directory X does not exist or is empty ..."
    raise FileNotFoundError(f"{dataset}: {e}") from None
  files = {s: find_split_files(root, s, subdirs) for s in splits}
  files = {s: f for s, f in files.items() if f}
  if not files:
    listing = sorted(p.name for p in root.iterdir())[:20]
    raise FileNotFoundError(
        f"{dataset}: no file for splits {list(splits)} in manual directory {root} "
        f"(it holds {listing}). {instructions.strip()}"
    )
  return root, files
