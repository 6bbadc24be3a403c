"""The learner's hooks (ict_jax/hooks.py): README's example runs and sees every step's metrics, the
call points come in their documented order, a metric a hook adds is logged, and a hook that stops
the run leaves a checkpoint the next run resumes from without losing a step."""

import re
from pathlib import Path

import pytest

from ict_jax import configs
from ict_jax.hooks import Hook
from ict_jax.logs import read_log
from ict_jax.train import train

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_example() -> str:
  text = README.read_text()
  marker = text.index("<!-- hook-example: tests/test_hooks.py runs this block -->")
  block = re.search(r"```python\n(.*?)```", text[marker:], re.S)
  assert block is not None, "README: no python block after the hook-example marker"
  return block.group(1)


def test_readme_hook_example_sees_every_steps_metrics(tmp_path, capsys):
  code = _readme_example()
  assert '"runs/hooked"' in code and "hooks=[hook]" in code
  workdir = tmp_path / "hooked"
  scope: dict = {}
  exec(compile(code.replace('"runs/hooked"', repr(str(workdir))), "README.md", "exec"), scope)  # pylint: disable=exec-used
  rewards = scope["hook"].rewards
  logged = read_log(workdir)
  assert [s for s, _ in rewards] == list(range(1, 21)) == [r["step"] for r in logged]
  assert [r for _, r in rewards] == [r["reward_mean"] for r in logged]
  assert str(rewards[-1]) in capsys.readouterr().out


class Recorder(Hook):
  """Records every call; adds a metric; stops the run before step `stop_at` + 1 updates."""

  def __init__(self, stop_at=None, where="on_step_start"):
    self.calls, self.stop_at, self.where = [], stop_at, where

  def _stop(self, learner, step, where):
    if where == self.where and step == self.stop_at:
      learner.request_stop(f": test stop at {step}")

  def on_run_start(self, learner):
    self.calls.append(("run_start", learner.start_step))

  def on_step_start(self, learner, step):
    self.calls.append(("step_start", step))
    self._stop(learner, step, "on_step_start")

  def on_batch(self, learner, step, rollout, batch):
    self.calls.append(("batch", step))
    assert batch.rows == len(rollout.rewards) and batch.packed is None  # before packing
    return None

  def on_update_start(self, learner, step):
    self.calls.append(("update_start", step))
    self._stop(learner, step, "on_update_start")

  def on_step_end(self, learner, step, metrics):
    self.calls.append(("step_end", step))
    metrics["hook_metric"] = 10.0 * step

  def on_save(self, learner, step):
    self.calls.append(("save", step))

  def on_run_end(self, learner):
    self.calls.append(("run_end",))


def _quick(steps=4, every=2):
  c = configs.tiny_config()
  c.warm_start.sft_steps, c.train.eval_every = 10, 0
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
  c.train.steps, c.train.checkpoint_every = steps, every
  return c


@pytest.mark.parametrize("where", ["on_step_start", "on_update_start"])
def test_hook_order_added_metric_and_a_stop_that_resumes(tmp_path, where):
  workdir = str(tmp_path / "run")
  first = Recorder(stop_at=3, where=where)
  history = train(_quick(), workdir, progress=False, hooks=[first])
  assert [h["step"] for h in history] == [1, 2, 3]
  one = lambda s: [("step_start", s), ("batch", s), ("update_start", s), ("step_end", s + 1)]
  stopped = [("step_start", 3)] if where == "on_step_start" else [("step_start", 3), ("batch", 3), ("update_start", 3)]
  # steps 1..3, the checkpoint of step 2, the stop before step 4 updates (its checkpoint of step 3)
  assert first.calls == [
      ("run_start", 0),
      *one(0),
      *one(1),
      ("save", 2),
      *one(2),
      *stopped,
      ("save", 3),
      ("run_end",),
  ]
  second = Recorder()
  history = train(_quick(), workdir, progress=False, hooks=[second])
  assert second.calls[0] == ("run_start", 3) and [h["step"] for h in history] == [4]
  logged = read_log(workdir)
  assert [r["step"] for r in logged] == [1, 2, 3, 4]  # no step lost, none twice
  assert [r["hook_metric"] for r in logged] == [10.0, 20.0, 30.0, 40.0]  # a hook's metric is logged


def test_hooks_must_be_hooks(tmp_path):
  with pytest.raises(TypeError, match="ict_jax.hooks.Hook"):
    train(_quick(), str(tmp_path / "bad"), progress=False, hooks=[lambda *a: None])


def test_cli_hooks_flag(capsys):
  """`--hooks module:Name`: a Hook class or a function returning one; anything else is one line."""
  from ict_jax.train import load_hooks, main

  hooks = load_hooks("test_hooks:Recorder, ict_jax.hooks:Hook")
  assert [type(h).__name__ for h in hooks] == ["Recorder", "Hook"]
  for spec, words in [
      ("no_such_module_xyz:Hook", "cannot import it"),
      ("ict_jax.hooks:NoSuchHook", "cannot import it"),
      ("ict_jax.hooks", "expected module:name"),
      ("ict_jax.config:ConfigError", "expected an ict_jax.hooks.Hook"),
  ]:
    with pytest.raises(SystemExit) as info:
      main(["train", "--workdir", "/nonexistent/never", f"--hooks={spec}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ict_jax.train: error: --hooks {spec}: ") and words in err[0], err
