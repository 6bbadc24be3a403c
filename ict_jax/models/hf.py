"""Hugging Face folder <-> Qwen2 NNX model: config.json + *.safetensors (single or sharded).

A model is a local folder or a hub id (`Qwen/Qwen2.5-1.5B-Instruct`): `resolve_model_dir` turns an
id into its snapshot folder with `huggingface_hub.snapshot_download` (downloaded when online, from
the local cache with HF_HUB_OFFLINE=1); every entry point (train, eval, export, `load_pretrained`)
goes through it.

Loading reads tensor by tensor through `safetensors.safe_open(...).get_slice`, and with a mesh
each device's shard is read straight into place (`jax.make_array_from_callback`): the model is
never gathered on one host. Saving writes a folder `transformers.AutoModelForCausalLM` loads.
The per-layer HF tensors `model.layers.{i}.*` are our stacked [L, ...] parameters under `layers/`.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ict_jax.models.axes import spec_for
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import Qwen2, abstract_model

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# ---- name and layout mapping ------------------------------------------------------------------
def _hf_name(path: tuple) -> tuple[str, str]:
  """Our parameter path -> (HF tensor name, layout kind). The decoder layers' parameters are
  stacked [L, ...] under "layers/..."; their name is a template with `{i}` for the layer."""
  p = tuple(str(x) for x in path)
  if p == ("embed", "embedding"):
    return "model.embed_tokens.weight", "copy"
  if p == ("final_norm", "scale"):
    return "model.norm.weight", "copy"
  if p == ("lm_head", "kernel"):
    return "lm_head.weight", "linear"
  if p[0] == "layers":
    rest, pre = p[1:], "model.layers.{i}."
    table = {
        ("input_norm", "scale"): ("input_layernorm.weight", "copy"),
        ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", "copy"),
        ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", "linear"),
        ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", "linear"),
        ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", "linear"),
        ("attn", "o_proj", "kernel"): ("self_attn.o_proj.weight", "heads_out"),
    }
    for proj in ("q_proj", "k_proj", "v_proj"):
      table[("attn", proj, "kernel")] = (f"self_attn.{proj}.weight", "in_heads")
      table[("attn", proj, "bias")] = (f"self_attn.{proj}.bias", "heads_bias")
    if rest in table:
      name, kind = table[rest]
      return pre + name, kind
  raise KeyError(f"no Hugging Face name for parameter {'/'.join(p)}")


def _hf_shape(kind: str, shape: tuple) -> tuple:
  if kind == "copy":
    return tuple(shape)
  if kind == "linear":  # ours [in, out], HF [out, in]
    return (shape[1], shape[0])
  if kind == "in_heads":  # ours [D, N, H], HF [N*H, D]
    return (shape[1] * shape[2], shape[0])
  if kind == "heads_out":  # ours [N, H, D], HF [D, N*H]
    return (shape[2], shape[0] * shape[1])
  if kind == "heads_bias":  # ours [N, H], HF [N*H]
    return (shape[0] * shape[1],)
  raise ValueError(kind)


def _layer_names(name: str, path: tuple, shape: tuple) -> list[str] | None:
  """The HF names of a stacked parameter's L layers (None for an unstacked one)."""
  return [name.format(i=i) for i in range(shape[0])] if str(path[0]) == "layers" else None


def _norm(idx: tuple, shape: tuple) -> list[tuple[int, int]]:
  idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
  return [s.indices(n)[:2] for s, n in zip(idx, shape)]


def _read_shard(get: Callable, kind: str, shape: tuple, idx: tuple) -> np.ndarray:
  """Read the part `idx` of our tensor from the HF slice reader `get` (numpy indexing)."""
  r = _norm(idx, shape)
  if kind == "copy":
    return get(tuple(slice(a, b) for a, b in r))
  if kind == "linear":
    (i0, i1), (o0, o1) = r
    return get((slice(o0, o1), slice(i0, i1))).T
  if kind == "in_heads":
    (d0, d1), (n0, n1), (h0, h1) = r
    h = shape[2]
    x = get((slice(n0 * h, n1 * h), slice(d0, d1))).T  # [d, n*H]
    return x.reshape(d1 - d0, n1 - n0, h)[:, :, h0:h1]
  if kind == "heads_out":
    (n0, n1), (h0, h1), (d0, d1) = r
    h = shape[1]
    x = get((slice(d0, d1), slice(n0 * h, n1 * h))).T  # [n*H, d]
    return x.reshape(n1 - n0, h, d1 - d0)[:, h0:h1, :]
  if kind == "heads_bias":
    (n0, n1), (h0, h1) = r
    h = shape[1]
    return get((slice(n0 * h, n1 * h),)).reshape(n1 - n0, h)[:, h0:h1]
  raise ValueError(kind)


