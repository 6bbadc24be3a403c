"""The evaluation loop: prompts -> n samples each (batched, sharded on the mesh) -> answer checks
-> unbiased pass@k, and the result files.

    res = evaluate(model, tok, examples, answer_type="math_boxed", n=8, ks=(1, 4),
                   max_new_tokens=1024, temperature=0.6, rng=0, mesh=mesh)
    res["pass@1"], res["pass@4"], res["per_problem"][0]["correct"]

``examples`` are dicts with ``question`` (chat prompts), ``prompt`` (plain prompts) and
``answer`` (the gold), so any in-memory task (e.g. the synthetic one) works without tfds.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ict_jax.data.prompts import MATH_INSTRUCTION, encode_prompts
from ict_jax.eval import checkers
from ict_jax.eval.passk import mean_pass_at_k
from ict_jax.rewards.registry import gold_text

# answer type -> RewardPool kind; "answer" is the bare final answer of the synthetic task.
ANSWER_TYPES: dict[str, str] = {**checkers.ANSWER_TYPE_TO_KIND, "answer": "answer"}

# sampler(prompt_ids, num_samples, rng) -> texts, row g * num_samples + j = sample j of prompt g
Sampler = Callable[[Sequence[Sequence[int]], int, jax.Array], Sequence[str]]


def check_ks(ks: Sequence[int] | int, n: int) -> tuple[int, ...]:
  """Sorted distinct k values, each in [1, n]; ValueError naming the bad value otherwise."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n (samples per problem) must be an int >= 1, got {n!r}")
  ks = (ks,) if isinstance(ks, (int, np.integer)) else tuple(ks)
  if not ks:
    raise ValueError("ks is empty: give at least one k for pass@k")
  for k in ks:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"k must be an int >= 1, got {k!r}")
    if k > n:
      raise ValueError(f"pass@{k} needs n >= k samples per problem, but n = {n}: " f"raise n to at least {max(ks)}")
  return tuple(sorted({int(k) for k in ks}))


def default_instruction(answer_type: str) -> str:
  from ict_jax.eval.benchmarks import CHOICE_INSTRUCTION

  return {"math_boxed": MATH_INSTRUCTION, "choice": CHOICE_INSTRUCTION}.get(answer_type, "")


class ModelSampler:
  """A model's `Sampler` for `evaluate`: the rollout's `Collector.texts` (ict_jax/rollout.py) over
  one rollout copy of the weights (cast and laid out for decoding once here, not per batch); every
  call has the same [batch_size, width] prompt shape, so one compile."""

  def __init__(
      self,
      model,
      tokenizer,
      *,
      batch_size: int,
      width: int,
      max_new_tokens: int,
      temperature: float,
      top_p: float,
      top_k: int,
      mesh,
  ):
    from ict_jax.rollout import Collector, Sampling
    from ict_jax.sampling import as_rollout_policy

    self.collector = Collector(tokenizer, Sampling(max_new_tokens, temperature, top_p, top_k), mesh=mesh)
    self.policy = as_rollout_policy(model, mesh=mesh)
    self.batch_size, self.width = batch_size, width
    self.completion_tokens = 0

  def __call__(self, prompt_ids, num_samples, rng):
    texts, tokens = self.collector.texts(
        self.policy, prompt_ids, num_samples, rng, batch_size=self.batch_size, width=self.width
    )
    self.completion_tokens += tokens
    return texts


def _check_args(answer_type: str, ks, n: int, batch_size, examples, model, sampler) -> tuple[int, ...]:
  if answer_type not in ANSWER_TYPES:
    raise ValueError(f"evaluate: unknown answer_type {answer_type!r}; expected one of {sorted(ANSWER_TYPES)}")
  ks = check_ks(ks, n)
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
    raise ValueError(f"evaluate: batch_size must be an int >= 1, got {batch_size!r}")
  if not examples:
    raise ValueError("evaluate: no examples")
  if model is None and sampler is None:
    raise ValueError("evaluate: give a model or a sampler")
  return ks


def _sample_and_check(sampler, tokens, kept, kind: str, n: int, batch_size: int, key, pool, bar):
  """Every problem's `n` completions, checked -> (completions [problems][n], correct [problems, n],
  the pool's {"timeouts", "errors"} counts)."""
  completions: list[list[str]] = []
  correct = np.zeros((len(kept), n), bool)  # [problems, n]
  stats = {"timeouts": 0, "errors": 0}
  for b, start in enumerate(range(0, len(kept), batch_size)):
    stop = min(start + batch_size, len(kept))
    texts = list(sampler(tokens[start:stop], n, jax.random.fold_in(key, b)))
    if len(texts) != (stop - start) * n:
      raise ValueError(
          f"evaluate: the sampler returned {len(texts)} completions for " f"{stop - start} prompts x {n} samples"
      )
    golds = [gold_text(kind, kept[g]) for g in range(start, stop) for _ in range(n)]
    rewards, rstats = pool.score_batch(kind, texts, golds)
    correct[start:stop] = (np.asarray(rewards) > 0.5).reshape(stop - start, n)
    for key_ in stats:
      stats[key_] += int(rstats.get(key_, 0))
    completions.extend(texts[g * n : (g + 1) * n] for g in range(stop - start))
    bar.update(stop - start)
    bar.set_postfix(pass1=f"{correct[:stop].mean():.3f}", refresh=False)
  return completions, correct, stats


