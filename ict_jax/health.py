"""Dead ends of a run, said in the log while it runs.

A step can train no token at all: every completion masked out of the loss (e.g. all truncated
under `loss.mask_truncated_completions`) or none selected. Its update is then Adam's momentum
alone, and a run whose completions all run past `rollout.max_new_tokens` under that mask can never
recover (nothing pushes the stop token back up). `RunHealth.check` reads a step's metrics record
and returns the warnings to log; the progress bar reads `no_tokens_trained` for its note.
"""

from __future__ import annotations

from typing import Any

NO_TOKENS = "no tokens trained"


def no_tokens_trained(record: dict[str, Any]) -> bool:
  """The step's loss covered no completion token (`trained_tokens` of the train step is 0)."""
  return record.get("trained_tokens", 1) == 0


NEARLY_ALL = 0.9  # a step whose truncated share is at least this counts toward a truncated streak


class RunHealth:
  """Warnings for a step that trains no token and for `truncated_streak` consecutive steps in each
  of which at least `NEARLY_ALL` (90%) of the completions were truncated (said once per such streak,
  then again each `truncated_streak` steps it lasts): a group whose completions all run on scores
  alike, so its advantages are 0 and it teaches nothing (seed 0 of the default run on an Intel Xeon
  box: 0.9-1.0 truncated over steps 200-313, reward ~0, before it climbed back). A streak of
  no-token steps is said at its first step and each `repeat_every` steps after, so a dead run does
  not write one line a step."""

  def __init__(self, *, max_new_tokens: int, mask_truncated: bool, truncated_streak: int = 20, repeat_every: int = 50):
    if truncated_streak < 1 or repeat_every < 1:
      raise ValueError(
          f"RunHealth: truncated_streak and repeat_every must be >= 1, got {truncated_streak}, {repeat_every}"
      )
    self.max_new_tokens, self.mask_truncated = max_new_tokens, mask_truncated
    self.truncated_streak, self.repeat_every = truncated_streak, repeat_every
    self._truncated = 0  # consecutive steps with truncated_rate >= NEARLY_ALL
    self._all_truncated = 0  # how many of those truncated every completion
    self._untrained = 0  # consecutive steps that trained no token

  def check(self, record: dict[str, Any]) -> list[str]:
    step, out = record["step"], []
    share = record.get("truncated_rate", 0.0)
    self._truncated = self._truncated + 1 if share >= NEARLY_ALL else 0
    self._all_truncated = (self._all_truncated + (share >= 1.0)) if self._truncated else 0
    self._untrained = self._untrained + 1 if no_tokens_trained(record) else 0
    if self._untrained and (self._untrained - 1) % self.repeat_every == 0:
      why = (
          "every completion was truncated and loss.mask_truncated_completions masks them out of the loss"
          if self.mask_truncated and record.get("truncated_rate", 0.0) >= 1.0
          else "no completion token was selected or left unmasked"
      )
      run = f" ({self._untrained} steps in a row)" if self._untrained > 1 else ""
      out.append(f"step {step} trained no token{run}: {why}; the update was Adam's momentum alone")
    if self._truncated and self._truncated % self.truncated_streak == 0:
      n = self._truncated
      every = "every completion" if self._all_truncated == n else f"{NEARLY_ALL:.0%} or more of the completions"
      out.append(
          f"steps {step - n + 1}-{step}: {every} ran to rollout.max_new_tokens={self.max_new_tokens} without "
          f"a stop token in each step (all of them in {self._all_truncated} of the {n}; verifier reward of "
          f"the truncated completions {record.get('reward_truncated', float('nan')):.3f})"
          + (
              "; loss.mask_truncated_completions gives them no loss, so once every one is the run cannot recover"
              if self.mask_truncated
              else "; a group whose completions all run on scores alike and teaches nothing (advantage 0)"
          )
      )
    return out
