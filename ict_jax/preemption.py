"""SIGTERM (TPU preemption, scancel) -> every process saves the same step, then exits 0.

Several processes: the decision is JAX's preemption service (started by
`jax.distributed.initialize`; it catches SIGTERM on any host, tells the others through the
coordination service and picks a step every host has not yet passed). The loop asks
`reached(step)` at the start of every step, with the same step numbers on every host, and all
hosts get True at the same step: nobody runs one more step while another saves, so no host waits
alone in a collective. `multihost_utils.reached_preemption_sync_point` is that call.

One process: a Python SIGTERM handler notes the time; `reached` is True from the next step
boundary on, and `drop_step` additionally lets the loop abandon a step whose train step would not
end within `train.sigterm_grace_s` (a jitted call cannot be interrupted). With several processes
the step in flight always finishes: the hosts only agree at step boundaries.
"""

from __future__ import annotations

import logging
import signal
import time

import jax

log = logging.getLogger("ict_jax.train")


class Preemption:
  """Context manager around the training loop; see the module docstring."""

  stopped = False  # SIGTERM seen or an agreed stop: main() then skips the interpreter teardown

  def __init__(self, grace_s: float = float("inf"), *, agreed: bool | None = None):
    self.grace_s = grace_s
    self.agreed = jax.process_count() > 1 if agreed is None else agreed
    self.requested = False  # one process: SIGTERM seen
    self.deadline = float("inf")
    self._old = None

  def __enter__(self) -> "Preemption":
    if self.agreed:
      from jax._src import distributed

      if distributed.global_state.preemption_sync_manager is None:
        log.warning(
            "JAX's preemption service is off (jax_enable_preemption_service=False): "
            "SIGTERM will not save a checkpoint on this multi-process run"
        )
    elif hasattr(signal, "SIGTERM"):  # JAX's service owns SIGTERM when agreed: do not replace it
      try:
        self._old = signal.signal(signal.SIGTERM, self._handle)
      except ValueError:  # not the main thread
        self._old = None
    return self

  def _handle(self, signum, frame) -> None:
    if not self.requested:
      self.deadline = time.monotonic() + self.grace_s
    self.requested = Preemption.stopped = True
    log.warning("SIGTERM: saving a checkpoint within %g s (train.sigterm_grace_s), then exiting", self.grace_s)

  def reached(self, step: int) -> bool:
    """Whether to save `step` (completed steps) and stop, asked before step `step + 1` starts.
    Call it at every step on every host, with the same `step` numbers."""
    if self.agreed:
      from jax.experimental import multihost_utils

      try:
        hit = multihost_utils.reached_preemption_sync_point(int(step))
      except RuntimeError:  # the service is off (warned in __enter__)
        hit = False
    else:
      hit = self.requested
    if hit:
      Preemption.stopped = True
      log.warning("preempted: every process stops at step %d", step)
    return hit

  def drop_step(self, estimate_s: float | None) -> bool:
    """One process, SIGTERM seen mid-step: True when the rest of the step, estimated at
    `estimate_s` seconds (None: no estimate yet), would not end before the grace deadline."""
    if self.agreed or not self.requested:
      return False
    if estimate_s is not None and time.monotonic() + estimate_s < self.deadline:
      return False
    Preemption.stopped = True
    return True

  def __exit__(self, *exc) -> bool:
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)
    return False
