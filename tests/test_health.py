"""Dead ends of a run said in the log and the progress bar (ict_jax/health.py, logs.MetricsLogger)."""

import io
import math

import pytest

from ict_jax import health
from ict_jax.logs import MetricsLogger, read_log


def _record(step, truncated_rate=0.1, trained_tokens=40.0, **extra):
  return dict(step=step, truncated_rate=truncated_rate, trained_tokens=trained_tokens, reward_truncated=0.4, **extra)


def test_a_healthy_run_says_nothing():
  h = health.RunHealth(max_new_tokens=20, mask_truncated=True, truncated_streak=3)
  shares = [0.1, 0.89, 0.5, 0.0]  # below health.NEARLY_ALL (0.9) every step
  assert [h.check(_record(s, truncated_rate=shares[s % 4])) for s in range(1, 30)] == [[]] * 29


def test_steps_that_train_no_token_warn_at_the_first_and_every_repeat():
  h = health.RunHealth(max_new_tokens=20, mask_truncated=True, truncated_streak=100, repeat_every=4)
  said = {}
  for s in range(1, 13):
    dead = 3 <= s <= 11  # steps 3..11 train nothing, all truncated
    r = _record(s, truncated_rate=1.0 if dead else 0.5, trained_tokens=0.0 if dead else 10.0)
    said[s] = h.check(r)
  warned = [s for s, w in said.items() if w]
  assert warned == [3, 7, 11]  # the streak's first step, then every 4th
  assert "step 3 trained no token:" in said[3][0] and "mask_truncated_completions" in said[3][0]
  assert "(5 steps in a row)" in said[7][0]


def test_a_truncated_streak_is_said_once_per_streak_length():
  h = health.RunHealth(max_new_tokens=20, mask_truncated=False, truncated_streak=5)
  shares = {7: 0.89, 9: 0.9, 10: 0.95}  # 1.0 at the other steps
  said = {s: h.check(_record(s, truncated_rate=shares.get(s, 1.0))) for s in range(1, 19)}
  warned = [s for s, w in said.items() if w]
  assert warned == [5, 12, 17]  # 1-5; the streak breaks at 7 (below 90%); 8-12, then 8-17
  assert said[5][0].startswith("steps 1-5: every completion ran to rollout.max_new_tokens=20")
  assert "(all of them in 5 of the 5;" in said[5][0]
  # steps of 90% and 95% truncated continue a streak, and the warning says how many were all
  assert said[12][0].startswith("steps 8-12: 90% or more of the completions ran to rollout.max_new_tokens=20")
  assert "(all of them in 3 of the 5;" in said[12][0] and "0.400" in said[12][0]
  assert said[17][0].startswith("steps 8-17: 90% or more") and "(all of them in 8 of the 10;" in said[17][0]
  # trained without the mask, the run can still move: an all-truncated group is what teaches nothing
  assert "cannot recover" not in said[5][0] and "teaches nothing (advantage 0)" in said[5][0]


def test_a_truncated_streak_under_the_mask_says_the_run_cannot_recover_once_all_are():
  h = health.RunHealth(max_new_tokens=20, mask_truncated=True, truncated_streak=3, repeat_every=100)
  said = [h.check(_record(s, truncated_rate=0.95)) for s in (1, 2, 3)]
  assert said[:2] == [[], []]
  assert said[2] == [
      "steps 1-3: 90% or more of the completions ran to rollout.max_new_tokens=20 without a stop token in "
      "each step (all of them in 0 of the 3; verifier reward of the truncated completions 0.400); "
      "loss.mask_truncated_completions gives them no loss, so once every one is the run cannot recover"
  ]


def test_bad_streak_lengths_are_refused():
  with pytest.raises(ValueError, match="truncated_streak"):
    health.RunHealth(max_new_tokens=20, mask_truncated=True, truncated_streak=0)


def test_the_bar_says_no_tokens_trained_and_shows_no_entropy(tmp_path, monkeypatch):
  import sys

  err = io.StringIO()
  monkeypatch.setattr(sys, "stderr", err)
  logger = MetricsLogger(str(tmp_path), total=2, tensorboard=False)
  logger.write(_record(1, entropy=0.31, reward_mean=0.5))
  assert "entropy=0.310" in logger._bar.postfix and health.NO_TOKENS not in logger._bar.postfix
  logger.write(_record(2, truncated_rate=1.0, trained_tokens=0.0, entropy=math.nan, reward_mean=0.4))
  assert health.NO_TOKENS in logger._bar.postfix and "entropy=nan" in logger._bar.postfix
  logger.close()
  rows = read_log(str(tmp_path))
  assert rows[0]["entropy"] == 0.31 and math.isnan(rows[1]["entropy"])  # not a 0
