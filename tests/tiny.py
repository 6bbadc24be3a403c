"""The tiny Qwen2 the step tests share, and the XLA:CPU options that make their compiles cheap."""

from __future__ import annotations

from ict_jax.models.config import Qwen2Config

# XLA:CPU compile time dominates the step tests; these options cut it about 4x (same HLO, same
# numerics up to float rounding of the generated loops). Passed to `make_train_step(compiler_options=)`.
COMPILE_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_cpu_use_fusion_emitters": False,
    "xla_llvm_disable_expensive_passes": True,
}


def tiny_config(vocab_size: int, max_position_embeddings: int = 64, **overrides) -> Qwen2Config:
  """2 layers, hidden 32, 4 query heads over 2 KV heads: every code path of the 0.5B-7B models
  (grouped-query attention, RoPE, tied or untied head) at a size XLA:CPU compiles in seconds."""
  return Qwen2Config(
      vocab_size=vocab_size,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      rope_theta=10000.0,
      max_position_embeddings=max_position_embeddings,
      **overrides,
  )


def step_config(**overrides):
  """A `train_step.StepConfig` with `overrides`, each a field of the step, of its `ict` section or of
  its `loss` section (method="grpo", beta=0.05, group_size=4, ...): the tests' short way to one."""
  import dataclasses

  from ict_jax import train_step as ts
  from ict_jax.config import IctConfig, LossConfig

  parts = {"ict": {}, "loss": {}, "step": {}}
  names = {"ict": IctConfig, "loss": LossConfig, "step": ts.StepConfig}
  for name, value in overrides.items():
    (part,) = [p for p, cls in names.items() if name in {f.name for f in dataclasses.fields(cls)}] or [None]
    if part is None:
      raise TypeError(f"step_config: {name!r} is no field of StepConfig, IctConfig or LossConfig")
    parts[part][name] = value
  return ts.StepConfig(ict=IctConfig(**parts["ict"]), loss=LossConfig(**parts["loss"]), **parts["step"])
