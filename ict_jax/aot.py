"""`python -m ict_jax.aot`: compile the train step and the sampler for an accelerator this machine
does not have.

    python -m ict_jax.aot --config configs/qwen2_5_1_5b_math.py --target v5p-32 \
        [--config.train.micro_batch_size=32] [--part train|sample|both] [--completion_len 1024] \
        [--hbm_gib 14] [--json out.json]

Builds the abstract train state and batch with `jax.eval_shape` (no weight is allocated), with
the shapes the trainer feeds: rows = prompts_per_step x group_size, prompt_ids/prompt_mask
[rows, P] (P = the bucket of data.max_prompt_len), completion_ids/completion_mask [rows, C]
(C = rollout.max_new_tokens unless --completion_len), advantages [rows]. The state, its
shardings and the jitted step come from the trainer's own functions (`setup`, `train_step`),
so what compiles here is what runs there. Then it compiles for the target's devices:
- TPU: compile-only devices of `jax.experimental.topologies.get_topology_desc` (libtpu). libtpu
  refuses a program that overflows HBM (RESOURCE_EXHAUSTED): that is the fit test.
- GPU: the CUDA PJRT plugin with an XLA GPU target spec (`gpu_specs/`). XLA:GPU has no such
  error, so peak bytes are compared with HBM x XLA_PYTHON_CLIENT_MEM_FRACTION (0.90, the value
  `launch/gpu_slurm.sbatch` sets).
  The cuDNN attention (`model.attention` cudnn, auto's choice for 16-bit compute) compiles as the
  trainer runs it: without the cuDNN library here, JAX's cuDNN version probe is answered for the
  trace (`_cudnn_tracing`; the report's note says so, and that cuDNN's workspace is not counted).

Prints per chip: arguments, outputs, temporaries, generated code, the usable HBM, fits and the
margin; compile seconds; the collectives of the optimised HLO by kind; model FLOPs per step
(`Qwen2Config.flops_per_token` x tokens; not `cost_analysis()`, which counts a loop body once).
The sampler (`compile_sampler`, --part sample): `sampling.lower_generate` for the rollout copy
(`rollout.dtype`, decoding layout) at the trainer's decode batch (`rollout.decode_batch_size`,
"auto" sized from the HBM the train state and the rollout copy leave free); it fits when its peak
plus the train state (on the chips during the rollout) is within the usable HBM. Its decode step
is compiled alone, layer scan unrolled, for `cost_analysis()` bytes accessed, reported against
the minimum (rollout weights + KV cache per chip). --part both (default): exit 1 unless both fit.
Exit 0 fits, 1 does not fit, 2 bad input (one line on stderr).

The compilers (libtpu, the CUDA plugin) print warnings or tracebacks at every plain CPU start
when installed next to JAX, so they live in their own folder that only this module puts on
`sys.path`: $ICT_JAX_AOT_LIBS, default ~/.cache/ict_jax/aot-libs, filled by
    pip install --no-deps --target ~/.cache/ict_jax/aot-libs -r requirements-aot.txt
(installed next to JAX, e.g. on a TPU VM or in CI, they are found there too).

One function a compiled program (`compile_train_step`, `compile_sampler`), each returning a
`Report`; they share `_setup`, `target_devices` and `measure`.
"""

from __future__ import annotations

import os
import sys

# Before JAX is imported: the compilers' folder on sys.path (jax discovers the CUDA plugin from
# it), and the CPU as the only runtime backend (nothing here runs; the targets' devices are
# compile-only), so neither libtpu nor the CUDA plugin probes for hardware.
LIBS_DIR = os.path.expanduser(os.environ.get("ICT_JAX_AOT_LIBS", "~/.cache/ict_jax/aot-libs"))
if os.path.isdir(LIBS_DIR) and LIBS_DIR not in sys.path:
  sys.path.insert(0, LIBS_DIR)
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ict_jax import sampling  # noqa: E402
from ict_jax import setup as setup_lib  # noqa: E402
from ict_jax import train_step as ts  # noqa: E402
from ict_jax.config import Config, ConfigError  # noqa: E402
from ict_jax.models.axes import axis_rules, logical_to_spec  # noqa: E402
from ict_jax.models.qwen2 import LayerCache  # noqa: E402
from ict_jax.sampling import bucket_length  # noqa: E402
from ict_jax.setup import abstract_params, make_mesh, model_config  # noqa: E402

# compile_s is a compile, never a load from JAX_COMPILATION_CACHE_DIR
jax.config.update("jax_enable_compilation_cache", False)

GiB = 1 << 30
GPU_SPECS_DIR = os.path.join(os.path.dirname(__file__), "gpu_specs")
GPU_MEM_FRACTION = 0.90  # launch/gpu_slurm.sbatch's XLA_PYTHON_CLIENT_MEM_FRACTION
PARTS = ("train", "sample", "both")  # --part: which programs to compile


