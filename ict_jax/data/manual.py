"""Base tfds builder for datasets built from files the user put in the tfds ``manual_dir``.

A subclass names its splits, where to look for files, and how one row becomes an example
(raising :class:`~ict_jax.data.readers.RowError` for a row to skip). Skipped rows are logged,
kept on ``builder.skipped`` and saved in ``builder.info.metadata["skipped_rows"]``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import tensorflow_datasets as tfds

from ict_jax.data import readers


class ManualFileBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Examples from ``{split}*.jsonl|json|parquet`` files in the manual directory."""

  SPLITS: ClassVar[tuple[str, ...]] = ("train", "test")
  SUBDIRS: ClassVar[tuple[str, ...]] = ()  # sub-folder globs searched when the root has no file

  def __init__(self, *, file_format: str = "array_record", **kwargs: Any):
    super().__init__(file_format=file_format, **kwargs)
    self.skipped = readers.SkipLog(self.name)

  @abc.abstractmethod
  def _features(self) -> dict[str, Any]:
    """tfds feature spec of one example."""

  @abc.abstractmethod
  def _row_to_example(self, row: dict[str, Any], example_id: str) -> dict[str, Any]:
    """One file row -> example; raise ``readers.RowError`` to skip the row."""

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(self._features()),
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    root, files = readers.manual_split_files(
        dl_manager, self.name, self.SPLITS, self.SUBDIRS, self.MANUAL_DOWNLOAD_INSTRUCTIONS
    )
    return {split: self._generate_examples(root, paths, split) for split, paths in files.items()}

  def _generate_examples(self, root: Path, paths: list[Path], split: str) -> Iterator[tuple[str, dict]]:
    before = len(self.skipped.entries)
    kept = 0
    for path in paths:
      name = path.relative_to(root).as_posix()
      for row_no, row in readers.read_rows(path, name, self.skipped):
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
    if skipped:
      readers.logger.warning(
          "%s %s: kept %d rows, skipped %d (see builder.info.metadata['skipped_rows'])",
          self.name,
          split,
          kept,
          len(skipped),
      )
    if kept == 0:
      names = [p.relative_to(root).as_posix() for p in paths]
      raise ValueError(
          f"{self.name} {split}: no usable row in {names} under {root} "
          f"({len(skipped)} skipped; first: {skipped[:3]})"
      )
