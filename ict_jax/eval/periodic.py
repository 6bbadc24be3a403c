"""Evaluation during training: pass@1 and pass@k on held-out problems every `train.eval_every` steps.

    ev = PeriodicEval.from_config(cfg, tok, eval_examples, mesh=mesh)
    if ev.due(step, total):  record.update(ev((graphdef, params), reward_pool))

Uses `ict_jax.eval.run.evaluate` (the sampler, the verifiers, the unbiased pass@k estimator) on the
first `train.eval_prompts` problems of `data.eval_split`, `train.eval_samples` samples each, at the
rollout's temperature / top-p / top-k and length. The key is the same at every evaluation, so
successive evaluations differ by the policy only (common random numbers), not by sampling noise.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Sequence

import jax

from ict_jax.data.prompts import MATH_INSTRUCTION
from ict_jax.eval.run import evaluate

PREFIX = "eval_"  # eval_pass_at_1, eval_pass_at_4, eval_pass_at_<samples>, eval_s (TensorBoard tags allow no "@")


@dataclasses.dataclass
class PeriodicEval:
  examples: Sequence[dict]
  tokenizer: Any
  every: int
  samples: int
  answer_type: str
  prompt_style: str
  max_new_tokens: int
  max_prompt_len: int
  temperature: float
  top_p: float
  top_k: int
  batch_size: int
  seed: int
  mesh: Any = None

  @classmethod
  def from_config(cls, cfg, tokenizer, source, *, mesh=None) -> "PeriodicEval":
    """`source`: the eval split (random access); its first `train.eval_prompts` problems are used."""
    n = min(len(source), cfg.train.eval_prompts)
    return cls(
        examples=[source[i] for i in range(n)],
        tokenizer=tokenizer,
        every=cfg.train.eval_every,
        samples=cfg.train.eval_samples,
        answer_type={"math": "math_boxed"}.get(cfg.reward.kind, cfg.reward.kind),
        prompt_style=cfg.data.prompt_style,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_prompt_len=cfg.data.max_prompt_len,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        batch_size=max(1, min(n, cfg.rollout.prompts_per_step)),
        seed=cfg.train.seed,
        mesh=mesh,
    )

  @property
  def ks(self) -> tuple[int, ...]:
    """pass@1, pass@4 (the ICT paper's metric) where there are 4 samples, and pass@samples."""
    return tuple(sorted({1, min(4, self.samples), self.samples}))

  def due(self, step: int, total: int) -> bool:
    """After step `step` (1-based) of `total`: every `every` steps and after the last one."""
    return self.every > 0 and (step % self.every == 0 or step == total)

  def __call__(self, model, reward_pool=None) -> dict[str, float]:
    """`model`: a `Qwen2` or `(graphdef, params)` -> {"eval_pass_at_k": ..., "eval_s": seconds}."""
    key = jax.random.fold_in(jax.random.key(self.seed), zlib.crc32(b"periodic eval") & 0x7FFFFFFF)
    res = evaluate(
        model,
        self.tokenizer,
        self.examples,
        answer_type=self.answer_type,
        n=self.samples,
        ks=self.ks,
        max_new_tokens=self.max_new_tokens,
        temperature=self.temperature,
        top_p=self.top_p,
        top_k=self.top_k,
        prompt_style=self.prompt_style,
        instruction=MATH_INSTRUCTION,  # as the rollouts' chat prompts
        rng=key,
        mesh=self.mesh,
        reward_pool=reward_pool,
        batch_size=self.batch_size,
        max_prompt_len=self.max_prompt_len,
    )
    out = {f"{PREFIX}pass_at_{k}": float(res[f"pass@{k}"]) for k in self.ks}
    out[f"{PREFIX}s"] = float(res["seconds"])
    return out