@dataclasses.dataclass(frozen=True)
class Target:
  """An accelerator slice. `usable_hbm` is per chip (JAX device): for TPU what libtpu 0.0.42.1
  reports as available HBM in its out-of-memory error; for GPU the spec's device memory."""

  name: str
  platform: str  # "tpu" | "gpu"
  chips: int  # JAX devices
  usable_hbm: int  # bytes per device a program may use
  peak_tflops: float  # dense bf16
  hbm_tb_s: float
  topology: str = ""  # TPU: libtpu topology name; GPU: "1x1x8"
  chip_config: str = "default"
  host_bounds: tuple[int, int, int] = (2, 2, 1)
  accelerator_type: str = ""  # TPU_ACCELERATOR_TYPE (silences libtpu's host probing)
  gpu_spec: str = ""  # file in gpu_specs/
  gpu_memory: int = 0  # bytes, replaces the spec's device_memory_size when set
  gpu_bandwidth: int = 0  # bytes/s, replaces the spec's memory_bandwidth when set


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("v4-8", "tpu", 4, int(30.75 * GiB), 275, 1.2, "v4:2x2x1", "megacore", (2, 2, 1), "v4-8"),
        Target("v5e-8", "tpu", 8, int(15.75 * GiB), 197, 0.82, "v5e:2x4", "default", (2, 2, 1), "v5litepod-8"),
        Target("v5p-32", "tpu", 16, int(95.74 * GiB), 459, 2.76, "v5:2x2x4", "megacore", (2, 2, 1), "v5p-32"),
        Target("v6e-8", "tpu", 8, int(31.25 * GiB), 918, 1.64, "v6e:2x4", "default", (2, 4, 1), "v6e-8"),
        Target("h100-8", "gpu", 8, int(84978434048 * GPU_MEM_FRACTION), 989, 3.35, "1x1x8", gpu_spec="h100_sxm.txtpb"),
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
        ),
    )
}

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_OOM_RES = (
    re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class AotError(ValueError):
  """Bad input to ict_jax.aot (unknown target, mesh / chip-count mismatch, missing compiler)."""


@dataclasses.dataclass
class Report:
  """What one compile of one program for one target measured (bytes are per device)."""

  program: str
  target: str
  fits: bool
  hbm_bytes_per_device: int
  peak_bytes_per_device: int | None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  temp_bytes: int | None = None
  generated_code_bytes: int | None = None
  compiler_accepted: bool = False  # compiled (libtpu refuses what overflows its HBM accounting)
  compile_s: float = 0.0
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)
  model_flops_per_step: float = 0.0
  shapes: dict[str, Any] = dataclasses.field(default_factory=dict)
  error: str = ""
  advice: str = ""
  # bytes other buffers hold on each device while this program runs (the sampler: the train
  # state, which stays on the devices during the rollout); fits = peak + resident <= usable HBM
  resident_bytes: int = 0
  # the sampler: rows decoded at once (rollout.decode_batch_size resolved as the trainer does),
  # the bytes one decode step reads and writes (`cost_analysis()` of the step alone) and their
  # minimum (the rollout-dtype weights + the sub-batch's KV cache, per device)
  decode_batch_size: int | None = None
  decode_step_bytes: float | None = None
  decode_step_min_bytes: int | None = None
  # cuDNN flash-attention calls (forward and backward custom calls) in the compiled program
  cudnn_attention_calls: int = 0
  # the sampler: prompt rows prefilled over the whole rollout (prompts once each when a decode
  # sub-batch holds whole groups; batch padding included) and their forward FLOPs
  prefill_rows: int | None = None
  prefill_flops: float | None = None
  # the sampler: KV cache slots the decode steps read over a whole rollout / the slots written when
  # read (`sampling.kv_read_over_filled`: completions all running to the end, decode phases as compiled)
  kv_read_over_filled: float | None = None

  @property
  def margin_bytes(self) -> int | None:
    if self.peak_bytes_per_device is None:
      return None
    return self.hbm_bytes_per_device - self.peak_bytes_per_device - self.resident_bytes

  @property
  def decode_bytes_ratio(self) -> float | None:
    if not self.decode_step_bytes or not self.decode_step_min_bytes:
      return None
    return self.decode_step_bytes / self.decode_step_min_bytes

  def to_json(self) -> dict:
    return {
        **dataclasses.asdict(self),
        "margin_bytes": self.margin_bytes,
        "decode_bytes_ratio": self.decode_bytes_ratio,
    }


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


# ---- measuring a compiled program ------------------------------------------------------------
def count_cudnn_attention(hlo_text: str) -> int:
  """cuDNN fused-attention custom calls (`__cudnn$fmha...`, forward and backward) in optimised HLO."""
  return len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo_text))


