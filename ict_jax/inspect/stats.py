"""L2 norms of a step's parameters and how far they moved between two steps, per tensor and per
layer group, reading one stacked tensor at a time."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ict_jax.inspect.reader import Checkpoint, _group_sort_key, _stacked, layer_group, read_groups


# ---- norms -----------------------------------------------------------------------------------------
def _sum_per_layer(path: str, sq: jax.Array) -> jax.Array:
  """Sum of squares: per layer [L] for a stacked tensor, else a scalar."""
  return jnp.sum(sq, axis=tuple(range(1, sq.ndim))) if _stacked(path) else jnp.sum(sq)


@jax.jit
def _sumsq(tree):  # {path: array} -> {path: float32 [] or [L]}
  return {p: _sum_per_layer(p, jnp.square(x.astype(jnp.float32))) for p, x in tree.items()}


@jax.jit
def _diff_sumsq(a, b):  # -> {path: sum((b - a)^2), [] or [L]}
  return {p: _sum_per_layer(p, jnp.square(b[p].astype(jnp.float32) - x.astype(jnp.float32))) for p, x in a.items()}


def _host_sums(sums) -> dict[str, np.ndarray]:
  return {p: np.asarray(v, np.float64) for p, v in sums.items()}


def _tensor_norms(sumsq: Mapping[str, np.ndarray]) -> dict[str, float]:
  return {p: math.sqrt(float(np.sum(s))) for p, s in sumsq.items()}


def _layer_norms(tensor_sumsq: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Per layer group: "layers/i" gathers layer i's slice of every stacked tensor."""
  out: dict[str, float] = {}
  for path, s in tensor_sumsq.items():
    per_group = {f"layers/{i}": x for i, x in enumerate(s)} if _stacked(path) else {layer_group(path): float(s)}
    for g, x in per_group.items():
      out[g] = out.get(g, 0.0) + float(x)
  return {g: math.sqrt(out[g]) for g in sorted(out, key=_group_sort_key)}


def _table(rows: list[tuple], head: tuple) -> str:
  cells = [head] + [tuple(c if isinstance(c, str) else f"{c:.4g}" for c in r) for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
  return "\n".join(
      "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells
  )


@dataclasses.dataclass(frozen=True)
class ParamStats:
  """L2 norms of one step's parameters: per tensor and per layer group ("embed", "layers/3", ...)."""

  step: int
  tensor_norms: dict[str, float]
  layer_norms: dict[str, float]

  def render_text(self) -> str:
    return f"step {self.step}\n" + _table(list(self.layer_norms.items()), ("layer", "L2 norm"))


def param_stats(ckpt: Checkpoint, step: int | None = None, *, mesh=None, item: str = "params") -> ParamStats:
  """Per-tensor and per-layer L2 norms, reading one stacked tensor at a time."""
  step = ckpt.pick_step(step)
  sumsq: dict[str, np.ndarray] = {}
  for paths in read_groups(ckpt, step, item):
    sumsq.update(_host_sums(_sumsq(ckpt.restore(paths, step=step, mesh=mesh, item=item))))
  return ParamStats(step, _tensor_norms(sumsq), _layer_norms(sumsq))


def _relative(delta: float, base: float) -> float:
  return delta / base if base > 0 else (math.inf if delta > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class ParamDiff:
  """How far the parameters moved from `step_a` to `step_b`: ||b - a|| and ||a||, per tensor and
  per layer group; `*_relative` = ||b - a|| / ||a||."""

  step_a: int
  step_b: int
  tensor_delta: dict[str, float]
  tensor_norm: dict[str, float]
  layer_delta: dict[str, float]
  layer_norm: dict[str, float]

  @property
  def tensor_relative(self) -> dict[str, float]:
    return {p: _relative(d, self.tensor_norm[p]) for p, d in self.tensor_delta.items()}

  @property
  def layer_relative(self) -> dict[str, float]:
    return {g: _relative(d, self.layer_norm[g]) for g, d in self.layer_delta.items()}

  def render_text(self) -> str:
    rel = self.layer_relative
    rows = [(g, d, self.layer_norm[g], rel[g]) for g, d in self.layer_delta.items()]
    return f"step {self.step_a} -> {self.step_b}\n" + _table(rows, ("layer", "||b-a||", "||a||", "relative"))


def diff(ckpt: Checkpoint, step_a: int, step_b: int, *, mesh=None, item: str = "params") -> ParamDiff:
  """Per-tensor and per-layer update size between two steps, reading one stacked tensor of each
  at a time."""
  step_a, step_b = ckpt.pick_step(step_a), ckpt.pick_step(step_b)
  ta, tb = ckpt.tensors(step_a, item=item), ckpt.tensors(step_b, item=item)
  mismatch = sorted(
      p
      for p in set(ta) | set(tb)
      if p not in ta or p not in tb or (ta[p].shape, ta[p].dtype) != (tb[p].shape, tb[p].dtype)
  )
  if mismatch:
    raise ValueError(
        f"{os.fspath(ckpt.directory)}: steps {step_a} and {step_b} differ in tensors "
        f"{mismatch[:4]} (missing, or another shape/dtype)"
    )
  delta, base = {}, {}
  for paths in read_groups(ckpt, step_a, item):
    a = ckpt.restore(paths, step=step_a, mesh=mesh, item=item)
    b = ckpt.restore(paths, step=step_b, mesh=mesh, item=item)
    delta.update(_host_sums(_diff_sumsq(a, b)))
    base.update(_host_sums(_sumsq(a)))
  return ParamDiff(step_a, step_b, _tensor_norms(delta), _tensor_norms(base), _layer_norms(delta), _layer_norms(base))
