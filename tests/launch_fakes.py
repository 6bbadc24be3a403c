"""Fakes for the launcher tests (tests/test_launch.py: launch/tpu_pod.sh; tests/test_launch_slurm.py:
launch/gpu_slurm.sbatch): a PATH that starts with loudly failing `gcloud`, `git`, `ssh`, `scp`, `srun`,
`sbatch` and `curl`, each of which records that it was called, so a dry run that ran anything is caught."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TPU = REPO / "launch" / "tpu_pod.sh"
SLURM = REPO / "launch" / "gpu_slurm.sbatch"

FAILING = ("gcloud", "git", "ssh", "scp", "srun", "sbatch", "curl")


def write_exe(path: Path, text: str) -> None:
  path.write_text(text)
  path.chmod(0o755)


@pytest.fixture
def fakes(tmp_path):
  """A bin dir of loudly failing fakes; `calls` is where they record themselves."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls.log"
  for name in FAILING:
    write_exe(
        bin_dir / name,
        f'#!/bin/sh\necho "FAKE {name} CALLED: $*" >> "{calls}"\n'
        f'echo "fake {name} must not run in a test" >&2\nexit 97\n',
    )
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "XLA_", "WANDB_"))}
  env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
  return dict(bin=bin_dir, calls=calls, env=env, tmp=tmp_path)


def no_calls(fakes) -> None:
  assert not fakes["calls"].exists(), fakes["calls"].read_text()
