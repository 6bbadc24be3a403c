"""Start-up code of the CPU pod's processes (tests/host_cache.py's `STARTUP`, first on their
PYTHONPATH, the repository after it): every process writes its compiled programs to the cache,
and benchmarks/faults' phase markers act where their environment asks for them."""

import importlib.util
from pathlib import Path

from benchmarks.faults import markers

_spec = importlib.util.spec_from_file_location("host_cache", Path(__file__).resolve().parent.parent / "host_cache.py")
_host_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host_cache)
_host_cache.install()
markers.install()  # nothing without $ICT_FAULTS_MARKERS
