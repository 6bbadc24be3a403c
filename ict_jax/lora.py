"""LoRA adapters on the Qwen2 projections, by `qwix` (what Tunix uses), with the base frozen.

`qwix.LoraProvider` intercepts the model's `jnp.einsum` calls while `Qwen2.hidden_states` runs
(`qwix.apply_lora_to_model(..., methods=("hidden_states",))`): in a module whose path matches the
rule (`model.lora_modules`), an einsum whose right operand is that module's `kernel` (each
projection is a `models.qwen2.Proj` holding its kernel) gets `+ alpha / rank * x.A.B`, with A over
the kernel's contracted dimensions and B over the rest (`BTD,DNH->BTNH` gives `BTD,Dr,rNH->BTNH`).
qwix creates its adapters on the first call of a module; here the decoder layers are one module of
stacked [L, ...] parameters run by `lax.scan`, so the adapters are made for the stack instead:
qwix is run once, abstractly, on one unstacked layer (the adapters' names, shapes and einsums),
and each adapter is drawn for the L layers by the rule's own initialisers (A He-uniform, B zero:
the adapted model starts as the base) and attached as an `nnx.LoRAParam` [L, ...] whose logical
axes follow the kernel's. Inside the scan qwix then finds them on the layer it runs.

The trained state is the adapters only (`split`: float32, with AdamW's moments); the base
`nnx.Param`s are frozen, kept in the rollout dtype, no gradient and no optimizer state. The
rollout, eval and export use `merged` weights, W + alpha / rank * A.B, in the plain model.
"""

from __future__ import annotations

import functools
import re
import string

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from ict_jax.models.axes import pure_shardings
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import DecoderLayer, Qwen2, abstract_model, rope_cos_sin

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MODULES = ",".join(PROJECTIONS)  # Tunix's examples: the attention and MLP projections
_SUFFIXES = ("_lora_a", "_lora_b")


def module_pattern(modules: str) -> str:
  """`model.lora_modules` -> the regex qwix matches against module paths (`layers/attn/q_proj`):
  a comma list of projection names, or a regex over the path. Raises ValueError naming what no
  projection matches."""
  modules = modules.strip()
  if re.fullmatch(r"[A-Za-z0-9_]+(\s*,\s*[A-Za-z0-9_]+)*", modules):
    names = [m.strip() for m in modules.split(",")]
    unknown = [m for m in names if m not in PROJECTIONS]
    if unknown:
      raise ValueError(f"unknown projection {unknown[0]!r}; expected names among {', '.join(PROJECTIONS)}")
    return ".*/(" + "|".join(names) + ")"
  try:
    pattern = re.compile(modules)
  except re.error as e:
    raise ValueError(f"{modules!r} is neither a comma list of projections nor a regex ({e})") from None
  paths = [f"layers/{'attn' if p[0] in 'qkvo' else 'mlp'}/{p}" for p in PROJECTIONS]
  if not any(pattern.fullmatch(p) for p in paths):
    raise ValueError(f"the regex {modules!r} matches none of the projections' paths ({', '.join(paths)})")
  return modules


def rule(rank: int, alpha: float, modules: str = DEFAULT_MODULES) -> qwix.LoraRule:
  """The qwix rule: its initialisers draw the adapters (A He-uniform, B zero)."""
  return qwix.LoraRule(module_path=module_pattern(modules), rank=rank, alpha=alpha)


def provider(rank: int, alpha: float, modules: str = DEFAULT_MODULES) -> qwix.LoraProvider:
  return qwix.LoraProvider([rule(rank, alpha, modules)])


class _OneLayer(nnx.Module):
  """One decoder layer at the model's path of the stack (`layers/...`), for the rule to match."""

  def __init__(self, cfg: Qwen2Config):
    self.layers = DecoderLayer(cfg, rngs=nnx.Rngs(0))

  def __call__(self, *args):
    return self.layers(*args)


@functools.lru_cache(maxsize=None)
def _one_layer(cfg: Qwen2Config, rank: int, alpha: float, modules: str):
  """qwix's LoRA on ONE unstacked float32 decoder layer, abstract: the adapters' structure."""
  cfg = cfg.replace(param_dtype="float32", dtype="float32", remat_policy="none")

  def make():
    layer = _OneLayer(cfg)
    x = jnp.zeros((1, 2, cfg.hidden_size), jnp.float32)
    cos, sin = rope_cos_sin(jnp.zeros((1, 2), jnp.int32), cfg.head_dim, cfg.rope_theta)
    return qwix.apply_lora_to_model(
        layer, provider(rank, alpha, modules), x, cos, sin, jnp.ones((1, 2), jnp.int32), rngs=nnx.Rngs(0)
    )

  return nnx.eval_shape(make).layers


def _adapted(module) -> bool:
  return hasattr(module, "kernel_lora_a") and hasattr(module, "kernel_lora_einsum_str")


def _split_einsum(module) -> tuple[str, str, str]:
  """(A's letters, B's letters, the kernel's letters) of a module qwix adapted."""
  _, a, b = module.kernel_lora_einsum_str.split("->")[0].split(",")
  return a, b, module.equation.split("->")[0].split(",")[1]


