"""A checkpoint's tree read from Orbax's metadata, and its tensors restored one (stacked) tensor
at a time into the placement asked for (`ict_jax.inspect`'s reading half)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import os
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from etils import epath

from ict_jax.checkpoint import CheckpointError, CheckpointReader, resolve_path

log = logging.getLogger(__name__)

_ITEMS = {"params": ("state", "params"), "ref_params": ("ref_params",)}
_ORDER = {"embed": 0, "layers": 1, "final_norm": 2, "lm_head": 3}


# ---- one tensor's metadata -------------------------------------------------------------------
def _human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024.0
  raise AssertionError("unreachable")


def _spec_entry(e) -> str:
  if e is None:
    return "None"
  if isinstance(e, (tuple, list)):
    return "(" + ", ".join(repr(a) for a in e) + ")"
  return repr(e)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Metadata of one saved array, as Orbax recorded it (nothing is read from the array files)."""

  path: str  # "layers/3/attn/q_proj/kernel" (relative to the item)
  shape: tuple[int, ...]
  dtype: np.dtype
  sharding: Any = None  # orbax ShardingMetadata (Named / SingleDevice) or None

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize

  @property
  def mesh(self) -> dict[str, int] | None:
    """{mesh axis: size} of the mesh it was saved from (None unless a NamedSharding)."""
    names = getattr(self.sharding, "axis_names", None)
    if names is None:
      return None
    return {str(a): int(n) for a, n in zip(names, np.asarray(self.sharding.shape).reshape(-1))}

  @property
  def partition_spec(self) -> tuple | None:
    spec = getattr(self.sharding, "partition_spec", None)
    return None if spec is None else tuple(spec)

  @property
  def spec_str(self) -> str:
    """ "P(None, 'fsdp')" for a NamedSharding, "device cpu:0" for one device, "?" when unknown."""
    spec = self.partition_spec
    if spec is not None:
      return "P(" + ", ".join(_spec_entry(e) for e in spec) + ")"
    device = getattr(self.sharding, "device_str", None)
    return f"device {device}" if device is not None else "?"

  @property
  def shard_nbytes(self) -> int:
    """Bytes of one device's shard (the whole tensor when replicated or unknown)."""
    mesh, spec = self.mesh, self.partition_spec
    if not mesh or spec is None:
      return self.nbytes
    parts = 1
    for entry in spec:
      for ax in (entry if isinstance(entry, (tuple, list)) else () if entry is None else (entry,)):
        parts *= mesh.get(ax, 1)
    return self.nbytes // max(parts, 1)

  def summary(self) -> str:
    """'float32[64, 4, 16]  P('fsdp', None, None)  16.0 KiB'."""
    dims = ", ".join(str(d) for d in self.shape)
    return f"{np.dtype(self.dtype).name}[{dims}]  {self.spec_str}  {_human_bytes(self.nbytes)}"

  def __treescope_repr__(self, path, subtree_renderer):
    del subtree_renderer
    from treescope import rendering_parts as rp

    dims = ", ".join(str(d) for d in self.shape)
    line = rp.siblings(
        rp.text(f"{np.dtype(self.dtype).name}[{dims}]"),
        rp.comment_color(rp.text(f"  {self.spec_str}  {_human_bytes(self.nbytes)}")),
    )
    return rp.build_one_line_tree_node(line, path)


# ---- path helpers ------------------------------------------------------------------------------
def _key(k) -> Any:
  """Orbax metadata stringifies dict keys ('3'); the model's pure dicts use ints for layers."""
  return int(k) if isinstance(k, str) and k.isdigit() else k


def _split(path: str) -> tuple:
  return tuple(_key(p) for p in path.strip("/").split("/"))


def layer_group(path: str) -> str:
  """'layers/3/attn/q_proj/kernel' -> 'layers/3'; 'layers/attn/q_proj/kernel' (stacked, all
  layers) -> 'layers'; 'embed/embedding' -> 'embed'."""
  parts = path.split("/")
  return "/".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else parts[0]


