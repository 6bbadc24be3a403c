"""`python -m ict_jax.train`: RLVR with GRPO / ICT on a device mesh.

    python -m ict_jax.train --workdir DIR --config configs/NAME.py --config.train.steps=200

With no flags it runs the embedded default (tiny model, bundled tokenizer, synthetic arithmetic,
`./runs/default`). Loop: prompts -> G samples each -> rewards -> advantages -> jitted step(s)
-> logs -> Orbax checkpoint. Re-running the same command resumes from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import cli_config
from ict_jax import config as config_lib
from ict_jax import sharding
from ict_jax import storage
from ict_jax.checkpoint import Checkpointer, resolve_path
from ict_jax.config import Config, ConfigError
from ict_jax.health import RunHealth
from ict_jax.logs import MetricsLogger, import_wandb
from ict_jax.models.config import Qwen2Config
from ict_jax.setup import (
    abstract_params as make_abstract_params,
    decode_batch_size,
    make_mesh,
    make_tokenizer,
    model_config,
    resolve_decode_attention,
    rollout_dtype,
)
from ict_jax.models.hf import load_pretrained
from ict_jax.models.qwen2 import Qwen2
from ict_jax.preemption import Preemption
from ict_jax.rewards.pool import RewardPool
from ict_jax.rollout import collect, host_array
from ict_jax.throughput import Throughput
from ict_jax.task_vocab import TaskTokenizer
from ict_jax.tokenizer import Tokenizer
from ict_jax import packing
from ict_jax import train_step as ts
from ict_jax.warm_start import build_sft_examples, sft_targets, supervised_warm_start

log = logging.getLogger("ict_jax.train")
SAMPLES_LOGGED = 16  # completions per step written to the samples log


# ---- set-up pieces -----------------------------------------------------------------------------
class OutOfDeviceMemory(RuntimeError):
  """XLA ran out of device memory in the rollout or the train step; the message names the
  config setting to lower (`python -m ict_jax.aot` checks a setting for a target beforehand)."""


@contextlib.contextmanager
def _name_oom(what: str, lower: str):
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


def _workdir_probe(workdir: str) -> str:
  """The file `_check_workdir` writes and removes: named by host and pid, since the processes of
  a multi-node job share the workdir and two nodes can run the same pid."""
  return os.path.join(workdir, f".write-test-{socket.gethostname()}-{os.getpid()}")


def _check_workdir(workdir: str) -> None:
  if storage.is_url(workdir):  # a missing gs:// backend is one line now, not a traceback mid-run
    storage.check_backend(workdir, "--workdir")
    return  # writability: Checkpointer's probe object, through the same backend
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = _workdir_probe(workdir)
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"--workdir {workdir}: not writable ({e.strerror or e})") from None


def _profiler(action, *args) -> bool:
  """Start or stop the `train.profile_steps` trace; a failure (e.g. the profiler's own storage
  client cannot write to the workdir's bucket) is a warning and the run goes on untraced."""
  try:
    action(*args)
    return True
  except Exception as e:  # pylint: disable=broad-except  # jax.errors.JaxRuntimeError, OSError, ...
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    log.warning(
        "train.profile_steps: jax.profiler.%s failed, training goes on without the trace (%s: %s)",
        action.__name__,
        type(e).__name__,
        first[:300],
    )
    return False


def executed_positions(batch: dict) -> int:
  """Decoder positions the update runs a pass: the packed rows x their width when the batch is
  packed (`packing.pack_batch`), else every padded row x (prompt + completion width)."""
  if "packed_ids" in batch:
    return int(np.prod(np.shape(batch["packed_ids"])))
  return int(
      np.shape(batch["completion_ids"])[0] * (np.shape(batch["prompt_ids"])[1] + np.shape(batch["completion_ids"])[1])
  )


def fetch_metrics(metrics: dict) -> dict[str, float]:
  """A step's metrics (replicated device scalars, or host numbers) as floats, in one
  device-to-host transfer: one `jax.device_get` of them all, not a blocking read each."""
  local = {k: v.addressable_data(0) if isinstance(v, jax.Array) else v for k, v in metrics.items()}
  return {k: float(v) for k, v in jax.device_get(local).items()}


def init_params(mcfg: Qwen2Config, seed: int, mesh, params_sharding):
  """Random parameters created directly in their shardings."""

  def init():
    return nnx.state(Qwen2(mcfg, rngs=nnx.Rngs(params=seed)), nnx.Param).to_pure_dict()

  with jax.set_mesh(mesh):
    return jax.jit(init, out_shardings=params_sharding)()


def load_examples(cfg: Config, split: str, workdir: str):
  """The split as a random-access source; on several hosts process 0 builds it first."""
  from ict_jax.data import load_split

  data_dir = storage.data_dir(cfg.data.data_dir, workdir)
  manual_dir = os.path.expanduser(cfg.data.manual_dir) if cfg.data.manual_dir else None

  def load():
    sources = []
    for name in cfg.data.name.split("+"):
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
    return sources[0] if len(sources) == 1 else _Concat(sources)

  if jax.process_count() == 1:
    return load()
  from jax.experimental import multihost_utils

  if jax.process_index() == 0:
    source = load()
  multihost_utils.sync_global_devices(f"ict_jax data {split}")
  return source if jax.process_index() == 0 else load()


class _Concat:
  """Random access over several sources, one after the other."""

  def __init__(self, sources):
    self.sources, self.offsets = sources, np.cumsum([0] + [len(s) for s in sources])

  def __len__(self):
    return int(self.offsets[-1])

  def __getitem__(self, i):
    k = int(np.searchsorted(self.offsets, i, side="right") - 1)
    return self.sources[k][i - int(self.offsets[k])]


def fitting_prompts(cfg: Config, tok: Tokenizer, train_src):
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
  except ValueError as e:
    raise ConfigError(f"config.data.max_prompt_len: {e}") from None
  return src


def warm_start(graphdef, params, cfg: Config, tok: Tokenizer, train_src, mesh):
  ws = cfg.warm_start
  from ict_jax.data.prompts import encode_prompts

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


# ---- the program ------------------------------------------------------------------------------
def train(config_dict, workdir: str, *, init_from_hf: str = "", progress: bool = True) -> list[dict]:
  """Run (or resume) training; returns the metrics of the steps run in this call."""
  cfg = config_lib.validate(config_dict)
  _check_workdir(workdir)
  storage.check_data_dir(cfg.data.data_dir, "config.data.data_dir")
  if storage.is_url(workdir):
    log.info("tfds data in %s (local: the workdir is a URL)", storage.data_dir(cfg.data.data_dir, workdir))
  if cfg.log.wandb_project:
    import_wandb()  # a missing package is one error now, not after the compile
  sharding.maybe_initialize_distributed(cfg.train.heartbeat_timeout_s)
  mesh = make_mesh(cfg)
  resolve_decode_attention(cfg.model.decode_attention, mesh.devices.flat)  # refused off TPU before any data
  try:  # a micro-batch must split over the mesh's row axes (else activations replicate)
    ts.check_micro_batch(cfg.train.micro_batch_size or cfg.rollout.prompts_per_step * cfg.rollout.group_size, mesh)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  roll_dtype = rollout_dtype(cfg, mesh)
  hf_dir = init_from_hf or cfg.model.path
  train_src = load_examples(cfg, cfg.data.train_split, workdir)
  tok = make_tokenizer(
      cfg,
      workdir,
      hf_dir,
      lambda split: train_src if split == cfg.data.train_split else load_examples(cfg, split, workdir),
  )
  if isinstance(tok, TaskTokenizer):
    log.info("task vocabulary: %d tokens (%s/task_vocab.json)", tok.vocab_size, workdir)
  train_src = fitting_prompts(cfg, tok, train_src)
  mcfg = model_config(cfg, hf_dir, mesh, tok)
  if cfg.train.token_budget:
    config_lib.check_packing_attention(mcfg.attention, mesh.local_devices)  # "auto" resolved for these devices
  graphdef, abstract_params, params_sharding = make_abstract_params(mcfg, mesh)
  optimizer = ts.make_optimizer(cfg.optim, cfg.train.steps * cfg.train.num_iterations)
  learning_rate = ts.learning_rate_schedule(cfg.optim, cfg.train.steps * cfg.train.num_iterations)
  throughput = Throughput(mcfg)  # the chip's peak: the table, or a matmul measured now (CPU)
  profile = config_lib.profile_range(cfg.train.profile_steps) if cfg.train.profile_steps else None
  state_sharding = ts.train_state_shardings(optimizer, abstract_params, params_sharding, mesh)

  ckpt = Checkpointer(workdir, keep=cfg.train.keep_checkpoints, async_save=cfg.train.async_checkpointing)
  with_ref = cfg.loss.beta > 0
  start_step, position, ref_params = 0, 0, None
  if ckpt.latest_step() is not None:
    abstract_tree = {"state": ts.abstract_train_state(optimizer, abstract_params, state_sharding)}
    if with_ref:
      abstract_tree["ref_params"] = abstract_params
    start_step, tree, meta = ckpt.restore(abstract_tree)
    state, ref_params = tree["state"], tree.get("ref_params")
    position = int(meta["data_position"])
    log.info("resumed from step %d of %s", start_step, workdir)
    for bad in [s for s in ckpt.all_steps() if s > start_step]:  # restore found these unreadable
      log.warning("moved unreadable checkpoint step %d to %s; it will be saved again", bad, ckpt.set_aside(bad))
  else:
    if hf_dir:
      try:
        model = load_pretrained(
            hf_dir,
            jnp.dtype(cfg.model.dtype),
            param_dtype=jnp.dtype(cfg.model.param_dtype),
            mesh=mesh,
            remat_policy=mcfg.remat_policy,
            attention=mcfg.attention,
            kernels=mcfg.kernels,
            decode_attention=mcfg.decode_attention,
        )
      except (ValueError, FileNotFoundError) as e:
        ckpt.close()  # else Orbax's background tmp-dir cleanup dies in interpreter shutdown, noisily
        raise ConfigError(str(e)) from None
      params = nnx.state(model, nnx.Param).to_pure_dict()
    else:
      params = init_params(mcfg, cfg.train.seed, mesh, params_sharding)
      if cfg.warm_start.sft_steps:
        params = warm_start(graphdef, params, cfg, tok, train_src, mesh)
    state = ts.init_train_state(params, optimizer, mesh=mesh, params_sharding=params_sharding)
    if with_ref:  # a frozen copy of the starting policy
      ref_params = jax.tree.map(jnp.copy, state.params)

  if jax.process_count() > 1:  # start the loop together: collectives time out on skewed hosts
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("ict_jax train loop")
  step_fn = ts.make_train_step(
      graphdef, ts.StepConfig.from_config(cfg), optimizer, mesh=mesh, state_sharding=state_sharding
  )
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  step_advice = (
      f"config.train.micro_batch_size (now {cfg.train.micro_batch_size or rows}; a divisor of the {rows} rows "
      f"that is a multiple of group_size {cfg.rollout.group_size} and of data x fsdp "
      f"{mesh.shape['data'] * mesh.shape['fsdp']})"
  )
  roll_advice = (
      f"config.rollout.decode_batch_size (now {cfg.rollout.decode_batch_size!r}; a divisor of the {rows} rows, "
      f"or 'auto' to size it from the free device memory) or config.rollout.max_new_tokens "
      f"(now {cfg.rollout.max_new_tokens})"
  )
  from ict_jax.data.iterator import PromptIterator

  it = PromptIterator(train_src, cfg.rollout.prompts_per_step, seed=cfg.train.seed, position=position)
  base_key = jax.random.key(cfg.train.seed)
  logger = MetricsLogger(
      workdir,
      enabled=sharding.is_main_process(),
      progress=progress,
      total=cfg.train.steps,
      initial=start_step,
      config=config_lib.to_dict(cfg),
      wandb_project=cfg.log.wandb_project,
  )
  history: list[dict] = []
  rc = cfg.rollout
  health = RunHealth(max_new_tokens=rc.max_new_tokens, mask_truncated=cfg.loss.mask_truncated_completions)
  from ict_jax import token_view as tv

  view = tv.TokenView(
      graphdef, ts.StepConfig.from_config(cfg), groups=max(1, SAMPLES_LOGGED // rc.group_size), mesh=mesh
  )
  periodic = None  # pass@k on held-out problems every train.eval_every steps
  if cfg.train.eval_every:
    from ict_jax.eval.periodic import PeriodicEval

    periodic = PeriodicEval.from_config(cfg, tok, load_examples(cfg, cfg.data.eval_split, workdir), mesh=mesh)

  def save(step: int, force: bool = False):
    logger.flush()  # the log holds every step the checkpoint covers: a resume from it keeps them
    tree = {"state": state}
    if with_ref:
      tree["ref_params"] = ref_params
    ckpt.save(
        step,
        tree,
        {"data_position": it.position, "step": step, "seed": cfg.train.seed, "config": config_lib.to_dict(cfg)},
        force=force,
    )

  with (
      RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool,
      Preemption(cfg.train.sigterm_grace_s) as preempt,
  ):
    last_step_s = None  # the previous train step + logging + save, in seconds
    tracing = False  # a jax.profiler trace is running (train.profile_steps)

    def stop(step: int, position: int, why: str) -> None:
      """Preempted before step `step + 1` ran: save the state of `step` completed steps."""
      it.position = position  # this step's prompts come again after the resume
      if ckpt.latest_step() != step:
        save(step, force=True)
      ckpt.wait()
      log.warning("preempted%s: saved step %d; exiting", why, step)

    try:
      for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        position = it.position
        if preempt.reached(step):  # the same answer on every host at this step
          stop(step, position, "")
          break
        if profile and step + 1 == profile[0]:
          tracing = _profiler(jax.profiler.start_trace, os.fspath(resolve_path(workdir) / "profile"))
        examples = next(it)
        key = jax.random.fold_in(base_key, step)
        with _name_oom("the rollout", roll_advice):
          roll = collect(
              (graphdef, state.params),
              examples,
              tok,
              pool,
              rng=key,
              group_size=rc.group_size,
              max_new_tokens=rc.max_new_tokens,
              temperature=rc.temperature,
              top_p=rc.top_p,
              top_k=rc.top_k,
              prompt_style=cfg.data.prompt_style,
              max_prompt_len=cfg.data.max_prompt_len,
              reward_kind=cfg.reward.kind,
              format_weight=cfg.reward.format_weight,
              advantage_scale=cfg.loss.advantage_scale,
              mask_truncated=cfg.loss.mask_truncated_completions,
              score_truncated=cfg.reward.score_truncated,
              truncated_reward=cfg.reward.truncated_reward,
              mesh=mesh,
              rollout_dtype=roll_dtype,
              decode_batch_size=decode_batch_size(cfg),
          )
        # the real length, bucketed (few compiled shapes); the longest completion comes from the
        # gathered lengths, so no host reads the other hosts' rows of the mask
        batch = ts.trim_batch(roll.batch(), completion_len=roll.stats["max_response_len"])
        tokens = None  # per-token statistics of the logged samples, at checkpoint steps: taken
        # before packing, whose group balancing reorders the rows (roll.rows, the golds, rewards)
        if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == cfg.train.steps:
          tokens = tv.records(
              step + 1,
              view(state.params, batch),
              tok,
              dict(zip(roll.rows.tolist(), roll.golds)),  # the rows this host scored
              roll.rewards,
              batch["advantages"],
              dense_warmup=cfg.ict.method == "ict" and step < cfg.ict.warmup_steps,
          )
        if cfg.train.token_budget:  # the decoder on packed rows: every host plans the whole batch
          batch = packing.pack_batch(
              {k: host_array(v) for k, v in batch.items()},
              token_budget=cfg.train.token_budget,
              group_size=cfg.rollout.group_size,
              micro_batch_size=cfg.train.micro_batch_size,
              multiple=mesh.shape["data"] * mesh.shape["fsdp"],
              balance=True,  # whole groups reordered: batch row i is no longer roll row i
              micro_batch_tokens=cfg.train.micro_batch_tokens,  # > 0: micro-batches by tokens
          )
        t1 = time.perf_counter()
        if preempt.drop_step(None if last_step_s is None else 1.5 * last_step_s):  # one process only
          stop(step, position, f": step {step + 1} would not end within train.sigterm_grace_s")
          break
        old_logp = None
        with _name_oom("the train step", step_advice):
          for _ in range(cfg.train.num_iterations):
            if old_logp is not None:
              batch["old_logp"] = old_logp
            state, metrics, logp = step_fn(state, batch, ref_params)
            old_logp = logp if old_logp is None else old_logp
          updates = (step + 1) * cfg.train.num_iterations  # the last update used count updates - 1
          lr = learning_rate(updates - 1) if callable(learning_rate) else learning_rate
          metrics = fetch_metrics({**metrics, "learning_rate": lr})
        dt, step_s = time.perf_counter() - t0, time.perf_counter() - t1
        lr = metrics.pop("learning_rate")
        record = {
            "step": step + 1,
            **roll.stats,
            **metrics,
            "step_s": step_s,
            "iteration_s": dt,
            "tokens_per_s": roll.stats["completion_tokens"] / dt,
            "learning_rate": lr,
            **throughput.step_metrics(
                lengths=roll.prompt_mask.sum(axis=1) + roll.completion_lengths,  # real tokens a row
                executed=executed_positions(batch),
                passes=cfg.train.num_iterations,
                step_s=step_s,
                tokens=roll.stats["completion_tokens"],
                iteration_s=dt,
            ),
            "sample": roll.completions[0][:200],
        }
        if periodic is not None and periodic.due(step + 1, cfg.train.steps):
          record.update(periodic((graphdef, state.params), pool))
        history.append(record)
        for warning in health.check(record):
          log.warning("%s", warning)
        shown = roll.rows[:SAMPLES_LOGGED]  # rows this host scored (process 0 writes the logs)
        prompts = tok.decode_batch([i[k != 0] for i, k in zip(roll.prompt_ids[shown], roll.prompt_mask[shown])])
        logger.write(
            record,
            samples=[
                {"prompt": p, "completion": c, "gold": str(gd), "reward": float(roll.rewards[r])}
                for p, r, c, gd in zip(prompts, shown, roll.completions, roll.golds)
            ],
        )
        if tokens and sharding.is_main_process():
          tv.write(workdir, step + 1, tokens)
        done = step + 1
        if tracing and done == profile[1]:
          tracing = False
          if _profiler(jax.profiler.stop_trace):
            log.info("profile of steps %d-%d written to %s/profile", *profile, workdir)
        if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
          save(done, force=True)
        last_step_s = time.perf_counter() - t1
    finally:
      if tracing:
        _profiler(jax.profiler.stop_trace)
      ckpt.close()
      logger.close()
  return history


def _error(msg: str) -> None:
  print(f"ict_jax.train: error: {msg}", file=sys.stderr)
  sys.exit(2)


def main(argv=None) -> None:
  from absl import flags

  fl = flags.FlagValues()
  flags.DEFINE_string(
      "workdir", "./runs/default", "Checkpoints, logs and metrics go here (local or gs://).", flag_values=fl
  )
  flags.DEFINE_string("init_from_hf", "", "Start from this local Hugging Face folder.", flag_values=fl)
  argv = sys.argv if argv is None else argv
  try:  # flag and --config.* override errors become one line, not a traceback
    cd = cli_config.parse(fl, argv)
  except ConfigError as e:
    _error(str(e))
  # force: importing orbax already put a WARNING-level handler on the root logger, which would
  # make basicConfig a no-op and hide every INFO line (resume step, warm-start progress)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
  logging.getLogger("absl").setLevel(logging.WARNING)
  logging.getLogger("fsspec").setLevel(logging.WARNING)  # gs://: a line per file opened otherwise
  try:
    train(cd, fl.workdir, init_from_hf=fl.init_from_hf)
  except ConfigError as e:
    _error(str(e))
  except OutOfDeviceMemory as e:
    print(f"ict_jax.train: error: {e}", file=sys.stderr)
    sys.exit(1)
  except Exception:  # pylint: disable=broad-except
    if not jax.distributed.is_initialized():
      raise
    # several processes: typically a peer died and this host's collective with it failed. Leave
    # now: JAX's exit handler would wait in the coordination service's shutdown barrier for every
    # process, which a dead one never reaches, until train.heartbeat_timeout_s has passed
    traceback.print_exc()
    _exit(1)
  if Preemption.stopped:
    # the checkpoint is committed and the logs are closed: skip the interpreter teardown
    # (seconds of XLA / TensorStore destructors), which the grace period cannot spare
    _exit(0)


def _exit(code: int) -> None:
  """Exit now, without the interpreter teardown (and, on several processes, JAX's shutdown barrier)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


if __name__ == "__main__":
  main()
