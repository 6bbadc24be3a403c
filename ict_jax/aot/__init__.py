"""`python -m ict_jax.aot`: compile the train step and the sampler for an accelerator this machine
does not have.

    python -m ict_jax.aot --config configs/qwen2_5_1_5b_math.py --target v5p-32 \
        [--config.train.micro_batch_tokens=40960] [--part train|sample|both] [--completion_len 1024] \
        [--hbm_gib 14] [--json out.json] [--decode_compiles few|all]

Builds the abstract train state and batch with `jax.eval_shape` (no weight is allocated), with
the shapes the trainer feeds: rows = prompts_per_step x group_size, prompt_ids/prompt_mask
[rows, P] (P = the bucket of data.max_prompt_len), completion_ids/completion_mask [rows, C]
(C = rollout.max_new_tokens unless --completion_len), advantages [rows]; with
`train.token_budget` (packed rows), that batch packed as train.py packs it at its largest (every
sequence at full length: the most micro-batches, the widest LM head; `step.packed_train_batch`),
the packing's sizes in the report's shapes["packed"]. The state, its
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
is compiled alone, layer scan unrolled, at the (phase bound, row count) shapes the rollout runs
(`decode_grid.py`: the length-bounded phases' read bounds x the row counts compaction keeps,
`sampling.compacted_rows`, with the prompt cache as the loop reads it: shared by a prompt's rows
until the first compaction, a copy a row after), for `cost_analysis()` bytes accessed and FLOPs
and the HLO's collectives (count, bytes), reported against each phase's minimum (rollout weights +
the KV cache it reads, per chip). `--decode_compiles few` (default) compiles the first and last
bound x the fewest and all rows (a prompt copy a row) and all rows (shared prompts) at 2 and 3
layers and derives the rest (affine in each; checked at the middle row count, every row count
compiled when that misses by > 1%); `all` compiles every shape at the model's depth. On TPU that
step is compiled without memory-space assignment (`decode_step.HBM_BYTES_OPTIONS`): with it,
libtpu's cost analysis also counts each VMEM staging copy and every read from VMEM, the same bytes
several times over. The decode attention is
the run's (`model.decode_attention`: on TPU the fused Pallas kernel, whose bytes are the ones it
declares in its `pl.CostEstimate`: libtpu counts a Mosaic call's bytes only from that).
--part both (default) compiles the train step in a child process beside the sampler.
--part both (default): exit 1 unless both fit.
Exit 0 fits, 1 does not fit, 2 bad input (one line on stderr).

The compilers (libtpu, the CUDA plugin) print warnings or tracebacks at every plain CPU start
when installed next to JAX, so they live in their own folder that only this module puts on
`sys.path`: $ICT_JAX_AOT_LIBS, default ~/.cache/ict_jax/aot-libs, filled by
    pip install --no-deps --target ~/.cache/ict_jax/aot-libs -r requirements-aot.txt
(installed next to JAX, e.g. on a TPU VM or in CI, they are found there too).

With the sampler compiled, a lower bound on one training step's time on the target (`plan.py`:
the update's real-token FLOPs at the chips' peak, prefill and decode bytes at their HBM bandwidth,
the decode on the rows live at each step with its collectives at the ICI bandwidth, on a length
distribution set by --prompt_median, --completion_median, --capped_share, ...) and on the hours of
train.steps steps: a bound to plan with, not a measurement; next to it the decode's limit (the
weights split over the chips + the KV really read): `decode_bytes_over_limit`,
`live_row_steps_over_real`.

One module a concern:
  targets.py   the targets (chips, usable HBM, peak FLOP/s, bandwidth) and their compile-only devices
  measure.py   compiling a lowered program: its memory, collectives (`Report`)
  step.py      the trainer's set-up on the target's mesh and its jitted train step
  sampler.py   the rollout's sampler
  decode_step.py  its decode step compiled alone (layer scan unrolled)
  decode_grid.py  that step's costs at every (phase bound, rows) from a few compiles
  plan.py      the lower bound on a step's time
  report.py    the reports as text
  cli.py       the command line (`main`)
"""

from __future__ import annotations

from ict_jax.aot import _env  # noqa: F401  (first: before JAX is imported)
from ict_jax.aot._env import LIBS_DIR

import jax  # noqa: E402

# compile_s is a compile, never a load from JAX_COMPILATION_CACHE_DIR
jax.config.update("jax_enable_compilation_cache", False)

from ict_jax.aot.measure import (  # noqa: E402
    COLLECTIVES,
    Report,
    bytes_per_device,
    count_collectives,
    count_cudnn_attention,
    measure,
)
from ict_jax.aot.plan import DecodeCosts, StepBound, step_bound  # noqa: E402
from ict_jax.aot.report import format_report  # noqa: E402
from ict_jax.aot.decode_step import compile_decode_step, decode_cache  # noqa: E402
from ict_jax.aot.sampler import compile_sampler  # noqa: E402
from ict_jax.aot.step import compile_train_step, train_batch  # noqa: E402
from ict_jax.aot.targets import GPU_MEM_FRACTION, GiB, TARGETS, AotError, Target, target_devices  # noqa: E402
from ict_jax.aot.cli import PARTS, main  # noqa: E402

__all__ = [
    "LIBS_DIR",
    "COLLECTIVES",
    "GPU_MEM_FRACTION",
    "GiB",
    "PARTS",
    "TARGETS",
    "AotError",
    "DecodeCosts",
    "Report",
    "StepBound",
    "Target",
    "bytes_per_device",
    "compile_decode_step",
    "compile_sampler",
    "compile_train_step",
    "count_collectives",
    "count_cudnn_attention",
    "decode_cache",
    "format_report",
    "main",
    "measure",
    "step_bound",
    "target_devices",
    "train_batch",
]
