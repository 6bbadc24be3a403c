"""Live rows evened out over the row shards at a compaction (issue 41): the host's plan.

`compact.py` drops the finished rows between stretches, and every row shard keeps as many rows as
the fullest one needs (one program for the mesh). Kept on their devices, the rows leave the fullest
shard ~1.13x the mean live rows on a rollout's length distribution, which every shard then
computes and reads. A few live rows moved between neighbouring shards even the counts out.

The shards are a line in the rows' ("data", "fsdp") order, and one exchange each way moves up to
`cap` rows across each edge (the static size of the buffers `compact._compact` sends, `move_cap`).
A shard sends only live rows of its own (a row crosses one edge a compaction), and for each live
row it takes in it gives back one of its finished output rows (the outputs [B, N] keep their rows
a shard). `edge_flows` finds the flows that leave the fewest live rows on the fullest shard, then
move the fewest; the moves are made only when they lower the rows every shard keeps (`plan`).

Which rows: a shard sorts its rows as the compaction keeps them (live first, longest prompt first),
sends its last live ones to the right and the ones before them to the left, keeps the rest of its
live rows at the front, puts the live rows it takes in after them (from the left, then from the
right), then its finished rows. `rows_after` is that layout in numpy: the rows the bound counts
(`aot.plan.stretch_batches`) and the tests' reference.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ict_jax.sampling.plan import compacted_rows

_MOVE_CAP = 8  # live rows an edge at a compaction, at most: 8 x a row's cache sent each way


def move_cap(shards: int, rows_per_shard: int) -> int:
  """The rows an edge may carry at a compaction: min(8, half a shard's rows); 0 on one shard."""
  return 0 if shards < 2 else min(_MOVE_CAP, max(1, rows_per_shard // 2))


class Moves(NamedTuple):
  """A compaction's moves, each [S] int: the live rows shard s sends to its right and left
  neighbours and takes in from its left and right ones."""

  send_right: np.ndarray
  send_left: np.ndarray
  from_left: np.ndarray
  from_right: np.ndarray

  @property
  def kept(self) -> np.ndarray:
    """[S] the live rows a shard holds after the moves (before them: `live`)."""
    return -self.send_right - self.send_left + self.from_left + self.from_right


def moves(flows: np.ndarray) -> Moves:
  """The per-shard counts of edge flows [S - 1] (positive: shard s to s + 1)."""
  edge = np.pad(np.asarray(flows, np.int64), 1)  # [S + 1]: edge[s] enters shard s from the left
  left, right = edge[:-1], edge[1:]
  return Moves(np.maximum(right, 0), np.maximum(-left, 0), np.maximum(left, 0), np.maximum(-right, 0))


def edge_flows(live: np.ndarray, total: int, cap: int) -> np.ndarray:
  """Rows crossing each edge [S - 1] (positive: shard s to s + 1) in one exchange that leave the
  fewest live rows on the fullest shard of `live` [S] (each of `total` rows), then move the fewest
  rows: at most `cap` an edge, a shard sending only live rows of its own and taking in no more than
  it has finished rows to give back. The smallest such maximum M (from the mean's ceiling up), each
  tried by a walk along the line keeping, for every flow into the next shard, the fewest rows moved
  so far (S x (2 cap + 1)^2 checks)."""
  live = np.asarray(live, np.int64)
  s = live.size
  if s < 2 or cap == 0:
    return np.zeros(max(s - 1, 0), np.int64)

  def fits(k: int, f_in: int, f_out: int, most: int) -> bool:  # shard k with f_in from the left, f_out to the right
    sent, taken = max(f_out, 0) + max(-f_in, 0), max(f_in, 0) + max(-f_out, 0)
    return sent <= live[k] and taken <= total - live[k] and live[k] + f_in - f_out <= most

  for most in range(-(-int(live.sum()) // s), int(live.max())):
    best, trail = {0: (0, 0)}, []  # flow out of the shard -> (rows moved so far, flow into it)
    for k in range(s):
      nxt = {}
      for f_in, (moved, _) in best.items():
        for f_out in (0,) if k == s - 1 else range(-cap, cap + 1):
          if fits(k, f_in, f_out, most) and (f_out not in nxt or moved + abs(f_out) < nxt[f_out][0]):
            nxt[f_out] = (moved + abs(f_out), f_in)
      trail.append(nxt)
      best = nxt
    if best:
      flows, f = [], 0
      for k in range(s - 1, 0, -1):
        f = trail[k][f][1]
        flows.append(f)
      return np.array(flows[::-1], np.int64)
  return np.zeros(s - 1, np.int64)


class Compaction(NamedTuple):
  """A compaction as the host plans it (`plan`): the rows every shard keeps, the edge flows [S - 1]
  (positive: shard s to s + 1) and the rows each buffer sent across an edge holds (`move_cap`; 0
  when no row moves: no exchange)."""

  keep: int
  flows: np.ndarray
  sent: int

  @property
  def counts(self) -> np.ndarray:
    """[4, S] int32: `moves(flows)` stacked, as `compact._compact` takes them."""
    return np.stack(moves(self.flows)).astype(np.int32)


def plan(live: np.ndarray, total: int, cap: int, units: int | None = None) -> Compaction:
  """The compaction with `live` [S] rows still decoding on each shard of `total`: every shard keeps
  `compacted_rows` (in `units`) of the fullest after the moves, which are made only when they
  lower the rows kept."""
  live = np.asarray(live, np.int64)
  stay = compacted_rows(int(live.max()), total, units)
  flows = edge_flows(live, total, cap)
  keep = compacted_rows(int((live + moves(flows).kept).max()), total, units)
  if keep < stay:
    return Compaction(keep, flows, cap if flows.any() else 0)
  return Compaction(stay, np.zeros_like(flows), 0)


def rows_after(ordered: np.ndarray, live: np.ndarray, flows: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
  """The rows each shard computes after a compaction, as `compact._compact` lays them out:
  `ordered` [S, here] each shard's rows (any ids) live first, longest prompt first; `live` [S]
  their live counts; `flows` from `plan` -> (rows [S, keep], live [S, keep]: a slot past a
  shard's live rows holds a finished row, or repeats its last row, marked finished)."""
  s, here = ordered.shape
  m = moves(flows)
  stay = live - m.send_right - m.send_left
  out, alive = np.empty((s, keep), ordered.dtype), np.zeros((s, keep), bool)
  for k in range(s):
    a, n = int(stay[k]), int(live[k])
    came = []
    if m.from_left[k]:
      left = ordered[k - 1]
      came += list(left[live[k - 1] - m.send_right[k - 1] : live[k - 1]])
    if m.from_right[k]:
      right = ordered[k + 1]
      first = live[k + 1] - m.send_right[k + 1] - m.send_left[k + 1]
      came += list(right[first : first + m.send_left[k + 1]])
    rest = [ordered[k][min(i, here - 1)] for i in range(n, n + keep)]
    row = list(ordered[k][:a]) + came + rest
    out[k] = row[:keep]
    alive[k, : min(keep, a + len(came))] = True
  return out, alive
