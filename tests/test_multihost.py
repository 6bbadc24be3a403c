"""The multi-host path on CPU: two processes join with `jax.distributed.initialize` on localhost
and train the tiny model together, the update on packed rows; their losses equal a one-process
run of the padded update on the same number of devices, and a rollout where one host's verifier
is slow on one row gives both hosts the same rewards and advantages. A SIGTERM to one host (every
host saves the same step, exits 0, and the resume equals the uninterrupted run) is
tests/test_pod.py's, on 4 processes and a bucket."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import host_cache
import numpy as np
import pytest

from ict_jax.logs import read_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax
    from ict_jax import config as C
    from ict_jax.train import train
    from ict_jax import configs
    c = configs.tiny_config()
    c.warm_start.sft_steps = 0
    c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
    c.train.steps = c.train.checkpoint_every = 2
    c.train.async_checkpointing = False
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.train.token_budget = int(sys.argv[2])  # > 0: the update on packed rows, micro-batches of 4
    c.train.micro_batch_tokens = 4 * c.train.token_budget  # packed rows (as the paper configs: by tokens)
    history = train(c, sys.argv[1], progress=False)
    print("RESULT " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                                  "steps": [r["step"] for r in history],
                                  "devices": jax.device_count(),
                                  "metrics": [[r["loss"], r["reward_mean"], r["entropy"], r["grad_norm"]]
                                              for r in history],
                                  "padded": [r["padded_fraction"] for r in history]}), flush=True)
    if jax.process_count() > 1:  # leave together; skip the coordinator's shutdown barrier, whose
        from jax.experimental import multihost_utils  # timeout a loaded CI machine can exceed
        multihost_utils.sync_global_devices("test done")
        sys.stdout.flush()
        os._exit(0)
""")


ROLLOUT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import jax
    import numpy as np
    from ict_jax import config as C, sharding
    sharding.maybe_initialize_distributed()
    from ict_jax.rewards.pool import RewardPool
    from ict_jax.rollout import Collector, Sampling, Scoring
    from ict_jax.setup import abstract_params, make_mesh, model_config
    from ict_jax.tokenizer import Tokenizer
    from ict_jax.setup import init_params
    from ict_jax import configs
    cfg = C.validate(configs.tiny_config())
    mesh = make_mesh(cfg)
    mcfg = model_config(cfg, "")
    graphdef, _, params_sharding = abstract_params(mcfg, mesh)
    params = init_params(mcfg, 0, mesh, params_sharding)
    scored = []

    def reward(completion, gold):  # 1 for every row; this host's first "slow" row overruns
      scored.append(gold)
      if gold == "slow" and jax.process_index() == 1 and scored.count("slow") == 1:
        time.sleep(1.0)
      return 1.0

    examples = [{"prompt": f"{i}+1=", "answer": "slow" if i == 3 else str(i + 1)} for i in range(4)]
    with RewardPool(num_workers=0, timeout_s=0.5, rewards={"answer": reward}) as pool:
      collector = Collector(Tokenizer(), Sampling(max_new_tokens=4), Scoring(reward_kind="answer"),
                            group_size=2, prompt_style="plain", max_prompt_len=16, mesh=mesh)
      roll = collector.collect((graphdef, params), examples, pool, rng=jax.random.key(0))
    print("RESULT " + json.dumps({"process": jax.process_index(), "scored": len(scored),
                                  "rows": roll.rows.tolist(), "rewards": roll.rewards.tolist(),
                                  "advantages": roll.advantages.tolist(),
                                  "timeouts": roll.stats["reward_timeouts"]}), flush=True)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("test done")
    sys.stdout.flush()
    os._exit(0)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def shim():
  """Every process writes its compiled programs to the cache (tests/host_cache.py)."""
  return host_cache.STARTUP


def _env(devices, shim, **extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
  env.update(
      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
      JAX_PLATFORMS="cpu",
      PYTHONPATH=os.pathsep.join([str(shim), REPO]),
      **extra,
  )
  return env


def _result(out: str) -> dict:
  lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
  assert lines, out[-3000:]
  return json.loads(lines[-1][len("RESULT ") :])


PACKED_ROW = 20  # tiny_config's 16 prompt + 4 completion tokens: the two-process run packs


def test_two_processes_train_like_one(tmp_path, shim):
  """Two processes, each packing the whole batch the same way (`packing.pack_batch` on the
  gathered rollout, micro-batches by tokens, as the paper configs run the update), train like one
  process on the padded batch: the same losses, rewards, entropies and gradient norms (ICT is
  micro-batch invariant)."""
  port = _free_port()
  procs = [
      subprocess.Popen(
          [sys.executable, "-c", SCRIPT, str(tmp_path / "multi"), str(PACKED_ROW)],
          cwd=REPO,
          env=_env(2, shim, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outs = []
  for p in procs:
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    outs.append(_result(out))
  single = subprocess.run(
      [sys.executable, "-c", SCRIPT, str(tmp_path / "single"), "0"],
      cwd=REPO,
      env=_env(4, shim),
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert single.returncode == 0, (single.stdout + single.stderr)[-3000:]
  one = _result(single.stdout)
  assert [o["processes"] for o in outs] == [2, 2] and one["processes"] == 1
  assert outs[0]["devices"] == outs[1]["devices"] == one["devices"] == 4
  np.testing.assert_allclose(outs[0]["metrics"], outs[1]["metrics"], rtol=1e-6)
  np.testing.assert_allclose(outs[0]["metrics"], one["metrics"], rtol=2e-4, atol=1e-6)
  assert all(p < q for p, q in zip(outs[0]["padded"], one["padded"]))  # the packed update ran fewer positions
  # only process 0 writes logs; both wrote the same checkpoint
  rows = read_log(tmp_path / "multi", "metrics")
  assert [r["step"] for r in rows] == [1, 2]
  assert os.path.isdir(tmp_path / "multi" / "checkpoints" / "2")


def test_each_host_scores_its_rows_and_all_see_the_same_rewards(shim):
  """8 rows over 4 devices of 2 processes: each host scores its 4 rows; host 1's verifier
  overruns the timeout on one row, which scores 0 on both hosts; rewards, advantages and the
  timeout count are identical on both."""
  port = _free_port()
  procs = [
      subprocess.Popen(
          [sys.executable, "-c", ROLLOUT_SCRIPT],
          cwd=REPO,
          env=_env(2, shim, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outs = []
  for p in procs:
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    outs.append(_result(out))
  a, b = sorted(outs, key=lambda o: o["process"])
  assert a["scored"] == b["scored"] == 4 and a["rows"] == [0, 1, 2, 3] and b["rows"] == [4, 5, 6, 7]
  assert a["rewards"] == b["rewards"] and a["advantages"] == b["advantages"]
  assert a["timeouts"] == b["timeouts"] == 1
  assert sorted(a["rewards"]) == [0.0] + [1.0] * 7 and a["rewards"].index(0.0) in (6, 7)
  adv = np.asarray(a["advantages"])
  assert (adv[:6] == 0).all() and adv[6] == -adv[7] != 0  # only the slow prompt's group differs
