"""The one batch type that flows from the rollout into the train step.

    batch = rollout.batch()                          # TrainBatch, padded rows
    batch = batch.trim(completion_len=...)           # cut to its real length (few compiled shapes)
    batch = packing.pack_batch(batch, ...)           # optional: with a PackedLayout for the decoder
    state, metrics, logp = step(state, batch, ref_params)

Every field is an array with the rows first ([N, ...], sharded over the mesh's row axes); the
optional ones are None when absent, which is part of the pytree's structure (a batch with and one
without `old_logp` compile to two programs, as two dicts with other keys did). `TrainBatch.abstract`
builds the `jax.ShapeDtypeStruct` batch that `ict_jax.aot` compiles the step for.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # np.ndarray | jax.Array | jax.ShapeDtypeStruct


@flax.struct.dataclass
class PackedLayout:
  """The packed decoder input of `packing.pack_batch` (see its docstring for the layout)."""

  ids: Array  # [M * R, W] int32: micro-batch m's R packed rows of W tokens
  segments: Array  # [M * R, W] int32: 1, 2, .. a sequence within its packed row, 0 padding
  positions: Array  # [M * R, W] int32: a token's place in its own sequence
  head_index: Array  # [N, C2] int32: into the micro-batch's flat [R * W] decoder states
  head_ids: Array  # [N, C2] int32: the completion ids the LM head scores there
  head_mask: Array  # [N, C2] int32
  head_segments: Array  # [N, C2] int32: pieces of a head slot told apart (group reference)
  unhead_index: Array  # [N, C] int32: into the micro-batch's flat [mb * C2] head outputs
  source_row: Array | None = None  # [N] int32, token-budget micro-batches: the input row, -1 empty
  micro_batch_rows: int = flax.struct.field(pytree_node=False, default=0)  # mb, static


@flax.struct.dataclass
class TrainBatch:
  """A step's rows: prompts left-padded, completions right-padded."""

  prompt_ids: Array  # [N, P] int32
  prompt_mask: Array  # [N, P] int32
  completion_ids: Array  # [N, C] int32
  completion_mask: Array  # [N, C] int32
  advantages: Array  # [N] float32
  old_logp: Array | None = None  # [N, C] float32: num_iterations > 1 (default: on-policy)
  stop_pos: Array | None = None  # [N] int32: each row's stop token (-1: none), a rollout's
  answer_end: Array | None = None  # [N] int32: first position after the final box (-1: none)
  packed: PackedLayout | None = None  # the decoder on packed rows (train.token_budget)
  score_noise: Array | None = None  # [N, C] float32: the "random" ICT ablation's scores
  hidden_offset: Array | None = None  # [N] float32 added to the final hidden states before the
  # LM head: a fault-injection seam (benchmarks/faults: non-finite logits); None in every run

  @property
  def rows(self) -> int:
    return int(np.shape(self.completion_ids)[0])

  @property
  def micro_batch_rows(self) -> int:
    """The rows a micro-batch that the batch itself names (a token-budget packed batch), else 0."""
    return self.packed.micro_batch_rows if self.packed is not None else 0

  def executed_positions(self) -> int:
    """Decoder positions the update runs a pass: the packed rows x their width when packed, else
    every padded row x (prompt + completion width)."""
    if self.packed is not None:
      return int(np.prod(np.shape(self.packed.ids)))
    return self.rows * (int(np.shape(self.prompt_ids)[1]) + int(np.shape(self.completion_ids)[1]))

  def map_rows(self, fn) -> "TrainBatch":
    """`fn` applied to every array (e.g. a row permutation, host transfer, sharding)."""
    return jax.tree.map(fn, self)

  def trim(self, buckets: Sequence[int] | None = None, *, completion_len: int | None = None) -> "TrainBatch":
    """The batch cut to its real length, on the host, before the step (few compiled shapes).

    Completion columns [N, C] -> [N, C'], C' = min(C, sampling.bucket_length(longest completion,
    buckets)); left-padded prompt columns [N, P] -> [N, P'] likewise from the left. The columns cut
    hold padding only (mask 0): positions are cumsum(mask) - 1, padding keys are masked out, and
    every loss, statistic and metric sums over the mask, so the step's results are those of the
    untrimmed batch (dr_grpo's divisor is the config's max_completion_length, not the width). With
    the default power-of-two buckets a step compiles at most log2(C / 16) + 1 completion widths.
    logp comes back [N, C']; feed it as old_logp with the same trimmed batch. `completion_len`:
    the longest completion when the caller knows it (the rollout gathers every row's length), so
    the completion mask, which may live on other hosts' devices, is not read here; completions
    are right-padded, so it is the last used column + 1. A packed batch is trimmed before packing."""
    from ict_jax.sampling import bucket_length

    if self.packed is not None:
      raise ValueError("TrainBatch.trim: trim the padded batch, then pack it")
    pmask = np.asarray(self.prompt_mask)
    c, p = np.shape(self.completion_mask)[1], pmask.shape[1]
    if completion_len is None:
      used = np.flatnonzero(np.asarray(self.completion_mask).any(axis=0))
      completion_len = int(used[-1]) + 1 if used.size else 1
    c_new = min(c, bucket_length(max(int(completion_len), 1), buckets))
    used = np.flatnonzero(pmask.any(axis=0))
    p_new = min(p, bucket_length(p - int(used[0]) if used.size else 1, buckets))
    cut = lambda x: None if x is None else x[:, :c_new]
    return self.replace(
        prompt_ids=self.prompt_ids[:, p - p_new :],
        prompt_mask=self.prompt_mask[:, p - p_new :],
        completion_ids=cut(self.completion_ids),
        completion_mask=cut(self.completion_mask),
        old_logp=cut(self.old_logp),
        score_noise=cut(self.score_noise),
    )

  @classmethod
  def abstract(
      cls, rows: int, prompt_len: int, completion_len: int, *, old_logp: bool = False, sharding=None
  ) -> "TrainBatch":
    """The padded batch's shapes as `jax.ShapeDtypeStruct`s (carrying `sharding`): what the
    trainer feeds the step after a rollout, for `ict_jax.aot` to compile."""
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return cls(
        prompt_ids=s((rows, prompt_len), jnp.int32),
        prompt_mask=s((rows, prompt_len), jnp.int32),
        completion_ids=s((rows, completion_len), jnp.int32),
        completion_mask=s((rows, completion_len), jnp.int32),
        advantages=s((rows,), jnp.float32),
        old_logp=s((rows, completion_len), jnp.float32) if old_logp else None,
        stop_pos=s((rows,), jnp.int32),
        answer_end=s((rows,), jnp.int32),
    )
