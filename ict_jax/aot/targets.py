"""The targets `ict_jax.aot` compiles for: chips, usable HBM, peak FLOP/s and bandwidth, and their
compile-only devices (libtpu's TPU topologies, the CUDA plugin with an XLA GPU target spec)."""

from __future__ import annotations

import dataclasses
import os
import re

from ict_jax.aot._env import LIBS_DIR

GiB = 1 << 30
GPU_SPECS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu_specs")
GPU_MEM_FRACTION = 0.90  # launch/gpu_slurm.sbatch's XLA_PYTHON_CLIENT_MEM_FRACTION


@dataclasses.dataclass(frozen=True)
class Target:
  """An accelerator slice. `usable_hbm` is per chip (JAX device): for TPU what libtpu 0.0.42.1
  reports as available HBM in its out-of-memory error; for GPU the spec's device memory."""

  name: str
  platform: str  # "tpu" | "gpu"
  chips: int  # JAX devices
  usable_hbm: int  # bytes per device a program may use
  peak_tflops: float  # dense bf16, a chip
  hbm_tb_s: float  # HBM bandwidth, a chip
  topology: str = ""  # TPU: libtpu topology name; GPU: "1x1x8"
  chip_config: str = "default"
  host_bounds: tuple[int, int, int] = (2, 2, 1)
  accelerator_type: str = ""  # TPU_ACCELERATOR_TYPE (silences libtpu's host probing)
  gpu_spec: str = ""  # file in gpu_specs/
  gpu_memory: int = 0  # bytes, replaces the spec's device_memory_size when set
  gpu_bandwidth: int = 0  # bytes/s, replaces the spec's memory_bandwidth when set
  ici_gb_s: float = 0.0  # inter-chip bandwidth a chip, GB/s, both directions (ICI; NVLink on GPU)


# Peak dense bf16 TFLOP/s and HBM TB/s a chip, as published: Cloud TPU docs (cloud.google.com/tpu/docs/
# v4, v5e, v5p, v6e: 275 TFLOP/s & 1200 GBps; 197 & 819 GBps; 459 & 2765 GBps; 918 & 1640 GBps) and
# NVIDIA's H100 / H200 datasheets (SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; 4.8 TB/s HBM3e).
# Inter-chip bandwidth a chip, both directions (`ici_gb_s`): Cloud TPU docs' "Bidirectional
# inter-chip interconnect (ICI) bandwidth (per chip)": v5e 400 GBps, v5p 1200 GBps, v6e 800 GBps;
# v4's page gives no per-chip figure, only "All-reduce bandwidth per Pod 1.1 PB/s" over 4096
# chips, which x 2 is 537 GB/s a chip (the same rule gives v5e's 400 and v6e's 800 from their
# pods' 51.2 and 102.4 TB/s over 256 chips); NVLink 4 on H100 SXM and H200 SXM: 900 GB/s (datasheets).
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("v4-8", "tpu", 4, int(30.75 * GiB), 275, 1.2, "v4:2x2x1", "megacore", (2, 2, 1), "v4-8", ici_gb_s=537),
        Target(
            "v5e-8",
            "tpu",
            8,
            int(15.75 * GiB),
            197,
            0.819,
            "v5e:2x4",
            "default",
            (2, 2, 1),
            "v5litepod-8",
            ici_gb_s=400,
        ),
        Target(
            "v5p-32",
            "tpu",
            16,
            int(95.74 * GiB),
            459,
            2.765,
            "v5:2x2x4",
            "megacore",
            (2, 2, 1),
            "v5p-32",
            ici_gb_s=1200,
        ),
        Target("v6e-8", "tpu", 8, int(31.25 * GiB), 918, 1.64, "v6e:2x4", "default", (2, 4, 1), "v6e-8", ici_gb_s=800),
        Target(
            "h100-8",
            "gpu",
            8,
            int(84978434048 * GPU_MEM_FRACTION),
            989,
            3.35,
            "1x1x8",
            gpu_spec="h100_sxm.txtpb",
            ici_gb_s=900,
        ),
        # H200: the H100 SXM chip with 141 GB of HBM3e at 4.8 TB/s.
        Target(
            "h200-8",
            "gpu",
            8,
            int(141e9 * GPU_MEM_FRACTION),
            989,
            4.8,
            "1x1x8",
            gpu_spec="h100_sxm.txtpb",
            gpu_memory=int(141e9),
            gpu_bandwidth=int(4.8e12),
            ici_gb_s=900,
        ),
    )
}


class AotError(ValueError):
  """Bad input to ict_jax.aot (unknown target, mesh / chip-count mismatch, missing compiler)."""


# ---- the target's devices --------------------------------------------------------------------
def _gpu_target_config(target: Target) -> str:
  with open(os.path.join(GPU_SPECS_DIR, target.gpu_spec)) as f:
    text = f.read()
  if target.gpu_memory:
    text = re.sub(r"device_memory_size: \d+", f"device_memory_size: {target.gpu_memory}", text)
  if target.gpu_bandwidth:
    text = re.sub(r"memory_bandwidth: \d+", f"memory_bandwidth: {target.gpu_bandwidth}", text)
  return text


def target_devices(target: Target) -> list:
  """The target's compile-only devices (nothing can run on them)."""
  from jax.experimental import topologies

  if target.platform == "tpu":
    try:
      import libtpu  # noqa: F401  (jax loads libtpu.so from TPU_LIBRARY_PATH or this module)
    except ImportError:
      raise AotError(
          f"--target {target.name}: libtpu is not installed; run: pip install --no-deps "
          f"--target {LIBS_DIR} -r requirements-aot.txt"
      ) from None
    os.environ.setdefault("TPU_LIBRARY_PATH", libtpu.get_library_path())
    # no chip to guard: several aot processes may load libtpu at once (else its /tmp lockfile
    # makes the second one fail)
    for k, v in (
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
        ("TPU_ACCELERATOR_TYPE", target.accelerator_type),
    ):
      os.environ.setdefault(k, v)
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=target.topology,
        chip_config_name=target.chip_config,
        chips_per_host_bounds=target.host_bounds,
        num_slices=1,
    )
  else:
    try:
      topo = topologies.get_topology_desc(
          "", "cuda", target_config=_gpu_target_config(target), topology=target.topology
      )
    except NotImplementedError:
      raise AotError(
          f"--target {target.name}: the CUDA plugin is not installed; run: pip install "
          f"--no-deps --target {LIBS_DIR} -r requirements-aot.txt"
      ) from None
  devices = list(topo.devices)
  if len(devices) != target.chips:
    raise AotError(f"--target {target.name}: the topology has {len(devices)} devices, " f"expected {target.chips}")
  return devices
