"""Building the run's pieces from a validated `Config`: the mesh, the model config (of a config,
or of a saved run: `model_config_from_checkpoint`), the abstract parameters with their shardings.
Shared by `train.py`, `eval/` and `inspect/` (nothing may import train.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from ict_jax import config as config_lib
from ict_jax import lora, sharding, task_vocab
from ict_jax.checkpoint import CheckpointReader
from ict_jax.config import Config, ConfigError
from ict_jax.models.config import Qwen2Config
from ict_jax.models.hf import load_pretrained, read_config
from ict_jax.models.qwen2 import Qwen2, abstract_model


def make_mesh(cfg: Config, devices=None) -> Mesh:
  """The ("data", "fsdp", "tensor") mesh of `config.mesh` over `devices` (default: all; `aot`
  passes a target's compile-only devices)."""
  try:
    return sharding.make_mesh(
        {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}, devices=devices
    )
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None


# model.attention "auto" by the platform of the mesh's devices: the flash kernels on
# accelerators, the reference einsum on CPU (and on anything else). cuDNN's flash attention
# computes in float16/bfloat16 only: a float32 model on GPU gets XLA's fused op instead.
AUTO_ATTENTION = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}
CUDNN_DTYPES = ("bfloat16", "float16")


def resolve_attention(choice: str, mesh: Mesh | None = None, dtype: str = "bfloat16") -> str:
  """`config.model.attention` -> a concrete implementation; "auto" looks at the devices of
  `mesh` (default: jax.devices()), once, here, so the model never checks the backend, and at
  the compute `dtype` (cuDNN has no float32 flash attention: "dot_product" there)."""
  if choice != "auto":
    return choice
  device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
  choice = AUTO_ATTENTION.get(device.platform, "einsum")
  if choice == "cudnn" and dtype not in CUDNN_DTYPES:
    return "dot_product"
  return choice


# model.decode_attention "auto": the fused Pallas kernel where it compiles (TPU), else XLA's einsums.
AUTO_DECODE_ATTENTION = {"tpu": "pallas"}


def resolve_decode_attention(choice: str, devices=None) -> str:
  """`config.model.decode_attention` -> "xla", "pallas" or "pallas_interpret" for the devices
  (a mesh's, default jax.devices()): "auto" is "pallas" on TPU, else "xla"; "pallas" asked for
  off TPU (a Mosaic kernel) is a clear error here, not a compile failure later."""
  platform = next(iter(jax.devices() if devices is None else devices)).platform
  if choice == "auto":
    return AUTO_DECODE_ATTENTION.get(platform, "xla")
  if choice == "pallas" and platform != "tpu":
    raise ConfigError(
        f"config.model.decode_attention: 'pallas' is a TPU kernel and the devices are {platform}; use "
        f"'xla' (or 'pallas_interpret', the same kernel in the Pallas interpreter: slow, for checks)"
    )
  return choice


def resolve_kernels(choice: str, devices=None) -> str:
  """`config.model.kernels` -> "portable" or "cpu" (`ict_jax.cpu_paths`): "auto" is "cpu" only
  when `devices` (a mesh's, default jax.devices()) are one CPU device; accelerators and every
  multi-device mesh, CPU included, get "portable". Decided once, here, from the devices."""
  if choice != "auto":
    return choice
  devices = list(jax.devices() if devices is None else devices)
  return "cpu" if len(devices) == 1 and devices[0].platform == "cpu" else "portable"


def model_config(cfg: Config, hf_dir: str, mesh: Mesh | None = None, tokenizer=None) -> Qwen2Config:
  """Architecture from the Hugging Face folder `hf_dir` (its config.json), else `model.preset`
  with, for `model.vocab="task"`, the embedding sized for `tokenizer` (a `task_vocab.TaskTokenizer`);
  dtypes, the remat policy, the attention implementation and the kernels from `config.model`
  ("auto" resolved for the devices of `mesh`, default jax.devices())."""
  devices = None if mesh is None else list(mesh.devices.flat)
  kw = dict(
      dtype=cfg.model.dtype,
      param_dtype=cfg.model.param_dtype,
      remat_policy=cfg.model.remat_policy,
      attention=resolve_attention(cfg.model.attention, mesh, cfg.model.dtype),
      kernels=resolve_kernels(cfg.model.kernels, devices),
      decode_attention=resolve_decode_attention(cfg.model.decode_attention, devices),
  )
  try:
    if hf_dir:
      return read_config(hf_dir, **kw)
    if cfg.model.vocab == "task":
      if not isinstance(tokenizer, task_vocab.TaskTokenizer):
        raise ConfigError("config.model.vocab='task' sizes the embedding from the run's task_vocab.json; none given")
      kw["vocab_size"] = task_vocab.model_vocab_size(tokenizer.vocab_size)
    return Qwen2Config.preset(cfg.model.preset, **kw)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from None


