"""Qwen2 port: logits equal transformers' `Qwen2ForCausalLM`, HF folders load and save, sizes."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ict_jax import load_pretrained, save_pretrained, sharding  # noqa: E402
from ict_jax.models.config import Qwen2Config  # noqa: E402


def _hf_model(tmp_path, *, tied, heads=4, kv_heads=2, name="m", vocab=128, layers=2):
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=vocab,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=layers,
      num_attention_heads=heads,
      num_key_value_heads=kv_heads,
      tie_word_embeddings=tied,
      rope_theta=10000.0,
      rms_norm_eps=1e-6,
      max_position_embeddings=256,
  )
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():  # non-trivial norms and biases too
      p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.shape[0] == 32 else 0.0))
  path = os.path.join(tmp_path, name)
  model.save_pretrained(path)
  return model, path


def _left_padded(vocab, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, (3, 9))
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  mask[1, :1] = 0
  ids[mask == 0] = 0
  return ids, mask


def _ref_logits(model, ids, mask):
  with torch.no_grad():
    return model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


@pytest.mark.parametrize("tied,heads,kv_heads", [(True, 4, 2), (False, 4, 2), (False, 4, 1), (True, 4, 4)])
def test_logits_match_transformers_left_padded(tmp_path, tied, heads, kv_heads):
  hf, path = _hf_model(tmp_path, tied=tied, heads=heads, kv_heads=kv_heads)
  ids, mask = _left_padded(128)
  ref = _ref_logits(hf, ids, mask)
  model = load_pretrained(path, dtype=jnp.float32)
  assert model.cfg.tie_word_embeddings == tied
  out = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  valid = mask == 1
  err = np.abs(out - ref)[valid].max() / np.abs(ref[valid]).max()
  assert err < 1e-4, err


def test_left_padding_does_not_change_real_token_logits(tmp_path):
  _, path = _hf_model(tmp_path, tied=True)
  model = load_pretrained(path)
  ids = np.array([[5, 6, 7, 8]])
  padded = np.array([[0, 0, 5, 6, 7, 8]])
  mask = np.array([[0, 0, 1, 1, 1, 1]])
  a = np.asarray(model(jnp.asarray(ids)))
  b = np.asarray(model(jnp.asarray(padded), jnp.asarray(mask)))[:, 2:]
  np.testing.assert_allclose(a, b, atol=1e-5)


def test_save_pretrained_round_trips_to_transformers_exactly(tmp_path):
  hf, path = _hf_model(tmp_path, tied=False)
  model = load_pretrained(path)
  out = os.path.join(tmp_path, "out")
  save_pretrained(model, out)
  back = transformers.AutoModelForCausalLM.from_pretrained(out)
  ref_sd, got_sd = hf.state_dict(), back.state_dict()
  assert set(ref_sd) == set(got_sd)
  for k in ref_sd:
    assert torch.equal(ref_sd[k], got_sd[k]), k


def test_sharded_index_folder_and_mesh_placement(tmp_path):
  hf, path = _hf_model(tmp_path, tied=False)
  model = load_pretrained(path)
  out = os.path.join(tmp_path, "sharded")
  save_pretrained(model, out, max_shard_bytes=20_000)  # forces several files + index
  files = sorted(os.listdir(out))
  assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 1
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  sharded = load_pretrained(out, mesh=mesh)
  q = sharded.layers.attn.q_proj["kernel"][...]  # [L, D, N, H], stacked layers
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  ids, mask = _left_padded(128)
  with jax.set_mesh(mesh):
    got = np.asarray(jax.jit(lambda i, m: sharded(i, m))(jnp.asarray(ids), jnp.asarray(mask)))
  ref = _ref_logits(hf, ids, mask)
  np.testing.assert_allclose(got[mask == 1], ref[mask == 1], rtol=1e-4, atol=1e-4)


def test_bfloat16_compute_is_close(tmp_path):
  hf, path = _hf_model(tmp_path, tied=True)
  ids, mask = _left_padded(128)
  model = load_pretrained(path, dtype=jnp.bfloat16)
  chex.assert_type(model.embed["embedding"][...], jnp.bfloat16)
  out = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  ref = _ref_logits(hf, ids, mask)
  err = np.abs(out - ref)[mask == 1].max() / np.abs(ref[mask == 1]).max()
  assert err < 5e-2, err


# ---- bad input: one clear error naming the file and tensor ------------------------------------
def _corrupt(tmp_path, fn):
  _, path = _hf_model(tmp_path, tied=True)
  fn(path)
  return path


def _rewrite(path, mutate):
  from safetensors.numpy import load_file, save_file

  f = os.path.join(path, "model.safetensors")
  tensors = load_file(f)
  mutate(tensors)
  save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
  path = _corrupt(tmp_path, lambda p: _rewrite(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_pretrained(path)


def test_extra_tensor_is_named(tmp_path):
  path = _corrupt(tmp_path, lambda p: _rewrite(p, lambda t: t.update({"model.layers.9.foo": np.ones(3, np.float32)})))
  with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.9\.foo"):
    load_pretrained(path)


def test_wrong_shape_is_named(tmp_path):
  def mutate(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 31), np.float32)

  path = _corrupt(tmp_path, lambda p: _rewrite(p, mutate))
  with pytest.raises(
      ValueError,
      match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(8, 31\), expected \(16, 32\)",
  ):
    load_pretrained(path)


def test_unsupported_model_type(tmp_path):
  def fn(p):
    cfg = json.load(open(os.path.join(p, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(p, "config.json"), "w"))

  path = _corrupt(tmp_path, fn)
  with pytest.raises(ValueError, match=r"config\.json: unsupported model_type 'llama'"):
    load_pretrained(path)


def test_bad_config_json(tmp_path):
  path = _corrupt(tmp_path, lambda p: open(os.path.join(p, "config.json"), "w").write("{not json"))
  with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
    load_pretrained(path)


def test_truncated_safetensors(tmp_path):
  def fn(p):
    f = os.path.join(p, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])

  path = _corrupt(tmp_path, fn)
  with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
    load_pretrained(path)


# ---- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,count", [("qwen2_5_0_5b", 494_032_768), ("qwen2_5_1_5b", 1_543_714_304), ("qwen2_5_7b", 7_615_616_512)]
)
def test_published_parameter_counts(name, count):
  cfg = Qwen2Config.preset(name)
  assert cfg.num_params() == count
  from ict_jax.models.qwen2 import abstract_model
  from flax import nnx

  abstract = abstract_model(cfg)  # shapes only, no memory
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == count


def test_parameter_count_matches_transformers_meta_model():
  cfg = Qwen2Config.preset("qwen2_5_0_5b")
  with torch.device("meta"):
    hf = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
        )
    )
  assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()


def test_every_parameter_has_logical_axes():
  from flax import nnx
  from ict_jax.models.qwen2 import abstract_model

  for path, var in nnx.to_flat_state(nnx.state(abstract_model(Qwen2Config.preset("tiny")), nnx.Param)):
    axes = var.get_metadata().get("axes")
    assert axes is not None and len(axes) == len(var.get_value().shape), path


# ---- scanned layers, remat policies ------------------------------------------------------------
def _small(**kw):
  return Qwen2Config(
      vocab_size=128,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=2,
      rope_theta=10000.0,
      **kw,
  )


def _loss_and_grads(cfg, ids, mask):
  from flax import nnx
  from ict_jax.models.qwen2 import init_model

  graphdef, params = nnx.split(init_model(cfg, seed=1), nnx.Param)

  def loss(params):
    logits = nnx.merge(graphdef, params)(ids, mask)  # [B, T, V]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * mask)

  return jax.jit(jax.value_and_grad(loss))(params)


def test_layers_are_stacked_with_a_layers_axis():
  from flax import nnx
  from ict_jax.models.qwen2 import abstract_model

  flat = nnx.to_flat_state(nnx.state(abstract_model(_small()), nnx.Param))
  stacked = [(path, var) for path, var in flat if path[0] == "layers"]
  assert len(stacked) == 12  # 2 norms + q/k/v kernels and biases + o + 3 MLP, once each
  for path, var in stacked:  # [L, ...] with the logical axis "layers" first, no per-layer index
    assert var.get_value().shape[0] == 3 and var.get_metadata()["axes"][0] == "layers", path
    assert not any(isinstance(k, int) for k in path), path


@pytest.mark.parametrize("policy", ["full", "minimal"])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
  ids, mask = _left_padded(128)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  loss0, g0 = _loss_and_grads(_small(), ids, mask)
  loss1, g1 = _loss_and_grads(_small(remat_policy=policy), ids, mask)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-7)


def test_bad_remat_policy_is_one_clear_error():
  with pytest.raises(ValueError, match=r"remat_policy: expected one of \('none', 'full', 'minimal'\), got 'True'"):
    _small(remat_policy="True")
