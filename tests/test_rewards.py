"""Reward functions and RewardPool: tricky answers, hostile outputs, timeouts and crashes."""

import concurrent.futures
import contextlib
import math
import os
import random
import signal
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from ict_jax.eval import checkers
from ict_jax.rewards import (
    MAX_COMPLETION_CHARS,
    REWARDS,
    RewardPool,
    choice_reward,
    extract_boxed,
    extract_choice,
    format_reward,
    math_equal,
    math_reward,
    sanitize,
    score,
)
from ict_jax.rewards.math import math_verify_available

needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed")
DEEP = "\\boxed{" * 10_000 + "}" * 10_000  # innermost box is empty
DEEP_BRACES = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
MEGABYTE = "x" * 1_000_000


# ------------------------------------------------------------------------------- extract_boxed
def _reference_last_box(text: str):
  """Quadratic reference: scan from each box start, the last one that closes wins."""
  best = None
  for name in ("\\boxed{", "\\fbox{"):
    start = text.find(name)
    while start != -1:
      depth, i = 0, start + len(name) - 1
      while i < len(text):
        ch = text[i]
        if ch == "\\":
          i += 2
          continue
        if ch == "{":
          depth += 1
        elif ch == "}":
          depth -= 1
          if depth == 0:
            if best is None or start > best[0]:
              best = (start, text[start + len(name) : i].strip())
            break
        i += 1
      start = text.find(name, start + 1)
  return None if best is None else best[1]


def test_extract_boxed_matches_reference_on_random_strings():
  rng = random.Random(0)
  tokens = ["\\boxed{", "\\fbox{", "{", "}", "}", "a", "1", " ", "\\{", "\\}", "x^{2}"]
  for _ in range(3000):
    text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 14)))
    assert extract_boxed(text) == _reference_last_box(text), repr(text)


@pytest.mark.parametrize(
    "text,want",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{\boxed{7}}", "7"),
        (r"\boxed{ 3 }", "3"),
        (r"\boxed {3}", "3"),
        (r"\boxed 5", "5"),
        (r"\fbox{6}", "6"),
        (r"\boxed{}", ""),
        (r"\boxed{4} and then \boxed{5", "4"),  # unclosed last box: previous closed one
        (r"} } \boxed{8} {", "8"),
        ("no box here", None),
        (r"\boxed{5", None),
        ("", None),
    ],
)
def test_extract_boxed_cases(text, want):
  assert extract_boxed(text) == want


@contextlib.contextmanager
def hang_guard(seconds: int, what: str = ""):
  """Fail (instead of hanging the suite) if the block runs for `seconds`. A hang detector with
  a wide margin (these inputs take well under a second here), not a speed assertion."""

  def alarm(signum, frame):
    raise AssertionError(f"still running after {seconds} s (a hang or super-linear work): {what}")

  old = signal.signal(signal.SIGALRM, alarm)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_extract_boxed_hostile_sizes_are_linear():
  with hang_guard(120, "extract_boxed on MB-sized inputs; quadratic behaviour would take hours"):
    assert extract_boxed(DEEP) == ""
    assert extract_boxed(DEEP_BRACES) == "{" * 10_000 + "1" + "}" * 10_000
    assert extract_boxed(MEGABYTE + r"\boxed{5}") == "5"
    assert extract_boxed("\\boxed{" * 140_000) is None  # 1 MB of unclosed boxes
    assert extract_boxed("{" * 500_000 + "\\boxed{1}" + "}" * 500_000) == "1"


