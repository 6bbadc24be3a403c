"""Brief supervised warm-start of a randomly initialised policy (the embedded CPU default).

RL from verifiable rewards needs a policy that sometimes succeeds; a random tiny model never
does. This teacher-forces `prompt + answer + EOS` on the training split for a few steps, so RL
starts from a partly competent policy (the reward then has room to rise). Real runs start from a
pretrained Hugging Face checkpoint and skip this.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from ict_jax.models.axes import constrain
from ict_jax.sharding import put_global


def _sft_loss(params, graphdef, ids, mask, pos, pos_mask):
  """Mean NLL of the target tokens ids[b, pos[b, k]] predicted from position pos[b, k] - 1.

  ids/mask [B, T]; pos/pos_mask [B, K]: only the K target positions go through the LM head
  (the [B, T, V] logits of a 151936-token vocabulary are most of the cost)."""
  model = nnx.merge(graphdef, params)
  h = model.hidden_states(ids, mask)  # [B, T, D]
  h_prev = jnp.take_along_axis(h, jnp.maximum(pos - 1, 0)[..., None], axis=1)  # [B, K, D]
  logits = model.logits_from_hidden(h_prev)  # [B, K, V]
  target = jnp.take_along_axis(ids, pos, axis=1)  # [B, K]
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]
  w = pos_mask.astype(jnp.float32)
  return jnp.sum(nll * w) / jnp.maximum(w.sum(), 1.0)


def sft_targets(example) -> list[str]:
  """The supervised targets of a dataset example: its worked solutions (one a line in
  ``solutions``, e.g. ``synthetic_chain``) when it has them, else its bare ``answer``."""
  solutions = str(example.get("solutions", "") or "")
  return [s for s in solutions.split("\n") if s] or [str(example["answer"])]


def build_sft_examples(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], eos_id: int, pad_id: int):
  """Right-padded [B, T] ids and attention mask, and the answer+EOS positions [B, K] + mask."""
  seqs = [list(p) + list(a) + [eos_id] for p, a in zip(prompts, answers)]
  width = max(len(s) for s in seqs)
  ids = np.full((len(seqs), width), pad_id, np.int32)
  mask = np.zeros_like(ids)
  k = max(len(s) - len(p) for p, s in zip(prompts, seqs))
  pos = np.zeros((len(seqs), k), np.int32)
  pos_mask = np.zeros_like(pos)
  for i, (p, s) in enumerate(zip(prompts, seqs)):
    ids[i, : len(s)] = s
    mask[i, : len(s)] = 1
    pos[i, : len(s) - len(p)] = np.arange(len(p), len(s))
    pos_mask[i, : len(s) - len(p)] = 1
  return ids, mask, pos, pos_mask


def _compile_together(step, params, opt_state, batch):
  """Several processes: compile the step for the shardings it keeps (the state resharded to its
  outputs' shardings, so one program serves every step), then wait for every host. On CPU hosts
  (gloo) a collective's first rendezvous waits only 30 s for a host that is still compiling,
  which a loaded machine exceeds."""
  compiled = step.lower(params, opt_state, *batch).compile()
  params, opt_state = jax.device_put((params, opt_state), tuple(compiled.output_shardings[:2]))
  compiled = step.lower(params, opt_state, *batch).compile()
  multihost_utils.sync_global_devices("ict_jax warm-start")
  return compiled, params, opt_state


def supervised_warm_start(
    graphdef,
    params,
    ids: np.ndarray,
    mask: np.ndarray,
    pos: np.ndarray,
    pos_mask: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    mesh=None,
    log=None,
):
  """`steps` Adam steps of teacher forcing on random batches of the examples -> params."""
  opt = optax.adam(learning_rate)

  @jax.jit
  def step(p, o, *batch):
    batch = [constrain(x, ("act_batch", None)) for x in batch]
    loss, grads = jax.value_and_grad(_sft_loss)(p, graphdef, *batch)
    updates, o = opt.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  rng = np.random.default_rng(seed)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    opt_state = jax.jit(opt.init)(params)
    loss = None
    for i in range(steps):
      idx = rng.choice(len(ids), size=batch_size, replace=len(ids) < batch_size)
      batch = [ids[idx], mask[idx], pos[idx], pos_mask[idx]]
      if mesh is not None:  # global arrays, also across hosts
        batch = [put_global(x, NamedSharding(mesh, P())) for x in batch]
      if i == 0 and jax.process_count() > 1:
        step, params, opt_state = _compile_together(step, params, opt_state, batch)
      params, opt_state, loss = step(params, opt_state, *batch)
      if log is not None and (i + 1) % max(1, steps // 4) == 0:
        log(f"warm-start step {i + 1}/{steps}: loss {float(loss):.3f}")
  return params
