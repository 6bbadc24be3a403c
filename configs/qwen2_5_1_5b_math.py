"""Qwen2.5-1.5B on GSM8K + MATH with ICT — the paper's setting (see ict_jax/paper_config.py).

    python -m ict_jax.train --config configs/qwen2_5_1_5b_math.py --workdir gs://BUCKET/run \
        --config.model.path=/ckpt/Qwen2.5-1.5B [--config.ict.method=grpo|entropy|stapo|ict]

Mesh: v5p-32: fsdp=16 (or v5e-8: fsdp=8; 8 x H100/H200: fsdp=8). Batch: 128 prompts x G=8 per
step (ASSUMPTION). The update runs on packed rows (`paper_config`, which also names the padded
update's flags). Check a target with
`python -m ict_jax.aot --config configs/qwen2_5_1_5b_math.py --target v5e-8`
(tabled in benchmarks/RESULTS.md and README.md).
"""

from ict_jax.paper_config import paper_config


def get_config():
  c = paper_config("/ckpt/Qwen2.5-1.5B", "qwen2_5_1_5b", prompts_per_step=128, steps=500, mesh_fsdp=-1)
  # the rollout copy's q/k/v/o whole on every chip (11 MiB a layer), the MLP and the head split over
  # the chips: the decode step gathers the rows for the MLP only (sampling.policy, RESULTS issue 41)
  c.rollout.decode_weights = "mlp"
  # compaction keeps multiples of 1/16 of a chip's rows where that is 8 rows or more (v5e-8, 8 GPUs:
  # 8 of 128; v5p-32 stays at 8 of 64): finished rows leave the decode batch sooner, for up to 16
  # decode programs a phase instead of 8 (RESULTS issue 41)
  c.rollout.compaction_units = 16
  return c
