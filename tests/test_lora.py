"""LoRA by qwix (`ict_jax/lora.py`): the adapted forward is the base plus alpha / rank * x.A.B on
each chosen projection (a numpy reference built from the weights), only the adapters train."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import lora
from ict_jax.models import qwen2
from ict_jax.models.config import Qwen2Config

CFG = Qwen2Config.preset(
    "tiny",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
RANK, ALPHA = 4, 8.0


def _np_rms(x, scale, eps):
  return scale * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _np_rope(x, pos, theta):  # x [T, N, H]
  h = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
  emb = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
  rot = np.concatenate([-x[..., h // 2 :], x[..., : h // 2]], -1)
  return x * np.cos(emb) + rot * np.sin(emb)


def _np_hidden(p, ids, cfg, w):
  """Qwen2's final hidden states for one row in numpy, each projection's weight given by `w`."""
  x = p["embed"]["embedding"][ids]
  t = len(ids)
  pos = np.arange(t)
  n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  for l in range(cfg.num_hidden_layers):
    lay = p["layers"]
    a = _np_rms(x, lay["input_norm"]["scale"][l], cfg.rms_norm_eps)
    q = np.einsum("td,dnh->tnh", a, w("attn", "q_proj", l)) + lay["attn"]["q_proj"]["bias"][l]
    kk = np.einsum("td,dkh->tkh", a, w("attn", "k_proj", l)) + lay["attn"]["k_proj"]["bias"][l]
    v = np.einsum("td,dkh->tkh", a, w("attn", "v_proj", l)) + lay["attn"]["v_proj"]["bias"][l]
    q, kk = _np_rope(q, pos, cfg.rope_theta), _np_rope(kk, pos, cfg.rope_theta)
    kk, v = np.repeat(kk, n // k, 1), np.repeat(v, n // k, 1)
    s = np.einsum("tnh,snh->nts", q, kk) / np.sqrt(h) + np.where(np.tri(t) > 0, 0.0, -1e30)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    x = x + np.einsum("tnh,nhd->td", np.einsum("nts,snh->tnh", s, v), w("attn", "o_proj", l))
    m = _np_rms(x, lay["post_attn_norm"]["scale"][l], cfg.rms_norm_eps)
    g, u = m @ w("mlp", "gate_proj", l), m @ w("mlp", "up_proj", l)
    x = x + (g / (1 + np.exp(-g)) * u) @ w("mlp", "down_proj", l)
  return _np_rms(x, p["final_norm"]["scale"], cfg.rms_norm_eps)


def _randomised(model):
  """The adapters' B drawn too (qwix starts it at zero, which would hide a wrong A.B)."""
  graphdef, adapters, base = lora.split(model)
  keys = iter(jax.random.split(jax.random.key(7), 64))
  adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
  return graphdef, adapters, base


@pytest.mark.parametrize("modules", [lora.DEFAULT_MODULES, "q_proj,down_proj", ".*/attn/(k|v)_proj"])
def test_lora_forward_is_base_plus_scaled_ba(modules):
  model = lora.apply(qwen2.init_model(CFG, 0), RANK, ALPHA, modules, seed=1)
  graphdef, adapters, base = _randomised(model)
  ids = np.array([3, 5, 7, 9, 11, 2])
  h = nnx.merge(graphdef, lora.join(base, adapters)).hidden_states(jnp.asarray(ids)[None])[0]
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), base)
  ad = jax.tree.map(lambda x: np.asarray(x, np.float64), adapters)
  pattern = lora.module_pattern(modules)
  import re

  def weight(part, proj, l):
    kern = p["layers"][part][proj]["kernel"][l]
    if not re.fullmatch(pattern, f"layers/{part}/{proj}"):
      assert proj not in ad["layers"].get(part, {})
      return kern
    a = ad["layers"][part][proj]["kernel_lora_a"][l]  # [contracted..., r]
    b = ad["layers"][part][proj]["kernel_lora_b"][l]  # [r, rest...]
    ab = np.tensordot(a, b, axes=([-1], [0]))  # the kernel's layout: contracted dims first
    return kern + ALPHA / RANK * ab

  ref = _np_hidden(p, ids, CFG, weight)
  np.testing.assert_allclose(np.asarray(h), ref, rtol=2e-4, atol=2e-4)
  base_only = _np_hidden(p, ids, CFG, lambda part, proj, l: p["layers"][part][proj]["kernel"][l])
  assert np.abs(ref - base_only).max() > 1e-2  # the adapters changed the output
  # the merged plain model (the rollout's weights) computes the same
  plain = qwen2.init_model(CFG, 5)
  state = nnx.state(plain, nnx.Param)
  nnx.replace_by_pure_dict(state, lora.merged(nnx.merge(graphdef, lora.join(base, adapters))))
  nnx.update(plain, state)
  np.testing.assert_allclose(np.asarray(plain.hidden_states(jnp.asarray(ids)[None])[0]), ref, rtol=2e-4, atol=2e-4)