# ---------------------------------------------------------------------------------- math
MATH_CASES = [  # (completion, gold, expected reward, needs math-verify)
    (r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}", 1.0, False),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, False),
    (r"\boxed{1/2}", r"\frac12", 1.0, False),
    (r"\boxed{\tfrac12}", "0.5", 1.0, False),
    (r"\boxed{50\%}", r"\frac{1}{2}", 1.0, False),
    (r"\boxed{50 percent}", "0.5", 1.0, False),
    (r"\boxed{12\text{ cm}}", "12", 1.0, False),
    (r"\boxed{12\mbox{ cm}^2}", "12", 1.0, False),
    (r"\boxed{12 dollars}", "12", 1.0, False),
    (r"\boxed{12 square units}", "12", 1.0, False),
    (r"\boxed{\$1,000}", "1000", 1.0, False),
    (r"\boxed{1{,}000}", "1000", 1.0, False),
    (r"\boxed{5.}", "5", 1.0, False),
    (r"\boxed{45^\circ}", "45", 1.0, False),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0, False),
    (r"\boxed{\frac{-3}{4}}", "-3/4", 1.0, False),
    (r"\boxed{\left(1, 2\right)}", "(1,2)", 1.0, False),
    (r"\boxed{\text{Monday}}", r"\text{monday}", 1.0, False),
    (r"\boxed{3} first, then finally \boxed{4}", "4", 1.0, False),
    (r"\boxed{3} first, then finally \boxed{4}", "3", 0.0, False),
    (r"\boxed{\boxed{5}}", "5", 1.0, False),
    (r"\boxed 5", "5", 1.0, False),
    (r"\fbox{7}", "7", 1.0, False),
    (r"\boxed{4}", "5", 0.0, False),
    (r"\boxed{0.333}", r"\frac13", 0.0, False),
    (r"\boxed{}", "5", 0.0, False),
    (r"\boxed{5", "5", 0.0, False),
    ("no box, the answer is 4", "4", 0.0, False),
    (r"\boxed{1,2}", "12", 0.0, False),  # not a thousands separator: stays a pair
    (r"\boxed{x = 3}", "3", 1.0, True),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0, True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0, True),
    (r"\boxed{1.5\times10^{3}}", "1500", 1.0, True),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0, True),
    (r"\boxed{2^{2^{2^2}}}", "65536", 1.0, True),  # small towers are still evaluated
    (r"\boxed{x^2+2x+2}", "(x+1)^2", 0.0, True),
]


@pytest.mark.parametrize("completion,gold,want,mv", MATH_CASES)
def test_math_reward_table(completion, gold, want, mv):
  if mv and not math_verify_available():
    pytest.skip("math-verify not installed")
  assert math_reward(completion, gold) == want


@pytest.mark.parametrize("completion,gold,want,mv", [c for c in MATH_CASES if not c[3]])
def test_math_equal_without_math_verify(completion, gold, want, mv):
  answer = extract_boxed(completion)
  got = bool(answer) and math_equal(answer, gold, use_math_verify=False)
  assert got == (want == 1.0)


def test_numbers_agree_with_fraction_reference():
  rng = random.Random(1)
  for _ in range(200):
    value = Fraction(rng.randint(-999, 999), rng.choice([1, 2, 4, 5, 8, 10, 20, 25]))
    decimal = f"{float(value):.6f}".rstrip("0").rstrip(".")
    frac = rf"\frac{{{value.numerator}}}{{{value.denominator}}}"
    assert math_equal(decimal, frac, use_math_verify=False), (decimal, frac)
    other = value + Fraction(1, 1000)
    assert not math_equal(decimal, rf"\frac{{{other.numerator}}}{{{other.denominator}}}", use_math_verify=False)


HOSTILE = [
    r"\boxed{9**9**9**9}",
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{10^{10^{10}} - 10^{10^{10}} + 5}",  # equals 5 but is not evaluated
    r"\boxed{\gcd(10^{10^{10}}, 2)}",  # latex2sympy evaluates gcd while parsing
    r"\boxed{\binom{10^{9}}{10^{8}}}",
    r"\boxed{(10^{100})!}",
    r"\boxed{\sin(10^{10^{5}})}",
    r"\boxed{e^{10^{10}}}",
    r"\boxed{\operatorname{zeros}(100000)}",
    r"\boxed{" + "9" * 5000 + "}",
    DEEP,
    DEEP_BRACES,
    "\\boxed{" + "(" * 5000 + "5" + ")" * 5000 + "}",
    MEGABYTE,
    "\\boxed{" * 140_000,
    "\ud800\udfff \\boxed{\ud800}",
]


@needs_math_verify
def test_hostile_answers_are_refused_quickly_in_process():
  for text in HOSTILE:
    with hang_guard(60, text[:60]):
      assert score("math", text, "5") == 0.0


def _random_expr(sympy, rng, depth):
  """A random unevaluated sympy expression of small integers and its exact value (Fraction)."""
  if depth == 0 or rng.random() < 0.25:
    n = rng.randint(1, 40)
    return sympy.Integer(n), Fraction(n)
  op = rng.choice(["add", "mul", "pow"])
  a, va = _random_expr(sympy, rng, depth - 1)
  if op == "pow":
    e = rng.choice([-2, -1, 2, 3])
    return sympy.Pow(a, sympy.Integer(e), evaluate=False), va**e
  b, vb = _random_expr(sympy, rng, depth - 1)
  if op == "add":
    return sympy.Add(a, b, evaluate=False), va + vb
  return sympy.Mul(a, b, evaluate=False), va * vb


