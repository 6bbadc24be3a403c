"""Device mesh, parameter placement, and multi-host start-up.

Mesh axes are ("data", "fsdp", "tensor"). Parameters carry logical names (`axes` metadata);
`models/axes.py` maps them to mesh axes. Everything here works the same on 1 CPU device,
8 simulated CPU devices, a TPU pod slice, or a GPU node.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ict_jax.models.axes import (MESH_AXES, logical_to_spec, pure_shardings, spec_for, state_shardings)  # noqa: F401

log = logging.getLogger(__name__)


def resolve_mesh_shape(shape: Mapping[str, int] | tuple[int, ...], num_devices: int) -> tuple[int, ...]:
  """{data, fsdp, tensor} (one of them may be -1 = the rest of the devices) -> a tuple."""
  if not isinstance(shape, Mapping):
    shape = dict(zip(MESH_AXES, shape))
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh: unknown axis {sorted(unknown)}; axes are {MESH_AXES}")
  sizes = [int(shape.get(ax, 1)) for ax in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh: axis sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
          f"mesh {dict(zip(MESH_AXES, sizes))}: {known} does not divide the " f"{num_devices} available devices"
      )
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
        f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, " f"but {num_devices} are available"
    )
  return tuple(sizes)


def make_mesh(shape: Mapping[str, int] | tuple[int, ...] = (1, -1, 1), devices=None) -> Mesh:
  """A `Mesh` with axes ("data", "fsdp", "tensor") over `devices` (default: all)."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = resolve_mesh_shape(shape, len(devices))
  if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
  if devices[0].platform != jax.devices()[0].platform:  # a compile-only target (ict_jax.aot):
    # laid out along its physical topology, as jax.make_mesh lays out the devices of a real one
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows over ("data", "fsdp"), the rest replicated."""
  return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_global(x, sharding: NamedSharding) -> jax.Array:
  """Host data (the same on every process) -> a global array with `sharding`, also when the
  sharding spans devices of other processes (multi-host), where `jax.device_put` cannot."""
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(x, sharding)  # already global: reshard
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def maybe_initialize_distributed(heartbeat_timeout_s: int | None = None) -> bool:
  """Call `jax.distributed.initialize()` when the environment describes a multi-host job.

  ICT_JAX_DISTRIBUTED=1 (set by launch/tpu_pod.sh on multi-host slices; JAX reads the pod
  layout from the TPU metadata server), TPU_WORKER_HOSTNAMES with several hosts (GKE), SLURM
  with several tasks, or an explicit JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES,
  JAX_PROCESS_ID). Returns whether it initialised.

  `heartbeat_timeout_s` (None: JAX's default, 100 s): a process whose heartbeat the coordination
  service misses this long is declared dead and every other process is terminated, so a host
  that dies mid-collective ends the job within about this bound instead of leaving the others
  waiting in a collective it will never join."""
  env = os.environ
  kwargs: dict[str, Any] = {}
  if env.get("JAX_COORDINATOR_ADDRESS"):
    kwargs = dict(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
        process_id=int(env.get("JAX_PROCESS_ID", "0")),
    )
    if kwargs["num_processes"] <= 1:
      return False
  elif (
      env.get("ICT_JAX_DISTRIBUTED") == "1"
      or int(env.get("SLURM_NTASKS", "1")) > 1
      or "," in env.get("TPU_WORKER_HOSTNAMES", "")
  ):
    pass  # jax auto-detects SLURM and Cloud TPU pod topologies (launch/tpu_pod.sh sets the flag)
  else:
    return False
  if heartbeat_timeout_s is not None:
    kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
  jax.distributed.initialize(**kwargs)
  log.info("jax.distributed initialised: process %d of %d", jax.process_index(), jax.process_count())
  return True


def is_main_process() -> bool:
  return jax.process_index() == 0


def bytes_per_device(tree) -> dict:
  """{device: bytes of the addressable shards of every array in tree}."""
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
