"""``synthetic_chain``: chained single-digit arithmetic with worked solutions (the default task).

    prompt "3+5+2="   solution "3+5=8,8+2=10;\\boxed{10}"   answer "10"

Why this task. ICT scores a token by how far its next-token distribution sits from the group's
mean at the same position, so it can only matter where rollouts of one prompt differ in context
and the outcome hangs on tokens after the first. The one-step task (``synthetic_arith``: "3+5=" ->
"8") has neither: the decisive token is the first, where every rollout shares the context and the
JS score is exactly 0. Here:

* the answer is a worked solution of one step per operator, each an equation whose result the next
  step reuses, ending in ``\\boxed{}`` (checked by the existing ``answer`` / ``math`` verifiers);
* the decisive tokens come later: the intermediate results (e.g. the "8" above, and the carry
  digit "1" of "10") decide the final answer, and an error there propagates to ``\\boxed{}``;
* rollouts can diverge at the first token and still recover: all-"+" chains are worked either
  left to right ("3+5=8,8+2=10") or right to left ("5+2=7,3+7=10"); the warm-start teaches both,
  so a group's rollouts split at their first token and both branches reach the right answer;
* the steps are small-number facts a tiny model learns in a short warm-start, but not perfectly:
  accuracy compounds over the steps, so RL has clear room to raise the reward;
* every problem of a level is enumerated and split by a seeded permutation, so the test split is
  held out and a build is identical on every machine; no download.

Each example: ``id``, ``question`` ("What is 3 + 5 + 2?", chat prompts), ``prompt`` ("3+5+2=",
plain prompts), ``answer`` ("10"), ``solution`` (the canonical worked solution), ``solutions``
(every accepted worked solution, one a line: the warm-start's targets) and ``level``.

Levels (level 1 is the CPU default: few enough facts for a tiny model's short warm-start, and
its held-out problems are new combinations of facts the training problems teach):
  1: a + b + c, operands 0..4, two orders                      (125 problems)
  2: a + b + c, operands 0..9, two orders                      (1,000)
  3: a + b + c + d, operands 0..9, two orders                  (10,000)
  4: a +/- b +/- c, operands 0..9, every running result >= 0, left to right   (2,605)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from ict_jax.data.synthetic import split_by_level

# level -> (operand count, operators, largest operand)
LEVELS: dict[int, tuple[int, tuple[str, ...], int]] = {
    1: (3, ("+",), 4),
    2: (3, ("+",), 9),
    3: (4, ("+",), 9),
    4: (3, ("+", "-"), 9),
}


def level_problems(level: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
  """All ``(operands, operators)`` of a level in a fixed order (no negative running result)."""
  if level not in LEVELS:
    raise ValueError(f"synthetic_chain: unknown level {level}; known {sorted(LEVELS)}")
  count, ops, top = LEVELS[level]
  out = []
  for operators in itertools.product(ops, repeat=count - 1):
    for operands in itertools.product(range(top + 1), repeat=count):
      if all(v >= 0 for v in _running(operands, operators)):
        out.append((operands, operators))
  return out


def _running(operands, operators) -> list[int]:
  """Left-to-right running results after each operator."""
  acc, out = operands[0], []
  for op, b in zip(operators, operands[1:]):
    acc = acc + b if op == "+" else acc - b
    out.append(acc)
  return out


def worked_solutions(operands: tuple[int, ...], operators: tuple[str, ...]) -> list[str]:
  """The accepted worked solutions: left to right, and right to left when every operator is "+"."""
  value = _running(operands, operators)[-1]
  steps, acc = [], operands[0]
  for op, b, r in zip(operators, operands[1:], _running(operands, operators)):
    steps.append(f"{acc}{op}{b}={r}")
    acc = r
  out = [",".join(steps) + f";\\boxed{{{value}}}"]
  if set(operators) == {"+"}:
    steps, acc = [], operands[-1]
    for a in reversed(operands[:-1]):
      steps.append(f"{a}+{acc}={a + acc}")
      acc = a + acc
    out.append(",".join(steps) + f";\\boxed{{{value}}}")
  return out


def make_example(operands: tuple[int, ...], operators: tuple[str, ...], level: int) -> dict[str, Any]:
  expr = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(operators, operands[1:]))
  solutions = worked_solutions(operands, operators)
  return {
      "id": f"L{level}:{expr}",
      "question": "What is "
      + " ".join([str(operands[0])] + [f"{op} {b}" for op, b in zip(operators, operands[1:])])
      + "?",
      "prompt": f"{expr}=",
      "answer": str(_running(operands, operators)[-1]),
      "solution": solutions[0],
      "solutions": "\n".join(solutions),
      "level": level,
  }


def split_examples(levels: tuple[int, ...], test_fraction: float, seed: int, split: str) -> list[dict[str, Any]]:
  """`synthetic.split_by_level` of synthetic_chain."""
  return split_by_level("synthetic_chain", level_problems, make_example, levels, test_fraction, seed, split)


@dataclasses.dataclass
class SyntheticChainConfig(tfds.core.BuilderConfig):
  levels: tuple[int, ...] = (1,)
  test_fraction: float = 0.2
  seed: int = 0


class SyntheticChain(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Chained single-digit arithmetic with worked, step-by-step solutions."""

  name = "synthetic_chain"
  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [
      SyntheticChainConfig(name=f"level{k}", description=f"level {k} only", levels=(k,)) for k in sorted(LEVELS)
  ] + [SyntheticChainConfig(name="mixed", description="all levels", levels=tuple(sorted(LEVELS)))]

  def __init__(self, *, file_format: str = "array_record", **kwargs: Any):
    super().__init__(file_format=file_format, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    text = ("id", "question", "prompt", "answer", "solution", "solutions")
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
            {**{k: tfds.features.Text() for k in text}, "level": tfds.features.Scalar(dtype=np.int32)}
        ),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    cfg = self.builder_config
    for example in split_examples(tuple(cfg.levels), cfg.test_fraction, cfg.seed, split):
      yield example["id"], example
