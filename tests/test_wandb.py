"""Weights & Biases with the real `wandb` package in offline mode (nothing reaches the network):
a run's steps in W&B's own history, one W&B run across a restart (its id kept in the workdir),
and W&B started by process 0 only. The offline runs are read back from the `.wandb` files W&B
writes (LevelDB's log format of `wandb.proto` Records), the format `wandb sync` uploads."""

from __future__ import annotations

import json
import re
import struct
import types
from pathlib import Path

import pytest
import wandb  # requirements-dev.txt
from etils import epath
from wandb.proto import wandb_internal_pb2

from ict_jax import config as config_lib, configs, logs, run_hooks, sharding
from ict_jax.config import ConfigError
from ict_jax.train import train
from test_logs import NoAppendFS, gs  # noqa: F401  pylint: disable=unused-import  # the fixture

BLOCK = 32768  # LevelDB log blocks; each chunk: crc32c (4), length (2), type (1), then the bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path):
  """Every Record of a `.wandb` file: the header `:W&B`, 0xBEE1, version 0, then LevelDB log chunks."""
  data = path.read_bytes()
  assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), path
  pos, pending = 7, b""
  while pos + 7 <= len(data):
    left = BLOCK - pos % BLOCK
    if left < 7:  # a block's tail too short for a chunk header is padding
      pos += left
      continue
    _, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
    chunk, pos = data[pos + 7 : pos + 7 + size], pos + 7 + size
    pending = chunk if kind in (FULL, FIRST) else pending + chunk
    if kind in (FULL, LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record


def _offline_runs(wandb_dir: Path) -> list[dict]:
  """The offline runs under WANDB_DIR in start order: id, run record, metric definitions, history rows."""
  wandb.teardown()  # finish() can return before W&B's service has closed an offline run's file
  runs = []
  for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
    (file,) = folder.glob("run-*.wandb")
    out = {"folder": folder.name, "history": [], "metrics": []}
    for r in _records(file):
      kind = r.WhichOneof("record_type")
      if kind == "run":
        out["run"] = r.run
      elif kind == "metric":
        out["metrics"].append(r.metric)
      elif kind == "history":
        out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    runs.append(out)
  return runs


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """W&B offline, writing under tmp_path; a server address nothing listens on, so any request
  that offline mode still made would fail at once instead of reaching the internet."""
  wandb_dir = tmp_path / "wandb_dir"
  wandb_dir.mkdir()
  for key in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONSOLE", "off")
  wandb.teardown()  # W&B reads its environment once a process: start again from this one
  yield wandb_dir
  wandb.teardown()


def _short(**overrides):
  c = configs.tiny_config()
  c.warm_start.sft_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 2
  c.train.steps = c.train.checkpoint_every = 2
  c.train.async_checkpointing = False
  c.log.wandb_project = "ict-test"
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  return c


def _same_numbers(history_row: dict, metrics_row: dict) -> None:
  """A W&B history row holds the metrics log's numbers of that step (the log is the reference)."""
  shared = [k for k, v in metrics_row.items() if isinstance(v, float) and k in history_row]
  assert {"loss", "reward_mean", "learning_rate"} <= set(shared), sorted(history_row)
  for k in shared:
    assert history_row[k] == pytest.approx(metrics_row[k], rel=1e-6), k


def test_a_run_and_its_restart_log_to_one_wandb_run(tmp_path, offline):
  workdir = str(tmp_path / "run")
  train(_short(), workdir, progress=False)
  run_id = (Path(workdir) / logs.WANDB_ID_FILE).read_text().strip()
  assert re.fullmatch(r"[a-z0-9]{8}", run_id), run_id  # W&B's own generate_id
  (first,) = _offline_runs(offline)
  assert first["folder"].endswith(f"-{run_id}") and first["run"].run_id == run_id
  assert first["run"].project == "ict-test" and first["run"].display_name == "run"
  assert first["run"].resume  # resume="allow": `wandb sync` continues the run of that id
  config = {u.key: json.loads(u.value_json) for u in first["run"].config.update}
  assert config["train"]["steps"] == 2 and config["log"]["wandb_project"] == "ict-test"
  # every metric is plotted against the training step, not W&B's own _step
  assert any(m.glob_name == "*" and m.step_metric == logs.WANDB_STEP for m in first["metrics"])
  metrics = logs.read_log(workdir, "metrics")
  assert [h["step"] for h in first["history"]] == [r["step"] for r in metrics] == [1, 2]
  for h, m in zip(first["history"], metrics):
    _same_numbers(h, m)

  # the restart (one more step, resumed from the checkpoint of step 2): the same W&B run
  train(_short(**{"train.steps": 3}), workdir, progress=False)
  assert (Path(workdir) / logs.WANDB_ID_FILE).read_text().strip() == run_id
  first_again, second = _offline_runs(offline)
  assert first_again["folder"] == first["folder"]
  assert second["folder"].endswith(f"-{run_id}") and second["run"].run_id == run_id and second["run"].resume
  metrics = logs.read_log(workdir, "metrics")
  assert [r["step"] for r in metrics] == [1, 2, 3]  # resumed, not restarted
  assert [h["step"] for h in second["history"]] == [3]
  _same_numbers(second["history"][0], metrics[2])
  assert second["history"][0]["_step"] == 0  # W&B's own counter: never told a step, never refuses one


def _hook_start(workdir: str):
  """LoggingHook's start as the learner runs it, on a run of `_short()`."""
  hook = run_hooks.LoggingHook(
      types.SimpleNamespace(cfg=config_lib.validate(_short()), workdir=workdir), progress=False
  )
  hook.on_run_start(types.SimpleNamespace(start_step=0))
  return hook


def test_only_process_0_starts_wandb(tmp_path, offline, monkeypatch):
  """Every process of a pod runs the same hooks: one with a process index other than 0 starts no
  W&B run and leaves the workdir's id alone; process 0 starts the workdir's run."""
  workdir = tmp_path / "run"
  monkeypatch.setattr(sharding.jax, "process_index", lambda *a: 1)
  assert not sharding.is_main_process()
  hook = _hook_start(str(workdir))
  hook.logger.write({"step": 1, "loss": 0.5})
  hook.on_run_end(None)
  assert wandb.run is None and not (offline / "wandb").exists()
  assert not (workdir / logs.WANDB_ID_FILE).exists() and logs.read_log(str(workdir)) == []

  monkeypatch.setattr(sharding.jax, "process_index", lambda *a: 0)
  hook = _hook_start(str(workdir))
  assert wandb.run is not None
  hook.logger.write({"step": 1, "loss": 0.5})
  hook.on_run_end(None)
  (only,) = _offline_runs(offline)
  assert only["run"].run_id == (workdir / logs.WANDB_ID_FILE).read_text().strip()
  assert [(h["step"], h["loss"]) for h in only["history"]] == [(1, 0.5)]


def test_a_logger_resumed_behind_what_wandb_has_logs_every_step(tmp_path, offline):
  """A crash after step 5 with the last checkpoint at step 3: the restart logs steps 4-6 again,
  to the same W&B run; W&B's own _step is never given (it would refuse 4 < 5), the training step
  is the metric `step`."""
  workdir = str(tmp_path / "run")
  for initial, steps in ((0, range(1, 6)), (3, range(4, 7))):
    logger = logs.MetricsLogger(workdir, progress=False, tensorboard=False, initial=initial, wandb_project="p")
    for step in steps:
      logger.write({"step": step, "loss": float(step)})
    logger.close()
  first, second = _offline_runs(offline)
  assert first["run"].run_id == second["run"].run_id == (Path(workdir) / logs.WANDB_ID_FILE).read_text().strip()
  assert [(h["step"], h["loss"]) for h in second["history"]] == [(4, 4.0), (5, 5.0), (6, 6.0)]
  assert [r["step"] for r in logs.read_log(workdir)] == [1, 2, 3, 4, 5, 6]  # the log drops the lost 4, 5


def test_the_run_id_is_kept_in_a_bucket_workdir(gs, offline):
  """A gs:// workdir (an object store that refuses appends, tests/test_logs.py): the id is one
  object there, and the restarted logger continues the W&B run it names."""
  for initial, step in ((0, 1), (1, 2)):
    logger = logs.MetricsLogger(gs, progress=False, tensorboard=False, initial=initial, wandb_project="p")
    logger.write({"step": step, "loss": 0.25 * step})
    logger.close()
  run_id = (epath.Path(gs) / logs.WANDB_ID_FILE).read_text().strip()
  first, second = _offline_runs(offline)
  assert first["run"].run_id == second["run"].run_id == run_id and first["run"].display_name == "run"
  assert [h["loss"] for h in first["history"] + second["history"]] == [0.25, 0.5]
  assert not any("a" in m or "+" in m for m in NoAppendFS.opened_modes)


@pytest.mark.parametrize("text", ["", "has/slash", "x" * 65])
def test_a_damaged_run_id_is_one_error_before_anything_runs(tmp_path, offline, text):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / logs.WANDB_ID_FILE).write_text(text)
  with pytest.raises(ConfigError, match=r"wandb_run_id\.txt: .* is not a W&B run id"):
    train(_short(), str(workdir), progress=False)
  assert not (workdir / "checkpoints").exists() and not (offline / "wandb").exists()
