"""Patch a module right after it is first imported, from a process's start-up code.

    install({"ict_jax.rollout": patch_rollout})  # patch_rollout(module) runs once it is executed

The sitecustomize.py of the CPU pod's processes (tests/host_cache.py: JAX's compilation-cache
writes from every process) uses it: the command line stays unchanged, the patch applies however
the module is first imported. (benchmarks/faults reaches the trainer through its hooks instead.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class PatchOnImport(importlib.abc.MetaPathFinder):
  """A finder first on sys.meta_path: for a name in `patches` it finds the module as the path
  finder would, and runs `patches[name](module)` after the module's own code."""

  def __init__(self, patches: dict[str, Callable]):
    self.patches = patches

  def find_spec(self, name, path, target=None):
    if name not in self.patches:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
      return spec
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      self.patches[name](module)

    spec.loader.exec_module = exec_module
    return spec


def install(patches: dict[str, Callable]) -> PatchOnImport:
  """Puts a PatchOnImport for `patches` first on sys.meta_path (modules imported later only)."""
  finder = PatchOnImport(patches)
  sys.meta_path.insert(0, finder)
  return finder