def read_run_config(workdir: str | os.PathLike, step: int | None = None) -> Config:
  """The validated training config of a workdir: its config.json, else the `config` in the meta
  of checkpoint `step` (default: the latest)."""
  path = epath.Path(workdir) / "config.json"
  if path.exists():
    try:
      raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{os.fspath(path)}: not valid JSON ({e})") from None
    source = os.fspath(path)
  else:
    with CheckpointReader.of_workdir(workdir) as reader:
      step = reader.pick_step(step)
      meta = reader.meta(step)
    if "config" not in meta:
      raise ConfigError(f"{os.fspath(path)} is missing and checkpoint {step}'s meta has no 'config'")
    raw, source = meta["config"], f"{os.fspath(workdir)}/checkpoints/{step}/meta"
  try:
    return config_lib.from_dict(raw)
  except ConfigError as e:
    raise ConfigError(f"{source}: {e}") from None


def model_config_from_checkpoint(
    workdir: str | os.PathLike,
    *,
    step: int | None = None,
    config: Config | None = None,
    hf_dir: str | None = None,
    mesh: Mesh | None = None,
    tokenizer=None,
) -> Qwen2Config:
  """The model of the run in `workdir`, the one rule for a training run (`train.py`, at a start
  and at a resume), evaluation (`eval/loading.py`) and inspection (`inspect/reader.py`):
  `model_config(cfg, hf_dir, mesh, tokenizer)` with
    cfg        `config`, default the saved one (`read_run_config(workdir, step)`);
    hf_dir     default `cfg.model.path` (train.py passes `--init_from_hf` when given);
    tokenizer  default, where it sizes the model (`model.vocab="task"`, no Hugging Face folder),
               the workdir's task_vocab.json, which `make_tokenizer` reads there at a resume.
  Nothing is read from `workdir` when `config` is given and the tokenizer is given or not needed."""
  cfg = config if config is not None else read_run_config(workdir, step)
  hf_dir = cfg.model.path if hf_dir is None else hf_dir
  if tokenizer is None and cfg.model.vocab == "task" and not hf_dir:
    tokenizer = _saved_task_vocab(workdir)
  return model_config(cfg, hf_dir, mesh, tokenizer)


def _saved_task_vocab(workdir: str | os.PathLike) -> task_vocab.TaskTokenizer:
  path = task_vocab.find([os.fspath(workdir)])
  if path is None:
    raise ConfigError(
        f"config.model.vocab='task': {os.fspath(workdir)} has no {task_vocab.FILENAME} (the run's "
        "vocabulary, which sizes the embedding)"
    )
  try:
    return task_vocab.TaskTokenizer.load(path)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def model_dir(path: str, what: str) -> str:
  """The local folder of the model folder or Hugging Face hub id `path` (`models.hf.resolve_model_dir`:
  a hub id is downloaded, or read from the cache offline); "" stays ""; ConfigError naming `what`."""
  from ict_jax.models.hf import resolve_model_dir

  try:
    return resolve_model_dir(path)
  except FileNotFoundError as e:
    raise ConfigError(f"{what}: {e}") from None


def _checkpoint_tokenizer(workdir: str, hf_dir: str):
  """The tokenizer of a run on the full vocabulary: the Hugging Face folder's own (its
  tokenizer.json and chat template; a copy is kept in `<workdir>/tokenizer/`, which a resume
  without the folder reads), else the workdir's copy, else the bundled Qwen2.5 tokenizer."""
  from ict_jax import hf_tokenizer
  from ict_jax.tokenizer import Tokenizer

  folder = hf_dir if hf_tokenizer.has_tokenizer(hf_dir) else ""
  if not folder and hf_tokenizer.has_tokenizer(os.path.join(workdir, hf_tokenizer.WORKDIR_SUBDIR)):
    folder = os.path.join(workdir, hf_tokenizer.WORKDIR_SUBDIR)
  if not folder:
    return Tokenizer()
  try:
    tok = hf_tokenizer.HFTokenizer(folder)
    if folder == hf_dir and sharding.is_main_process():
      tok.save(os.path.join(workdir, hf_tokenizer.WORKDIR_SUBDIR))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return tok


def make_tokenizer(cfg: Config, workdir: str, hf_dir: str, load_split: Callable[[str], Any]):
  """The run's tokenizer. A Hugging Face folder with a `task_vocab.json` brings its own task
  vocabulary (copied to the workdir, whose checkpoints are this model's); `model.vocab="task"`
  reads the workdir's (a resume) or builds one from the texts of the train and eval splits
  (`load_split(name)` -> a random-access source) and saves it there before any checkpoint;
  otherwise the checkpoint's own tokenizer and chat template when the folder has a
  tokenizer.json, else the full Qwen2.5 tokenizer (`_checkpoint_tokenizer`)."""
  from ict_jax.tokenizer import Tokenizer

  saved = task_vocab.find([hf_dir] if hf_dir else [workdir])
  if not saved and (hf_dir or cfg.model.vocab == "qwen"):
    if cfg.model.vocab == "task":
      raise ConfigError(
          f"config.model.vocab='task': {hf_dir} has no {task_vocab.FILENAME}; a pretrained model keeps "
          "its own vocabulary (model.vocab='qwen')"
      )
    return _checkpoint_tokenizer(workdir, hf_dir)
  if saved:
    try:
      tok = task_vocab.TaskTokenizer.load(saved)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if hf_dir and sharding.is_main_process():
      tok.save(workdir)
    return tok
  from ict_jax.data.prompts import encode_prompts
  from ict_jax.warm_start import sft_targets

  base, texts = Tokenizer(), []
  for split in (cfg.data.train_split, cfg.data.eval_split):
    src = load_split(split)
    exs, prompts, _ = encode_prompts([src[i] for i in range(len(src))], base, style=cfg.data.prompt_style)
    texts += prompts + [str(e["answer"]) for e in exs] + [t for e in exs for t in sft_targets(e)]
  tok = task_vocab.build(texts, base)
  if sharding.is_main_process():
    tok.save(workdir)
  return tok


