"""The house of issue 39 ("A house a newcomer can extend"), checked on the source with `ast`
(nothing is imported; no JAX): every function and method in ict_jax/ at most 120 lines, every .py
file in ict_jax/, benchmarks/ and tests/ at most 600 lines, no circle in ict_jax's imports, and no
upward arrow between its layers (`LAYERS`)."""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "ict_jax"
MAX_FUNCTION_LINES = 120
MAX_FILE_LINES = 600
SIZED_DIRS = ("ict_jax", "benchmarks", "tests")

# ict_jax's layers, bottom first. A unit is a top-level module or subpackage of ict_jax ("" is the
# package itself: its lazily resolved public names); a unit may import units of its own layer and
# of lower layers, never of a higher one, at module level or inside a function. The layers are
# what each unit uses: the config schema reads its choices from the registries that define them
# (selection, grpo, rewards, models, data's prompt styles), so it sits with the learner, and a
# lower unit that raises its ConfigError takes it from `errors`; the checkpoint store is a leaf library (Orbax, files) that setup reads a saved
# run's config with and the learner writes through; the reward functions and the advantages are libraries under the collector,
# which calls them while it samples (a step's data flows data -> collector -> rewards ->
# advantages -> learner.update -> checkpoint, each stage consuming the one before); the train step
# and its selection above the batch they take; the run (build_run, the Learner and its hooks)
# composes them all with the checkpoint, the run services and the periodic evaluation; the tools
# that plan, inspect or export a run sit above the run they read, and train.py drives it.
LAYERS = (
    (
        "foundation",
        (
            "errors",
            "cpu_paths",
            "models",
            "lora",
            "sharding",
            "storage",
            "tokenizer",
            "task_vocab",
            "hf_tokenizer",
            "hf_tokenizer_files",
        ),
    ),
    ("data", ("data",)),
    ("checkpoint", ("checkpoint",)),
    ("rewards", ("rewards", "answer_positions")),
    ("advantages", ("grpo",)),
    ("collector", ("sampling", "batch", "rollout")),
    (
        "learner",  # and its configuration, whose fields take their choices from these registries
        (
            "token_masks",
            "selection",
            "lm_head",
            "packing",
            "train_step",
            "warm_start",
            "setup",
            "config",
            "cli_config",
            "paper_config",
            "configs",
        ),
    ),
    ("run services", ("health", "logs", "throughput", "preemption", "token_view")),
    ("evaluation", ("eval",)),
    ("run", ("build", "hooks", "learner", "run_hooks")),
    ("tools", ("aot", "length_model", "inspect", "export", "analyze")),
    ("driver", ("train", "")),
)

# TEMPORARY: violations still to mend, each by name; the lists must shrink to empty. An entry that
# is no longer a violation fails the test, so none outlives its fix.
TEMPORARY_LONG_FUNCTIONS = frozenset()
TEMPORARY_LONG_FILES = frozenset()
TEMPORARY_UPWARD_IMPORTS = frozenset()


class Import(NamedTuple):
  source: str  # the importing module, dotted ("ict_jax.sampling.host"; a package: its __init__)
  target: str  # the imported ict_jax module
  in_function: bool  # inside a function (runs when called), not at module level (runs on import)
  typing_only: bool = False  # under `if TYPE_CHECKING:` (never runs: a type annotation's import)


def _python_files(*dirs: str) -> list[Path]:
  return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
  return ast.parse(path.read_text(), str(path))


def _rel(path: Path) -> str:
  return path.relative_to(REPO).as_posix()


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.Module):
  """(qualified name, node) of every function and method, nested ones included."""

  def walk(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = prefix + child.name
        if not isinstance(child, ast.ClassDef):
          yield name, child
        yield from walk(child, name + ".")
      else:
        yield from walk(child, prefix)

  yield from walk(tree, "")


def long_functions() -> dict[str, int]:
  """{"path:qualified name": lines} of the functions in ict_jax/ over MAX_FUNCTION_LINES (the def
  line to the last line of the body, decorators not counted)."""
  out = {}
  for path in _python_files(PACKAGE):
    for name, node in _functions(_tree(path)):
      lines = node.end_lineno - node.lineno + 1
      if lines > MAX_FUNCTION_LINES:
        out[f"{_rel(path)}:{name}"] = lines
  return out


def long_files() -> dict[str, int]:
  """{path: lines} of the .py files in SIZED_DIRS over MAX_FILE_LINES."""
  out = {}
  for path in _python_files(*SIZED_DIRS):
    lines = len(path.read_text().splitlines())
    if lines > MAX_FILE_LINES:
      out[_rel(path)] = lines
  return out


@functools.cache
def package_imports() -> tuple[Import, ...]:
  """Every `import` / `from ... import` of an ict_jax module inside ict_jax/: a name imported from
  a module (`from ict_jax.x import f`) counts as an import of that module, a submodule imported
  from its package (`from ict_jax import sampling`) as one of the submodule."""
  paths = _python_files(PACKAGE)
  modules = {_module_name(p) for p in paths}

  def module_of(dotted: str) -> str:
    while dotted not in modules:
      dotted = dotted.rpartition(".")[0]
    return dotted

  out = []
  for path in paths:
    source, tree = _module_name(path), _tree(path)
    in_function = {id(n) for _, f in _functions(tree) for n in ast.walk(f) if n is not f}
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        assert node.level == 0, f"{_rel(path)}:{node.lineno}: a relative import; the house imports ict_jax by name"
        names = [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
          target = module_of(name)
          if target != source:
            out.append(Import(source, target, id(node) in in_function, id(node) in typing_only))
  return tuple(out)


def unit(module: str) -> str:
  """The layer unit of a dotted ict_jax module: its top-level module or subpackage ("" for the
  package's own __init__)."""
  return module.split(".")[1] if "." in module else ""


def find_cycle(edges) -> list[str] | None:
  """A cycle [a, b, ..., a] of the directed graph of (source, target) edges, or None."""
  graph = collections.defaultdict(set)
  for a, b in edges:
    graph[a].add(b)
  state = {}  # node -> 1 on the current path, 2 finished

  def visit(node, path):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt, path)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node, [])):
      return cycle
  return None


