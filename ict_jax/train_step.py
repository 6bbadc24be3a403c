"""The jitted GRPO / ICT train step: `(state, batch) -> (state, metrics, logp)`.

Per micro-batch (a whole number of groups): one forward pass to the final hidden states, then a
fused, chunked LM head over the completion positions (`lm_head.py`) that yields in one pass over
each [N, chunk, V] float32 logits block the sampled tokens' log-probs (differentiated; the
backward recomputes only the rows with gradient when ICT's selection leaves few) and, with no
gradient, Shannon / Renyi-2 entropy and the ICT JS score. The selection mask, the clipped
surrogate and its (numerator, denominator) follow; gradients of the numerators are summed over
micro-batches (`lax.scan`) and divided by the summed denominators, so micro-batching equals one
big batch exactly. Then global-norm clipping and AdamW (optax), skipped when anything is
non-finite (`optax.apply_if_finite`).

Precision: the parameters (the master copy the updates land on), AdamW's moments and the
gradient sums are float32 whatever the compute dtype (`model.dtype`); the model casts each weight
to the compute dtype where it is used, and the LM head's dW is accumulated in float32. The step
refuses non-float32 parameters: in bfloat16 an update below 2**-9 of a weight rounds away (at
lr 1e-6 almost all of them), and a float32 copy beside bfloat16 weights would only add memory.

Selection thresholds that look across rows (20-Entropy's top-k, STAPO's entropy quantile) are
taken per micro-batch, as verl does; ICT's top-k is per response, hence micro-batch invariant.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ict_jax import answer_positions, grpo, lm_head, lora, selection
from ict_jax.batch import TrainBatch
from ict_jax.config import Config, IctConfig, LossConfig, OptimConfig
from ict_jax.models.axes import constrain
from ict_jax.sharding import put_global

_NEVER_GIVE_UP = 2**30  # apply_if_finite: always skip, never force a non-finite update


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 []
  params: Any  # pure nested dict of arrays (nnx.State.to_pure_dict()): the trained ones
  opt_state: Any  # optax state
  frozen: Any = None  # LoRA (model.lora_rank): the frozen base, a pure dict in the rollout dtype, no optimizer state

  def saved(self) -> "SavedState":
    """What a checkpoint holds of it: all but the frozen LoRA base."""
    return SavedState(step=self.step, params=self.params, opt_state=self.opt_state)


@flax.struct.dataclass
class SavedState:
  """A checkpoint's `state` item: `TrainState` less the frozen LoRA base, which a restore loads
  again from model.path (a LoRA run's checkpoint holds the adapters and their AdamW state, not a
  copy of the base). Full fine-tuning's tree is the one it has always been (step, params,
  opt_state: Orbax stores these keys, not the class)."""

  step: jax.Array  # int32 []
  params: Any
  opt_state: Any

  def with_frozen(self, frozen) -> TrainState:
    return TrainState(step=self.step, params=self.params, opt_state=self.opt_state, frozen=frozen)


def full_params(params, frozen):
  """The model's whole pure dict: the trained params, with the frozen LoRA base when there is one
  (never differentiated: the step's gradients are the adapters')."""
  return params if frozen is None else lora.join(jax.lax.stop_gradient(frozen), params)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static hyper-parameters of the compiled step (frozen, hashable): the run config's `ict` and
  `loss` sections as they are, and the step's facts from other sections."""

  ict: IctConfig = IctConfig()
  loss: LossConfig = LossConfig()
  group_size: int = 8  # rollout.group_size
  temperature: float = 1.0  # rollout.temperature (0, greedy: 1)
  micro_batch_size: int = 0  # train.micro_batch_size
  max_completion_length: int = 0  # dr_grpo's T (rollout.max_new_tokens); 0: the batch's width

  @classmethod
  def from_config(cfg_cls, cfg: Config) -> "StepConfig":
    return cfg_cls(
        ict=cfg.ict,
        loss=cfg.loss,
        group_size=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature or 1.0,
        micro_batch_size=cfg.train.micro_batch_size,
        max_completion_length=cfg.rollout.max_new_tokens,
    )


