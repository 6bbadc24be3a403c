"""Run logs: `config.json`, the `metrics` log (one JSON object per step), the `samples` log (a
few prompts/completions/rewards per step), TensorBoard, a progress bar, and Weights & Biases when
`log.wandb_project` is set.

Object stores (gs://, s3://) cannot append to an object, so a log is a folder of parts,
``<workdir>/metrics/<first step, 8 digits>.jsonl``, each part rewritten whole at every write and
closed after `PART_STEPS` steps or `PART_BYTES` bytes (so a rewrite stays small). Parts are named
by their first step: ``cat <workdir>/metrics/*.jsonl`` is the log in step order, and
`read_log(workdir, "metrics")` reads it from any path `epath` knows.

Only process 0 writes (`enabled`). On resume at step `initial`, parts starting after it are
deleted and lines past it are dropped from the last part left, so the log stays one line per step.

The parts are written off the step's path: `MetricsLogger.write` turns the records into lines and
queues the part rewrites for one writer thread (in order), so a slow object store never holds up
the next step. `flush` waits until every queued write is done; the trainer calls it before each
checkpoint save (a resume keeps the lines up to the checkpoint's step, so they must be stored
first), and `close` (also run at interpreter exit) flushes. A failed write is raised by the next
`write`, `flush` or `close`.

Weights & Biases (process 0 only): the run's W&B id is kept in ``<workdir>/wandb_run_id.txt``
(made at the first start, read through `epath` like the other workdir files), and every start
calls ``wandb.init(id=..., resume="allow")``, so a run restarted after a preemption continues the
same W&B run. The W&B x-axis is the training step, logged as the metric ``step``
(``define_metric("*", step_metric="step")``) rather than as ``wandb.log(step=...)``: W&B's own
``_step`` must only grow, and a resume from the checkpoint of step k logs steps k+1, ... again
when the lost attempt had logged past k (W&B keeps those points too: it cannot delete them, the
metrics log drops them).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import threading
from typing import Any, Callable

from etils import epath

from ict_jax import health

PART_STEPS = 100
PART_BYTES = 1 << 20
_PART = re.compile(r"^(\d+)\.jsonl$")
log = logging.getLogger(__name__)


def _write_whole(path: epath.Path, text: str) -> None:
  """Replace `path` with `text`: one object PUT on object stores; locally a write to a temporary
  file then a rename, so a process killed mid-write leaves the previous version, not half a file."""
  if "://" in os.fspath(path):
    path.write_text(text)
    return
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  tmp.write_text(text)
  os.replace(os.fspath(tmp), os.fspath(path))


def _parts(folder: epath.Path) -> list[tuple[int, epath.Path]]:
  if not folder.exists():
    return []
  found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _PART.match(p.name))]
  return sorted(found, key=lambda fp: fp[0])


def _step_of(line: str) -> int | None:
  try:
    return int(json.loads(line)["step"])
  except (json.JSONDecodeError, KeyError, TypeError, ValueError):
    return None  # a damaged line is dropped


def read_log(workdir: str | os.PathLike, name: str = "metrics") -> list[dict]:
  """Every record of log `name` ("metrics" or "samples") of a workdir, in step order."""
  from ict_jax import storage

  storage.check_backend(workdir, "read_log")  # gs:// without gcsfs: the package named, not a traceback
  rows = []
  for _, part in _parts(epath.Path(workdir) / name):
    for line in part.read_text().splitlines():
      if _step_of(line) is not None:
        rows.append(json.loads(line))
  return rows


class JsonlLog:
  """One log of a run: records go to the current part, which is rewritten whole each `write`."""

  def __init__(self, folder: epath.Path, initial: int, *, part_steps: int | None = None, part_bytes: int | None = None):
    self.folder = folder
    self.part_steps, self.part_bytes = part_steps or PART_STEPS, part_bytes or PART_BYTES
    folder.mkdir(parents=True, exist_ok=True)
    for first, part in _parts(folder):  # resume: nothing past step `initial` survives
      if first > initial:
        part.unlink()
        continue
      lines = part.read_text().splitlines()
      kept = [line for line in lines if (s := _step_of(line)) is not None and s <= initial]
      if kept != lines:
        _write_whole(part, "".join(line + "\n" for line in kept))
    self._first: int | None = None  # the current part's first step
    self._lines: list[str] = []
    self._steps: set[int] = set()
    self._bytes = 0

  def write(self, step: int, records: list[dict]) -> None:
    self.append(step, [json.dumps(r) for r in records])

  def append(self, step: int, lines: list[str]) -> None:
    """`write` of records already encoded (one JSON object a line)."""
    if not lines:
      return
    if self._first is not None and (len(self._steps | {step}) > self.part_steps or self._bytes >= self.part_bytes):
      self._first, self._lines, self._steps, self._bytes = None, [], set(), 0
    if self._first is None:
      self._first = step
    self._lines += lines
    self._steps.add(step)
    self._bytes += sum(len(line) + 1 for line in lines)
    _write_whole(self.folder / f"{self._first:08d}.jsonl", "".join(line + "\n" for line in self._lines))


class _Writer:
  """One background thread running queued jobs in order (the log parts' rewrites)."""

  def __init__(self):
    self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="ict_jax-logs", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while True:
      job = self._queue.get()
      try:
        if job is None:
          return
        job()
      except BaseException as e:  # pylint: disable=broad-except  # raised in the caller's thread
        self._error = self._error or e
      finally:
        self._queue.task_done()

  def _raise(self) -> None:
    error, self._error = self._error, None
    if error is not None:
      raise error

  def put(self, job: Callable[[], None]) -> None:
    self._raise()
    self._queue.put(job)

  def flush(self) -> None:
    self._queue.join()
    self._raise()

  def close(self) -> None:
    if self._thread.is_alive():
      self._queue.put(None)
      self._thread.join()
    self._raise()


def _summary_writer(logdir: str):
  """tensorboardX's writer; it writes gs:// itself through google-cloud-storage (requirements.txt)."""
  from tensorboardX import SummaryWriter

  return SummaryWriter(logdir)


WANDB_ID_FILE = "wandb_run_id.txt"
_WANDB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # W&B refuses / \ # ? % : in an id


def read_wandb_run_id(workdir: str | os.PathLike) -> str | None:
  """The W&B run id kept in the workdir, or None before the first start; a damaged file is one
  ConfigError naming it (checked at start-up, before anything compiles)."""
  from ict_jax.errors import ConfigError

  path = epath.Path(workdir) / WANDB_ID_FILE
  if not path.exists():
    return None
  run_id = path.read_text().strip()
  if not _WANDB_ID.match(run_id):
    raise ConfigError(
        f"{path}: {run_id[:80]!r} is not a W&B run id (1-64 letters, digits, '-' or '_'); "
        "write the id of the W&B run to continue, or delete the file to start a new W&B run"
    )
  return run_id


def import_wandb():
  """The `wandb` module, or one ConfigError saying how to get it (imported only when asked for)."""
  from ict_jax.errors import ConfigError

  try:
    import wandb
  except ImportError:
    raise ConfigError(
        "config.log.wandb_project is set but the wandb package is not installed: "
        "pip install wandb (or leave log.wandb_project empty; launch/tpu_pod.sh installs it with --wandb, "
        "launch/gpu_slurm.sbatch with INSTALL_WANDB=1)"
    ) from None
  return wandb


def _numbers(record: dict[str, Any]):
  return {
      k: v
      for k, v in record.items()
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  }


WANDB_STEP = "step"  # the W&B metric every other one is plotted against


def _wandb_run(root: epath.Path, project: str, config: dict | None):
  """The workdir's W&B run: the one of the id kept there, else a new one whose id (W&B's, or
  WANDB_RUN_ID) is kept there at once; the training step is the x-axis of every metric."""
  wandb = import_wandb()
  kept = read_wandb_run_id(root)
  run = wandb.init(
      project=project,
      id=kept,
      resume="allow",  # the id's run when W&B has it, else a new run with that id
      config=config,
      name=os.path.basename(os.fspath(root).rstrip("/")) or None,
  )
  if kept is None:
    _write_whole(root / WANDB_ID_FILE, run.id + "\n")
  run.define_metric(WANDB_STEP)
  run.define_metric("*", step_metric=WANDB_STEP)
  return run


class MetricsLogger:

  def __init__(
      self,
      workdir: str,
      *,
      enabled: bool = True,
      progress: bool = True,
      total: int = 0,
      initial: int = 0,
      config: dict | None = None,
      tensorboard: bool = True,
      wandb_project: str = "",
  ):
    self.enabled = enabled
    self._bar = self._tb = self._wandb = self._writer = None
    self._eval: dict[str, str] = {}
    if not enabled:
      return
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    if wandb_project:
      self._wandb = _wandb_run(root, wandb_project, config)
    if config is not None:
      _write_whole(root / "config.json", json.dumps(config, indent=2))
    self._metrics = JsonlLog(root / "metrics", initial)
    self._samples = JsonlLog(root / "samples", initial)
    self._writer = _Writer()
    atexit.register(self.flush)  # an exit without close() (e.g. an exception above the loop)
    if tensorboard:
      self._tb = self._tensorboard(lambda: _summary_writer(os.fspath(root / "tb")), "open")
    if progress:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

  def _tensorboard(self, action, what: str):
    """Run a TensorBoard call; a failure is one warning and TensorBoard is off for the rest of the
    run (the metrics log has every number): the run never ends over its events file."""
    try:
      return action()
    except Exception as e:  # pylint: disable=broad-except  # ImportError, OSError, the cloud client's errors
      log.warning(
          "TensorBoard: %s failed, continuing without events (the metrics log has every number): %s: %s",
          what,
          type(e).__name__,
          str(e).splitlines()[0][:300] if str(e) else "",
      )
      self._tb = None
      return None

  def write(self, record: dict[str, Any], samples: list[dict] | None = None) -> None:
    if not self.enabled:
      return
    step = record["step"]
    lines = [json.dumps(record)]  # encoded now: later changes to the dicts do not reach the log
    sample_lines = [json.dumps({"step": step, **sample}) for sample in samples or ()]
    self._writer.put(lambda: (self._metrics.append(step, lines), self._samples.append(step, sample_lines)))
    numbers = _numbers(record)
    if self._tb is not None:
      self._tensorboard(lambda: [self._tb.add_scalar(k, v, step) for k, v in numbers.items()], "write")
    if self._wandb is not None:
      self._wandb.log({WANDB_STEP: step, **numbers})  # no step=: see the module docstring
    if self._bar is not None:
      nan = float("nan")
      self._eval = {
          k[len("eval_") :].replace("_at_", "@"): f"{v:.3f}" for k, v in record.items() if k.startswith("eval_pass_at_")
      } or self._eval  # the latest evaluation
      note = {"note": health.NO_TOKENS} if health.no_tokens_trained(record) else {}
      self._bar.set_postfix(
          **note,
          reward=f"{record.get('reward_mean', nan):.3f}",
          entropy=f"{record.get('entropy', nan):.3f}",
          lr=f"{record.get('learning_rate', nan):.2e}",
          tok_s_chip=f"{record.get('tokens_per_s_per_chip', nan):.0f}",
          mfu=f"{100 * record.get('mfu', nan):.1f}%",
          **self._eval,
          refresh=False,
      )
      self._bar.update(1)

  def flush(self) -> None:
    """Wait until every record written so far is in its log part (raises a failed write)."""
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if not self.enabled:
      return
    atexit.unregister(self.flush)
    writer, self._writer = self._writer, None
    try:
      if writer is not None:
        writer.close()
    finally:
      if self._tb is not None:
        self._tensorboard(self._tb.close, "close")
      if self._wandb is not None:
        self._wandb.finish()
      if self._bar is not None:
        self._bar.close()
