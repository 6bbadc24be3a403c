"""ict_jax.inspect / ict_jax.export: metadata-only tree, partial restore, norms, diff, HF export.

Two checkpoints are written the way `train.py` writes them ({"state": TrainState, "ref_params"},
meta with the run config) on an 8-device (1, 4, 2) mesh. Step 2 is step 1 with layer 1's slice of
every stacked decoder tensor ([L, ...] under "layers/") scaled by 1.5, so the expected update sizes
are known exactly.
"""

from __future__ import annotations

import math
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ict_jax import config as config_lib
from ict_jax import configs
from ict_jax import inspect as ins
from ict_jax.inspect import reader
from ict_jax import sharding
from ict_jax import train_step as ts
from ict_jax.checkpoint import Checkpointer, CheckpointError
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import abstract_model, init_model

SCALE = 1.5  # layer 1 at step 2 = SCALE * layer 1 at step 1


def _params_of(mcfg):
  return nnx.to_pure_dict(nnx.state(init_model(mcfg, seed=3), nnx.Param))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """-> dict(workdir, cfg (the validated run config), mesh, mcfg, params {step: host numpy pure dict},
  optimizer, shardings)."""
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = configs.tiny_config()
  cfg.loss.beta = 0.04  # the trainer then saves a frozen "ref_params" copy too
  run_cfg = config_lib.validate(cfg)
  mcfg = Qwen2Config.preset("tiny")
  mesh = sharding.make_mesh((1, 4, 2))
  abstract = abstract_model(mcfg)
  params_sharding = sharding.pure_shardings(nnx.state(abstract, nnx.Param), mesh)
  optimizer = ts.make_optimizer(run_cfg.optim, 10)
  p1 = _params_of(mcfg)
  p2 = {**p1, "layers": jax.tree.map(lambda x: x.at[1].multiply(SCALE), p1["layers"])}
  host = {}
  with Checkpointer(workdir, async_save=False) as ck:
    for step, p in ((1, p1), (2, p2)):
      placed = jax.device_put(p, params_sharding)
      state = ts.init_train_state(placed, optimizer, mesh=mesh, params_sharding=params_sharding, step=step)
      tree = {"state": state, "ref_params": jax.device_put(p1, params_sharding)}
      ck.save(
          step,
          tree,
          {"data_position": 4 * step, "step": step, "seed": 0, "config": config_lib.to_dict(run_cfg)},
          force=True,
      )
      host[step] = jax.tree.map(lambda x: np.asarray(x, np.float64), p)
  return dict(
      workdir=workdir,
      cfg=run_cfg,
      mesh=mesh,
      mcfg=mcfg,
      params=host,
      optimizer=optimizer,
      params_sharding=params_sharding,
  )


@pytest.fixture()
def ckpt(run):
  with ins.open_checkpoint(run["workdir"]) as c:
    yield c


def _flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(str(getattr(k, "key", k)) for k in kp): v for kp, v in jax.tree_util.tree_leaves_with_path(tree)}


# ---- metadata --------------------------------------------------------------------------------
def test_steps_and_meta(ckpt, run, monkeypatch):
  assert ckpt.steps == [1, 2] and ckpt.step == 2
  assert ckpt.meta(1)["data_position"] == 4
  assert ckpt.at(1).step == 1
  assert ins.open_checkpoint(os.path.join(run["workdir"], "checkpoints", "1")).step == 1
  assert ckpt.model_config == run["mcfg"]
  monkeypatch.chdir(os.path.dirname(run["workdir"]))  # a relative path (Orbax wants absolute)
  with ins.open_checkpoint(os.path.basename(run["workdir"])) as rel:
    assert rel.steps == [1, 2] and rel.meta(1)["data_position"] == 4


