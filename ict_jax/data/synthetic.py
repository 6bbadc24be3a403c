"""``synthetic_arith``: generated arithmetic, the default task (no download).

Every problem of a difficulty level is enumerated, shuffled from the config's seed and split into
disjoint train / test sets, so the test split is held out and a build is identical on every
machine. Each example: ``id``, ``question`` ("What is 3 + 5?", for chat prompts), ``prompt``
("3+5=", the short completion prompt for tiny models), ``answer`` ("8") and ``level``.

Levels (a curriculum moves up them; config ``mixed`` holds all, tagged by ``level``):
  1: a + b, a, b in 0..9                      (100 problems)
  2: a + b and a - b (a >= b), a, b in 0..9   (155)
  3: a + b, a, b in 0..99                     (10,000)
  4: a + b and a - b (a >= b) in 0..99, a * b in 0..12   (15,219)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

# level -> ((operator, largest operand), ...)
LEVELS: dict[int, tuple[tuple[str, int], ...]] = {
    1: (("+", 9),),
    2: (("+", 9), ("-", 9)),
    3: (("+", 99),),
    4: (("+", 99), ("-", 99), ("*", 12)),
}
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def level_problems(level: int) -> list[tuple[int, str, int]]:
  """All ``(a, op, b)`` of a level in a fixed order; subtraction keeps ``a >= b``."""
  if level not in LEVELS:
    raise ValueError(f"synthetic_arith: unknown level {level}; known {sorted(LEVELS)}")
  return [(a, op, b) for op, hi in LEVELS[level] for a in range(hi + 1) for b in range(hi + 1) if op != "-" or a >= b]


def make_example(a: int, op: str, b: int, level: int) -> dict[str, Any]:
  return {
      "id": f"L{level}:{a}{op}{b}",
      "question": f"What is {a} {op} {b}?",
      "prompt": f"{a}{op}{b}=",
      "answer": str(_APPLY[op](a, b)),
      "level": level,
  }


def split_by_level(
    name: str, problems_of, example_of, levels: tuple[int, ...], test_fraction: float, seed: int, split: str
) -> list[dict[str, Any]]:
  """Examples of ``split`` ("train" or "test") of the generated task `name`: per level, the first
  ceil(test_fraction * n) of a seeded permutation of `problems_of(level)` are the test set, the
  rest the train set; `example_of(*problem, level)` makes each example."""
  if split not in ("train", "test"):
    raise ValueError(f"{name}: unknown split {split!r}; expected 'train' or 'test'")
  out = []
  for level in levels:
    problems = problems_of(level)
    order = np.random.default_rng([seed, level]).permutation(len(problems))
    n_test = math.ceil(test_fraction * len(problems))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    out.extend(example_of(*problems[i], level) for i in chosen)
  return out


def split_examples(levels: tuple[int, ...], test_fraction: float, seed: int, split: str) -> list[dict[str, Any]]:
  """`split_by_level` of synthetic_arith."""
  return split_by_level("synthetic_arith", level_problems, make_example, levels, test_fraction, seed, split)


@dataclasses.dataclass
class SyntheticArithConfig(tfds.core.BuilderConfig):
  levels: tuple[int, ...] = (1,)
  test_fraction: float = 0.2
  seed: int = 0


class SyntheticArith(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Generated arithmetic problems with integer answers."""

  name = "synthetic_arith"
  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [
      SyntheticArithConfig(name=f"level{k}", description=f"level {k} only", levels=(k,)) for k in sorted(LEVELS)
  ] + [SyntheticArithConfig(name="mixed", description="all levels", levels=tuple(sorted(LEVELS)))]

  def __init__(self, *, file_format: str = "array_record", **kwargs: Any):
    super().__init__(file_format=file_format, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
            {
                "id": tfds.features.Text(),
                "question": tfds.features.Text(),
                "prompt": tfds.features.Text(),
                "answer": tfds.features.Text(),
                "level": tfds.features.Scalar(dtype=np.int32),
            }
        ),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    cfg = self.builder_config
    for example in split_examples(tuple(cfg.levels), cfg.test_fraction, cfg.seed, split):
      yield example["id"], example
