"""What the launchers hand the trainer, checked against the trainer itself: the pinned platform
ends a run on a machine without it, the persistent compilation cache makes a restart load its
programs instead of compiling them, the workdir probe names its host, and launch/README.md's
memory arithmetic is the models' parameter counts at 16 B each (tests/test_launch.py and
tests/test_launch_slurm.py check the scripts themselves)."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "launch" / "gpu_slurm.sbatch"
TPU = REPO / "launch" / "tpu_pod.sh"
# the smallest run of the default config: no warm-start, 2 prompts x 2 samples of <= 16 tokens
TINY = [
    "--config.warm_start.sft_steps=0",
    "--config.rollout.prompts_per_step=2",
    "--config.rollout.group_size=2",
    "--config.rollout.max_new_tokens=16",
    "--config.train.eval_every=0",
]


def _clean_env(**extra) -> dict:
  """The test process's environment without the suite's JAX / XLA settings (a user's shell)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SLURM_"))}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
  return dict(env, **extra)


def _slurm_env(home: Path) -> dict:
  """The variables gpu_slurm.sbatch exports, from its dry run on one node."""
  env = _clean_env(DRY_RUN="1", SLURM_JOB_NODELIST="gpu01", SLURM_NNODES="1", HOME=str(home))
  res = subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert res.returncode == 0, res.stderr
  out = {}
  for line in res.stdout.splitlines():
    if re.match(r"^[A-Z_]+=", line):
      key, value = line.split("=", 1)
      (out[key],) = shlex.split(value)
  return out


def _tpu_env(workdir: str = "gs://b/r") -> dict:
  """JAX_PLATFORMS and JAX_COMPILATION_CACHE_DIR of tpu_pod.sh's train command (dry run)."""
  res = subprocess.run(
      ["bash", str(TPU), "--dry-run", "--name", "t", "--zone", "z", "--accelerator-type", "v5p-32",
       "--config", "configs/tiny.py", "--workdir", workdir],
      cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert res.returncode == 0, res.stderr
  (run,) = [c for c in res.stdout.splitlines() if "ict_jax.train" in c]
  (command,) = [a.split("=", 1)[1] for a in shlex.split(run[2:]) if a.startswith("--command=")]
  words = shlex.split(command.replace(";", " "))
  return dict(w.split("=", 1) for w in words if w.startswith(("JAX_PLATFORMS=", "JAX_COMPILATION_CACHE_DIR=")))


def _train(workdir: Path, *flags: str, env: dict) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "ict_jax.train", "--workdir", str(workdir), *TINY, *flags]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("launcher", ["tpu_pod.sh", "gpu_slurm.sbatch"])
def test_pinned_platform_is_an_error_where_it_is_missing(launcher, tmp_path):
  """This machine has no TPU and no usable GPU: with the launcher's JAX_PLATFORMS the trainer
  exits non-zero before writing a step, instead of training on the CPU."""
  platform = (_tpu_env() if launcher == "tpu_pod.sh" else _slurm_env(tmp_path))["JAX_PLATFORMS"]
  assert platform == {"tpu_pod.sh": "tpu", "gpu_slurm.sbatch": "cuda"}[launcher]
  workdir = tmp_path / "run"
  proc = _train(workdir, "--config.train.steps=1", env=_clean_env(JAX_PLATFORMS=platform, CUDA_VISIBLE_DEVICES=""))
  assert proc.returncode != 0
  assert platform in proc.stderr.lower(), proc.stderr[-2000:]
  assert not (workdir / "checkpoints").exists() and not list(workdir.glob("metrics*"))


def test_restart_loads_the_step_and_sampler_from_the_compilation_cache(tmp_path):
  """The cache folder gpu_slurm.sbatch sets (under $HOME): a first run writes the compiled
  programs there, and its restart (the same command with one more step, as after a preemption)
  loads the train step and the sampler from it: the trainer does not turn the cache off."""
  from ict_jax.logs import read_log

  cache = _slurm_env(tmp_path / "home")["JAX_COMPILATION_CACHE_DIR"]
  assert cache == str(tmp_path / "home" / ".cache" / "ict_jax" / "jax_cache")
  env = _clean_env(
      JAX_PLATFORMS="cpu",
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # tiny programs compile in well under 1 s
      JAX_LOG_COMPILES="1",  # logs each persistent-cache hit
  )
  workdir = tmp_path / "run"
  first = _train(workdir, "--config.train.steps=1", env=env)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "cache hit for 'jit_step_fn'" not in first.stderr
  written = {name.rsplit("-", 2)[0] for name in os.listdir(cache)}
  assert {"jit_step_fn", "jit__generate_impl"} <= written
  again = _train(workdir, "--config.train.steps=2", env=env)
  assert again.returncode == 0, again.stderr[-3000:]
  for program in ("jit_step_fn", "jit__generate_impl"):
    assert f"Persistent compilation cache hit for '{program}'" in again.stderr, program
  assert [r["step"] for r in read_log(str(workdir), "metrics")] == [1, 2]  # resumed, not restarted


def test_tpu_default_cache_in_a_bucket_is_written_once_and_read_back():
  """tpu_pod.sh's default cache for a gs:// workdir, WORKDIR/jax_cache, on a real GCS server
  (fake-gcs-server): JAX writes the compiled program there through etils/gcsfs and a second
  process (a restarted worker) loads it."""
  emulator = pytest.importorskip("gcs_emulator", reason="tests/gcs_emulator.py starts the GCS server")
  prog = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: jnp.tanh(x @ x) + 1)(jnp.ones((64, 64))).sum()))"
  with emulator.gcs_emulator() as server:
    cache = _tpu_env(server.url("runs/r1"))["JAX_COMPILATION_CACHE_DIR"]
    assert cache == server.url("runs/r1/jax_cache")
    env = server.env(_clean_env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache, JAX_LOG_COMPILES="1"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    runs = [
        subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
  assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
  assert runs[0].stdout == runs[1].stdout == "8192.0\n"  # 64 x 64 entries of tanh(64) + 1
  assert "Persistent compilation cache hit for 'jit__lambda'" not in runs[0].stderr
  assert "Persistent compilation cache hit for 'jit__lambda'" in runs[1].stderr


def test_workdir_probe_names_the_host(tmp_path, monkeypatch):
  """Two nodes of a SLURM job can run the same pid in one shared workdir: a probe that another
  host has in flight is left alone."""
  from ict_jax import build

  monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
  theirs = Path(build.workdir_probe(str(tmp_path)))
  theirs.write_text("node-b's")
  monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
  ours = Path(build.workdir_probe(str(tmp_path)))
  assert "node-a" in ours.name and str(os.getpid()) in ours.name
  build.check_workdir(str(tmp_path))
  assert theirs.read_text() == "node-b's" and not ours.exists()


# ---- launch/README.md's memory arithmetic ------------------------------------------------------
SIZES = {"0.5B": "qwen2_5_0_5b", "1.5B": "qwen2_5_1_5b", "7B": "qwen2_5_7b"}


def _table_rows(text: str, header_start: str) -> list[list[str]]:
  lines = text[text.index(header_start) :].splitlines()
  rows = []
  for line in lines[2:]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip("|").split("|")])
  return rows


