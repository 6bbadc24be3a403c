"""Run reward verifiers outside the jitted step, in worker processes that can be killed.

A sympy call can hang or eat memory on hostile model output and cannot be interrupted from
another thread, so each verification runs in a worker process with a per-item deadline: a worker
that overruns is killed (SIGKILL) and replaced, the item gets reward 0 and is counted as a timeout.
A verifier that raises, or a worker that dies, gives reward 0 and counts as an error. Inputs are
passed through ``registry.sanitize`` in the parent (valid UTF-8, last ``max_chars`` characters), and
each worker runs under an address-space limit (``max_memory_mb``), so memory stays bounded.

Workers are fresh interpreters (``python -m ict_jax.rewards.worker``, see ``worker.py``) joined by
a socket pair: started with fork+exec, never a bare fork of the trainer (JAX is multithreaded,
forking it without exec is unsafe), and unlike
multiprocessing's "spawn"/"forkserver" they do not re-import the trainer's ``__main__`` module
(which would load JAX in every worker) and need no ``if __name__ == "__main__"`` guard. A worker
takes about a second to start (it imports sympy and math-verify); replacements start in the
background while the other workers carry on. On Linux a worker is SIGKILLed if the parent dies.

Reward functions with TRL's signature (``functions=``, ``rewards/functions.py``) run in the same
workers, one call a function and batch (``score_functions`` / ``submit_functions``), the calls of a
batch on as many workers at once; a call of ``n`` completions has ``n * timeout_s`` seconds. A
worker loads a function named by a spec itself and unpickles a callable; one that cannot is a
start-up failure naming it.

``num_workers=0`` runs in-process for tests and debugging: there is no way to stop a running
verifier without signals, so an item that overruns ``timeout_s`` is detected after it returns,
gets reward 0 and counts as a timeout; hostile inputs are still cheap thanks to the guards in
``rewards.math``, but a genuinely hanging verifier would hang the caller.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Sequence

import numpy as np

from ict_jax.rewards.functions import RewardFunction, run_call, settle
from ict_jax.rewards.registry import MAX_COMPLETION_CHARS, REWARDS, RewardFn, sanitize, score

_THREAD = "ict_jax-rewards"  # the thread scoring `submit`ted batches
_POLL_S = 0.5  # the longest wait for a reply: how soon a batch scored in the background sees close()
log = logging.getLogger("ict_jax.rewards")


def _pythonpath() -> str:
  """PYTHONPATH for a worker: the directory holding ``ict_jax`` first, then the caller's."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  rest = os.environ.get("PYTHONPATH", "")
  return root + (os.pathsep + rest if rest else "")


class _Worker:

  def __init__(self, proc: subprocess.Popen, conn: mp_connection.Connection, deadline: float):
    self.proc, self.conn, self.deadline = proc, conn, deadline
    self.state = "starting"  # starting -> idle <-> busy
    self.index = -1


class _Items:
  """Where `_poll` puts the replies of verifier items: their rewards and the batch's counts."""

  def __init__(self, out: np.ndarray, stats: dict[str, int]):
    self.out, self.stats = out, stats

  def reply(self, index: int, status: str, value) -> None:
    self.out[index] = value if status == "ok" else 0.0
    if status != "ok":
      self.stats["errors"] += 1

  def lost(self, index: int, why: str) -> None:  # why: "timeouts" (killed) or "errors" (died)
    self.out[index] = 0.0
    self.stats[why] += 1


class _Calls:
  """Where `_poll` puts the replies of function calls: function index -> `run_call`'s result, or
  "timeouts" / "errors" when its worker was killed or died."""

  def __init__(self):
    self.results: dict[int, tuple | str] = {}

  def reply(self, index: int, status: str, value) -> None:
    self.results[index] = value if status == "ok" else "errors"

  def lost(self, index: int, why: str) -> None:
    self.results[index] = why


def _kill_all(procs: list) -> None:
  """Finaliser: SIGKILL every worker still running (the pool was not closed)."""
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


