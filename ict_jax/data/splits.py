"""A run's splits from its config: `load_examples(cfg, split, workdir)` -> a random-access source,
and `fitting_prompts` (the train split without the prompts over `data.max_prompt_len` tokens)."""

from __future__ import annotations

import os

import jax
import numpy as np

from ict_jax import storage
from ict_jax.config import Config, ConfigError


def load_examples(cfg: Config, split: str, workdir: str):
  """The split as a random-access source; on several hosts process 0 builds it first."""
  from ict_jax.data import load_split

  data_dir = storage.data_dir(cfg.data.data_dir, workdir)
  manual_dir = os.path.expanduser(cfg.data.manual_dir) if cfg.data.manual_dir else None

  def load():
    sources = []
    for name in cfg.data.name.split("+"):
      try:
        sources.append(
            load_split(
                name,
                split,
                data_dir=data_dir,
                manual_dir=manual_dir,
                config=(cfg.data.config or None) if name == cfg.data.name else None,
            )
        )
      except (FileNotFoundError, KeyError, ValueError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) is quoted
        raise ConfigError(f"config.data.name={name!r}: {text}") from None
    return sources[0] if len(sources) == 1 else Concat(sources)

  if jax.process_count() == 1:
    return load()
  from jax.experimental import multihost_utils

  if jax.process_index() == 0:
    source = load()
  multihost_utils.sync_global_devices(f"ict_jax data {split}")
  return source if jax.process_index() == 0 else load()


class Concat:
  """Random access over several sources, one after the other."""

  def __init__(self, sources):
    self.sources, self.offsets = sources, np.cumsum([0] + [len(s) for s in sources])

  def __len__(self):
    return int(self.offsets[-1])

  def __getitem__(self, i):
    k = int(np.searchsorted(self.offsets, i, side="right") - 1)
    return self.sources[k][i - int(self.offsets[k])]


def fitting_prompts(cfg: Config, tok, train_src):
  """The train split without the prompts over data.max_prompt_len tokens (each logged with its
  file and row), so every rollout batch has prompts_per_step prompts and the step its rows."""
  from ict_jax.data.prompts import drop_long_prompts

  try:
    src, _ = drop_long_prompts(
        train_src,
        tok,
        style=cfg.data.prompt_style,
        max_len=cfg.data.max_prompt_len,
        dataset=f"{cfg.data.name} {cfg.data.train_split}",
    )
  except ValueError as e:
    raise ConfigError(f"config.data.max_prompt_len: {e}") from None
  return src
