"""Before JAX is imported: the compilers' folder on sys.path (jax discovers the CUDA plugin from
it), and the CPU as the only runtime backend (nothing here runs; the targets' devices are
compile-only), so neither libtpu nor the CUDA plugin probes for hardware. `ict_jax.aot` imports
this first."""

import os
import sys

LIBS_DIR = os.path.expanduser(os.environ.get("ICT_JAX_AOT_LIBS", "~/.cache/ict_jax/aot-libs"))
if os.path.isdir(LIBS_DIR) and LIBS_DIR not in sys.path:
  sys.path.insert(0, LIBS_DIR)
os.environ["JAX_PLATFORMS"] = "cpu"
