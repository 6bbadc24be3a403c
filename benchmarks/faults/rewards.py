"""Hostile completions through RewardPool workers (huge numbers, deep nesting, invalid UTF-8, a
sympy hang): reward 0, bounded time and memory, and the pool still scores correctly afterwards."""

from __future__ import annotations

import time

from benchmarks.faults.harness import row
from benchmarks.faults.registry import Context, scenario

HOSTILE = {
    "huge number": r"\boxed{" + "9" * 200_000 + "}",
    "huge power tower": r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{} nested 10,000 deep": "\\boxed{" * 10_000 + "5" + "}" * 10_000,
    "1 MB string": "x" * (1 << 20) + r" \boxed{6}",
    "invalid UTF-8": b"\xff\xfe\xc3\x28 \\boxed{\xed\xa0\x80 6}",
    "sympy hang": r"\boxed{10^{10^{10}} - 10^{10^{10}} + \gcd(10^{10^{10}}, 2)}",
}


def _rss_mb(pids) -> dict:
  import psutil

  out = {}
  for pid in pids:
    try:
      out[pid] = psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
      pass
  return out


def hostile_rewards(*, rounds=3, workers=2, timeout_s=5.0) -> dict:
  import psutil

  from ict_jax.rewards import RewardPool

  me = psutil.Process()
  texts, golds = list(HOSTILE.values()), ["7"] * len(HOSTILE)
  with RewardPool(num_workers=workers, timeout_s=timeout_s, max_memory_mb=2048) as pool:
    pool.score_batch("math", [r"\boxed{7}"], ["7"])  # warm: the workers imported sympy
    base = {"parent": me.memory_info().rss / 2**20, "workers": sum(_rss_mb(c.pid for c in me.children()).values())}
    times, all_rewards, stats = [], [], []
    for _ in range(rounds):
      t0 = time.monotonic()
      rewards, st = pool.score_batch("math", texts, golds)
      times.append(time.monotonic() - t0)
      all_rewards.append(rewards.tolist())
      stats.append({k: st[k] for k in ("timeouts", "errors", "respawns")})
    sane, _ = pool.score_batch("math", [r"\boxed{7}"], ["7"])  # still answers correctly
    after = {
        "parent": me.memory_info().rss / 2**20,
        "workers": sum(_rss_mb(c.pid for c in me.children()).values()),
        "max_worker": max(_rss_mb(c.pid for c in me.children()).values()),
    }
  bound = timeout_s * -(-len(texts) // workers) + 5.0
  ok = (
      all(v == 0.0 for r in all_rewards for v in r)
      and max(times) <= bound
      and sane[0] == 1.0
      and after["parent"] - base["parent"] < 100
      and after["max_worker"] < 2048
  )
  return row(
      "hostile model outputs -> RewardPool",
      f"{', '.join(HOSTILE)}; {rounds} rounds through {workers} workers (timeout {timeout_s} s)",
      f"reward 0 each, every batch < {bound:.0f} s, parent RSS + < 100 MB, workers < 2048 MB",
      f"rewards all 0: {all(v == 0.0 for r in all_rewards for v in r)}; batch s {[round(t, 2) for t in times]}; "
      f"timeouts/errors {[(s['timeouts'], s['errors']) for s in stats]}; parent RSS {base['parent']:.0f} -> "
      f"{after['parent']:.0f} MB; workers {base['workers']:.0f} -> {after['workers']:.0f} MB "
      f"(largest {after['max_worker']:.0f}); then \\boxed{{7}} -> {sane[0]:.0f}",
      ok,
      times=times,
      stats=stats,
  )


@scenario("rewards")
def _run(ctx: Context) -> dict:
  return hostile_rewards()
