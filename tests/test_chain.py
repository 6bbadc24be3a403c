"""synthetic_chain (the default task): sizes, worked solutions checked step by step, splits,
the verifier accepts every worked solution, the tfds build, the warm-start targets."""

from __future__ import annotations

import itertools
import re

import pytest

from ict_jax import data
from ict_jax.data import chain
from ict_jax.rewards.math import answer_reward, math_reward
from ict_jax.warm_start import sft_targets

STEP = re.compile(r"(\d+)([-+])(\d+)=(\d+)")


def test_level_sizes_by_brute_force():
  assert len(chain.level_problems(1)) == 5**3
  assert len(chain.level_problems(2)) == 10**3
  assert len(chain.level_problems(3)) == 10**4
  want4 = sum(
      1
      for a, b, c in itertools.product(range(10), repeat=3)
      for o1, o2 in itertools.product("+-", repeat=2)
      if eval(f"{a}{o1}{b}") >= 0 and eval(f"{a}{o1}{b}{o2}{c}") >= 0
  )
  assert len(chain.level_problems(4)) == want4


def check_solution(prompt: str, solution: str, answer: str):
  """Every step an arithmetic truth, each result reused by the next step, all operands used."""
  body, boxed = solution.split(";")
  assert boxed == f"\\boxed{{{answer}}}"
  steps = [STEP.fullmatch(s).groups() for s in body.split(",")]
  for a, op, b, r in steps:
    assert int(r) == (int(a) + int(b) if op == "+" else int(a) - int(b))
  for prev, nxt in zip(steps, steps[1:]):
    assert prev[3] in (nxt[0], nxt[2])
  assert steps[-1][3] == answer
  assert len(steps) == len(re.findall(r"[-+]", prompt))


def test_worked_solutions_are_correct_and_verified():
  for level in chain.LEVELS:
    for operands, ops in chain.level_problems(level)[::37]:
      ex = chain.make_example(operands, ops, level)
      expr = ex["prompt"][:-1]
      assert ex["answer"] == str(eval(expr))  # noqa: S307 (digits and +/- only)
      sols = ex["solutions"].split("\n")
      assert sols[0] == ex["solution"] and len(sols) == (2 if set(ops) == {"+"} else 1)
      for s in sols:
        check_solution(ex["prompt"], s, ex["answer"])
        assert answer_reward(s, ex["answer"]) == 1.0 and math_reward(s, ex["answer"]) == 1.0
      if len(sols) == 2:  # the two orders diverge at the first token
        assert sols[0][0] != sols[1][0] or operands[0] == operands[-2]
      wrong = ex["solution"].replace(f"{{{ex['answer']}}}", f"{{{int(ex['answer']) + 1}}}")
      assert answer_reward(wrong, ex["answer"]) == 0.0


def test_split_is_seeded_and_disjoint():
  train = chain.split_examples((2, 4), 0.2, 0, "train")
  test = chain.split_examples((2, 4), 0.2, 0, "test")
  assert len(train) + len(test) == 1000 + len(chain.level_problems(4))
  assert not {e["id"] for e in train} & {e["id"] for e in test}
  assert chain.split_examples((1,), 0.2, 1, "test") != chain.split_examples((1,), 0.2, 0, "test")


def test_build_read_back_and_sft_targets(tmp_path):
  test = data.load_split("synthetic_chain/level1", "test", tmp_path)
  assert len(test) == 25
  ex = test[0]
  assert set(ex) == {"id", "question", "prompt", "answer", "solution", "solutions", "level"}
  assert sft_targets(ex) == ex["solutions"].split("\n") and len(sft_targets(ex)) == 2
  assert sft_targets({"answer": 8}) == ["8"]  # a bare-answer task: the answer itself


def test_chain_steps_verifier_checks_every_step():
  """reward.kind=chain_steps: 1 only when each worked step's arithmetic, the chain over the
  problem's operands and the box are right; the answer-only verifier is the contrast."""
  from ict_jax import config as config_lib
  from ict_jax import configs
  from ict_jax.rewards import score
  from ict_jax.rewards.registry import gold_text

  ex = chain.make_example((3, 5, 2), ("+", "+"), 2)
  gold = gold_text("chain_steps", ex)
  assert gold == "3+5+2=10" and gold_text("answer", ex) == "10"
  cases = {
      "3+5=8,8+2=10;\\boxed{10}": 1.0,  # the canonical solution
      "5+2=7,3+7=10;\\boxed{10}": 1.0,  # right to left, as the task teaches
      "5+3=8,2+8=10;\\boxed{10}": 1.0,  # commuted operands: still right arithmetic
      " 3 + 5 = 8 ,\n8+2 = 10 ; \\boxed{ 10 }": 1.0,  # spaces and newlines anywhere
      "3+5=8,8+2=10;;\\boxed{10}": 1.0,  # an empty piece is skipped
      "3+5=8,8+2=10;\\boxed{10}1}1=": 1.0,  # text after the box is ignored (as answer-only)
      "3+5=9,9+2=10;\\boxed{10}": 0.0,  # a wrong step with the right box
      "3+5=8,8+2=11;\\boxed{10}": 0.0,  # last step disagrees with the box
      "3+5=8,8+2=10;\\boxed{11}": 0.0,  # wrong answer
      "8+2=10;\\boxed{10}": 0.0,  # a missing step
      "3+5=8,8+2=10,10+0=10;\\boxed{10}": 0.0,  # an extra step
      "3+5=8,9+1=10;\\boxed{10}": 0.0,  # does not build on the previous result
      "4+4=8,8+2=10;\\boxed{10}": 0.0,  # right arithmetic on numbers not in the problem
      "3+5=8,then 8+2=10;\\boxed{10}": 0.0,  # a piece that is no equation
      "3+5=8,8+2=10;": 0.0,  # no box
      "\\boxed{10}": 0.0,  # no steps
  }
  for completion, want in cases.items():
    assert score("chain_steps", completion, gold) == want, completion
  assert answer_reward("3+5=9,9+2=10;\\boxed{10}", ex["answer"]) == 1.0  # what answer-only misses
  assert score("chain_steps", "3+5=8,8+2=10;\\boxed{10}", "not an equation") == 0.0
  # every accepted worked solution of the small levels (subtraction included) scores 1, and the
  # same steps with one result off by one score 0
  for level in (1, 4):
    for operands, operators in chain.level_problems(level):
      ex = chain.make_example(operands, operators, level)
      for s in ex["solutions"].split("\n"):
        assert score("chain_steps", s, gold_text("chain_steps", ex)) == 1.0, (ex["prompt"], s)
        wrong = STEP.sub(lambda m: f"{m[1]}{m[2]}{m[3]}={int(m[4]) + 1}", s, count=1)
        assert score("chain_steps", wrong, gold_text("chain_steps", ex)) == 0.0, (ex["prompt"], wrong)
  c = configs.chain_config()
  c.reward.kind = "chain_steps"
  assert config_lib.validate(c).reward.kind == "chain_steps"
  c.data.name = "synthetic_arith"
  with pytest.raises(config_lib.ConfigError, match="config.reward.kind: 'chain_steps'"):
    config_lib.validate(c)
