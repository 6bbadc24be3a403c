"""The token-level view: tokens/<step>.jsonl reading, the selected tokens' statistics against hand
counts, the page's content and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ict_jax import analyze, token_view

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(step, prompt, tokens, js, ent, prob, sel, reward=1.0):
  return {
      "step": step,
      "prompt": prompt,
      "gold": "9",
      "reward": reward,
      "advantage": 0.5,
      "dense_warmup": False,
      "tokens": tokens,
      "js": js,
      "entropy": ent,
      "prob": prob,
      "selected": sel,
  }


ROWS = [
    _row(
        20,
        "1+4+4=",
        ["1", "+", "4", "=", "5"],
        [0.0, 0.1, 0.2, 0.0, 0.6],
        [0.1, 0.2, 1.5, 0.3, 2.0],
        [0.9, 0.8, 0.3, 0.9, 0.2],
        [False, False, False, False, True],
    ),
    _row(
        20,
        "1+4+4=",
        ["4", "+", "4", "=", "8"],
        [0.0, 0.0, 0.4, 0.0, 0.1],
        [0.4, 0.1, 0.05, 0.2, 0.9],
        [0.6, 0.9, 0.95, 0.9, 0.5],
        [False, False, True, False, False],
        0.0,
    ),
]


def _write(workdir, rows):
  for step in sorted({r["step"] for r in rows}):
    token_view.write(workdir, step, [r for r in rows if r["step"] == step])


def test_load_picks_the_step_and_a_rewritten_step(tmp_path):
  w = str(tmp_path)
  _write(w, [dict(r, step=10) for r in ROWS] + ROWS)
  _write(w, [dict(ROWS[0], step=10, reward=0.5)])  # step 10 logged again (a resumed run): replaced
  assert token_view.load(w)[0] == 20
  step, rows = token_view.load(w, 10)
  assert step == 10 and [r["reward"] for r in rows] == [0.5]
  with pytest.raises(KeyError, match="steps with them"):
    token_view.load(w, 7)
  with pytest.raises(FileNotFoundError):
    token_view.load(str(tmp_path / "none"))


def test_selection_stats_by_hand():
  s = analyze.selection_stats(ROWS)
  assert (s["tokens"], s["selected"]) == (10, 2)
  assert s["mean_prob_selected"] == pytest.approx((0.2 + 0.95) / 2)
  assert s["mean_prob_all"] == pytest.approx(np.mean(ROWS[0]["prob"] + ROWS[1]["prob"]))
  median = np.median(ROWS[0]["entropy"] + ROWS[1]["entropy"])  # 0.25
  assert s["entropy_median"] == pytest.approx(median)
  assert s["high_entropy_share"] == 0.5 and s["low_entropy_share"] == 0.5  # 2.0 above, 0.05 below
  # positions 4/5 -> last fifth, 2/5 -> middle fifth
  assert s["position_fifths_selected"] == [0, 0, 1, 0, 1]
  assert s["position_fifths_all"] == [2, 2, 2, 2, 2]
  assert s["mean_relative_position_selected"] == pytest.approx((0.9 + 0.5) / 2)
  assert s["first_token_selected_share"] == 0.0 and s["mean_js_first_token"] == 0.0


def test_token_without_text_keeps_a_visible_box():
  """A token holding only the first bytes of a character (decode_pieces gives it "") gets a grey
  dot and says so in its tooltip; a token with text shows that text, escaped."""
  empty = analyze._token_span("", 0.1, 0.5, 0.2, True, 1.0)
  assert '<span class="frag">·</span>' in empty and "first bytes of a character" in empty
  assert 'class="tok sel"' in empty
  plain = analyze._token_span("<b>", 0.1, 0.5, 0.2, False, 1.0)
  assert ">&lt;b&gt;</span>" in plain and "frag" not in plain


def test_a_completion_masked_out_of_the_loss_says_so(tmp_path):
  """loss.mask_truncated_completions zeroes a truncated completion's mask, so its row has no
  tokens: the page says why instead of showing an empty line."""
  w = str(tmp_path / "run")
  _write(w, ROWS + [_row(20, "1+4+4=", [], [], [], [], [], 0.0)])
  analyze.main(["--workdir", w, "--no-png"])
  page = open(os.path.join(w, "analysis", "step_20.html")).read()
  assert page.count("truncated at rollout.max_new_tokens: no tokens trained") == 1
  assert json.load(open(os.path.join(w, "analysis", "step_20.json")))["tokens"] == 10


def test_page_and_command_line(tmp_path):
  w = str(tmp_path / "run")
  _write(w, ROWS)
  proc = subprocess.run(
      [sys.executable, "-m", "ict_jax.analyze", "--workdir", w, "--no-png"],
      capture_output=True,
      text=True,
      cwd=REPO,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  page = open(os.path.join(w, "analysis", "step_20.html")).read()
  assert page.count('class="tok sel"') == 2 and page.count('class="tok') == 10
  for needle in ('value="js"', 'value="entropy"', 'value="prob"', "mean probability", "high-entropy share"):
    assert needle in page
  stats = json.load(open(os.path.join(w, "analysis", "step_20.json")))
  assert stats["selected"] == 2
  bad = subprocess.run(
      [sys.executable, "-m", "ict_jax.analyze", "--workdir", w, "--step", "3", "--no-png"],
      capture_output=True,
      text=True,
      cwd=REPO,
      timeout=300,
  )
  assert bad.returncode == 2 and "no token statistics for step 3" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_stop_and_post_answer_marks_by_hand():
  """Rows with stop / post-answer flags: the shares among the selected tokens are hand counts, and
  the page marks those tokens; rows logged before the flags existed count as having none."""
  a = dict(ROWS[0], stop=[False, False, False, False, True], post_answer=[False] * 5)
  b = dict(ROWS[1], stop=[False] * 5, post_answer=[False, False, True, True, True])  # truncated junk
  s = analyze.selection_stats([a, b])
  assert s["stop_share_selected"] == 0.5 and s["post_answer_share_selected"] == 0.5  # of 2 selected
  assert s["stop_selected_rate"] == 1.0 and s["stop_share_all"] == 0.1 and s["post_answer_share_all"] == 0.3
  assert analyze.selection_stats(ROWS)["stop_share_selected"] == 0.0
  page = analyze.render_fragment([a, b])
  assert page.count('class="tok sel stop"') == 1 and page.count('class="tok sel post"') == 1
  assert page.count(' post"') == 3 and "| stop token" in page
