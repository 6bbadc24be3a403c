"""The decode step's costs at every (phase bound, decode rows) the bound needs (`decode_grid`), from
a few compiles.

A rollout's decode step runs at each phase's read bound b (`sampling.decode_phases`) and, once
finished rows are dropped, at each compacted row count r (`sampling.compacted_rows`): up to 8 x
units programs, each a compile of many seconds to minutes for a 1.5B-7B model with its layer scan
unrolled. Their bytes, FLOPs and collectives are affine in b at a fixed r (the KV slots read), in
r at a fixed b (the rows' activations, logits and cache), and in the layer count (identical layers,
unrolled). So "few" (the default) compiles the four corners (first and last bound) x (fewest and
all rows; every row count when compaction keeps fewer than 8 rows a chip at a time, which the
TPU pads to its 8-row tiles) at two depths (2 and 3 layers, or the model's own when it has no more) and derives the
rest: `plan.bilinear` in (b, r), then a straight line in the depth to the model's layers. "all"
compiles every (b, r) at the model's depth (slow: the check of the derivation, tests/test_aot.py).

A step's prompt cache is the one the sampler's loop reads (`sampling.compact`): before any row is
dropped (all of a sub-batch's rows) the u prefilled prompts, each read by its R rows; once a
compaction has dropped rows, a copy a kept row (`compact._compact` gathers each kept row's prompt,
as its rows of a prompt no longer sit together), so a compacted step of r rows reads r prompt
rows. The rows' line in "few" runs through the compacted form at both ends (the fewest rows, and
all rows with a prompt copy a row, a knot compiled for the line only); the all-rows step the loop
runs before its first compaction is compiled as it is, at both ends of the bounds.
"""

from __future__ import annotations

import dataclasses

from ict_jax import sampling
from ict_jax.aot import plan
from ict_jax.aot.decode_step import compile_decode_step, decode_cache, pallas_grid_steps
from ict_jax.aot.measure import bytes_per_device, collective_bytes, count_collectives

MODES = ("few", "all")  # --decode_compiles
_DEPTHS = (2, 3)  # the layer counts "few" compiles, when the model has more
# a chip's rows are padded to a TPU tile's 8 sublanes: when compaction keeps fewer than 8 rows a
# chip at a time, the bytes step at each multiple of 8 (a 4-layer tiny model, 2 .. 16 rows a chip
# in steps of 2: +10% from 8 to 10 rows, -1% from 14 to 16), so "few" compiles every row count
# then and derives only in the bound and the depth
_TILE_ROWS = 8
# "few": the line through the fewest and all rows may miss the middle row count by this much
# (1.5B on v5e-8, 2 layers, bound 256: 0.17% at 64 of 16 .. 128 rows a chip; a 4-layer tiny model
# over tensor 4 misses by 14%: XLA partitions its head differently by row count)
AFFINE_TOLERANCE = 0.01


@dataclasses.dataclass
class GridResult:
  """`decode_grid`'s answer: the grid, the Pallas grid steps a step at all rows (one a phase), the
  collectives of a step at all rows and the last bound by kind (count, bytes), the first error."""

  grid: plan.DecodeGrid
  grid_steps: list[int]
  collectives: dict[str, float]
  collective_bytes: dict[str, float]
  error: str
  cost_analysis: bool  # the compiler gave bytes (else the grid's bytes are the minimum)
  affine_miss: float | None = None  # "few": how far the rows' line missed its check point


def row_counts(rows: int, shards: int, units: int | None = None) -> list[int]:
  """The decode rows (the mesh's) a step may run at: `sampling.compacted_rows` of 1 .. all live
  rows of a chip (in `units`), x the row shards; ascending, the last all of a sub-batch's rows."""
  per_chip = rows // shards
  return sorted({sampling.compacted_rows(n, per_chip, units) * shards for n in range(1, per_chip + 1)})


def prompt_rows(prompts: int, r: int, shared: bool) -> int:
  """The prompt cache rows of a step of r decode rows reading `prompts` prefilled prompts: the
  prompts while they are shared (all of a sub-batch's rows, no compaction yet), a copy a row once
  compacted (module docstring)."""
  return prompts if shared else r


