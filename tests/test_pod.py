"""A pod on one box: the v5p-32 host layout (4 processes x 2 devices, `jax.distributed` on
localhost) runs the whole program, `python -m ict_jax.train` (rollouts, rewards, the step,
periodic eval, checkpoints, the token view), the way launch/tpu_pod.sh starts it on each host,
on a gs:// workdir served by a real Cloud Storage server (tests/gcs_emulator.py; its `gcs` and
`gcs_environ` fixtures are registered in tests/conftest.py).

Three runs of one small config are shared by the tests: an uninterrupted one; one where a
SIGTERM to one process makes every process save the same step and exit 0, then resumed to the
end with the metrics of the uninterrupted run; and one where one process is killed with SIGKILL
mid-step, after which every other process exits non-zero within KILL_BOUND_S instead of waiting
in a collective for a peer that is gone. The phases' seconds are written to
<basetemp>/pod*/timings.json (benchmarks/RESULTS.md, "A pod on one box").
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from etils import epath
import host_cache

from benchmarks.faults.markers import HOOKS_FLAG
from ict_jax import token_view
from ict_jax.logs import read_log

REPO = Path(__file__).resolve().parent.parent
PROCESSES, DEVICES = 4, 2  # a v5p-32 slice: 4 hosts x 4 chips (2 here, on 2 cores)
STEPS, EVERY, EVAL_EVERY = 6, 2, 3
# SIGKILL of one process: a process in a collective with it fails at once and exits 1 without
# JAX's shutdown barrier (ict_jax.train.main); any other is ended by the coordination service once
# the dead one missed its heartbeat for train.heartbeat_timeout_s. The bound is that timeout plus
# 30 s for the detection and the exit on a loaded 2-core machine.
HEARTBEAT_S = 30
KILL_BOUND_S = HEARTBEAT_S + 30
FLAGS = [
    "--config",
    str(REPO / "configs" / "tiny_arith.py"),
    "--config.model.vocab=task",  # ~15 embedding rows: the LM head of the full vocabulary dominates a CPU step
    # a short warm-start: the policy then answers a few prompts right (reward ~0.05), so steps have
    # non-zero advantages and move the parameters
    "--config.warm_start.sft_steps=10",
    "--config.warm_start.sft_learning_rate=1e-2",
    f"--config.train.steps={STEPS}",
    f"--config.train.checkpoint_every={EVERY}",
    f"--config.train.eval_every={EVAL_EVERY}",
    "--config.train.eval_prompts=8",
    "--config.train.eval_samples=2",
    "--config.rollout.prompts_per_step=16",
    "--config.rollout.group_size=4",
    "--config.train.async_checkpointing=False",
    f"--config.train.heartbeat_timeout_s={HEARTBEAT_S}",
]
METRIC_KEYS = ("reward_mean", "loss", "entropy", "grad_norm", "eval_pass_at_1")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class Pod:
  """The 4 processes of one run of `python -m ict_jax.train`, with their output in files."""

  def __init__(
      self, root: dict, name: str, *, shim: bool = False, sleep: str = "", workdir: str = "", extra: tuple = ()
  ):
    self.workdir = workdir or root["gcs"].url(f"pod/{name}")
    logs, data_dir = root["logs"] / name, root["data"]
    self.logs, self.t0 = logs, time.monotonic()
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    self.markers = [logs / f"markers{i}.jsonl" for i in range(PROCESSES)]
    self.procs = []
    for i in range(PROCESSES):
      env = {k: v for k, v in root["gcs"].env().items() if not k.startswith("JAX_COORDINATOR")}
      # the suite's XLA:CPU collective timeout (tests/conftest.py), with this host's 2 devices
      xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
      env.update(
          JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
          JAX_NUM_PROCESSES=str(PROCESSES),
          JAX_PROCESS_ID=str(i),
          JAX_PLATFORMS="cpu",
          XLA_FLAGS=" ".join(xla + [f"--xla_force_host_platform_device_count={DEVICES}"]),
          # every process writes its compiled programs to the cache (tests/host_cache.py)
          PYTHONPATH=os.pathsep.join([str(root["shim"]), str(REPO)]),
      )
      if shim:  # benchmarks/faults/markers.py's phase markers (and sleeps): a hook, --hooks below
        env.update(ICT_FAULTS_MARKERS=str(self.markers[i]), ICT_FAULTS_SLEEP=sleep)
      cmd = [
          sys.executable,
          "-m",
          "ict_jax.train",
          "--workdir",
          self.workdir,
          *FLAGS,
          f"--config.data.data_dir={data_dir}",
          *extra,
          *([HOOKS_FLAG] if shim else []),
      ]
      with open(logs / f"out{i}.txt", "w") as out:
        self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))

  def output(self, i: int) -> str:
    return (self.logs / f"out{i}.txt").read_text()

  def wait(self, timeout: float = 900) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for i, p in enumerate(self.procs):
      try:
        codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
      except subprocess.TimeoutExpired:
        self.kill()
        raise AssertionError(f"process {i} still running after {timeout} s:\n{self.output(i)[-3000:]}")
    self.seconds = time.monotonic() - self.t0
    return codes

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def wait_marker(self, i: int, event: str, count: int = 1, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      path = self.markers[i]
      lines = path.read_text().splitlines() if path.exists() else []
      if sum(json.loads(line)["event"] == event for line in lines if line.strip()) >= count:
        return
      if any(p.poll() is not None for p in self.procs):
        self.kill()
        raise AssertionError(f"a process ended before {event} on {i}:\n{self.output(i)[-3000:]}")
      time.sleep(0.05)
    self.kill()
    raise AssertionError(f"{event} x{count} not seen on process {i} in {timeout} s")

  def finish_ok(self) -> None:
    codes = self.wait()
    for i, rc in enumerate(codes):
      assert rc == 0, f"process {i} exited {rc}:\n{self.output(i)[-3000:]}"


def _names(gcs, workdir: str, folder: str) -> list[str]:
  """Object names under <workdir>/<folder>/, relative to it, from the server's own listing (not
  through gcsfs, whose listing cache in this process would not see a later run's objects)."""
  prefix = f"{workdir[len(gcs.url()) + 1 :]}/{folder}/"
  return [n[len(prefix) :] for n in gcs.list(prefix)]