def _stacked(path: str) -> bool:
  """A decoder-layer parameter stacked on a leading [L] axis ('layers/attn/q_proj/kernel')."""
  return layer_group(path) == "layers"


def _read_group(path: str) -> str:
  """Tensors read together: each stacked tensor alone, the rest by layer group."""
  return path if _stacked(path) else layer_group(path)


def _group_sort_key(group: str):
  parts = group.split("/")
  return (_ORDER.get(parts[0], len(_ORDER)), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0, group)


def _nest(flat: Mapping[str, Any]) -> dict:
  """{"a/0/b": x} -> {"a": {0: {"b": x}}}."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    *parents, last = _split(path)
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = value
  return out


def _get(tree: Any, keys: Iterable) -> Any:
  for k in keys:
    tree = tree[k]
  return tree


def _walk(tree: Any, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
  """(keys, leaf) for every array leaf of an Orbax metadata tree (dicts, lists, tuples)."""
  if isinstance(tree, Mapping):
    for k, v in tree.items():
      yield from _walk(v, prefix + (_key(k),))
  elif isinstance(tree, (list, tuple)) and not hasattr(tree, "shape"):
    for i, v in enumerate(tree):
      yield from _walk(v, prefix + (i,))
  elif hasattr(tree, "shape") and hasattr(tree, "dtype"):
    yield prefix, tree


def _in_notebook() -> bool:
  try:
    from IPython import get_ipython
  except ImportError:
    return False
  shell = get_ipython()
  return shell is not None and hasattr(shell, "kernel")


# ---- the checkpoint ------------------------------------------------------------------------------
class Checkpoint:
  """A read-only view of `<workdir>/checkpoints/` with one selected step (`.step`).

  Every method reads what it needs itself: `model_config` and `logical_axes` are computed on
  first use and kept (cached properties), `meta(step)` and `tensors(step)` remember what they
  read, so no result depends on which method was called first."""

  def __init__(self, directory: str | os.PathLike, step: int | None = None, *, model_config=None):
    self._reader = CheckpointReader(directory)
    self.directory = self._reader.directory
    self.step = self._reader.pick_step(step)
    self._given_model_config = model_config  # None: `model_config` infers it
    self._tensors: dict[int, dict[str, TensorInfo]] = {}  # tensors(step)'s metadata, by step
    self._meta: dict[int, dict] = {}  # meta(step), by step

  # ---- steps and metadata --------------------------------------------------------------------
  @property
  def steps(self) -> list[int]:
    """Every committed step, oldest first (re-read from the directory on each call)."""
    return self._reader.steps

  @property
  def workdir(self) -> epath.Path:
    """The folder holding `checkpoints/`: the run's workdir (config.json, task_vocab.json)."""
    return self.directory.parent

  def pick_step(self, step: int | None = None) -> int:
    """`step` if it is committed (else a `CheckpointError` listing the steps); None: `.step`."""
    return self.step if step is None else self._reader.pick_step(step)

  def at(self, step: int) -> "Checkpoint":
    """The same checkpoint directory with another step selected."""
    return Checkpoint(self.directory, self.pick_step(step), model_config=self._given_model_config)

  def meta(self, step: int | None = None) -> dict:
    """The step's JSON item: data_position, step, seed, config."""
    step = self.pick_step(step)
    if step not in self._meta:
      self._meta[step] = self._reader.meta(step)
    return self._meta[step]

  @property
  def config(self):
    """The run's validated `Config` from the meta item (None when it no longer validates)."""
    from ict_jax import config as config_lib

    raw = self.meta().get("config")
    if raw is None:
      return None
    try:
      return config_lib.from_dict(raw)
    except config_lib.ConfigError as e:
      log.warning(
          "%s/%d/meta: config does not validate (%s); using the tensor shapes only",
          os.fspath(self.directory),
          self.step,
          e,
      )
      return None

  def tensors(self, step: int | None = None, *, item: str | None = "params") -> dict[str, TensorInfo]:
    """{path: TensorInfo} of `item` ("params", "ref_params", or None for the whole saved tree,
    optimizer state included), from Orbax metadata only."""
    step = self.pick_step(step)
    if step not in self._tensors:
      tree = self._reader.state_metadata(step)
      if tree is None:
        raise CheckpointError(f"{os.fspath(self.directory / str(step))}/state: no Orbax tree metadata")
      self._tensors[step] = {
          "/".join(str(k) for k in keys): TensorInfo(
              "/".join(str(k) for k in keys),
              tuple(int(d) for d in leaf.shape),
              np.dtype(leaf.dtype),
              getattr(leaf, "sharding", None),
          )
          for keys, leaf in _walk(tree)
      }
    everything = self._tensors[step]
    if item is None:
      return dict(everything)
    if item not in _ITEMS:
      raise ValueError(f"item {item!r}: expected one of {sorted(_ITEMS)} or None")
    prefix = "/".join(_ITEMS[item]) + "/"
    out = {
        p[len(prefix) :]: dataclasses.replace(t, path=p[len(prefix) :])
        for p, t in everything.items()
        if p.startswith(prefix)
    }
    if not out:
      raise CheckpointError(
          f"{os.fspath(self.directory / str(step))}: no '{item}' in the saved state "
          f"(top-level items: {sorted({p.split('/')[0] for p in everything})})"
      )
    return out

  def tree(self, step: int | None = None, *, item: str | None = "params") -> dict:
    """The nested tree of `TensorInfo` (layer indices as ints), like the model's pure dict."""
    return _nest(self.tensors(step, item=item))

  def nbytes(self, step: int | None = None, *, item: str | None = "params") -> int:
    return sum(t.nbytes for t in self.tensors(step, item=item).values())

  @functools.cached_property
  def model_config(self):
    """The `Qwen2Config` of the saved parameters: the one given to the constructor, else the
    run's (`setup.model_config_from_checkpoint`) checked against the saved shapes (see
    `_resolve_model_config`)."""
    if self._given_model_config is not None:
      return self._given_model_config
    if self.lora_config is not None:  # the adapters' shapes are not the model's: the run's model
      from ict_jax import setup

      return setup.model_config_from_checkpoint(self.workdir, config=self.lora_config).replace(param_dtype="float32")
    return _resolve_model_config(self.tensors(), self.config, self.workdir, os.fspath(self.directory / str(self.step)))

  @functools.cached_property
  def lora_config(self):
    """The run's config when it trained LoRA adapters (model.lora_rank > 0; its `params` are the
    adapters, the base not saved), else None."""
    cfg = self.config
    return cfg if cfg is not None and cfg.model.lora_rank else None

  @functools.cached_property
  def logical_axes(self) -> dict[str, tuple]:
    """{param path: logical axis names} of `model_config` (the placement `mesh=` reads into)."""
    return param_axes(self.model_config, self.lora_config)

  # ---- reading tensors -----------------------------------------------------------------------
  def restore(
      self, paths: Iterable[str] | None = None, *, step: int | None = None, mesh=None, item: str = "params"
  ) -> dict[str, jax.Array]:
    """{path: array} of the saved tensors `paths` of `item` (default: all of them), read by Orbax
    partial restore and nothing else. Without `mesh` each lands on the first local device; with
    one, in the `NamedSharding` of its logical axes (`models.axes.logical_to_spec`), each device
    reading only its shard."""
    import orbax.checkpoint as ocp

    step = self.pick_step(step)
    tensors = self.tensors(step, item=item)
    infos = list(tensors.values()) if paths is None else [self._stored(tensors, p, step, item) for p in paths]
    axes = None if mesh is None else self.logical_axes
    prefix = _ITEMS[item]
    flat_target, flat_args = {}, {}
    for info in infos:
      sharding = _placement(info, mesh, axes)
      flat_target[info.path] = jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)
      flat_args[info.path] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=info.shape, dtype=info.dtype)
    wrap = lambda t: _nest({"/".join(prefix) + "/" + p: v for p, v in t.items()})
    restored = self._reader.restore_state(step, wrap(flat_target), wrap(flat_args))
    return {p: _get(restored, prefix + _split(p)) for p in flat_target}

  def load_param(self, path: str, mesh=None, *, step: int | None = None, item: str = "params") -> jax.Array:
    """One tensor (e.g. "layers/attn/q_proj/kernel", all layers [L, D, N, H]), read alone by
    `restore`; "layers/3/attn/q_proj/kernel" is layer 3's slice [D, N, H] of it (the stacked
    tensor is read, then sliced into the placement of the slice's logical axes on `mesh`)."""
    step = self.pick_step(step)
    info, layer = _lookup(self.tensors(step, item=item), path, self._missing(step, item))
    x = self.restore([info.path], step=step, mesh=mesh, item=item)[info.path]
    if layer is None:
      return x
    out = x.sharding
    if mesh is not None:
      from ict_jax.models.axes import logical_to_spec

      names = self.logical_axes[info.path][1:]
      out = jax.sharding.NamedSharding(mesh, logical_to_spec(names, info.shape[1:], dict(mesh.shape)))
    return jax.jit(lambda x: x[layer], out_shardings=out)(x)

  def load_params(self, step: int | None = None, *, mesh=None, item: str = "params") -> dict:
    """The whole parameter pure dict (the model's `nnx.to_pure_dict`), without the optimizer state."""
    return _nest(self.restore(step=step, mesh=mesh, item=item))

  def restore_model(self, step: int | None = None, *, mesh=None, item: str = "params"):
    """The `Qwen2` model (nnx) of `model_config` holding the step's parameters."""
    from flax import nnx
    from ict_jax.models.qwen2 import abstract_model

    graphdef, _ = nnx.split(abstract_model(self.model_config))
    params = self.load_params(step, mesh=mesh, item=item)
    if self.lora_config is not None:  # W + alpha / rank * A.B, the base rebuilt as the run began
      from ict_jax import setup, sharding

      mesh = mesh or sharding.make_mesh((1, 1, 1), jax.local_devices()[:1])
      params = setup.lora_merged_params(self.lora_config, self.model_config, params, mesh)
    return nnx.merge(graphdef, params)

  def _missing(self, step: int, item: str) -> str:
    return f"{os.fspath(self.directory / str(step))}: no {item} tensor"

  def _stored(self, tensors: Mapping[str, TensorInfo], path: str, step: int, item: str) -> TensorInfo:
    info, layer = _lookup(tensors, path, self._missing(step, item))
    if layer is not None:
      raise KeyError(f"{path!r} is one layer's slice of the stored {info.path!r}: read it with load_param")
    return info

  # ---- rendering -----------------------------------------------------------------------------
  def header(self, step: int | None = None) -> str:
    step = self.pick_step(step)
    params = self.tensors(step)
    meshes = {json.dumps(t.mesh) for t in params.values() if t.mesh}
    mesh = (
        " ".join(f"{k}={v}" for k, v in json.loads(meshes.pop()).items())
        if len(meshes) == 1
        else ("several meshes" if meshes else "no mesh recorded")
    )
    n = sum(t.size for t in params.values())
    full = self.nbytes(step, item=None)
    return (
        f"checkpoint {os.fspath(self.directory)}  step {step}  (steps {self.steps})\n"
        f"params: {len(params)} tensors, {n:,} parameters, {_human_bytes(self.nbytes(step))}; "
        f"whole state {_human_bytes(full)}; saved on mesh {mesh}"
    )

  def render_text(self, step: int | None = None, *, item: str | None = "params") -> str:
    """A plain-text table: path, dtype[shape], saved sharding, bytes (and bytes per device)."""
    rows = [
        (
            t.path,
            f"{np.dtype(t.dtype).name}[{', '.join(map(str, t.shape))}]",
            t.spec_str,
            _human_bytes(t.nbytes),
            _human_bytes(t.shard_nbytes),
        )
        for t in self.tensors(step, item=item).values()
    ]
    head = ("path", "dtype[shape]", "sharding", "bytes", "per device")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([self.header(step), fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])

  def show(self, step: int | None = None, *, item: str | None = "params", max_height: int = 80) -> None:
    """Treescope (collapsible tree, one line per tensor, about `max_height` lines expanded) in a
    notebook; the text table elsewhere."""
    if not _in_notebook():
      print(self.render_text(step, item=item))
      return
    import treescope

    print(self.header(step))
    with treescope.using_expansion_strategy(max_height=max_height, target_width=100):
      treescope.display(self.tree(step, item=item))

  def __str__(self) -> str:
    return self.render_text()

  def __repr__(self) -> str:
    return f"Checkpoint({os.fspath(self.directory)!r}, step={self.step}, steps={self.steps})"

  def close(self) -> None:
    self._reader.close()

  def __enter__(self) -> "Checkpoint":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def open_checkpoint(workdir_or_path: str | os.PathLike, step: int | None = None, *, model_config=None) -> Checkpoint:
  """A workdir, its `checkpoints/` folder, or one `checkpoints/<step>/` folder -> `Checkpoint`.

  `step` (default: the step of a step folder, else the latest) selects `.step`. `model_config`
  (a `Qwen2Config`) overrides the architecture read from the run's config."""
  from ict_jax import storage

  storage.check_backend(workdir_or_path, "checkpoint path")
  path = resolve_path(workdir_or_path)
  if not path.exists():
    raise CheckpointError(f"{os.fspath(path)!r} does not exist")
  if path.name.isdigit() and (path / "state").exists():
    directory, step = path.parent, int(path.name) if step is None else step
  elif (path / "checkpoints").is_dir():
    directory = path / "checkpoints"
  else:
    directory = path
  return Checkpoint(directory, step, model_config=model_config)


