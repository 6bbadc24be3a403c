"""Run logs: `config.json`, `metrics.jsonl` (one object per step), `samples.jsonl` (a few
prompts/completions/rewards per step), TensorBoard, a progress bar.

Only process 0 writes (`enabled`). On resume, metric lines past the restored step are dropped
so the file stays one line per step.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from etils import epath


class MetricsLogger:

  def __init__(self, workdir: str, *, enabled: bool = True, progress: bool = True, total: int = 0,
               initial: int = 0, config: dict | None = None):
    self.enabled = enabled
    self._bar = self._tb = None
    self._eval: dict[str, str] = {}
    if not enabled:
      return
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
      (root / "config.json").write_text(json.dumps(config, indent=2))
    self.path = root / "metrics.jsonl"
    self._file = _reopen(self.path, initial)
    self._samples = _reopen(root / "samples.jsonl", initial)
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.fspath(root / "tb"))
    except ImportError:  # optional
      self._tb = None
    if progress:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

  def write(self, record: dict[str, Any], samples: list[dict] | None = None) -> None:
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for sample in samples or ():
      self._samples.write(json.dumps({"step": record["step"], **sample}) + "\n")
    self._samples.flush()
    step = record["step"]
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      self._eval = {k[len("eval_"):].replace("_at_", "@"): f"{v:.3f}" for k, v in record.items()
                    if k.startswith("eval_pass_at_")} or self._eval  # the latest evaluation
      self._bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}",
                            entropy=f"{record.get('entropy', float('nan')):.3f}", **self._eval,
                            refresh=False)
      self._bar.update(1)

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    self._samples.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


def _reopen(path: epath.Path, initial: int):
  """Open a JSONL log for appending, first dropping lines past step `initial` (resume)."""
  kept = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        if json.loads(line)["step"] <= initial:
          kept.append(line)
      except (json.JSONDecodeError, KeyError, TypeError):
        continue
  path.write_text("".join(line + "\n" for line in kept))
  return path.open("a")
