"""Checkpointer: exact round trip, keep-N, restore onto another mesh, corrupt-step fallback,
atomicity under SIGKILL, unwritable workdir."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ict_jax.checkpoint import Checkpointer, CheckpointError, abstract_like

REPO = Path(__file__).resolve().parents[1]
AXES = ("data", "fsdp", "tensor")


def mesh_of(shape):
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3)


def make_state(seed: int, mesh=None):
  """A small train-state look-alike: nested params, adamw state (namedtuples), step, key data, counters."""
  rng = np.random.default_rng(seed)
  params = {
      # [vocab, embed]; 16 KB, so its chunks are stored out of line (OCDBT inlines values <= 1 KB)
      "embed": {"embedding": rng.standard_normal((64, 64), dtype=np.float32)},
      "layers": {
          "0": {
              "attn": {
                  "q": rng.standard_normal((8, 8), dtype=np.float32),
                  "q_bias": rng.standard_normal((8,), dtype=np.float32),
              },
              "mlp": {"up": rng.standard_normal((8, 24), dtype=np.float32).astype(jnp.bfloat16)},
          }
      },
  }
  params = jax.tree.map(jnp.asarray, params)
  tx = optax.adamw(1e-3)
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * (seed + 1), params)
  _, opt_state = tx.update(grads, opt_state, params)  # non-zero moments and count
  state = {
      "params": params,
      "opt_state": opt_state,
      "step": jnp.int32(100 + seed),
      "rng": jax.random.key_data(jax.random.key(seed)),  # uint32[2]
      "counters": {"tokens_seen": jnp.int32(1234 * (seed + 1)), "samples": jnp.int32(7 + seed)},
  }
  if mesh is not None:
    state = jax.device_put(state, shardings_for(state, mesh, {2: P("data", None), 1: P("data")}))
  return state


def shardings_for(tree, mesh, spec_by_ndim):
  """First dim over the given spec when it divides, replicated otherwise."""

  def one(x):
    spec = spec_by_ndim.get(x.ndim, P())
    sizes = dict(mesh.shape)
    for dim, ax in zip(x.shape, spec):
      names = (ax,) if isinstance(ax, str) else (ax or ())
      if dim % int(np.prod([sizes[n] for n in names] or [1])):
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, tree)


def to_numpy(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def assert_exactly_equal(restored, expected_np):
  chex.assert_trees_all_equal_structs(restored, expected_np)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(expected_np)):
    assert a.dtype == b.dtype, (jax.tree_util.keystr(path), a.dtype, b.dtype)
    assert a.shape == b.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))


META = {
    "data": {"position": 4096, "epoch": 1},
    "config": {"lr": 1e-6, "method": "ict", "mesh": [1, 8, 1], "warmup": None, "tied": True},
}


def test_round_trip_exact_and_meta(tmp_path):
  mesh = mesh_of((8, 1, 1))
  state = make_state(0, mesh)
  expected = to_numpy(state)
  abstract = abstract_like(state, jax.tree.map(lambda x: x.sharding, state))
  with Checkpointer(str(tmp_path), keep=3) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(10, state, META) is True
    # The caller donates its state right after save(): the in-flight write must not depend on it.
    for leaf in jax.tree.leaves(state):
      leaf.delete()
    ckpt.wait()
    assert (tmp_path / "checkpoints" / "10" / "state").is_dir()
    assert (tmp_path / "checkpoints" / "10" / "meta").is_dir()
    assert ckpt.save(10, make_state(1), META) is False  # an existing step is never overwritten
  with Checkpointer(tmp_path) as ckpt:
    step, restored, meta = ckpt.restore(abstract)
  assert step == 10
  assert meta == META
  assert_exactly_equal(restored, expected)
  # optax's namedtuples survive (so tx.update accepts the restored state)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(expected["opt_state"])
  assert type(restored["opt_state"][0]).__name__ == "ScaleByAdamState"
  assert restored["rng"].dtype == jnp.uint32
  np.testing.assert_array_equal(
      jax.random.key_data(jax.random.wrap_key_data(restored["rng"])), jax.random.key_data(jax.random.key(0))
  )


def test_relative_workdir(tmp_path, monkeypatch):
  """The default --workdir is ./runs/default: a relative path saves and restores (Orbax itself
  refuses relative paths)."""
  monkeypatch.chdir(tmp_path)
  state = {"w": jnp.arange(4, dtype=jnp.float32)}
  with Checkpointer("runs/rel", keep=1) as ckpt:
    assert ckpt.save(3, state, {"step": 3})
    ckpt.wait()
  assert (tmp_path / "runs" / "rel" / "checkpoints" / "3" / "state").is_dir()
  with Checkpointer("./runs/rel") as ckpt:
    abstract = abstract_like(state, NamedSharding(mesh_of((8, 1, 1)), P()))
    step, restored, _ = ckpt.restore(abstract)
  assert step == 3
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4, dtype=np.float32))


def test_keep_last_n(tmp_path):
  with Checkpointer(tmp_path, keep=2, async_save=True) as ckpt:
    state = {"w": jnp.zeros((4,), jnp.float32)}
    for step in range(1, 6):
      assert ckpt.save(step, jax.tree.map(lambda x: x + step, state), {"step": step})
      ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  on_disk = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
  assert on_disk == ["4", "5"]
  with Checkpointer(tmp_path, keep=2) as ckpt:
    assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
    abstract = abstract_like(state, NamedSharding(mesh_of((8, 1, 1)), P()))
    step, restored, meta = ckpt.restore(abstract, step=4)
  assert step == 4 and meta == {"step": 4}
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 4, np.float32))


def test_restore_onto_a_different_mesh(tmp_path):
  state = make_state(3, mesh_of((8, 1, 1)))
  assert state["params"]["embed"]["embedding"].sharding.spec == P("data", None)
  expected = to_numpy(state)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, state, {"k": 1})
  mesh2 = mesh_of((2, 2, 2))
  target = shardings_for(state, mesh2, {2: P("fsdp", "tensor"), 1: P(("data", "tensor"))})
  abstract = abstract_like(expected, target)
  with Checkpointer(tmp_path) as ckpt:
    step, restored, meta = ckpt.restore(abstract)
  assert step == 5 and meta == {"k": 1}
  assert_exactly_equal(restored, expected)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert got.sharding == want, (got.sharding, want)
  emb = restored["params"]["embed"]["embedding"]  # [64, 64] over fsdp x tensor: [32, 32] shards
  assert emb.sharding.spec == P("fsdp", "tensor")
  assert {s.data.shape for s in emb.addressable_shards} == {(32, 32)}


@flax.struct.dataclass
class _TrainStateBeforeLora:
  """`ict_jax.train_step.TrainState` as main wrote it before LoRA (d58346f): the checkpoints of
  every full fine-tuning run so far hold this tree."""

  step: jax.Array
  params: Any
  opt_state: Any


def test_full_fine_tuning_checkpoint_before_lora_restores_and_is_written_the_same(tmp_path):
  """LoRA keeps its frozen base in `TrainState.frozen`, which checkpoints never hold
  (`TrainState.saved`): full fine-tuning writes the tree it wrote before (Orbax's metadata of the
  state item byte for byte), and a checkpoint written before restores into the learner's target."""
  from ict_jax import train_step as ts

  mesh = mesh_of((8, 1, 1))
  s = make_state(2, mesh)
  before = _TrainStateBeforeLora(step=s["step"], params=s["params"], opt_state=s["opt_state"])
  now = ts.TrainState(step=s["step"], params=s["params"], opt_state=s["opt_state"])  # frozen=None
  expected = to_numpy(before)
  for name, state in (("before", before), ("now", now.saved())):
    with Checkpointer(tmp_path / name, async_save=False) as ckpt:
      ckpt.save(7, {"state": state}, META)
  metadata = lambda name: (tmp_path / name / "checkpoints" / "7" / "state" / "_METADATA").read_bytes()
  assert metadata("now") == metadata("before")
  shardings = jax.tree.map(lambda x: x.sharding, now)
  target = {"state": abstract_like(now, shardings).saved()}  # as Learner.restore_or_init asks
  with Checkpointer(tmp_path / "before") as ckpt:
    step, restored, meta = ckpt.restore(target)
  assert step == 7 and meta == META
  state = restored["state"].with_frozen(None)
  assert isinstance(state, ts.TrainState) and state.frozen is None
  assert_exactly_equal(state.saved(), ts.SavedState(**vars(expected)))


