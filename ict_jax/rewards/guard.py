"""Refuse to let sympy evaluate expressions whose numbers are absurdly large.

``10^{10^{10^{10}}}`` parses in milliseconds (unevaluated) but comparing it hangs sympy for ever
while it builds a 10^10-digit integer. ``is_safe`` walks a parsed expression once, iteratively,
and bounds ``A(x) >= |log10 |x||`` for every sub-expression without computing anything big:

- rational p/q: ``max(log10|p|, log10 q)`` (bit lengths for huge ones); float: its binary
  exponent;
  symbols and constants (pi, e, i): 1;
- ``a + b``: ``A(a) + A(b) + log10(n)`` (sums of exact numbers cannot get smaller than that);
  ``a * b``: ``A(a) + A(b)``; ``b ** e`` and ``exp(e)``: ``10 ** A(e) * A(b)``;
- factorial-like functions of n: ``10 ** A(n) * A(n)`` (n! <= n^n); any other function demands
  ``A(argument) <= MAX_FUNCTION_ARG_LOG10`` (``sin(10^{10^5})`` is slow to reduce);
- sums, products, integrals and limits are refused outright (their evaluation is unbounded).

An expression is safe when every bound stays under ``max_log10`` and it has at most ``max_nodes``
nodes; chains of small integer powers stay tight (``2^{2^{2^2}} = 65536`` gets A = 4.82).
"""

from __future__ import annotations

import math
from typing import Any

MAX_LOG10 = 10_000  # about 10,000 digits; math-verify compares such numbers in well under 1 s
MAX_NODES = 2_000
MAX_FUNCTION_ARG_LOG10 = 300.0
_LOG10_2 = math.log10(2.0)
_FACTORIAL_LIKE = frozenset(
    {
        "factorial",
        "factorial2",
        "subfactorial",
        "gamma",
        "loggamma",
        "RisingFactorial",
        "FallingFactorial",
        "binomial",
        "catalan",
        "fibonacci",
        "lucas",
        "bell",
        "bernoulli",
        "harmonic",
        "primorial",
        "multinomial",
        "tribonacci",
        "euler",
        "partition",
        "prime",
    }
)
_REFUSED = frozenset(
    {
        "Sum",
        "Product",
        "Integral",
        "Limit",
        "Derivative",
        "Subs",
        "Lambda",
        "Piecewise",
        "ExprCondPair",
        "Order",
        "RootOf",
        "CRootOf",
        "RootSum",
    }
)


class _Unsafe(Exception):
  pass


def _children(node: Any) -> tuple:
  from sympy.matrices import MatrixBase

  if isinstance(node, MatrixBase):
    return tuple(node)
  args = getattr(node, "args", ())
  return args if isinstance(args, tuple) else ()


def _int_log10(n: int) -> float:
  """Upper bound on log10|n| (0 for n = 0), without converting huge ints to float."""
  n = abs(int(n))
  if n <= 1:
    return 0.0
  if n.bit_length() <= 1000:
    return math.log10(n)
  return n.bit_length() * _LOG10_2


def _leaf_bound(node: Any) -> float | None:
  """Bound for atoms; None when the node has to be combined from its children."""
  from sympy import Float, Rational

  if isinstance(node, Rational):  # Integer is a Rational
    return max(_int_log10(node.p), _int_log10(node.q))
  if isinstance(node, Float):
    mpf = node._mpf_
    if len(mpf) != 4 or not mpf[1]:
      return 0.0 if len(mpf) == 4 else 1.0  # zero, or inf/nan
    exponent = mpf[2] + mpf[3]  # |x| lies in [2^(exponent-1), 2^exponent)
    return (abs(exponent) + 1) * _LOG10_2
  if not _children(node):
    return 1.0  # symbols, pi, E, I, oo, strings, booleans
  return None


def _pow_bound(base: float, exponent: float, max_log10: float) -> float:
  if exponent > math.log10(max_log10) + 2:  # |exponent| could exceed 100 * max_log10
    if base == 0.0:
      return 0.0
    raise _Unsafe
  return (10.0**exponent) * base


def _combine(node: Any, bounds: list[float], max_log10: float) -> float:
  name = type(node).__name__
  if name in _REFUSED:
    raise _Unsafe
  if name == "Add":
    return sum(bounds) + math.log10(max(len(bounds), 1))
  if name == "Mul":
    return sum(bounds)
  if name == "Pow":
    return _pow_bound(bounds[0], bounds[1], max_log10)
  if name == "exp":
    return _pow_bound(0.4343, bounds[0], max_log10)
  if name in _FACTORIAL_LIKE:
    top = max(bounds, default=0.0)
    return _pow_bound(max(top, 1.0), top, max_log10) + 1.0
  from sympy import Function

  if isinstance(node, Function):
    if max(bounds, default=0.0) > MAX_FUNCTION_ARG_LOG10:
      raise _Unsafe
    return max(bounds, default=0.0) + 1.0
  return max(bounds, default=0.0)  # tuples, sets, intervals, relations, matrices, ...


def is_safe(expr: Any, *, max_log10: float = MAX_LOG10, max_nodes: int = MAX_NODES) -> bool:
  """True when ``expr`` (a sympy object or a string) can be handed to sympy without blowing up.

  Iterative post-order walk: no recursion, stops after ``max_nodes`` nodes.
  """
  if isinstance(expr, (str, bytes, int, float, bool)) or expr is None:
    return True
  try:
    seen = 0
    stack: list[tuple[Any, bool]] = [(expr, False)]
    results: list[float] = []
    arity: list[int] = []
    while stack:
      node, expanded = stack.pop()
      if not expanded:
        seen += 1
        if seen > max_nodes:
          return False
        leaf = _leaf_bound(node)
        if leaf is not None:
          results.append(leaf)
          continue
        kids = _children(node)
        if type(node).__name__ in _REFUSED:
          return False
        stack.append((node, True))
        arity.append(len(kids))
        stack.extend((kid, False) for kid in reversed(kids))
        continue
      n = arity.pop()
      bounds = results[len(results) - n :]
      del results[len(results) - n :]
      value = _combine(node, bounds, max_log10)
      if not value <= max_log10:  # also catches nan
        return False
      results.append(value)
    return all(r <= max_log10 for r in results)
  except _Unsafe:
    return False
  except (RecursionError, MemoryError, OverflowError, TypeError, ValueError, AttributeError):
    return False
