"""Jitted generation for rollouts and evaluation: `generate(model, prompt_ids, prompt_mask, ...)`.

One module a concern:
  rules.py    sampling one token per row: temperature, top-k, top-p, greedy (`sample_logits`).
  policy.py   the rollout copy of the policy: weights cast and laid out for decoding once a step.
  decode.py   the jitted prefill (once per prompt) + KV-cache decode loop, sub-batches (`sample_fn`).
  compact.py  the decode loop's phases driven from the host, the finished rows dropped between them.
  balance.py  the host's plan of the live rows moved between row shards at a compaction.
  plan.py     length buckets, the decode sub-batch size, which rows share a prefilled prompt, and
              the decode loop's length-bounded phases.
  host.py     `generate` (validation, bucketing, the mesh), `generate_sub_batches` (the decode
              sub-batches one dispatch each, for host work between them) and `lower_generate` (AOT).
"""

from ict_jax.sampling.decode import QWEN_EOS_IDS, QWEN_PAD_ID, decode_head, decode_one, prefill, sample_fn
from ict_jax.sampling.host import (
    SubBatch,
    generate,
    generate_sub_batches,
    join_sub_batches,
    lower_generate,
    prompt_sharding,
)
from ict_jax.sampling.plan import (
    DecodeLayout,
    auto_decode_batch_size,
    bucket_length,
    compacted_rows,
    decode_layout,
    decode_phases,
    decode_row_bytes,
    decode_stretches,
    free_device_bytes,
    kv_bytes,
    kv_read_over_filled,
    resolve_decode_batch_size,
)
from ict_jax.sampling.policy import (
    DECODE_RULES,
    DECODE_WEIGHTS,
    TENSOR_RULES,
    ROLLOUT_DTYPES,
    RolloutPolicy,
    abstract_rollout_policy,
    as_rollout_policy,
    decode_shardings,
    make_rollout_policy,
)
from ict_jax.sampling.rules import sample_logits

__all__ = [
    "generate",
    "generate_sub_batches",
    "join_sub_batches",
    "SubBatch",
    "sample_fn",
    "sample_logits",
    "bucket_length",
    "make_rollout_policy",
    "as_rollout_policy",
    "abstract_rollout_policy",
    "RolloutPolicy",
    "decode_shardings",
    "decode_head",
    "decode_one",
    "prefill",
    "lower_generate",
    "prompt_sharding",
    "DecodeLayout",
    "decode_layout",
    "decode_phases",
    "decode_stretches",
    "compacted_rows",
    "kv_read_over_filled",
    "kv_bytes",
    "decode_row_bytes",
    "auto_decode_batch_size",
    "free_device_bytes",
    "resolve_decode_batch_size",
    "DECODE_RULES",
    "DECODE_WEIGHTS",
    "TENSOR_RULES",
    "ROLLOUT_DTYPES",
    "QWEN_EOS_IDS",
    "QWEN_PAD_ID",
]
