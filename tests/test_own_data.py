"""README's "Your own model, data and reward" example, run as written (paths moved to a temporary
folder): a JSONL of prompts, a reward file with TRL's signature, the command; the run trains on the
file's prompts with the function's reward."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ict_jax.logs import read_log

REPO = Path(__file__).resolve().parent.parent


def _example() -> str:
  text = (REPO / "README.md").read_text()
  marker = text.index("<!-- own-data-example: tests/test_own_data.py runs this block -->")
  block = re.search(r"```bash\n(.*?)```", text[marker:], re.S)
  assert block is not None, "README: no bash block after the own-data-example marker"
  return block.group(1)


def test_readme_own_data_example_runs_end_to_end(tmp_path):
  script = _example()
  assert "my_task/reward.py:exact" in script and "--config.data.name=files" in script
  script = script.replace("my_task/", f"{tmp_path}/my_task/").replace("my_task\n", f"{tmp_path}/my_task\n")
  script = script.replace("runs/my_task", str(tmp_path / "run")).replace("python ", f"{sys.executable} ")
  env = dict(os.environ)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  proc = subprocess.run(["bash", "-e", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = read_log(tmp_path / "run")
  assert [r["step"] for r in rows] == list(range(1, 21))
  assert all("reward/exact" in r for r in rows)
  # the reward is the function's: its mean equals reward_mean (one function, weight 1)
  assert all(abs(r["reward/exact"] - r["reward_mean"]) < 1e-6 for r in rows)
  prompts = {json.loads(line)["prompt"] for line in (tmp_path / "my_task" / "train.jsonl").read_text().splitlines()}
  samples = read_log(tmp_path / "run", "samples")
  assert samples and {s["prompt"] for s in samples} <= prompts
