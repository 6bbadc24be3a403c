"""Rewards as Python functions, with TRL's signature (`reward.funcs`, `train(reward_funcs=[...])`).

    def my_reward(prompts: list, completions: list[str], **columns) -> list[float | None]: ...

A function is named ``"pkg.module:fn"`` (imported) or ``"path/to/file.py:fn"`` (the file loaded as a
module), or given as a callable through the library API. Each is called in batches (a decode
sub-batch of this host's completions at a time) with keyword arguments: ``prompts`` (each
completion's prompt as the dataset gives it: the example's "prompt", else its "question"; a
string or a list of chat messages), ``completions`` (the texts, decoded without EOS) and every
other column of the examples by name, each a list aligned with the completions (as TRL passes a
dataset's columns). It returns one number per completion, or None where it does not apply (counted
as 0 in the reward and as a "none" in the function's metrics).

The reward of a completion is the weighted sum of the functions (`reward.weights`, default all 1).
`run_call` calls one function and checks what it returned; it runs in the reward worker processes
(`pool.RewardPool`, under its timeouts) or in-process, and never raises for what the function does.
`settle` turns its result into the function's values and counts: a call that raises, returns a
wrong length or something that is not a number scores 0 for each of its completions, each counted
as an error; a non-finite value scores 0 for its completion, counted as an error (as the built-in
verifiers' failures are). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import pickle
import sys
from typing import Any, Callable, Sequence

import numpy as np

from ict_jax.errors import ConfigError

RewardCallable = Callable[..., Sequence[Any]]
_MESSAGE_CHARS = 300  # a failure's message is cut to this many characters


@dataclasses.dataclass(frozen=True)
class RewardFunction:
  """One reward function of a run: its metric name, weight, the callable and, when it was named by
  a string, that spec (a worker process loads it again from the spec)."""

  name: str
  fn: RewardCallable
  weight: float = 1.0
  spec: str = ""  # "module:fn" or "/abs/path/file.py:fn"; "" for a callable given directly

  def payload(self) -> tuple[str, str, bytes | None]:
    """What a worker process needs to get the function: (name, spec, pickled callable or None)."""
    return self.name, self.spec, None if self.spec else pickle.dumps(self.fn)


def parse_list(text: str) -> list[str]:
  """ "a, b,,c" -> ["a", "b", "c"]."""
  return [part.strip() for part in text.split(",") if part.strip()]


def parse_weights(text: str) -> list[float]:
  """`reward.weights` -> floats; ValueError naming the entry that is not a finite number."""
  weights = []
  for part in parse_list(text):
    try:
      value = float(part)
    except ValueError:
      value = float("nan")
    if not math.isfinite(value):
      raise ValueError(f"{part!r} is not a finite number")
    weights.append(value)
  return weights


def _is_file(where: str) -> bool:
  return where.endswith(".py") or os.sep in where or "/" in where


def _load_file(path: str):
  """The module of a .py file (kept in sys.modules under a name made from its path)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such file {path}")
  stem = os.path.splitext(os.path.basename(path))[0]
  name = f"ict_jax_reward_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def load(spec: str, key: str = "config.reward.funcs") -> RewardCallable:
  """``"pkg.module:fn"`` or ``"path/to/file.py:fn"`` (``fn`` may be dotted: ``Class.method``) ->
  the callable. ConfigError naming `key` and the spec when it cannot be imported or is not callable."""
  where, sep, attr = spec.rpartition(":")
  if not sep or not where or not attr:
    raise ConfigError(f"{key}: {spec!r}: expected module:function or path/to/file.py:function")
  try:
    obj = _load_file(where) if _is_file(where) else importlib.import_module(where)
    for part in attr.split("."):
      obj = getattr(obj, part)
  except Exception as e:  # the module's own code may raise anything
    raise ConfigError(f"{key}: {spec}: cannot import it ({type(e).__name__}: {_message(e)})") from None
  if not callable(obj):
    raise ConfigError(f"{key}: {spec}: {type(obj).__name__} is not callable")
  return obj


def absolute_spec(spec: str) -> str:
  """A file spec with an absolute path (a worker may run in another directory); others as given."""
  where, _, attr = spec.rpartition(":")
  return f"{os.path.abspath(os.path.expanduser(where))}:{attr}" if _is_file(where) else spec


def _check_picklable(label: str, fn) -> None:
  """A callable given to the API must reach the worker processes: pickled by reference, so it must
  be importable by name in a fresh interpreter (not a lambda, a closure or the script's __main__)."""
  advice = "define it at module level of an importable module, or set reward.num_workers=0 (in-process)"
  if getattr(fn, "__module__", None) == "__main__":
    raise ConfigError(f"{label}: defined in __main__, which the reward worker processes cannot import; {advice}")
  try:
    pickle.loads(pickle.dumps(fn))
  except Exception as e:
    raise ConfigError(f"{label}: cannot be pickled to the reward worker processes ({_message(e)}); {advice}") from None


