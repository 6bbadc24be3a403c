"""Rewards as Python functions with TRL's signature (`reward.funcs`, `train(reward_funcs=...)`):
loading by module or file, batched calls in the worker processes, weights, None, failures and
timeouts, the per-function metrics of a run, and the dataset columns reaching the functions."""

import logging
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import config as config_lib
from ict_jax import configs, grpo, rollout, task_vocab
from ict_jax.config import ConfigError
from ict_jax.logs import read_log
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import Qwen2
from ict_jax.rewards.functions import resolve
from ict_jax.rewards.pool import RewardPool
from ict_jax.train import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the functions a user would write (a module on the path, and a file named by its path)
MODULE = """
import math, time

def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]

def not_for_x(prompts, completions, answer, **columns):
    return [None if a == "x" else float(c == a) for c, a in zip(completions, answer)]

def boom(prompts, completions, **columns):
    raise ValueError("no luck")

def short(prompts, completions, **columns):
    return [1.0]

def half_nan(prompts, completions, **columns):
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

def sleepy(prompts, completions, **columns):
    time.sleep(60)
    return [1.0] * len(completions)

def text(prompts, completions, **columns):
    return ["1.0"] * len(completions)

NOT_CALLABLE = 3
"""

FILE = '''
def has_digit(prompts, completions, **columns):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]

def columns_match(prompts, completions, id, question, answer, level, **rest):
    """synthetic_arith's columns, aligned with the completions (raises, so scores 0 as an error, if not)."""
    assert not rest, rest
    assert len(prompts) == len(completions) == len(id) == len(question) == len(answer) == len(level)
    for p, i, q, a, lv in zip(prompts, id, question, answer, level):
        expr = p[:-1]
        assert i == f"L{lv}:{expr}", (i, p)
        assert str(eval(expr)) == a, (p, a)
        assert q.startswith("What is "), q
    return [1.0] * len(completions)
'''


@pytest.fixture
def user_code(tmp_path, monkeypatch):
  """-> the file path of FILE; MODULE importable as `user_rewards` (here and in the workers)."""
  (tmp_path / "user_rewards.py").write_text(MODULE)
  (tmp_path / "file_rewards.py").write_text(FILE)
  monkeypatch.syspath_prepend(str(tmp_path))
  return str(tmp_path / "file_rewards.py")


def test_module_and_file_functions_score_as_called_directly(user_code):
  """Both kinds of spec load, run in the workers (and in-process) on one batch, and give what
  the function gives when called directly; None is NaN in the values and counted."""
  import user_rewards

  fs = resolve(f"user_rewards:length,user_rewards:not_for_x,{user_code}:has_digit", "", num_workers=2)
  assert [f.name for f in fs] == ["length", "not_for_x", "has_digit"]
  assert fs[2].spec == f"{user_code}:has_digit" and fs[1].weight == 1.0
  prompts, texts, cols = ["p1", "p2", "p3", "p4"], ["1", "22", "x", "abc"], {"answer": ["1", "2", "x", "abc"]}
  want_len = np.asarray(user_rewards.length(prompts, texts), np.float32)
  for workers in (2, 0):
    with RewardPool(num_workers=workers, timeout_s=5.0, functions=fs) as pool:
      out = pool.score_functions(prompts, texts, cols)
    np.testing.assert_array_equal(out["length"][0], want_len)
    np.testing.assert_array_equal(out["not_for_x"][0], [1.0, 0.0, np.nan, 1.0])
    np.testing.assert_array_equal(out["has_digit"][0], [1.0, 1.0, 0.0, 0.0])
    assert out["not_for_x"][1]["nones"] == 1 and out["length"][1]["nones"] == 0
    assert all(st["errors"] == st["timeouts"] == 0 and st["n"] == 4 for _, st in out.values())


