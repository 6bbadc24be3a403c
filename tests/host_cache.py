"""Start-up code for the processes of a CPU pod (tests/test_pod.py, tests/test_multihost.py):
every process writes what it compiles to the persistent compilation cache, so that the suite's
next run loads its programs as a TPU pod's hosts do.

JAX writes cache entries from process 0 only. On a TPU slice that is enough: the cache key hashes
the slice's topology, the same on every host, so the other hosts load what process 0 wrote.
XLA:CPU's topology fingerprint differs from process to process, so the other processes' keys were
never written and they recompiled every program on every run (process 1 of the pod's 6-step run:
58 s of XLA compiles, against process 0's 6 s of cache loads). With this, a process i > 0 writes
its own keys; the programs and how they are compiled do not change.

`STARTUP` is the folder of those processes' sitecustomize.py (host_cache_startup/), for the front
of their PYTHONPATH: it calls `install()`, which with benchmarks/faults/hook.py's import hook
patches `jax._src.compiler` when that module is first imported (JAX 0.10.2, pinned in
requirements.txt) and fails at import, naming itself, if the function it wraps is gone.
"""

from pathlib import Path

from benchmarks.faults import hook

STARTUP = Path(__file__).resolve().parent / "host_cache_startup"


def every_process_writes(compiler) -> None:
  """Test-only: every process of a CPU pod writes its compiled programs to the persistent
  compilation cache, not process 0 only."""
  from jax._src import compilation_cache, config

  if not hasattr(compiler, "_cache_write"):
    raise ImportError("tests/host_cache.py: jax._src.compiler._cache_write is gone (JAX upgraded?)")
  write = compiler._cache_write

  def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if (
        compiler.distributed.global_state.process_id == 0
        or host_callbacks
        or compile_time_secs < config.persistent_cache_min_compile_time_secs.value
    ):
      return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
    compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))

  compiler._cache_write = _cache_write


def install() -> None:
  """Patches `jax._src.compiler` when it is first imported (start-up code, before JAX is)."""
  hook.install({"jax._src.compiler": every_process_writes})
