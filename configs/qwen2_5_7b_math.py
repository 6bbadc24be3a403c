"""Qwen2.5-7B on GSM8K + MATH with ICT — the paper's setting (see ict_jax/paper_config.py).

    python -m ict_jax.train --config configs/qwen2_5_7b_math.py --workdir gs://BUCKET/run \
        --config.model.path=/ckpt/Qwen2.5-7B [--config.ict.method=grpo|entropy|stapo|ict]

Mesh: v5p-32: fsdp=16; 8 x H100/H200: fsdp=8. Batch: 128 prompts x G=8 per step (ASSUMPTION).
The update runs on packed rows (`paper_config`, which also names the padded update's flags). Not
v5e-8: its float32 parameters and Adam state alone (16 B a parameter, 14.2 GiB/chip over 8 chips)
leave no room for activations in 15.75 GiB, and bfloat16 parameters are refused (they lose lr 1e-6
updates); with LoRA adapters it fits: --config.model.lora_rank=16, on this mesh (fsdp=8) or
--config.mesh.fsdp=4 --config.mesh.tensor=2 (README, "LoRA adapters"). Check a target with
`python -m ict_jax.aot --config configs/qwen2_5_7b_math.py --target v5p-32`.
"""

from ict_jax.paper_config import paper_config


def get_config():
  return paper_config("/ckpt/Qwen2.5-7B", "qwen2_5_7b", prompts_per_step=128, steps=500, mesh_fsdp=-1, mesh_tensor=1)
