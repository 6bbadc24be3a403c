"""Datasets as tensorflow-datasets builders (array_record files, read without TensorFlow).

    src = load_split("synthetic_arith", "train", data_dir)            # builds on first use
    src = load_split("gsm8k", "test", data_dir, manual_dir="~/gsm8k")  # from the user's files
    src = load_files("train.jsonl", prompt_field="prompt", answer_field="solution")  # data.name="files"
    src[0] -> {"id": ..., "question": ..., "answer": ..., "prompt": ..., ...}   (str / int values)
    for batch in PromptIterator(src, batch_size=8, seed=0): ...

Nothing is imported at import time; tensorflow_datasets loads on the first build.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

# name -> (module, builder class); a name may carry a config, e.g. "synthetic_arith/level2".
BUILDERS: dict[str, tuple[str, str]] = {
    "synthetic_arith": ("ict_jax.data.synthetic", "SyntheticArith"),
    "synthetic_chain": ("ict_jax.data.chain", "SyntheticChain"),
    "gsm8k": ("ict_jax.data.gsm8k", "Gsm8k"),
    "math": ("ict_jax.data.math", "Math"),
    "math500": ("ict_jax.data.eval_sets", "Math500"),
    "aime": ("ict_jax.data.eval_sets", "Aime"),
    "mmlu_stem": ("ict_jax.data.eval_sets", "MmluStem"),
    "gpqa": ("ict_jax.data.eval_sets", "Gpqa"),
}

_LAZY = {
    "PromptIterator": "ict_jax.data.iterator",
    "format_prompt": "ict_jax.data.prompts",
    "build_prompt": "ict_jax.data.prompts",
    "MATH_INSTRUCTION": "ict_jax.data.prompts",
    "load_files": "ict_jax.data.files",
}


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'ict_jax.data' has no attribute {name!r}")
  return getattr(importlib.import_module(_LAZY[name]), name)


def builder_class(name: str) -> type:
  """The tfds builder class registered as ``name`` (without a ``/config`` suffix)."""
  if name not in BUILDERS:
    raise KeyError(f"unknown dataset {name!r}; known: {sorted(BUILDERS)}, or 'files' (data.train_files)")
  module, cls = BUILDERS[name]
  return getattr(importlib.import_module(module), cls)


def make_builder(name: str, data_dir: str | os.PathLike | None = None, config: Any = None):
  """An (unprepared) builder for ``name`` or ``name/config`` writing under ``data_dir``;
  ``config`` is a config name or a ``tfds.core.BuilderConfig`` (e.g. a custom seed)."""
  base, _, suffix = name.partition("/")
  if suffix and config is not None and suffix != config:
    raise ValueError(f"dataset {name!r} names config {suffix!r} but config={config!r} was given")
  kwargs: dict[str, Any] = {"data_dir": os.fspath(data_dir) if data_dir is not None else None}
  if suffix or config is not None:
    kwargs["config"] = suffix or config
  return builder_class(base)(**kwargs)


def prepare(name: str, data_dir=None, manual_dir=None, config: Any = None):
  """Build ``name`` if ``data_dir`` does not hold it yet (tfds reuses a finished build) and
  return the builder. Files for gsm8k / math are read from ``manual_dir`` (tfds default:
  ``<data_dir>/downloads/manual``)."""
  import tensorflow_datasets as tfds

  builder = make_builder(name, data_dir, config)
  download_config = tfds.download.DownloadConfig(
      manual_dir=os.fspath(os.path.expanduser(manual_dir)) if manual_dir is not None else None,
      try_download_gcs=False,
  )
  builder.download_and_prepare(download_config=download_config)
  return builder


def load_split(name: str, split: str, data_dir=None, manual_dir=None, config: Any = None) -> ExampleSource:
  """Random-access examples of one split (building the dataset first when needed)."""
  builder = prepare(name, data_dir, manual_dir, config)
  base_split = split.split("[", 1)[0]
  if base_split not in builder.info.splits:
    raise KeyError(
        f"{builder.info.full_name} has no split {base_split!r}; it has {sorted(builder.info.splits)} "
        f"(built under {builder.data_dir})"
    )
  return ExampleSource(builder.as_data_source(split=split))


def _to_python(value: Any) -> Any:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if hasattr(value, "shape") and getattr(value, "shape", None) == ():
    return value.item()
  return value


class ExampleSource:
  """A tfds data source whose examples come back as dicts of ``str`` / ``int`` values."""

  def __init__(self, source: Any):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    n = len(self.source)
    if not -n <= index < n:
      raise IndexError(f"example {index} out of range for {n} examples")
    return {k: _to_python(v) for k, v in self.source[index % n].items()}

  def __getitems__(self, indices: Iterable[int]) -> list[dict[str, Any]]:
    return [self[i] for i in indices]

  def __repr__(self) -> str:
    return f"ExampleSource({self.source!r})"
