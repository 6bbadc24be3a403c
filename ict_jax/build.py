"""`build_run(cfg, workdir)`: everything a run is built from, once, before the first step.

    run = build_run(config_lib.validate(cd), "runs/x")       # checks, mesh, data, tokenizer, model
    learner = Learner(run, hooks=[...]); learner.fit()     # ict_jax/learner.py

A `Run` holds the validated config, the mesh, the train split, the tokenizer and the model's
abstract pieces (`ModelSetup`: the architecture, the graph definition, the parameters' shapes and
shardings, the optimizer and the train state's shardings). `build_model` is the part that needs no
data and no workdir: `ict_jax.aot` compiles the trainer's programs from it for a target's devices,
and `ict_jax.eval` lays out a checkpoint's model with it.
Every bad setting is a `ConfigError` here, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ict_jax import config as config_lib
from ict_jax import lora, sharding, storage
from ict_jax import train_step as ts
from ict_jax.config import Config, ConfigError
from ict_jax.data.prompts import PromptError
from ict_jax.logs import import_wandb, read_wandb_run_id
from ict_jax.models.config import Qwen2Config
from ict_jax.rewards.functions import RewardFunction, resolve
from ict_jax.setup import abstract_params, make_mesh, make_tokenizer, model_config_from_checkpoint, model_dir
from ict_jax.setup import resolve_decode_attention
from ict_jax.setup import rollout_dtype as resolve_rollout_dtype
from ict_jax.task_vocab import TaskTokenizer

log = logging.getLogger("ict_jax.train")


@dataclasses.dataclass(frozen=True)
class ModelSetup:
  """The model and its update, abstract (no weight allocated), on a mesh."""

  config: Qwen2Config
  graphdef: Any
  params: Any  # pure dict of jax.ShapeDtypeStruct carrying their NamedSharding (a restore target)
  params_sharding: Any
  optimizer: Any  # optax.GradientTransformation
  learning_rate: Any  # optax.ScalarOrSchedule: update count -> learning rate
  state_sharding: Any  # TrainState of shardings
  # LoRA (model.lora_rank > 0): `graphdef` is the adapted model's, `params` the adapters (trained),
  # `frozen` the base's ShapeDtypeStructs in the rollout dtype (a pure dict; None: full fine-tuning)
  frozen: Any = None

  def abstract_state(self) -> ts.TrainState:
    """The TrainState `init_train_state` makes, as ShapeDtypeStructs (a restore or compile target)."""
    return ts.abstract_train_state(self.optimizer, self.params, self.state_sharding, self.frozen)


@dataclasses.dataclass(frozen=True)
class Run:
  """What a training run is built from (`build_run`)."""

  cfg: Config
  workdir: str
  hf_dir: str  # the Hugging Face folder the weights start from ("" : random init or a resume)
  mesh: Mesh
  tokenizer: Any  # ict_jax.tokenizer.Tokenizer or task_vocab.TaskTokenizer
  train_source: Any  # the train split without over-long prompts (random access)
  model: ModelSetup
  rollout_dtype: str
  reward_funcs: tuple[RewardFunction, ...] = ()  # reward.funcs or train(reward_funcs=...), weighted

  @property
  def rows(self) -> int:
    """A step's rows: prompts_per_step x group_size."""
    return self.cfg.rollout.rows


