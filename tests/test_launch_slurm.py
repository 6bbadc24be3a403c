"""launch/gpu_slurm.sbatch without SLURM: dry runs parsed back with `shlex`, and a real run against
fake `scontrol`/`srun` and a fake python that records each rank's argv and environment. Fake
`gcloud`, `git`, `ssh`, `scp`, `srun`, `sbatch` and `curl` come first on PATH (tests/launch_fakes.py),
so a dry run that ran anything is caught."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from launch_fakes import REPO, SLURM, fakes, no_calls, write_exe  # noqa: F401  pylint: disable=unused-import


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


SECRET = "k3y-with 'quote' $HOME"  # a key a shell would split, quote or expand if mishandled
# A python without wandb until `-m pip install` ran (then `import wandb` works); every other call
# is a task, recording its argv and environment as rank-$SLURM_PROCID.
PYTHON_WITHOUT_WANDB = (
    '#!/bin/bash\nif [[ $1 == -c ]]; then [[ -f "$FAKE_OUT/pip-argv" ]]; exit; fi\n'
    'if [[ $1 == -m && $2 == pip ]]; then printf "%s\\0" "$@" > "$FAKE_OUT/pip-argv"; '
    'echo "pip ran" >> "$FAKE_OUT/order"; exit 0; fi\n'
    'd="$FAKE_OUT/rank-$SLURM_PROCID"; mkdir -p "$d"; echo "rank $SLURM_PROCID" >> "$FAKE_OUT/order"\n'
    'printf "%s\\0" "$@" > "$d/argv"; env -0 > "$d/env"\n'
)


def wandb_pin() -> str:
  return re.search(r"^wandb==(\S+)$", (REPO / "requirements-dev.txt").read_text(), re.M).group(1)


@pytest.mark.parametrize(
    "config_text,args,env,asked",
    [
        ("", [], {}, False),
        ("", ["--config.log.wandb_project=ict"], {}, True),
        ("", ["--config.log.wandb_project", "ict"], {}, True),
        ("", ["--config.log.wandb_project="], {}, False),
        ("", [], {"INSTALL_WANDB": "1"}, True),
        ("c.log.wandb_project = 'ict'\n", [], {}, True),
    ],
    ids=["no", "arg", "arg-two-words", "arg-empty", "env", "config"],
)
def test_slurm_dry_run_installs_wandb_when_asked_and_missing(slurm, config_text, args, env, asked):
  (slurm["repo"] / "configs" / "c.py").write_text(config_text)
  out = slurm["tmp"] / "out"
  out.mkdir()
  write_exe(slurm["bin"] / "python-nowandb", PYTHON_WITHOUT_WANDB)
  res = run_slurm(
      slurm, *args, DRY_RUN="1", PYTHON="python-nowandb", FAKE_OUT=str(out), WANDB_API_KEY=SECRET,
      WANDB_ENTITY="team", **env,
  )  # fmt: skip
  assert res.returncode == 0, res.stderr
  assert SECRET not in res.stdout + res.stderr
  printed, srun, _ = parse_dry_run(res.stdout)
  assert printed["WANDB_ENTITY"] == "team" and printed["WANDB_API_KEY"] == "(set; not shown)"
  pip = [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ") and " pip " in line]
  assert pip == ([["python-nowandb", "-m", "pip", "install", f"wandb=={wandb_pin()}"]] if asked else [])
  assert srun[0] == "srun" and not (out / "pip-argv").exists()  # printed, not run
  # a python that has wandb: nothing to install
  res = run_slurm(slurm, *args, DRY_RUN="1", PYTHON=sys.executable, **env)
  assert res.returncode == 0 and " pip " not in res.stdout, res.stdout
  no_calls(slurm)


def test_slurm_bad_install_wandb_value(slurm):
  res = run_slurm(slurm, DRY_RUN="1", INSTALL_WANDB="yes")
  assert res.returncode == 2 and "INSTALL_WANDB=yes: expected 0 or 1" in res.stderr


def test_slurm_wandb_without_a_key_is_a_warning(slurm):
  res = run_slurm(slurm, "--config.log.wandb_project=ict", DRY_RUN="1", PYTHON=sys.executable)
  assert res.returncode == 0 and "WANDB_API_KEY is not set" in res.stderr, res.stderr
  res = run_slurm(slurm, "--config.log.wandb_project=ict", DRY_RUN="1", PYTHON=sys.executable, WANDB_MODE="offline")
  assert res.returncode == 0 and "WANDB_API_KEY" not in res.stderr, res.stderr


def test_slurm_real_path_installs_wandb_once_and_every_task_gets_the_key(slurm):
  """Not a dry run: wandb is installed once, before srun starts the tasks, and the W&B settings
  reach every rank's environment intact."""
  out = slurm["tmp"] / "tasks"
  out.mkdir()
  write_exe(
      slurm["bin"] / "srun",
      "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
      'for ((r = 0; r < SLURM_NNODES; r++)); do SLURM_PROCID=$r "$@" || exit $?; done\n',
  )
  write_exe(slurm["bin"] / "python", PYTHON_WITHOUT_WANDB)
  res = run_slurm(slurm, "--config.log.wandb_project=ict", FAKE_OUT=str(out), WANDB_API_KEY=SECRET, WANDB_ENTITY="team")
  assert res.returncode == 0, res.stderr
  assert SECRET not in res.stdout + res.stderr
  assert (out / "order").read_text().splitlines() == ["pip ran", "rank 0", "rank 1", "rank 2", "rank 3"]
  assert (out / "pip-argv").read_bytes().decode().split("\0")[:-1] == [
      "-m",
      "pip",
      "install",
      f"wandb=={wandb_pin()}",
  ]
  for r in range(4):
    env = dict(kv.split("=", 1) for kv in (out / f"rank-{r}" / "env").read_bytes().decode().split("\0") if kv)
    assert env["WANDB_API_KEY"] == SECRET and env["WANDB_ENTITY"] == "team"
    argv = (out / f"rank-{r}" / "argv").read_bytes().decode().split("\0")[:-1]
    assert argv[-1] == "--config.log.wandb_project=ict"