def test_guard_bound_never_underestimates():
  sympy = pytest.importorskip("sympy")
  from ict_jax.rewards.guard import is_safe

  rng = random.Random(2)
  checked = 0
  for _ in range(400):
    expr, value = _random_expr(sympy, rng, 3)
    true = abs(math.log10(value.numerator) - math.log10(value.denominator))
    assert is_safe(expr), expr  # small values are always accepted
    if true > 0.5:  # a limit just under the true magnitude must be refused
      assert not is_safe(expr, max_log10=true * 0.999), (expr, true)
      checked += 1
  assert checked > 100


def test_guard_refuses_towers_but_not_small_powers():
  sympy = pytest.importorskip("sympy")
  from ict_jax.rewards.guard import is_safe

  P, I = (lambda b, e: sympy.Pow(b, e, evaluate=False)), sympy.Integer
  assert is_safe(P(I(2), P(I(2), P(I(2), I(2)))))  # 65536
  assert not is_safe(P(I(2), P(I(2), P(I(2), P(I(2), I(2))))))  # 2^65536
  assert not is_safe(P(I(10), P(I(10), I(10))))
  assert is_safe(P(I(10), I(10_000))) and not is_safe(P(I(10), I(10_001)))
  assert not is_safe(sympy.factorial(P(I(10), I(100)), evaluate=False))
  assert not is_safe(sympy.Sum(sympy.Symbol("k"), (sympy.Symbol("k"), 1, 10)))
  assert is_safe("a string") and is_safe(None)


# -------------------------------------------------------------------------------- choice
@pytest.mark.parametrize(
    "completion,want",
    [
        (r"Therefore \boxed{C}", "C"),
        (r"\boxed{(B)}", "B"),
        (r"\boxed{\text{D}}", "D"),
        (r"\boxed{E. 42}", "E"),
        ("The answer is (C).", "C"),
        ("the answer is **J**", "J"),
        ("Answer: B", "B"),
        ("Final answer: (A)", "A"),
        ("So the answer is A, not B as I first thought.\n\nAnswer: D", "D"),
        ("Comparing the options, we pick\n\nC", "C"),
        ("The best option is (G).", "G"),
        ("Carbon is the element. Bromine is not. A lot of Ions.", None),
        ("I think this is a hard question", None),
        ("The answer is a number", None),
        ("The answer is K", None),
        (r"\boxed{Carbon}", None),
        ("", None),
    ],
)
def test_extract_choice(completion, want):
  assert extract_choice(completion) == want


def test_choice_reward_and_gold_forms():
  assert choice_reward("The answer is (C).", "C") == 1.0
  assert choice_reward("The answer is (C).", "(c)") == 1.0
  assert choice_reward("The answer is (C).", 2) == 1.0
  assert choice_reward("The answer is (C).", "D") == 0.0
  assert choice_reward("The answer is (C).", "Z") == 0.0
  assert choice_reward("Carbon", "C") == 0.0
  with hang_guard(60, "choice_reward on 1 MB inputs"):
    assert choice_reward(MEGABYTE + " The answer is (B)", "B") == 1.0
    assert choice_reward("(" * 1_000_000, "A") == 0.0


# -------------------------------------------------------------------------------- format
@pytest.mark.parametrize(
    "completion,want",
    [
        (r"First add 2 and 3 to get 5. So \boxed{5}", 1.0),
        (r"\boxed{5}", 0.0),  # no reasoning
        (r"Some reasoning here. \boxed{5} and \boxed{6}", 0.0),
        (r"Some reasoning here. \boxed{\boxed{5}}", 0.0),
        (r"Some reasoning here. \boxed{}", 0.0),
        (r"Some reasoning here. \boxed{5", 0.0),
        ("Some reasoning here, no box.", 0.0),
    ],
)
def test_format_reward(completion, want):
  assert format_reward(completion) == want


# ------------------------------------------------------------------------- registry, score
def test_registry_and_score():
  assert set(REWARDS) == {"math", "choice", "format", "answer", "chain_steps"}
  assert score("answer", " 8", "8") == 1.0 and score("answer", "18", "8") == 0.0
  assert score("chain_steps", "1+2=3,3+4=7;\\boxed{7}", "1+2+4=7") == 1.0
  assert score("math", r"so \boxed{\frac{1}{2}}", "0.5") == 1.0
  assert score("choice", "Answer: B", "B") == 1.0
  assert score("format", r"Reasoning first, then \boxed{1}", None) == 1.0
  with pytest.raises(KeyError, match="unknown reward kind"):
    score("nope", "x", "y")


