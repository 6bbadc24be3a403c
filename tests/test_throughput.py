"""What a user watches: learning rate, model TFLOP/s per chip, MFU and tokens/s per chip in the
metrics (and so TensorBoard / W&B), a jax.profiler trace of chosen steps, the W&B logger."""

import math
import os
import sys
import threading
import types

import jax
import pytest

from ict_jax import configs
from ict_jax import logs, throughput
from ict_jax.checkpoint import Checkpointer
from ict_jax.config import ConfigError
from ict_jax.logs import read_log
from ict_jax.models.config import Qwen2Config
from ict_jax.train import train


@pytest.mark.parametrize(
    "kind,name,peak",
    [
        ("TPU v4", "TPU v4", 275),
        ("TPU v5 lite", "TPU v5e", 197),
        ("TPU v5", "TPU v5p", 459),
        ("TPU v5p", "TPU v5p", 459),
        ("TPU v6 lite", "TPU v6e", 918),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100", 989),
        ("NVIDIA H200", "NVIDIA H200", 989),
    ],
)
def test_peak_table(kind, name, peak):
  assert throughput.table_peak(kind) == (name, peak)


def test_cpu_peak_is_measured():
  assert throughput.table_peak("cpu") is None
  name, peak, source = throughput.chip_peak(jax.devices("cpu")[0])
  assert source == "measured" and name == "cpu" and 1e-4 < peak < 100  # TFLOP/s of a few cores


def test_step_metrics_arithmetic():
  mcfg = Qwen2Config.preset("tiny")
  t = throughput.Throughput(mcfg, num_chips=4, peak=("chip", 2.0, "table"))
  full = t.step_metrics(lengths=[32] * 8, executed=8 * 32, passes=2, step_s=0.5, tokens=100, iteration_s=2.0)
  flops = mcfg.flops_per_token(32) * 8 * 32 * 2  # no padding: every executed position is work
  assert full["model_tflops_per_chip"] == pytest.approx(flops / 0.5 / 4 / 1e12)
  assert full["mfu"] == pytest.approx(full["model_tflops_per_chip"] / 2.0)
  assert full["padded_fraction"] == 0.0
  assert full["tokens_per_s_per_chip"] == pytest.approx(100 / 2.0 / 4)
  # the same 8 x 32 positions executed, most rows shorter: only their own tokens are work, each
  # token's attention over its own row
  lengths = [32, 20, 12, 5, 32, 7, 9, 16]
  m = t.step_metrics(lengths=lengths, executed=8 * 32, passes=2, step_s=0.5, tokens=100, iteration_s=2.0)
  real = sum(mcfg.flops_per_token(n) * n for n in lengths) * 2
  assert m["mfu"] == pytest.approx(real / 0.5 / 4 / 1e12 / 2.0)
  assert m["padded_fraction"] == pytest.approx(1 - sum(lengths) / (8 * 32))


class _FakeWandb(types.ModuleType):

  def __init__(self):
    super().__init__("wandb")
    self.calls = []
    self.id = "fakeid01"  # the run's id, as wandb.init's run has it

  def init(self, **kw):
    self.calls.append(("init", kw))
    return self

  def define_metric(self, name, **kw):
    self.calls.append(("define_metric", name, kw))

  def log(self, data, step=None):
    assert step is None  # the training step is the metric "step": W&B's own _step only grows
    self.calls.append(("log", data["step"], dict(data)))

  def finish(self):
    self.calls.append(("finish",))


def _short(**overrides):
  c = configs.tiny_config()
  c.warm_start.sft_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 2
  c.train.steps = c.train.checkpoint_every = 2
  c.train.async_checkpointing = False
  c.optim.schedule = "linear"  # warm-up 0, then linearly to 0 over the 2 updates: lr, lr / 2
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  return c


def test_metrics_profile_and_wandb_of_a_run(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  workdir = str(tmp_path / "run")
  # a store that takes no log part until the logger is flushed or closed: the checkpoint save must
  # come after a flush, and find every step it covers in the log
  gate, write_whole, logged_at_save = threading.Event(), logs._write_whole, {}
  flush, close, save = logs.MetricsLogger.flush, logs.MetricsLogger.close, Checkpointer.save
  monkeypatch.setattr(
      logs, "_write_whole", lambda path, text: (path.suffix != ".jsonl" or gate.wait(), write_whole(path, text))
  )  # the log parts; config.json is written at start-up
  monkeypatch.setattr(logs.MetricsLogger, "flush", lambda self: (gate.set(), flush(self)))
  monkeypatch.setattr(logs.MetricsLogger, "close", lambda self: (gate.set(), close(self)))
  monkeypatch.setattr(
      Checkpointer,
      "save",
      lambda self, step, *a, **k: (
          logged_at_save.setdefault(step, read_log(workdir, "metrics")),
          save(self, step, *a, **k),
      )[1],
  )
  train(_short(**{"train.profile_steps": "2,2", "log.wandb_project": "ict-test"}), workdir, progress=False)
  assert [r["step"] for r in logged_at_save[2]] == [1, 2]  # flushed before the checkpoint of step 2
  rows = read_log(workdir, "metrics")
  lr = configs.tiny_config().optim.learning_rate
  assert [r["learning_rate"] for r in rows] == pytest.approx([lr, lr / 2])
  for r in rows:
    assert r["model_tflops_per_chip"] > 0 and 0 < r["mfu"] < 1
    assert 0 < r["padded_fraction"] < 1  # prompts and completions of several lengths, batched
    assert r["tokens_per_s_per_chip"] == pytest.approx(r["tokens_per_s"] / jax.device_count())
  traces = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces), traces
  assert fake.calls[0][0] == "init" and fake.calls[0][1]["project"] == "ict-test"
  assert fake.calls[0][1]["id"] is None and fake.calls[0][1]["resume"] == "allow"  # a new W&B run
  assert open(os.path.join(workdir, "wandb_run_id.txt")).read() == "fakeid01\n"
  assert ("define_metric", "*", {"step_metric": "step"}) in fake.calls
  logged = [c for c in fake.calls if c[0] == "log"]
  assert [c[1] for c in logged] == [1, 2]
  assert all(math.isfinite(c[2]["mfu"]) and "sample" not in c[2] for c in logged)
  assert fake.calls[-1] == ("finish",)


def test_wandb_missing_is_one_clear_error_before_anything_runs(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
  with pytest.raises(ConfigError, match="log.wandb_project.*pip install wandb"):
    train(_short(**{"log.wandb_project": "p"}), str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run" / "checkpoints")