def test_tree_is_metadata_only(run, monkeypatch):
  def no_restore(*a, **k):
    raise AssertionError("tree() must not restore arrays")

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", no_restore)
  with ins.open_checkpoint(run["workdir"]) as c:
    tree = c.tree()
    tensors = c.tensors()
    text = c.render_text()
  mcfg = run["mcfg"]
  # the same paths, shapes and dtypes as the model's own parameter tree
  want = {
      p: (tuple(v.shape), np.dtype(v.dtype))
      for p, v in _flat(nnx.to_pure_dict(nnx.state(abstract_model(mcfg), nnx.Param))).items()
  }
  assert {p: (t.shape, t.dtype) for p, t in tensors.items()} == want
  assert isinstance(tree["layers"]["attn"]["q_proj"]["kernel"], ins.TensorInfo)  # stacked layers
  assert sum(t.nbytes for t in tensors.values()) == mcfg.num_params() * 4 == c.nbytes()
  # the sharding each tensor was saved with: (vocab -> tensor, embed -> fsdp) on (1, 4, 2)
  emb = tensors["embed/embedding"]
  assert emb.mesh == {"data": 1, "fsdp": 4, "tensor": 2}
  assert emb.partition_spec == ("tensor", "fsdp")
  assert emb.shard_nbytes * 8 == emb.nbytes
  q = tensors["layers/attn/q_proj/kernel"]  # (layers, embed, heads, head_dim)
  assert q.shape == (2, 64, 4, 16)
  assert q.partition_spec == (None, "fsdp", "tensor", None)
  assert q.spec_str == "P(None, 'fsdp', 'tensor', None)"
  for path in want:
    assert path in text
  # the whole saved tree: params, AdamW moments, step, ref_params
  full = c.tensors(item=None)
  assert "state/step" in full and "ref_params/embed/embedding" in full
  assert sum(t.nbytes for p, t in full.items() if "/mu/" in p) == mcfg.num_params() * 4


def test_treescope_rendering(ckpt):
  import treescope

  text = treescope.render_to_text(ckpt.tree())
  assert "float32[2, 64, 4, 16]" in text and "P(None, 'fsdp', 'tensor', None)" in text


# ---- reading tensors ---------------------------------------------------------------------------
def _restore_full(run, step):
  """The whole state the way train.py restores it (an independent path through Orbax)."""
  mcfg, mesh = run["mcfg"], run["mesh"]
  params_abs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(abstract_model(mcfg), nnx.Param))
  )
  shardings = ts.train_state_shardings(run["optimizer"], params_abs, run["params_sharding"], mesh)
  state_abs = jax.eval_shape(lambda p: ts.TrainState(jnp.int32(0), p, run["optimizer"].init(p)), params_abs)
  tree = {
      "state": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state_abs, shardings),
      "ref_params": jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params_abs, run["params_sharding"]
      ),
  }
  with Checkpointer(run["workdir"], async_save=False) as ck:
    _, restored, _ = ck.restore(tree, step=step)
  return restored


