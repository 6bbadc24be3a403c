"""Run logs: `config.json`, `metrics.jsonl` (one object per step), TensorBoard, a progress bar.

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
    if not enabled:
      return
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
      (root / "config.json").write_text(json.dumps(config, indent=2))
    self.path = root / "metrics.jsonl"
    kept = []
    if self.path.exists():  # resume: keep the steps that the checkpoint covers
      for line in self.path.read_text().splitlines():
        try:
          if json.loads(line)["step"] <= initial:
            kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
          continue
    self.path.write_text("".join(line + "\n" for line in kept))
    self._file = self.path.open("a")
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.fspath(root / "tb"))
    except ImportError:  # optional
      self._tb = None
    if progress:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

  def write(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    step = record["step"]
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      self._bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}",
                            entropy=f"{record.get('entropy', float('nan')):.3f}", refresh=False)
      self._bar.update(1)

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()