def _steps(gcs, workdir: str) -> list[int]:
  """Committed checkpoint steps (Orbax's commit marker on object stores)."""
  names = [n.split("/") for n in _names(gcs, workdir, "checkpoints")]
  return sorted(int(n[0]) for n in names if n[0].isdigit() and n[1:] == ["commit_success.txt"])


def _log(gcs, workdir: str, name: str) -> list[dict]:
  """The objects of a log folder (metrics/, tokens/), read straight from the server, in step order."""
  prefix = workdir[len(gcs.url()) + 1 :]
  parts = sorted(n for n in _names(gcs, workdir, name) if n.endswith(".jsonl"))
  return [json.loads(line) for p in parts for line in gcs.read(f"{prefix}/{name}/{p}").decode().splitlines() if line]


@pytest.fixture(scope="module")
def pod_root(tmp_path_factory, gcs, gcs_environ):
  root = tmp_path_factory.mktemp("pod")
  shim = host_cache.STARTUP  # every process writes its compiled programs to the cache
  timings: dict[str, float] = {}
  # tfds data stay on local disk (a gs:// data_dir is refused)
  yield {"gcs": gcs, "logs": root, "data": root / "data", "shim": shim, "timings": timings}
  (root / "timings.json").write_text(json.dumps({k: round(v, 1) for k, v in timings.items()}, indent=1))


@pytest.fixture(scope="module")
def reference(pod_root):
  """The uninterrupted run."""
  pod = Pod(pod_root, "ref")
  pod.finish_ok()
  pod_root["timings"]["uninterrupted run (6 steps)"] = pod.seconds
  return pod.workdir