def test_lora_starts_at_base_and_base_gets_no_gradient():
  base_model = qwen2.init_model(CFG, 0)
  model = lora.apply(base_model, RANK, ALPHA, seed=1)
  graphdef, adapters, base = lora.split(model)
  ids = jnp.array([[3, 5, 7, 9]])
  np.testing.assert_array_equal(model.hidden_states(ids), base_model.hidden_states(ids))  # B = 0
  graphdef, adapters, base = _randomised(model)

  def loss(adapters, base):  # as the train step: the base frozen
    m = nnx.merge(graphdef, lora.join(jax.lax.stop_gradient(base), adapters))
    return jnp.sum(m.hidden_states(ids) ** 2)

  g_adapters, g_base = jax.jit(jax.grad(loss, argnums=(0, 1)))(adapters, base)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(g_base))
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_adapters))
  n = CFG.num_hidden_layers
  shapes = jax.tree.map(lambda x: x.shape, adapters["layers"]["attn"]["q_proj"])
  assert shapes == {"kernel_lora_a": (n, 32, RANK), "kernel_lora_b": (n, RANK, 4, 8)}
  assert "embed" not in adapters and "lm_head" not in adapters


@pytest.mark.parametrize("bad", ["q_proj,lm_head", "embed.*", "(("])
def test_lora_modules_rejected(bad):
  with pytest.raises(ValueError):
    lora.module_pattern(bad)


def test_adapted_model_computes_in_bfloat16():
  """The adapters are float32 (AdamW's moments follow them); `lora.merge` casts them to the compute
  dtype, without which qwix's x.A.B (float32) would break the layer scan's bf16 carry."""
  ids = jnp.array([[3, 5, 7, 9]])
  out = {}
  for dtype in ("float32", "bfloat16"):
    model = lora.apply(qwen2.init_model(CFG.replace(dtype=dtype), 0), RANK, ALPHA, seed=1)
    graphdef, adapters, base = _randomised(model)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    out[dtype] = lora.merge(graphdef, lora.join(base, adapters)).hidden_states(ids)
  assert out["bfloat16"].dtype == jnp.bfloat16
  want = np.asarray(out["float32"])
  np.testing.assert_allclose(np.asarray(out["bfloat16"], np.float32), want, atol=0.05 * np.abs(want).max())


# ---- a LoRA run's checkpoint read back: export, eval and inspect merge its adapters ----------------
SEED = 3  # the run's train.seed: a run from random weights froze the seed's