def test_load_param_equals_full_restore(ckpt, run):
  full = _restore_full(run, 2)
  flat = _flat(full["state"].params)
  for path in ("layers/attn/q_proj/kernel", "embed/embedding", "final_norm/scale"):
    want = np.asarray(flat[path])
    got = ckpt.load_param(path)
    assert len(got.sharding.device_set) == 1
    np.testing.assert_array_equal(np.asarray(got), want)
  layer1 = ckpt.load_param("layers/1/attn/q_proj/kernel")  # one layer's slice of the stack
  np.testing.assert_array_equal(np.asarray(layer1), np.asarray(flat["layers/attn/q_proj/kernel"])[1])
  ref = ckpt.load_param("layers/1/mlp/up_proj/kernel", item="ref_params")
  np.testing.assert_array_equal(np.asarray(ref), run["params"][1]["layers"]["mlp"]["up_proj"]["kernel"][1])


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (1, 8, 1)])
def test_load_param_onto_mesh(ckpt, run, shape):
  mesh = sharding.make_mesh(shape)
  x = ckpt.load_param("layers/0/attn/q_proj/kernel", mesh=mesh, step=1)  # (embed, heads, head_dim)
  fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
  spec = P("fsdp" if fsdp > 1 else None, "tensor" if tensor > 1 else None, None)
  assert x.sharding == NamedSharding(mesh, spec)
  assert x.addressable_shards[0].data.shape == (64 // fsdp, 4 // tensor, 16)
  want = run["params"][1]["layers"]["attn"]["q_proj"]["kernel"]  # [L, D, N, H]
  np.testing.assert_array_equal(np.asarray(x), want[0])
  stack = ckpt.load_param("layers/attn/q_proj/kernel", mesh=mesh, step=1)
  assert stack.sharding == NamedSharding(mesh, P(None, *spec))
  np.testing.assert_array_equal(np.asarray(stack), want)


def _read_everything(ckpt, mesh, order):
  """The public reading methods of a fresh `Checkpoint`, called in `order` -> {name: result}."""
  calls = {
      "slice": lambda: ckpt.load_param("layers/1/mlp/gate_proj/kernel", mesh=mesh, step=1),
      "stack": lambda: ckpt.load_param("layers/mlp/gate_proj/kernel", mesh=mesh),
      "restore": lambda: ckpt.restore(["embed/embedding", "layers/attn/q_proj/kernel"], mesh=mesh, item="ref_params"),
      "params": lambda: ckpt.load_params(1, mesh=mesh),
      "model": lambda: nnx.to_pure_dict(nnx.state(ckpt.restore_model(mesh=mesh), nnx.Param)),
      "model_config": lambda: ckpt.model_config,
      "logical_axes": lambda: ckpt.logical_axes,
  }
  return {name: calls[name]() for name in order}


def test_public_methods_give_the_same_results_in_either_order(run):
  """Nothing a method needs is left behind by another: a mesh read first (which once filled the
  axes a layer slice then used) or last, the results, values and placements, are the same."""
  mesh = run["mesh"]
  order = ["slice", "stack", "restore", "params", "model", "model_config", "logical_axes"]
  with ins.open_checkpoint(run["workdir"]) as c:
    forward = _read_everything(c, mesh, order)
  with ins.open_checkpoint(run["workdir"]) as c:
    backward = _read_everything(c, mesh, order[::-1])
  assert forward["model_config"] == backward["model_config"] == run["mcfg"]
  assert forward["logical_axes"] == backward["logical_axes"] == ins.param_axes(run["mcfg"])
  for name in ("slice", "stack", "restore", "params", "model"):
    a, b = _flat(forward[name]), _flat(backward[name])
    assert a.keys() == b.keys(), name
    for path, x in a.items():
      assert x.sharding == b[path].sharding, (name, path)
      assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, (name, path)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(b[path]), err_msg=f"{name} {path}")
  np.testing.assert_array_equal(
      np.asarray(forward["slice"]), run["params"][1]["layers"]["mlp"]["gate_proj"]["kernel"][1]
  )
  np.testing.assert_array_equal(
      np.asarray(forward["model"]["embed"]["embedding"]), run["params"][2]["embed"]["embedding"]
  )
  with ins.open_checkpoint(run["workdir"]) as c:  # a stored tensor's slice is load_param's, not restore's
    with pytest.raises(KeyError, match="one layer's slice of the stored 'layers/attn/q_proj/kernel'"):
      c.restore(["layers/0/attn/q_proj/kernel"])
    with pytest.raises(KeyError, match="did you mean"):
      c.restore(["embed/embeding"])


def test_errors_name_what_exists(ckpt, tmp_path):
  with pytest.raises(CheckpointError, match=r"available steps: \[1, 2\]"):
    ckpt.load_param("embed/embedding", step=7)
  with pytest.raises(KeyError, match="did you mean.*layers/attn/q_proj/kernel"):
    ckpt.load_param("layers/attn/q_proj/kernal")
  with pytest.raises(KeyError, match="no params tensor 'layers/2/attn/q_proj/kernel'"):
    ckpt.load_param("layers/2/attn/q_proj/kernel")  # 2 layers: 0 and 1
  with pytest.raises(CheckpointError, match="does not exist"):
    ins.open_checkpoint(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match="no checkpoints"):
    ins.open_checkpoint(tmp_path / "empty")