# ---- the architecture -------------------------------------------------------------------------
def _shape_dims(params: Mapping[str, TensorInfo], where: str) -> dict:
  """Architecture sizes read off the parameter shapes."""
  need = ("embed/embedding", "layers/attn/q_proj/kernel", "layers/attn/k_proj/kernel", "layers/mlp/gate_proj/kernel")
  missing = [p for p in need if p not in params]
  if missing and "layers/0/attn/q_proj/kernel" in params:
    raise CheckpointError(
        f"{where}: saved with one tensor per decoder layer (layers/0/...), the "
        "layout before the scanned layers; this version reads stacked layers/... "
        "tensors only"
    )
  if missing:
    raise CheckpointError(f"{where}: not a Qwen2 parameter tree (missing {missing})")
  vocab, hidden = params["embed/embedding"].shape
  layers, _, heads, _ = params["layers/attn/q_proj/kernel"].shape
  _, _, kv_heads, _ = params["layers/attn/k_proj/kernel"].shape
  return dict(
      vocab_size=vocab,
      hidden_size=hidden,
      num_attention_heads=heads,
      num_key_value_heads=kv_heads,
      num_hidden_layers=layers,
      intermediate_size=params["layers/mlp/gate_proj/kernel"].shape[2],
      tie_word_embeddings="lm_head/kernel" not in params,
  )


