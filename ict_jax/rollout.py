"""One rollout: prompts -> tokens -> G sampled completions -> rewards -> group advantages.

Generation runs on the devices with the rollout copy of the policy (`sampling.make_rollout_policy`:
the weights cast to the rollout dtype and laid out for decoding by one jitted call a step; no
parameter goes through the host). The completion ids stay global device arrays for the train
step; only this host's rows come to the host, are detokenized in one batched call and scored by
this host's reward pool, a decode sub-batch at a time while the next one decodes. The rewards (and per-row lengths and verifier counts) are then gathered
from every host, so the advantages are computed once from the same numbers everywhere: a
verifier timeout on one host scores 0 on every host alike. The sampler's log-probs are not
computed (the train step's first pass gives the old log-probs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import answer_positions, grpo
from ict_jax.data.prompts import encode_prompts
from ict_jax.rewards.registry import gold_text
from ict_jax.sampling import (
    RolloutPolicy,
    bucket_length,
    generate_sub_batches,
    join_sub_batches,
    make_rollout_policy,
)
from ict_jax.tokenizer import left_pad


@dataclasses.dataclass
class Rollout:
  prompt_ids: np.ndarray  # [N, P] int32, left-padded, each prompt repeated G times
  prompt_mask: np.ndarray  # [N, P]
  completion_ids: jax.Array  # [N, C] int32, rows over the devices of every host
  completion_mask: jax.Array  # [N, C] int32
  rewards: np.ndarray  # [N], the same on every host
  advantages: np.ndarray  # [N], the same on every host
  rows: np.ndarray  # [n] int: the rows this host scored (all of them on one host)
  completions: list[str]  # [n] texts of `rows`
  golds: list[Any]  # [n] gold answers of `rows`
  stats: dict[str, float]
  completion_lengths: np.ndarray  # [N] tokens sampled a row (before mask_truncated), the same on every host
  stop_pos: np.ndarray  # [N] int32: each row's stop token (-1: none), `answer_positions`
  answer_end: np.ndarray  # [N] int32: first position after the final box (-1: no box)

  def batch(self) -> dict[str, Any]:
    """The train step's inputs."""
    return dict(
        prompt_ids=self.prompt_ids,
        prompt_mask=self.prompt_mask,
        completion_ids=self.completion_ids,
        completion_mask=self.completion_mask,
        advantages=self.advantages,
        stop_pos=self.stop_pos,
        answer_end=self.answer_end,
    )


def host_array(x) -> np.ndarray:
  """A (possibly multi-host sharded) array, whole, on every host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
  """(row indices [n], rows [n, ...]) of the rows of `x` held by this host's devices (rows
  replicated over several local devices once), sorted; all rows when `x` is fully addressable."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    x = np.asarray(x)
    return np.arange(x.shape[0]), x
  blocks = {}
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0])
    blocks.setdefault(start, (np.arange(start, stop), np.asarray(shard.data)))
  idx, data = zip(*(blocks[k] for k in sorted(blocks)))
  return np.concatenate(idx), np.concatenate(data)


