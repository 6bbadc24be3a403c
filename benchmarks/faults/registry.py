"""The scenarios of benchmarks/faults by name, in the table's order, and what they share.

A scenario module registers the function that runs it at the command line's settings:

    @scenario("soak")
    def _(ctx: Context) -> dict:
      return soak(ctx.root, steps=ctx.soak_steps, data_dir=ctx.data_dir)

`python -m benchmarks.faults` runs them (or --only's subset) in the order of their modules in
cli.MODULES.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from benchmarks.faults.harness import reference_run


@dataclasses.dataclass
class Context:
  """The command line's settings, and the reference runs shared by the scenarios that compare with
  one (`ref(steps, every)` runs it on first use)."""

  root: Path
  kills: int = 10
  soak_steps: int = 200
  huge_mb: int = 100
  refs: dict = dataclasses.field(default_factory=dict)

  @property
  def data_dir(self) -> str:
    return str(self.root / "data")

  def ref(self, steps: int, every: int):
    if (steps, every) not in self.refs:
      self.refs[steps, every] = reference_run(self.root / f"ref_{steps}_{every}", steps, every, self.data_dir)
    return self.refs[steps, every]


SCENARIOS: dict[str, Callable[[Context], dict]] = {}


def scenario(name: str):
  """Registers the decorated `fn(ctx) -> row` as the scenario `name` (`--only name`)."""

  def register(fn):
    if name in SCENARIOS:
      raise ValueError(f"scenario {name!r} registered twice")
    SCENARIOS[name] = fn
    return fn

  return register
