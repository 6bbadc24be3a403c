"""Per-token statistics of logged completions, for the token-level view (`python -m ict_jax.analyze`).

At the steps it checkpoints, the trainer runs `TokenView` on the first groups of the step's rollout
with the parameters the step starts from (the policy that sampled them), and writes one line per
completion to `<workdir>/tokens/<step>.jsonl`, one object per step written whole (object stores
cannot append; a resumed run that logs a step again replaces it):

    {"step", "prompt", "gold", "reward", "advantage", "dense_warmup", "tokens": [str],
     "prob": [pi(y_t)], "entropy": [H_t], "js": [u_t], "selected": [bool], "stop": [bool],
     "post_answer": [bool]}

`js` is ICT's score with the configured reference and `selected` ICT's selection (top
`ict.top_fraction` of the response by the configured score and end; JS when the score is
"random"), both computed by the same functions as the train step on whole groups, so they are the
step's values. `stop` marks the stop token and `post_answer` the tokens after the final box
(`answer_positions`). `dense_warmup` marks steps inside ICT's dense warm-up, where every token trained.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ict_jax import answer_positions, lora, selection, sharding
from ict_jax.batch import TrainBatch

DIR = "tokens"  # <workdir>/tokens/<step:08d>.jsonl


class TokenView:
  """Jitted (params, rows) -> per-token arrays for `groups` whole groups of a rollout."""

  def __init__(self, graphdef, step_cfg, *, groups: int = 2, mesh=None):
    from ict_jax.train_step import completion_logp_and_stats

    self.cfg, self.groups, self.mesh = step_cfg, groups, mesh
    # ICT's selection whatever the run's method; JS ranks the tokens when the score is "random"
    score = step_cfg.ict.score if step_cfg.ict.score in ("js", "kl", "entropy") else "js"
    ict = dataclasses.replace(step_cfg.ict, method="ict", score=score)

    def fn(params, batch):
      model = lora.merge(graphdef, params)  # a LoRA model's adapters in the compute dtype
      logp, stats = completion_logp_and_stats(
          model,
          batch,
          temperature=step_cfg.temperature,
          group_size=step_cfg.group_size,
          chunk_size=ict.chunk_size,
          reference=ict.reference,
          kl=score == "kl",
      )
      mask = batch.completion_mask
      sel, _ = selection.select_tokens(ict, mask=mask, u=stats["js"], kl=stats.get("kl"), entropy=stats["entropy"])
      return {"prob": jnp.exp(logp) * mask, "entropy": stats["entropy"], "js": stats["js"], "selected": sel}

    if mesh is None:
      self._fn = jax.jit(fn)
    else:
      # Declared layouts, as the train step has: the few logged rows replicated (they need not
      # divide data x fsdp) and placed before the call, the parameters as they lie. Fed host
      # arrays with no declared sharding, this program now and then aborted on the suite's 8
      # simulated CPU devices (an XLA:CPU collective rendezvous that never completed).
      repl = sharding.replicated(mesh)
      self._fn = jax.jit(fn, in_shardings=(None, repl), out_shardings=repl)

  def __call__(self, params, batch: TrainBatch) -> dict[str, np.ndarray]:
    """-> per-token arrays [rows, C] of the first `groups` groups, and those rows' prompt and
    completion ids and masks, on the host. Every process calls it: the completion arrays may be
    global device arrays spanning several hosts (gathered here, a collective)."""
    from ict_jax.rollout import host_array

    rows = self.groups * self.cfg.group_size
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    sub = {k: host_array(getattr(batch, k))[:rows] for k in keys}
    view = TrainBatch(**sub, advantages=np.zeros(len(sub["completion_ids"]), np.float32))
    if self.mesh is None:
      out = self._fn(params, view)
    else:
      repl = sharding.replicated(self.mesh)
      inputs = jax.block_until_ready(jax.tree.map(lambda v: sharding.put_global(v, repl), view))
      with jax.set_mesh(self.mesh):
        out = self._fn(params, inputs)
    return {**sub, **{k: host_array(v) for k, v in out.items()}}


def records(
    step: int, view: dict[str, np.ndarray], tokenizer, golds, rewards, advantages, dense_warmup: bool
) -> list[dict[str, Any]]:
  """One JSON-able dict per completion row of `view` (`TokenView`'s output, which holds the rows'
  ids and masks). `golds`: row index -> gold answer (the rows this host scored; others get "");
  rewards, advantages [N] of the whole batch."""
  out = []
  c_ids, c_mask = np.asarray(view["completion_ids"]), np.asarray(view["completion_mask"])
  stop, post = answer_positions.token_masks(
      *answer_positions.positions(tokenizer, c_ids, c_mask, tokenizer.eos_ids), c_mask
  )
  for i in range(view["prob"].shape[0]):
    m = np.asarray(view["completion_mask"][i]).astype(bool)
    ids = np.asarray(view["completion_ids"][i])[m]
    prompt = np.asarray(view["prompt_ids"][i])[np.asarray(view["prompt_mask"][i]) != 0]
    out.append(
        {
            "step": step,
            "prompt": tokenizer.decode(prompt),
            "gold": str(golds.get(i, "")),
            "reward": float(rewards[i]),
            "advantage": float(advantages[i]),
            "dense_warmup": bool(dense_warmup),
            "tokens": tokenizer.decode_pieces(ids),
            **{k: [round(float(x), 6) for x in view[k][i][m]] for k in ("prob", "entropy", "js")},
            "selected": [bool(x) for x in view["selected"][i][m]],
            "stop": [bool(x) for x in stop[i][m]],
            "post_answer": [bool(x) for x in post[i][m]],
        }
    )
  return out


def write(workdir: str, step: int, rows: list[dict[str, Any]]) -> None:
  """The rows of `step` as one object, written whole."""
  from etils import epath

  folder = epath.Path(workdir) / DIR
  folder.mkdir(parents=True, exist_ok=True)
  (folder / f"{step:08d}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def load(workdir: str, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
  """The rows of `step` (default: the latest step logged) -> (step, rows)."""
  from etils import epath

  folder = epath.Path(workdir) / DIR
  steps = sorted(int(f.name.split(".")[0]) for f in folder.glob("*.jsonl")) if folder.exists() else []
  if not steps:
    raise FileNotFoundError(f"{folder}: no token statistics (the trainer writes them at checkpoint " "steps)")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise KeyError(f"no token statistics for step {step}; steps with them: {steps}")
  rows = [json.loads(line) for line in (folder / f"{step:08d}.jsonl").read_text().splitlines() if line.strip()]
  if not rows:
    raise ValueError(f"{folder / f'{step:08d}.jsonl'} is empty")
  return step, rows