def test_failures_score_zero_are_counted_and_logged_by_name(user_code, caplog):
  """A raise, a wrong length or a non-number fail the whole call (each completion 0, an error); a
  non-finite value fails its completion only; a function that sleeps past n * timeout_s is killed
  (each completion 0, a timeout) and the pool goes on."""
  names = ["boom", "short", "half_nan", "text", "sleepy", "length"]
  fs = resolve(",".join(f"user_rewards:{n}" for n in names), "", num_workers=2)
  texts = ["a", "bb", "ccc", "dddd"]
  with caplog.at_level(logging.WARNING, logger="ict_jax.rewards"):
    with RewardPool(num_workers=2, timeout_s=0.25, functions=fs) as pool:
      t0 = time.monotonic()
      out = pool.score_functions(["p"] * 4, texts, {})
      took = time.monotonic() - t0
      again = pool.score_functions(["p"] * 4, texts, {})  # replaced workers score the next batch
  assert took < 20, took  # sleepy (60 s) was killed after 4 x 0.25 s
  stats = {n: out[n][1] for n in names}
  for n in ("boom", "short", "text"):
    np.testing.assert_array_equal(out[n][0], np.zeros(4))
    assert stats[n]["errors"] == 4 and stats[n]["timeouts"] == 0
  np.testing.assert_array_equal(out["half_nan"][0], [1.0, 0.0, 1.0, 0.0])
  assert stats["half_nan"]["errors"] == 2
  np.testing.assert_array_equal(out["sleepy"][0], np.zeros(4))
  assert stats["sleepy"]["timeouts"] == 4 and stats["sleepy"]["errors"] == 0
  np.testing.assert_array_equal(out["length"][0], [1.0, 2.0, 3.0, 4.0])
  np.testing.assert_array_equal(again["length"][0], [1.0, 2.0, 3.0, 4.0])
  assert again["sleepy"][1]["timeouts"] == 4
  lines = [r.getMessage() for r in caplog.records]
  for n, why in [
      ("boom", "raised ValueError: no luck"),
      ("short", "returned 1 values for 4 completions"),
      ("text", "returned str '1.0' at 0, expected a number or None"),
      ("half_nan", "returned a non-finite value for 2 of 4 completions"),
      ("sleepy", "ran past its timeout on 4 completions"),
  ]:
    assert any(line.startswith(f"reward function {n} {why}") for line in lines), (n, lines)


def test_in_process_overrun_counts_as_timeout():
  """num_workers=0: nothing can stop a call, but one that overran n * timeout_s scores 0 and
  counts as timeouts, like the built-in verifiers in-process."""

  def slow(prompts, completions, **columns):
    time.sleep(0.3)
    return [1.0] * len(completions)

  fs = resolve("", "", [slow], num_workers=0)
  with RewardPool(num_workers=0, timeout_s=0.1, functions=fs) as pool:
    values, stats = pool.score_functions(["p", "q"], ["a", "b"], {})["slow"]
  np.testing.assert_array_equal(values, [0.0, 0.0])
  assert stats["timeouts"] == 2


@pytest.mark.parametrize(
    "funcs,weights,given,workers,message",
    [
        (
            "no_such_module:fn",
            "",
            (),
            0,
            "config.reward.funcs: no_such_module:fn: cannot import it (ModuleNotFoundError: No module named "
            "'no_such_module')",
        ),
        (
            "user_rewards:missing",
            "",
            (),
            0,
            "config.reward.funcs: user_rewards:missing: cannot import it (AttributeError: module 'user_rewards' "
            "has no attribute 'missing')",
        ),
        ("user_rewards:NOT_CALLABLE", "", (), 0, "config.reward.funcs: user_rewards:NOT_CALLABLE: int is not callable"),
        ("length", "", (), 0, "config.reward.funcs: 'length': expected module:function or path/to/file.py:function"),
        ("/nowhere/r.py:fn", "", (), 0, "config.reward.funcs: /nowhere/r.py:fn: cannot import it (FileNotFoundError"),
        (
            "user_rewards:length",
            "1,2",
            (),
            0,
            "config.reward.weights: 2 weights for 1 reward functions (user_rewards:length); give one weight per function",
        ),
        ("", "1", (), 0, "config.reward.weights: 1 weights for 0 reward functions (none)"),
        ("user_rewards:length", "", [len], 0, "config.reward.funcs: reward functions are given both by"),
        (
            "",
            "",
            [lambda prompts, completions, **kw: [1.0]],
            1,
            "train(reward_funcs=...)[0] <lambda>: cannot be pickled to the reward worker processes",
        ),
        ("", "", [3], 0, "train(reward_funcs=...)[0]: expected a callable or 'module:function', got 3"),
    ],
)
def test_bad_functions_are_one_config_error(user_code, funcs, weights, given, workers, message):
  with pytest.raises(ConfigError) as e:
    resolve(funcs, weights, given, num_workers=workers)
  assert str(e.value).startswith(message), str(e.value)
  assert "\n" not in str(e.value)


