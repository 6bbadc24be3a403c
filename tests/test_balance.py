"""The host's plan of the rows moved between row shards at a compaction (`sampling/balance.py`),
against brute force over every way to move the rows and against layouts worked by hand."""

import itertools

import numpy as np
import pytest

from ict_jax.sampling import balance, compacted_rows


def _after(live, flows):
  return np.asarray(live) + balance.moves(flows).kept


def _best_by_search(live, total, cap):
  """(the lowest fullest shard, the fewest rows moved to reach it) over every flows within +-cap an
  edge, each shard sending no more live rows than it has and taking in no more than its finished
  rows (no move at all when none lowers the fullest shard)."""
  best = (max(live), 0)
  for flows in itertools.product(range(-cap, cap + 1), repeat=len(live) - 1):
    m = balance.moves(np.array(flows))
    if np.any(m.send_right + m.send_left > live) or np.any(m.from_left + m.from_right > total - np.asarray(live)):
      continue
    best = min(best, (int(_after(live, flows).max()), int(np.abs(flows).sum())))
  return best


@pytest.mark.parametrize("seed", range(40))
def test_flows_reach_the_fullest_shard_brute_force_finds(seed):
  """Random live counts on 2-5 shards: the flows keep every row (sums equal), stay within the cap
  and the shards' rows, and leave the fullest shard as low as the best of all flows within the
  cap (`_best_by_search`)."""
  rng = np.random.default_rng(seed)
  shards, total = int(rng.integers(2, 6)), int(rng.integers(2, 9))
  live = rng.integers(0, total + 1, shards)
  cap = int(rng.integers(1, 4))
  flows = balance.edge_flows(live, total, cap)
  m = balance.moves(flows)
  after = _after(live, flows)
  assert after.sum() == live.sum() and np.all(np.abs(flows) <= cap)
  assert np.all(m.send_right + m.send_left <= live) and np.all(m.from_left + m.from_right <= total - live)
  assert (after.max(), np.abs(flows).sum()) == _best_by_search(live, total, cap), (live, total, cap, flows)


def test_plan_moves_rows_only_when_fewer_are_kept():
  """4 rows a shard (units of 1 row): live (4, 1, 1) moves 2 then 1 row right, every shard keeps
  2 (4 without the moves); live (3, 2, 2) could only even out to (3, 2, 2) again: no move, 3 kept."""
  keep, flows, sent = balance.plan(np.array([4, 1, 1]), 4, cap=2)
  assert keep == 2 and flows.tolist() == [2, 1] and sent == 2
  keep, flows, sent = balance.plan(np.array([3, 2, 2]), 4, cap=2)
  assert keep == 3 and flows.tolist() == [0, 0] and sent == 0
  one = balance.plan(np.array([5]), 8, cap=0)
  assert one.keep == compacted_rows(5, 8) and one.flows.size == 0 and one.sent == 0
  assert balance.plan(np.array([4, 1, 1]), 4, cap=2).counts.tolist() == [[2, 1, 0], [0, 0, 0], [0, 2, 1], [0, 0, 0]]


def test_rows_after_lays_the_rows_out_as_worked_by_hand():
  """Shards of 4 rows [a0..a3], [b0..b3], [c0..c3] (live first), live (4, 1, 1), flows (2, 1):
  shard 0 keeps a0 a1 and sends a2 a3 right; shard 1 takes them in and sends b0 right; shard 2
  keeps c0 then b0. Every shard computes 2 rows, all live."""
  ordered = np.array([[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]])
  rows, held = balance.rows_after(ordered, np.array([4, 1, 1]), np.array([2, 1]), 2)
  assert rows.tolist() == [[0, 1], [2, 3], [20, 10]] and held.all()


def test_rows_after_marks_the_slots_past_the_live_rows():
  """Live (1, 4) on 4-row shards, flows (-1,), 3 kept: shard 0 keeps a0, takes b3 (shard 1's last
  live row, sent left) and then its first finished row a1; shard 1 keeps b0 b1 b2 and, having no
  finished row among its 4, repeats its last one (b3, gone) marked finished."""
  ordered = np.array([[0, 1, 2, 3], [10, 11, 12, 13]])
  rows, held = balance.rows_after(ordered, np.array([1, 4]), np.array([-1]), 3)
  assert rows.tolist() == [[0, 13, 1], [10, 11, 12]] and held.tolist() == [[True, True, False], [True] * 3]
  rows, held = balance.rows_after(ordered, np.array([1, 4]), np.array([-1]), 4)
  assert rows.tolist() == [[0, 13, 1, 2], [10, 11, 12, 13]]
  assert held.tolist() == [[True, True, False, False], [True, True, True, False]]
