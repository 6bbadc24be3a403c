"""Run logs on an object store: a fake gs:// (fsspec's in-memory filesystem behind `epath`, with
append refused, as Cloud Storage refuses it) and on local disk."""

import json
import os
import subprocess
import sys
import threading

from fsspec.registry import _registry as fsspec_implementations
import pytest
from etils import epath
from etils.epath import backend
from fsspec.implementations.memory import MemoryFileSystem

from ict_jax import logs


class NoAppendFS(MemoryFileSystem):
  """An object store: objects are written whole, never appended to."""

  protocol = ("gs", "gcs")
  store: dict = {}  # its own objects, not the shared memory:// ones
  pseudo_dirs = [""]
  opened_modes: list = []

  def __init__(self, *args, finalize_on_close=None, **kwargs):
    super().__init__(*args, **kwargs)

  def _open(self, path, mode="rb", **kwargs):
    NoAppendFS.opened_modes.append(mode)
    if "a" in mode or "+" in mode:
      raise OSError(f"{path}: objects cannot be appended to (mode {mode!r})")
    return super()._open(path, mode, **kwargs)


@pytest.fixture
def gs(monkeypatch):
  """epath's gs:// paths on the append-refusing in-memory store, emptied for each test."""
  NoAppendFS.store, NoAppendFS.pseudo_dirs, NoAppendFS.opened_modes = {}, [""], []
  NoAppendFS.clear_instance_cache()
  for name in ("gs", "gcs"):  # fsspec's own table of loaded implementations, restored afterwards
    monkeypatch.setitem(fsspec_implementations, name, NoAppendFS)
  backend.fsspec_backend._get_filesystem.cache_clear()
  yield "gs://bucket/run"
  backend.fsspec_backend._get_filesystem.cache_clear()


def _run(workdir, steps, initial=0, **kw):
  logger = logs.MetricsLogger(workdir, progress=False, tensorboard=False, initial=initial, config={"x": 1})
  for step in steps:
    logger.write({"step": step, "loss": float(step)}, samples=[{"completion": f"c{step}.{i}"} for i in range(2)])
  logger.close()


def test_the_fake_store_refuses_appends(gs):
  path = epath.Path(gs) / "probe.txt"
  path.write_text("a")
  with pytest.raises(OSError, match="appended"):
    path.open("a")


def test_logs_on_an_object_store_resume_drops_lines_past_the_restored_step(gs):
  _run(gs, range(1, 6))
  assert [r["step"] for r in logs.read_log(gs, "metrics")] == [1, 2, 3, 4, 5]
  assert [r["completion"] for r in logs.read_log(gs, "samples")][:3] == ["c1.0", "c1.1", "c2.0"]
  # resumed from the checkpoint of step 3: steps 4 and 5 are run (and logged) again
  _run(gs, range(4, 8), initial=3)
  assert [r["step"] for r in logs.read_log(gs, "metrics")] == [1, 2, 3, 4, 5, 6, 7]
  assert [r["step"] for r in logs.read_log(gs, "samples")] == [s for s in range(1, 8) for _ in range(2)]
  assert not any("a" in m or "+" in m for m in NoAppendFS.opened_modes)
  assert json.loads((epath.Path(gs) / "config.json").read_text()) == {"x": 1}


def test_parts_are_bounded_and_a_resume_inside_a_part_truncates_it(gs):
  log = logs.JsonlLog(epath.Path(gs) / "metrics", 0, part_steps=3)
  for step in range(1, 9):
    log.write(step, [{"step": step}])
  names = sorted(p.name for p in (epath.Path(gs) / "metrics").iterdir())
  assert names == ["00000001.jsonl", "00000004.jsonl", "00000007.jsonl"]
  logs.JsonlLog(epath.Path(gs) / "metrics", 2, part_steps=3)  # resume at step 2
  assert [r["step"] for r in logs.read_log(gs, "metrics")] == [1, 2]
  assert sorted(p.name for p in (epath.Path(gs) / "metrics").iterdir()) == ["00000001.jsonl"]


def test_local_parts_concatenate_in_step_order(tmp_path):
  _run(str(tmp_path), range(1, 4))
  text = "".join(p.read_text() for p in sorted((tmp_path / "metrics").glob("*.jsonl")))
  assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3]
  assert not [p for p in (tmp_path / "metrics").iterdir() if p.name.startswith(".")]  # no temp files


class _BrokenWriter:
  """A SummaryWriter whose writes fail from step `fail_at` on (a lost connection to the bucket)."""

  def __init__(self, fail_at):
    self.fail_at, self.scalars, self.closed = fail_at, [], False

  def add_scalar(self, tag, value, step):
    if step >= self.fail_at:
      raise OSError("connection reset by peer")
    self.scalars.append((tag, step))

  def close(self):
    self.closed = True


