"""pass@k estimator against exact binomials and against enumerating every k-subset."""

import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from ict_jax.eval.passk import mean_pass_at_k, pass_at_k, pass_at_k_curve


def _exact(n: int, c: int, k: int) -> Fraction:
  return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def _enumerated(n: int, c: int, k: int) -> Fraction:
  correct = set(range(c))
  subsets = list(itertools.combinations(range(n), k))
  hits = sum(1 for s in subsets if correct.intersection(s))
  return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matches_enumeration_of_all_subsets(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      want = _enumerated(n, c, k)
      assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12), (n, c, k)


def test_matches_exact_binomials_for_large_n():
  rng = random.Random(0)
  for _ in range(300):
    n = rng.randint(1, 1000)
    c = rng.randint(0, n)
    k = rng.randint(1, n)
    want = float(_exact(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-9, abs=1e-12), (n, c, k)


def test_special_cases():
  assert pass_at_k(10, 0, 5) == 0.0
  assert pass_at_k(10, 10, 1) == 1.0
  assert pass_at_k(10, 6, 5) == 1.0  # n - c < k: every 5-subset holds a correct sample
  for n, c in [(7, 3), (100, 37), (16, 1)]:
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)  # pass@1 is the accuracy
  # huge n where C(n, k) overflows float64; the product form stays finite and exact enough
  assert pass_at_k(100_000, 1, 50_000) == pytest.approx(0.5, abs=1e-9)
  assert np.isfinite(pass_at_k(10_000, 3, 5_000))


def test_monotone_in_k_and_c():
  n = 20
  for c in range(n + 1):
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(b >= a - 1e-15 for a, b in zip(values, values[1:]))
  for k in (1, 4, 8):
    values = [pass_at_k(n, c, k) for c in range(n + 1)]
    assert all(b >= a - 1e-15 for a, b in zip(values, values[1:]))


def test_mean_pass_at_k():
  counts = [0, 3, 8, 1]
  want = np.mean([float(_exact(8, c, 4)) for c in counts])
  assert mean_pass_at_k(counts, 8, 4) == pytest.approx(want, abs=1e-12)
  per_problem_n = [8, 10, 12, 4]
  want = np.mean([float(_exact(n, c, 4)) for n, c in zip(per_problem_n, counts)])
  assert mean_pass_at_k(counts, per_problem_n, 4) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_invalid_arguments(n, c, k):
  with pytest.raises(ValueError, match="pass_at_k"):
    pass_at_k(n, c, k)


def test_mean_pass_at_k_rejects_empty():
  with pytest.raises(ValueError, match="empty"):
    mean_pass_at_k([], 4, 1)


def test_curve_to_64_is_the_exact_mean_and_monotone():
  """pass@k for k = 1..64 of known per-problem counts out of 64: the exact binomial mean at every
  k, non-decreasing in k, pass@1 the mean success rate and pass@64 the share of problems solved."""
  counts = [0, 1, 2, 7, 32, 63, 64]
  curve = pass_at_k_curve(counts, 64)
  want = [float(sum(_exact(64, c, k) for c in counts) / len(counts)) for k in range(1, 65)]
  assert curve.shape == (64,) and np.allclose(curve, want, rtol=0, atol=1e-12)
  assert np.all(np.diff(curve) >= -1e-15)
  assert curve[0] == pytest.approx(np.mean(counts) / 64) and curve[-1] == pytest.approx(6 / 7)
  assert pass_at_k_curve(counts, 64, [4, 16]) == pytest.approx([want[3], want[15]])
