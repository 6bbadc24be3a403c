"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

# The 8 simulated devices share the machine's cores (2 on CI): XLA:CPU aborts the process when a
# collective's participants have not all arrived within 40 s, which a loaded box can exceed
# without any deadlock; allow 10 minutes (a real deadlock still aborts, later).
_flags = os.environ.get("XLA_FLAGS", "")
if "collective_call_terminate_timeout" not in _flags:
  _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# No persistent compilation cache unless you ask for one: `JAX_COMPILATION_CACHE_DIR=DIR` before
# pytest keeps compiled programs across test processes and runs (a warm rerun of the slow files is
# minutes faster). CI runs without it: on a fresh machine it pays off within one run only, and a
# cache hit there once aborted a worker inside XLA:CPU's deserialize_executable
# (tests/test_sampling_cache.py, 2026-12-07), which no Python handler can catch. With a cache
# every program is kept, however quick to compile: the suite compiles thousands of 0.05-0.5 s
# programs (benchmarks/RESULTS.md, "The test suite's compiled programs").
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The GCS server fixtures (`gcs`, `gcs_environ`; tests/gcs_emulator.py), registered here so that
# every test file shares one server per session. Nothing starts until a test asks for them.
from gcs_emulator import gcs, gcs_environ  # noqa: E402,F401  pylint: disable=wrong-import-position,unused-import
import pytest  # noqa: E402  pylint: disable=wrong-import-position

# Files that start whole training runs go first: under xdist (README's `-n 2`) a file runs on one
# worker, and the longest ones started last would leave the other worker idle at the end.
SLOW_FIRST = (
    "test_train.py",
    "test_pod.py",
    "test_benchmarks_smoke.py",
    "test_faults.py",
    "test_aot.py",
    "test_multihost.py",
    "test_gcs.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: otherwise in file order


# Each program XLA:CPU compiles stays in the process while jax's caches hold it (~0.7 MB and ~6
# memory maps a small program), so a worker's memory grows over the suite (2.4 GB and 5,500 maps a
# tenth of the way in). Workers have died of a segmentation fault inside XLA:CPU's compile late in
# the suite (88-96% of the way, in whichever test compiled next: CI on 2026-12-07 and three runs
# here). The suspects are the box's memory (two such workers and the training subprocesses the
# tests start share 24 GB) and the kernel's 65,530 maps a process (vm.max_map_count); neither is
# proven (10,000+ tiny programs in one process held 49,800 maps, 7 GB, and did not crash). Past
# either limit below, jax's caches are cleared between two tests: the programs still needed
# compile again.
_MAX_MAPS = 20_000
_MAX_RSS = 6 * 2**30


def _process_load() -> tuple[int, int]:
  """(memory maps, resident bytes) of this process; (0, 0) off Linux."""
  try:
    with open("/proc/self/maps", "rb") as f:
      maps = sum(1 for _ in f)
    with open("/proc/self/statm", "rb") as f:
      rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return 0, 0
  return maps, rss


@pytest.fixture(autouse=True)
def _bounded_process():
  yield
  maps, rss = _process_load()
  if maps > _MAX_MAPS or rss > _MAX_RSS:
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def blocked_at_any_vocab(monkeypatch):
  """kernels "cpu" takes the row-blocked ICT statistics at a test's small vocabulary too (a run
  takes them from cpu_paths.BLOCKED_MIN_VOCAB entries up)."""
  from ict_jax import cpu_paths

  monkeypatch.setattr(cpu_paths, "BLOCKED_MIN_VOCAB", 1)
