"""The rollout copy of the policy: the weights the sampler decodes with.

The parameters are cast once to the rollout dtype (bfloat16 on accelerators in training) and laid
out for decoding by one jitted call (`make_rollout_policy`), so no decode step casts or all-gathers
a weight. Three layouts (`DECODE_WEIGHTS`, the run config's `rollout.decode_weights`):

- "replicated" (`DECODE_RULES`): nothing over "fsdp", heads / MLP / vocabulary over "tensor" as in
  training; on a (data, fsdp, 1) mesh every chip holds, and reads a step, all the weights.
- "tensor" (`TENSOR_RULES`): each weight split once over every chip of the mesh (data x fsdp x
  tensor, where the dimension divides): the MLP on its intermediate dimension, the embedding / LM
  head on the vocabulary, q/k/v/o on the embed dimension (Qwen2.5's KV heads, 2 or 4, and its
  query heads, 12 or 28, do not divide 8 chips; the embed dimension does). A chip reads 1/chips of
  each weight a step; the decode step (`models/qwen2.py`, `cfg.decode_weights`) gathers the rows
  for those matmuls and scatters the results back to the rows a chip holds, where the attention
  runs on its own KV cache (batch-sharded as in "replicated"), as MaxText's and JetStream's decode
  shard it. Norm scales and q/k/v biases (a few KiB a layer) stay whole on every chip.
- "mlp": the MLP and the embedding / LM head split as in "tensor", the attention's projections as in
  "replicated" (whole on every row shard): the attention runs on the rows a chip holds with no
  collective, and only the MLP and the head gather the rows. A chip reads its q/k/v/o whole (11 MiB
  a layer on 1.5B) but writes, reads and exchanges far fewer gathered activations: compiled for
  v5e-8 at 1,024 rows (4 layers), 1.5B's decode step reads 13% fewer bytes and exchanges half the
  collective bytes of "tensor"; at 256 rows 4% more bytes (benchmarks/RESULTS.md, issue 41). For
  models whose attention weights a chip cannot hold whole (7B LoRA on v5e-8), "tensor".

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ict_jax import lora
from ict_jax.models.axes import DEFAULT_RULES, axis_rules, logical_to_spec, pure_shardings
from ict_jax.models.config import DECODE_WEIGHTS
from ict_jax.models.qwen2 import abstract_model

_PARAM_NAMES = ("embed", "vocab", "heads", "kv_heads", "mlp", "head_dim", "norm", "layers")

# Decoding layout: heads, KV heads, MLP and vocabulary over "tensor" as in training, but nothing
# over "fsdp" (the `embed` dimension whole on every device), so a decode step reads its weights
# where they are instead of all-gathering them from the FSDP shards every token.
DECODE_RULES = tuple((name, () if name == "embed" else axes) for name, axes in DEFAULT_RULES)
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")

# The tensor layout's parameters: one dimension of each weight over every chip, in the order of
# the activations' "act_split" (models/axes.py), so a weight shard and the activation shard it
# multiplies sit on the same chip. "vocab" and "mlp" are placed before "embed" (`_TENSOR_FIRST`):
# a weight with either splits on it and keeps its embed dimension whole; q/k/v/o split on embed.
_ALL_CHIPS = dict(DEFAULT_RULES)["act_split"]
TENSOR_RULES = tuple(
    (name, _ALL_CHIPS if name in ("vocab", "mlp", "embed") else () if name in _PARAM_NAMES else axes)
    for name, axes in DEFAULT_RULES
)
_TENSOR_FIRST = ("vocab", "mlp")


class RolloutPolicy(NamedTuple):
  """The weights the sampler decodes with: `state` (a pure dict like `nnx.state(model,
  nnx.Param).to_pure_dict()`) in the rollout dtype and the decoding layout, and the `graphdef`
  of a `Qwen2` whose compute and parameter dtype are that dtype (so nothing is cast per token)."""

  graphdef: Any
  state: Any


@functools.lru_cache(maxsize=None)
def _rollout_graphdef(model_cfg, dtype: str, weights: str = "replicated"):
  return nnx.graphdef(abstract_model(model_cfg.replace(dtype=dtype, param_dtype=dtype, decode_weights=weights)))


def _check_weights(weights: str) -> None:
  if weights not in DECODE_WEIGHTS:
    raise ValueError(f"decode weights layout must be one of {DECODE_WEIGHTS}, got {weights!r}")


def _tensor_spec(variable: nnx.Variable, mesh: Mesh, weights: str) -> P:
  """A parameter's PartitionSpec in the tensor layout: `TENSOR_RULES` with its "vocab" / "mlp"
  dimension placed first (a mesh axis goes to the first dimension it divides); in the "mlp"
  layout the attention's parameters (those with a heads axis) by `DECODE_RULES`."""
  names, shape = variable.get_metadata().get("axes"), variable.get_value().shape
  if names is None:
    return P()
  if weights == "mlp" and {"heads", "kv_heads"} & set(names):
    return logical_to_spec(names, shape, dict(mesh.shape), DECODE_RULES)
  order = sorted(range(len(names)), key=lambda i: names[i] not in _TENSOR_FIRST)
  spec = logical_to_spec([names[i] for i in order], [shape[i] for i in order], dict(mesh.shape), TENSOR_RULES)
  out = [None] * len(names)
  for i, entry in zip(order, spec):
    out[i] = entry
  return P(*out)


