"""Start-up code of the CPU pod's processes (tests/host_cache.py's `STARTUP`, first on their
PYTHONPATH, the repository after it): every process writes its compiled programs to the cache."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("host_cache", Path(__file__).resolve().parent.parent / "host_cache.py")
_host_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host_cache)
_host_cache.install()
