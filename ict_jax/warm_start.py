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

from ict_jax.models.axes import constrain


def _sft_loss(params, graphdef, ids, mask, target_mask):
  """Mean next-token NLL over positions where target_mask[:, t+1] is 1. ids/mask [B, T]."""
  logits = nnx.merge(graphdef, params)(ids, mask)[:, :-1]  # [B, T-1, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
  w = target_mask[:, 1:].astype(jnp.float32)
  return jnp.sum(nll * w) / jnp.maximum(w.sum(), 1.0)


def build_sft_examples(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                       eos_id: int, pad_id: int):
  """Right-padded [B, T] ids, attention mask, and the mask of answer+EOS tokens."""
  seqs = [list(p) + list(a) + [eos_id] for p, a in zip(prompts, answers)]
  width = max(len(s) for s in seqs)
  ids = np.full((len(seqs), width), pad_id, np.int32)
  mask = np.zeros_like(ids)
  target = np.zeros_like(ids)
  for i, (p, s) in enumerate(zip(prompts, seqs)):
    ids[i, :len(s)] = s
    mask[i, :len(s)] = 1
    target[i, len(p):len(s)] = 1
  return ids, mask, target


def supervised_warm_start(graphdef, params, ids: np.ndarray, mask: np.ndarray, target: np.ndarray,
                          *, steps: int, batch_size: int, learning_rate: float, seed: int,
                          mesh=None, log=None):
  """`steps` Adam steps of teacher forcing on random batches of the examples -> params."""
  opt = optax.adam(learning_rate)

  @jax.jit
  def step(p, o, b_ids, b_mask, b_target):
    b_ids, b_mask, b_target = (constrain(x, ("act_batch", None)) for x in (b_ids, b_mask, b_target))
    loss, grads = jax.value_and_grad(_sft_loss)(p, graphdef, b_ids, b_mask, b_target)
    updates, o = opt.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  rng = np.random.default_rng(seed)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    opt_state = jax.jit(opt.init)(params)
    loss = None
    for i in range(steps):
      idx = rng.choice(len(ids), size=batch_size, replace=len(ids) < batch_size)
      params, opt_state, loss = step(params, opt_state, ids[idx], mask[idx], target[idx])
      if log is not None and (i + 1) % max(1, steps // 4) == 0:
        log(f"warm-start step {i + 1}/{steps}: loss {float(loss):.3f}")
  return params