def _to_hf(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == "copy":
    return x
  if kind == "linear":
    return x.T
  if kind == "in_heads":
    return x.reshape(x.shape[0], -1).T
  if kind == "heads_out":
    return x.reshape(-1, x.shape[2]).T
  if kind == "heads_bias":
    return x.reshape(-1)
  raise ValueError(kind)


# ---- a folder or a hub id ---------------------------------------------------------------------
# What a snapshot downloads: the weights, configs, tokenizer and chat template files (never the
# *.bin / *.pt / *.gguf copies some repositories also hold).
HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")


def resolve_model_dir(path_or_id: str | os.PathLike) -> str:
  """A local model folder as it is ("" stays ""); anything else is a Hugging Face hub id
  (`org/name`), resolved to its snapshot folder by `huggingface_hub.snapshot_download`: downloaded
  when online, read from the local cache (HF_HUB_CACHE / HF_HOME) with HF_HUB_OFFLINE=1.
  FileNotFoundError, one line naming it, when it is neither a folder nor a model it can get."""
  path = os.path.expanduser(os.fspath(path_or_id))
  if not path or os.path.isdir(path):
    return path
  from huggingface_hub import constants, snapshot_download
  from huggingface_hub.errors import HFValidationError
  from huggingface_hub.utils import validate_repo_id

  try:
    validate_repo_id(path)
  except HFValidationError:
    raise FileNotFoundError(
        f"{path}: not a directory (expected a Hugging Face model folder or a hub id such as Qwen/Qwen2.5-0.5B)"
    ) from None
  try:
    return snapshot_download(path, allow_patterns=list(HUB_PATTERNS))
  except Exception as e:  # pylint: disable=broad-except  # offline miss, unknown repo, gated, network
    if constants.HF_HUB_OFFLINE:
      why = f"not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1"
    else:
      why = f"cannot be downloaded from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    raise FileNotFoundError(f"{path}: not a local folder, and the hub model {path!r} {why}") from None


# ---- reading ----------------------------------------------------------------------------------
def read_config(path: str, **overrides) -> Qwen2Config:
  """The `Qwen2Config` of the model folder or hub id `path` (its config.json) with `overrides`."""
  path = resolve_model_dir(path)
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: not a directory (expected a Hugging Face model folder)")
  if not os.path.isfile(cfg_file):
    raise FileNotFoundError(f"{cfg_file}: missing (expected the model's config.json)")
  try:
    with open(cfg_file, encoding="utf-8") as f:
      d = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"{cfg_file}: expected a JSON object, got {type(d).__name__}")
  return Qwen2Config.from_hf_dict(d, source=cfg_file, **overrides)


def _weight_files(path: str) -> dict[str, str]:
  """{tensor name: file path} from the index, or from the single file's header."""
  index = os.path.join(path, _INDEX)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: expected JSON with a 'weight_map' object ({e!r})") from None
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  single = os.path.join(path, _SINGLE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path}: no {_SINGLE} or {_INDEX}")
  return {k: single for k in _open(single, {}).keys()}


def _open(file: str, handles: dict):
  if file not in handles:
    if not os.path.isfile(file):
      raise FileNotFoundError(f"{file}: missing (named in {_INDEX})")
    try:
      handles[file] = safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
      raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from None
  return handles[file]


