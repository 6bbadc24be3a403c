"""Stop and post-answer positions (answer_positions.py) against hand-built completions, and the step
metrics of where a selection falls against numpy counts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ict_jax import answer_positions
from ict_jax.rewards.extract import answer_end
from ict_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


def test_answer_end_is_just_past_the_final_box():
  assert answer_end("2+3=5;\\boxed{5} ok") == len("2+3=5;\\boxed{5}")
  assert answer_end("\\boxed{1} then \\boxed{{2}}!") == len("\\boxed{1} then \\boxed{{2}}")
  assert answer_end("so \\boxed 7 and") == len("so \\boxed 7")
  assert answer_end("\\boxed{8") is None and answer_end("no box") is None


def test_positions_of_hand_built_completions(tok):
  """Each completion is built from pieces encoded one by one, so the token where the post-answer
  text starts is known without decoding."""
  eos = tok.im_end_id
  cases = [  # (pieces before the answer's end, pieces after it, stops, expected answer_end is set)
      (["3+5=8;", "\\boxed{8}"], [" ok", " done"], True),
      (["2 + 3 = 5;", "\\boxed{5}"], [], True),
      (["no box at all"], [], False),
      (["\\boxed{8}"], ["}}}", "}}"], False),  # truncated junk after the box: no stop token
  ]
  rows, want_stop, want_end = [], [], []
  for before, after, stops in cases:
    head = [t for piece in before for t in tok.encode(piece)]
    tail = [t for piece in after for t in tok.encode(piece)]
    rows.append(head + tail + ([eos] if stops else []))
    want_stop.append(len(head) + len(tail) if stops else -1)
    boxed = any("\\boxed" in p for p in before)
    want_end.append(len(head) if boxed else -1)
  c = max(map(len, rows)) + 3
  ids = np.full((len(rows), c), tok.pad_id, np.int32)
  mask = np.zeros((len(rows), c), np.int32)
  for i, r in enumerate(rows):
    ids[i, : len(r)], mask[i, : len(r)] = r, 1
  stop, end = answer_positions.positions(tok, ids, mask, tok.eos_ids)
  assert stop.tolist() == want_stop and end.tolist() == want_end
  s, post = answer_positions.token_masks(stop, end, mask)
  assert s.sum(axis=1).tolist() == [1, 1, 0, 0]
  # post-answer: the tokens of " ok done" in row 0 (the stop token excluded), none in row 1
  assert post.sum(axis=1).tolist() == [len(rows[0]) - 1 - want_end[0], 0, 0, len(rows[3]) - want_end[3]]


def test_where_metrics_equal_numpy_counts():
  rng = np.random.default_rng(0)
  n, c = 12, 9
  lengths = rng.integers(1, c + 1, size=n)
  lengths[5] = 0  # an empty row
  mask = (np.arange(c)[None] < lengths[:, None]).astype(np.float32)
  stop = np.where(rng.random(n) < 0.8, lengths - 1, -1).astype(np.int32)  # -1: truncated
  stop[lengths == 0] = -1
  end = np.where(rng.random(n) < 0.7, rng.integers(0, c // 2, size=n), -1).astype(np.int32)
  # every third row's stop token selected, the others' by chance
  sel = (rng.random((n, c)) < 0.4) | ((np.arange(c)[None] == stop[:, None]) & (np.arange(n)[:, None] % 3 == 0))
  ent = rng.random((n, c)).astype(np.float32)
  adv = rng.normal(size=n).astype(np.float32)
  got = jax.jit(answer_positions.where_metrics)(sel, mask, ent, stop, end, adv)
  got = {k: float(s) / float(cnt) for k, (s, cnt) in got.items()}
  n_sel = n_sel_stop = n_sel_post = n_stop = n_post = n_real = 0
  ent_stop = adv_stop = adv_sel_stop = 0.0
  for i in range(n):
    for t in range(lengths[i]):
      is_stop = t == stop[i]
      is_post = end[i] >= 0 and t >= end[i] and not is_stop
      n_real += 1
      n_stop += is_stop
      n_post += is_post
      ent_stop += ent[i, t] * is_stop
      adv_stop += adv[i] * is_stop
      if sel[i, t]:
        n_sel += 1
        n_sel_stop += is_stop
        adv_sel_stop += adv[i] * is_stop
        n_sel_post += is_post
  assert n_stop > 2 and n_post > 2 and 0 < n_sel_stop < n_stop
  want = {
      "selected_stop_share": n_sel_stop / n_sel,
      "selected_post_answer_share": n_sel_post / n_sel,
      "stop_selected_rate": n_sel_stop / n_stop,
      "post_answer_frac": n_post / n_real,
      "stop_entropy": ent_stop / n_stop,
      "stop_advantage": adv_stop / n_stop,
      "stop_advantage_selected": adv_sel_stop / n_sel_stop,
  }
  assert got == pytest.approx(want, rel=1e-6)