def test_sanitize_truncates_and_repairs_text():
  assert sanitize(b"\xff\xfe \\boxed{0.5}") == "\ufffd\ufffd \\boxed{0.5}"
  repaired = sanitize("\ud800 ok")
  repaired.encode("utf-8")  # would raise on a lone surrogate
  assert repaired.endswith(" ok")
  long = "a" * 50_000 + "END"
  assert sanitize(long) == long[-MAX_COMPLETION_CHARS:]
  assert score("math", b"\xff\xfe so \\boxed{0.5}", "1/2") == 1.0
  # documented consequence: only the last 10k characters are looked at
  assert score("math", r"\boxed{5}" + " " * (MAX_COMPLETION_CHARS + 10), "5") == 0.0
  assert score("math", MEGABYTE + r"\boxed{5}", "5") == 1.0


def test_eval_checkers_map_answer_types():
  assert checkers.reward_kind("math_boxed") == "math"
  assert checkers.reward_kind("choice") == "choice"
  assert checkers.checker("math_boxed") is math_reward
  assert checkers.is_correct("math_boxed", r"\boxed{0.5}", r"\frac12")
  assert not checkers.is_correct("choice", "Answer: A", "B")
  with pytest.raises(KeyError, match="unknown answer type"):
    checkers.reward_kind("essay")


# ---------------------------------------------------------------------------------- pool
# Custom verifiers run inside the workers; they must be importable by name (this module).
def sleepy_reward(completion, gold):
  time.sleep(60)
  return 1.0


def raising_reward(completion, gold):
  raise ValueError("verifier bug")


def crashing_reward(completion, gold):
  os._exit(3)


def memory_hog_reward(completion, gold):
  return float(len(bytearray(8 * 1024**3)))  # 8 GiB: over the worker's address-space limit


def unguarded_math_verify(completion, gold):
  """math-verify without our guards or its own timeouts: really hangs on huge towers."""
  from math_verify import parse, verify

  return float(verify(parse(gold, parsing_timeout=None), parse(completion, parsing_timeout=None), timeout_seconds=None))


POOL_TIMEOUT_S = 10.0  # generous: the pool tests must not depend on the machine's speed


@pytest.fixture(scope="module")
def pool():
  rewards = dict(
      REWARDS,
      sleep=sleepy_reward,
      raises=raising_reward,
      crash=crashing_reward,
      hog=memory_hog_reward,
      unguarded=unguarded_math_verify,
  )
  with RewardPool(num_workers=2, timeout_s=POOL_TIMEOUT_S, rewards=rewards, max_memory_mb=2048) as p:
    yield p


def test_pool_scores_like_in_process(pool):
  cases = [c for c in MATH_CASES if not c[3] or math_verify_available()]
  rewards, stats = pool.score_batch("math", [c[0] for c in cases], [c[1] for c in cases])
  assert rewards.dtype == np.float32 and rewards.shape == (len(cases),)
  np.testing.assert_array_equal(rewards, [c[2] for c in cases])
  assert stats["n"] == len(cases) and stats["timeouts"] == 0 and stats["errors"] == 0
  rewards, _ = pool.score_batch("choice", ["Answer: B", "Carbon", b"\xff (C)"], ["B", "C", "C"])
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0])


@needs_math_verify
def test_pool_hostile_outputs_get_zero_without_timeouts(pool):
  rewards, stats = pool.score_batch("math", HOSTILE, ["5"] * len(HOSTILE))
  np.testing.assert_array_equal(rewards, np.zeros(len(HOSTILE), np.float32))
  assert stats["timeouts"] == 0 and stats["errors"] == 0  # the guards refuse them, cheaply


def test_pool_kills_hanging_verifiers_and_recovers(pool):
  t0 = time.monotonic()
  rewards, stats = pool.score_batch("sleep", ["a", "b"], ["x", "x"])
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(rewards, [0.0, 0.0])
  assert stats["timeouts"] == 2 and stats["respawns"] == 2
  assert POOL_TIMEOUT_S <= elapsed < 2 * POOL_TIMEOUT_S  # both killed in parallel
  rewards, stats = pool.score_batch("math", [r"\boxed{3}"] * 3, ["3"] * 3)  # replacements work
  np.testing.assert_array_equal(rewards, [1.0, 1.0, 1.0])
  assert stats["timeouts"] == 0