def _compile_one(policy, mcfg, mesh, sample_kw, dtype, opts, *, bound, rows, prompts, new_len, prompt_len):
  """(bytes or None, FLOPs or None, collective counts by kind, their bytes by kind, grid steps) of
  the decode step at (bound, rows), compiled (`sampler.compile_decode_step`)."""
  cache = decode_cache(mcfg, mesh, rows, new_len, dtype)
  prompt_cache = decode_cache(mcfg, mesh, prompts, prompt_len, dtype)
  compiled, trace = compile_decode_step(policy, mesh, cache, prompt_cache, sample_kw, bound, opts, traced=True)
  costs = compiled.cost_analysis()
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs
  text = compiled.as_text()
  return (
      float(costs["bytes accessed"]) if costs and costs.get("bytes accessed") else None,
      float(costs["flops"]) if costs and costs.get("flops") else None,
      count_collectives(text),
      collective_bytes(text),
      pallas_grid_steps(trace.jaxpr.jaxpr),
  )


def _min_bytes(mcfg, mesh, dtype, weights_read: int, *, bound: int, rows: int, prompts: int, prompt_len: int) -> int:
  """A step's minimum a chip: the rollout weights + the prompt cache + the completion slots read."""
  kv = decode_cache(mcfg, mesh, rows, bound, dtype), decode_cache(mcfg, mesh, prompts, prompt_len, dtype)
  return weights_read + bytes_per_device(kv)


def _affine_miss(measured: dict, depth: int, bounds, corners, mid: int) -> float:
  """How far the line through the corners' (bytes, FLOPs, collective bytes, collectives) misses
  the compiled (first bound, `mid` rows) at `depth`: the largest relative error (inf: not compiled)."""
  got = measured[depth, bounds[0], mid, False]
  at = lambda k: measured[depth, *k, False]
  line = lambda j: plan.bilinear({k: (at(k)[j] or 0) for k in corners}, bounds[0], mid)
  values = [(got[0], line(0)), (got[1], line(1))] if got[0] is not None else []
  values.append((sum(got[3].values()), plan.bilinear({k: sum(at(k)[3].values()) for k in corners}, bounds[0], mid)))
  values.append((sum(got[2].values()), plan.bilinear({k: sum(at(k)[2].values()) for k in corners}, bounds[0], mid)))
  return max((abs(x - y) / max(abs(x), 1.0) for x, y in values), default=float("inf"))