def resolve(funcs: str, weights: str, given: Sequence[Any] = (), *, num_workers: int = 0) -> tuple[RewardFunction, ...]:
  """The run's reward functions: `reward.funcs` (a comma-separated string) or the API's `given`
  (callables or spec strings; not both), weighted by `reward.weights` (default all 1). ConfigError
  naming the bad entry: unimportable, not callable, unpicklable for workers, a count mismatch."""
  specs = parse_list(funcs)
  if specs and given:
    raise ConfigError(
        "config.reward.funcs: reward functions are given both by reward.funcs and by train(reward_funcs=...); "
        "give them one way"
    )
  entries = specs or list(given)
  try:
    ws = parse_weights(weights)
  except ValueError as e:
    raise ConfigError(f"config.reward.weights: {e}") from None
  if ws and len(ws) != len(entries):
    raise ConfigError(
        f"config.reward.weights: {len(ws)} weights for {len(entries)} reward functions "
        f"({', '.join(map(_label, entries)) or 'none'}); give one weight per function"
    )
  out, names = [], set()
  for i, entry in enumerate(entries):
    if isinstance(entry, str):
      fn, spec = load(entry, "config.reward.funcs" if specs else f"train(reward_funcs=...)[{i}]"), absolute_spec(entry)
      name = entry.rpartition(":")[2].rpartition(".")[2]
    elif callable(entry):
      fn, spec = entry, ""
      name = getattr(entry, "__name__", type(entry).__name__)
      if num_workers:
        _check_picklable(f"train(reward_funcs=...)[{i}] {name}", entry)
    else:
      raise ConfigError(f"train(reward_funcs=...)[{i}]: expected a callable or 'module:function', got {entry!r}")
    unique, k = name, 2
    while unique in names:  # two files' `reward`: reward, reward_2
      unique, k = f"{name}_{k}", k + 1
    names.add(unique)
    out.append(RewardFunction(unique, fn, ws[i] if ws else 1.0, spec))
  return tuple(out)


def _label(entry) -> str:
  return entry if isinstance(entry, str) else getattr(entry, "__name__", type(entry).__name__)


def _message(e: BaseException) -> str:
  try:
    text = str(e)
  except Exception:  # pylint: disable=broad-except
    text = ""
  return text[:_MESSAGE_CHARS]


def batch_inputs(examples: Sequence[dict], which: Sequence[int]) -> tuple[list, dict[str, list]]:
  """What a function is given for the completions of `examples[which]`: (prompts: each example's
  "prompt", else its "question"; {column: values} for every other key of the examples, as TRL
  passes a dataset's columns, None where an example lacks it)."""
  rows = [examples[int(i)] for i in which]
  keys = list(dict.fromkeys(k for ex in rows for k in ex if k != "prompt"))
  prompts = [ex["prompt"] if "prompt" in ex else ex.get("question") for ex in rows]
  return prompts, {k: [ex.get(k) for ex in rows] for k in keys}


# ---- one call --------------------------------------------------------------------------------
def run_call(fn: RewardCallable, prompts: list, completions: list[str], columns: dict[str, list]) -> tuple:
  """Call `fn` on one batch -> (values: list[float | None], non-finite indices, error message).
  A non-empty message (the call raised, or returned the wrong length or a non-number) fails the
  whole call. Never raises but MemoryError (the worker then exits)."""
  n = len(completions)
  try:
    out = fn(prompts=prompts, completions=completions, **columns)
  except MemoryError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    return [], [], f"raised {type(e).__name__}: {_message(e)}"
  try:
    out = list(out)
  except TypeError:
    return [], [], f"returned {type(out).__name__}, expected a list of {n} numbers or None"
  if len(out) != n:
    return [], [], f"returned {len(out)} values for {n} completions"
  values, bad = [], []
  for i, v in enumerate(out):
    if v is None:
      values.append(None)
      continue
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.number)):
      return [], [], f"returned {type(v).__name__} {str(v)[:40]!r} at {i}, expected a number or None"
    value = float(v)
    if not math.isfinite(value):
      bad.append(i)
      value = 0.0
    values.append(value)
  return values, bad, ""


def settle(name: str, result: tuple | str, n: int) -> tuple[np.ndarray, dict[str, int], str]:
  """A call's `run_call` result, or "timeouts" / "errors" when its worker was killed or died ->
  (values float32[n], NaN where the function returned None; {"nones", "errors", "timeouts"};
  the warning to log, naming the function, or "")."""
  stats = {"nones": 0, "errors": 0, "timeouts": 0}
  values = np.zeros(n, np.float32)
  if isinstance(result, str):
    stats[result] = n
    why = "ran past its timeout" if result == "timeouts" else "killed its worker process"
    return values, stats, f"reward function {name} {why} on {n} completions; they score 0 (counted in reward_{result})"
  got, bad, error = result
  if error:
    stats["errors"] = n
    return values, stats, f"reward function {name} {error}; its {n} completions score 0 (counted in reward_errors)"
  nones = [i for i, v in enumerate(got) if v is None]
  values[:] = [np.nan if v is None else v for v in got]
  stats["nones"], stats["errors"] = len(nones), len(bad)
  warn = ""
  if bad:
    warn = (
        f"reward function {name} returned a non-finite value for {len(bad)} of {n} completions; "
        f"they score 0 (counted in reward_errors)"
    )
  return values, stats, warn