def _resolve_model_config(params: Mapping[str, TensorInfo], cfg, workdir: str | os.PathLike, where: str):
  """The run's model (`setup.model_config_from_checkpoint`: its Hugging Face folder's config.json
  or preset, a task vocabulary's rows from `workdir`'s task_vocab.json) when it matches the saved
  shapes; else the preset with those shapes; else the shapes with Qwen2.5's defaults (rope_theta
  1e6), with a warning. Parameter dtype: the saved one."""
  from ict_jax.models.config import PRESETS, Qwen2Config

  dims = _shape_dims(params, where)
  pdt = np.dtype(params["embed/embedding"].dtype).name
  dtype = cfg.model.dtype if cfg is not None else pdt
  matches = lambda c: all(getattr(c, k) == v for k, v in dims.items())
  run = None if cfg is None else _run_model_config(cfg, workdir, dims["vocab_size"], where)
  if run is not None:
    if matches(run):
      return run.replace(param_dtype=pdt)
    log.warning(
        "%s: the run's model (%s) does not match the saved shapes %s",
        where,
        cfg.model.path or f"preset {cfg.model.preset!r}",
        dims,
    )
  for preset in PRESETS.values():
    if matches(preset):
      return preset.replace(dtype=dtype, param_dtype=pdt)
  log.warning(
      "%s: no preset has the saved shapes %s; assuming Qwen2.5 defaults for rope_theta and "
      "rms_norm_eps (pass model_config= to open_checkpoint to override)",
      where,
      dims,
  )
  return Qwen2Config(**dims, dtype=dtype, param_dtype=pdt)