# ---- the run's splits -------------------------------------------------------------------------
def load_examples(cfg: Config, split: str, workdir: str):
  """The split as a random-access source; on several hosts process 0 builds it first (or, for
  data.name "files", reads the files and fills the `datasets` cache first)."""
  from ict_jax.data import load_split
  from ict_jax.data.files import FILES, config_split

  data_dir = storage.data_dir(cfg.data.data_dir, workdir)
  manual_dir = os.path.expanduser(cfg.data.manual_dir) if cfg.data.manual_dir else None

  def load():
    sources = []
    for name in cfg.data.name.split("+"):
      if name == FILES:  # data.train_files / data.eval_files (ConfigError naming them)
        sources.append(config_split(cfg.data, split).load())
        continue
      try:
        sources.append(
            load_split(
                name,
                split,
                data_dir=data_dir,
                manual_dir=manual_dir,
                config=(cfg.data.config or None) if name == cfg.data.name else None,
            )
        )
      except (FileNotFoundError, KeyError, ValueError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) is quoted
        raise ConfigError(f"config.data.name={name!r}: {text}") from None
    return sources[0] if len(sources) == 1 else Concat(sources)

  if jax.process_count() == 1:
    return load()
  from jax.experimental import multihost_utils

  if jax.process_index() == 0:
    source = load()
  multihost_utils.sync_global_devices(f"ict_jax data {split}")
  return source if jax.process_index() == 0 else load()


class Concat:
  """Random access over several sources, one after the other."""

  def __init__(self, sources):
    self.sources, self.offsets = sources, np.cumsum([0] + [len(s) for s in sources])

  def __len__(self):
    return int(self.offsets[-1])

  def __getitem__(self, i):
    k = int(np.searchsorted(self.offsets, i, side="right") - 1)
    return self.sources[k][i - int(self.offsets[k])]


def fitting_prompts(cfg: Config, tok, train_src):
  """The train split without the prompts over data.max_prompt_len tokens (each logged with its
  file and row), so every rollout batch has prompts_per_step prompts and the step its rows."""
  from ict_jax.data.prompts import drop_long_prompts

  try:
    src, _ = drop_long_prompts(
        train_src,
        tok,
        style=cfg.data.prompt_style,
        max_len=cfg.data.max_prompt_len,
        dataset=f"{cfg.data.name} {cfg.data.train_split}",
    )
  except PromptError as e:
    raise ConfigError(f"config.data.prompt_field: {e}") from None
  except ValueError as e:
    raise ConfigError(f"config.data.max_prompt_len: {e}") from None
  return src


# ---- the model and the run ----------------------------------------------------------------------
def build_model(cfg: Config, mesh: Mesh, mcfg: Qwen2Config) -> ModelSetup:
  """The abstract parameters of the architecture `mcfg` (`setup.model_config`), laid out on `mesh`,
  and the optimizer with the train state's shardings. Shared by the trainer and `ict_jax.aot`."""
  frozen = None
  if cfg.model.lora_rank:  # the adapters are trained, the base frozen in the rollout dtype
    m = cfg.model
    graphdef, params, frozen = lora.abstract_split(mcfg, m.lora_rank, m.lora_alpha, m.lora_modules, mesh)
    frozen = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, resolve_rollout_dtype(cfg, mesh), sharding=x.sharding), frozen
    )
    params_sharding = jax.tree.map(lambda x: x.sharding, params)
  else:
    graphdef, params, params_sharding = abstract_params(mcfg, mesh)
  updates = cfg.train.steps * cfg.train.num_iterations
  optimizer = ts.make_optimizer(cfg.optim, updates)
  frozen_sharding = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
  state_sharding = ts.train_state_shardings(optimizer, params, params_sharding, mesh, frozen_sharding)
  return ModelSetup(
      mcfg,
      graphdef,
      params,
      params_sharding,
      optimizer,
      ts.learning_rate_schedule(cfg.optim, updates),
      state_sharding,
      frozen,
  )


def workdir_probe(workdir: str) -> str:
  """The file `check_workdir` writes and removes: named by host and pid, since the processes of
  a multi-node job share the workdir and two nodes can run the same pid."""
  return os.path.join(workdir, f".write-test-{socket.gethostname()}-{os.getpid()}")


def check_workdir(workdir: str) -> None:
  if storage.is_url(workdir):  # a missing gs:// backend is one line now, not a traceback mid-run
    storage.check_backend(workdir, "--workdir")
    return  # writability: Checkpointer's probe object, through the same backend
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = workdir_probe(workdir)
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"--workdir {workdir}: not writable ({e.strerror or e})") from None


