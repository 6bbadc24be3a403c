"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that a
random k-subset holds at least one correct sample. The ratio of binomials is computed as the
product prod_{i=n-c+1}^{n} (1 - k / i), which never forms a huge integer or a 0/0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one problem: ``n`` samples, ``c`` of them correct, ``1 <= k <= n``."""
  n, c, k = int(n), int(c), int(k)
  if n < 1 or not 0 <= c <= n:
    raise ValueError(f"pass_at_k: need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
  if n - c < k:  # every k-subset contains a correct sample
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct_counts: Sequence[int], n: int | Sequence[int], k: int) -> float:
  """Mean of ``pass_at_k`` over problems; ``n`` is one sample count for all or one per problem."""
  counts = np.asarray(correct_counts, dtype=np.int64).reshape(-1)
  if counts.size == 0:
    raise ValueError("mean_pass_at_k: correct_counts is empty")
  ns = np.broadcast_to(np.asarray(n, dtype=np.int64), counts.shape)
  return float(np.mean([pass_at_k(ni, ci, k) for ni, ci in zip(ns, counts)]))


def pass_at_k_curve(correct_counts: Sequence[int], n: int, ks: Sequence[int] | None = None) -> np.ndarray:
  """``mean_pass_at_k`` at each k of ``ks`` (default 1..n), as a float64 array: the pass@k curve
  of one run from its per-problem correct counts out of ``n`` samples."""
  ks = range(1, int(n) + 1) if ks is None else ks
  return np.array([mean_pass_at_k(correct_counts, n, k) for k in ks], dtype=np.float64)
