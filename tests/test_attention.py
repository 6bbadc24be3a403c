"""Attention implementations against the einsum reference: values and gradients on real tokens,
GQA, left- and right-padded rows; "auto" resolved once in set-up; the splash kernel in the Pallas
interpreter (CPU) and compiled for a TPU v5e topology this machine does not have (libtpu); the
cudnn formulation (rotated rows, sequence lengths) through XLA, and its cuDNN call traced, with
cuDNN's layout checks, in the train step, scoring and the sampler's prefill (cuDNN's version
probe stubbed: this machine has no cuDNN library); packed rows as cuDNN's ragged runs, traced."""

import os
import subprocess
import sys
import textwrap
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused
from compilers import LIBS_DIR, SKIP_REASON, libtpu_found

from ict_jax import config as config_lib
from ict_jax import configs
from ict_jax import sampling, setup, sharding
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.models import attention as attn
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(b, t, n, k, h, seed=0):
  """q [B,T,N,H], k/v [B,T,K,H] and segment ids: row 0 left-padded (a prompt), row 1
  right-padded (a short completion), the rest full."""
  rng = np.random.RandomState(seed)
  q, kk, v = (jnp.asarray(rng.randn(b, t, heads, h), jnp.float32) for heads in (n, k, k))
  seg = np.ones((b, t), np.int32)
  seg[0, : t // 3] = 0
  seg[1, t - t // 4 :] = 0
  return q, kk, v, jnp.asarray(seg)


def _loss(fn, seg):
  """A scalar of the real tokens' outputs only (padding rows are never read by a loss)."""
  w = jnp.asarray(np.random.RandomState(1).randn(*seg.shape, 1, 1), jnp.float32)
  return lambda q, k, v: jnp.sum(jnp.where(seg[..., None, None] > 0, fn(q, k, v, seg) * w, 0.0) ** 2)


def _check_parity(fn, q, k, v, seg, *, atol):
  ref, got = attn.einsum_attention(q, k, v, seg), fn(q, k, v, seg)
  real = np.asarray(seg) > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], atol=atol, rtol=atol)
  g_ref = jax.grad(_loss(attn.einsum_attention, seg), argnums=(0, 1, 2))(q, k, v)
  g_got = jax.grad(_loss(fn, seg), argnums=(0, 1, 2))(q, k, v)
  chex.assert_trees_all_close(g_got, g_ref, atol=atol * 10, rtol=atol * 10)


@pytest.mark.parametrize("n,k", [(4, 2), (4, 1), (4, 4)])
def test_dot_product_matches_einsum(n, k):
  q, kk, v, seg = _qkv(3, 24, n, k, 16)
  _check_parity(attn.dot_product_attention, q, kk, v, seg, atol=1e-5)


def _mixed_rows(b, t, n, k, h, seed=0):
  """q, k, v and segment ids of the rows the callers pass: a left-padded prompt (the prefill), a
  right-padded warm-start row, a left-padded prompt + right-padded completion (the train step,
  scoring), a full row and a padding-only row."""
  q, kk, v, _ = _qkv(b, t, n, k, h, seed)
  seg = np.ones((b, t), np.int32)
  seg[0, :5] = 0
  seg[1, t - 7 :] = 0
  seg[2, :3], seg[2, t - 4 :] = 0, 0
  seg[4] = 0
  return q, kk, v, jnp.asarray(seg)