def abstract_params(mcfg: Qwen2Config, mesh: Mesh) -> tuple[Any, Any, Any]:
  """-> (graphdef, params, params_sharding): `params` a pure dict of `jax.ShapeDtypeStruct`
  carrying their `NamedSharding` (a restore target), `params_sharding` the same dict of shardings."""
  abstract = abstract_model(mcfg)
  graphdef, _ = nnx.split(abstract)
  param_state = nnx.state(abstract, nnx.Param)
  params_sharding = sharding.pure_shardings(param_state, mesh)
  params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), param_state.to_pure_dict(), params_sharding
  )
  return graphdef, params, params_sharding


def init_params(mcfg: Qwen2Config, seed: int, mesh, params_sharding):
  """Random parameters created directly in their shardings."""

  def init():
    return nnx.state(Qwen2(mcfg, rngs=nnx.Rngs(params=seed)), nnx.Param).to_pure_dict()

  with jax.set_mesh(mesh):
    return jax.jit(init, out_shardings=params_sharding)()


def lora_abstract_adapters(cfg: Config, mcfg: Qwen2Config, mesh: Mesh) -> dict:
  """A LoRA run's (model.lora_rank > 0) adapters as saved (the checkpoint's `state.params`), as
  `ShapeDtypeStruct`s carrying their shardings on `mesh`: a restore target."""
  m = cfg.model
  return lora.abstract_split(mcfg, m.lora_rank, m.lora_alpha, m.lora_modules, mesh)[1]


def lora_merged_params(cfg: Config, mcfg: Qwen2Config, adapters: dict, mesh: Mesh) -> dict:
  """A LoRA run's saved `adapters` merged into its frozen base, W + alpha / rank * A.B in float32:
  the plain model's pure dict, each array in its sharding on `mesh` (what export, eval and
  inspect read of a LoRA checkpoint). The base is not in the checkpoint; it is rebuilt as the
  trainer began: model.path's weights, else (a run from random weights) the seed's. A run
  warm-started from random weights (warm_start.sft_steps) cannot be rebuilt here: a ConfigError."""
  m = cfg.model
  mcfg = mcfg.replace(param_dtype="float32")
  _, _, shardings = abstract_params(mcfg, mesh)
  if m.path:
    plain = load_pretrained(m.path, jnp.dtype(mcfg.dtype), param_dtype=jnp.float32, mesh=mesh)
    base = nnx.state(plain, nnx.Param).to_pure_dict()
  elif cfg.warm_start.sft_steps:
    raise ConfigError(
        "a LoRA run (model.lora_rank) warm-started from random weights (warm_start.sft_steps): its frozen "
        "base is not in the checkpoint and only the trainer rebuilds it; train from model.path to export one"
    )
  else:
    base = init_params(mcfg, cfg.train.seed, mesh, shardings)
  graphdef = nnx.graphdef(lora.abstract(mcfg, m.lora_rank, m.lora_alpha, m.lora_modules))
  merge = lambda b, a: lora.merged(nnx.merge(graphdef, lora.join(b, a)))
  with jax.set_mesh(mesh):
    return jax.jit(merge, out_shardings=shardings)(base, adapters)


# The floating dtypes a platform computes in; a rollout dtype outside them is a config error.
_PLATFORM_DTYPES = {"tpu": ("float32", "bfloat16")}  # TPUs have bfloat16, not float16, arithmetic


def rollout_dtype(cfg: Config, mesh: Mesh) -> str:
  """`config.rollout.dtype` for the mesh's platform: "auto" is bfloat16 on accelerators and
  `model.dtype` on CPU; a dtype the platform lacks is a ConfigError (before anything compiles)."""
  platform = mesh.devices.flat[0].platform
  name = cfg.rollout.dtype
  if name == "auto":
    return cfg.model.dtype if platform == "cpu" else "bfloat16"
  allowed = _PLATFORM_DTYPES.get(platform)
  if allowed is not None and name not in allowed:
    raise ConfigError(
        f"config.rollout.dtype: {platform} has no {name} arithmetic; expected one " f"of {('auto',) + allowed}"
    )
  return name