def evaluate(
    model,
    tokenizer,
    examples: Sequence[Mapping[str, Any]],
    *,
    answer_type: str,
    n: int,
    ks: Sequence[int] = (1,),
    max_new_tokens: int,
    temperature: float = 0.6,
    top_p: float = 1.0,
    top_k: int = 0,
    prompt_style: str = "chat",
    instruction: str | None = None,
    rng: Any = 0,
    mesh=None,
    reward_pool=None,
    batch_size: int = 8,
    max_prompt_len: int | None = None,
    sampler: Sampler | None = None,
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, Any]:
  """pass@k of ``model`` (a `Qwen2`, or `(graphdef, params)`) on ``examples``.

  ``n`` samples per problem, ``batch_size`` problems per generation call (rows g*n..g*n+n-1
  are problem g's samples; rows are sharded over the mesh's data and fsdp axes). Prompts longer
  than ``max_prompt_len`` or than the context minus ``max_new_tokens`` are skipped and counted.
  ``instruction`` (chat prompts) defaults to the answer type's. ``rng`` is a seed or a jax key;
  batch b samples with ``fold_in(rng, b)``. ``reward_pool`` defaults to an in-process pool.
  ``sampler`` replaces the model (``model`` may then be None).

  Returns ``{"pass@k": float for each k, "n", "ks", "num_problems", "num_skipped",
  "mean_correct", "mean_response_tokens", "reward_timeouts", "reward_errors", "seconds",
  "per_problem": [{"id", "prompt", "gold", "completions", "correct", "num_correct"}]}``.
  """
  ks = _check_args(answer_type, ks, n, batch_size, examples, model, sampler)
  instruction = default_instruction(answer_type) if instruction is None else instruction
  key = jax.random.key(int(rng)) if isinstance(rng, (int, np.integer)) else rng
  t0 = time.perf_counter()

  limit = max_prompt_len if max_prompt_len is not None else 1 << 62
  if sampler is None:
    if isinstance(model, tuple):
      from flax import nnx

      model = nnx.merge(*model)
    limit = min(limit, model.cfg.max_position_embeddings - max_new_tokens)
  kept, prompts, tokens = encode_prompts(
      examples, tokenizer, style=prompt_style, instruction=instruction, max_len=limit
  )
  if not kept:
    raise ValueError(
        f"evaluate: all {len(examples)} prompts are longer than the {limit} tokens "
        f"allowed (max_prompt_len / model context minus max_new_tokens)"
    )

  if sampler is None:
    from ict_jax.sampling import bucket_length

    sampler = ModelSampler(
        model,
        tokenizer,
        batch_size=int(batch_size),
        width=bucket_length(max(map(len, tokens))),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        mesh=mesh,
    )
  from ict_jax.rewards.pool import RewardPool
  from tqdm.auto import tqdm

  pool = reward_pool if reward_pool is not None else RewardPool(num_workers=0, timeout_s=10.0)
  bar = tqdm(total=len(kept), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True)
  try:
    completions, correct, stats = _sample_and_check(
        sampler, tokens, kept, ANSWER_TYPES[answer_type], n, batch_size, key, pool, bar
    )
  finally:
    bar.close()
    if reward_pool is None:
      pool.close()

  counts = correct.sum(axis=1)
  result: dict[str, Any] = {f"pass@{k}": mean_pass_at_k(counts, n, k) for k in ks}
  result.update(
      n=int(n),
      ks=list(ks),
      num_problems=len(kept),
      num_skipped=len(examples) - len(kept),
      mean_correct=float(correct.mean()),
      mean_response_tokens=(sampler.completion_tokens / correct.size if isinstance(sampler, ModelSampler) else None),
      reward_timeouts=stats["timeouts"],
      reward_errors=stats["errors"],
      seconds=time.perf_counter() - t0,
      per_problem=[
          {
              "id": str(ex.get("id", i)),
              "prompt": p,
              "gold": ex["answer"],
              "completions": c,
              "correct": [bool(x) for x in row],
              "num_correct": int(row.sum()),
          }
          for i, (ex, p, c, row) in enumerate(zip(kept, prompts, completions, correct))
      ],
  )
  return result