def _run_model_config(cfg, workdir: str | os.PathLike, vocab_rows: int, where: str):
  """`setup.model_config_from_checkpoint` of the run; None, with a warning, when it cannot be
  read. A task-vocabulary run's checkpoints whose workdir's task_vocab.json is missing or
  unreadable (the checkpoints copied elsewhere) get the run's preset with the saved embedding's
  `vocab_rows`."""
  from ict_jax import setup
  from ict_jax.config import ConfigError

  try:
    return setup.model_config_from_checkpoint(workdir, config=cfg)
  except ConfigError as e:
    error = e
  if cfg.model.vocab == "task" and not cfg.model.path:
    qwen = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab="qwen"))
    try:
      return setup.model_config(qwen, "").replace(vocab_size=vocab_rows)
    except ConfigError as e:
      error = e
  log.warning("%s: the run's model cannot be read (%s); using the saved shapes", where, error)
  return None


def param_axes(model_config, lora_config=None) -> dict[str, tuple]:
  """{param path: logical axis names} from the model's `axes` metadata (no memory used); with a
  LoRA run's config, its adapters' too."""
  from flax import nnx
  from ict_jax import lora
  from ict_jax.models.qwen2 import abstract_model

  m = lora_config and lora_config.model
  model = (
      abstract_model(model_config)
      if m is None
      else lora.abstract(model_config, m.lora_rank, m.lora_alpha, m.lora_modules)
  )
  state = nnx.state(model, nnx.Param)  # a LoRAParam is a Param
  return {"/".join(str(k) for k in keys): tuple(var.get_metadata()["axes"]) for keys, var in nnx.to_flat_state(state)}