def count_collectives(hlo_text: str) -> dict[str, int]:
  """{kind: number of instructions} in optimised HLO text; an async pair (-start/-done) is one."""
  counts = {k: 0 for k in COLLECTIVES}
  for m in _COLLECTIVE_RE.finditer(hlo_text):
    counts[m.group(1)] += 1
  return counts


def _parse_oom(msg: str) -> tuple[int | None, int | None]:
  """libtpu's overflow message -> (bytes needed, bytes available), None when not parsed."""
  m = next((m for m in (r.search(msg) for r in _OOM_RES) if m), None)
  if not m:
    return None, None
  return (int(float(m.group(1)) * _UNITS[m.group(2)]), int(float(m.group(3)) * _UNITS[m.group(4)]))


def measure(lowered, target: Target, *, program: str, advice: str = "", resident: int = 0) -> Report:
  """Compile `lowered` (a `jax.stages.Lowered` for `target`'s devices) and read its memory.

  Peak per device = arguments + outputs - aliased (donated) + temporaries + generated code;
  fits = compiled and peak <= usable HBM. libtpu has been seen to accept a program whose peak so
  counted exceeds its usable HBM (1.5B on v5e-8, micro-batch 32: 17.03 vs 15.75 GiB); such a
  program is reported as not fitting, with `compiler_accepted` true. `resident`: bytes per device
  that other buffers hold meanwhile (counted against the usable HBM, not in the peak)."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001  (libtpu's overflow is an XlaRuntimeError)
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
      raise
    needed, available = _parse_oom(msg)
    first = next((line for line in msg.splitlines() if "RESOURCE_EXHAUSTED" in line), msg)
    return Report(
        program,
        target.name,
        False,
        available or target.usable_hbm,
        needed,
        temp_bytes=needed,
        compile_s=time.perf_counter() - t0,
        error=first.strip()[:500],
        advice=advice,
        resident_bytes=resident,
    )
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak = (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      - mem.alias_size_in_bytes
      + mem.temp_size_in_bytes
      + mem.generated_code_size_in_bytes
  )
  fits = peak + resident <= target.usable_hbm
  text = compiled.as_text()
  return Report(
      program,
      target.name,
      fits,
      target.usable_hbm,
      int(peak),
      argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
      generated_code_bytes=int(mem.generated_code_size_in_bytes),
      compiler_accepted=True,
      compile_s=compile_s,
      collectives=count_collectives(text),
      cudnn_attention_calls=count_cudnn_attention(text),
      advice="" if fits else advice,
      resident_bytes=resident,
  )


# ---- the train step --------------------------------------------------------------------------
def _without_missing_model_path(cfg: Config) -> tuple[Config, str]:
  """A model.path that is not on this machine -> the preset (same shapes as the published
  config.json); returns the config and a note for the report ("" when nothing changed)."""
  path = cfg.model.path
  if not path or os.path.isfile(os.path.join(path, "config.json")):
    return cfg, ""
  note = f"model.path {path} is not on this machine: shapes from model.preset " f"{cfg.model.preset!r}"
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="")), note


def _cudnn_loadable() -> bool:
  try:  # JAX checks the cuDNN version while tracing its cuDNN attention
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    check_cudnn_version()
    return True
  except Exception:  # noqa: BLE001 - no cuDNN library on this machine, whatever JAX raises
    return False


# The cuDNN version JAX's probe reports while tracing for a GPU target on a machine without the
# library (9.12: the oldest jax-cuda13-plugin[with-cuda] accepts). JAX only gates features on it
# (MLA, compute capability 10.3); nothing of it enters the program.
CUDNN_VERSION_FOR_TRACING = 91200


def _cudnn_note(mcfg) -> str:
  if mcfg.attention != "cudnn" or _cudnn_loadable():
    return ""
  return (
      f"cuDNN is not installed here: its version probe answered {CUDNN_VERSION_FOR_TRACING} while "
      "tracing; the cudnn attention compiled, its workspace (sized when a GPU loads it) not counted"
  )


@contextlib.contextmanager
def _cudnn_tracing(mcfg):
  """Trace `mcfg`'s cudnn attention on a machine without the cuDNN library (a CPU box compiling
  for a GPU node). JAX asks the library for its version while tracing and stops there when it is
  absent; the CUDA plugin compiles the cuDNN custom call without it. So, for the trace only, the
  probe answers CUDNN_VERSION_FOR_TRACING: what compiles is the program the trainer runs."""
  if not _cudnn_note(mcfg):
    yield
    return
  from jax._src.cudnn import fused_attention_stablehlo as fused

  probe = fused.check_cudnn_version
  fused.check_cudnn_version = lambda: CUDNN_VERSION_FOR_TRACING
  try:
    yield
  finally:
    fused.check_cudnn_version = probe


def train_batch_shapes(cfg: Config, prompt_len: int, completion_len: int) -> dict[str, tuple]:
  """{name: (shape, dtype)} of one step's batch as `Rollout.batch()` builds it."""
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  shapes = dict(
      prompt_ids=((rows, prompt_len), jnp.int32),
      prompt_mask=((rows, prompt_len), jnp.int32),
      completion_ids=((rows, completion_len), jnp.int32),
      completion_mask=((rows, completion_len), jnp.int32),
      advantages=((rows,), jnp.float32),
      stop_pos=((rows,), jnp.int32),
      answer_end=((rows,), jnp.int32),
  )
  if cfg.train.num_iterations > 1:  # the second pass of a batch also carries old log-probs
    shapes["old_logp"] = ((rows, completion_len), jnp.float32)
  return shapes


