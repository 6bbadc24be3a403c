"""Logical axis names and their mapping to the mesh axes ("data", "fsdp", "tensor").

Every parameter carries logical names in its `axes` metadata (e.g. `("embed", "vocab")`);
activations are constrained with `constrain(x, ("act_batch", "act_length", "act_embed"))`.
The rules below turn logical names into a `PartitionSpec` for the current mesh. A mesh axis is
dropped from a dimension when it does not divide that dimension (e.g. 2 KV heads on tensor=4),
so the same model runs on any mesh shape.

This module is the leaf of the sharding stack: models import it; `ict_jax.sharding` builds
meshes and placements on top of it.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes, in priority order (MaxText-style).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # parameters
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("head_dim", ()),
    ("norm", ()),
    ("layers", ()),
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_length", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    ("act_cache_length", ()),
    # the train step's LM head works on vocabulary shards: rows over data only (lm_head.py)
    ("act_head_batch", ("data",)),
    ("act_head_vocab", ("tensor", "fsdp")),
    # the tensor decode layout (Qwen2Config.decode_weights "tensor"): a dimension split over every
    # chip, in the order the rollout copy's weights are split (`sampling.policy.TENSOR_RULES`)
    ("act_split", ("data", "fsdp", "tensor")),
)


_RULES_STACK: list[tuple[tuple[str, tuple[str, ...]], ...]] = [DEFAULT_RULES]


@contextlib.contextmanager
def axis_rules(rules):
  """Temporarily replace the logical->mesh rules (e.g. to map `embed` to no axis)."""
  _RULES_STACK.append(tuple((k, tuple(v) if v else ()) for k, v in rules))
  try:
    yield
  finally:
    _RULES_STACK.pop()


def current_rules():
  return _RULES_STACK[-1]


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int], rules=None) -> P:
  """PartitionSpec for an array of `shape` whose dims have logical `names` on a mesh.

  A mesh axis is used at most once, and only while the product of the chosen axes divides
  the dimension."""
  rules = dict(rules if rules is not None else current_rules())
  if len(names) != len(shape):
    raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, dim in zip(names, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise ValueError(f"no sharding rule for logical axis {name!r}; known: {sorted(rules)}")
    chosen, size = [], 1
    for ax in rules[name]:
      n = mesh_shape.get(ax, 1)
      if ax in used or n == 1:
        continue
      if dim % (size * n) == 0:
        chosen.append(ax)
        size *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names under the current mesh (`jax.set_mesh`).

  Applied on every backend, CPU included; a no-op only when no mesh is set (one device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(names, x.shape, dict(mesh.shape))
  return jax.lax.with_sharding_constraint(x, spec)


def spec_for(variable: nnx.Variable, mesh: Mesh) -> P:
  axes = variable.get_metadata().get("axes")
  shape = variable.get_value().shape
  if axes is None:
    return P()
  return logical_to_spec(axes, shape, dict(mesh.shape))


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
  """A State of `NamedSharding`s, one per variable, from its logical `axes` metadata."""
  return jax.tree.map(
      lambda v: v.replace(NamedSharding(mesh, spec_for(v, mesh))), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


def pure_shardings(state: nnx.State, mesh: Mesh) -> dict:
  """Like `state_shardings` but as a pure nested dict (matching `State.to_pure_dict()`)."""
  return state_shardings(state, mesh).to_pure_dict()
