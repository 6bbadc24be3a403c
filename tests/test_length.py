"""No wasted length: the step on the trimmed batch equals the step on the padded one, only a few
widths compile, and prefill attends over the prompt only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ict_jax import sampling
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.config import OptimConfig
from ict_jax.models.qwen2 import init_model
from tiny import step_config as tiny_step_config
from tiny import tiny_config

G, N, V = 4, 8, 128
CFG = tiny_config(V, max_position_embeddings=128)
LENGTHS = np.array([11, 7, 3, 9, 1, 5, 10, 6])  # longest 11 -> bucket 16


def padded_batch(p_pad: int, c_width: int, seed=0):
  """Prompts of 3..6 tokens left-padded to 6 + p_pad, completions right-padded to c_width."""
  rng = np.random.default_rng(seed)
  p = 6 + p_pad
  plen = np.repeat([6, 3], G)
  pmask = (np.arange(p)[None] >= p - plen[:, None]).astype(np.int32)
  pids = (rng.integers(1, V, (N, p)) * pmask).astype(np.int32)
  cmask = (np.arange(c_width)[None] < LENGTHS[:, None]).astype(np.int32)
  cids = (rng.integers(1, V, (N, c_width)) * cmask).astype(np.int32)
  adv = np.tile([1.0, -0.5, 0.7, -1.2], N // G).astype(np.float32)
  return TrainBatch(prompt_ids=pids, prompt_mask=pmask, completion_ids=cids, completion_mask=cmask, advantages=adv)


def make_step(method, loss_type):
  graphdef, state = nnx.split(init_model(CFG, seed=0))
  # b1 = 0: Adam's first moment is the gradient
  opt = ts.make_optimizer(OptimConfig(learning_rate=1e-3, b1=0.0, max_grad_norm=0.0), 10)
  cfg = tiny_step_config(
      group_size=G,
      method=method,
      loss_type=loss_type,
      warmup_steps=0,
      chunk_size=8,
      micro_batch_size=G,
      temperature=0.7,
      max_completion_length=64,
  )
  step = ts.make_train_step(graphdef, cfg, opt, donate=False)
  return step, ts.init_train_state(state.to_pure_dict(), opt)


@pytest.mark.parametrize("method,loss_type", [("ict", "grpo"), ("grpo", "dr_grpo")])
def test_trimmed_batch_gives_the_padded_batch_results(method, loss_type):
  step, state = make_step(method, loss_type)
  big = padded_batch(p_pad=13, c_width=64)
  small = big.trim()
  assert small.completion_ids.shape == (N, 16) and small.prompt_ids.shape == (N, 16)
  s_big, m_big, lp_big = step(state, big)
  s_small, m_small, lp_small = step(state, small)
  for k in m_big:
    np.testing.assert_allclose(m_small[k], m_big[k], rtol=2e-6, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(np.asarray(lp_small), np.asarray(lp_big)[:, :16], rtol=1e-6, atol=1e-6)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  for a, b in zip(jax.tree.leaves(mu(s_small)), jax.tree.leaves(mu(s_big))):
    b = np.asarray(b)  # float rounding only: summation order differs with the width
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
  if method == "ict":
    assert 0 < float(m_big["selected_frac"]) < 1


def test_trim_keeps_old_logp_aligned_and_what_is_not_padding():
  big = padded_batch(p_pad=0, c_width=64)
  big = big.replace(old_logp=np.arange(N * 64, dtype=np.float32).reshape(N, 64))
  small = big.trim()
  np.testing.assert_array_equal(small.old_logp, big.old_logp[:, :16])
  np.testing.assert_array_equal(small.prompt_ids, big.prompt_ids)  # 6 <= bucket 16
  np.testing.assert_array_equal(small.advantages, big.advantages)
  narrow = padded_batch(p_pad=0, c_width=12)  # never wider than given
  assert narrow.trim().completion_ids.shape == (N, 12)
  longest = int(np.asarray(big.completion_mask).sum(axis=1).max())  # the rollout's gathered max
  told = big.trim(completion_len=longest)  # the mask is not read
  assert jax.tree.all(jax.tree.map(np.array_equal, told, small))


def test_few_widths_compile():
  """Every longest completion 1..2048 maps to one of 8 widths; the jitted step compiles once a
  width, not once a length."""
  widths = set()
  for longest in range(1, 2049):
    cmask = np.zeros((1, 2048), np.int32)
    cmask[0, :longest] = 1
    b = TrainBatch(
        prompt_ids=np.ones((1, 4), np.int32),
        prompt_mask=np.ones((1, 4), np.int32),
        completion_ids=cmask,
        completion_mask=cmask,
        advantages=np.zeros(1, np.float32),
    )
    width = b.trim().completion_ids.shape[1]
    assert width >= longest
    widths.add(width)
  assert widths == {16, 32, 64, 128, 256, 512, 1024, 2048}

  step, state = make_step("ict", "grpo")
  for longest in (3, 9, 16, 17, 30):
    b = padded_batch(p_pad=0, c_width=64)
    b.completion_mask[:, longest:] = 0
    b.completion_mask[0, :longest] = 1
    step(state, b.trim())
  assert step._cache_size() == 2  # widths 16 and 32


def _score_shapes(jaxpr, *, into_while: bool = True) -> set[tuple[int, ...]]:
  """Shapes of the 5-D dot_general outputs (attention scores [B, K, G, T, S]) anywhere in the
  jaxpr: inside the scanned decoder layer too, and inside while loops unless `into_while` is
  False (the sampler's decode steps live in one)."""
  shapes = set()
  for eq in jaxpr.eqns:
    if eq.primitive.name == "dot_general":
      shapes |= {tuple(v.aval.shape) for v in eq.outvars if len(v.aval.shape) == 5}
    if eq.primitive.name == "while" and not into_while:
      continue
    for sub in jax.core.jaxprs_in_params(eq.params):
      shapes |= _score_shapes(sub, into_while=into_while)
  return shapes


def test_prefill_attends_over_the_prompt_only():
  """prefill=True gives the hidden states and cache of the full-cache prefill, and its attention
  scores are [.., P, P], not [.., P, P + max_new_tokens]."""
  model = init_model(dataclasses.replace(CFG), seed=1)
  b, p, extra = 4, 8, 40  # S = 48: no other dimension has that size
  rng = np.random.default_rng(0)
  mask = (np.arange(p)[None] >= np.array([0, 3, 5, 2])[:, None]).astype(np.int32)
  ids = jnp.asarray(rng.integers(1, V, (b, p)) * mask, jnp.int32)
  mask = jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
  kv_mask = jnp.concatenate([mask, jnp.ones((b, extra), jnp.int32)], 1)

  def run(prefill):
    cache = model.init_cache(b, p + extra)
    kw = dict(prefill=True) if prefill else dict(kv_mask=kv_mask)
    return model.hidden_states(ids, mask, positions=positions, cache=cache, cache_index=jnp.int32(0), **kw)

  (h_full, c_full), (h_pre, c_pre) = run(False), run(True)
  real = np.asarray(mask, bool)  # padding queries see no key: their (unused) values differ
  np.testing.assert_allclose(np.asarray(h_pre)[real], np.asarray(h_full)[real], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      np.asarray(h_pre)[real], np.asarray(model.hidden_states(ids, mask))[real], rtol=1e-5, atol=1e-6
  )
  for a, c in zip(jax.tree.leaves(c_pre), jax.tree.leaves(c_full)):  # [L, B, K, S, H]
    a, c = (np.moveaxis(np.asarray(x)[:, :, :, :p], 3, 2) for x in (a, c))  # [L, B, P, K, H]
    np.testing.assert_allclose(a[:, real], c[:, real], rtol=1e-5, atol=1e-6)

  def score_shapes(prefill):  # shapes of the attention scores [B, K, G, T, S] in the jaxpr
    return _score_shapes(jax.make_jaxpr(lambda: run(prefill)[0])().jaxpr)

  assert any(p + extra in shape for shape in score_shapes(False))
  assert not any(p + extra in shape for shape in score_shapes(True))


def test_generate_uses_the_prompt_only_prefill():
  model = init_model(CFG, seed=1)
  ids = np.random.default_rng(0).integers(1, V, (2, 5)).astype(np.int32)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(
      lambda s: sampling.sample_fn(graphdef, s, ids, np.ones_like(ids), jax.random.key(0), max_new_tokens=32)
  )(state)
  # outside the while loop: the prefill (the decode steps, [.., 1, P + N], are inside it)
  shapes = _score_shapes(jaxpr.jaxpr, into_while=False)
  assert shapes and not any(5 + 32 in s for s in shapes)  # no prompt x (prompt + new) scores