def upward_imports(imports) -> dict[str, list[str]]:
  """{"unit -> higher unit": the imports that make it} over LAYERS."""
  layer = {u: i for i, (_, units) in enumerate(LAYERS) for u in units}
  out = collections.defaultdict(list)
  for imp in imports:
    a, b = unit(imp.source), unit(imp.target)
    if layer[b] > layer[a]:
      where = "in a function" if imp.in_function else "module level"
      out[f"{a} -> {b}"].append(f"{imp.source} imports {imp.target} ({where})")
  return dict(out)


# ---- the checks --------------------------------------------------------------------------------
def test_every_function_in_ict_jax_is_at_most_120_lines():
  found = long_functions()
  assert set(found) <= TEMPORARY_LONG_FUNCTIONS, {k: v for k, v in found.items() if k not in TEMPORARY_LONG_FUNCTIONS}
  assert (
      set(found) == TEMPORARY_LONG_FUNCTIONS
  ), f"fixed, remove from TEMPORARY_LONG_FUNCTIONS: {sorted(TEMPORARY_LONG_FUNCTIONS - set(found))}"


def test_every_python_file_is_at_most_600_lines():
  found = long_files()
  assert set(found) <= TEMPORARY_LONG_FILES, {k: v for k, v in found.items() if k not in TEMPORARY_LONG_FILES}
  assert (
      set(found) == TEMPORARY_LONG_FILES
  ), f"fixed, remove from TEMPORARY_LONG_FILES: {sorted(TEMPORARY_LONG_FILES - set(found))}"


def test_no_circle_between_modules_at_import_time():
  """Module-level imports (what runs on `import`) between ict_jax's modules form no cycle."""
  cycle = find_cycle({(i.source, i.target) for i in package_imports() if not (i.in_function or i.typing_only)})
  assert cycle is None, " -> ".join(cycle)


def test_no_circle_between_top_level_units():
  """No cycle between ict_jax's top-level modules and subpackages, function-level imports included
  (a function-level import does not make a circle acceptable, it only defers it)."""
  edges = {(unit(i.source), unit(i.target)) for i in package_imports() if not i.typing_only}
  cycle = find_cycle({(a, b) for a, b in edges if a != b})
  assert cycle is None, " -> ".join(cycle)


def test_every_unit_has_one_layer():
  units = {unit(_module_name(p)) for p in _python_files(PACKAGE)}
  listed = [u for _, us in LAYERS for u in us]
  assert len(listed) == len(set(listed)), [u for u in listed if listed.count(u) > 1]
  assert set(listed) == units, f"place in LAYERS: {sorted(units - set(listed))}; gone: {sorted(set(listed) - units)}"


def test_no_upward_import_between_layers():
  found = upward_imports(package_imports())
  new = {k: v for k, v in found.items() if k not in TEMPORARY_UPWARD_IMPORTS}
  assert not new, new
  fixed = sorted(TEMPORARY_UPWARD_IMPORTS - set(found))
  assert not fixed, f"fixed, remove from TEMPORARY_UPWARD_IMPORTS: {fixed}"


# ---- the checks can fail -----------------------------------------------------------------------
def test_the_checks_see_what_they_look_for():
  """On made-up input: a long method, a circle, an upward import (each of which the tree today
  may lack), and their absence."""
  src = "class A:\n  def f(self):\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\ndef g():\n  def h():\n    pass\n"
  sizes = {name: n.end_lineno - n.lineno + 1 for name, n in _functions(ast.parse(src))}
  assert sizes == {"A.f": MAX_FUNCTION_LINES + 1, "g": 3, "g.h": 2}
  assert find_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
  assert find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None
  up = upward_imports(
      [Import("ict_jax.grpo", "ict_jax.train_step", True), Import("ict_jax.train", "ict_jax.grpo", False)]
  )
  assert up == {"grpo -> train_step": ["ict_jax.grpo imports ict_jax.train_step (in a function)"]}
  assert unit("ict_jax.sampling.host") == "sampling" and unit("ict_jax") == ""
