"""Packed decoder tokens for the train step (`config.train.token_budget`): the host's plan.

A padded batch runs the decoder on every row's full width, prompt bucket + completion bucket, so
one long completion makes every row long. Packed, each micro-batch's sequences (prompt and
completion, real tokens only) are laid end to end by first-fit-decreasing in rows of
W = min(token_budget, the padded width P + C) tokens (a row holds any sequence of the batch, and
never attends over more than a padded row). The decoder stack runs on those rows (segment ids: a
token attends to the earlier tokens of its own sequence only; positions: its place in its own
sequence). The LM head, with the group reference of ICT's JS score, runs on the groups' live
column blocks (below), and its outputs come back to the padded [N, C] layout where the selection
and the loss run as on the padded batch. Micro-batches stay the same whole groups, so the step's
loss, gradients and selection masks are the padded step's on the same batch (float rounding aside).

Token-balanced micro-batches (`pack_batch(balance=True)`, what train.py asks for when it
micro-batches): every micro-batch compiles to the packed-row count R of the fullest one (one shape
for the scan), so fixed consecutive groups waste the rows the lighter ones leave empty. Whole
groups are first reordered across micro-batches (`balance_groups`) so each holds a similar number
of real tokens; the packed step then equals the padded step on that PERMUTED batch. GRPO and ICT
(per-response top-k, the group reference inside a group) are micro-batch invariant: their loss,
gradients and masks do not change with the reordering. 20-Entropy and STAPO take their thresholds
per micro-batch (as verl does), so balancing changes which rows share a threshold, hence their
selection; that is a different (equally arbitrary) micro-batch composition, not an error.

Compiled shapes: the packed rows of a micro-batch are [R, W], W one per (prompt, completion)
bucket pair as for the padded batch (`train_step.trim_batch`); R (the most rows any micro-batch
of the step needs) is rounded up to a multiple of the mesh's data x fsdp devices `d`, and R / d to
one of `STEPS_PER_OCTAVE` = 16 values per power of two (every value up to 32, then 34, 36, .. 64,
68, ..): at most 16 x log2(micro_batch / d) + 16 values of R, of which a run meets the few near
its typical length, and rounding adds at most 1/16 of the rows (~3% on average). The LM head's
width C2 (below) is HEAD_BLOCK = 64 columns times a count bucketed alike. So a step compiles at
most (padded step's shapes) x (R values) x (C2 values) shapes; on the reasoning-like lengths of
`benchmarks/length.py` 20 batches of 1024 rows met 3-6 (R, C2) pairs where the padded step met 1.

The plan reads the masks on the host (numpy), outside jit: one process's whole batch (a
single-process run).
"""

from __future__ import annotations

import numpy as np

PACKED_KEYS = (
    "packed_ids",
    "packed_segments",
    "packed_positions",
    "head_index",
    "head_ids",
    "head_mask",
    "unhead_index",
)
STEPS_PER_OCTAVE = 16
HEAD_BLOCK = 64  # completion columns of a group a block of the LM head's input holds