def load_pretrained(
    path: str,
    dtype=jnp.float32,
    *,
    param_dtype=None,
    mesh=None,
    remat_policy: str = "none",
    attention: str = "einsum",
    kernels: str = "portable",
    decode_attention: str = "xla",
) -> Qwen2:
  """Load a Hugging Face Qwen2/Qwen2.5 folder or hub id (`resolve_model_dir`) into a `Qwen2` model.

  dtype: compute dtype; param_dtype: storage dtype (default: dtype). With `mesh`, each
  parameter is created directly in its `NamedSharding` from the logical-axis rules.
  remat_policy, attention, kernels: concrete `Qwen2Config` choices (`setup.resolve_kernels`
  turns "auto" into one for a set of devices)."""
  path = resolve_model_dir(path)
  dt = jnp.dtype(dtype).name
  pdt = jnp.dtype(param_dtype or dtype).name
  cfg = read_config(
      path,
      dtype=dt,
      param_dtype=pdt,
      remat_policy=remat_policy,
      attention=attention,
      kernels=kernels,
      decode_attention=decode_attention,
  )
  where = _weight_files(path)
  abstract = abstract_model(cfg)
  graphdef, state = nnx.split(abstract)
  handles: dict = {}
  used = set()
  try:

    def open_slice(keypath, name, kind, shape):
      """The safetensors slice of HF tensor `name`, checked to have our `shape`'s HF layout."""
      if name not in where:
        raise ValueError(f"{path}: missing tensor {name!r} (needed for {'/'.join(map(str, keypath))})")
      file = where[name]
      f = _open(file, handles)
      if name not in f.keys():
        raise ValueError(f"{file}: missing tensor {name!r} (the index says it is here)")
      used.add(name)
      sl = f.get_slice(name)
      want, got = _hf_shape(kind, shape), tuple(sl.get_shape())
      if got != want:
        raise ValueError(f"{file}: tensor {name!r} has shape {got}, expected {want} for {cfg}")
      return file, sl

    def load(keypath, var):
      name, kind = _hf_name(keypath)
      shape = tuple(var.get_value().shape)
      layer_names = _layer_names(name, keypath, shape)
      if layer_names is None:
        slices = [(name, *open_slice(keypath, name, kind, shape))]
      else:  # one HF tensor per layer, stacked on our leading axis
        slices = [(n, *open_slice(keypath, n, kind, shape[1:])) for n in layer_names]
      np_dtype = np.dtype(var.get_value().dtype)

      def read_one(name, file, sl, shape, idx):
        try:
          return _read_shard(lambda s: sl[s], kind, shape, idx)
        except SafetensorError as e:
          raise ValueError(f"{file}: cannot read tensor {name!r} (truncated file?): {e}") from None

      def read(idx):
        if layer_names is None:
          return np.ascontiguousarray(read_one(*slices[0], shape, idx)).astype(np_dtype)
        (l0, l1), rest = _norm(idx, shape)[0], tuple(idx)[1:]
        return np.ascontiguousarray(np.stack([read_one(*slices[i], shape[1:], rest) for i in range(l0, l1)])).astype(
            np_dtype
        )

      if mesh is None:
        return var.replace(jnp.asarray(read(())))
      sharding = jax.sharding.NamedSharding(mesh, spec_for(var, mesh))
      return var.replace(jax.make_array_from_callback(shape, sharding, read))

    flat = [(k, load(k, v)) for k, v in nnx.to_flat_state(state)]
  finally:
    handles.clear()
  extra = sorted(set(where) - used - _IGNORED(cfg))
  if extra:
    raise ValueError(
        f"{path}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} "
        f"not used by a Qwen2 model with {cfg.num_hidden_layers} layers"
    )
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _IGNORED(cfg: Qwen2Config) -> set[str]:
  ignored = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_hidden_layers)}
  if cfg.tie_word_embeddings:
    ignored.add("lm_head.weight")  # some tied checkpoints store the head anyway
  return ignored


# ---- writing ----------------------------------------------------------------------------------
def _host_array(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_pretrained(
    model: Qwen2, out_dir: str, *, dtype=None, max_shard_bytes: int = 4 << 30, token_ids: dict | None = None
) -> None:
  """Write `config.json` and safetensors (sharded with an index past `max_shard_bytes`).
  `token_ids` ({"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...}) replace Qwen2.5's
  ids in config.json (a task vocabulary's ids differ).

  Every process must call it with a sharded model (arrays are gathered); process 0 writes."""
  cfg = model.cfg
  state = nnx.state(model, nnx.Param)
  np_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for keypath, var in nnx.to_flat_state(state):
    name, kind = _hf_name(keypath)
    value = _host_array(var.get_value())
    layer_names = _layer_names(name, keypath, value.shape)
    pieces = [(name, value)] if layer_names is None else list(zip(layer_names, value))
    for name, x in pieces:
      arr = np.ascontiguousarray(_to_hf(kind, x)).astype(np_dtype)
      if shards[-1] and size + arr.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][name] = arr
      size += arr.nbytes
  if jax.process_index() != 0:
    return
  os.makedirs(out_dir, exist_ok=True)
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(out_dir, _SINGLE), metadata=meta)
  else:
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(tensors, os.path.join(out_dir, fname), metadata=meta)
      weight_map.update({k: fname for k in tensors})
      total += sum(a.nbytes for a in tensors.values())
    with open(os.path.join(out_dir, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**cfg.to_hf_dict(torch_dtype=np_dtype.name), **(token_ids or {})}, f, indent=2)
