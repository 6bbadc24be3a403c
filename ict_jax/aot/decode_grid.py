"""The decode step's costs at every (phase bound, decode rows) the bound needs (`decode_grid`), from
a few compiles.

A rollout's decode step runs at each phase's read bound b (`sampling.decode_phases`) and, once
finished rows are dropped, at each compacted row count r (`sampling.compacted_rows`): up to 8 x 8
programs, each a compile of many seconds to minutes for a 1.5B-7B model with its layer scan
unrolled. Their bytes, FLOPs and collectives are affine in b at a fixed r (the KV slots read), in
r at a fixed b (the rows' activations, logits and cache), and in the layer count (identical layers,
unrolled). So "few" (the default) compiles the four corners (first and last bound) x (fewest and
all rows; and the second-fewest when the fewest are under 8 a chip) at two depths (2 and 3 layers, or the model's own when it has no more) and derives the
rest: `plan.bilinear` in (b, r), then a straight line in the depth to the model's layers. "all"
compiles every (b, r) at the model's depth (slow: the check of the derivation, tests/test_aot.py).

A compacted step's prompt cache is the sub-batch's cut in the rows' proportion (u x r / rows
prompts, R rows each), or one prompt row a decode row when R does not divide that.
"""

from __future__ import annotations

import dataclasses

from ict_jax import sampling
from ict_jax.aot import plan
from ict_jax.aot.decode_step import compile_decode_step, decode_cache, pallas_grid_steps
from ict_jax.aot.measure import bytes_per_device, collective_bytes, count_collectives

MODES = ("few", "all")  # --decode_compiles
_DEPTHS = (2, 3)  # the layer counts "few" compiles, when the model has more
# fewer rows a chip than a TPU tile's 8 sublanes compile to other code (1 row a chip: a 4-layer
# tiny model's step reads 4% more bytes and 8% fewer FLOPs than the line through 2 and 4 rows):
# "few" then also compiles the second-fewest rows and derives piecewise
_TILE_ROWS = 8


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


def row_counts(rows: int, shards: int) -> list[int]:
  """The decode rows (the mesh's) a step may run at: `sampling.compacted_rows` of 1 .. all live
  rows of a chip, x the row shards; ascending, the last all of a sub-batch's rows."""
  per_chip = rows // shards
  return sorted({sampling.compacted_rows(n, per_chip) * shards for n in range(1, per_chip + 1)})


def prompt_rows(prompts: int, rows: int, r: int) -> int:
  """The prompt cache rows of a step of r decode rows cut from a sub-batch of `rows` rows
  reading `prompts` prefilled prompts (module docstring)."""
  u = prompts * r // rows
  return u if u and (prompts * r) % rows == 0 and r % u == 0 else r


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


def decode_grid(
    mcfg, mesh, ro, sample_kw: dict, dtype: str, opts, *, chips: int, weights_read: int, mode: str = "few"
) -> GridResult:
  """The decode step's costs a chip at each (phase bound, decode rows) of the rollout `ro`
  (`sampler._Rollout`), compiled as `mode` says (module docstring). A compile that fails is
  reported (the first error), its costs the minimum; without cost analysis (the CUDA plugin) the
  bytes are the minimum and the FLOPs the decode matmuls'."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  bounds, rows = tuple(ro.phases), tuple(row_counts(ro.layout.rows, shards))
  layers = mcfg.num_hidden_layers
  if mode == "all":
    points, depths = [(b, r) for b in bounds for r in rows], (layers,)
  else:
    knots = {rows[0], rows[-1]} | ({rows[1]} if rows[0] // shards < _TILE_ROWS and len(rows) > 2 else set())
    points = [(b, r) for b in sorted({bounds[0], bounds[-1]}) for r in sorted(knots)]
    depths = _DEPTHS if layers > _DEPTHS[-1] else (layers,)
  shape = dict(new_len=ro.new_len, prompt_len=ro.prompt_len)
  measured, error = {}, ""
  for depth in depths:
    cfg = dataclasses.replace(mcfg, num_hidden_layers=depth)
    policy = sampling.abstract_rollout_policy(cfg, dtype=dtype, mesh=mesh)
    for b, r in points:
      u = prompt_rows(ro.layout.prompts, ro.layout.rows, r)
      try:
        got = _compile_one(policy, cfg, mesh, sample_kw, dtype, opts, bound=b, rows=r, prompts=u, **shape)
      except Exception as e:  # noqa: BLE001 - a step alone overflowing is reported, not fatal
        error = error or f"decode step (phase {b}, {r} rows): {' '.join(str(e).split())[:300]}"
        got = (None, None, {}, {}, 0)
      measured[depth, b, r] = got
  return _assemble(mcfg, mesh, ro, dtype, bounds, rows, depths, measured, error, chips=chips, weights_read=weights_read)


def _assemble(mcfg, mesh, ro, dtype, bounds, rows, depths, measured, error, *, chips, weights_read) -> GridResult:
  """`decode_grid`'s compiles -> the grid: a cost the compiler did not give replaced (the
  minimum bytes, the matmul FLOPs), each depth's grid derived in (bound, rows), then the model's
  depth on the line through the depths compiled."""
  layers = mcfg.num_hidden_layers
  kinds = sorted({k for got in measured.values() for k in got[2]})

  def costs(depth, b, r, got):
    cfg = dataclasses.replace(mcfg, num_hidden_layers=depth)
    u = prompt_rows(ro.layout.prompts, ro.layout.rows, r)
    nbytes = (
        got[0]
        if got[0] is not None
        else _min_bytes(cfg, mesh, dtype, weights_read, bound=b, rows=r, prompts=u, prompt_len=ro.prompt_len)
    )
    flops = got[1] if got[1] is not None else r * cfg.flops_per_token(0, training=False) / chips
    counts = [got[2].get(k, 0) for k in kinds]
    return (nbytes, flops, sum(got[3].values()), sum(counts), got[4], *counts, *(got[3].get(k, 0) for k in kinds))

  per_depth = []
  for depth in depths:
    pts = {(b, r): costs(depth, b, r, got) for (d, b, r), got in measured.items() if d == depth}
    per_depth.append(plan.derive_grid(bounds, rows, pts))
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
          compiled=tuple(sorted({(b, r) for (_, b, r) in measured})),
          depths=tuple(depths),
      ),
      grid_steps=[round(row[-1][4]) for row in grid],
      collectives={k: round(v) for k, v in zip(kinds, last[5 : 5 + n])},
      collective_bytes={k: float(v) for k, v in zip(kinds, last[5 + n :])},
      error=error,
      cost_analysis=any(got[0] is not None for got in measured.values()),
  )
