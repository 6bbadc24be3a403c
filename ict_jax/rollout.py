"""One rollout: prompts -> tokens -> G sampled completions -> rewards -> group advantages.

Everything here runs on the host except generation (jitted, sharded). The returned `Rollout`
holds the arrays the train step consumes, and the text for logs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import grpo
from ict_jax.data.prompts import encode_prompts
from ict_jax.sampling import bucket_length, generate
from ict_jax.tokenizer import left_pad


@dataclasses.dataclass
class Rollout:
  prompt_ids: np.ndarray       # [N, P] int32, left-padded, each prompt repeated G times
  prompt_mask: np.ndarray      # [N, P]
  completion_ids: np.ndarray   # [N, C]
  completion_mask: np.ndarray  # [N, C]
  logprobs: np.ndarray         # [N, C] sampling log-probs
  rewards: np.ndarray          # [N]
  advantages: np.ndarray       # [N]
  completions: list[str]
  golds: list[Any]
  stats: dict[str, float]

  def batch(self) -> dict[str, np.ndarray]:
    """The train step's inputs."""
    return dict(prompt_ids=self.prompt_ids, prompt_mask=self.prompt_mask,
                completion_ids=self.completion_ids, completion_mask=self.completion_mask,
                advantages=self.advantages)


def host_array(x) -> np.ndarray:
  """A (possibly multi-host sharded) array, whole, on every host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def decode_completions(tokenizer, ids: np.ndarray, mask: np.ndarray, eos_ids: Sequence[int]) -> list[str]:
  out = []
  for row, m in zip(ids, mask):
    toks = [int(t) for t, v in zip(row, m) if v and int(t) not in eos_ids]
    out.append(tokenizer.decode(toks, skip_special_tokens=True))
  return out


def collect(model_or_parts, examples: Sequence[dict], tokenizer, reward_pool, *, rng,
            group_size: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
            prompt_style: str, max_prompt_len: int, reward_kind: str, format_weight: float = 0.0,
            advantage_scale: str = "group", mesh=None) -> Rollout:
  """Sample `group_size` completions per example with the current policy and score them."""
  model = model_or_parts if not isinstance(model_or_parts, tuple) else nnx.merge(*model_or_parts)
  kept, _, prompt_tokens = encode_prompts(examples, tokenizer, style=prompt_style, max_len=max_prompt_len)
  skipped = len(examples) - len(kept)  # over-long prompts
  if not kept:
    raise ValueError(f"every prompt of this batch is longer than data.max_prompt_len={max_prompt_len}")
  width = bucket_length(max(len(t) for t in prompt_tokens))  # few compiled shapes
  p_ids, p_mask = left_pad(prompt_tokens, tokenizer.pad_id, bucket=(width,))
  t0 = time.perf_counter()
  c_ids, c_mask, logp = generate(model, p_ids, p_mask, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, top_k=top_k, rng=rng,
                                 eos_token_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
                                 num_samples=group_size, mesh=mesh)
  c_ids, c_mask, logp = host_array(c_ids), host_array(c_mask), host_array(logp)
  sample_s = time.perf_counter() - t0
  texts = decode_completions(tokenizer, c_ids, c_mask, tokenizer.eos_ids)
  golds = [ex["answer"] for ex in kept for _ in range(group_size)]
  t0 = time.perf_counter()
  rewards, rstats = reward_pool.score_batch(reward_kind, texts, golds)
  if format_weight:
    fmt, _ = reward_pool.score_batch("format", texts, golds)
    rewards = rewards + format_weight * fmt
  reward_s = time.perf_counter() - t0
  adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), group_size, scale=advantage_scale))
  groups = rewards.reshape(-1, group_size)
  stats = dict(
      reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
      pass_rate=float((groups.max(axis=1) > 0).mean()),
      solve_all_rate=float((groups.min(axis=1) > 0).mean()),
      response_len=float(c_mask.sum(axis=1).mean()),
      completion_tokens=int(c_mask.sum()), prompts_skipped=skipped,
      reward_timeouts=rstats.get("timeouts", 0), reward_errors=rstats.get("errors", 0),
      sample_s=sample_s, reward_s=reward_s)
  return Rollout(np.repeat(p_ids, group_size, 0), np.repeat(p_mask, group_size, 0),
                 c_ids, c_mask, logp, rewards, adv.astype(np.float32), texts, golds, stats)