def decode_shardings(state: nnx.State, mesh: Mesh, weights: str = "replicated") -> dict:
  """NamedShardings of a decoding layout (`DECODE_WEIGHTS`: "replicated", `DECODE_RULES`;
  "tensor", `TENSOR_RULES`; "mlp", the two mixed) as a pure dict, for an `nnx.State` of the model's Params (arrays or
  ShapeDtypeStructs, e.g. `nnx.state(abstract_model(cfg), nnx.Param)`); the logical axis names
  come from the parameters' metadata."""
  _check_weights(weights)
  if weights in ("tensor", "mlp"):
    return jax.tree.map(
        lambda v: v.replace(NamedSharding(mesh, _tensor_spec(v, mesh, weights))),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    ).to_pure_dict()
  with axis_rules(DECODE_RULES):
    return pure_shardings(state, mesh)


def _cast(params, dtype: str):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@functools.lru_cache(maxsize=None)
def _reshard_fn(dtype: str, treedef, shardings: tuple | None):
  """The jitted cast + reshard, one per (dtype, layout): built once, not per step."""
  out = None if shardings is None else jax.tree.unflatten(treedef, shardings)
  return jax.jit(functools.partial(_cast, dtype=dtype), out_shardings=out)


def make_rollout_policy(
    graphdef, params, *, dtype: str | None = None, mesh: Mesh | None = None, weights: str = "replicated"
) -> RolloutPolicy:
  """The rollout copy of the policy: `params` (a pure dict, e.g. the train state's, any layout)
  cast to `dtype` (default: the model's compute dtype) and laid out for decoding on `mesh` in the
  `weights` layout (`DECODE_WEIGHTS`) by one jitted call, once per step. Without a mesh and with
  nothing to cast, `params` is used as is."""
  _check_weights(weights)
  model = nnx.merge(graphdef, params)  # Python objects around the same device arrays: no copy
  cfg = model.cfg
  dtype = cfg.dtype if dtype is None else dtype
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  if lora.is_lora(model):  # LoRA: decode with the merged weights, W + alpha / rank * A.B
    return _merged_policy(model, dtype, mesh, weights)
  state = nnx.state(model, nnx.Param)
  pure = state.to_pure_dict()
  rgraphdef = _rollout_graphdef(cfg, dtype, weights)
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
  shardings = None if mesh is None else decode_shardings(state, mesh, weights)
  leaves, treedef = jax.tree.flatten(shardings)
  fn = _reshard_fn(dtype, treedef, None if shardings is None else tuple(leaves))
  return RolloutPolicy(rgraphdef, fn(pure))


def _merged_policy(model, dtype: str, mesh: Mesh | None, weights: str) -> RolloutPolicy:
  """A LoRA model's rollout copy: its adapters merged, cast and laid out by one jitted call."""
  cfg = model.cfg
  graphdef, params = nnx.split(model)
  out = None if mesh is None else decode_shardings(nnx.state(abstract_model(cfg), nnx.Param), mesh, weights)
  leaves, treedef = jax.tree.flatten(out)
  merge = _merge_fn(graphdef, dtype, treedef, tuple(leaves))
  return RolloutPolicy(_rollout_graphdef(cfg, dtype, weights), merge(params))


@functools.lru_cache(maxsize=None)
def _merge_fn(graphdef, dtype: str, treedef, shardings: tuple):
  """The jitted merge + cast + reshard of a LoRA model, one per (model, dtype, layout)."""
  out = jax.tree.unflatten(treedef, shardings) if shardings else None
  return jax.jit(lambda p: _cast(lora.merged(nnx.merge(graphdef, p)), dtype), out_shardings=out)


def as_rollout_policy(
    model, *, dtype: str | None = None, mesh: Mesh | None = None, weights: str = "replicated"
) -> RolloutPolicy:
  """A `Qwen2` -> its rollout copy (`make_rollout_policy`) on `mesh` (else the mesh set by
  `jax.set_mesh` or the one its parameters live on); a `RolloutPolicy` is returned as is. For a
  caller that samples the same weights many times (an evaluation's batches): the copy is made once,
  where `generate(model, ...)` makes one per call."""
  if isinstance(model, RolloutPolicy):
    return model
  graphdef, state = nnx.split(model)
  mesh = mesh if mesh is not None else _find_mesh(state)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    return make_rollout_policy(graphdef, state, dtype=dtype, mesh=mesh, weights=weights)


def abstract_rollout_policy(
    model_cfg, *, dtype: str, mesh: Mesh | None = None, weights: str = "replicated"
) -> RolloutPolicy:
  """A RolloutPolicy of `jax.ShapeDtypeStruct`s (in `dtype`, carrying the `weights` decoding
  layout's shardings on `mesh`) for a `Qwen2Config`: what `lower_generate` needs to compile the
  sampler for a mesh whose devices are absent (e.g. a TPU topology's)."""
  if dtype not in ROLLOUT_DTYPES:
    raise ValueError(f"rollout dtype must be one of {ROLLOUT_DTYPES}, got {dtype!r}")
  _check_weights(weights)
  params = nnx.state(abstract_model(model_cfg), nnx.Param)
  shardings = None if mesh is None else decode_shardings(params, mesh, weights)
  pure = params.to_pure_dict()
  structs = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s
      ),
      pure,
      shardings if shardings is not None else jax.tree.map(lambda _: None, pure),
  )
  return RolloutPolicy(_rollout_graphdef(model_cfg, dtype, weights), structs)


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