def build_run(cfg: Config, workdir: str, *, init_from_hf: str = "", reward_funcs: Sequence[Any] = ()) -> Run:
  """Check the workdir and the config against the devices, join the other processes, make the
  mesh, read the train split and the tokenizer, and lay out the model: raises ConfigError on the
  first bad setting, before any data is prepared where the setting is about the devices.
  reward_funcs: reward functions (callables or "module:fn") in place of reward.funcs."""
  check_workdir(workdir)
  rc = cfg.reward  # an unimportable reward function is one error before anything else
  funcs = resolve(rc.funcs, rc.weights, reward_funcs, num_workers=rc.num_workers)
  storage.check_data_dir(cfg.data.data_dir, "config.data.data_dir")
  if storage.is_url(workdir):
    log.info("tfds data in %s (local: the workdir is a URL)", storage.data_dir(cfg.data.data_dir, workdir))
  if cfg.log.wandb_project:
    import_wandb()  # a missing package is one error now, not after the compile
    read_wandb_run_id(workdir)  # and a damaged run id kept in the workdir
  sharding.maybe_initialize_distributed(cfg.train.heartbeat_timeout_s)
  mesh = make_mesh(cfg)
  resolve_decode_attention(cfg.model.decode_attention, mesh.devices.flat)  # refused off TPU before any data
  try:  # a micro-batch must split over the mesh's row axes (else activations replicate)
    ts.check_micro_batch(cfg.train.micro_batch_size or cfg.rollout.rows, mesh)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  roll_dtype = resolve_rollout_dtype(cfg, mesh)
  hf_dir = model_dir(init_from_hf, "--init_from_hf") or model_dir(cfg.model.path, "config.model.path")
  train_src = load_examples(cfg, cfg.data.train_split, workdir)
  try:
    tok = make_tokenizer(
        cfg,
        workdir,
        hf_dir,
        lambda split: train_src if split == cfg.data.train_split else load_examples(cfg, split, workdir),
    )
  except PromptError as e:  # model.vocab="task" formats every prompt of both splits
    raise ConfigError(f"config.data.prompt_field: {e}") from None
  if isinstance(tok, TaskTokenizer):
    log.info("task vocabulary: %d tokens (%s/task_vocab.json)", tok.vocab_size, workdir)
  train_src = fitting_prompts(cfg, tok, train_src)
  # the one rule from a run to its model (eval and the checkpoint reader use it on a saved run)
  mcfg = model_config_from_checkpoint(workdir, config=cfg, hf_dir=hf_dir, mesh=mesh, tokenizer=tok)
  if cfg.train.token_budget:
    config_lib.check_packing_attention(mcfg.attention, mesh.local_devices)  # "auto" resolved for these devices
  model = build_model(cfg, mesh, mcfg)
  return Run(cfg, workdir, hf_dir, mesh, tok, train_src, model, roll_dtype, funcs)


def warm_start(graphdef, params, cfg: Config, tok, train_src, mesh):
  """`warm_start.supervised_warm_start` on the train split's worked solutions."""
  from ict_jax.data.prompts import encode_prompts
  from ict_jax.warm_start import build_sft_examples, sft_targets, supervised_warm_start

  ws = cfg.warm_start
  exs, _, encoded = encode_prompts([train_src[i] for i in range(len(train_src))], tok, style=cfg.data.prompt_style)
  prompts, answers = [], []
  for e, prompt in zip(exs, encoded):
    for target in sft_targets(e):  # worked solutions when the task has them
      prompts.append(prompt)
      answers.append(tok.encode(target))
  arrays = build_sft_examples(prompts, answers, tok.pad_id, tok.pad_id)
  return supervised_warm_start(
      graphdef,
      params,
      *arrays,
      steps=ws.sft_steps,
      batch_size=ws.sft_batch_size,
      learning_rate=ws.sft_learning_rate,
      seed=cfg.train.seed,
      mesh=mesh,
      log=log.info,
  )