@dataclasses.dataclass
class _Setup:
  """What the trainer builds before its first step, abstract, on the target's mesh."""

  cfg: Config
  mesh: Any
  mcfg: Any
  note: str
  graphdef: Any
  params: Any  # abstract float32 parameters (pure dict of ShapeDtypeStructs with shardings)
  optimizer: Any
  state_sharding: Any
  state: Any  # abstract TrainState


def _task_tokenizer(cfg: Config):
  """`model.vocab="task"`: the task vocabulary the trainer would build (the data prepared in a
  temporary folder, unless `data.data_dir` holds it)."""
  import tempfile

  from ict_jax.data import load_split
  from ict_jax.setup import make_tokenizer

  with tempfile.TemporaryDirectory(prefix="ict_jax_aot_") as tmp:
    data_dir = cfg.data.data_dir or tmp
    load = lambda split: load_split(cfg.data.name, split, data_dir=data_dir, config=cfg.data.config or None)
    return make_tokenizer(cfg, tmp, "", load)


def _setup(cfg: Config, target: Target) -> _Setup:
  devices = target_devices(target)
  cfg, note = _without_missing_model_path(cfg)
  try:
    mesh = make_mesh(cfg, devices=devices)
  except ConfigError as e:
    raise AotError(f"--target {target.name} has {target.chips} chips: {e}") from None
  mb = cfg.train.micro_batch_size or cfg.rollout.prompts_per_step * cfg.rollout.group_size
  try:  # the trainer's own check, named for the target
    ts.check_micro_batch(mb, mesh)
  except ValueError as e:
    raise AotError(f"--target {target.name}: {e}") from None
  tok = None
  if cfg.model.vocab == "task" and not cfg.model.path:  # the embedding's rows come from the task's text
    tok = _task_tokenizer(cfg)
  mcfg = model_config(cfg, cfg.model.path, mesh, tok)  # "auto" attention: the target's kernel
  note = "; ".join(n for n in (note, _cudnn_note(mcfg)) if n)
  graphdef, params, params_sharding = abstract_params(mcfg, mesh)
  optimizer = ts.make_optimizer(cfg.optim, cfg.train.steps * cfg.train.num_iterations)
  state_sharding = ts.train_state_shardings(optimizer, params, params_sharding, mesh)
  state = ts.abstract_train_state(optimizer, params, state_sharding)
  return _Setup(cfg, mesh, mcfg, note, graphdef, params, optimizer, state_sharding, state)


def compile_train_step(cfg: Config, target: Target, *, prompt_len: int = 0, completion_len: int = 0) -> Report:
  """Compile the trainer's jitted step for `target`; prompt_len 0: bucket of
  data.max_prompt_len; completion_len 0: rollout.max_new_tokens."""
  su = _setup(cfg, target)
  cfg, mesh, mcfg, note, graphdef, params = su.cfg, su.mesh, su.mcfg, su.note, su.graphdef, su.params
  optimizer, state_sharding, state = su.optimizer, su.state_sharding, su.state
  prompt_len = prompt_len or bucket_length(cfg.data.max_prompt_len)
  completion_len = completion_len or cfg.rollout.max_new_tokens
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  mb = cfg.train.micro_batch_size or rows
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  rows_sharding = NamedSharding(mesh, P(("data", "fsdp")))
  batch = {
      k: jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)
      for k, (shape, dtype) in train_batch_shapes(cfg, prompt_len, completion_len).items()
  }
  ref = params if cfg.loss.beta > 0 else None
  step = ts.make_train_step(
      graphdef, ts.StepConfig.from_config(cfg), optimizer, mesh=mesh, state_sharding=state_sharding
  )
  with jax.set_mesh(mesh), _cudnn_tracing(mcfg):
    lowered = step.jitted.lower(state, batch, ref)
  advice = (
      f"lower --config.train.micro_batch_size (now {mb}; a multiple of group_size "
      f"{cfg.rollout.group_size} and of data x fsdp = {shards}), or --completion_len "
      f"(now {completion_len}), or spread the model over more chips (config.mesh)"
  )
  report = measure(lowered, target, program="train_step", advice=advice)
  tokens = rows * (prompt_len + completion_len)
  report.model_flops_per_step = float(mcfg.flops_per_token(prompt_len + completion_len) * tokens)
  report.shapes = dict(
      rows=rows,
      micro_batch_size=mb,
      group_size=cfg.rollout.group_size,
      prompt_len=prompt_len,
      completion_len=completion_len,
      mesh=dict(mesh.shape),
      model=cfg.model.path or cfg.model.preset,
      num_params=mcfg.num_params(),
      dtype=mcfg.dtype,
      param_dtype=mcfg.param_dtype,
      remat_policy=mcfg.remat_policy,
      attention=mcfg.attention,
      kernels=mcfg.kernels,
      method=cfg.ict.method,
      rows_per_shard=mb // shards,
      note=note,
  )
  return report


