"""Non-finite values: NaN advantages (-> NaN gradients) at one step and +inf activations feeding the
LM head (-> non-finite logits) at another. Both updates are skipped and counted, the parameters stay
unchanged at those steps and finite throughout, training goes on.

The faults are injected in a child process (`python -m benchmarks.faults.nonfinite`, its arguments
in $ICT_FAULTS_CHILD) that patches `ict_jax.train.collect`, `train_step.completion_logp_and_stats`
and `train_step.make_train_step` before calling `train()` in-process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.faults.harness import Run, row
from benchmarks.faults.registry import Context, scenario


def _nonfinite_child(workdir: str, steps: int, nan_step: int, inf_step: int) -> None:
  """Runs in a subprocess: train() with NaN advantages at `nan_step` and +inf activations before
  the LM head at `inf_step` (1-based), recording per step whether the parameters changed."""
  import jax
  import numpy as np

  import ict_jax.train as tr
  import ict_jax.train_step as ts
  from ict_jax import config as config_lib

  calls, record = [0], []
  collect, logp_and_stats, make_step = tr.collect, ts.completion_logp_and_stats, ts.make_train_step

  def faulty_collect(*a, **kw):
    roll = collect(*a, **kw)
    calls[0] += 1
    step, batch = calls[0], roll.batch

    def with_faults():
      b = batch()
      b["logit_fault"] = np.full(len(b["advantages"]), np.inf if step == inf_step else 0.0, np.float32)
      if step == nan_step:
        b["advantages"] = np.full_like(b["advantages"], np.nan)
      return b

    roll.batch = with_faults
    return roll

  class FaultyModel:  # hidden states + fault[:, None, None] -> non-finite logits on that step

    def __init__(self, model, fault):
      self.model, self.fault, self.cfg = model, fault, model.cfg

    def hidden_states(self, ids, mask):
      return self.model.hidden_states(ids, mask) + self.fault[:, None, None]

    def head_weight(self):
      return self.model.head_weight()

  def faulty_logp_and_stats(model, batch, **kw):
    if "logit_fault" in batch:
      model = FaultyModel(model, batch["logit_fault"])
    return logp_and_stats(model, batch, **kw)

  def watched_step(*a, **kw):
    fn = make_step(*a, **kw)

    def step(state, batch, ref_params=None):
      before = jax.device_get(state.params)
      out = fn(state, batch, ref_params)
      after = jax.device_get(out[0].params)
      pairs = list(zip(jax.tree.leaves(before), jax.tree.leaves(after)))
      record.append(
          {
              "delta": float(max(np.abs(b - a).max() for a, b in pairs)),
              "finite": bool(all(np.isfinite(b).all() for _, b in pairs)),
          }
      )
      return out

    return step

  tr.collect, ts.completion_logp_and_stats, ts.make_train_step = (faulty_collect, faulty_logp_and_stats, watched_step)
  c = config_lib.tiny_config()
  c.warm_start.sft_steps, c.rollout.prompts_per_step, c.rollout.group_size = 20, 4, 4
  c.train.steps, c.train.checkpoint_every, c.mesh.fsdp = steps, steps, 1
  history = tr.train(c, workdir, progress=False)
  out = [
      {k: h[k] for k in ("step", "loss", "grad_norm", "skipped", "total_skipped")} | p for h, p in zip(history, record)
  ]
  Path(workdir, "nonfinite.json").write_text(json.dumps(out))


def nonfinite(root, *, steps=7, nan_step=3, inf_step=5) -> dict:
  root = Path(root)
  workdir = root / "nonfinite"
  r = Run(
      workdir,
      [],
      root / "logs",
      name="nonfinite",
      module="benchmarks.faults.nonfinite",
      extra_env={"ICT_FAULTS_CHILD": json.dumps(["nonfinite", str(workdir), steps, nan_step, inf_step])},
  )
  rc = r.wait()
  if rc != 0:
    return row("non-finite logits / gradients", "", "", f"child failed (exit {rc}): {r.stderr()[-300:]}", False)
  rec = json.loads((workdir / "nonfinite.json").read_text())
  faults = {nan_step, inf_step}
  skipped = [int(x["skipped"]) for x in rec]
  ok = (
      len(rec) == steps
      and skipped == [int(x["step"] in faults) for x in rec]
      and int(rec[-1]["total_skipped"]) == len(faults)
      and all(x["delta"] == 0.0 for x in rec if x["step"] in faults)
      and all(x["finite"] for x in rec)
      and all(x["loss"] == x["loss"] and abs(x["loss"]) != float("inf") for x in rec if x["step"] not in faults)
      and any(x["delta"] > 0 for x in rec if x["step"] > max(faults))
  )
  return row(
      "non-finite logits / gradients",
      f"NaN advantages at step {nan_step} (NaN grads), +inf activations into the LM head at step {inf_step} "
      f"(non-finite logits), {steps} steps in-process",
      "update skipped and counted (skipped, total_skipped), params unchanged there and finite, training continues",
      f"skipped per step {skipped}, total_skipped {int(rec[-1]['total_skipped'])}; loss at faults "
      f"{[rec[s - 1]['loss'] for s in sorted(faults)]}; param change at faults "
      f"{[rec[s - 1]['delta'] for s in sorted(faults)]}, after {max(rec[s]['delta'] for s in range(max(faults), steps)):.2g}; "
      f"params finite at every step: {all(x['finite'] for x in rec)}",
      ok,
      steps=rec,
  )


@scenario("nonfinite")
def _run(ctx: Context) -> dict:
  return nonfinite(ctx.root)


def _child() -> None:
  kind, *rest = json.loads(os.environ["ICT_FAULTS_CHILD"])
  if kind == "nonfinite":
    workdir, steps, nan_step, inf_step = rest
    _nonfinite_child(workdir, int(steps), int(nan_step), int(inf_step))


if __name__ == "__main__":
  _child()
