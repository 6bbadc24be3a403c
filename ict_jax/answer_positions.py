"""Where each completion stops and where its answer ends: per-row positions, found on the host.

Two per-row integers ride with a rollout's batch into the train step, which turns them into
per-token masks (`token_masks`) for the metrics of where a selection falls (`where_metrics`):

  stop_pos [N]    the position of the stop token (the first EOS / <|im_end|> among the row's real
                  tokens; the token that ends the completion), -1 when the row has none (truncated
                  at rollout.max_new_tokens, or masked out of the loss).
  answer_end [N]  the first position whose token starts at or after the end of the final
                  ``\\boxed{...}`` (the box the rewards read, `rewards.extract.answer_end`), -1
                  when the completion has no closed box.

A token is "post-answer" when it is a real token at or after answer_end and not the stop token
(the stop token is counted on its own). Character offsets come from `Tokenizer.decode_pieces` of
the row's real tokens before the stop, so the box is found in the same text the reward reads
(special tokens inside a completion aside).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ict_jax.rewards.extract import answer_end as answer_char_end

__all__ = ["positions", "token_masks", "where_metrics"]


def positions(tokenizer, ids: np.ndarray, mask: np.ndarray, eos_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """(stop_pos [n], answer_end [n]) int32 of completion rows ids, mask [n, C] (see module doc)."""
  ids, mask = np.asarray(ids), np.asarray(mask) != 0
  eos = np.asarray(list(eos_ids), ids.dtype)
  stop = np.full(ids.shape[0], -1, np.int32)
  end = np.full(ids.shape[0], -1, np.int32)
  for i in range(ids.shape[0]):
    real = np.flatnonzero(mask[i])
    is_eos = np.isin(ids[i, real], eos)
    if is_eos.any():
      first = int(np.argmax(is_eos))
      stop[i], real = real[first], real[:first]
    if not real.size:
      continue
    pieces = tokenizer.decode_pieces(ids[i, real])
    text = "".join(pieces)
    close = answer_char_end(text) if "\\" in text else None
    if close is None:
      continue
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])  # each token's first character
    after = np.flatnonzero(starts >= close)
    end[i] = real[after[0]] if after.size else real[-1] + 1
  return stop, end


def token_masks(stop_pos, answer_end, mask):
  """Per-token bool masks (stop [N, C], post_answer [N, C]) from the per-row positions; works on
  numpy and on jax arrays (inside the jitted step)."""
  xp = jnp if any(not isinstance(x, np.ndarray) for x in (stop_pos, answer_end, mask)) else np
  real = xp.asarray(mask) != 0
  t = xp.arange(real.shape[1])[None, :]
  stop = real & (t == xp.asarray(stop_pos)[:, None])
  end = xp.asarray(answer_end)[:, None]
  post = real & (end >= 0) & (t >= end) & ~stop
  return stop, post


def where_metrics(token_mask, mask, entropy, stop_pos, answer_end, advantages) -> dict:
  """(sum, count) pairs (finalised by `grpo.finalize_metrics`) of where a step's selection falls:

  selected_stop_share         stop tokens among the selected tokens
  selected_post_answer_share  post-answer tokens among the selected tokens
  stop_selected_rate          stop tokens that are selected (so get gradient) among all stop tokens
  post_answer_frac            post-answer tokens among all real tokens
  stop_entropy                mean entropy (nats) at the stop position
  stop_advantage              mean advantage [N] of the rows' stop tokens (the sign of the push
                              each gets under dense GRPO)
  stop_advantage_selected     mean advantage of the selected stop tokens (what the selection
                              trains the stop token with)
  """
  stop, post = token_masks(stop_pos, answer_end, mask)
  real = jnp.asarray(mask) != 0
  sel = (real & token_mask.astype(bool)).astype(jnp.float32)
  stop, post = stop.astype(jnp.float32), post.astype(jnp.float32)
  adv = jnp.asarray(advantages, jnp.float32)[:, None]
  return {
      "selected_stop_share": (jnp.sum(sel * stop), sel.sum()),
      "selected_post_answer_share": (jnp.sum(sel * post), sel.sum()),
      "stop_selected_rate": (jnp.sum(sel * stop), stop.sum()),
      "post_answer_frac": (post.sum(), real.astype(jnp.float32).sum()),
      "stop_entropy": (jnp.sum(entropy.astype(jnp.float32) * stop), stop.sum()),
      "stop_advantage": (jnp.sum(adv * stop), stop.sum()),
      "stop_advantage_selected": (jnp.sum(adv * sel * stop), jnp.sum(sel * stop)),
  }