def _lora_checkpoint(workdir, **overrides):
  """A checkpoint as a LoRA run of the tiny preset saves it (`TrainState.saved`): state.params the
  adapters (B drawn, not qwix's zeros) with their AdamW state, no base; the run from random
  weights (model.path "", no warm start). -> (graphdef, base, adapters) of the adapted model."""
  import optax

  from ict_jax import config as config_lib
  from ict_jax import configs, setup, sharding
  from ict_jax import train_step as ts
  from ict_jax.checkpoint import Checkpointer

  c = configs.tiny_config()
  c.model.lora_rank, c.model.lora_alpha, c.model.lora_modules = RANK, ALPHA, "q_proj,v_proj,down_proj"
  c.warm_start.sft_steps, c.train.seed = 0, SEED
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  cfg = config_lib.validate(c)
  mcfg = setup.model_config(cfg, "")
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  base = setup.init_params(mcfg, SEED, mesh, setup.abstract_params(mcfg, mesh)[2])  # as the learner draws it
  plain = nnx.merge(nnx.graphdef(qwen2.abstract_model(mcfg)), base)
  graphdef, adapters, base = _randomised(lora.apply(plain, RANK, ALPHA, cfg.model.lora_modules, seed=1))
  state = ts.SavedState(step=jnp.int32(2), params=adapters, opt_state=optax.adamw(1e-3).init(adapters))
  with Checkpointer(workdir, async_save=False) as ck:
    ck.save(2, {"state": state}, {"data_position": 0, "config": config_lib.to_dict(cfg)}, force=True)
  return graphdef, base, adapters


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lora_run"))
  return (workdir, *_lora_checkpoint(workdir))


IDS = np.array([[151644, 872, 198, 18, 10, 20, 28, 151645, 198]])  # "<|im_start|>user\n3+5=<|im_end|>\n"


def _adapted_logits(graphdef, base, adapters):
  """The reference: qwix's adapted forward (each projection + alpha / r x.A.B), not merged weights."""
  return np.asarray(lora.merge(graphdef, lora.join(base, adapters))(jnp.asarray(IDS)), np.float32)


def test_export_of_a_lora_run_merges_its_adapters(lora_run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from safetensors import safe_open

  from ict_jax.export import main as export_main

  workdir, graphdef, base, adapters = lora_run
  out = str(tmp_path / "merged")
  assert export_main(["--workdir", workdir, "--out", out, "--dtype", "float32"]) == 0
  with safe_open(f"{out}/model.safetensors", "np") as f:  # a plain Qwen2 checkpoint
    assert not [k for k in f.keys() if "lora" in k]
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    got = hf(torch.tensor(IDS)).logits.float().numpy()
  want = _adapted_logits(graphdef, base, adapters)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
  plain = nnx.merge(nnx.graphdef(qwen2.abstract_model(Qwen2Config.preset("tiny"))), base)
  assert np.abs(np.asarray(plain(jnp.asarray(IDS))) - want).max() > 1e-2  # the adapters are in it


def test_eval_and_inspect_read_a_lora_run_merged(lora_run):
  from ict_jax import inspect as ins
  from ict_jax.eval.loading import load_workdir

  workdir, graphdef, base, adapters = lora_run
  want = _adapted_logits(graphdef, base, adapters)
  loaded, _ = load_workdir(workdir)
  np.testing.assert_allclose(np.asarray(loaded.model(jnp.asarray(IDS))), want, atol=2e-5, rtol=1e-5)
  with ins.open_checkpoint(workdir) as ckpt:
    assert all("_lora_" in p for p in ckpt.tensors())  # the checkpoint holds the adapters alone
    model = ckpt.restore_model()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), want, atol=2e-5, rtol=1e-5)