@pytest.mark.parametrize("n,k", [(4, 2), (4, 1)])
def test_seq_lengths_formulation_matches_einsum(n, k):
  """cudnn's formulation (each row rotated so its real tokens start at 0, PADDING_CAUSAL lengths)
  run through XLA's implementation of the same jax.nn call: values and gradients on real tokens."""
  q, kk, v, seg = _mixed_rows(5, 24, n, k, 16)
  fn = lambda q, k, v, s: attn.seq_lengths_attention(q, k, v, s, implementation="xla")
  _check_parity(fn, q, kk, v, seg, atol=1e-5)
  out = np.asarray(fn(q, kk, v, seg))
  assert np.all(out[np.asarray(seg) == 0] == 0) and np.isfinite(out).all()  # padding: zeros


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4), (2, 2, 2)])
def test_seq_lengths_formulation_under_a_mesh(mesh_shape):
  """Rows over data x fsdp, heads over tensor; with tensor 4 the 2 KV heads do not split like the
  4 query heads, so they are repeated (cuDNN's partitioner needs q, k, v sharded alike)."""
  q, kk, v, seg = _mixed_rows(8, 24, 4, 2, 16)
  seg = seg.at[5:].set(seg[:3])
  with jax.set_mesh(sharding.make_mesh(mesh_shape)):
    got = jax.jit(lambda *a: attn.seq_lengths_attention(*a, implementation="xla"))(q, kk, v, seg)
  real = np.asarray(seg) > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(attn.einsum_attention(q, kk, v, seg))[real], atol=1e-5)


def test_cudnn_takes_float32_through_xla():
  q, kk, v, seg = _mixed_rows(5, 24, 4, 2, 16)
  got = attn.attend(q, kk, v, seg, "cudnn")  # float32: cuDNN has no kernel; XLA, same call
  real = np.asarray(seg) > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(attn.einsum_attention(q, kk, v, seg))[real], atol=1e-5)


@pytest.fixture
def cudnn_probe(monkeypatch):
  """JAX asks the cuDNN library for its version while tracing cuDNN attention (then runs the
  layout checks); this machine has no cuDNN, so the probe answers 9.12."""
  monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91200)


def _cudnn_calls(jaxpr) -> set[str]:
  text = str(jaxpr)
  return {name for name in ("dot_product_attention_fwd", "dot_product_attention_bwd") if name in text}


def test_cudnn_rejects_the_key_mask_but_takes_the_sequence_lengths(cudnn_probe):
  """What broke every GPU run: a [B, 1, 1, S] key mask is refused at trace time; the rotated
  rows with sequence lengths trace (forward and backward) in bfloat16."""
  q, kk, v, seg = _mixed_rows(5, 32, 4, 2, 16)
  q, kk, v = (x.astype(jnp.bfloat16) for x in (q, kk, v))
  with pytest.raises(ValueError, match="Bias must have same seq length as QKV"):
    jax.make_jaxpr(lambda *a: attn.dot_product_attention(*a, implementation="cudnn"))(q, kk, v, seg)
  loss = lambda q, k, v: jnp.sum(attn.attend(q, k, v, seg, "cudnn").astype(jnp.float32) ** 2)
  assert _cudnn_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kk, v)) == {
      "dot_product_attention_fwd",
      "dot_product_attention_bwd",
  }


def _cudnn_model():
  cfg = _small(dtype="bfloat16", attention="cudnn", hidden_size=64)  # head_dim 16: a multiple of 8
  return cfg, nnx.split(init_model(cfg, seed=0), nnx.Param)


def _rollout_batch(rows=4, prompt=8, completion=8):
  rng = np.random.RandomState(0)
  pmask = (np.arange(prompt)[None] >= np.array([3, 0, 5, 2])[:, None]).astype(np.int32)  # left-padded
  cmask = (np.arange(completion)[None] < np.array([8, 2, 5, 0])[:, None]).astype(np.int32)  # right-padded
  return TrainBatch(
      prompt_ids=jnp.asarray(rng.randint(1, 128, (rows, prompt)) * pmask, jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.randint(1, 128, (rows, completion)) * cmask, jnp.int32),
      completion_mask=jnp.asarray(cmask),
      advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32),
  )