class RewardPool:
  """Process pool scoring ``(kind, completion, gold)`` items with a per-item timeout.

  >>> with RewardPool(num_workers=4, timeout_s=5.0) as pool:
  ...     rewards, stats = pool.score_batch("math", completions, golds)
  ...     future = pool.submit("math", completions, golds)  # scored while the caller goes on

  ``rewards`` overrides the registry (``{kind: fn(completion, gold) -> float}``; functions must be
  importable by name in a fresh interpreter so that they can be pickled to the workers).
  ``functions`` are the run's TRL-style reward functions (`score_functions`).
  """

  def __init__(
      self,
      num_workers: int = 4,
      timeout_s: float = 5.0,
      *,
      max_chars: int = MAX_COMPLETION_CHARS,
      max_memory_mb: int | None = 4096,
      rewards: dict[str, RewardFn] | None = None,
      functions: Sequence[RewardFunction] = (),
      startup_timeout_s: float = 120.0,
  ):
    if num_workers < 0:
      raise ValueError(f"RewardPool: num_workers must be >= 0, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
    self.num_workers, self.timeout_s, self.max_chars = num_workers, float(timeout_s), max_chars
    self.max_memory_mb, self.startup_timeout_s = max_memory_mb, startup_timeout_s
    self.rewards = dict(REWARDS if rewards is None else rewards)
    self.functions = tuple(functions)
    custom = rewards is not None and num_workers > 0
    try:
      self._pickled_rewards = pickle.dumps(self.rewards) if custom else None
    except (pickle.PicklingError, AttributeError, TypeError) as e:
      raise ValueError(
          "RewardPool: custom rewards must be module-level functions that a " f"fresh interpreter can import ({e})"
      ) from e
    try:
      self._function_payloads = [f.payload() for f in self.functions] if num_workers else []
    except (pickle.PicklingError, AttributeError, TypeError) as e:
      raise ValueError(f"RewardPool: a reward function cannot be pickled to the workers ({e})") from e
    self._lock = threading.Lock()
    self._workers: list[_Worker] = []
    self._procs: list[subprocess.Popen] = []  # every worker ever started, for the finaliser
    self._finalizer = weakref.finalize(self, _kill_all, self._procs)
    self._closed = False
    self._cancel = threading.Event()  # close() while the scoring thread runs a batch
    self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # runs `submit`ted batches
    self.total_respawns = 0
    if num_workers:
      self._workers = [self._spawn() for _ in range(num_workers)]
      self._wait_started()

  # -- worker management -------------------------------------------------------------------
  def _spawn(self) -> _Worker:
    ours, theirs = socket.socketpair()
    try:
      proc = subprocess.Popen(
          [sys.executable, "-m", "ict_jax.rewards.worker", str(theirs.fileno())],
          pass_fds=(theirs.fileno(),),
          stdin=subprocess.DEVNULL,
          close_fds=True,
          env=dict(os.environ, PYTHONPATH=_pythonpath()),
      )
    finally:
      theirs.close()
    self._procs[:] = [p for p in self._procs if p.poll() is None] + [proc]
    conn = mp_connection.Connection(ours.detach())
    init = ("init", list(sys.path), self.max_memory_mb, self._pickled_rewards)
    conn.send(init + (self._function_payloads,) if self.functions else init)
    return _Worker(proc, conn, time.monotonic() + self.startup_timeout_s)

  def _kill(self, w: _Worker) -> None:
    if w.proc.poll() is None:
      w.proc.kill()
    w.proc.wait()
    w.conn.close()

  def _replace(self, w: _Worker) -> None:
    self._kill(w)
    self._workers[self._workers.index(w)] = self._spawn()
    self.total_respawns += 1

  def _startup_failed(self, w: _Worker, why: str) -> None:
    code = w.proc.poll()
    self.close()
    raise RuntimeError(
        f"RewardPool: a reward worker failed to start ({why}, exit code "
        f"{code}); "
        "see its traceback above; custom reward functions must be importable"
    )

  def _wait_started(self) -> None:
    while any(w.state == "starting" for w in self._workers):
      self._poll(_Items(np.zeros(0, np.float32), {}))

  def _poll(self, sink: _Items | _Calls) -> None:
    """Wait for one round of replies or deadlines and handle them."""
    active = [w for w in self._workers if w.state in ("starting", "busy")]
    if not active:
      return
    wait_s = max(0.0, min(min(w.deadline for w in active) - time.monotonic(), _POLL_S))
    ready = set(mp_connection.wait([w.conn for w in active], timeout=wait_s))
    for w in active:
      if w.conn not in ready:
        continue
      try:
        status, index, value = w.conn.recv()
      except (EOFError, OSError):  # the worker died
        if w.state == "starting":
          self._startup_failed(w, "died")
        sink.lost(w.index, "errors")
        self._replace(w)
        continue
      if w.state == "starting":
        if status == "failed":  # a reward function could not be loaded: the message names it
          self._startup_failed(w, value)
        w.state = "idle"
        continue
      sink.reply(index, status, value)
      w.state, w.index = "idle", -1
      if status == "fatal":  # the worker is exiting (it ran out of memory)
        self._replace(w)
    now = time.monotonic()
    for w in list(self._workers):
      if w.state == "busy" and now > w.deadline:
        sink.lost(w.index, "timeouts")
        self._replace(w)
      elif w.state == "starting" and now > w.deadline:
        self._startup_failed(w, f"not ready after {self.startup_timeout_s} s")

  # -- scoring -----------------------------------------------------------------------------
  def score_batch(
      self, kind: str, completions: Sequence[str | bytes], golds: Sequence[Any]
  ) -> tuple[np.ndarray, dict[str, float]]:
    """Rewards ``float32[N]`` for ``N`` completions and stats
    ``{"n", "timeouts", "errors", "respawns", "seconds"}``. Never hangs and never raises for
    model output; raises ``KeyError`` for an unknown kind and ``ValueError`` for mismatched
    lengths."""
    if self._closed:
      raise RuntimeError("RewardPool.score_batch: the pool is closed")
    if kind not in self.rewards:
      raise KeyError(
          f"RewardPool.score_batch: unknown reward kind {kind!r}; " f"expected one of {sorted(self.rewards)}"
      )
    if len(completions) != len(golds):
      raise ValueError(f"RewardPool.score_batch: {len(completions)} completions but " f"{len(golds)} golds")
    with self._lock:
      start, respawns0 = time.monotonic(), self.total_respawns
      out = np.zeros(len(completions), np.float32)
      stats = {"n": len(completions), "timeouts": 0, "errors": 0}
      items = collections.deque()
      for i, (c, g) in enumerate(zip(completions, golds)):
        try:
          text_gold = isinstance(g, (str, bytes))
          items.append((i, sanitize(c, self.max_chars), sanitize(g, self.max_chars) if text_gold else g))
        except TypeError:
          stats["errors"] += 1
      if self.num_workers == 0:
        self._run_inline(kind, items, out, stats)
      else:
        try:
          self._run_workers(kind, items, out, stats)
        except BaseException:  # e.g. KeyboardInterrupt: no stale replies in the next batch
          if not self._closed and not self._cancel.is_set():
            for w in list(self._workers):
              if w.state == "busy":
                self._replace(w)
          raise
      stats["respawns"] = self.total_respawns - respawns0
      stats["seconds"] = time.monotonic() - start
      return out, stats

  def submit(self, kind: str, completions: Sequence[str | bytes], golds: Sequence[Any]) -> concurrent.futures.Future:
    """`score_batch` in the pool's scoring thread, returning at once: a Future of its
    ``(rewards, stats)``. Batches are scored one after the other in submission order, while the
    caller goes on (e.g. fetching the next decode sub-batch). Errors surface at ``result()``."""
    if self._closed:
      raise RuntimeError("RewardPool.submit: the pool is closed")
    return self._executor().submit(self.score_batch, kind, list(completions), list(golds))

  def score_functions(
      self, prompts: Sequence[Any], completions: Sequence[str], columns: dict[str, Sequence[Any]]
  ) -> dict[str, tuple[np.ndarray, dict[str, float]]]:
    """Each of the pool's reward functions on one batch -> {name: (values float32[N], NaN where it
    returned None; stats {"n", "nones", "timeouts", "errors", "respawns", "seconds"})}: one call a
    function, on as many workers at once, each with ``N * timeout_s`` seconds. A failure is logged
    with the function's name and its completions score 0 (`functions.settle`); never raises for
    what a function does, ``ValueError`` for columns not aligned with the completions."""
    if self._closed:
      raise RuntimeError("RewardPool.score_functions: the pool is closed")
    n = len(completions)
    prompts, completions = list(prompts), list(completions)
    columns = {k: list(v) for k, v in columns.items()}
    for key, values in [("prompts", prompts), *columns.items()]:
      if len(values) != n:
        raise ValueError(f"RewardPool.score_functions: {n} completions but {len(values)} {key}")
    with self._lock:
      start, respawns0 = time.monotonic(), self.total_respawns
      calls = _Calls()
      if self.num_workers == 0:
        self._call_inline(prompts, completions, columns, calls)
      else:
        message = lambda item: ("call", item[0], prompts, completions, columns)
        items = collections.deque((k,) for k in range(len(self.functions)))
        try:
          self._dispatch(items, message, lambda item: self.timeout_s * max(n, 1), calls)
        except BaseException:  # as score_batch: no stale replies in the next batch
          if not self._closed and not self._cancel.is_set():
            for w in list(self._workers):
              if w.state == "busy":
                self._replace(w)
          raise
      out = {}
      for k, f in enumerate(self.functions):
        values, stats, warning = settle(f.name, calls.results.get(k, "errors"), n)
        if warning:
          log.warning("%s", warning)
        out[f.name] = (values, {"n": n, **stats})
      seconds, respawns = time.monotonic() - start, self.total_respawns - respawns0
      for _, stats in out.values():
        stats.update(seconds=seconds, respawns=respawns)
      return out

  def submit_functions(
      self, prompts: Sequence[Any], completions: Sequence[str], columns: dict[str, Sequence[Any]]
  ) -> concurrent.futures.Future:
    """`score_functions` in the pool's scoring thread (in order with `submit`), returning at once."""
    if self._closed:
      raise RuntimeError("RewardPool.submit_functions: the pool is closed")
    return self._executor().submit(self.score_functions, list(prompts), list(completions), dict(columns))

  def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._thread is None:
      self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_THREAD)
    return self._thread

  def _call_inline(self, prompts: list, completions: list, columns: dict, calls: _Calls) -> None:
    """In-process calls: an overrun is seen after the call returns (nothing can stop it)."""
    for k, f in enumerate(self.functions):
      if self._cancel.is_set():
        raise concurrent.futures.CancelledError("RewardPool: closed while scoring")
      t0 = time.monotonic()
      result = run_call(f.fn, prompts, completions, columns)
      overran = time.monotonic() - t0 > self.timeout_s * max(len(completions), 1)
      calls.results[k] = "timeouts" if overran else result

  def _run_inline(self, kind: str, items: collections.deque, out: np.ndarray, stats: dict[str, int]) -> None:
    for index, completion, gold in items:
      if self._cancel.is_set():
        raise concurrent.futures.CancelledError("RewardPool: closed while scoring")
      t0 = time.monotonic()
      try:
        value = score(kind, completion, gold, self.rewards)
        ok = math.isfinite(value)
      except Exception:
        ok, value = False, 0.0
      if time.monotonic() - t0 > self.timeout_s:
        stats["timeouts"] += 1
      elif not ok:
        stats["errors"] += 1
      else:
        out[index] = value

  def _run_workers(self, kind: str, items: collections.deque, out: np.ndarray, stats: dict[str, int]) -> None:
    message = lambda item: (item[0], kind, item[1], item[2])
    self._dispatch(items, message, lambda item: self.timeout_s, _Items(out, stats))

  def _dispatch(self, items: collections.deque, message, timeout_s, sink: _Items | _Calls) -> None:
    """Hand `items` (index first) to idle workers as `message(item)`, each with `timeout_s(item)`
    seconds, until every reply or deadline is in `sink`."""
    while items or any(w.state == "busy" for w in self._workers):
      if self._cancel.is_set():
        raise concurrent.futures.CancelledError("RewardPool: closed while scoring")
      for w in self._workers:
        if not items:
          break
        if w.state != "idle":
          continue
        item = items.popleft()
        try:
          w.conn.send(message(item))
        except (BrokenPipeError, EOFError, OSError):  # died while idle: retry elsewhere
          items.appendleft(item)
          self._replace(w)
          continue
        w.state, w.index = "busy", item[0]
        w.deadline = time.monotonic() + timeout_s(item)
      self._poll(sink)

  # -- lifetime ----------------------------------------------------------------------------
  def close(self) -> None:
    """Stop all workers: ask politely, SIGKILL what still runs after 2 s (idempotent)."""
    if self._closed:
      return
    if self._thread is not None:  # a batch being scored stops at its next poll; queued ones are dropped
      self._cancel.set()
      inside = threading.current_thread().name.startswith(_THREAD)  # a worker failed to start
      self._thread.shutdown(wait=not inside, cancel_futures=True)
    self._closed = True
    for w in self._workers:
      if w.state != "idle":  # still importing, or busy on an item: nothing to wait for
        self._kill(w)
        continue
      try:
        w.conn.send(None)
      except (BrokenPipeError, EOFError, OSError):
        pass
    deadline = time.monotonic() + 2.0
    for w in self._workers:
      try:
        w.proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
      self._kill(w)
    self._workers = []
    self._finalizer()

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