def test_the_uninterrupted_pod_run(gcs, reference):
  rows = _log(gcs, reference, "metrics")
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert read_log(reference, "metrics") == rows  # ict_jax.logs reads the same from the bucket
  # the policy earns rewards, so the steps update the parameters: equal metrics in the resume
  # test mean equal parameters, not equal zeros
  assert sum(r["reward_mean"] > 0 and r["grad_norm"] > 0 for r in rows) >= 2, rows
  evals = [r["step"] for r in rows if "eval_pass_at_1" in r]
  assert evals == [s for s in range(1, STEPS + 1) if s % EVAL_EVERY == 0], evals
  assert _steps(gcs, reference) == list(range(EVERY, STEPS + 1, EVERY))
  tokens = _log(gcs, reference, "tokens")  # the token view, at every checkpoint step
  assert sorted({t["step"] for t in tokens}) == list(range(EVERY, STEPS + 1, EVERY))
  assert all(len(t["tokens"]) == len(t["prob"]) == len(t["selected"]) > 0 for t in tokens)
  assert token_view.load(reference, STEPS)[1] == [t for t in tokens if t["step"] == STEPS]
  assert json.loads((epath.Path(reference) / "config.json").read_text())["train"]["steps"] == STEPS


def test_sigterm_to_one_process_all_save_the_same_step_and_the_resume_equals_the_uninterrupted_run(pod_root, reference):
  # a slowed train step (1.5 s) keeps the run inside the loop when the signal lands
  pod = Pod(pod_root, "term", shim=True, sleep="step=1.5")
  workdir = pod.workdir
  pod.wait_marker(2, "step_end")  # the loop runs: JAX's SIGTERM handler is in place
  pod.procs[2].send_signal(signal.SIGTERM)  # one host: the preemption service tells the others
  t = time.monotonic()
  pod.finish_ok()
  pod_root["timings"]["SIGTERM to every process exited 0"] = time.monotonic() - t
  pod_root["timings"]["run stopped by SIGTERM, start to exit"] = pod.seconds
  saved = set()
  for i in range(PROCESSES):
    m = re.findall(r"preempted: saved step (\d+); exiting", pod.output(i))
    assert len(m) == 1, pod.output(i)[-3000:]
    saved.add(int(m[0]))
  assert len(saved) == 1, saved  # the same step on every process
  (k,) = saved
  assert 1 <= k < STEPS, k
  assert _steps(pod_root["gcs"], workdir)[-1] == k
  assert [r["step"] for r in _log(pod_root["gcs"], workdir, "metrics")] == list(range(1, k + 1))

  resumed = Pod(pod_root, "resume", workdir=workdir)
  resumed.finish_ok()
  pod_root["timings"]["resumed run to the end"] = resumed.seconds
  for i in range(PROCESSES):
    assert f"resumed from step {k} of {workdir}" in resumed.output(i), resumed.output(i)[-3000:]
  a, b = _log(pod_root["gcs"], reference, "metrics"), _log(pod_root["gcs"], workdir, "metrics")
  assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, STEPS + 1))
  assert any(r["grad_norm"] > 0 for r in a[k:])  # the resumed steps move the parameters
  for ra, rb in zip(a, b):
    assert ("eval_pass_at_1" in ra) == ("eval_pass_at_1" in rb), ra["step"]
    for key in METRIC_KEYS:
      if key in ra:
        np.testing.assert_allclose(rb[key], ra[key], rtol=1e-5, atol=1e-7, err_msg=f"step {ra['step']} {key}")


def test_kill9_of_one_process_ends_the_others_within_the_bound(pod_root, reference):
  # nothing is compared with this run: no warm-start (~20 s of 4 processes on 2 cores)
  pod = Pod(pod_root, "kill", shim=True, sleep="step=1.5", extra=("--config.warm_start.sft_steps=0",))
  pod.wait_marker(1, "step_start", count=2)  # inside the second train step, in its collectives
  pod.procs[1].kill()
  t = time.monotonic()
  codes = {}
  for i, p in enumerate(pod.procs):
    try:
      codes[i] = p.wait(timeout=max(1.0, KILL_BOUND_S - (time.monotonic() - t)))
    except subprocess.TimeoutExpired:
      pod.kill()
      raise AssertionError(
          f"process {i} still running {KILL_BOUND_S} s after process 1 was killed:\n{pod.output(i)[-3000:]}"
      )
  pod_root["timings"]["kill -9 to every other process exited"] = time.monotonic() - t
  assert codes[1] == -signal.SIGKILL
  for i in (0, 2, 3):
    assert codes[i] != 0, f"process {i} exited 0 after a peer was killed:\n{pod.output(i)[-3000:]}"