def test_config_rules_of_funcs_and_weights():
  """RewardConfig: weights are finite numbers, one per function of reward.funcs; the format weight
  belongs to reward.kind, which reward.funcs replaces."""

  def bad(**reward):
    cd = config_lib.default_config()
    cd.reward.update(reward)
    with pytest.raises(ConfigError) as e:
      config_lib.validate(cd)
    return str(e.value)

  assert bad(weights="1,x") == "config.reward.weights: expected comma-separated finite numbers (\"1.0,0.2\"), got '1,x'"
  assert bad(weights="nan").startswith("config.reward.weights: expected comma-separated finite numbers")
  assert bad(funcs="a:f,b.py:g", weights="1") == (
      "config.reward.weights: 1 weights for the 2 functions of reward.funcs (a:f, b.py:g); give one weight per function"
  )
  assert bad(funcs="a:f", format_weight=0.5).startswith("config.reward.format_weight: 0.5 adds the format reward")
  cd = config_lib.default_config()
  cd.reward.update(funcs=" a:f , b.py:g ", weights="1.0, -0.2")  # spaces are allowed; a weight may be negative
  assert config_lib.validate(cd).reward.weights == "1.0, -0.2"


def test_collector_rewards_are_the_weighted_sum_with_columns(user_code):
  """The collector hands each decode sub-batch to the functions with its prompts and every other
  column aligned (a function asserts on them), and the rewards are the weighted sum of what the
  functions give on the decoded texts (None as 0), the advantages the group advantages of that,
  each function's mean (over the completions it applies to) a statistic."""
  import user_rewards

  def answer_match(prompts, completions, answer, id, **rest):
    for p, a, i in zip(prompts, answer, id):
      assert i == f"id:{p}" and a == str(eval(p[:-1])), (p, a, i)
    return [None if p.startswith("3") else float(len(c) % 2) for p, c in zip(prompts, completions)]

  tok = task_vocab.build(["1+2=3;\\boxed{3}"])
  model = Qwen2(Qwen2Config.preset("tiny", vocab_size=128), rngs=nnx.Rngs(jax.random.key(0)))
  examples = [{"prompt": p, "answer": a, "id": f"id:{p}"} for p, a in (("1+2=", "3"), ("2+1=", "3"), ("3=", "3"))]
  fs = resolve("", "0.5,-0.25,2", ["user_rewards:length", answer_match, f"{user_code}:has_digit"])
  kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)
  with RewardPool(num_workers=0, functions=fs) as pool:
    collector = rollout.Collector(
        tok, rollout.Sampling(**kw), rollout.Scoring(reward_kind="answer", functions=fs), group_size=4,
        prompt_style="plain", max_prompt_len=16, decode_batch_size=4,
    )  # fmt: skip
    roll = collector.collect(model, examples, pool, rng=jax.random.key(3))
  texts, prompts = roll.completions, [ex["prompt"] for ex in examples for _ in range(4)]
  length = np.asarray(user_rewards.length(prompts, texts), np.float32)
  match = np.asarray([np.nan if p.startswith("3") else len(c) % 2 for p, c in zip(prompts, texts)], np.float32)
  digit = np.asarray([any(ch.isdigit() for ch in c) for c in texts], np.float32)
  want = 0.5 * length - 0.25 * np.nan_to_num(match) + 2 * digit
  assert want.min() < want.max()
  np.testing.assert_allclose(roll.rewards, want, rtol=1e-6)
  np.testing.assert_allclose(
      roll.advantages, np.asarray(grpo.group_advantages(jnp.asarray(want), 4)), rtol=1e-5, atol=1e-6
  )
  st = roll.stats
  assert st["reward_errors"] == 0 and st["reward_timeouts"] == 0
  np.testing.assert_allclose(st["reward/length"], length.mean(), rtol=1e-6)
  np.testing.assert_allclose(st["reward/answer_match"], np.nanmean(match), rtol=1e-6)
  assert st["reward/answer_match/nones"] == 4 and st["reward/has_digit/nones"] == 0
  np.testing.assert_allclose(st["reward_mean"], want.mean(), rtol=1e-6)


