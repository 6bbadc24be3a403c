"""Deterministic, resumable batches of examples from a random-access source.

Position ``p`` (examples consumed so far, over all epochs) maps to epoch ``p // n`` and index
``perm_epoch[p % n]``, where ``perm_epoch`` is a permutation seeded by ``(seed, epoch)``. Saving
``.position`` in a checkpoint and building a new iterator with it continues the exact sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class PromptIterator:
  """Endless global batches of ``batch_size`` examples, reshuffled every epoch.

  With ``num_shards > 1`` (one shard per host) each call returns shard ``shard_index``'s
  contiguous slice of the global batch; ``.position`` counts global examples, the same on every host.
  """

  def __init__(
      self,
      source: Sequence[Any],
      batch_size: int,
      seed: int,
      position: int = 0,
      *,
      shuffle: bool = True,
      num_shards: int = 1,
      shard_index: int = 0,
  ):
    self.num_examples = len(source)
    if self.num_examples == 0:
      raise ValueError("PromptIterator: the source has no examples")
    if batch_size < 1 or batch_size % num_shards:
      raise ValueError(f"PromptIterator: batch_size={batch_size} must be >= 1 and divisible by num_shards={num_shards}")
    if not 0 <= shard_index < num_shards:
      raise ValueError(f"PromptIterator: shard_index={shard_index} not in [0, {num_shards})")
    if int(position) != position or position < 0:
      raise ValueError(f"PromptIterator: position must be a non-negative int, got {position!r}")
    self.source = source
    self.batch_size = batch_size
    self.seed = int(seed)
    self.position = int(position)
    self.shuffle = shuffle
    self.num_shards = num_shards
    self.shard_index = shard_index
    self._perm_epoch = -1
    self._perm = np.arange(self.num_examples)

  @property
  def epoch(self) -> int:
    return self.position // self.num_examples

  def _permutation(self, epoch: int) -> np.ndarray:
    if self.shuffle and epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
      self._perm_epoch = epoch
    return self._perm

  def indices(self, position: int) -> list[int]:
    """Source indices of the (global) batch that starts at ``position``."""
    out = []
    for p in range(position, position + self.batch_size):
      epoch, k = divmod(p, self.num_examples)
      out.append(int(self._permutation(epoch)[k]))
    return out

  def __iter__(self) -> PromptIterator:
    return self

  def __next__(self) -> list[Any]:
    idx = self.indices(self.position)
    per_shard = self.batch_size // self.num_shards
    mine = idx[self.shard_index * per_shard : (self.shard_index + 1) * per_shard]
    self.position += self.batch_size
    return [self.source[i] for i in mine]
