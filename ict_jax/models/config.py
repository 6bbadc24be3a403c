"""Qwen2 architecture hyper-parameters, the published presets, and parameter/FLOP counts."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ict_jax.cpu_paths import KERNELS

DTYPES = ("float32", "bfloat16", "float16")  # compute and parameter dtypes
REMAT_POLICIES = ("none", "full", "minimal")  # MaxText's names; see models/qwen2.REMAT_POLICIES
ATTENTION = ("einsum", "dot_product", "cudnn", "splash")  # see models/attention.py
DECODE_ATTENTION = ("xla", "pallas", "pallas_interpret")  # see models/decode_kernel.py
DECODE_WEIGHTS = ("replicated", "tensor", "mlp")  # see models/qwen2.py and sampling/policy.py


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Hyper-parameters of a Qwen2 / Qwen2.5 decoder (names follow `transformers.Qwen2Config`)."""

  vocab_size: int = 151936
  hidden_size: int = 896
  intermediate_size: int = 4864
  num_hidden_layers: int = 24
  num_attention_heads: int = 14
  num_key_value_heads: int = 2
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 32768
  dtype: str = "float32"  # compute dtype of activations and matmuls
  param_dtype: str = "float32"  # storage dtype of the parameters
  # jax.checkpoint around the scanned decoder layer when there is no KV cache (train step,
  # scoring): "none"; "full" (keep only each layer's input, recompute the rest in the backward
  # pass); "minimal" (keep the outputs of the matmuls with weights, recompute the rest).
  remat_policy: str = "none"
  # attention without a KV cache (train step, scoring, warm start): "einsum" (the reference),
  # "dot_product" (jax.nn.dot_product_attention, XLA), "cudnn" (its cuDNN flash kernel, GPU),
  # "splash" (the Pallas TPU kernel). A concrete choice: the run config's "auto" is resolved
  # from the mesh's devices in `setup.model_config`.
  attention: str = "einsum"
  # the decode step's attention over the KV cache: "xla" (einsums over a [L, B, K, S, H] keys
  # and values cache) or "pallas" (`models/decode_kernel.py`: a fused Pallas TPU kernel over a
  # joint [L, B, K, S, 2H] cache, scores kept on-chip, and with the MLP split over the chips the
  # fused MLP of `models/mlp_kernel.py`); "pallas_interpret" runs those kernels in the Pallas
  # interpreter (any backend; tests). The run config's "auto" is resolved in `setup`.
  decode_attention: str = "xla"
  # the kernels' formulation (`ict_jax.cpu_paths`): "portable" (TPU, GPU, any mesh: what the
  # reference tests check) or "cpu" (XLA:CPU on one device). A concrete choice: the run config's
  # "auto" is resolved from the mesh's devices in `setup.model_config`.
  kernels: str = "portable"
  # the decode step's weights (`sampling.policy.DECODE_WEIGHTS`, the rollout copy's layout):
  # "replicated" (every weight whole on every row shard; a chip reads all of them a step) or
  # "tensor" (the MLP, the vocabulary and the attention's embed dimension split over every chip of
  # the mesh: the decode step gathers the rows for those matmuls and scatters them back, so a chip
  # reads 1/chips of each weight a step; the attention itself still runs on each chip's rows) or
  # "mlp" (the MLP and the vocabulary split so, the attention's projections whole on every chip and
  # run on its own rows: more weight bytes, fewer gathered rows and collectives; see `split_mlp`).
  decode_weights: str = "replicated"

  def __post_init__(self):
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Qwen2Config.{name}: expected a positive int, got {value!r}")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
          f"Qwen2Config: hidden_size {self.hidden_size} is not divisible by "
          f"num_attention_heads {self.num_attention_heads}"
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"Qwen2Config: num_attention_heads {self.num_attention_heads} is not "
          f"divisible by num_key_value_heads {self.num_key_value_heads}"
      )
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"Qwen2Config.remat_policy: expected one of {REMAT_POLICIES}, " f"got {self.remat_policy!r}")
    if self.attention not in ATTENTION:
      raise ValueError(f"Qwen2Config.attention: expected one of {ATTENTION}, got {self.attention!r}")
    if self.decode_attention not in DECODE_ATTENTION:
      raise ValueError(
          f"Qwen2Config.decode_attention: expected one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
      )
    if self.decode_weights not in DECODE_WEIGHTS:
      raise ValueError(f"Qwen2Config.decode_weights: expected one of {DECODE_WEIGHTS}, got {self.decode_weights!r}")
    if self.kernels not in KERNELS:
      raise ValueError(f"Qwen2Config.kernels: expected one of {KERNELS}, got {self.kernels!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"Qwen2Config.{name}: expected one of {DTYPES}, got {getattr(self, name)!r}")

  @property
  def split_mlp(self) -> bool:
    """The decode step's MLP and LM head split over every chip (decode_weights "tensor" / "mlp")."""
    return self.decode_weights in ("tensor", "mlp")

  @property
  def split_attention(self) -> bool:
    """The decode step's q/k/v/o split on embed over every chip too (decode_weights "tensor")."""
    return self.decode_weights == "tensor"

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def num_groups(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  def replace(self, **kw) -> "Qwen2Config":
    return dataclasses.replace(self, **kw)

  # ---- presets (published transformers configs) ---------------------------------------------
  @classmethod
  def preset(cls, name: str, **overrides) -> "Qwen2Config":
    if name not in PRESETS:
      raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

  # ---- Hugging Face config.json --------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json", **overrides) -> "Qwen2Config":
    model_type = d.get("model_type")
    if model_type != "qwen2":
      raise ValueError(
          f"{source}: unsupported model_type {model_type!r}; expected 'qwen2' " "(Qwen2 / Qwen2.5 checkpoints)"
      )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
      raise ValueError(f"{source}: missing required key(s) {missing}")
    rope_theta = d.get("rope_theta")
    if rope_theta is None:  # transformers 5 nests it under rope_parameters
      rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    kw = dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
    )
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim != kw["hidden_size"] // kw["num_attention_heads"]:
      raise ValueError(
          f"{source}: head_dim {head_dim} != hidden_size/num_attention_heads; "
          "only the standard Qwen2 head size is supported"
      )
    kw.update(overrides)
    try:
      return cls(**kw)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{source}: {e}") from None

  def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": torch_dtype or self.param_dtype,
    }

  # ---- sizes ---------------------------------------------------------------------------------
  def num_params(self) -> int:
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    n, k = self.num_attention_heads, self.num_key_value_heads
    attn = d * n * h + n * h + 2 * (d * k * h + k * h) + n * h * d
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * v
    return v * d + self.num_hidden_layers * layer + d + head

  def flops_per_token(self, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token (matmuls + attention scores), 6N-style for training, 2N for forward.

    Counts every matmul with weights (embedding lookup excluded, LM head included) and the
    causal attention score/value products (seq_len/2 average context)."""
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    n, k = self.num_attention_heads, self.num_key_value_heads
    matmul_params = self.num_hidden_layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + d * v
    attn = self.num_hidden_layers * 2 * n * h * seq_len / 2  # QK^T and AV, causal average
    forward = 2 * (matmul_params + attn)
    return 3 * forward if training else forward


PRESETS: dict[str, Qwen2Config] = {
    # A tiny Qwen2 for tests and the CPU default (real Qwen2.5 vocabulary, so the bundled
    # tokenizer's ids are valid).
    "tiny": Qwen2Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    ),
    "qwen2_5_0_5b": Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2_5_1_5b": Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2_5_7b": Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # The benchmark config of issues 7-9: vocab 151936, hidden 256, 4 layers, 4/2 heads, MLP 704.
    "bench": Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}