# ---- optimizer -------------------------------------------------------------------------------
def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.ScalarOrSchedule:
  """Optimizer update count -> learning rate: linear warm-up, then constant, cosine or linear decay
  (a plain number for a constant rate without warm-up, so the optimizer state keeps no count)."""
  lr, warm = cfg.learning_rate, cfg.warmup_steps
  if cfg.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warm, 0), max(total_steps, warm + 1))
  elif cfg.schedule == "linear":
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warm, 1)), optax.linear_schedule(lr, 0.0, max(total_steps - warm, 1))],
        [warm],
    )
  else:
    sched = (
        optax.join_schedules([optax.linear_schedule(0.0, lr, max(warm, 1)), optax.constant_schedule(lr)], [warm])
        if warm
        else lr
    )
  return sched


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """AdamW with warm-up + schedule and global-norm clipping; non-finite updates are skipped."""
  sched = learning_rate_schedule(cfg, total_steps)
  chain = []
  if cfg.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.max_grad_norm))
  chain.append(optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
  return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=_NEVER_GIVE_UP)


# ---- per-token log-probs and statistics ------------------------------------------------------
def completion_logp_and_stats(
    model,
    batch: TrainBatch,
    *,
    temperature: float,
    group_size: int | None,
    chunk_size: int = 128,
    grad_rows: int = 0,
    reference: str = "active_mean",
    kl: bool = False,
):
  """log pi(y_t) [N, C] (differentiable) and no-grad stats [N, C]: entropy, renyi2, js.

  The logits of completion token j come from position P-1+j of prompt+completion; they are
  divided by `temperature` (the sampling distribution). The LM head runs chunk by chunk over C
  (`lm_head.logp_and_stats`: one [N, chunk, V] float32 block live at a time; its backward pass
  recomputes only the rows with a non-zero gradient when there are at most `grad_rows`). A batch
  with a `packed` layout (`packing.pack_batch`) runs the decoder on its packed rows and the LM head on the groups'
  live rows of each column block, stacked in stripes of G rows (the group reference reads each
  piece's rows, `head_segments`), and brings the results back to [N, C]."""
  w, vocab_major = model.head_weight()  # [V, D] (tied) or [D, V]
  head = functools.partial(
      lm_head.logp_and_stats,
      w=w,
      temperature=temperature,
      group_size=group_size,
      chunk_size=chunk_size,
      grad_rows=grad_rows,
      vocab_major=vocab_major,
      reference=reference,
      kl=kl,
      kernels=model.cfg.kernels,
  )
  pk = batch.packed
  if pk is not None:  # the decoder on packed rows; the head on the groups' live blocks
    h = model.hidden_states(  # a packed row holds at most the micro-batch's N sequences
        pk.ids,
        positions=pk.positions,
        segment_ids=pk.segments,
        max_segments=pk.head_index.shape[0],
    )
    h = jnp.take(h.reshape(-1, h.shape[-1]), pk.head_index, axis=0)  # [N, C2, D]
    logp, stats = head(h, ids=pk.head_ids, mask=pk.head_mask, segments=pk.head_segments)
    back = lambda x: jnp.take(x.reshape(-1), pk.unhead_index, axis=0, mode="fill", fill_value=0)
    return back(logp), jax.tree.map(back, stats)  # [N, C]; 0 where a whole group is padding
  ids, cmask = batch.completion_ids, batch.completion_mask
  p, c = batch.prompt_ids.shape[1], ids.shape[1]
  h = model.hidden_states(jnp.concatenate([batch.prompt_ids, ids], 1), jnp.concatenate([batch.prompt_mask, cmask], 1))
  h = h[:, p - 1 : p + c - 1]  # [N, C, D]
  if batch.hidden_offset is not None:  # the fault-injection seam (TrainBatch.hidden_offset)
    h = h + batch.hidden_offset[:, None, None].astype(h.dtype)
  return head(h, ids=ids, mask=cmask)


