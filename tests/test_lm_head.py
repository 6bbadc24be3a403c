"""The fused LM head's custom VJP (dense and sparse-row backward) against plain autodiff."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax import lm_head, selection

N, C, D, V, G = 8, 11, 16, 97, 4
TEMP = 0.7


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(N, C, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
  ids = jnp.asarray(rng.integers(0, V, size=(N, C)), jnp.int32)
  mask = np.ones((N, C), np.float32)
  mask[1, 7:] = 0
  mask[6, 3:] = 0
  return h, w, ids, jnp.asarray(mask)


def plain_logp(h, w, ids):
  """Unfused reference: full logits, log_softmax, gather (differentiated by JAX)."""
  logits = jnp.einsum("NCD,DV->NCV", h, w) / TEMP
  return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[..., None], -1)[..., 0]


def grads(fn, g, h, w):
  return jax.jit(jax.grad(lambda h, w: jnp.sum(g * fn(h, w)), argnums=(0, 1)))(h, w)


def cotangent(nonzero: int, seed=1):
  """g [N, C] with `nonzero` non-zero entries at random positions (values of both signs)."""
  rng = np.random.default_rng(seed)
  g = np.zeros(N * C, np.float32)
  pos = rng.choice(N * C, size=nonzero, replace=False)
  g[pos] = rng.normal(size=nonzero)
  return jnp.asarray(g.reshape(N, C))


@pytest.mark.parametrize("chunk", [3, 4, C])  # 3 and 4 do not divide C = 11
@pytest.mark.parametrize(
    "nonzero,grad_rows",
    [
        (9, 12),  # sparse path: 9 rows <= capacity 12
        (12, 12),  # exactly at capacity
        (30, 12),  # overflow: dense fallback
        (N * C, 0),  # dense only (GRPO)
    ],
)
def test_gradients_equal_autodiff(chunk, nonzero, grad_rows):
  h, w, ids, mask = inputs()
  g = cotangent(nonzero)

  def fused(h, w):
    return lm_head.logp_and_stats(
        h, w, ids, mask, temperature=TEMP, group_size=G, chunk_size=chunk, grad_rows=grad_rows
    )[0]

  got = grads(fused, g, h, w)
  want = grads(lambda h, w: plain_logp(h, w, ids), g, h, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # rows without gradient get exactly zero
  dh = np.asarray(got[0])
  assert np.all(dh[np.asarray(g) == 0] == 0)


@pytest.mark.parametrize("grad_rows", [12, 0])
def test_vocab_major_weight_gives_the_same_values_and_gradients(grad_rows):
  """A tied embedding is passed as stored, [V, D]: same log-probs, stats and (transposed) dW."""
  h, w, ids, mask = inputs(5)
  g = cotangent(9)
  kw = dict(temperature=TEMP, group_size=G, chunk_size=4, grad_rows=grad_rows)
  dv = lambda h, w: lm_head.logp_and_stats(h, w, ids, mask, **kw)
  vd = lambda h, e: lm_head.logp_and_stats(h, e, ids, mask, vocab_major=True, **kw)
  (lp1, st1), (lp2, st2) = jax.jit(dv)(h, w), jax.jit(vd)(h, w.T)
  np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp1), rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(st2, st1, atol=1e-5)
  (dh1, dw1), (dh2, de2) = grads(lambda h, w: dv(h, w)[0], g, h, w), grads(lambda h, e: vd(h, e)[0], g, h, w.T)
  np.testing.assert_allclose(np.asarray(dh2), np.asarray(dh1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(de2).T, np.asarray(dw1), rtol=1e-5, atol=1e-6)


def test_forward_values_and_stats():
  h, w, ids, mask = inputs(3)
  logp, stats = jax.jit(
      lambda h, w: lm_head.logp_and_stats(h, w, ids, mask, temperature=TEMP, group_size=G, chunk_size=4, grad_rows=10)
  )(h, w)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(plain_logp(h, w, ids)), atol=1e-5)
  logits = jnp.einsum("NCD,DV->NCV", h, w) / TEMP
  ref = selection.sequence_stats(logits, mask, G, chunk_size=C)
  for name in ("entropy", "renyi2", "js"):
    np.testing.assert_allclose(np.asarray(stats[name]), np.asarray(ref[name]), atol=1e-5)


@pytest.mark.parametrize("fraction,size", [(0.2, 12), (0.0, 5), (1.0, 60), (0.1, 130), (0.5, 3)])
def test_compact_equals_nonzero(fraction, size):
  """The sparse backward's row compaction: the indices of jnp.nonzero(size=, fill_value=0)
  (numpy's flatnonzero, truncated or zero-padded) and each position's count of earlier rows."""
  nz = np.random.default_rng(5).random(1000 if size == 130 else 50) < fraction
  idx, slot = jax.jit(lm_head._compact, static_argnums=1)(jnp.asarray(nz), size)
  want = np.zeros(size, np.int64)
  found = np.flatnonzero(nz)[:size]
  want[: found.size] = found
  np.testing.assert_array_equal(np.asarray(idx), want)
  np.testing.assert_array_equal(np.asarray(slot), np.cumsum(nz) - nz)


def test_sparse_capacity_bounds_ict_selection():
  """ICT keeps ceil(f * len_i) tokens per response: rows * ceil(f * C) bounds it exactly."""
  assert lm_head.sparse_grad_rows("ict", 0.1, 0.2, rows=8, length=192) == 8 * 20
  assert lm_head.sparse_grad_rows("ict", 0.1, 0.2, rows=3, length=30) == 3 * 3
  assert lm_head.sparse_grad_rows("entropy", 0.1, 0.2, rows=8, length=192) == 308
  assert lm_head.sparse_grad_rows("grpo", 0.1, 0.2, rows=8, length=192) == 0
  assert lm_head.sparse_grad_rows("stapo", 0.1, 0.2, rows=8, length=192) == 0
  u = jnp.asarray(np.random.default_rng(0).random((8, 192)), jnp.float32)
  lengths = np.random.default_rng(1).integers(1, 193, size=8)
  valid = jnp.asarray(np.arange(192)[None] < lengths[:, None])
  kept = selection.ict_mask(u, valid, 0.1)
  assert int(kept.sum()) <= lm_head.sparse_grad_rows("ict", 0.1, 0.2, rows=8, length=192)


def test_non_finite_cotangent_propagates():
  """NaN gradients (e.g. NaN advantages) must reach the parameters so the step is skipped."""
  h, w, ids, mask = inputs()
  g = cotangent(5).at[0, 0].set(jnp.nan)
  dh, dw = grads(
      lambda h, w: lm_head.logp_and_stats(h, w, ids, mask, temperature=TEMP, group_size=G, chunk_size=4, grad_rows=12)[
          0
      ],
      g,
      h,
      w,
  )
  assert not np.isfinite(np.asarray(dw)).all()


def test_bfloat16_inputs_give_bfloat16_gradients_close_to_float32():
  h, w, ids, mask = inputs(4)
  g = cotangent(9)
  fn = lambda h, w: lm_head.logp_and_stats(h, w, ids, mask, temperature=TEMP, group_size=G, chunk_size=4, grad_rows=12)[
      0
  ]
  dh16, dw16 = grads(fn, g, h.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  assert dh16.dtype == dw16.dtype == jnp.bfloat16
  dh, dw = grads(lambda h, w: plain_logp(h, w, ids), g, h, w)
  for a, b in ((dh16, dh), (dw16, dw)):
    a, b = np.asarray(a, np.float32), np.asarray(b)
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()