def test_export_of_a_warm_started_lora_run_from_random_weights_is_one_error(tmp_path, capsys):
  """Its base (the warm start's weights) is in no file: one line saying so, exit 2."""
  from ict_jax.export import main as export_main

  workdir = str(tmp_path / "run")
  _lora_checkpoint(workdir, **{"warm_start.sft_steps": 5})
  assert export_main(["--workdir", workdir, "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "warm_start.sft_steps" in err and "model.lora_rank" in err, err


@pytest.mark.parametrize(
    "arg,needle",
    [
        ("--config.model.lora_rank=-1", "config.model.lora_rank: expected >= 0, got -1"),
        ("--config.model.lora_modules=q_proj,lm_head", "config.model.lora_modules: unknown projection 'lm_head'"),
    ],
)
def test_bad_lora_keys_are_one_config_error(arg, needle, tmp_path):
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-m", "ict_jax.train", f"--workdir={tmp_path}/w", arg],
      cwd=repo,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith(f"ict_jax.train: error: {needle}"), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(f"{tmp_path}/w/checkpoints")


# ---- training: the adapters train, the checkpoint holds them, a resume continues bit-identically ----
def _quick_lora(steps=4):
  """test_train's quick run (the tiny preset, a short warm start, small batches) with LoRA."""
  from ict_jax import configs

  c = configs.tiny_config()
  c.warm_start.sft_steps = 20
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
  c.train.steps, c.train.checkpoint_every, c.train.eval_every = steps, 2, 0
  c.train.async_checkpointing = False
  c.model.lora_rank, c.model.lora_alpha = RANK, ALPHA
  return c


def _saved_state(workdir, step):
  from ict_jax.checkpoint import CheckpointReader

  with CheckpointReader.of_workdir(workdir) as reader:
    md = reader.state_metadata(step)
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
        md,
    )
    return md, reader.restore_state(step, target)


def test_lora_resume_continues_bit_identically_and_saves_no_base(tmp_path):
  from ict_jax.logs import read_log
  from ict_jax.train import train

  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  train(_quick_lora(), full, progress=False)
  train(_quick_lora(steps=2), part, progress=False)
  resumed = train(_quick_lora(), part, progress=False)  # the base reloaded, the adapters restored
  assert [r["step"] for r in resumed] == [3, 4]
  a, b = read_log(full, "metrics"), read_log(part, "metrics")
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  for ra, rb in zip(a, b):
    for key in ("reward_mean", "entropy", "loss", "grad_norm", "js_selected", "response_len"):
      assert rb[key] == ra[key] or (np.isnan(ra[key]) and np.isnan(rb[key])), (ra["step"], key, ra[key], rb[key])
  md, want = _saved_state(full, 4)
  _, got = _saved_state(part, 4)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=jax.tree_util.keystr(path))
  # the checkpoint: the adapters, their AdamW moments, the step; no base weight
  assert set(md["state"]) == {"step", "params", "opt_state"}
  params = jax.tree_util.tree_leaves_with_path(md["state"]["params"])
  assert params and all(jax.tree_util.keystr(p).endswith(("kernel_lora_a']", "kernel_lora_b']")) for p, _ in params)
  assert "embed" not in md["state"]["params"]
  trained_b = [x for p, x in jax.tree_util.tree_leaves_with_path(got["state"]["params"]) if "lora_b" in str(p)]
  assert trained_b and all(np.abs(np.asarray(x)).max() > 0 for x in trained_b)  # B starts at 0: it trained


LORA_RISE_STEPS = 60


def test_lora_reward_rises(tmp_path):
  """RL with adapters raises the reward as full fine-tuning does: the tiny preset's one-step
  addition (its task vocabulary, the 200-step warm start), every step dense (`ict.method=grpo`:
  on this task the decisive token is the first, which ICT's sparse phase cannot move), LoRA
  rank 16, alpha 32 on all seven projections at lr 2e-3; the mean training reward of the last
  fifth of the 60 steps against the first fifth's. On the 2-core AMD EPYC box (2026-12-07) this
  run rose 0.129 -> 0.158 (+0.029, fifths 0.129 / 0.134 / 0.145 / 0.156 / 0.158; 120 steps:
  0.132 -> 0.166), full fine-tuning of the same run at its lr 5e-4 0.123 -> 0.137 (+0.014), LoRA
  at lr 5e-3 +0.010 (benchmarks/RESULTS.md, "LoRA"); the bound is half the measured rise."""
  from ict_jax import configs
  from ict_jax.logs import read_log
  from ict_jax.train import train

  c = configs.tiny_config()
  c.model.vocab, c.ict.method = "task", "grpo"
  c.train.steps, c.train.checkpoint_every, c.train.eval_every = LORA_RISE_STEPS, LORA_RISE_STEPS, 0
  c.train.async_checkpointing = False
  c.model.lora_rank, c.model.lora_alpha, c.optim.learning_rate = 16, 32.0, 2e-3
  train(c, str(tmp_path / "run"), progress=False)
  rewards = np.array([r["reward_mean"] for r in read_log(str(tmp_path / "run"), "metrics")])
  assert len(rewards) == LORA_RISE_STEPS
  fifth = LORA_RISE_STEPS // 5
  rise = rewards[-fifth:].mean() - rewards[:fifth].mean()
  assert rise > 0.015, (rise, rewards.round(3).tolist())
