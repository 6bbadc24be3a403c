"""Float32 master weights, Adam moments and gradient sums under bfloat16 compute.

Several train steps with bfloat16 compute (model.dtype) are compared with the same steps in
float32: the parameter change (not just the loss) must agree, nearly every weight must move at
lr 1e-6, and the state must stay float32. A bfloat16 copy of the weights, by contrast, loses
almost every such update (checked directly with numpy), which is why training refuses it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from ict_jax import config as config_lib
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.config import OptimConfig
from ict_jax.models.qwen2 import init_model
from tiny import step_config as tiny_step_config
from tiny import tiny_config

G, N, P, C, V = 4, 8, 4, 12, 128
LR = 1e-6
STEPS = 3
CFG = tiny_config(V)


def batch():
  rng = np.random.default_rng(0)
  lengths = np.array([12, 7, 3, 9, 12, 5, 10, 1])
  cmask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
  prompt = np.repeat(rng.integers(1, V, (N // G, P)), G, 0).astype(np.int32)
  adv = np.tile([1.0, -0.5, 0.7, -1.2], N // G).astype(np.float32)
  return TrainBatch(
      prompt_ids=prompt,
      prompt_mask=np.ones((N, P), np.int32),
      completion_ids=(rng.integers(1, V, (N, C)) * cmask).astype(np.int32),
      completion_mask=cmask,
      advantages=adv,
  )


def run(dtype: str):
  """STEPS GRPO steps from the same float32 weights with compute in `dtype` -> (p0, p, state)."""
  graphdef, state = nnx.split(init_model(dataclasses.replace(CFG, dtype=dtype), seed=0))
  params = state.to_pure_dict()
  opt = ts.make_optimizer(OptimConfig(learning_rate=LR, max_grad_norm=0.0), total_steps=10)
  step = ts.make_train_step(
      graphdef, tiny_step_config(group_size=G, method="grpo", chunk_size=4, micro_batch_size=G), opt, donate=False
  )
  st = ts.init_train_state(params, opt)
  for _ in range(STEPS):
    st, metrics, _ = step(st, batch())
    assert int(metrics["skipped"]) == 0
  return params, st.params, st


def test_bf16_compute_updates_like_float32_reference():
  p0, p32, _ = run("float32")
  p0b, p16, st16 = run("bfloat16")
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p0b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same starting weights
  for leaf in jax.tree.leaves((st16.params, st16.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  d32 = flat(p32) - flat(p0)
  d16 = flat(p16) - flat(p0)
  moving = np.abs(d32) > 0.5 * LR  # Adam moves (almost) every weight by ~lr a step
  assert moving.mean() > 0.95
  # with float32 master weights the bf16-compute run moves the same weights...
  assert (np.abs(d16[moving]) > 0.5 * LR).mean() > 0.99
  # ...by about the same amount: Adam's direction depends on the gradient's sign and scale, which
  # bf16 compute perturbs by ~1% (a few tiny entries may flip)
  cos = d16 @ d32 / np.linalg.norm(d16) / np.linalg.norm(d32)
  assert cos > 0.95, cos
  np.testing.assert_allclose(np.linalg.norm(d16), np.linalg.norm(d32), rtol=0.05)
  # the updates land: no step rounds away (each is ~lr; float32 resolves it at these magnitudes)
  np.testing.assert_allclose(np.abs(d32[moving]).mean(), STEPS * LR, rtol=0.3)


def test_bf16_weights_would_lose_the_updates():
  """What the float32 master copy prevents: the same update applied to bf16 weights."""
  p0, p32, _ = run("float32")
  w0, w1 = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(t)]) for t in (p0, p32))
  bf = jnp.bfloat16
  kept = np.asarray(jnp.asarray(w0, bf) + jnp.asarray(w1 - w0, bf) != jnp.asarray(w0, bf))
  nonzero = np.abs(w0) > 1e-3
  assert kept[nonzero].mean() < 0.05


def test_training_refuses_non_float32_parameters():
  cd = config_lib.default_config()
  cd.model.param_dtype = "bfloat16"
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.param_dtype: .*float32"):
    config_lib.validate(cd)
  cd.model.param_dtype, cd.model.dtype = "float32", "bfloat16"
  assert config_lib.validate(cd).model.dtype == "bfloat16"


def test_step_refuses_bf16_parameters():
  graphdef, state = nnx.split(init_model(dataclasses.replace(CFG, param_dtype="bfloat16"), seed=0))
  opt = ts.make_optimizer(OptimConfig(), total_steps=10)
  step = ts.make_train_step(graphdef, tiny_step_config(group_size=G, method="grpo"), opt, donate=False)
  with pytest.raises(ValueError, match="float32 master weights"):
    step(ts.init_train_state(state.to_pure_dict(), opt), batch())