# ---- reading tensors ----------------------------------------------------------------------------
def _placement(info: TensorInfo, mesh, axes: Mapping[str, tuple] | None):
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  from ict_jax.models.axes import logical_to_spec

  names = axes.get(info.path) if axes else None
  if names is None:
    raise KeyError(f"no logical axes for parameter {info.path!r} in the model's metadata")
  return jax.sharding.NamedSharding(mesh, logical_to_spec(names, info.shape, dict(mesh.shape)))


def _lookup(tensors: Mapping[str, TensorInfo], path: str, missing: str) -> tuple[TensorInfo, int | None]:
  """-> (the stored tensor, layer index or None): "layers/3/x" names layer 3 of stacked "layers/x".
  An unknown path: a KeyError, `missing` and the path, naming the closest stored ones."""
  path = path.strip("/")
  if path in tensors:
    return tensors[path], None
  parts = path.split("/")
  if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
    stacked = tensors.get("/".join(["layers"] + parts[2:]))
    if stacked is not None and int(parts[1]) < stacked.shape[0]:
      return stacked, int(parts[1])
  close = difflib.get_close_matches(path, list(tensors), n=3)
  raise KeyError(
      f"{missing} {path!r}"
      + (f"; did you mean {close}?" if close else f"; {len(tensors)} tensors, e.g. {list(tensors)[:3]}")
  )


def read_groups(ckpt: Checkpoint, step: int, item: str) -> list[list[str]]:
  """The stored paths of `item`, in groups read together and in model order: each stacked tensor
  alone, the rest by layer group (what `stats` holds in memory at a time)."""
  groups: dict[str, list[str]] = {}
  for info in ckpt.tensors(step, item=item).values():
    groups.setdefault(_read_group(info.path), []).append(info.path)
  return [groups[g] for g in sorted(groups, key=_group_sort_key)]
