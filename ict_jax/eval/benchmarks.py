"""The benchmark registry: which dataset, split, prompt instruction and answer checker each uses.

        bench = get("math500"); examples = load(bench, data_dir=..., manual_dir="~/data/math500")

Math500, GSM8K and AIME are checked on the last ``\\boxed{}`` (answer type ``math_boxed``);
MMLU-STEM and GPQA list their options as ``(A) ...`` lines and are checked on the committed letter
(``choice``); ``synthetic`` (one-step arithmetic) and ``chain`` (the default task, worked
solutions; no files) on the bare or boxed answer. ``files`` is the user's own files
(`ict_jax.data.files`: `--files`, or the run's ``data.eval_files``), checked on their answer column
as the run's ``reward.kind`` checks it (``math_boxed`` unless said otherwise).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ict_jax.data.files import FILES, FileSplit
from ict_jax.data.prompts import MATH_INSTRUCTION

CHOICE_INSTRUCTION = "Please reason step by step, and put the letter of the correct option " "within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str  # the CLI name
  title: str  # the results-table column
  dataset: str  # an ict_jax.data builder, "name" or "name/config"
  split: str
  answer_type: str  # "math_boxed" | "choice" | "answer" (ict_jax.eval.run.ANSWER_TYPES)
  instruction: str  # appended to the question in chat prompts
  needs_files: bool = True  # built from the user's files in a manual directory


# In the paper's table order.
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("math500", "Math500", "math500", "test", "math_boxed", MATH_INSTRUCTION),
        Benchmark("gsm8k", "GSM8K", "gsm8k", "test", "math_boxed", MATH_INSTRUCTION),
        Benchmark("mmlu_stem", "MMLU-STEM", "mmlu_stem", "test", "choice", CHOICE_INSTRUCTION),
        Benchmark("gpqa", "GPQA", "gpqa", "test", "choice", CHOICE_INSTRUCTION),
        Benchmark("aime23", "AIME23", "aime/2023", "test", "math_boxed", MATH_INSTRUCTION),
        Benchmark("aime24", "AIME24", "aime/2024", "test", "math_boxed", MATH_INSTRUCTION),
        Benchmark("aime25", "AIME25", "aime/2025", "test", "math_boxed", MATH_INSTRUCTION),
        Benchmark("synthetic", "Synthetic", "synthetic_arith/level1", "test", "answer", "", needs_files=False),
        Benchmark("chain", "Chain", "synthetic_chain/level1", "test", "answer", "", needs_files=False),
        Benchmark(FILES, "Files", FILES, "test", "math_boxed", MATH_INSTRUCTION),  # the rollouts' instruction
    )
}


def get(name: str) -> Benchmark:
  if name not in BENCHMARKS:
    raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
  return BENCHMARKS[name]


def parse(names: str) -> list[Benchmark]:
  """``"math500,gsm8k"`` -> the benchmarks, in the given order, each once."""
  out: list[Benchmark] = []
  for name in (n.strip() for n in names.split(",")):
    if name and get(name) not in out:
      out.append(get(name))
  if not out:
    raise KeyError(f"no benchmark named in {names!r}; known: {', '.join(BENCHMARKS)}")
  return out


def load(
    bench: Benchmark,
    *,
    data_dir: str | None,
    manual_dir: str | None,
    limit: int | None = None,
    files: FileSplit | None = None,
) -> list[dict[str, Any]]:
  """The benchmark's examples (dicts with id / question / prompt / answer), the first ``limit``.

  Builds the tfds dataset under ``data_dir`` from the files in ``manual_dir`` on first use; a
  missing or empty manual directory raises FileNotFoundError with the dataset's instructions.
  The ``files`` benchmark reads ``files`` (ConfigError naming a bad file)."""
  from ict_jax.data import load_split

  if bench.dataset == FILES:
    if files is None or not files.spec:
      raise FileNotFoundError(
          "benchmark files: no files given (--files PATHS, or a --workdir whose run has data.eval_files)"
      )
    source = files.load()
    count = len(source) if limit is None else min(limit, len(source))
    return [source[i] for i in range(count)]
  manual = os.path.expanduser(manual_dir) if (manual_dir and bench.needs_files) else None
  if bench.needs_files and manual is None:
    raise FileNotFoundError(f"benchmark {bench.name}: no manual directory given for its files")
  source = load_split(bench.dataset, bench.split, data_dir=data_dir, manual_dir=manual)
  count = len(source) if limit is None else min(limit, len(source))
  return [source[i] for i in range(count)]