# ---- the sampler -----------------------------------------------------------------------------
def bytes_per_device(tree) -> int:
  """Bytes one device holds of the arrays (or ShapeDtypeStructs with shardings) of `tree`: the
  shard shape of each leaf; a leaf without a sharding counts whole."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _decode_step(state, cache, prompt_cache, tok, num_prompt, i, prompt_mask, rng, temperature, top_p, *, graphdef, kw):
  """One step of the sampler's decode loop (`sampling.decode._decode_rows`'s while-loop body,
  without writing the outputs): token i - 1 [b] in, its KV written at completion slot i - 1, the
  shared prompt cache read, token i sampled."""
  model = nnx.merge(graphdef, state)
  logits, cache = sampling.decode_one(model, tok, num_prompt, i, cache, prompt_cache, prompt_mask)
  kernels = model.cfg.kernels
  tok, _ = sampling.rules._sample_step(logits, jax.random.fold_in(rng, i), temperature, top_p, kernels=kernels, **kw)
  return tok, cache


def decode_cache(mcfg, mesh, batch: int, cache_len: int, dtype: str) -> LayerCache:
  """The abstract KV cache `Qwen2.init_cache` makes for a decode batch, in the decoding layout."""
  shape = (mcfg.num_hidden_layers, batch, mcfg.num_key_value_heads, cache_len, mcfg.head_dim)
  names = (None, "act_batch", "act_kv_heads", "act_cache_length", None)
  with axis_rules(sampling.DECODE_RULES):
    spec = logical_to_spec(names, shape, dict(mesh.shape))
  struct = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  return LayerCache(struct, struct)


@contextlib.contextmanager
def _unrolled_scans():
  """`jax.lax.scan` unrolled while a program is traced: `cost_analysis()` counts a loop body once,
  so the decode step's layer scan must be straight-line code for its bytes to count every layer."""
  scan = jax.lax.scan

  def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  jax.lax.scan = unrolled
  try:
    yield
  finally:
    jax.lax.scan = scan


def compile_decode_step(policy, mesh, cache: LayerCache, prompt_cache: LayerCache, sample_kw: dict):
  """`_decode_step` compiled for `mesh` (the decode cache donated, as the loop carries it in
  place; the prompt cache only read), its layer scan unrolled (`_unrolled_scans`).

  The layouts of the cache and the weights are the compiler's choice (`Layout.AUTO`), as inside
  the sampler, where the cache is made in the program and a weight relayout is loop-invariant
  (done once, before the loop): with the default layouts of arguments, XLA relayouts the whole
  cache into and out of the layer scan (4 x its bytes: 1.5B on v5e-8, 64 rows a chip, 18 GB) and
  the tied embedding for its gather, and the step would be charged for what the loop does not do."""
  batch, prompts, prompt_len = cache.k.shape[1], prompt_cache.k.shape[1], prompt_cache.k.shape[3]
  cache_formats = LayerCache(*(Format(Layout.AUTO, x.sharding) for x in cache))
  rows, repl = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
  sds = jax.ShapeDtypeStruct
  args = (
      policy.state,
      cache,
      prompt_cache,
      sds((batch,), jnp.int32, sharding=rows),  # the last token
      sds((batch,), jnp.int32, sharding=rows),  # prompt lengths
      sds((), jnp.int32, sharding=repl),  # i
      sds((prompts, prompt_len), jnp.int32, sharding=sampling.prompt_sharding(mesh, prompts)),
      sds((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=repl),
      sds((), jnp.float32, sharding=repl),
      sds((), jnp.float32, sharding=repl),
  )
  in_shardings = list(jax.tree.map(lambda x: x.sharding, args))
  in_shardings[0] = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), policy.state)
  in_shardings[1] = cache_formats
  in_shardings[2] = LayerCache(*(Format(Layout.AUTO, x.sharding) for x in prompt_cache))
  step = jax.jit(
      functools.partial(_decode_step, graphdef=policy.graphdef, kw=sample_kw),
      in_shardings=tuple(in_shardings),
      out_shardings=(rows, cache_formats),
      donate_argnums=(1,),
  )
  with jax.set_mesh(mesh), axis_rules(sampling.DECODE_RULES), _unrolled_scans():
    return step.lower(*args).compile()