# ---- the loss of one micro-batch -------------------------------------------------------------
def _microbatch_terms(params, graphdef, batch: TrainBatch, step, cfg: StepConfig, ref_params, frozen=None):
  model = lora.merge(graphdef, full_params(params, frozen))
  ict, loss = cfg.ict, cfg.loss
  n, c = batch.completion_ids.shape
  grad_rows = (
      lm_head.sparse_grad_rows(ict.method, ict.top_fraction, ict.entropy_top_fraction, n, c)
      if ict.sparse_backward
      else 0
  )
  logp, stats = completion_logp_and_stats(
      model,
      batch,
      temperature=cfg.temperature,
      group_size=cfg.group_size,
      chunk_size=ict.chunk_size,
      grad_rows=grad_rows,
      reference=ict.reference,
      kl=ict.method == "ict" and ict.score == "kl",
  )
  mask = batch.completion_mask
  adv = batch.advantages
  sg_logp = jax.lax.stop_gradient(logp)
  old_logp = sg_logp if batch.old_logp is None else batch.old_logp
  ref_logp = None
  if loss.beta > 0:
    ref_model = lora.merge(graphdef, full_params(ref_params, frozen))
    ref_logp, _ = completion_logp_and_stats(
        ref_model, batch, temperature=cfg.temperature, group_size=None, chunk_size=ict.chunk_size
    )
    ref_logp = jax.lax.stop_gradient(ref_logp)
  token_mask, loss_type = selection.select_tokens(
      ict,
      loss.loss_type,
      mask=mask,
      u=stats["js"],
      entropy=stats["entropy"],
      token_prob=jnp.exp(sg_logp),
      advantages=adv,
      kl=stats.get("kl"),
      noise=batch.score_noise,
  )
  if ict.method == "ict" and ict.warmup_steps > 0:  # dense GRPO for the first steps
    token_mask = jnp.where(step < ict.warmup_steps, mask.astype(bool), token_mask)
  terms = grpo.policy_loss_terms(
      logp,
      old_logp,
      adv,
      mask,
      ref_logp=ref_logp,
      beta=loss.beta,
      epsilon_low=loss.epsilon_low,
      epsilon_high=loss.epsilon_high,
      loss_type=loss_type,
      token_mask=token_mask,
      max_completion_length=cfg.max_completion_length or None,
      selected_norm=loss.selected_norm,
      num_rows=None
      if batch.packed is None or batch.packed.source_row is None
      else (batch.packed.source_row >= 0).sum(),
  )
  metrics = dict(terms.metrics)
  metrics.update(selection.selection_metrics(stats["js"], mask, token_mask, stats["entropy"], stats["renyi2"]))
  if batch.stop_pos is not None:  # a rollout's batch: where the selection falls (stop token, post-answer)
    metrics.update(
        answer_positions.where_metrics(token_mask, mask, stats["entropy"], batch.stop_pos, batch.answer_end, adv)
    )
  # per-token outputs [N, C]: the whole step's signature metrics are taken after the scan
  return terms.numerator, (terms.denominator, metrics, (sg_logp, stats["entropy"], token_mask.astype(bool)))


def check_micro_batch(micro_batch: int, mesh) -> None:
  """A micro-batch must split evenly over the mesh's row axes (data x fsdp); otherwise the
  sharding rules would drop those axes and every device would compute every row. Raises
  ValueError naming train.micro_batch_size and the mesh."""
  if mesh is None or mesh.empty:
    return
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  if micro_batch % rows:
    raise ValueError(
        f"config.train.micro_batch_size: a micro-batch of {micro_batch} rows does not "
        f"divide over the mesh's data x fsdp = {mesh.shape['data']} x "
        f"{mesh.shape['fsdp']} = {rows} devices (mesh {dict(mesh.shape)}); use a "
        f"multiple of {rows} (0 = the whole batch of prompts_per_step x group_size)"
    )