# ---- norms and updates ---------------------------------------------------------------------------
def test_param_stats_match_numpy(ckpt, run):
  stats = ins.param_stats(ckpt, step=1, mesh=run["mesh"])
  ref = _flat(run["params"][1])
  assert set(stats.tensor_norms) == set(ref)
  for p, x in ref.items():
    np.testing.assert_allclose(stats.tensor_norms[p], np.sqrt(np.sum(x * x)), rtol=1e-5, err_msg=p)
  assert list(stats.layer_norms) == ["embed", "layers/0", "layers/1", "final_norm"]
  layer1 = [x[1] for p, x in ref.items() if p.startswith("layers/")]  # layer 1's slices
  np.testing.assert_allclose(stats.layer_norms["layers/1"], np.sqrt(sum(np.sum(x * x) for x in layer1)), rtol=1e-5)
  assert stats.layer_norms["final_norm"] == pytest.approx(math.sqrt(64))  # RMSNorm scales start at 1
  assert "layers/1" in stats.render_text()


def test_diff_same_step_is_zero(ckpt):
  d = ins.diff(ckpt, 2, 2)
  assert all(v == 0.0 for v in d.tensor_delta.values())
  assert all(v == 0.0 for v in d.layer_relative.values())


def test_diff_across_steps(ckpt, run):
  d = ins.diff(ckpt, 1, 2)
  ref1 = _flat(run["params"][1])
  for p, x in ref1.items():
    if p.startswith("layers/"):  # stacked [L, ...]: only layer 1's slice moved
      np.testing.assert_allclose(d.tensor_delta[p], (SCALE - 1) * np.sqrt(np.sum(x[1] * x[1])), rtol=1e-5, err_msg=p)
      if np.any(x):  # (biases start at zero: 0 / 0 counts as no update)
        np.testing.assert_allclose(
            d.tensor_relative[p], d.tensor_delta[p] / np.sqrt(np.sum(x * x)), rtol=1e-5, err_msg=p
        )
      else:
        assert d.tensor_relative[p] == 0.0, p
    else:
      assert d.tensor_delta[p] == 0.0, p
  assert d.layer_relative["layers/1"] == pytest.approx(SCALE - 1, rel=1e-5)
  assert d.layer_relative["layers/0"] == d.layer_relative["embed"] == 0.0
  # the update measured from the other side is relative to step 2's (larger) norm
  assert ins.diff(ckpt, 2, 1).layer_relative["layers/1"] == pytest.approx((SCALE - 1) / SCALE, rel=1e-5)


# ---- the run's model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
  """A `model.vocab="task"` run: its task_vocab.json and one checkpoint of the tiny preset with
  the vocabulary's 128 embedding rows, meta with the run config (no config.json) -> (workdir, cfg, tok)."""
  from ict_jax import task_vocab

  workdir = str(tmp_path_factory.mktemp("task_run"))
  cfg = config_lib.validate(configs.chain_config())
  tok = task_vocab.build(["3+1+4=", "3+1=4,4+4=8;\\boxed{8}"])
  tok.save(workdir)
  mcfg = Qwen2Config.preset("tiny", vocab_size=task_vocab.model_vocab_size(tok.vocab_size))
  with Checkpointer(workdir, async_save=False) as ck:
    ck.save(
        1, {"state": {"params": _params_of(mcfg)}}, {"data_position": 0, "config": config_lib.to_dict(cfg)}, force=True
    )
  return workdir, cfg, tok