def test_cudnn_traces_in_the_train_step_and_scoring(cudnn_probe):
  """The train step (`make_train_step`, a micro-batch of one group) and scoring
  (`completion_logp_and_stats`, what the token view calls) with model.attention=cudnn in
  bfloat16 over left-padded prompts and right-padded completions: cuDNN's checks pass."""
  _, (graphdef, params) = _cudnn_model()
  batch = _rollout_batch()
  optimizer = ts.make_optimizer(config_lib.OptimConfig(), total_steps=4)
  step = ts.make_train_step(graphdef, ts.StepConfig(group_size=2, micro_batch_size=2), optimizer, donate=False)
  state = ts.init_train_state(params, optimizer, step=0)
  assert _cudnn_calls(step.trace(state, batch, None).jaxpr) == {
      "dot_product_attention_fwd",
      "dot_product_attention_bwd",
  }
  score = lambda p: ts.completion_logp_and_stats(nnx.merge(graphdef, p), batch, temperature=1.0, group_size=2)
  assert "dot_product_attention_fwd" in _cudnn_calls(jax.make_jaxpr(score)(params))


def test_cudnn_traces_in_the_samplers_prefill(cudnn_probe):
  """The sampler's program (`lower_generate`, as ict_jax.aot compiles it) with the bfloat16
  rollout copy: tracing passes cuDNN's checks; only lowering for this CPU has no rule for cuDNN's
  custom call (ict_jax.aot compiles it for a GPU target: tests/test_aot.py)."""
  cfg, _ = _cudnn_model()
  policy = sampling.abstract_rollout_policy(cfg, dtype="bfloat16")
  with pytest.raises(NotImplementedError, match="dot_product_attention_fwd.* not found for platform cpu"):
    sampling.lower_generate(policy, 4, 8, 8)


# ---- packed rows on cuDNN: its sequence packing (ragged offsets and lengths) ---------------------
PACKED_IDS = np.array(
    [
        [1, 1, 1, 2, 2, 2, 2, 3, 0, 0, 0, 0],  # three sequences, then padding
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # one sequence filling the row
        [1, 1, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0],  # sequence 2 has no real token (an empty slot)
        [0] * 12,  # a padding-only row
    ],
    np.int32,
)


def _runs_mask(lengths, offsets, t):
  """[B, T, T]: what cuDNN's sequence packing with PADDING_CAUSAL lets query t see, from its
  ragged form alone: key s of the same run m, s <= t (offsets[b, m] <= s <= t < offsets[b, m] +
  lengths[b, m]); runs with length -1 are absent."""
  pos = np.arange(t)
  allowed = np.zeros((len(lengths), t, t), bool)
  for b, m in zip(*np.nonzero(lengths >= 0)):
    inside = (pos >= offsets[b, m]) & (pos < offsets[b, m] + lengths[b, m])
    allowed[b] |= inside[:, None] & inside[None, :] & (pos[None, :] <= pos[:, None])
  return allowed


def test_segment_runs_give_cudnn_the_packed_rows_block_mask():
  """`segment_runs` (ids -> cuDNN's lengths [B, M] and offsets [B, M + 1]) describes exactly the
  block-causal mask the other implementations apply to packed rows, on every real query; a
  sequence without tokens and the rows' ends are -1."""
  lengths, offsets = (np.asarray(x) for x in attn.segment_runs(jnp.asarray(PACKED_IDS), 3))
  np.testing.assert_array_equal(lengths, [[3, 4, 1], [12, -1, -1], [2, -1, 4], [-1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 7, -1], [0, -1, -1, -1], [0, -1, 2, -1], [-1, -1, -1, -1]])
  want = np.asarray(attn._allowed(jnp.asarray(PACKED_IDS), True))
  real = PACKED_IDS > 0
  np.testing.assert_array_equal(_runs_mask(lengths, offsets, 12)[real], want[real])


