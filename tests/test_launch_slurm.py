"""launch/gpu_slurm.sbatch without SLURM: dry runs parsed back with `shlex`, and a real run against
fake `scontrol`/`srun` and a fake python that records each rank's argv and environment. Fake
`gcloud`, `git`, `ssh`, `scp`, `srun`, `sbatch` and `curl` come first on PATH (tests/launch_fakes.py),
so a dry run that ran anything is caught."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from launch_fakes import SLURM, fakes, no_calls, write_exe  # noqa: F401  pylint: disable=unused-import


@pytest.fixture
def slurm(fakes):
  """A fake repo root (REPO_DIR), fake scontrol, and SLURM variables for 4 nodes."""
  repo = fakes["tmp"] / "repo"
  (repo / "ict_jax").mkdir(parents=True)
  (repo / "ict_jax" / "__init__.py").write_text("")
  (repo / "configs").mkdir()
  (repo / "configs" / "c.py").write_text("")
  write_exe(
      fakes["bin"] / "scontrol",
      '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: $*" >&2; exit 1; }\n'
      'case "$3" in\n  "gpu-[07-10]") printf "gpu-07\\ngpu-08\\ngpu-09\\ngpu-10\\n" ;;\n'
      '  *) echo "fake scontrol: unknown nodelist $3" >&2; exit 1 ;;\nesac\n',
  )
  env = dict(
      fakes["env"],
      SLURM_JOB_NODELIST="gpu-[07-10]",
      SLURM_NNODES="4",
      SLURM_PROCID="2",
      SLURM_JOB_ID="4242",
      SLURM_JOB_NAME="ict",
      SLURM_SUBMIT_DIR=str(repo),
      CONFIG="configs/c.py",
      WORKDIR="/shared/runs/r 1",
  )
  return dict(fakes, repo=repo, env=env)


def run_slurm(slurm, *args, **env):
  full = dict(slurm["env"], **env)
  return subprocess.run(
      ["bash", str(SLURM), *args], cwd=slurm["tmp"], env=full, capture_output=True, text=True, timeout=60
  )


def parse_dry_run(stdout: str):
  env, srun, task = {}, None, None
  for line in stdout.splitlines():
    if line.startswith("+ "):
      srun = shlex.split(line[2:])
    elif line.startswith("task "):
      task = line
    elif "=" in line:
      key, value = line.split("=", 1)
      (env[key],) = shlex.split(value)
  return env, srun, task


def test_slurm_dry_run_env_and_srun(slurm):
  res = run_slurm(slurm, "--config.ict.method=ict", "--config.note=a b", DRY_RUN="1")
  assert res.returncode == 0, res.stderr
  no_calls(slurm)
  env, srun, task = parse_dry_run(res.stdout)
  host, port = env["JAX_COORDINATOR_ADDRESS"].split(":")
  assert host == "gpu-07" and 1024 < int(port) < 65536
  assert env["JAX_NUM_PROCESSES"] == "4"
  assert task == "task SLURM_PROCID=2: JAX_PROCESS_ID=2"
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"].split()
  assert env["JAX_PLATFORMS"] == "cuda"  # a CUDA plugin that fails is an error, not a CPU run
  assert env["JAX_COMPILATION_CACHE_DIR"] == os.path.expanduser("~/.cache/ict_jax/jax_cache")
  assert srun[0] == "srun" and "--ntasks-per-node=1" in srun and "--nodes=4" in srun
  i = srun.index("-m")
  assert srun[i - 1 :] == [
      "python",
      "-m",
      "ict_jax.train",
      "--config",
      "configs/c.py",
      "--workdir",
      "/shared/runs/r 1",
      "--config.ict.method=ict",
      "--config.note=a b",
  ]


def test_slurm_overrides(slurm):
  res = run_slurm(
      slurm, DRY_RUN="1", JAX_COORDINATOR_PORT="4321", XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false"
  )
  env, _, _ = parse_dry_run(res.stdout)
  assert env["JAX_COORDINATOR_ADDRESS"] == "gpu-07:4321"
  assert env["XLA_FLAGS"].split()[-1] == "--xla_gpu_enable_latency_hiding_scheduler=false"
  env, _, _ = parse_dry_run(run_slurm(slurm, DRY_RUN="1", JAX_COMPILATION_CACHE_DIR="/shared/jax cache").stdout)
  assert env["JAX_COMPILATION_CACHE_DIR"] == "/shared/jax cache"
  ports = {
      parse_dry_run(run_slurm(slurm, DRY_RUN="1", SLURM_JOB_ID=j).stdout)[0]["JAX_COORDINATOR_ADDRESS"]
      for j in ("100", "101")
  }
  assert len(ports) == 2  # jobs sharing a head node get different ports


def test_slurm_default_workdir_and_plain_nodelist_without_scontrol(slurm):
  (slurm["bin"] / "scontrol").unlink()
  env = {k: v for k, v in slurm["env"].items() if k != "WORKDIR"}
  res = subprocess.run(
      ["bash", str(SLURM)],
      cwd=slurm["tmp"],
      capture_output=True,
      text=True,
      env=dict(env, DRY_RUN="1", SLURM_JOB_NODELIST="n1,n2", SLURM_NNODES="2"),
  )
  assert res.returncode == 0, res.stderr
  env_out, srun, _ = parse_dry_run(res.stdout)
  assert env_out["JAX_COORDINATOR_ADDRESS"].startswith("n1:")
  assert srun[srun.index("--workdir") + 1] == f"{slurm['repo']}/runs/ict-4242"


@pytest.mark.parametrize(
    "env,message",
    [
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_NNODES": "3"}, "lists 4 hosts but SLURM_NNODES=3"),
        ({"CONFIG": "configs/missing.py"}, "CONFIG=configs/missing.py"),
        ({"SLURM_SUBMIT_DIR": "/"}, "is not the ict-jax repository root"),
    ],
)
def test_slurm_errors(slurm, env, message):
  res = run_slurm(slurm, DRY_RUN="1", **env)
  assert res.returncode != 0 and message in res.stderr, res.stderr
  no_calls(slurm)


def test_slurm_real_path_with_fake_srun_starts_one_process_per_node(slurm):
  """Not a dry run: fake srun runs the task command once per rank; fake python records."""
  out = slurm["tmp"] / "tasks"
  out.mkdir()
  write_exe(
      slurm["bin"] / "srun",
      '#!/bin/bash\nwhile [[ $1 == --* ]]; do echo "$1" >> "$FAKE_OUT/srun-options"; shift; done\n'
      'for ((r = 0; r < SLURM_NNODES; r++)); do SLURM_PROCID=$r "$@" || exit $?; done\n',
  )
  write_exe(
      slurm["bin"] / "python",
      '#!/bin/bash\nd="$FAKE_OUT/rank-$SLURM_PROCID"; mkdir -p "$d"\n'
      'printf "%s\\0" "$@" > "$d/argv"; env -0 > "$d/env"; echo "cwd=$PWD" > "$d/cwd"\n',
  )
  res = run_slurm(slurm, "--config.x=1", FAKE_OUT=str(out))
  assert res.returncode == 0, res.stderr
  assert "coordinator gpu-07:" in res.stdout
  ranks = sorted(p.name for p in out.glob("rank-*"))
  assert ranks == ["rank-0", "rank-1", "rank-2", "rank-3"]
  for r in range(4):
    d = out / f"rank-{r}"
    env = dict(kv.split("=", 1) for kv in (d / "env").read_bytes().decode().split("\0") if kv)
    assert env["JAX_PROCESS_ID"] == str(r)
    assert env["JAX_NUM_PROCESSES"] == "4"
    assert env["JAX_COORDINATOR_ADDRESS"].startswith("gpu-07:")
    assert env["JAX_PLATFORMS"] == "cuda"
    assert env["JAX_COMPILATION_CACHE_DIR"] == os.path.expanduser("~/.cache/ict_jax/jax_cache")
    argv = (d / "argv").read_bytes().decode().split("\0")[:-1]
    assert argv == ["-m", "ict_jax.train", "--config", "configs/c.py", "--workdir", "/shared/runs/r 1", "--config.x=1"]
    assert (d / "cwd").read_text().strip() == f"cwd={slurm['repo']}"
  assert "--ntasks-per-node=1" in (out / "srun-options").read_text().split()


def test_slurm_xla_flags_are_known_to_the_installed_jaxlib(slurm):
  env, _, _ = parse_dry_run(run_slurm(slurm, DRY_RUN="1").stdout)
  probe = [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"]
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  base["JAX_PLATFORMS"] = "cpu"
  ok = subprocess.run(probe, env=dict(base, XLA_FLAGS=env["XLA_FLAGS"]), capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr[-2000:]
  # the probe can fail: XLA aborts on a flag it does not know
  bad = subprocess.run(
      probe,
      env=dict(base, XLA_FLAGS="--xla_gpu_no_such_flag_for_test=true"),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert bad.returncode != 0 and "xla_gpu_no_such_flag_for_test" in bad.stderr