def test_model_config_from_checkpoint_is_setup_model_config(run, task_run, tmp_path):
  """The one rule (the trainer's): the saved config through `setup.model_config`, a task
  vocabulary's rows from the workdir's task_vocab.json; the reader's model is it, shape-checked."""
  import shutil

  from ict_jax import setup
  from ict_jax.config import ConfigError

  mesh = run["mesh"]
  qwen = setup.model_config_from_checkpoint(run["workdir"], mesh=mesh)  # the config from the meta
  assert (
      qwen
      == setup.model_config(run["cfg"], "", mesh)
      == setup.model_config_from_checkpoint(run["workdir"], step=1, mesh=mesh)
  )
  assert qwen.vocab_size == 151936
  with ins.open_checkpoint(run["workdir"]) as c:
    assert c.model_config == setup.model_config_from_checkpoint(run["workdir"]) == run["mcfg"]

  workdir, cfg, tok = task_run
  task = setup.model_config_from_checkpoint(workdir, mesh=mesh)
  assert task == setup.model_config(cfg, "", mesh, tok) and task.vocab_size == 128
  assert setup.model_config_from_checkpoint(workdir, config=cfg, mesh=mesh, tokenizer=tok) == task
  with ins.open_checkpoint(workdir) as c:
    assert c.model_config == setup.model_config_from_checkpoint(workdir)
    assert c.model_config.rope_theta == 10000.0  # the tiny preset's, not a Qwen default
    assert c.load_params()["embed"]["embedding"].shape == (128, 64)
  # the checkpoints copied without their task_vocab.json: the rule cannot size the model; the
  # reader still reads it, the run's preset with the saved embedding's rows
  elsewhere = tmp_path / "copy"
  shutil.copytree(os.path.join(workdir, "checkpoints"), elsewhere / "checkpoints")
  with pytest.raises(ConfigError, match="model.vocab='task'.*has no task_vocab.json"):
    setup.model_config_from_checkpoint(elsewhere)
  with ins.open_checkpoint(elsewhere) as c:
    assert c.model_config == setup.model_config_from_checkpoint(workdir)


# ---- Hugging Face export ---------------------------------------------------------------------------
def test_to_hf_round_trip_with_transformers(ckpt, run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = ins.to_hf(ckpt, tmp_path / "hf", step=2, mesh=run["mesh"])
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  ids = np.array([[9707, 0, 220, 16, 488, 220, 16, 284, 220, 17]], np.int64)
  with torch.no_grad():
    want = hf(torch.tensor(ids)).logits.numpy()
  model = ckpt.restore_model(step=2)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32)))
  chex.assert_trees_all_close(got, want, atol=2e-4, rtol=1e-4)
  # and the exported weights are the saved ones (layer 1 scaled at step 2)
  sd = hf.state_dict()
  q = run["params"][2]["layers"]["attn"]["q_proj"]["kernel"][1]  # [D, N, H] -> HF [N*H, D]
  np.testing.assert_allclose(
      sd["model.layers.1.self_attn.q_proj.weight"].numpy(), q.reshape(q.shape[0], -1).T, rtol=1e-6
  )


def test_export_cli(run, tmp_path, capsys):
  from safetensors.numpy import load_file
  from ict_jax import export

  assert (
      export.main(
          [
              "--workdir",
              run["workdir"],
              "--step",
              "1",
              "--out",
              str(tmp_path / "a"),
              "--dtype",
              "bfloat16",
              "--mesh",
              "1,-1,1",
          ]
      )
      == 0
  )
  assert "wrote step 1" in capsys.readouterr().out
  tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
  emb = run["params"][1]["embed"]["embedding"]
  got = tensors["model.embed_tokens.weight"]
  assert got.dtype.name == "bfloat16"
  np.testing.assert_allclose(got.astype(np.float32), emb, rtol=1e-2, atol=1e-3)
  assert (tmp_path / "a" / "config.json").exists()
  assert export.main(["--workdir", run["workdir"], "--step", "9", "--out", str(tmp_path / "b")]) == 2
  assert "available steps: [1, 2]" in capsys.readouterr().err


def test_old_per_layer_checkpoint_layout_is_one_clear_error():
  """Checkpoints written before the scanned layers held layers/<i>/...; say so, not 'missing'."""
  old = {
      p: None
      for p in (
          "embed/embedding",
          "layers/0/attn/q_proj/kernel",
          "layers/0/attn/k_proj/kernel",
          "layers/0/mlp/gate_proj/kernel",
          "final_norm/scale",
      )
  }
  with pytest.raises(CheckpointError, match=r"ckpt/2: saved with one tensor per decoder layer \(layers/0/\.\.\.\)"):
    reader._shape_dims(old, "ckpt/2")
