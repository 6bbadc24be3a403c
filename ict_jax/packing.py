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
bucket pair as for the padded batch (`TrainBatch.trim`); R (the most rows any micro-batch
of the step needs) is rounded up to a multiple of the mesh's data x fsdp devices `d`, and R / d to
one of `STEPS_PER_OCTAVE` = 16 values per power of two (every value up to 32, then 34, 36, .. 64,
68, ..): at most 16 x log2(micro_batch / d) + 16 values of R, of which a run meets the few near
its typical length, and rounding adds at most 1/16 of the rows (~3% on average). The LM head's
width C2 (below) is HEAD_BLOCK = 64 columns times a count bucketed alike. So a step compiles at
most (padded step's shapes) x (R values) x (C2 values) shapes; on the reasoning-like lengths of
`benchmarks/length.py` 20 batches of 1024 rows met 3-6 (R, C2) pairs where the padded step met 1.

Token-budget micro-batches (`pack_batch(micro_batch_tokens=T)`, `config.train.micro_batch_tokens`):
with few rows a device, a fixed row count wastes whole packed rows (a 64-row micro-batch of the
paper's lengths needs ~17 rows of 2560 tokens, 24 on 8 devices, 32 on 16). Instead each
micro-batch gets R = T / W packed rows (a multiple of the devices, at least a group's) and as many
whole groups as fit (`token_micro_batches`: first fit decreasing, then dealt evenly over that many
micro-batches), verl's dynamic batch size. Its groups' rows take mb row slots (mb = G x the most
groups a micro-batch holds, bucketed like R), the empty slots after them zero (source_row -1; they
count in no loss denominator); the step takes mb from the batch (`PackedLayout.micro_batch_rows`, a static
field of the layout). The micro-batch count M varies with the lengths: compiled shapes per (W, M, mb, C2);
on `benchmarks/length.py`'s distributions 20 batches of 1024 rows met 2-6 of them.

The plan reads the masks on the host (numpy), outside jit: one process's whole batch (a
single-process run).
"""

from __future__ import annotations

import numpy as np

from ict_jax.batch import PackedLayout, TrainBatch

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


def _first_fit(room: np.ndarray, members: np.ndarray, lengths: np.ndarray, width: int):
  """Each of `members` (longest first) into the first row of `room` (free tokens a row) it fits;
  -> [(member, row, offset)], `room` updated in place, or None (room untouched) when one does not."""
  trial, placed = room.copy(), []
  for i in members:
    fits = np.flatnonzero(trial >= lengths[i])
    if not fits.size:
      return None
    placed.append((i, fits[0], width - trial[fits[0]]))
    trial[fits[0]] -= lengths[i]
  room[:] = trial
  return placed


def _assign_groups(lengths: np.ndarray, g: int, width: int, rows: int, opened: int):
  """Groups (most tokens first) into micro-batches of `rows` rows of `width`: with `opened` = 0,
  each into the first that takes it (first fit); with `opened` = M micro-batches open from the
  start, each into the least loaded one that takes it (even micro-batches), a new one only when
  none does. -> (micro [N], where [N], offset [N], micro-batches used)."""
  tokens = lengths.reshape(-1, g).sum(1)
  free = [np.full(rows, width, np.int64) for _ in range(opened)]  # per micro-batch: each row's free tokens
  load = [0] * opened
  micro, where, offset = (np.zeros(len(lengths), np.int64) for _ in range(3))
  for grp in np.argsort(-tokens, kind="stable"):
    members = grp * g + np.argsort(-lengths[grp * g : grp * g + g], kind="stable")
    order = np.argsort(load, kind="stable") if opened else range(len(free))
    placed = None
    for m in order:
      placed = _first_fit(free[m], members, lengths, width)
      if placed is not None:
        break
    if placed is None:  # a new micro-batch
      m = len(free)
      free.append(np.full(rows, width, np.int64))
      load.append(0)
      placed = _first_fit(free[m], members, lengths, width)
    if placed is None:
      raise ValueError(
          f"packing: a group of {g} sequences ({int(tokens[grp])} tokens, the longest "
          f"{int(lengths[members[0]])}) does not fit a micro-batch of {rows} rows of {width} tokens"
      )
    load[m] += int(tokens[grp])
    for i, b, off in placed:
      micro[i], where[i], offset[i] = m, b, off
  used = np.unique(micro)
  return np.searchsorted(used, micro), where, offset, len(used)


def token_micro_batches(
    lengths, *, group_size: int, width: int, rows: int, multiple: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """Whole groups into micro-batches of at most `rows` packed rows of `width` tokens each, as many
  groups a micro-batch as fit (verl's dynamic batch size: a token budget, not a row count). First
  fit decreasing (groups with the most tokens first, each group's sequences longest first into
  the first row with room) gives the count M; the groups are then dealt again, each to the least
  loaded of M micro-batches that takes it, so micro-batches hold similar tokens and groups (the
  LM head's and the [rows, C] arrays' width follow the fullest one), and the rows a micro-batch
  shrink by `multiple` while M of them still hold every group (the last micro-batch is not left
  near empty). -> (micro-batch [N] in 0 .. M - 1, packed row in it [N], offset in that row [N],
  packed rows R a micro-batch). Raises ValueError when a group does not fit an empty micro-batch."""
  lengths = np.asarray(lengths, np.int64)
  *best, m = _assign_groups(lengths, group_size, width, rows, 0)
  best, used = tuple(best), rows
  for r in range(rows, 0, -multiple):
    try:
      *even, m_even = _assign_groups(lengths, group_size, width, r, m)
    except ValueError:  # a group no longer fits one micro-batch
      break
    if m_even != m:
      break
    best, used = tuple(even), r
  return (*best, used)


def micro_batch_tokens_rows(micro_batch_tokens: int, width: int, group_size: int, multiple: int = 1) -> int:
  """Packed rows R of a token-budget micro-batch: the most rows of `width` tokens within
  `micro_batch_tokens`, a multiple of `multiple` (the mesh's data x fsdp), and at least enough
  rows for a group of full-width sequences."""
  least = -(-group_size // multiple) * multiple
  return max(micro_batch_tokens // width // multiple * multiple, least)


def pack_batch(
    batch: TrainBatch,
    *,
    token_budget: int,
    group_size: int,
    block: int = HEAD_BLOCK,
    micro_batch_size: int = 0,
    multiple: int = 1,
    balance: bool = False,
    micro_batch_tokens: int = 0,
) -> TrainBatch:
  """`batch` (a trimmed padded batch [N, P] / [N, C]) with the packed step's input added
  (`TrainBatch.packed`, a `PackedLayout`); micro-batch m (rows m*mb .. m*mb + mb - 1, whole groups) owns the m-th equal
  share of every packed array's rows, so the step scans them as it scans the padded rows.

  The decoder's input: ids / segments / positions [N / mb * R, W] int32,
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
  is then the permuted batch, packed: row i is the input's row perm[i]. Every array comes back
  on the host (numpy)."""
  if batch.packed is not None:
    raise ValueError("packing: the batch is packed already")
  if batch.hidden_offset is not None:
    raise ValueError("packing: TrainBatch.hidden_offset (a padded-row fault seam) has no packed layout")
  batch = batch.map_rows(np.asarray)
  if micro_batch_tokens:
    *layout, source_row = _token_layout(batch, token_budget, group_size, micro_batch_tokens, multiple)
    return _pack(*layout, group_size, block, source_row=source_row)
  if balance and micro_batch_size and micro_batch_size < batch.rows:
    perm = balance_groups(
        batch.prompt_mask, batch.completion_mask, group_size=group_size, micro_batch_size=micro_batch_size
    )
    batch = batch.map_rows(lambda v: v[perm])
  n, (p, c) = batch.rows, (np.shape(batch.prompt_mask)[1], np.shape(batch.completion_mask)[1])
  mb, g = micro_batch_size or n, group_size
  if n % mb or mb % g:
    raise ValueError(f"packing: micro-batch {mb} must divide the batch ({n} rows) and hold whole groups of {g}")
  width = min(token_budget, p + c)
  plan = pack_plan(batch.prompt_mask, batch.completion_mask, token_budget=width, micro_batch_size=mb, multiple=multiple)
  return _pack(batch, width, mb, *plan, group_size, block)


def _token_layout(batch: TrainBatch, token_budget: int, group_size: int, micro_batch_tokens: int, multiple: int):
  """`pack_batch(micro_batch_tokens=T)`'s layout: M micro-batches of R = `micro_batch_tokens_rows`
  packed rows (`token_micro_batches`), each micro-batch's groups in mb row slots (its groups'
  rows, then empty rows: zero masks, ids and advantages; source_row: the input row, -1 empty), mb = G x the most groups
  a micro-batch holds, a multiple of lcm(G, multiple), bucketed like R. -> (batch laid out
  [M * mb], W, mb, where [M * mb], offset [M * mb], R, source_row [M * mb])."""
  pmask, cmask = np.asarray(batch.prompt_mask) != 0, np.asarray(batch.completion_mask) != 0
  n, g = len(cmask), group_size
  width = min(token_budget, pmask.shape[1] + cmask.shape[1])
  rows = micro_batch_tokens_rows(micro_batch_tokens, width, g, multiple)
  micro, where, offset, rows = token_micro_batches(
      pmask.sum(1) + cmask.sum(1), group_size=g, width=width, rows=rows, multiple=multiple
  )
  per_micro = np.bincount(micro[::g], minlength=int(micro.max(initial=0)) + 1)  # groups a micro-batch
  unit = np.lcm(g, multiple)
  mb = packed_rows_bucket(int(per_micro.max()) * g, unit)
  src = np.full(len(per_micro) * mb, -1, np.int64)  # each slot's batch row, -1: empty
  for m in range(len(per_micro)):
    groups = np.flatnonzero(micro[::g] == m)
    members = (groups[:, None] * g + np.arange(g)).reshape(-1)
    src[m * mb : m * mb + len(members)] = members
  real = src >= 0
  take = lambda x: np.where(real.reshape(-1, *[1] * (np.ndim(x) - 1)), np.asarray(x)[np.maximum(src, 0)], 0)
  laid = batch.map_rows(lambda v: take(v).astype(np.asarray(v).dtype))
  return (
      laid,
      width,
      mb,
      np.where(real, where[np.maximum(src, 0)], 0),
      np.where(real, offset[np.maximum(src, 0)], 0),
      rows,
      src.astype(np.int32),
  )


def _pack(
    batch: TrainBatch, width: int, mb: int, where, offset, rows: int, group_size: int, block: int, source_row=None
) -> TrainBatch:
  """The packed arrays of `batch` (its `PackedLayout`) for micro-batches of `mb` rows, sequence i at
  packed row `where[i]` of its micro-batch's `rows`, from token `offset[i]` (see `pack_batch`)."""
  pmask = np.asarray(batch.prompt_mask).astype(bool)
  cmask = np.asarray(batch.completion_mask).astype(bool)
  cids = np.asarray(batch.completion_ids)
  ids = np.concatenate([np.asarray(batch.prompt_ids), cids], 1)
  mask = np.concatenate([pmask, cmask], 1)
  n, p = pmask.shape
  c = cmask.shape[1]
  g = group_size
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

  # the LM head's input: per micro-batch, each (group, column block) pair's rows holding a real
  # token there (a piece of 1 .. G rows), stacked best-fit into slots of G rows x k columns; slot
  # s is column slot s // S of stripe s % S (S = mb / G stripes); head_segments tells the pieces
  # of a slot apart for the group reference
  k = min(block, c)
  n_col = -(-c // k)
  row_live = np.pad(cmask, [(0, 0), (0, n_col * k - c)]).reshape(n, n_col, k).any(2)  # [N, column blocks]
  stripes = mb // g
  plans = [_stack_pieces(row_live[m * mb : (m + 1) * mb], g) for m in range(n // mb)]
  per_stripe = max([-(-len(slots) // stripes) for _, slots in plans] + [1])
  width_head = packed_rows_bucket(per_stripe) * k
  head_index, head_ids, head_mask, head_segments = (np.zeros((n, width_head), np.int32) for _ in range(4))
  unhead = np.full((n, c), mb * width_head, np.int32)
  for m, (pieces, slots) in enumerate(plans):
    for number, (rows, col, slot, start) in enumerate(pieces, 1):
      stripe, at = slot % stripes, slot // stripes * k
      src = m * mb + rows  # the piece's batch rows
      cols = slice(col * k, min(col * k + k, c))
      span = cols.stop - cols.start
      dst = m * mb + stripe * g + start + np.arange(len(rows))  # its rows in the stripe
      head_index[dst, at : at + span] = index[src, cols]
      head_ids[dst, at : at + span] = cids[src, cols]
      head_mask[dst, at : at + span] = cmask[src, cols]
      head_segments[dst, at : at + span] = number
      unhead[src, cols] = (dst - m * mb)[:, None] * width_head + at + np.arange(span)[None]
  layout = PackedLayout(
      ids=packed_ids,
      segments=segments,
      positions=positions,
      head_index=head_index,
      head_ids=head_ids,
      head_mask=head_mask,
      head_segments=head_segments,
      unhead_index=unhead,
      source_row=source_row,
      micro_batch_rows=mb,
  )
  return batch.replace(packed=layout)


def _stack_pieces(row_live: np.ndarray, g: int):
  """One micro-batch's pieces, best fit into slots of `g` rows: row_live [mb, column blocks] (a
  row has a real token in the block). A piece is a (group, block) pair's live rows; pieces with
  the most rows first, each into the open slot with the fewest free rows that takes it (else a
  new slot). -> ([(rows in the micro-batch [h], block, slot, first row in the slot)], free rows
  a slot)."""
  pieces = []
  for grp in range(len(row_live) // g):
    live = row_live[grp * g : grp * g + g]
    for col in np.flatnonzero(live.any(0)):
      pieces.append((grp * g + np.flatnonzero(live[:, col]), int(col)))
  pieces.sort(key=lambda piece: -len(piece[0]))  # stable: ties keep (group, block) order
  free: list[int] = []  # free rows a slot
  open_with: list[list[int]] = [[] for _ in range(g)]  # free rows (1 .. G - 1) -> those slots, oldest first
  out = []
  for rows, col in pieces:
    h = len(rows)
    f = next((f for f in range(h, g) if open_with[f]), None)
    if f is None:  # a new slot
      free.append(g)
      slot, f = len(free) - 1, g
    else:
      slot = open_with[f].pop(0)
    out.append((rows, col, slot, g - f))
    free[slot] = f - h
    if f - h:
      open_with[f - h].append(slot)
  return out, free
