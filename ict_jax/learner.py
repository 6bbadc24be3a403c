"""The learner: owns a run's state and runs its steps, rollout -> update -> record, with hooks.

    run = build_run(cfg, workdir)                      # ict_jax/build.py
    learner = Learner(run, hooks=default_hooks(run) + my_hooks)
    history = learner.fit()                            # resumes from the workdir's checkpoint

One step (`fit`): the next prompts -> `rollout` (G samples each, rewards, group advantages: the
collector, `ict_jax.rollout.Collector`) -> the batch at its real length -> hooks' `on_batch` ->
packed (train.token_budget) -> `update` (the jitted GRPO / ICT step, train.num_iterations passes)
-> `record` (the step's metrics) -> hooks' `on_step_end` (eval, health, logging, checkpoint, ...).
What happens around a step is a hook (`ict_jax/hooks.py`, the built-in ones in
`ict_jax/run_hooks.py`); the learner itself only restores, steps, saves and stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ict_jax import config as config_lib
from ict_jax import lora, packing
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.build import Run, warm_start
from ict_jax.checkpoint import Checkpointer
from ict_jax.config import ConfigError
from ict_jax.hooks import Hook, Hooks
from ict_jax.models.hf import load_pretrained
from ict_jax.models.qwen2 import abstract_model
from ict_jax.setup import init_params
from ict_jax.rewards.pool import RewardPool
from ict_jax.rollout import Collector, Rollout, host_array
from ict_jax.throughput import Throughput

log = logging.getLogger("ict_jax.train")


class OutOfDeviceMemory(RuntimeError):
  """XLA ran out of device memory in the rollout or the train step; the message names the
  config setting to lower (`python -m ict_jax.aot` checks a setting for a target beforehand)."""


@contextlib.contextmanager
def name_oom(what: str, lower: str):
  """Re-raise XLA's RESOURCE_EXHAUSTED (raised by the call, or by the first read of its output:
  dispatch is asynchronous) as one OutOfDeviceMemory that says what to lower."""
  try:
    yield
  except RuntimeError as e:  # jax.errors.JaxRuntimeError (XlaRuntimeError)
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
      raise
    first = next((line.strip() for line in msg.splitlines() if line.strip()), msg)
    raise OutOfDeviceMemory(
        f"{what} ran out of device memory: lower {lower}; check a setting for a target before the run "
        f"with `python -m ict_jax.aot --config ... --target ...` (XLA: {first[:300]})"
    ) from e


def fetch_metrics(metrics: dict) -> dict[str, float]:
  """A step's metrics (replicated device scalars, or host numbers) as floats, in one
  device-to-host transfer: one `jax.device_get` of them all, not a blocking read each."""
  local = {k: v.addressable_data(0) if isinstance(v, jax.Array) else v for k, v in metrics.items()}
  return {k: float(v) for k, v in jax.device_get(local).items()}


@dataclasses.dataclass
class StepData:
  """The step in flight: what hooks read besides the metrics."""

  step: int  # 0-based: the steps completed before this one
  position: int  # the data iterator's position before this step's prompts
  rollout: Rollout | None = None
  batch: TrainBatch | None = None  # the batch the update took (packed when train.token_budget)
  t0: float = 0.0  # the step's start (perf_counter)
  t1: float = 0.0  # the update's start


def lora_state(cfg, model, params):
  """(adapters, frozen base) of LoRA (model.lora_rank) for the starting weights `params`: the
  adapters float32 in their shardings, the base cast to the rollout dtype in its own."""
  m = cfg.model
  adapters, base = lora.init_split(params, model.config, m.lora_rank, m.lora_alpha, m.lora_modules, cfg.train.seed)
  put = lambda tree, like: jax.jit(
      lambda t: jax.tree.map(lambda x, s: x.astype(s.dtype), t, like),
      out_shardings=jax.tree.map(lambda s: s.sharding, like),
  )(tree)
  return put(adapters, model.params), put(base, model.frozen)


class Learner:
  """Owns a run's train state, data position, reward pool and checkpoints; `fit` runs the steps."""

  def __init__(self, run: Run, hooks: Sequence[Hook] = ()):
    cfg = self.cfg = run.cfg
    self.run, self.hooks = run, Hooks(hooks)
    self.base_key = jax.random.key(cfg.train.seed)  # step k samples with fold_in(base_key, k)
    self.collector = Collector.from_config(
        cfg, run.tokenizer, mesh=run.mesh, rollout_dtype=run.rollout_dtype, reward_funcs=run.reward_funcs
    )
    self.throughput = Throughput(run.model.config)  # the chip's peak: the table, or a matmul measured now (CPU)
    self.ckpt = Checkpointer(run.workdir, keep=cfg.train.keep_checkpoints, async_save=cfg.train.async_checkpointing)
    self.state = self.ref_params = self.data = self.reward_pool = self.step_fn = None
    self.start_step, self.history, self.current = 0, [], None
    self.stop_reason: str | None = None
    self.last_step_s: float | None = None  # the previous step's update + hooks, in seconds
    rows, mesh = run.rows, run.mesh
    self.step_advice = (
        f"config.train.micro_batch_size (now {cfg.train.micro_batch_size or rows}; a divisor of the {rows} rows "
        f"that is a multiple of group_size {cfg.rollout.group_size} and of data x fsdp "
        f"{mesh.shape['data'] * mesh.shape['fsdp']})"
    )
    self.rollout_advice = (
        f"config.rollout.decode_batch_size (now {cfg.rollout.decode_batch_size!r}; a divisor of the {rows} rows, "
        f"or 'auto' to size it from the free device memory) or config.rollout.max_new_tokens "
        f"(now {cfg.rollout.max_new_tokens})"
    )

  @property
  def graphdef(self):
    """The model's graph definition (`nnx.merge(learner.graphdef, learner.state.params)`)."""
    return self.run.model.graphdef

  # ---- the state -------------------------------------------------------------------------------
  def restore_or_init(self) -> None:
    """The workdir's latest checkpoint, else the pretrained or random weights (warm-started)."""
    cfg, model = self.cfg, self.run.model
    with_ref, position = cfg.loss.beta > 0, 0
    if self.ckpt.latest_step() is not None:
      target = {"state": model.abstract_state().saved()}  # LoRA: the adapters, not the base
      if with_ref:
        target["ref_params"] = model.params
      self.start_step, tree, meta = self.ckpt.restore(target)
      frozen = None
      if model.frozen is not None:  # LoRA: the frozen base as the run began (model.path, or the seed's)
        frozen = lora_state(cfg, model, self._initial_params())[1]
      self.state, self.ref_params = tree["state"].with_frozen(frozen), tree.get("ref_params")
      position = int(meta["data_position"])
      log.info("resumed from step %d of %s", self.start_step, self.run.workdir)
      for bad in [s for s in self.ckpt.all_steps() if s > self.start_step]:  # restore found these unreadable
        log.warning("moved unreadable checkpoint step %d to %s; it will be saved again", bad, self.ckpt.set_aside(bad))
    else:
      params, frozen = self._initial_params(), None
      if model.frozen is not None:  # LoRA: the adapters train, the base frozen in the rollout dtype
        params, frozen = lora_state(cfg, model, params)
      self.state = ts.init_train_state(
          params, model.optimizer, mesh=self.run.mesh, params_sharding=model.params_sharding, frozen=frozen
      )
      if with_ref:  # a frozen copy of the starting policy
        self.ref_params = jax.tree.map(jnp.copy, self.state.params)
    from ict_jax.data.iterator import PromptIterator

    self.data = PromptIterator(
        self.run.train_source, cfg.rollout.prompts_per_step, seed=cfg.train.seed, position=position
    )

  def _initial_params(self):
    cfg, run, model = self.cfg, self.run, self.run.model
    if not run.hf_dir:  # LoRA: the base, in the plain model's layout
      graphdef, shardings = model.graphdef, model.params_sharding
      if model.frozen is not None:
        graphdef, shardings = nnx.graphdef(abstract_model(model.config)), jax.tree.map(
            lambda s: s.sharding, model.frozen
        )
      params = init_params(model.config, cfg.train.seed, run.mesh, shardings)
      if cfg.warm_start.sft_steps:
        params = warm_start(graphdef, params, cfg, run.tokenizer, run.train_source, run.mesh)
      return params
    mcfg = model.config
    try:
      pretrained = load_pretrained(
          run.hf_dir,
          jnp.dtype(cfg.model.dtype),
          param_dtype=jnp.dtype(cfg.model.param_dtype),
          mesh=run.mesh,
          remat_policy=mcfg.remat_policy,
          attention=mcfg.attention,
          kernels=mcfg.kernels,
          decode_attention=mcfg.decode_attention,
      )
    except (ValueError, FileNotFoundError) as e:  # fit() closes the checkpointer (Orbax's threads)
      raise ConfigError(str(e)) from None
    return nnx.state(pretrained, nnx.Param).to_pure_dict()

  def save(self, step: int, force: bool = False) -> None:
    """A checkpoint of `step` completed steps: the state, the data position, the config."""
    self.hooks.save(self, step)  # e.g. the logs flushed: a resume from it keeps every step it covers
    tree = {"state": self.state.saved()}  # LoRA: not the frozen base (a restore reloads it)
    if self.ref_params is not None:
      tree["ref_params"] = self.ref_params
    meta = {
        "data_position": self.data.position,
        "step": step,
        "seed": self.cfg.train.seed,
        "config": config_lib.to_dict(self.cfg),
    }
    self.ckpt.save(step, tree, meta, force=force)
    self.hooks.saved(self, step)

  def request_stop(self, why: str) -> None:
    """Stop before the step in flight updates (a hook calls this; see ict_jax/hooks.py)."""
    self.stop_reason = why

  def _stop(self, data: StepData) -> None:
    """Stopped before step `data.step + 1` updated: save the state of the steps completed."""
    self.data.position = data.position  # this step's prompts come again after the resume
    if self.ckpt.latest_step() != data.step:
      self.save(data.step, force=True)
    self.ckpt.wait()
    log.warning("preempted%s: saved step %d; exiting", self.stop_reason, data.step)

  # ---- one step --------------------------------------------------------------------------------
  def rollout(self, step: int) -> tuple[Rollout, TrainBatch]:
    """The next prompts, sampled and scored (`Collector.collect`) -> (the rollout, its batch at
    its real length: few compiled shapes)."""
    examples = next(self.data)
    key = jax.random.fold_in(self.base_key, step)
    roll = self.collector.collect((self.graphdef, self.policy_params()), examples, self.reward_pool, rng=key)
    # the longest completion comes from the gathered lengths: no host reads the others' rows
    return roll, roll.batch().trim(completion_len=roll.stats["max_response_len"])

  def policy_params(self):
    """The policy's whole pure dict for `self.graphdef`: the trained params, with the frozen LoRA
    base when there is one (the rollout merges them: `sampling.make_rollout_policy`)."""
    return ts.full_params(self.state.params, self.state.frozen)

  def pack(self, batch: TrainBatch) -> TrainBatch:
    """The decoder on packed rows (train.token_budget > 0): every host plans the whole batch."""
    cfg = self.cfg
    if not cfg.train.token_budget:
      return batch
    mesh = self.run.mesh
    return packing.pack_batch(
        batch.map_rows(host_array),
        token_budget=cfg.train.token_budget,
        group_size=cfg.rollout.group_size,
        micro_batch_size=cfg.train.micro_batch_size,
        multiple=mesh.shape["data"] * mesh.shape["fsdp"],
        balance=True,  # whole groups reordered: batch row i is no longer roll row i
        micro_batch_tokens=cfg.train.micro_batch_tokens,  # > 0: micro-batches by tokens
    )

  def update(self, step: int, batch: TrainBatch) -> dict[str, float]:
    """train.num_iterations passes of the jitted step over `batch` (the first pass's log-probs are
    the old log-probs of the others) -> the last pass's metrics and the learning rate, on the host."""
    old_logp = None
    for _ in range(self.cfg.train.num_iterations):
      if old_logp is not None:
        batch = batch.replace(old_logp=old_logp)
      self.state, metrics, logp = self.step_fn(self.state, batch, self.ref_params)
      old_logp = logp if old_logp is None else old_logp
    updates = (step + 1) * self.cfg.train.num_iterations  # the last update used count updates - 1
    schedule = self.run.model.learning_rate
    lr = schedule(updates - 1) if callable(schedule) else schedule
    return fetch_metrics({**metrics, "learning_rate": lr})  # the first read: asynchronous dispatch ends

  def record(self, data: StepData, metrics: dict[str, float]) -> dict[str, Any]:
    """The step's metrics record: the rollout's statistics, the update's metrics, timings and
    throughput (what the logs, the progress bar and `fit`'s history hold)."""
    roll, batch = data.rollout, data.batch
    dt, step_s = time.perf_counter() - data.t0, time.perf_counter() - data.t1
    lr = metrics.pop("learning_rate")
    return {
        "step": data.step + 1,
        **roll.stats,
        **metrics,
        "step_s": step_s,
        "iteration_s": dt,
        "tokens_per_s": roll.stats["completion_tokens"] / dt,
        "learning_rate": lr,
        **self.throughput.step_metrics(
            lengths=roll.prompt_mask.sum(axis=1) + roll.completion_lengths,  # real tokens a row
            executed=batch.executed_positions(),
            passes=self.cfg.train.num_iterations,
            step_s=step_s,
            tokens=roll.stats["completion_tokens"],
            iteration_s=dt,
        ),
        "sample": roll.completions[0][:200],
    }

  def train_step(self, step: int) -> dict[str, Any] | None:
    """One step with its hooks -> its record, or None when a hook stopped the run before it updated."""
    data = self.current = StepData(step, self.data.position, t0=time.perf_counter())
    self.hooks.step_start(self, step)
    if self.stop_reason is not None:
      return None
    with name_oom("the rollout", self.rollout_advice):
      data.rollout, batch = self.rollout(step)
    batch = self.hooks.batch(self, step, data.rollout, batch)
    data.batch = self.pack(batch)
    data.t1 = time.perf_counter()
    self.hooks.update_start(self, step)
    if self.stop_reason is not None:
      return None
    with name_oom("the train step", self.step_advice):
      metrics = self.update(step, data.batch)
    record = self.record(data, metrics)
    self.history.append(record)
    self.hooks.step_end(self, step + 1, record)
    self.last_step_s = time.perf_counter() - data.t1
    return record

  # ---- the run ---------------------------------------------------------------------------------
  def fit(self) -> list[dict[str, Any]]:
    """Restore (or initialise), then run the steps left; returns the records of the steps run."""
    cfg, run = self.cfg, self.run
    try:
      self.restore_or_init()
      if jax.process_count() > 1:  # start the loop together: collectives time out on skewed hosts
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("ict_jax train loop")
      self.step_fn = ts.make_train_step(
          run.model.graphdef,
          ts.StepConfig.from_config(cfg),
          run.model.optimizer,
          mesh=run.mesh,
          state_sharding=run.model.state_sharding,
      )
      pool = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s, functions=run.reward_funcs)
      with pool as self.reward_pool:
        try:
          self.hooks.run_start(self)
          for step in range(self.start_step, cfg.train.steps):
            if self.train_step(step) is None:
              self._stop(self.current)
              break
        finally:
          self.hooks.run_end(self)
    finally:
      self.ckpt.close()
    return self.history