@pytest.fixture
def hopper_probe(cudnn_probe, monkeypatch):
  """The compute-capability probes JAX asks while tracing cuDNN's sequence packing (there is no
  local GPU) answer for an H100 (9.0)."""
  capability = lambda c: tuple(int(x) for x in c.split("."))
  monkeypatch.setattr(cudnn_fused, "check_compute_capability", lambda c: (9, 0) >= capability(c))
  monkeypatch.setattr(cudnn_fused, "is_cuda_compute_capability_equal", lambda c: (9, 0) == capability(c))


def _packed_cudnn_grads(ids, max_segments):
  rng = np.random.RandomState(0)
  b, t = ids.shape
  q, kk, v = (jnp.asarray(rng.randn(b, t, heads, 16), jnp.bfloat16) for heads in (4, 2, 2))
  seg = attn.PackedSegments(jnp.asarray(ids), max_segments)
  loss = lambda q, k, v: jnp.sum(attn.attend(q, k, v, seg, "cudnn").astype(jnp.float32) ** 2)
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kk, v)


def test_packed_rows_trace_into_cudnns_sequence_packing(hopper_probe, monkeypatch):
  """bfloat16 packed rows on "cudnn": the forward and backward cuDNN calls take the runs (lengths
  [B, M] and offsets [B, M + 1], M = max_segments), JAX's checks for packing pass on Hopper, and
  before Hopper JAX refuses the packed layout (what `check_packing_attention` says at start-up)."""
  jaxpr = _packed_cudnn_grads(PACKED_IDS, 3)
  assert _cudnn_calls(jaxpr) == {"dot_product_attention_fwd", "dot_product_attention_bwd"}
  text = str(jaxpr)
  assert "i32[4,3]" in text and "i32[4,4]" in text  # the lengths and the offsets of 4 rows x 3 runs
  monkeypatch.setattr(cudnn_fused, "check_compute_capability", lambda c: False)  # an A100
  with pytest.raises(NotImplementedError, match="Packed layout requires a GPU with at least Hopper"):
    _packed_cudnn_grads(PACKED_IDS, 3)


def test_packing_with_cudnn_before_hopper_is_one_config_error():
  a100, h100 = (
      types.SimpleNamespace(device_kind=k, compute_capability=c) for k, c in (("A100", "8.0"), ("H100", "9.0"))
  )
  with pytest.raises(
      config_lib.ConfigError, match=r"train.token_budget: .* 'cudnn' .* >= 9.0 \(Hopper\); A100 has 8.0. Run the padded"
  ):
    config_lib.check_packing_attention("cudnn", [a100])
  config_lib.check_packing_attention("cudnn", [h100])
  config_lib.check_packing_attention("splash", [a100])  # only cuDNN's packing needs Hopper


def test_splash_kernel_in_interpreter_matches_einsum():
  q, k, v, seg = _qkv(2, 128, 4, 2, 16)  # 128: the kernel's smallest tile (TPU lane width)
  fn = lambda q, k, v, s: attn.splash_attention(q, k, v, s, interpret=True)
  _check_parity(fn, q, k, v, seg, atol=2e-5)


def test_splash_under_a_mesh_runs_per_shard():
  q, k, v, seg = _qkv(4, 128, 4, 2, 16)
  mesh = sharding.make_mesh((2, 2, 2))  # rows over data x fsdp, KV heads over tensor
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: attn.splash_attention(*a, interpret=True))(q, k, v, seg)
  real = np.asarray(seg) > 0
  ref = attn.einsum_attention(q, k, v, seg)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], atol=2e-5)


def test_splash_pads_lengths_off_the_lane_width():
  q, k, v, seg = _qkv(2, 100, 4, 2, 16)  # padded to 128 inside, sliced back
  got = attn.splash_attention(q, k, v, seg, interpret=True)
  assert got.shape == q.shape
  real = np.asarray(seg) > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(attn.einsum_attention(q, k, v, seg))[real], atol=2e-5)


def _small(**kw):
  dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  return Qwen2Config(vocab_size=128, rope_theta=10000.0, **{**dims, **kw})


