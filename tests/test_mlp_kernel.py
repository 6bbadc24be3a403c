"""The fused decode MLP (models/mlp_kernel.py) in the Pallas interpreter: against numpy on one
device and per chip on the 8-device mesh (its partial sums reduce-scattered to the rows' shards),
and the split-MLP decode of the model with it against the XLA path. Its TPU compile and bytes are
checked in test_decode_weights (libtpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ict_jax import sampling, sharding
from ict_jax.models import mlp_kernel
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model


def _numpy_mlp(x, scale, gate, up, down):
  """float64 silu(xs @ gate) * (xs @ up) @ down, xs = scale * x: x [N, D]."""
  x, scale, gate, up, down = (np.asarray(a, np.float64) for a in (x, scale, gate, up, down))
  x = x * scale
  g = x @ gate
  return (g / (1 + np.exp(-g)) * (x @ up)) @ down


def _inputs(b, d, f, dtype, seed=0):
  """x [b, 1, d], the norm scale [d], gate / up [d, f], down [f, d]."""
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (b, 1, d), jnp.float32)
  scale = 1 + 0.5 * jax.random.normal(keys[1], (d,), jnp.float32)
  w = [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]) for k, s in zip(keys[2:], [(d, f), (d, f), (f, d)])]
  return [a.astype(dtype) for a in (x, scale, *w)]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_fused_mlp_matches_numpy_on_one_device(dtype, tol):
  """40 rows: 5 grid steps of 8 rows (the largest multiple of 8 dividing them), D 64, F 96; one
  layer's weights, and layer 1 of two stacked."""
  x, scale, gate, up, down = _inputs(40, 64, 96, dtype)
  got = mlp_kernel.decode_mlp(x, scale, gate, up, down, interpret=True)
  assert got.shape == x.shape and got.dtype == x.dtype
  want = _numpy_mlp(x[:, 0], scale, gate, up, down)
  np.testing.assert_allclose(np.asarray(got[:, 0], np.float64), want, rtol=tol, atol=tol)
  # the layers stacked, [L, ...]: layer 1 read in place by the index maps, as the decoder calls it
  _, *other = _inputs(40, 64, 96, dtype, seed=5)
  stacked = [jnp.stack([a, b]) for a, b in zip(other, (scale, gate, up, down))]
  got = jax.jit(lambda x, *w: mlp_kernel.decode_mlp(x, *w, jnp.int32(1), interpret=True))(x, *stacked)
  np.testing.assert_allclose(np.asarray(got[:, 0], np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_fused_mlp_per_chip_reduce_scatters_the_partial_sums(mesh_shape):
  """On the 8-device mesh, F split over every chip: each chip's partial sums of all 64 rows,
  reduce-scattered to the rows' ("data", "fsdp") shards and summed over "tensor", equal numpy's
  MLP of the whole weights, and the rows come out sharded as "act_batch" says."""
  mesh = sharding.make_mesh(mesh_shape)
  x, scale, gate, up, down = _inputs(64, 64, 128, jnp.float32, seed=1)
  split = ("data", "fsdp", "tensor")
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = put(x, P()), put(scale, P()), put(gate, P(None, split)), put(up, P(None, split)), put(down, P(split, None))
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: mlp_kernel.decode_mlp(*a, interpret=True))(*args)
  data, fsdp, _ = mesh_shape
  assert got.sharding.shard_shape(got.shape)[0] == 64 // (data * fsdp)  # rows over ("data", "fsdp")
  want = _numpy_mlp(x[:, 0], scale, gate, up, down)
  np.testing.assert_allclose(np.asarray(got[:, 0], np.float64), want, rtol=1e-5, atol=1e-5)


def test_fits_counts_a_chips_share_of_the_weights():
  """Qwen2.5-1.5B's MLP (1,536 x 8,960) on 8 chips fits the kernel's VMEM in bf16; 7B's
  (3,584 x 18,944) does not, and neither does 1.5B's on one chip."""
  mesh = sharding.make_mesh((1, 8, 1))
  with jax.set_mesh(mesh):
    assert mlp_kernel.fits(1536, 8960, 2)
    assert not mlp_kernel.fits(3584, 18944, 2)
  assert not mlp_kernel.fits(1536, 8960, 2)


@pytest.mark.parametrize("weights", ["mlp", "tensor"])
def test_split_mlp_decode_with_the_kernels_samples_the_xla_paths_tokens(weights):
  """A small Qwen2 on the (1, 8, 1) mesh, its rollout copy's MLP split over the chips: greedy
  decoding with the TPU kernels in the interpreter (decode_attention "pallas_interpret": the fused
  attention and MLP) gives the XLA path's tokens, and log-probs within float rounding."""
  mesh = sharding.make_mesh((1, 8, 1))
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 256, (4, 7)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, :3] = mask[3, :5] = 0
  kw = dict(
      max_new_tokens=12, temperature=0.0, eos_token_ids=(), pad_id=0, num_samples=2, mesh=mesh, return_logprobs=True
  )
  out = {}
  for attn in ("xla", "pallas_interpret"):
    cfg = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, decode_attention=attn,
    )  # fmt: skip
    model = init_model(cfg, seed=3)
    with jax.set_mesh(mesh):
      policy = sampling.make_rollout_policy(
          *nnx.split(model)[:1], nnx.state(model, nnx.Param).to_pure_dict(), mesh=mesh, weights=weights
      )
    out[attn] = [np.asarray(a) for a in sampling.generate(policy, ids * mask, mask, **kw)]
  np.testing.assert_array_equal(out["pallas_interpret"][0], out["xla"][0])
  np.testing.assert_allclose(out["pallas_interpret"][2], out["xla"][2], atol=1e-4)