def decode_grid(
    mcfg,
    mesh,
    ro,
    sample_kw: dict,
    dtype: str,
    opts,
    *,
    chips: int,
    weights_read: int,
    mode: str = "few",
    weights: str = "replicated",
) -> GridResult:
  """The decode step's costs a chip at each (phase bound, decode rows) of the rollout `ro`
  (`sampler._Rollout`), compiled as `mode` says (module docstring). "few" checks its line in the
  rows at one point (the first bound, the middle row count, the lesser depth) and, if the line
  misses it by more than `AFFINE_TOLERANCE`, compiles every row count instead. A compile that
  fails is reported (the first error), its costs the minimum; without cost analysis (the CUDA
  plugin) the bytes are the minimum and the FLOPs the decode matmuls'. weights: the rollout copy's
  layout (`rollout.decode_weights`)."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  bounds, rows = tuple(ro.phases), tuple(row_counts(ro.layout.rows, shards, ro.units))
  layers = mcfg.num_hidden_layers
  ends = sorted({bounds[0], bounds[-1]})
  full = [(b, rows[-1], True) for b in (bounds if mode == "all" else ends)]  # before any compaction
  if mode == "all":
    points, depths = [(b, r, False) for b in bounds for r in rows[:-1]] + full, (layers,)
  else:  # the compacted rows' line: knots at the fewest rows and at all rows (a prompt copy a row)
    knots = rows if rows[0] // shards < _TILE_ROWS else sorted({rows[0], rows[-1]})
    points = [(b, r, False) for b in ends for r in knots if len(rows) > 1] + full
    depths = _DEPTHS if layers > _DEPTHS[-1] else (layers,)
  measured, error = {}, ""

  def compile_at(depth, pts):
    nonlocal error
    cfg = dataclasses.replace(mcfg, num_hidden_layers=depth)
    policy = sampling.abstract_rollout_policy(cfg, dtype=dtype, mesh=mesh, weights=weights)
    for b, r, shared in pts:
      if (depth, b, r, shared) in measured:
        continue
      u = prompt_rows(ro.layout.prompts, r, shared)
      shape = dict(bound=b, rows=r, prompts=u, new_len=ro.new_len, prompt_len=ro.prompt_len)
      try:
        measured[depth, b, r, shared] = _compile_one(policy, cfg, mesh, sample_kw, dtype, opts, **shape)
      except Exception as e:  # noqa: BLE001 - a step alone overflowing is reported, not fatal
        error = error or f"decode step (phase {b}, {r} rows): {' '.join(str(e).split())[:300]}"
        measured[depth, b, r, shared] = (None, None, {}, {}, 0)

  for depth in depths:
    compile_at(depth, points)
  miss = None
  corners = sorted({(b, r) for b, r, shared in points if not shared})  # the compacted rows' line
  if mode == "few" and len({r for _, r in corners}) == 2 < len(rows):
    mid = rows[len(rows) // 2]
    compile_at(depths[0], [(bounds[0], mid, False)])
    miss = _affine_miss(measured, depths[0], ends, corners, mid)
    if miss > AFFINE_TOLERANCE:  # not a line in the rows: every row count
      for depth in depths:
        compile_at(depth, [(b, r, False) for b in ends for r in rows])
    else:  # a knot at one depth and bound only: not one of the grid's
      del measured[depths[0], bounds[0], mid, False]
  res = _assemble(mcfg, mesh, ro, dtype, bounds, rows, depths, measured, error, chips=chips, weights_read=weights_read)
  res.affine_miss = miss
  return res


def _assemble(mcfg, mesh, ro, dtype, bounds, rows, depths, measured, error, *, chips, weights_read) -> GridResult:
  """`decode_grid`'s compiles -> the grid: a cost the compiler did not give replaced (the
  minimum bytes, the matmul FLOPs), each depth's grid derived in (bound, rows), then the model's
  depth on the line through the depths compiled."""
  layers = mcfg.num_hidden_layers
  kinds = sorted({k for got in measured.values() for k in got[2]})

  def costs(depth, b, r, shared, got):
    cfg = dataclasses.replace(mcfg, num_hidden_layers=depth)
    u = prompt_rows(ro.layout.prompts, r, shared)
    nbytes = (
        got[0]
        if got[0] is not None
        else _min_bytes(cfg, mesh, dtype, weights_read, bound=b, rows=r, prompts=u, prompt_len=ro.prompt_len)
    )
    flops = got[1] if got[1] is not None else r * cfg.flops_per_token(0, training=False) / chips
    counts = [got[2].get(k, 0) for k in kinds]
    return (nbytes, flops, sum(got[3].values()), sum(counts), got[4], *counts, *(got[3].get(k, 0) for k in kinds))

  per_depth = []

  def points(depth, form):
    return {(b, r): costs(depth, b, r, s, got) for (d, b, r, s), got in measured.items() if (d, s) == (depth, form)}

  for depth in depths:  # the compacted rows' grid, then the all-rows column as the loop first runs it
    first = plan.derive_grid(bounds, rows[-1:], points(depth, True))
    lower = plan.derive_grid(bounds, rows[:-1], points(depth, False)) if len(rows) > 1 else [[] for _ in bounds]
    per_depth.append([row + col for row, col in zip(lower, first)])
  if len(depths) == 1:
    grid = per_depth[0]
  else:  # a straight line through the two depths, to the model's
    t = (layers - depths[0]) / (depths[1] - depths[0])
    grid = [
        [tuple(a + t * (b - a) for a, b in zip(c0, c1)) for c0, c1 in zip(r0, r1)]
        for r0, r1 in zip(per_depth[0], per_depth[1])
    ]
  table = lambda j: tuple(tuple(float(c[j]) for c in row) for row in grid)
  last = grid[-1][-1]
  n = len(kinds)
  return GridResult(
      grid=plan.DecodeGrid(
          bounds=bounds,
          rows=rows,
          bytes=table(0),
          flops=table(1),
          ici_bytes=table(2),
          collectives=table(3),
          compiled=tuple(sorted({(b, r) for (_, b, r, _) in measured})),
          depths=tuple(depths),
      ),
      grid_steps=[round(row[-1][4]) for row in grid],
      collectives={k: round(v) for k, v in zip(kinds, last[5 : 5 + n])},
      collective_bytes={k: float(v) for k, v in zip(kinds, last[5 + n :])},
      error=error,
      cost_analysis=any(got[0] is not None for got in measured.values()),
  )