@pytest.mark.parametrize("fail", ["open", "write"])
def test_a_tensorboard_failure_is_one_warning_and_the_logs_go_on(tmp_path, monkeypatch, caplog, fail):
  writer = _BrokenWriter(fail_at=3)

  def open_writer(logdir):
    if fail == "open":
      raise ImportError("`google-cloud-storage` must be installed in order to use the 'gs://' protocol")
    return writer

  monkeypatch.setattr(logs, "_summary_writer", open_writer)
  logger = logs.MetricsLogger(str(tmp_path), progress=False, initial=0)
  for step in range(1, 6):
    logger.write({"step": step, "loss": float(step)})
  logger.close()
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "TensorBoard" in r.getMessage()]
  expected = "google-cloud-storage" if fail == "open" else "connection reset by peer"
  assert len(warnings) == 1 and expected in warnings[0], warnings
  assert [r["step"] for r in logs.read_log(str(tmp_path))] == [1, 2, 3, 4, 5]
  if fail == "write":  # steps before the failure reached TensorBoard; nothing is called after it
    assert writer.scalars == [("loss", 1), ("loss", 2)] and not writer.closed


def _tree(root):
  """{relative path: text} of every file under `root`."""
  return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_writer_thread_writes_what_the_synchronous_writer_writes(tmp_path, monkeypatch):
  """Parts rewritten in the writer thread, off the caller's path: nothing reaches the store until
  the thread runs, then the files are byte for byte those of writing each part in the caller."""
  records = [
      ({"step": s, "loss": s / 3, "sample": f"x{s}"}, [{"completion": f"c{s}.{i}"} for i in range(2)])
      for s in range(1, 8)
  ]
  sync = tmp_path / "sync"
  metrics, samples = logs.JsonlLog(epath.Path(sync) / "metrics", 0, part_steps=3), logs.JsonlLog(
      epath.Path(sync) / "samples", 0, part_steps=3
  )
  for record, shown in records:
    metrics.write(record["step"], [record])
    samples.write(record["step"], [{"step": record["step"], **x} for x in shown])

  gate, real = threading.Event(), logs._write_whole
  monkeypatch.setattr(logs, "_write_whole", lambda path, text: (gate.wait(), real(path, text)))
  monkeypatch.setattr(logs, "PART_STEPS", 3)
  threaded = tmp_path / "threaded"
  logger = logs.MetricsLogger(str(threaded), progress=False, tensorboard=False)
  for record, shown in records:
    logger.write(record, samples=shown)
    record["loss"] = -1.0  # the caller's dicts may change once written: the lines are taken at write()
  assert logs.read_log(str(threaded)) == []  # queued, not yet written: the thread waits at the gate
  gate.set()
  logger.flush()
  assert [r["step"] for r in logs.read_log(str(threaded))] == list(range(1, 8))
  logger.close()
  assert _tree(threaded) == _tree(sync)


def test_close_and_interpreter_exit_flush_the_queue(tmp_path):
  """A slow store: whatever was written before `close` or before the interpreter exits (without
  close: an exception above the loop) is in the parts afterwards."""
  code = (
      "import sys, time\n"
      "from ict_jax import logs\n"
      "real = logs._write_whole\n"
      "logs._write_whole = lambda path, text: (time.sleep(0.05), real(path, text))\n"
      "logger = logs.MetricsLogger(sys.argv[1], progress=False, tensorboard=False)\n"
      "for step in range(1, 6):\n"
      "  logger.write({'step': step})\n"
      "if sys.argv[2] == 'close':\n"
      "  logger.close()\n"
      "else:\n"
      "  raise SystemExit(3)\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for how in ("close", "exit"):
    workdir = str(tmp_path / how)
    proc = subprocess.run(
        [sys.executable, "-c", code, workdir, how], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == (0 if how == "close" else 3), proc.stderr[-2000:]
    assert [r["step"] for r in logs.read_log(workdir)] == [1, 2, 3, 4, 5], how


def test_a_failed_write_is_raised_by_the_next_call(tmp_path, monkeypatch):
  logger = logs.MetricsLogger(str(tmp_path), progress=False, tensorboard=False)

  def broken(path, text):
    raise OSError("bucket gone")

  monkeypatch.setattr(logs, "_write_whole", broken)
  logger.write({"step": 1})
  with pytest.raises(OSError, match="bucket gone"):
    logger.flush()
  logger.close()