@needs_math_verify
def test_pool_kills_a_real_sympy_hang(pool):
  hang = r"$10^{10^{10}} - 10^{10^{10}}$"
  rewards, stats = pool.score_batch("unguarded", [hang, r"$\frac{1}{2}$"], ["$0$", "$0.5$"])
  np.testing.assert_array_equal(rewards, [0.0, 1.0])
  assert stats["timeouts"] == 1


def test_pool_counts_errors_crashes_and_memory(pool):
  rewards, stats = pool.score_batch("raises", ["a", "b", "c"], ["x", "y", "z"])
  np.testing.assert_array_equal(rewards, [0.0, 0.0, 0.0])
  assert stats["errors"] == 3 and stats["timeouts"] == 0
  rewards, stats = pool.score_batch("crash", ["a"], ["x"])
  assert rewards[0] == 0.0 and stats["errors"] == 1 and stats["respawns"] == 1
  rewards, stats = pool.score_batch("hog", ["a"], ["x"])
  assert rewards[0] == 0.0 and stats["errors"] == 1
  rewards, stats = pool.score_batch("math", [r"\boxed{3}", 123], ["3", "3"])  # not text
  np.testing.assert_array_equal(rewards, [1.0, 0.0])
  assert stats["errors"] == 1


def test_pool_argument_errors(pool):
  with pytest.raises(KeyError, match="unknown reward kind"):
    pool.score_batch("nope", ["a"], ["b"])
  with pytest.raises(ValueError, match="1 completions but 2 golds"):
    pool.score_batch("math", ["a"], ["b", "c"])
  with pytest.raises(ValueError, match="num_workers"):
    RewardPool(num_workers=-1)
  with pytest.raises(ValueError, match="timeout_s"):
    RewardPool(num_workers=0, timeout_s=0)
  with pytest.raises(ValueError, match="module-level functions"):
    RewardPool(num_workers=1, rewards={"lambda": lambda c, g: 1.0})


def test_inline_pool_budget_and_close():
  def slow(completion, gold):
    time.sleep(2.5)
    return 1.0

  with RewardPool(num_workers=0, timeout_s=2.0, rewards=dict(REWARDS, slow=slow)) as p:
    rewards, stats = p.score_batch("slow", ["a", "b"], ["x", "y"])
    np.testing.assert_array_equal(rewards, [0.0, 0.0])
    assert stats["timeouts"] == 2
    completions = [r"\boxed{\dfrac{1}{2}}", r"\boxed{2}"]
    rewards, stats = p.score_batch("math", completions, ["0.5", "3"])
    np.testing.assert_array_equal(rewards, [1.0, 0.0])
    assert stats["timeouts"] == 0 and stats["errors"] == 0
  with pytest.raises(RuntimeError, match="closed"):
    p.score_batch("math", ["a"], ["b"])


def test_submitted_batches_score_as_score_batch_in_order(pool):
  cases = [c for c in MATH_CASES if not c[3] or math_verify_available()]
  first = pool.submit("math", [c[0] for c in cases], [c[1] for c in cases])
  second = pool.submit("choice", ["Answer: B", "Carbon"], ["B", "C"])
  rewards, stats = first.result()
  np.testing.assert_array_equal(rewards, [c[2] for c in cases])
  assert stats["n"] == len(cases) and stats["timeouts"] == stats["errors"] == 0
  np.testing.assert_array_equal(second.result()[0], [1.0, 0.0])


def test_close_stops_the_batches_being_scored_in_the_background():
  """close() with batches submitted: the one being scored stops at its next item, the queued
  ones never start, and no verifier runs once close() has returned."""
  scored, started = [], threading.Event()

  def slow(completion, gold):
    started.set()
    time.sleep(0.05)
    scored.append(completion)
    return 1.0

  p = RewardPool(num_workers=0, rewards=dict(REWARDS, slow=slow))
  futures = [p.submit("slow", [f"{i}.{j}" for j in range(100)], ["x"] * 100) for i in range(2)]
  started.wait()
  p.close()
  done = len(scored)
  for f in futures:
    with pytest.raises(concurrent.futures.CancelledError):
      f.result()
  assert 0 < done < 100 and len(scored) == done
  with pytest.raises(RuntimeError, match="closed"):
    p.submit("math", ["a"], ["b"])


def test_rewards_import_neither_jax_nor_sympy_eagerly():
  import subprocess
  import sys

  code = (
      "import sys, ict_jax.rewards, ict_jax.eval.passk, ict_jax.eval.checkers; "
      "bad = [m for m in ('jax', 'sympy', 'math_verify') if m in sys.modules]; "
      "assert not bad, bad"
  )
  subprocess.run(
      [sys.executable, "-c", code],
      check=True,
      timeout=60,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
