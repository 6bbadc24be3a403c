"""Shared settings of the paper-scale runs (Qwen2.5 + GSM8K/MATH, ICT top-10% JS tokens), used by
`configs/qwen2_5_*_math.py` (and importable from any project: `from ict_jax.paper_config import
paper_config`).

Values the paper ("Beyond Entropy: Learning from Token-Level Distributional Deviations for LLM
Reasoning") states are marked PAPER; the rest are ASSUMPTIONS, chosen as common verl / TRL
GRPO practice for Qwen2.5 math RL, and kept configurable.
"""

from ict_jax.config import default_config


def paper_config(
    model_dir: str,
    preset: str,
    *,
    prompts_per_step: int,
    steps: int,
    mesh_fsdp: int = -1,
    mesh_tensor: int = 1,
    micro_batch_tokens: int = 32 * 2560,
):
  c = default_config()
  c.model.path = model_dir  # local HF folder, e.g. /ckpt/Qwen2.5-1.5B
  c.model.preset = preset  # its architecture (python -m ict_jax.aot uses it
  # where the folder is absent)
  c.model.dtype = "bfloat16"  # ASSUMPTION: bf16 compute
  c.model.param_dtype = "float32"  # ASSUMPTION: fp32 master weights + Adam state
  c.model.remat_policy = "full"
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, mesh_fsdp, mesh_tensor
  c.data.name = "gsm8k+math"  # PAPER: trained on GSM8K + MATH
  c.data.config = ""
  c.data.manual_dir = "~/tensorflow_datasets/downloads/manual"  # put the JSONL/parquet files here
  c.data.prompt_style = "chat"  # Qwen chat template + "\boxed{}" instruction
  c.data.max_prompt_len = 512  # ASSUMPTION
  c.rollout.prompts_per_step = prompts_per_step  # ASSUMPTION (verl default train_batch_size)
  c.rollout.group_size = 8  # ASSUMPTION: G = 8
  c.rollout.max_new_tokens = 2048  # ASSUMPTION
  c.rollout.temperature = 1.0  # ASSUMPTION
  c.ict.method = "ict"  # PAPER: grpo | entropy (20-Entropy) | stapo | ict
  c.ict.top_fraction = 0.1  # PAPER: top 10% unique tokens by JS
  c.ict.warmup_steps = 10  # PAPER (DESIGN.md): first steps dense GRPO
  c.ict.entropy_top_fraction = 0.2  # PAPER baseline: 20-Entropy
  c.ict.chunk_size = 256
  c.loss.loss_type = "grpo"  # Sparse-GRPO normalisation for ICT; GRPO baseline
  c.loss.beta = 0.0  # ASSUMPTION: no KL (common for RLVR); 0.001 to enable
  c.loss.epsilon_low, c.loss.epsilon_high = 0.2, 0.2  # ASSUMPTION: symmetric clip
  c.optim.learning_rate = 1e-6  # ASSUMPTION
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.max_grad_norm = 1.0
  c.reward.kind = "math"  # PAPER: verifiable \boxed{} answer reward
  c.reward.num_workers = 8
  c.reward.timeout_s = 5.0
  c.train.steps = steps  # ASSUMPTION
  # the update on packed rows, micro-batches by tokens (README "Packed tokens"; verl's dynamic batch
  # size): rows of one whole sequence's width, each micro-batch `micro_batch_tokens` of them (32
  # rows of 2560 tokens), as many whole groups as fit. The padded update instead:
  # --config.train.token_budget=0 --config.train.micro_batch_tokens=0 --config.train.micro_batch_size=N
  c.train.token_budget = c.data.max_prompt_len + c.rollout.max_new_tokens
  c.train.micro_batch_tokens = micro_batch_tokens
  c.train.micro_batch_size = 0
  c.train.checkpoint_every = 25
  c.train.keep_checkpoints = 3
  c.train.eval_samples = 4  # PAPER: pass@4 (P@1 and P@4)
  return c