def gather_rows(rows: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
  """Every host's `values` [n_host, ...] at its `rows` [n_host] -> the whole [n, ...], the same
  on every host. Raises when the hosts' rows do not cover 0..n-1 exactly once."""
  values = np.asarray(values)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    counts = multihost_utils.process_allgather(np.int32(len(rows)))  # [processes]
    width = int(np.max(counts))
    pad = lambda a, fill: np.concatenate([a, np.full((width - len(a),) + a.shape[1:], fill, a.dtype)])
    rows = multihost_utils.process_allgather(pad(np.asarray(rows, np.int64), -1)).reshape(-1)
    values = multihost_utils.process_allgather(pad(values, 0)).reshape(-1, *values.shape[1:])
    values, rows = values[rows >= 0], rows[rows >= 0]
  if sorted(rows.tolist()) != list(range(n)):
    raise ValueError(f"gather_rows: the hosts' rows do not cover the {n} rows exactly once")
  out = np.zeros((n,) + values.shape[1:], values.dtype)
  out[rows] = values
  return out


def decode_completions(tokenizer, ids: np.ndarray, mask: np.ndarray, eos_ids: Sequence[int]) -> list[str]:
  """Texts of completion rows ids/mask [n, C]: the masked tokens less EOS, special tokens
  skipped, detokenized in one batched call."""
  ids, mask = np.asarray(ids), np.asarray(mask)
  keep = (mask != 0) & ~np.isin(ids, np.asarray(list(eos_ids), ids.dtype))
  return tokenizer.decode_batch([row[k] for row, k in zip(ids, keep)], skip_special_tokens=True)


def rollout_policy(model_or_parts, *, dtype: str | None = None, mesh=None) -> RolloutPolicy:
  """A RolloutPolicy from a model, (graphdef, params) or a RolloutPolicy (returned as is)."""
  if isinstance(model_or_parts, RolloutPolicy):
    return model_or_parts
  graphdef, params = model_or_parts if isinstance(model_or_parts, tuple) else nnx.split(model_or_parts)
  return make_rollout_policy(graphdef, params, dtype=dtype, mesh=mesh)


def _mean_or_nan(x: np.ndarray) -> float:
  return float(x.mean()) if x.size else float("nan")


def collect(
    model_or_parts,
    examples: Sequence[dict],
    tokenizer,
    reward_pool,
    *,
    rng,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    prompt_style: str,
    max_prompt_len: int,
    reward_kind: str,
    format_weight: float = 0.0,
    advantage_scale: str = "group",
    mask_truncated: bool = False,
    score_truncated: bool = True,
    truncated_reward: float = 0.0,
    mesh=None,
    rollout_dtype: str | None = None,
    decode_batch_size: int | str | None = None,
) -> Rollout:
  """Sample `group_size` completions per example with the current policy and score them.

  model_or_parts: a Qwen2, (graphdef, params) (e.g. the train state's) or a RolloutPolicy;
  the first two are copied into `rollout_dtype` (default: the model's compute dtype) and the
  decoding layout first. decode_batch_size as in `sampling.generate` (an int that no longer
  divides the rows because over-long prompts were dropped shrinks to their gcd).

  The decode sub-batches overlap with the host: while sub-batch j + 1 decodes, sub-batch j's rows
  are fetched, detokenized and submitted to the reward pool (`RewardPool.submit`, scored in its
  thread), so the rewards are the same as when scored after all the decoding. stats["sample_s"]
  covers the rollout copy, generation and fetching this host's rows; stats["reward_s"] the wait
  for the rewards after that (the scoring decoding did not hide).

  A completion is truncated when it reaches max_new_tokens without a stop token;
  stats["truncated_rate"] is their share. mask_truncated (TRL's mask_truncated_completions)
  zeroes their completion mask, so they get no loss and drop out of ICT's group mean; their
  reward still counts in the group's advantages and in the reward statistics. score_truncated=False
  gives them `truncated_reward` instead of the verifier's score (in the advantages and
  reward_mean); stats["reward_truncated"] / ["reward_complete"] are the verifier's mean score of
  the truncated / the stopped completions either way (NaN when there are none)."""
  t0 = time.perf_counter()
  policy = rollout_policy(model_or_parts, dtype=rollout_dtype, mesh=mesh)
  kept, _, prompt_tokens = encode_prompts(examples, tokenizer, style=prompt_style, max_len=max_prompt_len)
  skipped = len(examples) - len(kept)  # over-long prompts
  if not kept:
    raise ValueError(f"every prompt of this batch is longer than data.max_prompt_len={max_prompt_len}")
  width = bucket_length(max(len(t) for t in prompt_tokens))  # few compiled shapes
  p_ids, p_mask = left_pad(prompt_tokens, tokenizer.pad_id, bucket=(width,))
  n = len(kept) * group_size
  if isinstance(decode_batch_size, int) and n % decode_batch_size:  # prompts were skipped
    decode_batch_size = math.gcd(decode_batch_size, n)  # smaller sub-batches: still fits
  all_golds = [gold_text(reward_kind, ex) for ex in kept for _ in range(group_size)]
  parts, rows, ids, mask, texts, golds, futures = [], [], [], [], [], [], []  # one entry a sub-batch
  for part in generate_sub_batches(
      policy,
      p_ids,
      p_mask,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_p=top_p,
      top_k=top_k,
      rng=rng,
      eos_token_ids=tokenizer.eos_ids,
      pad_id=tokenizer.pad_id,
      num_samples=group_size,
      mesh=mesh,
      return_logprobs=False,
      decode_batch_size=decode_batch_size,
  ):  # sub-batch j + 1 is decoding while j is fetched, detokenized and handed to the reward pool
    parts.append(part)
    idx, part_ids = local_rows(part.outputs[0])  # this host's rows (ids and mask share one sharding)
    _, part_mask = local_rows(part.outputs[1])
    keep = part.rows[idx] >= 0  # not batch padding
    rows.append(part.rows[idx][keep])
    ids.append(part_ids[keep])
    mask.append(part_mask[keep])
    texts.append(decode_completions(tokenizer, ids[-1], mask[-1], tokenizer.eos_ids))
    golds.append([all_golds[i] for i in rows[-1]])
    kinds = [reward_kind] + (["format"] if format_weight else [])
    futures.append([reward_pool.submit(kind, texts[-1], golds[-1]) for kind in kinds])
  c_ids, c_mask = join_sub_batches(parts)
  sample_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  local, counts = [], np.zeros(2, np.float32)  # timeouts, errors
  for (scores, rstats), *fmt in ([f.result() for f in fs] for fs in futures):  # fmt: [] or [(scores, stats)]
    local.append(scores + format_weight * fmt[0][0] if fmt else scores)
    for _, st in [(scores, rstats), *fmt]:
      counts += [st.get("timeouts", 0), st.get("errors", 0)]
  reward_s = time.perf_counter() - t0
  rows = np.concatenate(rows)
  order = np.argsort(rows, kind="stable")  # ascending rows, as before the sub-batches were split
  rows, ids, mask, local = rows[order], *(np.concatenate(x)[order] for x in (ids, mask, local))
  texts = [t for ts in texts for t in ts]
  golds = [g for gs in golds for g in gs]
  texts, golds = [texts[i] for i in order], [golds[i] for i in order]
  stopped = ((mask != 0) & np.isin(ids, np.asarray(tokenizer.eos_ids, ids.dtype))).any(axis=1)
  # per row: reward, length, truncated, stop position, answer end; the host's timeout and error
  # counts ride on its first row
  per_row = np.zeros((len(rows), 7), np.float32)
  per_row[:, 0], per_row[:, 1], per_row[:, 2] = local, mask.sum(axis=1), ~stopped
  per_row[:, 5], per_row[:, 6] = answer_positions.positions(tokenizer, ids, mask, tokenizer.eos_ids)
  if len(rows):
    per_row[0, 3:5] = counts
  whole = gather_rows(rows, per_row, n)
  timeouts, errors = (int(c) for c in whole[:, 3:5].sum(axis=0))
  scores, lengths, truncated = whole[:, 0], whole[:, 1], whole[:, 2] > 0
  rewards = scores if score_truncated else np.where(truncated, np.float32(truncated_reward), scores)
  if mask_truncated and truncated.any():
    c_mask = c_mask * (~truncated).astype(c_mask.dtype)[:, None]  # [rows, new]; keeps c_mask's sharding
  adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), group_size, scale=advantage_scale))
  groups = rewards.reshape(-1, group_size)
  stats = dict(
      reward_mean=float(rewards.mean()),
      reward_std=float(rewards.std()),
      pass_rate=float((groups.max(axis=1) > 0).mean()),
      solve_all_rate=float((groups.min(axis=1) > 0).mean()),
      response_len=float(lengths.mean()),
      max_response_len=int(lengths.max()),
      completion_tokens=int(lengths.sum()),
      truncated_rate=float(truncated.mean()),
      reward_truncated=_mean_or_nan(scores[truncated]),
      reward_complete=_mean_or_nan(scores[~truncated]),
      prompts_skipped=skipped,
      reward_timeouts=timeouts,
      reward_errors=errors,
      sample_s=sample_s,
      reward_s=reward_s,
  )
  return Rollout(
      np.repeat(p_ids, group_size, 0),
      np.repeat(p_mask, group_size, 0),
      c_ids,
      c_mask,
      rewards,
      adv.astype(np.float32),
      rows,
      texts,
      golds,
      stats,
      lengths.astype(np.int32),
      whole[:, 5].astype(np.int32),
      whole[:, 6].astype(np.int32),
  )
