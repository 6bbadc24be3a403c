"""The rollout copy of the policy: the weights the sampler decodes with.

The parameters are cast once to the rollout dtype (bfloat16 on accelerators in training) and laid
out for decoding (`DECODE_RULES`: nothing over "fsdp", heads / MLP / vocabulary over "tensor") by
one jitted call (`make_rollout_policy`), so no decode step casts or all-gathers a weight.
`abstract_rollout_policy` gives the same structure as `ShapeDtypeStruct`s, for compiling the
sampler for devices that are absent (`lower_generate`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ict_jax import lora
from ict_jax.models.axes import DEFAULT_RULES, axis_rules, pure_shardings
from ict_jax.models.qwen2 import abstract_model

# Decoding layout: heads, KV heads, MLP and vocabulary over "tensor" as in training, but nothing
# over "fsdp" (the `embed` dimension whole on every device), so a decode step reads its weights
# where they are instead of all-gathering them from the FSDP shards every token.
DECODE_RULES = tuple((name, () if name == "embed" else axes) for name, axes in DEFAULT_RULES)
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


class RolloutPolicy(NamedTuple):
  """The weights the sampler decodes with: `state` (a pure dict like `nnx.state(model,
  nnx.Param).to_pure_dict()`) in the rollout dtype and the decoding layout, and the `graphdef`
  of a `Qwen2` whose compute and parameter dtype are that dtype (so nothing is cast per token)."""

  graphdef: Any
  state: Any


@functools.lru_cache(maxsize=None)
def _rollout_graphdef(model_cfg, dtype: str):
  return nnx.graphdef(abstract_model(model_cfg.replace(dtype=dtype, param_dtype=dtype)))


def decode_shardings(state: nnx.State, mesh: Mesh) -> dict:
  """NamedShardings of the decoding layout (`DECODE_RULES`) as a pure dict, for an `nnx.State`
  of the model's Params (arrays or ShapeDtypeStructs, e.g. `nnx.state(abstract_model(cfg),
  nnx.Param)`); the logical axis names come from the parameters' metadata."""
  with axis_rules(DECODE_RULES):
    return pure_shardings(state, mesh)


def _cast(params, dtype: str):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@functools.lru_cache(maxsize=None)
def _reshard_fn(dtype: str, treedef, shardings: tuple | None):
  """The jitted cast + reshard, one per (dtype, layout): built once, not per step."""
  out = None if shardings is None else jax.tree.unflatten(treedef, shardings)
  return jax.jit(functools.partial(_cast, dtype=dtype), out_shardings=out)


def make_rollout_policy(graphdef, params, *, dtype: str | None = None, mesh: Mesh | None = None) -> RolloutPolicy:
  """The rollout copy of the policy: `params` (a pure dict, e.g. the train state's, any layout)
  cast to `dtype` (default: the model's compute dtype) and laid out for decoding on `mesh` by one
  jitted call, once per step. Without a mesh and with nothing to cast, `params` is used as is."""
  model = nnx.merge(graphdef, params)  # Python objects around the same device arrays: no copy
  if lora.is_lora(model):  # LoRA: decode with the merged weights, W + alpha / rank * A.B
    return _merged_policy(model, dtype, mesh)
  cfg = model.cfg
  dtype = cfg.dtype if dtype is None else dtype
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  state = nnx.state(model, nnx.Param)
  pure = state.to_pure_dict()
  rgraphdef = _rollout_graphdef(cfg, dtype)
  same = all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(pure))
  if (
      mesh is None
      and same
      and all(
          not isinstance(getattr(x, "sharding", None), NamedSharding) or x.sharding.mesh.size == 1
          for x in jax.tree.leaves(pure)
      )
  ):
    return RolloutPolicy(rgraphdef, pure)
  shardings = None if mesh is None else decode_shardings(state, mesh)
  leaves, treedef = jax.tree.flatten(shardings)
  fn = _reshard_fn(dtype, treedef, None if shardings is None else tuple(leaves))
  return RolloutPolicy(rgraphdef, fn(pure))


def _merged_policy(model, dtype: str | None, mesh: Mesh | None) -> RolloutPolicy:
  """A LoRA model's rollout copy: its adapters merged, cast and laid out by one jitted call."""
  cfg = model.cfg
  dtype = cfg.dtype if dtype is None else dtype
  graphdef, params = nnx.split(model)
  out = None if mesh is None else decode_shardings(nnx.state(abstract_model(cfg), nnx.Param), mesh)
  leaves, treedef = jax.tree.flatten(out)
  return RolloutPolicy(_rollout_graphdef(cfg, dtype), _merge_fn(graphdef, dtype, treedef, tuple(leaves))(params))


@functools.lru_cache(maxsize=None)
def _merge_fn(graphdef, dtype: str, treedef, shardings: tuple):
  """The jitted merge + cast + reshard of a LoRA model, one per (model, dtype, layout)."""
  out = jax.tree.unflatten(treedef, shardings) if shardings else None
  return jax.jit(lambda p: _cast(lora.merged(nnx.merge(graphdef, p)), dtype), out_shardings=out)


def as_rollout_policy(model, *, dtype: str | None = None, mesh: Mesh | None = None) -> RolloutPolicy:
  """A `Qwen2` -> its rollout copy (`make_rollout_policy`) on `mesh` (else the mesh set by
  `jax.set_mesh` or the one its parameters live on); a `RolloutPolicy` is returned as is. For a
  caller that samples the same weights many times (an evaluation's batches): the copy is made once,
  where `generate(model, ...)` makes one per call."""
  if isinstance(model, RolloutPolicy):
    return model
  graphdef, state = nnx.split(model)
  mesh = mesh if mesh is not None else _find_mesh(state)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    return make_rollout_policy(graphdef, state, dtype=dtype, mesh=mesh)


def abstract_rollout_policy(model_cfg, *, dtype: str, mesh: Mesh | None = None) -> RolloutPolicy:
  """A RolloutPolicy of `jax.ShapeDtypeStruct`s (in `dtype`, carrying the decoding layout's
  shardings on `mesh`) for a `Qwen2Config`: what `lower_generate` needs to compile the sampler
  for a mesh whose devices are absent (e.g. a TPU topology's)."""
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  params = nnx.state(abstract_model(model_cfg), nnx.Param)
  shardings = None if mesh is None else decode_shardings(params, mesh)
  pure = params.to_pure_dict()
  structs = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s
      ),
      pure,
      shardings if shardings is not None else jax.tree.map(lambda _: None, pure),
  )
  return RolloutPolicy(_rollout_graphdef(model_cfg, dtype), structs)


def _find_mesh(state) -> jax.sharding.Mesh | None:
  """The mesh set by `jax.set_mesh`, else the one the parameters are sharded over, else None."""
  mesh = jax.sharding.get_mesh()
  if not mesh.empty:
    return mesh
  for leaf in jax.tree.leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None
