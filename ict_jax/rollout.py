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
from ict_jax.batch import TrainBatch
from ict_jax.data.prompts import encode_prompts
from ict_jax.rewards.functions import RewardFunction, batch_inputs
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

  def batch(self) -> TrainBatch:
    """The train step's inputs."""
    return TrainBatch(
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


def rollout_policy(
    model_or_parts, *, dtype: str | None = None, mesh=None, weights: str = "replicated"
) -> RolloutPolicy:
  """A RolloutPolicy from a model, (graphdef, params) or a RolloutPolicy (returned as is); weights:
  its decoding layout (`sampling.DECODE_WEIGHTS`)."""
  if isinstance(model_or_parts, RolloutPolicy):
    return model_or_parts
  graphdef, params = model_or_parts if isinstance(model_or_parts, tuple) else nnx.split(model_or_parts)
  return make_rollout_policy(graphdef, params, dtype=dtype, mesh=mesh, weights=weights)


def _mean_or_nan(x: np.ndarray) -> float:
  return float(x.mean()) if x.size else float("nan")


def decode_batch_size(cfg) -> int | str | None:
  """`config.rollout.decode_batch_size` as `sampling.generate` takes it: None (all rows),
  "auto" or an int."""
  dbs = cfg.rollout.decode_batch_size
  return None if dbs == "all" else dbs if dbs == "auto" else int(dbs)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How completions are drawn (`sampling.generate`)."""

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0


@dataclasses.dataclass(frozen=True)
class Scoring:
  """How completions are rewarded and turned into advantages (`Collector.collect`'s docstring)."""

  reward_kind: str  # a RewardPool kind (ict_jax/rewards/registry.py)
  format_weight: float = 0.0  # weight of the "format" reward added to it
  # reward functions (ict_jax/rewards/functions.py; the pool's `functions`): when given, the reward
  # is their weighted sum, in place of reward_kind's (+ format)
  functions: tuple[RewardFunction, ...] = ()
  advantage_scale: str = "group"  # grpo.group_advantages' scale
  mask_truncated: bool = False  # TRL's mask_truncated_completions
  score_truncated: bool = True
  truncated_reward: float = 0.0


# the per-row numbers every host contributes to `gather_rows` (one float32 column each)
_ROW_COLUMNS = ("reward", "length", "truncated", "timeouts", "errors", "stop_pos", "answer_end")


@dataclasses.dataclass
class _Sampled:
  """This host's rows of a rollout, as the sub-batches came back, and their pending scores."""

  c_ids: Any  # [N, C] global device array
  c_mask: Any
  rows: list  # per sub-batch: [n_j] this host's row indices
  ids: list  # per sub-batch: [n_j, C] np
  mask: list
  texts: list  # per sub-batch: [n_j] str
  golds: list
  futures: list  # per sub-batch: [reward future, (format future)] (none with reward functions)
  calls: list = dataclasses.field(default_factory=list)  # per sub-batch: the reward functions' future


class Collector:
  """Prompts -> G sampled completions each -> rewards -> group advantages (`collect`: the
  trainer's rollout), and prompts -> completion texts (`texts`: the evaluator's sampler): the one
  place that turns prompts into scored completions.

      collector = Collector.from_config(cfg, tokenizer, mesh=mesh, rollout_dtype="bfloat16")
      roll = collector.collect((graphdef, params), examples, reward_pool, rng=key)

  decode_batch_size as in `sampling.generate` (an int that no longer divides the rows because
  over-long prompts were dropped shrinks to their gcd); compact_rows as `sampling.generate`'s
  (config.rollout.compact_rows, compaction_units): the finished rows dropped from the decode batch
  between stretches."""

  def __init__(
      self,
      tokenizer,
      sampling: Sampling,
      scoring: Scoring | None = None,
      *,
      group_size: int = 1,
      prompt_style: str = "plain",
      max_prompt_len: int = 1 << 30,
      mesh=None,
      rollout_dtype: str | None = None,
      decode_batch_size: int | str | None = None,
      decode_weights: str = "replicated",
      compact_rows: bool = True,
      compaction_units: int = 8,
  ):
    self.tokenizer, self.sampling, self.scoring = tokenizer, sampling, scoring
    self.group_size, self.prompt_style, self.max_prompt_len = group_size, prompt_style, max_prompt_len
    self.mesh, self.rollout_dtype, self.decode_batch_size = mesh, rollout_dtype, decode_batch_size
    self.decode_weights = decode_weights
    self.compact_rows, self.compaction_units = compact_rows, compaction_units

  @classmethod
  def from_config(
      cls, cfg, tokenizer, *, mesh=None, rollout_dtype: str | None = None, reward_funcs: Sequence[RewardFunction] = ()
  ) -> "Collector":
    """The rollout of a validated `ict_jax.config.Config` (its rollout, data, reward and loss
    sections); `reward_funcs` (`functions.resolve`'s) in place of reward.kind."""
    rc = cfg.rollout
    return cls(
        tokenizer,
        Sampling(rc.max_new_tokens, rc.temperature, rc.top_p, rc.top_k),
        Scoring(
            reward_kind=cfg.reward.kind,
            format_weight=cfg.reward.format_weight,
            advantage_scale=cfg.loss.advantage_scale,
            mask_truncated=cfg.loss.mask_truncated_completions,
            score_truncated=cfg.reward.score_truncated,
            truncated_reward=cfg.reward.truncated_reward,
            functions=tuple(reward_funcs),
        ),
        group_size=rc.group_size,
        prompt_style=cfg.data.prompt_style,
        max_prompt_len=cfg.data.max_prompt_len,
        mesh=mesh,
        rollout_dtype=rollout_dtype,
        decode_batch_size=decode_batch_size(cfg),
        decode_weights=rc.decode_weights,
        compact_rows=rc.compact_rows,
        compaction_units=rc.compaction_units,
    )

  def policy(self, model_or_parts) -> RolloutPolicy:
    """The rollout copy: weights in the rollout dtype, laid out for decoding (a RolloutPolicy as is)."""
    return rollout_policy(model_or_parts, dtype=self.rollout_dtype, mesh=self.mesh, weights=self.decode_weights)

  def _generate_kw(self) -> dict:
    s, tok = self.sampling, self.tokenizer
    return dict(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        eos_token_ids=tok.eos_ids,
        pad_id=tok.pad_id,
        mesh=self.mesh,
        compact_rows=self.compact_rows,
        compaction_units=self.compaction_units,
    )

  # ---- the evaluator's sampler -----------------------------------------------------------------
  def texts(self, policy, prompt_ids, num_samples: int, rng, *, batch_size: int, width: int) -> tuple[list[str], int]:
    """Texts of `num_samples` completions of each prompt (row g * num_samples + j: sample j of
    prompt g) and their token count. Every call has the same [batch_size, width] prompt shape
    (short batches padded with copies of their first prompt), so one compile."""
    from ict_jax.sampling import generate

    real = len(prompt_ids)
    padded = list(prompt_ids) + [prompt_ids[0]] * (batch_size - real)
    ids, mask = left_pad(padded, self.tokenizer.pad_id, bucket=(width,))  # [B, width]
    c_ids, c_mask, _ = generate(policy, ids, mask, rng=rng, num_samples=num_samples, **self._generate_kw())
    rows = real * num_samples
    c_ids, c_mask = host_array(c_ids)[:rows], host_array(c_mask)[:rows]  # [real * n, N]
    return decode_completions(self.tokenizer, c_ids, c_mask, self.tokenizer.eos_ids), int(c_mask.sum())

  # ---- the trainer's rollout -------------------------------------------------------------------
  def collect(self, model_or_parts, examples: Sequence[dict], reward_pool, *, rng) -> Rollout:
    """Sample `group_size` completions per example with the current policy and score them.

    model_or_parts: a Qwen2, (graphdef, params) (e.g. the train state's) or a RolloutPolicy;
    the first two are copied into `rollout_dtype` (default: the model's compute dtype) and the
    decoding layout first.

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
    if self.scoring is None:
      raise ValueError("Collector.collect: the collector has no Scoring (a sampler for evaluation only)")
    t0 = time.perf_counter()
    policy = self.policy(model_or_parts)
    kept, _, prompt_tokens = encode_prompts(
        examples, self.tokenizer, style=self.prompt_style, max_len=self.max_prompt_len
    )
    if not kept:
      raise ValueError(f"every prompt of this batch is longer than data.max_prompt_len={self.max_prompt_len}")
    width = bucket_length(max(len(t) for t in prompt_tokens))  # few compiled shapes
    p_ids, p_mask = left_pad(prompt_tokens, self.tokenizer.pad_id, bucket=(width,))
    sampled = self._sample(policy, p_ids, p_mask, kept, reward_pool, rng)
    sample_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    whole = self._scores(sampled, len(kept) * self.group_size)
    roll = self._assemble(sampled, whole, p_ids, p_mask, skipped=len(examples) - len(kept))  # over-long prompts
    roll.stats.update(sample_s=sample_s, reward_s=whole["reward_s"])
    return roll

  def _sample(self, policy, p_ids, p_mask, kept, reward_pool, rng) -> _Sampled:
    """Decode in sub-batches; sub-batch j + 1 decodes while j is fetched, detokenized and handed
    to the reward pool."""
    g, tok, scoring = self.group_size, self.tokenizer, self.scoring
    n, dbs = len(kept) * g, self.decode_batch_size
    if isinstance(dbs, int) and n % dbs:  # prompts were skipped
      dbs = math.gcd(dbs, n)  # smaller sub-batches: still fits
    all_golds = [gold_text(scoring.reward_kind, ex) for ex in kept for _ in range(g)]
    kinds = [] if scoring.functions else [scoring.reward_kind] + (["format"] if scoring.format_weight else [])
    parts, out = [], _Sampled(None, None, [], [], [], [], [], [])
    for part in generate_sub_batches(
        policy,
        p_ids,
        p_mask,
        rng=rng,
        num_samples=g,
        return_logprobs=False,
        decode_batch_size=dbs,
        **self._generate_kw(),
    ):
      parts.append(part)
      idx, part_ids = local_rows(part.outputs[0])  # this host's rows (ids and mask share one sharding)
      _, part_mask = local_rows(part.outputs[1])
      keep = part.rows[idx] >= 0  # not batch padding
      out.rows.append(part.rows[idx][keep])
      out.ids.append(part_ids[keep])
      out.mask.append(part_mask[keep])
      out.texts.append(decode_completions(tok, out.ids[-1], out.mask[-1], tok.eos_ids))
      out.golds.append([all_golds[i] for i in out.rows[-1]])
      if kinds:
        out.futures.append([reward_pool.submit(kind, out.texts[-1], out.golds[-1]) for kind in kinds])
      else:  # reward functions
        prompts, columns = batch_inputs(kept, out.rows[-1] // g)
        out.calls.append(reward_pool.submit_functions(prompts, out.texts[-1], columns))
    out.c_ids, out.c_mask = join_sub_batches(parts)
    return out

  def _function_scores(self, results: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sub-batch's `RewardPool.score_functions` -> (rewards [n]: the weighted sum, None as 0;
    values [n, K], NaN where a function returned None; counts [K, 2]: each one's timeouts, errors)."""
    funcs = self.scoring.functions
    values = np.stack([results[f.name][0] for f in funcs], axis=1).astype(np.float32)  # [n, K]
    weights = np.asarray([f.weight for f in funcs], np.float32)
    counts = np.asarray([[results[f.name][1][k] for k in ("timeouts", "errors")] for f in funcs], np.float32)
    return (np.nan_to_num(values, nan=0.0) * weights).sum(axis=1), values, counts

  def _scores(self, sampled: _Sampled, n: int) -> dict[str, Any]:
    """Wait for this host's scores, then gather every host's per-row numbers: {column: [N]} the
    same on every host (`_ROW_COLUMNS`, then each reward function's values "fn<k>" and its
    "fn<k>_timeouts" / "fn<k>_errors"), this host's rows sorted, and the wait in "reward_s"."""
    t0, fw, funcs = time.perf_counter(), self.scoring.format_weight, self.scoring.functions
    local, counts = [], np.zeros(2, np.float32)  # timeouts, errors
    f_values, f_counts = [], np.zeros((len(funcs), 2), np.float32)  # reward functions: [n_j, K], [K, 2]
    for (scores, rstats), *fmt in ([f.result() for f in fs] for fs in sampled.futures):  # fmt: [] or [(scores, stats)]
      local.append(scores + fw * fmt[0][0] if fmt else scores)
      for _, st in [(scores, rstats), *fmt]:
        counts += [st.get("timeouts", 0), st.get("errors", 0)]
    for call in sampled.calls:  # reward functions (then sampled.futures is empty)
      rewards, values, per_function = self._function_scores(call.result())
      local.append(rewards)
      f_values.append(values)
      f_counts += per_function
    counts += f_counts.sum(axis=0)
    reward_s = time.perf_counter() - t0
    rows = np.concatenate(sampled.rows)
    order = np.argsort(rows, kind="stable")  # ascending rows, as before the sub-batches were split
    rows, ids, mask, local = rows[order], *(np.concatenate(x)[order] for x in (sampled.ids, sampled.mask, local))
    sampled.rows, sampled.ids, sampled.mask = rows, ids, mask
    texts, golds = [t for ts in sampled.texts for t in ts], [g for gs in sampled.golds for g in gs]
    sampled.texts, sampled.golds = [texts[i] for i in order], [golds[i] for i in order]
    tok = self.tokenizer
    stopped = ((mask != 0) & np.isin(ids, np.asarray(tok.eos_ids, ids.dtype))).any(axis=1)
    names = _ROW_COLUMNS + tuple(f"fn{k}{what}" for k in range(len(funcs)) for what in ("", "_timeouts", "_errors"))
    column = dict.fromkeys(names, 0.0)
    column.update(reward=local, length=mask.sum(axis=1), truncated=~stopped)
    column["stop_pos"], column["answer_end"] = answer_positions.positions(tok, ids, mask, tok.eos_ids)
    if funcs:
      column.update({f"fn{k}": v for k, v in enumerate(np.concatenate(f_values)[order].T)})
    per_row = np.zeros((len(rows), len(names)), np.float32)
    for i, name in enumerate(names):
      per_row[:, i] = column[name]
    if len(rows):  # the host's timeout and error counts ride on its first row
      per_row[0, names.index("timeouts") : names.index("errors") + 1] = counts
      for k in range(len(funcs)):
        per_row[0, names.index(f"fn{k}_timeouts") : names.index(f"fn{k}_errors") + 1] = f_counts[k]
    whole = gather_rows(rows, per_row, n)
    return {**dict(zip(names, whole.T)), "reward_s": reward_s}

  def _assemble(self, sampled: _Sampled, whole: dict[str, Any], p_ids, p_mask, *, skipped: int) -> Rollout:
    """Rewards (truncated ones as `Scoring` says), group advantages and the statistics."""
    sc, g = self.scoring, self.group_size
    scores, lengths, truncated = whole["reward"], whole["length"], whole["truncated"] > 0
    rewards = scores if sc.score_truncated else np.where(truncated, np.float32(sc.truncated_reward), scores)
    c_mask = sampled.c_mask
    if sc.mask_truncated and truncated.any():
      c_mask = c_mask * (~truncated).astype(c_mask.dtype)[:, None]  # [rows, new]; keeps c_mask's sharding
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), g, scale=sc.advantage_scale))
    groups = rewards.reshape(-1, g)
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
        reward_timeouts=int(whole["timeouts"].sum()),
        reward_errors=int(whole["errors"].sum()),
    )
    for k, f in enumerate(sc.functions):  # each function's mean over the completions it applies to
      values = whole[f"fn{k}"]
      applied = values[~np.isnan(values)]
      stats[f"reward/{f.name}"] = _mean_or_nan(applied)
      stats[f"reward/{f.name}/nones"] = int(values.size - applied.size)
      stats[f"reward/{f.name}/timeouts"] = int(whole[f"fn{k}_timeouts"].sum())
      stats[f"reward/{f.name}/errors"] = int(whole[f"fn{k}_errors"].sum())
    return Rollout(
        np.repeat(p_ids, g, 0),
        np.repeat(p_mask, g, 0),
        sampled.c_ids,
        c_mask,
        rewards,
        adv.astype(np.float32),
        sampled.rows,
        sampled.texts,
        sampled.golds,
        stats,
        lengths.astype(np.int32),
        whole["stop_pos"].astype(np.int32),
        whole["answer_end"].astype(np.int32),
    )