def apply(model: Qwen2, rank: int, alpha: float, modules: str = DEFAULT_MODULES, seed: int = 0) -> Qwen2:
  """`model` with qwix's LoRA on the projections `modules` matches: a new model (the same base
  arrays) whose `hidden_states` (and `__call__`) add the adapters, drawn from `seed`."""
  cfg = model.cfg
  layer, init_rule = _one_layer(cfg, rank, alpha, modules), rule(rank, alpha, modules)
  lora = qwix.apply_lora_to_model(
      model,
      provider(rank, alpha, modules),
      jnp.zeros((1, 2), jnp.int32),
      methods=("hidden_states",),
      skip_nnx_init=True,  # the adapters are attached below, for the stacked layers
      rngs=nnx.Rngs(seed),
  )
  n = cfg.num_hidden_layers
  key = jax.random.key(seed)
  for path, one in nnx.iter_modules(layer):
    if not _adapted(one):
      continue
    target = lora.layers
    for name in path:  # ("attn", "q_proj")
      target = getattr(target, name)
    a_letters, b_letters, kernel_letters = _split_einsum(one)
    axes = dict(zip(kernel_letters, target.kernel.get_metadata()["axes"][1:]))
    for suffix, letters, init in zip(
        _SUFFIXES, (a_letters, b_letters), (init_rule.lora_a_initializer, init_rule.lora_b_initializer)
    ):
      shape = getattr(one, "kernel" + suffix).shape
      key, sub = jax.random.split(key)
      value = jax.vmap(lambda k: init(k, shape, jnp.float32))(jax.random.split(sub, n))  # per layer's fan-in
      setattr(target, "kernel" + suffix, nnx.LoRAParam(value, axes=("layers",) + tuple(axes.get(c) for c in letters)))
    target.kernel_lora_einsum_str = one.kernel_lora_einsum_str
  lora.lora_scale = float(alpha) / rank
  return lora


def abstract(cfg: Qwen2Config, rank: int, alpha: float, modules: str = DEFAULT_MODULES) -> Qwen2:
  """The LoRA model of `cfg` with `ShapeDtypeStruct` leaves (no memory)."""
  return nnx.eval_shape(lambda: apply(Qwen2(cfg, rngs=nnx.Rngs(params=0)), rank, alpha, modules))


def split(model: Qwen2):
  """A LoRA model -> (graphdef, adapters, base): the trained float32 `LoRAParam`s and the frozen
  `Param`s, each a pure dict; `nnx.merge(graphdef, join(base, adapters))` rebuilds the model."""
  graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
  return graphdef, adapters.to_pure_dict(), base.to_pure_dict()


def join(base: dict, adapters: dict) -> dict:
  """The base's and the adapters' pure dicts as one (their leaves are disjoint): no copy."""
  out = dict(base)
  for k, v in adapters.items():
    out[k] = join(base[k], v) if isinstance(v, dict) and k in base else v
  return out


def is_lora(model) -> bool:
  return hasattr(model, "lora_scale")


def merge(graphdef, params) -> Qwen2:
  """`nnx.merge(graphdef, params)`, a LoRA model's adapters cast to the compute dtype
  (`model.dtype`): qwix adds x.A.B in the adapters' dtype, and the decoder's layer scan carries
  its activations in the compute dtype. The cast is inside whatever is differentiated, so the
  gradients are still the float32 adapters'. A plain model is merged as it is."""
  model = nnx.merge(graphdef, params)
  if is_lora(model):
    dt = jnp.dtype(model.cfg.dtype)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dt), nnx.state(model, nnx.LoRAParam)))
  return model


def merged(model: Qwen2) -> dict:
  """A LoRA model's weights merged, W + alpha / rank * A.B (in float32), as the plain model's pure
  dict of `nnx.Param`s (no adapter): what the rollout decodes with and the export writes."""
  scale = model.lora_scale
  out = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict()
  for path, module in nnx.iter_modules(model):
    if not _adapted(module):
      continue
    a_letters, b_letters, kernel_letters = _split_einsum(module)
    lead = sorted(set(string.ascii_letters) - set(a_letters + b_letters + kernel_letters))[0]  # the layers axis
    delta = jnp.einsum(
        f"{lead}{a_letters},{lead}{b_letters}->{lead}{kernel_letters}",
        module.kernel_lora_a[...],
        module.kernel_lora_b[...],
        preferred_element_type=jnp.float32,
    )
    node = out
    for name in path:
      node = node[name]
    node["kernel"] = node["kernel"].astype(jnp.float32) + scale * delta
  return out


def abstract_split(cfg: Qwen2Config, rank: int, alpha: float, modules: str, mesh):
  """-> (graphdef, adapters, base) of the LoRA model of `cfg`, abstract: pure dicts of
  `ShapeDtypeStruct`s carrying their `NamedSharding`s on `mesh` (by the logical axes)."""
  model = abstract(cfg, rank, alpha, modules)
  graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, nnx.Param)

  def structs(state):
    shardings = pure_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state.to_pure_dict(), shardings
    )

  return graphdef, structs(adapters), structs(base)


def init_split(base: dict, cfg: Qwen2Config, rank: int, alpha: float, modules: str, seed: int):
  """The starting adapters (float32; B = 0, so the adapted model is the base) for a plain model's
  pure dict `base` -> (adapters, base): pure dicts, the base's arrays as they were."""
  plain = nnx.merge(nnx.graphdef(abstract_model(cfg)), base)
  _, adapters, base = split(apply(plain, rank, alpha, modules, seed))
  return adapters, base
