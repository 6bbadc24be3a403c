"""Reward worker process: ``python -m ict_jax.rewards.worker FD`` (started by ``RewardPool``).

A fresh interpreter (never a fork of the trainer, which has JAX's threads), talking over the
socket ``FD`` with pickled messages:
  parent -> worker: ``("init", sys_path, max_memory_mb, pickled_rewards | None[, functions])``
                    (functions: ``[(name, spec, pickled callable | None)]``, `functions.RewardFunction.payload`),
                    then items ``(index, kind, completion, gold)`` or function calls
                    ``("call", function index, prompts, completions, columns)``, and ``None`` to stop;
  worker -> parent: ``("ready", -1, 0.0)`` once warm (``("failed", -1, message)`` when a function
                    cannot be loaded), then ``(status, index, reward)`` per item with status "ok",
                    "error" (the verifier raised) or "fatal" (out of memory; exiting), and
                    ``("ok", index, functions.run_call's result)`` per call.
"""

from __future__ import annotations

import math
import pickle
import signal
import sys


def _die_with_parent() -> None:
  """Linux: get SIGKILL when the parent dies, so a hung worker never outlives the trainer."""
  if not sys.platform.startswith("linux"):
    return
  try:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _limit_memory(max_memory_mb: int | None) -> None:
  if not max_memory_mb:
    return
  try:
    import resource

    limit = int(max_memory_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  except (ImportError, ValueError, OSError):
    pass


def _load_functions(payloads: list, conn) -> list | None:
  """The reward functions, loaded from their specs or unpickled; None (after telling the parent,
  with the function's name) when one cannot be."""
  from ict_jax.rewards.functions import load

  fns = []
  for name, spec, blob in payloads:
    try:
      fns.append(load(spec) if spec else pickle.loads(blob))
    except BaseException as e:  # pylint: disable=broad-except  (ConfigError, or the unpickling's)
      conn.send(("failed", -1, f"reward function {name}: {type(e).__name__}: {str(e)[:300]}"))
      return None
  return fns


def serve(conn) -> None:
  """Initialise from the first message, warm up, then score items until ``None`` or EOF."""
  try:
    tag, sys_path, max_memory_mb, pickled_rewards, *functions = conn.recv()
  except (EOFError, OSError):
    return
  if tag != "init":
    raise RuntimeError(f"ict_jax.rewards.worker: expected an init message, got {tag!r}")
  sys.path[:0] = [p for p in sys_path if p not in sys.path]
  _limit_memory(max_memory_mb)
  rewards = pickle.loads(pickled_rewards) if pickled_rewards is not None else None
  fns = _load_functions(functions[0] if functions else [], conn)
  if fns is None:
    return

  from ict_jax.rewards.functions import run_call
  from ict_jax.rewards.math import warm_up
  from ict_jax.rewards.registry import score

  warm_up()
  conn.send(("ready", -1, 0.0))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    if msg[0] == "call":
      _, index, prompts, completions, columns = msg
      try:
        conn.send(("ok", index, run_call(fns[index], prompts, completions, columns)))
      except MemoryError:
        conn.send(("fatal", index, 0.0))
        return
      continue
    index, kind, completion, gold = msg
    try:
      value = score(kind, completion, gold, rewards)
      if not math.isfinite(value):
        raise ValueError("reward is not finite")
      conn.send(("ok", index, value))
    except MemoryError:
      conn.send(("fatal", index, 0.0))
      return  # a fresh worker is safer than one that ran out of memory
    except Exception:  # never repr() the exception: it may hold a huge sympy object
      conn.send(("error", index, 0.0))


def main(argv: list[str] | None = None) -> None:
  from multiprocessing.connection import Connection

  argv = sys.argv[1:] if argv is None else argv
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  _die_with_parent()
  serve(Connection(int(argv[0])))


if __name__ == "__main__":
  main()