def packed_rows_bucket(rows: int, multiple: int = 1) -> int:
  """`rows` rounded up to a multiple of `multiple`, then to one of STEPS_PER_OCTAVE values per
  power of two (in units of `multiple`)."""
  rows, multiple = int(rows), int(multiple)
  units = max(-(-rows // multiple), 1)
  step = 1 << max(0, units.bit_length() - STEPS_PER_OCTAVE.bit_length())  # units >= 16: 2, >= 32: 4, ..
  return -(-units // step) * step * multiple


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Bins of `capacity` for items of `lengths` (each <= capacity), longest first, each into the
  first bin it fits. -> (bin [n], offset in its bin [n], bins used)."""
  n = len(lengths)
  free = np.full(n, capacity, np.int64)  # at most one bin an item
  where, offset = np.zeros(n, np.int64), np.zeros(n, np.int64)
  used = 0
  for i in np.argsort(-lengths, kind="stable"):
    b = int(np.argmax(free >= lengths[i]))
    where[i], offset[i] = b, capacity - free[b]
    free[b] -= lengths[i]
    used = max(used, b + 1)
  return where, offset, used


def balance_groups(prompt_mask, completion_mask, *, group_size: int, micro_batch_size: int) -> np.ndarray:
  """A permutation of the batch's rows [N] that moves whole groups of `group_size` rows so each
  micro-batch (`micro_batch_size` rows) holds about as many real tokens (prompt + completion) as
  the others, as verl's dynamic batch size balances its micro-batches: groups largest first, each
  to the micro-batch with the fewest tokens so far that still has room (mb / G groups each). The
  micro-batches' token counts then differ by at most the largest group's. Groups keep their order
  within a micro-batch; deterministic (ties go to the lower index)."""
  lengths = np.asarray(prompt_mask).astype(bool).sum(1) + np.asarray(completion_mask).astype(bool).sum(1)
  n, g = len(lengths), group_size
  mb = micro_batch_size or n
  if n % mb or mb % g:
    raise ValueError(f"packing: micro-batch {mb} must divide the batch ({n} rows) and hold whole groups of {g}")
  tokens = lengths.reshape(n // g, g).sum(1)
  load, held = np.zeros(n // mb, np.int64), np.zeros(n // mb, np.int64)
  home = np.zeros(n // g, np.int64)  # each group's micro-batch
  for grp in np.argsort(-tokens, kind="stable"):
    room = np.flatnonzero(held < mb // g)
    m = room[np.argmin(load[room])]
    home[grp], load[m], held[m] = m, load[m] + tokens[grp], held[m] + 1
  groups = np.argsort(home, kind="stable")  # micro-batch by micro-batch
  return (groups[:, None] * g + np.arange(g)).reshape(-1)


def pack_plan(prompt_mask, completion_mask, *, token_budget: int, micro_batch_size: int = 0, multiple: int = 1):
  """(bin [N], offset [N], packed rows R per micro-batch) for the sequences of a batch.

  Micro-batch m (rows m*mb .. m*mb + mb - 1) fills its own R rows of `token_budget` tokens. Raises
  ValueError naming config.train.token_budget when a sequence does not fit one row."""
  lengths = np.asarray(prompt_mask).astype(bool).sum(1) + np.asarray(completion_mask).astype(bool).sum(1)
  n = len(lengths)
  mb = micro_batch_size or n
  if int(lengths.max(initial=0)) > token_budget:
    raise ValueError(
        f"config.train.token_budget: a packed row of {token_budget} tokens cannot hold a sequence of "
        f"{int(lengths.max())} (prompt + completion); use at least data.max_prompt_len + rollout.max_new_tokens"
    )
  where, offset = np.zeros(n, np.int64), np.zeros(n, np.int64)
  most = 1
  for m in range(n // mb):
    rows = slice(m * mb, (m + 1) * mb)
    where[rows], offset[rows], used = first_fit_decreasing(lengths[rows], token_budget)
    most = max(most, used)
  return where, offset, packed_rows_bucket(most, multiple)


def pack_batch(
    batch: dict,
    *,
    token_budget: int,
    group_size: int,
    block: int = HEAD_BLOCK,
    micro_batch_size: int = 0,
    multiple: int = 1,
    balance: bool = False,
) -> dict:
  """`batch` (a trimmed padded batch [N, P] / [N, C]) with the packed step's input added
  (PACKED_KEYS); micro-batch m (rows m*mb .. m*mb + mb - 1, whole groups) owns the m-th equal
  share of every packed array's rows, so the step scans them as it scans the padded rows.

  The decoder's input: packed_ids / packed_segments / packed_positions [N / mb * R, W] int32,
  W = min(token_budget, P + C). The LM head's, [N, C2] each: a block is a group's G rows x
  k = min(block, C) completion columns; the micro-batch's live blocks (a real token in them) are
  dealt round-robin to its mb / G stripes of G rows and laid side by side, so the head's group
  reference (G consecutive rows, one column) still reads one group's rows at one completion
  position, and C2 = k x (the most blocks a stripe holds, bucketed like R) is about the groups'
  mean padded length, not the batch's longest. head_index: into the micro-batch's flattened
  [R * W] decoder states, the position that predicts the token (padded position P - 1 + j; a
  column that predicts nothing real points at its sequence's first token); head_ids, head_mask:
  the completion's ids and mask there. Back to [N, C]: unhead_index, into the micro-batch's
  flattened [mb * C2] head outputs (mb * C2, out of range, where the whole group is padding).

  balance: first reorder whole groups by `balance_groups` (every per-row array of `batch`), so
  micro-batches hold similar token counts and R, the fullest one's rows, comes down. The result
  is then the permuted batch, packed: row i is the input's row perm[i]."""
  if balance and micro_batch_size and micro_batch_size < len(batch["completion_mask"]):
    perm = balance_groups(
        batch["prompt_mask"], batch["completion_mask"], group_size=group_size, micro_batch_size=micro_batch_size
    )
    batch = {k: np.asarray(v)[perm] for k, v in batch.items()}
  pmask = np.asarray(batch["prompt_mask"]).astype(bool)
  cmask = np.asarray(batch["completion_mask"]).astype(bool)
  cids = np.asarray(batch["completion_ids"])
  ids = np.concatenate([np.asarray(batch["prompt_ids"]), cids], 1)
  mask = np.concatenate([pmask, cmask], 1)
  n, p = pmask.shape
  c = cmask.shape[1]
  mb, g = micro_batch_size or n, group_size
  if n % mb or mb % g:
    raise ValueError(f"packing: micro-batch {mb} must divide the batch ({n} rows) and hold whole groups of {g}")
  width = min(token_budget, p + c)
  where, offset, rows = pack_plan(pmask, cmask, token_budget=width, micro_batch_size=mb, multiple=multiple)
  shape = (n // mb * rows, width)
  row = np.arange(n) // mb * rows + where  # each sequence's packed row, and its start there
  rank = np.cumsum(mask, 1) - 1  # a real position's place in its sequence
  dest = ((row * width + offset)[:, None] + rank)[mask]  # each real token's flat packed position
  order = np.lexsort((offset, row))  # sequences by packed row, then start
  first = np.r_[True, row[order][1:] != row[order][:-1]]
  seq_number = np.empty(n, np.int64)  # 1, 2, .. within its packed row
  seq_number[order] = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0)) + 1
  packed_ids, segments, positions = (np.zeros(shape[0] * width, np.int32) for _ in range(3))
  packed_ids[dest] = ids[mask]
  segments[dest] = np.broadcast_to(seq_number[:, None], mask.shape)[mask]
  positions[dest] = rank[mask]
  packed_ids, segments, positions = (x.reshape(shape) for x in (packed_ids, segments, positions))
  column = np.arange(c) + p - 1  # the padded position whose hidden state predicts column j
  real = mask[:, column]
  holes = np.flatnonzero((cmask & ~real).any(1))
  if holes.size:
    raise ValueError(
        f"packing: completion row {holes[0]} has a real token after a padding position (prompts must "
        f"be left-padded, completions right-padded)"
    )
  local = (where * width + offset)[:, None]  # the sequence's first token in its micro-batch's rows
  index = np.where(real, local + rank[:, column], local).astype(np.int32)  # what predicts column j

  # the LM head's input: per micro-batch, the (group, column block) pairs holding a real token,
  # dealt round-robin to the micro-batch's mb / G stripes of G rows, side by side in each stripe
  k = min(block, c)
  n_col = -(-c // k)
  padded_mask = np.pad(cmask, [(0, 0), (0, n_col * k - c)])
  live = padded_mask.reshape(n // g, g, n_col, k).any(axis=(1, 3))  # [groups, column blocks]
  stripes = mb // g
  per_stripe = -(-live.reshape(n // mb, stripes * n_col).sum(1) // stripes)  # blocks a stripe, per micro-batch
  width_head = packed_rows_bucket(int(per_stripe.max(initial=1))) * k
  head_index, head_ids, head_mask = (np.zeros((n, width_head), np.int32) for _ in range(3))
  unhead = np.full((n, c), mb * width_head, np.int32)
  for m in range(n // mb):
    groups = range(m * stripes, (m + 1) * stripes)
    for t, (grp, col) in enumerate((grp, col) for grp in groups for col in np.flatnonzero(live[grp])):
      stripe, at = t % stripes, t // stripes * k
      src = slice(grp * g, grp * g + g)  # the group's rows
      cols = slice(col * k, min(col * k + k, c))
      span = cols.stop - cols.start
      dst = slice(m * mb + stripe * g, m * mb + stripe * g + g)
      head_index[dst, at : at + span] = index[src, cols]
      head_ids[dst, at : at + span] = cids[src, cols]
      head_mask[dst, at : at + span] = cmask[src, cols]
      unhead[src, cols] = (stripe * g + np.arange(g)[:, None]) * width_head + at + np.arange(span)[None]
  return {
      **batch,
      "packed_ids": packed_ids,
      "packed_segments": segments,
      "packed_positions": positions,
      "head_index": head_index,
      "head_ids": head_ids,
      "head_mask": head_mask,
      "unhead_index": unhead,
  }