def test_model_with_dot_product_attention_matches_einsum():
  ids = np.random.RandomState(0).randint(0, 128, (3, 12))
  mask = np.ones_like(ids)
  mask[0, :5] = 0  # left padding
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)

  def run(cfg):
    graphdef, params = nnx.split(init_model(cfg, seed=2), nnx.Param)
    f = lambda p: nnx.merge(graphdef, p)(ids, mask)
    loss = lambda p: jnp.sum(jnp.where(mask[..., None] > 0, jax.nn.log_softmax(f(p)), 0.0)[..., 7])
    return f(params), jax.grad(loss)(params)

  (l0, g0), (l1, g1) = run(_small()), run(_small(attention="dot_product"))
  real = np.asarray(mask) > 0
  np.testing.assert_allclose(np.asarray(l1)[real], np.asarray(l0)[real], atol=1e-5)
  chex.assert_trees_all_close(g1, g0, atol=1e-6, rtol=1e-5)


def test_auto_is_resolved_in_setup_from_the_mesh_devices():
  c = configs.tiny_config()
  assert c.model.attention == "auto"
  cfg = config_lib.validate(c)
  assert setup.model_config(cfg, "", sharding.make_mesh((1, -1, 1))).attention == "einsum"  # CPU
  assert setup.resolve_attention("dot_product") == "dot_product"
  gpu = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))  # a GPU mesh
  assert setup.resolve_attention("auto", gpu, "bfloat16") == "cudnn"
  assert setup.resolve_attention("auto", gpu, "float32") == "dot_product"  # cuDNN: 16-bit only
  c.model.attention = "cudnn"
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.attention: 'cudnn' .* float16/bfloat16"):
    config_lib.validate(c)  # model.dtype float32
  c.model.dtype = "bfloat16"
  assert config_lib.validate(c).model.attention == "cudnn"
  c.model.attention = "flash"
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.attention: expected one of"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match=r"Qwen2Config\.attention: expected one of"):
    _small(attention="auto")  # the model takes a concrete choice only


_TPU_COMPILE = textwrap.dedent("""
  import os, sys
  sys.path.insert(0, sys.argv[1])
  import libtpu
  os.environ.update(TPU_LIBRARY_PATH=libtpu.get_library_path(), TPU_SKIP_MDS_QUERY="1",
                    TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                    TPU_ACCELERATOR_TYPE="v5litepod-4", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  import jax, jax.numpy as jnp
  from jax.experimental import topologies
  from flax import nnx
  from ict_jax import config as config_lib, configs, setup, sharding
  from ict_jax.models.config import Qwen2Config
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2",
                                      chip_config_name="default", chips_per_host_bounds=(2, 2, 1),
                                      num_slices=1)
  mesh = sharding.make_mesh((1, 2, 2), devices=list(topo.devices))
  c = configs.tiny_config()
  mcfg = setup.model_config(config_lib.validate(c), "", mesh)
  assert mcfg.attention == "splash", mcfg.attention  # auto on TPU devices
  mcfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16",
                     attention=mcfg.attention, remat_policy="full")
  graphdef, params, _ = setup.abstract_params(mcfg, mesh)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=rows)
  def loss(p, ids):
    h = nnx.merge(graphdef, p).hidden_states(ids, (ids > 0).astype(jnp.int32))
    return jnp.mean(h.astype(jnp.float32) ** 2)
  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, ids)
  text = lowered.as_text()
  assert "tpu_custom_call" in text or "splash" in text, "no Pallas kernel in the lowered step"
  compiled = lowered.compile()
  print("compiled", compiled.memory_analysis().temp_size_in_bytes)
""")


@pytest.mark.skipif(not libtpu_found(), reason=SKIP_REASON)
def test_splash_model_compiles_for_a_tpu_topology(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, "-c", _TPU_COMPILE, LIBS_DIR],
      env=env,
      cwd=str(tmp_path),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "compiled" in proc.stdout