def _quick(tmp_path):
  c = configs.tiny_config()
  c.warm_start.sft_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 2  # 8 rows: one per simulated device
  c.train.steps, c.train.checkpoint_every = 2, 2
  c.train.async_checkpointing = False
  c.train.eval_every = 0
  return c


def test_a_run_logs_each_functions_mean(user_code, tmp_path):
  """A tiny `train()` with reward.funcs (a module function and the columns-checking file function,
  weighted) in one worker process: each step's metrics log `reward/<name>` and its counts, the
  columns reached the function (it never failed), and reward_mean is the weighted sum of the means."""
  c = _quick(tmp_path)
  c.reward.funcs = f"user_rewards:length,{user_code}:columns_match"
  c.reward.weights = "0.1,2"
  c.reward.num_workers = 1
  history = train(c, str(tmp_path / "run"), progress=False)
  logged = read_log(str(tmp_path / "run"), "metrics")
  assert [r["step"] for r in logged] == [1, 2] and len(history) == 2
  for row in logged:
    assert row["reward_errors"] == 0 and row["reward_timeouts"] == 0
    assert row["reward/columns_match"] == 1.0 and row["reward/columns_match/errors"] == 0
    assert row["reward/length/nones"] == 0 and row["reward/length"] > 0
    np.testing.assert_allclose(row["reward_mean"], 0.1 * row["reward/length"] + 2.0, rtol=1e-5)


def test_the_api_takes_callables_in_process(tmp_path):
  """`train(cfg, workdir, reward_funcs=[fn])`: a closure runs in-process (reward.num_workers=0)
  and sees every completion of the step once."""
  seen = []

  def count(prompts, completions, **columns):
    seen.extend(completions)
    return [0.5] * len(completions)

  c = _quick(tmp_path)
  c.train.steps = 1
  c.reward.num_workers = 0
  (record,) = train(c, str(tmp_path / "run"), progress=False, reward_funcs=[count])
  assert len(seen) == 8 and record["reward/count"] == 0.5 and record["reward_mean"] == 0.5


def test_an_unimportable_function_exits_2_in_one_line(tmp_path):
  cmd = [
      sys.executable,
      "-m",
      "ict_jax.train",
      f"--workdir={tmp_path}/w",
      "--config.reward.funcs=no_such_module:reward_fn",
  ]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  want = (
      "ict_jax.train: error: config.reward.funcs: no_such_module:reward_fn: cannot import it "
      "(ModuleNotFoundError: No module named 'no_such_module')"
  )
  assert proc.stderr.strip().splitlines()[-1] == want, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(f"{tmp_path}/w/checkpoints")


def test_a_worker_that_cannot_load_a_function_names_it(tmp_path):
  """A spec that loaded in the trainer but not in a worker (the file is gone): the pool's start-up
  fails with the function's name and the worker's reason, not a bare dead worker."""
  path = tmp_path / "gone.py"
  path.write_text("def gone(prompts, completions, **columns):\n    return [1.0] * len(completions)\n")
  fs = resolve(f"{path}:gone", "", num_workers=1)
  path.unlink()
  with pytest.raises(RuntimeError) as e:
    RewardPool(num_workers=1, functions=fs)
  assert f"reward function gone: ConfigError: config.reward.funcs: {path}:gone: cannot import it" in str(e.value)
