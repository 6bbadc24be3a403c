"""Where the tests find libtpu, the compiler of the compile-only TPU tests: `ict_jax.aot`'s folder
($ICT_JAX_AOT_LIBS, default ~/.cache/ict_jax/aot-libs) or the environment itself (README's test
command installs requirements-dev.txt, which installs requirements-aot.txt next to JAX)."""

import importlib.util
import os

LIBS_DIR = os.path.expanduser(os.environ.get("ICT_JAX_AOT_LIBS", "~/.cache/ict_jax/aot-libs"))


def libtpu_found() -> bool:
  """libtpu importable from LIBS_DIR or from sys.path (found, not loaded)."""
  return os.path.isdir(os.path.join(LIBS_DIR, "libtpu")) or importlib.util.find_spec("libtpu") is not None


SKIP_REASON = f"libtpu is neither in {LIBS_DIR} nor installed (pip install -r requirements-aot.txt)"