def _largest_data_file(step_dir: Path) -> Path:
  """The file holding the embedding's chunks (the only value over OCDBT's 1 KB inline limit)."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files, f"no array data files under {step_dir / 'state'}"
  biggest = max(files, key=lambda p: p.stat().st_size)
  assert biggest.stat().st_size > 8_000, sorted((p.stat().st_size, str(p)) for p in files)
  return biggest


def test_corrupt_newest_falls_back_with_warning(tmp_path, caplog):
  mesh = mesh_of((8, 1, 1))
  states = {1: make_state(1, mesh), 2: make_state(2, mesh)}
  expected1 = to_numpy(states[1])
  with Checkpointer(tmp_path) as ckpt:
    for step, st in states.items():
      ckpt.save(step, st, {"step": step})
  abstract = abstract_like(expected1, jax.tree.map(lambda x: x.sharding, states[1]))
  bad = _largest_data_file(tmp_path / "checkpoints" / "2")
  size = bad.stat().st_size
  with open(bad, "r+b") as f:
    f.truncate(size // 2)

  with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger="ict_jax.checkpoint"):
    assert ckpt.latest_step() == 2
    step, restored, meta = ckpt.restore(abstract)
    assert step == 1 and meta == {"step": 1}
    assert_exactly_equal(restored, expected1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ict_jax.checkpoint"]
    assert any(str(tmp_path / "checkpoints" / "2") in w for w in warnings), warnings
    with pytest.raises(CheckpointError, match=r"checkpoints/2'"):
      ckpt.restore(abstract, step=2)
    # After the fallback the trainer resumes at step 1; steps <= 2 need force, and 2 is never overwritten.
    assert ckpt.save(2, states[1], {}, force=True) is False

  bad1 = _largest_data_file(tmp_path / "checkpoints" / "1")
  with open(bad1, "r+b") as f:
    f.truncate(0)
  with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="no usable checkpoint"):
    ckpt.restore(abstract)


CHILD = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np
    from ict_jax.checkpoint import Checkpointer
    workdir, n = sys.argv[1], int(sys.argv[2])
    ckpt = Checkpointer(workdir, keep=3)
    ckpt.save(1, {"w": jnp.full((n,), 1.0, jnp.float32), "step": jnp.int32(1)}, {"step": 1})
    ckpt.wait()
    big = jnp.asarray(np.random.default_rng(0).random(n, dtype=np.float32))  # incompressible: a slow write
    started = ckpt.save(2, {"w": big, "step": jnp.int32(2)}, {"step": 2})
    in_flight = not os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
    print("SAVE_STARTED", started, "IN_FLIGHT", in_flight, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_killed_save_leaves_previous_checkpoint(tmp_path):
  n = 50_000_000  # 200 MB of float32
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="",
  )
  proc = subprocess.run(
      [sys.executable, "-c", CHILD, str(tmp_path), str(n)], env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert "SAVE_STARTED True IN_FLIGHT True" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
  ckdir = tmp_path / "checkpoints"
  leftovers = [p.name for p in ckdir.iterdir() if p.name.startswith("2") and p.name != "2"]
  assert leftovers, f"expected the killed save's temporary directory, found {os.listdir(ckdir)}"
  assert not (ckdir / "2").exists()

  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    abstract = {
        "w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=NamedSharding(mesh_of((8, 1, 1)), P("data"))),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh_of((8, 1, 1)), P())),
    }
    step, restored, meta = ckpt.restore(abstract)
    assert step == 1 and meta == {"step": 1} and int(restored["step"]) == 1
    w = np.asarray(restored["w"])
    assert w.shape == (n,) and w.min() == 1.0 and w.max() == 1.0
  assert sorted(p.name for p in ckdir.iterdir() if p.is_dir()) == ["1"]  # the temporary directory is cleaned up


def test_unwritable_workdir_is_named(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(CheckpointError, match="a_file/run.*not writable"):
    Checkpointer(blocker / "run")
  if os.geteuid() != 0:  # root ignores permission bits
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
      with pytest.raises(CheckpointError, match=f"{ro}.*not writable"):
        Checkpointer(ro)
    finally:
      ro.chmod(0o700)


def test_bad_inputs(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match="no checkpoints in"):
      ckpt.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(TypeError, match=r"\['rng'\].*key_data"):
      ckpt.save(1, {"rng": jax.random.key(0)}, {})
    with pytest.raises(TypeError, match="meta is not JSON"):
      ckpt.save(1, {"w": jnp.zeros(2)}, {"x": object()})
    assert ckpt.all_steps() == []
    with pytest.raises(CheckpointError, match="no checkpoint for step 3"):
      ckpt.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, step=3)
  with pytest.raises(ValueError, match="keep=0"):
    Checkpointer(tmp_path, keep=0)