def test_launch_readme_memory_arithmetic_is_16_bytes_a_parameter():
  from ict_jax.models.config import Qwen2Config

  text = (REPO / "launch" / "README.md").read_text()
  gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
  rows = _table_rows(text, "| | params | × 16 B |")
  assert [r[0] for r in rows] == list(SIZES)
  for size, params_text, total, per8, per16, reference in rows:
    n = Qwen2Config.preset(SIZES[size]).num_params()
    assert params_text == f"{n:,}"
    assert (total, per8, per16, reference) == (gib(16 * n), gib(16 * n / 8), gib(16 * n / 16), gib(4 * n)), size
  # the mesh table's GiB of state a chip, and 7B on v5e-8 refused, as README.md says
  mesh = {r[0]: r[1:] for r in _table_rows(text, "| model | v5e-8 (`v5litepod-8`")}
  for size, cells in mesh.items():
    n = Qwen2Config.preset(SIZES[size]).num_params()
    for cell, chips in zip(cells, (8, 16, 8)):
      if size == "7B" and chips == 8 and cell.startswith("no"):
        assert f"{16 * n / 8 / 2**30:.2f} of 15.75 GiB" in cell
        continue
      assert re.search(r"\(([\d.]+)", cell).group(1) == f"{16 * n / chips / 2**30:.2f}", (size, cell)
  assert mesh["7B"][0].startswith("no")
  readme = (REPO / "README.md").read_text()
  assert "16 B/parameter" in readme and "not v5e-8" in readme
  (row_7b,) = [r for r in _table_rows(readme, "| model | v5e-8 (8 x 16 GiB)") if r[0] == "7B"]
  assert (
      row_7b[1].startswith("no")
      and f"{16 * Qwen2Config.preset('qwen2_5_7b').num_params() / 8 / 2**30:.1f}" in row_7b[1]
  )