def make_train_step(
    graphdef,
    cfg: StepConfig,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    state_sharding=None,
    donate: bool = True,
    compiler_options: dict | None = None,
):
  """Jitted `(state, batch, ref_params) -> (state, metrics, logp [N, C])`; `compiler_options`
  go to `jax.jit` (XLA options, e.g. cheaper CPU code generation in tests).

  batch: prompt_ids/prompt_mask [N, P] (left-padded), completion_ids/completion_mask [N, C],
  advantages [N], optionally old_logp [N, C] (for num_iterations > 1; default: on-policy), and
  optionally the packed decoder input of `packing.pack_batch` (made with this micro-batch size):
  then the decoder runs on the packed rows, with the same results."""

  def step_fn(state: TrainState, batch: TrainBatch, ref_params=None):
    low = [
        (jax.tree_util.keystr(path), x.dtype)
        for path, x in jax.tree_util.tree_leaves_with_path(state.params)
        if x.dtype != jnp.float32
    ]
    if low:
      raise ValueError(
          f"train step: parameters must be float32 master weights (compute runs in "
          f"the model's dtype); {low[0][0]} is {low[0][1]} ({len(low)} such leaves)"
      )
    n = batch.completion_ids.shape[0]
    mb = batch.micro_batch_rows or cfg.micro_batch_size or n  # a token-budget batch names its own
    if n % mb or mb % cfg.group_size:
      raise ValueError(
          f"micro_batch_size {mb} must divide the batch ({n} rows) and be a " f"multiple of group_size {cfg.group_size}"
      )
    check_micro_batch(mb, jax.sharding.get_abstract_mesh())
    if cfg.ict.method == "ict" and cfg.ict.score == "random":  # the "random" ablation's scores
      key = jax.random.fold_in(jax.random.key(0), state.step)
      batch = batch.replace(score_noise=jax.random.uniform(key, batch.completion_mask.shape))
    batch = jax.tree.map(lambda v: constrain(v, ("act_batch",) + (None,) * (v.ndim - 1)), batch)
    grad_fn = jax.value_and_grad(_microbatch_terms, has_aux=True)
    # [N] -> [N / mb, mb]: micro-batch i is rows i*mb .. i*mb + mb - 1 (whole groups), and each
    # one is spread over every device (not micro-batch i on device i): a device's share of a
    # micro-batch is mb / (data x fsdp) consecutive rows, whole groups when it has >= G of them.
    # Packed rows (`packing.pack_batch`) are [N / mb * R, W]: micro-batch i's R rows likewise.
    micro = jax.tree.map(
        lambda x: constrain(x.reshape(n // mb, -1, *x.shape[1:]), (None, "act_batch") + (None,) * (x.ndim - 1)), batch
    )

    def accumulate(carry, mbatch):
      grads, num, den, metrics = carry
      (num_i, (den_i, metrics_i, tokens_i)), g_i = grad_fn(
          state.params, graphdef, mbatch, state.step, cfg, ref_params, state.frozen
      )
      add = lambda a, b: a + b
      return (jax.tree.map(add, grads, g_i), num + num_i, den + den_i, jax.tree.map(add, metrics, metrics_i)), tokens_i

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    first = jax.tree.map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(
        lambda: _microbatch_terms(state.params, graphdef, first, state.step, cfg, ref_params, state.frozen)[1][1]
    )
    init_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
    (grads, num, den, msum), tokens = jax.lax.scan(
        accumulate, (zeros, jnp.float32(0), jnp.float32(0), init_metrics), micro
    )
    logp, entropy, selected = (x.reshape(n, -1) for x in tokens)  # [N, C] each
    msum = {**msum, **selection.signature_metrics(jnp.exp(logp), entropy, batch.completion_mask, selected)}
    scale = 1.0 / jnp.maximum(den, 1.0)
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    loss = num * scale
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = grpo.finalize_metrics(msum)
    finite = opt_state.last_finite
    metrics.update(
        trained_tokens=msum["selected_frac"][0],  # completion tokens in the loss: selected, not masked
        loss=loss,
        grad_norm=grad_norm,
        skipped=1 - finite.astype(jnp.int32),
        total_skipped=opt_state.total_notfinite,
    )
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, frozen=state.frozen)
    return new_state, metrics, logp

  kwargs: dict = {}
  if mesh is not None and state_sharding is not None:
    repl = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    kwargs = dict(in_shardings=(state_sharding, rows, None), out_shardings=(state_sharding, repl, rows))
  jitted = jax.jit(
      step_fn,
      donate_argnums=(0,) if donate else (),
      compiler_options=compiler_options,
      **kwargs,
  )
  rows_sharding = None if mesh is None else NamedSharding(mesh, P(("data", "fsdp")))

  def run(state, batch: TrainBatch, ref_params=None):
    if not isinstance(batch, TrainBatch):
      raise TypeError(f"train step: expected an ict_jax.batch.TrainBatch, got {type(batch).__name__}")
    if mesh is None:
      return jitted(state, batch, ref_params)
    batch = jax.tree.map(lambda v: put_global(v, rows_sharding), batch)  # multi-host: global arrays
    with jax.set_mesh(mesh):
      return jitted(state, batch, ref_params)

  # the jitted step itself: AOT lowering, cost analysis, its cache of compiled shapes
  run.jitted, run.lower, run.trace, run._cache_size = jitted, jitted.lower, jitted.trace, jitted._cache_size
  return run


# ---- state creation directly in its sharding -------------------------------------------------
def train_state_shardings(optimizer, params_abstract, params_sharding, mesh: Mesh, frozen_sharding=None):
  """Shardings of TrainState: optimizer moments follow their parameters, scalars replicated; the
  frozen LoRA base's are `frozen_sharding`."""
  repl = NamedSharding(mesh, P())
  opt_abstract = jax.eval_shape(optimizer.init, params_abstract)
  opt_sharding = optax.tree_map_params(
      optimizer, lambda _, s: s, opt_abstract, params_sharding, transform_non_params=lambda _: repl
  )
  return TrainState(step=repl, params=params_sharding, opt_state=opt_sharding, frozen=frozen_sharding)


def init_train_state(
    params, optimizer, *, mesh: Mesh | None = None, params_sharding=None, step: int = 0, frozen=None
) -> TrainState:
  """TrainState with the optimizer state created by a jitted init with `out_shardings`, so
  AdamW moments are born sharded (never whole on one device); `frozen` (the LoRA base) is kept
  as it is, with no optimizer state."""

  def init(p):
    return TrainState(step=jnp.asarray(step, jnp.int32), params=p, opt_state=optimizer.init(p))

  if mesh is None:
    return jax.jit(init)(params).replace(frozen=frozen)
  shardings = train_state_shardings(optimizer, jax.eval_shape(lambda: params), params_sharding, mesh)
  with jax.set_mesh(mesh):
    return jax.jit(init, in_shardings=(params_sharding,), out_shardings=shardings)(params).replace(frozen=frozen)


def abstract_train_state(optimizer, params_abstract, state_sharding, frozen_abstract=None) -> TrainState:
  """The TrainState `init_train_state` makes, as `jax.ShapeDtypeStruct`s carrying
  `state_sharding` (no array allocated): a checkpoint restore target, and what `ict_jax.aot`
  compiles the step for."""
  shapes = jax.eval_shape(
      lambda p, f: TrainState(jnp.int32(0), p, optimizer.init(p), f), params_abstract, frozen_abstract
  )
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, state_sharding)
