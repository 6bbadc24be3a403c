"""synthetic_chain (the default task): sizes, worked solutions checked step by step, splits,
the verifier accepts every worked solution, the tfds build, the warm-start targets."""

from __future__ import annotations

import itertools
import re

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
