"""Non-finite values: NaN advantages (-> NaN gradients) at one step and +inf activations feeding the
LM head (-> non-finite logits) at another. Both updates are skipped and counted, the parameters stay
unchanged at those steps and finite throughout, training goes on.

The faults are injected in a child process (`python -m benchmarks.faults.nonfinite`, its arguments
in $ICT_FAULTS_CHILD) through the trainer's seams: `train(..., hooks=[FaultHook(...)])`, whose
`on_batch` hands the update a faulty `TrainBatch`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.faults.harness import Run, row
from ict_jax.hooks import Hook
from benchmarks.faults.registry import Context, scenario


class FaultHook(Hook):
  """NaN advantages at step `nan_step`, +inf added to the final hidden states (the LM head's input,
  `TrainBatch.hidden_offset`) at `inf_step` (1-based), both through `on_batch`; the parameters'
  largest change and finiteness recorded around each update."""

  def __init__(self, nan_step: int, inf_step: int):
    self.nan_step, self.inf_step, self.before, self.record = nan_step, inf_step, None, []

  def on_batch(self, learner, step, rollout, batch):
    import numpy as np

    step += 1  # 1-based, as the metrics' "step"
    offset = np.full(batch.rows, np.inf if step == self.inf_step else 0.0, np.float32)  # one program
    batch = batch.replace(hidden_offset=offset)
    if step == self.nan_step:
      batch = batch.replace(advantages=np.full_like(np.asarray(batch.advantages), np.nan))
    return batch

  def on_update_start(self, learner, step):
    import jax

    self.before = jax.device_get(learner.state.params)  # before the step donates them

  def on_step_end(self, learner, step, metrics):
    import jax
    import numpy as np

    pairs = list(zip(jax.tree.leaves(self.before), jax.tree.leaves(jax.device_get(learner.state.params))))
    self.record.append(
        {
            "delta": float(max(np.abs(b - a).max() for a, b in pairs)),
            "finite": bool(all(np.isfinite(b).all() for _, b in pairs)),
        }
    )


def _nonfinite_child(workdir: str, steps: int, nan_step: int, inf_step: int) -> None:
  """Runs in a subprocess: train() with `FaultHook`, recording per step whether the parameters changed."""
  from ict_jax import configs
  from ict_jax.train import train

  c = configs.tiny_config()
  c.warm_start.sft_steps, c.rollout.prompts_per_step, c.rollout.group_size = 20, 4, 4
  c.train.steps, c.train.checkpoint_every, c.mesh.fsdp = steps, steps, 1
  faults = FaultHook(nan_step, inf_step)
  history = train(c, workdir, progress=False, hooks=[faults])
  out = [
      {k: h[k] for k in ("step", "loss", "grad_norm", "skipped", "total_skipped")} | p
      for h, p in zip(history, faults.record)
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