def compile_sampler(cfg: Config, target: Target, *, prompt_len: int = 0, completion_len: int = 0) -> Report:
  """Compile the rollout's sampler (`sampling.lower_generate`) for `target` as the trainer runs
  it: the rollout copy of the policy (`rollout.dtype`, the decoding layout), all
  prompts_per_step x group_size rows in sub-batches of `rollout.decode_batch_size` ("auto" sized
  from what the target's HBM leaves free next to the train state and the rollout copy, as
  `sampling.resolve_decode_batch_size` sizes it from the devices' memory statistics). Fits when
  its peak plus the train state (which stays on the devices meanwhile) is within the usable HBM.
  Then the decode step alone is compiled for its `cost_analysis()` bytes accessed."""
  su = _setup(cfg, target)
  cfg, mesh, mcfg, note = su.cfg, su.mesh, su.mcfg, su.note
  prompt_len = prompt_len or bucket_length(cfg.data.max_prompt_len)
  new_len = bucket_length(completion_len or cfg.rollout.max_new_tokens)
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  dtype = setup_lib.rollout_dtype(cfg, mesh)
  policy = sampling.abstract_rollout_policy(mcfg, dtype=dtype, mesh=mesh)
  resident = bytes_per_device(su.state) + (bytes_per_device(su.params) if cfg.loss.beta > 0 else 0)
  policy_bytes = bytes_per_device(policy.state)
  free = target.usable_hbm - resident - policy_bytes
  dbs = setup_lib.decode_batch_size(cfg)
  group = cfg.rollout.group_size
  try:
    if dbs == "auto":
      row_bytes = sampling.decode_row_bytes(mcfg, new_len, mesh, dtype)
      prompt_bytes = sampling.kv_bytes(mcfg, prompt_len, mesh, dtype)
      try:
        if free <= 0:
          raise ValueError("no memory is free")
        sub = sampling.auto_decode_batch_size(
            rows, shards, row_bytes, free, group_size=group, prompt_bytes=prompt_bytes
        )
      except ValueError:  # not even one row a chip fits: compile one row a chip, report not fitting
        sub = min(d for d in range(shards, rows + 1) if rows % d == 0)
        note = "; ".join(
            n for n in (note, f"decode_batch_size=auto: not one row a chip fits the free HBM; compiled {sub}") if n
        )
    else:
      sub = sampling.resolve_decode_batch_size(
          dbs, rows, cfg=mcfg, prompt_len=prompt_len, new_len=new_len, group_size=group, mesh=mesh, dtype=dtype
      )
  except ValueError as e:
    raise AotError(f"--target {target.name}: config.rollout.{' '.join(str(e).split())}") from None
  layout = sampling.decode_layout(rows, group, sub, shards)  # as `generate` lays the rows out
  greedy = cfg.rollout.temperature == 0
  sample_kw = dict(greedy=greedy, top_k=min(cfg.rollout.top_k, mcfg.vocab_size), use_top_p=cfg.rollout.top_p < 1.0)
  with _cudnn_tracing(mcfg):  # the prefill
    lowered = sampling.lower_generate(
        policy, rows, prompt_len, new_len, mesh=mesh, decode_batch_size=sub, num_samples=group, **sample_kw
    )
  advice = (
      f"lower --config.rollout.decode_batch_size (now {sub} of {rows} rows; it must divide them), or "
      f"rollout.max_new_tokens (now {new_len}), or spread the model over more chips (config.mesh)"
  )
  report = measure(lowered, target, program="sampler", advice=advice, resident=resident)
  report.decode_batch_size = sub
  report.prefill_rows = layout.prefill_rows
  report.prefill_flops = layout.prefill_rows * prompt_len * mcfg.flops_per_token(prompt_len, training=False)
  phases = sampling.decode_phases(new_len)
  report.kv_read_over_filled = sampling.kv_read_over_filled(phases, layout.prompts, prompt_len, layout.rows)
  # the decode step alone: cost_analysis counts a loop body once, so the whole program's figure
  # is not per step; this is the body as its own program, its cache donated (updated in place)
  cache = decode_cache(mcfg, mesh, layout.rows, new_len, dtype)
  prompt_cache = decode_cache(mcfg, mesh, layout.prompts, prompt_len, dtype)
  kv_cache_bytes = bytes_per_device(cache) + bytes_per_device(prompt_cache)
  try:
    costs = compile_decode_step(policy, mesh, cache, prompt_cache, sample_kw).cost_analysis()
  except Exception as e:  # noqa: BLE001 - the step alone overflowing is reported, not fatal
    costs, report.error = None, (report.error or f"decode step: {' '.join(str(e).split())[:300]}")
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs
  if costs and costs.get("bytes accessed"):
    report.decode_step_bytes = float(costs["bytes accessed"])
  elif not report.error:  # the CUDA plugin's compile-only executables have no cost analysis
    note = "; ".join(n for n in (note, "decode step bytes: this compiler gives no cost analysis") if n)
  report.decode_step_min_bytes = policy_bytes + kv_cache_bytes
  report.shapes = dict(
      rows=rows,
      decode_batch_size=sub,
      sub_batches=layout.sub_batches,
      rows_per_device=layout.rows // shards,
      prompts_per_sub_batch=layout.prompts,
      samples_per_prompt=layout.samples,
      decode_phases=list(phases),
      prompt_len=prompt_len,
      completion_len=new_len,
      mesh=dict(mesh.shape),
      model=cfg.model.path or cfg.model.preset,
      num_params=mcfg.num_params(),
      dtype=dtype,
      param_dtype=dtype,
      attention=mcfg.attention,  # the prefill's
      rollout_policy_bytes=policy_bytes,
      kv_cache_bytes=kv_cache_bytes,
      prompt_kv_cache_bytes=bytes_per_device(prompt_cache),
      note=note,
  )
  return report