def benchmark_rng(seed: int, name: str) -> jax.Array:
  """A benchmark's key: the seed folded with the crc32 of its name, so a benchmark samples the
  same whatever other benchmarks run with it."""
  return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


def load_benchmarks(
    benches: Sequence,
    *,
    data_dir: str | None,
    manual_dirs: Mapping[str, str],
    limit: int | None = None,
    files=None,
) -> dict[str, list[dict[str, Any]]]:
  """Every benchmark's examples (built from its files first), before any model time is spent;
  `files` (an `ict_jax.data.files.FileSplit`) is what the ``files`` benchmark reads."""
  from ict_jax.eval import benchmarks as registry

  return {
      b.name: registry.load(b, data_dir=data_dir, manual_dir=manual_dirs.get(b.name), limit=limit, files=files)
      for b in benches
  }


def evaluate_benchmarks(
    model,
    tokenizer,
    benches: Sequence,
    examples: Mapping[str, Sequence[Mapping]],
    *,
    seed: int = 0,
    progress: bool = False,
    **kw,
) -> dict[str, dict[str, Any]]:
  """`evaluate` on each registry `Benchmark` with its answer type, instruction and key
  `benchmark_rng(seed, name)`; `examples` from `load_benchmarks`, `kw` as for `evaluate`."""
  return {
      b.name: evaluate(
          model,
          tokenizer,
          examples[b.name],
          answer_type=b.answer_type,
          instruction=b.instruction,
          rng=benchmark_rng(seed, b.name),
          progress=progress,
          desc=b.name,
          **kw,
      )
      for b in benches
  }


# ---- reporting ---------------------------------------------------------------------------------
def summary(
    label: str,
    step: int | None,
    settings: Mapping[str, Any],
    per_benchmark: Mapping[str, Mapping[str, Any]],
    titles: Mapping[str, str],
) -> dict[str, Any]:
  """results.json: settings, pass@k per benchmark (no per-problem data) and the unweighted
  average over benchmarks."""
  ks = list(settings["ks"])
  benches = {}
  for name, res in per_benchmark.items():
    benches[name] = {"title": titles.get(name, name), **{k: v for k, v in res.items() if k != "per_problem"}}
  average = {f"pass@{k}": float(np.mean([b[f"pass@{k}"] for b in benches.values()])) for k in ks}
  return {"model": label, "step": step, "settings": dict(settings), "benchmarks": benches, "average": average}


def markdown_table(results: Sequence[Mapping[str, Any]], ks: Sequence[int] | None = None) -> str:
  """One Markdown table, a row per results.json dict (model / step), columns ``<title> P@k`` per
  benchmark (the first result's order) and ``Average P@k``; values in percent."""
  if not results:
    raise ValueError("markdown_table: no results")
  ks = list(ks if ks is not None else results[0]["settings"]["ks"])
  names: list[str] = []
  titles: dict[str, str] = {}
  for r in results:
    for name, b in r["benchmarks"].items():
      if name not in names:
        names.append(name)
        titles[name] = b.get("title", name)
  header = ["Model"] + [f"{titles[m]} P@{k}" for m in names for k in ks] + [f"Average P@{k}" for k in ks]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

  def cell(d: Mapping[str, Any] | None, k: int) -> str:
    v = None if d is None else d.get(f"pass@{k}")
    return "–" if v is None else f"{100 * v:.1f}"

  for r in results:
    row = [str(r["model"]) + (f" (step {r['step']})" if r.get("step") is not None else "")]
    row += [cell(r["benchmarks"].get(m), k) for m in names for k in ks]
    row += [cell(r.get("average"), k) for k in ks]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines) + "\n"


def write_results(out_dir: str, summary_: Mapping[str, Any], per_benchmark: Mapping[str, Mapping[str, Any]]) -> None:
  """results.json, results.md and samples_<bench>.jsonl (one problem a line) in out_dir
  (local or gs://)."""
  from etils import epath

  out = epath.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(summary_, indent=2) + "\n")
  s = summary_["settings"]
  notes = (
      f"\nn = {s['n']} samples per problem, temperature {s['temperature']}, top-p {s['top_p']}, "
      f"max_new_tokens {s['max_new_tokens']}, seed {s['seed']}; unbiased pass@k in %.\n"
  )
  (out / "results.md").write_text(markdown_table([summary_]) + notes)
  for name, res in per_benchmark.items():
    lines = [json.dumps(p, ensure_ascii=False) for p in res["per_problem"]]
    (out / f"samples_{name}.jsonl").write_text("\n".join(lines) + "\n")