# ---- the report as text ----------------------------------------------------------------------
def _gib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def format_report(r: Report, target: Target) -> str:
  s = r.shapes
  if r.program == "sampler":
    head = (
        f"sampler on {r.target} ({target.chips} chips, mesh {s.get('mesh')}): {s.get('model')} "
        f"({s.get('num_params', 0):,} params, {s.get('dtype')} rollout copy), {s.get('rows')} rows x "
        f"({s.get('prompt_len')} + {s.get('completion_len')}) tokens, decode batch "
        f"{s.get('decode_batch_size')} ({s.get('sub_batches')} sub-batches, {s.get('rows_per_device')} rows a chip); "
        f"{r.prefill_rows} prompt rows prefilled ({s.get('samples_per_prompt')} rows read each), "
        f"{r.prefill_flops:.3e} prefill FLOPs; decode in {len(s.get('decode_phases', ()))} length-bounded "
        f"phases: KV slots read / written {r.kv_read_over_filled:.3f}"
    )
  else:
    head = (
        f"{r.program} on {r.target} ({target.chips} chips, mesh {s.get('mesh')}): "
        f"{s.get('model')} ({s.get('num_params', 0):,} params, {s.get('dtype')} compute, "
        f"{s.get('param_dtype')} params), {s.get('rows')} rows x ({s.get('prompt_len')} + "
        f"{s.get('completion_len')}) tokens, micro-batch {s.get('micro_batch_size')}"
    )
  lines = [head]
  if s.get("attention"):
    calls = f" ({r.cudnn_attention_calls} cuDNN attention calls compiled)" if r.cudnn_attention_calls else ""
    lines.append(f"  attention: {s['attention']}{calls}")
  if s.get("note"):
    lines.append(f"  note: {s['note']}")
  if s.get("method") == "ict" and 0 < s.get("rows_per_shard", 0) < s.get("group_size", 0):
    lines.append(
        f"  note: a row shard holds {s['rows_per_shard']} rows of a micro-batch, less than "
        f"a group ({s['group_size']}): the ICT group mean crosses chips"
    )
  lines += [
      f"  per chip: arguments {_gib(r.argument_bytes)}, outputs {_gib(r.output_bytes)} "
      f"(aliased {_gib(r.alias_bytes)}), temporaries {_gib(r.temp_bytes)}, generated code "
      f"{_gib(r.generated_code_bytes)}",
      f"  peak {_gib(r.peak_bytes_per_device)}"
      + (f" (+ {_gib(r.resident_bytes)} of train state held meanwhile)" if r.resident_bytes else "")
      + f" of {_gib(r.hbm_bytes_per_device)} usable HBM: "
      + (
          f"fits, margin {_gib(r.margin_bytes)}"
          if r.fits
          else "DOES NOT FIT"
          + (
              " (the compiler accepted it, but arguments + temporaries exceed the usable HBM)"
              if r.compiler_accepted
              else ""
          )
      ),
      f"  compile {r.compile_s:.1f} s",
  ]
  if r.collectives:
    lines.append(
        "  collectives: " + ", ".join(f"{k} {v}" for k, v in r.collectives.items() if v)
        if any(r.collectives.values())
        else "  collectives: none"
    )
  flops = r.model_flops_per_step
  if r.program != "sampler":
    lines.append(
        f"  model FLOPs per step {flops:.3e} ({flops / (target.chips * target.peak_tflops * 1e12):.2f} s "
        f"at 100% of {target.chips} x {target.peak_tflops:g} TFLOP/s)"
    )
  if r.decode_step_min_bytes:
    floor_s = r.decode_step_min_bytes / (target.hbm_tb_s * 1e12)
    got = "n/a" if r.decode_step_bytes is None else _gib(r.decode_step_bytes)
    ratio = "n/a" if r.decode_bytes_ratio is None else f"{r.decode_bytes_ratio:.2f}x"
    lines.append(
        f"  one decode step reads/writes {got} a chip, {ratio} the minimum {_gib(r.decode_step_min_bytes)} "
        f"(rollout weights {_gib(s.get('rollout_policy_bytes'))} + KV cache {_gib(s.get('kv_cache_bytes'))}; "
        f"{floor_s * 1e3:.2f} ms at {target.hbm_tb_s:g} TB/s)"
    )
  if r.error:
    lines.append(f"  {r.error}")
  if not r.fits and r.advice:
    lines.append(f"  to fit: {r.advice}")
  return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------
def _fail(msg: str) -> None:
  print(f"ict_jax.aot: error: {msg}", file=sys.stderr)
  sys.exit(2)


def main(argv=None) -> None:
  from absl import flags
  from ml_collections import config_flags

  from ict_jax import config as config_lib

  fl = flags.FlagValues()
  flags.DEFINE_string("target", "", f"one of {', '.join(TARGETS)}", flag_values=fl)
  flags.DEFINE_integer(
      "completion_len",
      0,
      "completion columns of the batch (0: " "rollout.max_new_tokens, what the trainer feeds)",
      flag_values=fl,
  )
  flags.DEFINE_integer("prompt_len", 0, "prompt columns (0: the bucket of data.max_prompt_len)", flag_values=fl)
  flags.DEFINE_string("json", "", "also write the report here as JSON", flag_values=fl)
  flags.DEFINE_float(
      "hbm_gib",
      0.0,
      "usable HBM per chip in GiB for the fit test and rollout.decode_batch_size=auto (0: the "
      "target's; less leaves headroom for other buffers)",
      flag_values=fl,
  )
  flags.DEFINE_enum("part", "both", PARTS, "train: the train step; sample: the sampler; both: both", flag_values=fl)
  argv = sys.argv if argv is None else argv
  try:
    config_flags.DEFINE_config_file(
        "config", config_lib.__file__, "An ml_collections config file.", flag_values=fl, lock_config=True
    )
    fl(argv)
    cd = fl.config
  except (AttributeError, KeyError) as e:
    _fail(f"unknown config key {str(e.args[0] if e.args else e).strip(chr(39))}")
  except (flags.Error, TypeError, ValueError) as e:
    _fail(" ".join(str(e).split()))
  if type(cd).__name__ == "_ErrorConfig":
    _fail(
        f"--config {fl['config'].config_filename}: could not be loaded: "
        + " ".join(str(object.__getattribute__(cd, "_error")).split())
    )
  if fl.target not in TARGETS:
    _fail(f"--target {fl.target!r}: unknown; expected one of {', '.join(TARGETS)}")
  if fl.completion_len < 0 or fl.prompt_len < 0:
    _fail("--completion_len and --prompt_len must be >= 0")
  if fl.hbm_gib < 0:
    _fail(f"--hbm_gib must be >= 0, got {fl.hbm_gib}")
  target = TARGETS[fl.target]
  if fl.hbm_gib:
    target = dataclasses.replace(target, usable_hbm=int(fl.hbm_gib * GiB))
  reports = []
  try:
    cfg = config_lib.validate(cd)
    if fl.part in ("train", "both"):
      reports.append(compile_train_step(cfg, target, prompt_len=fl.prompt_len, completion_len=fl.completion_len))
    if fl.part in ("sample", "both"):
      reports.append(compile_sampler(cfg, target, prompt_len=fl.prompt_len, completion_len=fl.completion_len))
  except (ConfigError, AotError) as e:
    _fail(" ".join(str(e).split()))
  fits = all(r.fits for r in reports)
  if fl.json:  # first: a compile of many minutes must not be lost to a closed stdout
    by_program = {r.program: r.to_json() for r in reports}
    out = {
        **by_program.get("train_step", {}),
        **({"sampler": by_program["sampler"]} if "sampler" in by_program else {}),
        "fits": fits,
        "part": fl.part,
        "config": fl["config"].config_filename,
        "chips": target.chips,
        "peak_tflops_per_chip": target.peak_tflops,
        "hbm_tb_s_per_chip": target.hbm_tb_s,
        "jax": jax.__version__,
    }
    with open(fl.json, "w") as f:
      json.dump(out, f, indent=1)
  print("\n".join(format_report(r, target) for r in reports), flush=True)
  sys.exit(0 if fits else 1)


if __name__ == "__main__":
  main()
