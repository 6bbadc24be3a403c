"""selection.py against numpy/scipy loops (and TRL's entropy helpers when installed)."""

from __future__ import annotations

import functools
import math
import types
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from scipy.spatial.distance import jensenshannon

from ict_jax import selection, token_masks
from ict_jax.config import IctConfig

js_scores = jax.jit(selection.js_scores, static_argnames=("group_size", "chunk_size"))
token_stats = jax.jit(selection.token_stats, static_argnames=("chunk_size",))
ict_mask = jax.jit(selection.ict_mask, static_argnames=("top_fraction",))
entropy_mask = jax.jit(selection.entropy_mask, static_argnames=("top_fraction",))
stapo_mask = jax.jit(selection.stapo_mask, static_argnames=("tau_p", "tau_h_quantile"))
masked_quantile = jax.jit(selection.masked_quantile, static_argnames=("q",))


# ----------------------------------------------------------------------------- numpy reference
def np_softmax(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def np_js(logits, mask, g):
  p = np_softmax(logits)
  n, t, _ = p.shape
  u = np.zeros((n, t))
  for grp in range(n // g):
    rows = range(grp * g, grp * g + g)
    for pos in range(t):
      active = [j for j in rows if mask[j, pos]]
      if not active:
        continue
      big_p = np.mean([p[j, pos] for j in active], axis=0)
      for i in active:
        u[i, pos] = jensenshannon(p[i, pos], big_p, base=np.e) ** 2
  return u


def ceil_frac(f, n):
  return math.ceil(Fraction(str(f)) * n)


def np_ict(u, mask, f):
  out = np.zeros(mask.shape, bool)
  for i in range(mask.shape[0]):
    valid = [t for t in range(mask.shape[1]) if mask[i, t]]
    if not valid:
      continue
    k = max(1, ceil_frac(f, len(valid)))
    for t in sorted(valid, key=lambda t: (-u[i, t], t))[:k]:
      out[i, t] = True
  return out


def np_entropy_mask(h, mask, f):
  flat_h, flat_m = h.reshape(-1), mask.reshape(-1).astype(bool)
  valid = [i for i in range(flat_h.size) if flat_m[i]]
  out = np.zeros(flat_h.size, bool)
  for i in sorted(valid, key=lambda i: (-flat_h[i], i))[: ceil_frac(f, len(valid))]:
    out[i] = True
  return out.reshape(h.shape)


def grouped_batch(seed, n=8, t=10, v=16, g=4):
  """Logits with some -inf vocab entries, unequal lengths within groups (one empty row)."""
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(n, t, v)) * 2.0).astype(np.float32)
  logits[1, :, -3:] = -np.inf  # masked vocabulary: 0 log 0 must be 0
  logits[5, 2] = logits[4, 2]  # identical rows at one position
  lengths = rng.integers(1, t + 1, size=n)
  lengths[2], lengths[6], lengths[0] = 0, t, 1
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  return logits, mask


# ----------------------------------------------------------------------------- logits stats
def test_entropy_and_renyi2_match_numpy():
  logits, mask = grouped_batch(0)
  p = np_softmax(logits)
  with np.errstate(divide="ignore", invalid="ignore"):
    h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
  h2 = -np.log((p**2).sum(-1))
  for chunk in (3, 10, 128):
    stats = token_stats(jnp.asarray(logits), chunk_size=chunk)
    np.testing.assert_allclose(np.asarray(stats["entropy"]), h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["renyi2"]), h2, rtol=1e-5, atol=1e-5)
  masked = token_stats(jnp.asarray(logits), jnp.asarray(mask), chunk_size=4)
  np.testing.assert_allclose(np.asarray(masked["entropy"]), h * mask, rtol=1e-5, atol=1e-5)
  assert np.all(h2 <= h + 1e-9)  # Renyi-2 never exceeds Shannon entropy


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 128])
def test_js_scores_match_scipy(chunk):
  logits, mask = grouped_batch(1)
  want = np_js(logits, mask, 4)
  u = np.asarray(js_scores(jnp.asarray(logits), jnp.asarray(mask), 4, chunk_size=chunk))
  np.testing.assert_allclose(u, want, atol=2e-6, rtol=1e-4)
  assert np.all(u[mask == 0] == 0.0)
  assert np.all(u >= 0.0) and np.all(u <= np.log(2.0))
  assert u[0, 0] == 0.0 or mask[[0, 1, 2, 3], 0].sum() > 1  # a lone active row has P = p


def test_js_scores_bounds_extremes_and_no_gradient():
  # Two rollouts with disjoint one-hot distributions: P = (1/2, 1/2), u = 0.75 log(4/3) for both.
  v = 4
  logits = np.full((2, 1, v), -1e4, np.float32)
  logits[0, 0, 0] = logits[1, 0, 1] = 0.0
  u = np.asarray(js_scores(jnp.asarray(logits), jnp.ones((2, 1)), 2))
  np.testing.assert_allclose(u[:, 0], 0.75 * np.log(4 / 3), rtol=1e-6)
  same = np.repeat(np.random.default_rng(2).normal(size=(1, 3, 7)).astype(np.float32), 3, axis=0)
  np.testing.assert_allclose(np.asarray(js_scores(jnp.asarray(same), jnp.ones((3, 3)), 3)), 0.0, atol=1e-7)
  logits, mask = grouped_batch(3)
  grad = jax.jit(jax.grad(lambda x: selection.js_scores(x, jnp.asarray(mask), 4, chunk_size=3).sum()))(
      jnp.asarray(logits)
  )
  assert np.all(np.asarray(grad) == 0.0)


def test_chunk_stats_equals_full_pass_and_bf16():
  logits, mask = grouped_batch(4)
  full = jax.jit(selection.chunk_stats, static_argnums=2)(jnp.asarray(logits), jnp.asarray(mask), 4)
  seq = jax.jit(selection.sequence_stats, static_argnums=(2, 3))(jnp.asarray(logits), jnp.asarray(mask), 4, 3)
  chex.assert_trees_all_close(full, seq, atol=1e-6)
  assert set(full) == {"entropy", "renyi2", "js"}
  bf16 = jnp.asarray(logits).astype(jnp.bfloat16)
  u16 = js_scores(bf16, jnp.asarray(mask), 4, chunk_size=4)
  assert u16.dtype == jnp.float32
  np.testing.assert_allclose(
      np.asarray(u16), np_js(np.asarray(bf16.astype(jnp.float32)), mask, 4), atol=2e-6, rtol=1e-4
  )


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_chunk_stats_paths_match_numpy_and_scipy(kernels, blocked_at_any_vocab):
  """Both implementations of chunk_stats (one [N, C, V] pass; 2-D row blocks, kernels "cpu")
  against numpy/scipy, with -inf vocabulary entries, unequal lengths, an empty row, and
  C = 21 > cpu_paths.ROW_BLOCK so that a short last block is exercised."""
  logits, mask = grouped_batch(7, t=21)
  p = np_softmax(logits)
  with np.errstate(divide="ignore", invalid="ignore"):
    h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
  h2 = -np.log((p**2).sum(-1))
  fn = jax.jit(lambda x, m: selection.chunk_stats(x, m, 4, kernels=kernels))
  got = fn(jnp.asarray(logits), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(got["entropy"]), h * mask, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got["renyi2"]), h2 * mask, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got["js"]), np_js(logits, mask, 4), atol=2e-6, rtol=1e-4)
  with pytest.raises(ValueError, match="N=8 rows is not a positive multiple of group_size=3"):
    selection.chunk_stats(jnp.asarray(logits), jnp.asarray(mask), 3, kernels=kernels)
  with pytest.raises(ValueError, match="kernels"):
    selection.chunk_stats(jnp.asarray(logits), jnp.asarray(mask), 4, kernels="tpu")


def test_trl_entropy_helpers_agree():
  torch = pytest.importorskip("torch")
  trl_utils = pytest.importorskip("trl.trainer.utils")
  trainer = pytest.importorskip("trl.trainer.grpo_trainer")
  logits, mask = grouped_batch(5)
  logits[1, :, -3:] = -30.0  # torch's p * logp is NaN at -inf; compare on finite logits
  want = trl_utils.entropy_from_logits(torch.tensor(logits)).numpy()
  got = np.asarray(token_stats(jnp.asarray(logits), chunk_size=4)["entropy"])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  # TRL's quantile threshold vs our exact top-k: both keep an upper set of the entropies,
  # so one contains the other and (without ties) they differ by at most one token.
  h = np.random.default_rng(5).random((6, 11)).astype(np.float32)
  m = (np.random.default_rng(6).random((6, 11)) < 0.7).astype(np.float32)
  identity = lambda x, **_: x  # noqa: E731
  fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(pad_across_processes=identity, gather=identity))
  theirs = trainer.GRPOTrainer.get_high_entropy_mask(fake, torch.tensor(h), torch.tensor(m), 0.8).numpy()
  ours = np.asarray(entropy_mask(jnp.asarray(h), jnp.asarray(m), 0.2))
  assert np.all(ours <= theirs) or np.all(theirs <= ours)
  assert abs(int(ours.sum()) - int(theirs.sum())) <= 1
  assert ours.sum() == ceil_frac(0.2, int(m.sum()))


# ----------------------------------------------------------------------------- masks
def test_top_k_rows_is_the_first_k_of_a_stable_sort():
  """The radix-select top-k keeps exactly the first k of numpy's stable argsort of -score
  (ties by position, -0.0 = 0.0, NaN last), for every k from 0 to beyond the row."""
  rng = np.random.default_rng(3)
  specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3.0, -3.0, 1e30, -1e30, 0.5], np.float32)
  top_k = jax.jit(token_masks._top_k_rows)
  for trial in range(40):
    r, t = 5, int(rng.integers(1, 30))
    score = rng.choice(specials, size=(r, t)) if trial % 2 else rng.integers(-2, 3, (r, t)).astype(np.float32)
    valid = rng.random((r, t)) < 0.8
    k = rng.integers(0, t + 2, r)
    got = np.asarray(top_k(jnp.asarray(score), jnp.asarray(valid), jnp.asarray(k, jnp.int32)))
    key = np.where(valid, -score, np.inf) + np.float32(0.0)
    want = np.zeros((r, t), bool)
    for i in range(r):
      order = np.argsort(key[i], kind="stable")
      want[i, order[: k[i]]] = True
    np.testing.assert_array_equal(got, want & valid, err_msg=f"{score} {valid} {k}")


@pytest.mark.parametrize("fraction", [0.1, 0.25, 1.0])
def test_ict_mask_matches_numpy_loop(fraction):
  rng = np.random.default_rng(7)
  n, t = 9, 40
  u = (rng.integers(0, 5, size=(n, t)) / 8).astype(np.float32)  # many ties
  lengths = np.array([0, 1, 9, 10, 11, 30, 40, 20, 5])
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  got = np.asarray(ict_mask(jnp.asarray(u), jnp.asarray(mask), fraction))
  want = np_ict(u, mask, fraction)
  np.testing.assert_array_equal(got, want)
  expected_k = [0 if n_ == 0 else max(1, ceil_frac(fraction, n_)) for n_ in lengths]
  np.testing.assert_array_equal(got.sum(1), expected_k)
  if fraction == 0.1:
    assert got[5].sum() == 3  # ceil(0.1 * 30) is 3, not float-rounded 4


def test_entropy_mask_matches_numpy_loop():
  rng = np.random.default_rng(8)
  h = (rng.integers(0, 6, size=(7, 13)) / 3).astype(np.float32)  # ties across rows
  mask = (rng.random((7, 13)) < 0.6).astype(np.float32)
  mask[2] = 0
  for fraction in (0.2, 0.5, 1.0):
    got = np.asarray(entropy_mask(jnp.asarray(h), jnp.asarray(mask), fraction))
    np.testing.assert_array_equal(got, np_entropy_mask(h, mask, fraction))
  assert not np.asarray(entropy_mask(jnp.asarray(h), jnp.zeros_like(jnp.asarray(mask)), 0.2)).any()

  # The paper's verl code (get_global_entropy_top_mask): global top-k, k = max(1, int(n*r + 0.9999)).
  h = rng.random((7, 13)).astype(np.float32)  # no ties
  for n_valid in (1, 15, 50, 91):
    mask = np.zeros(91, np.float32)
    mask[rng.permutation(91)[:n_valid]] = 1
    mask = mask.reshape(7, 13)
    valid_idx = np.flatnonzero(mask.reshape(-1))
    k = max(1, int(n_valid * 0.2 + 0.9999))
    want = np.zeros(91, bool)
    want[valid_idx[np.argsort(-h.reshape(-1)[valid_idx])[:k]]] = True
    got = np.asarray(entropy_mask(jnp.asarray(h), jnp.asarray(mask), 0.2))
    np.testing.assert_array_equal(got, want.reshape(7, 13))


def test_masked_quantile_matches_numpy():
  rng = np.random.default_rng(9)
  x = rng.normal(size=(5, 9)).astype(np.float32)
  for n_valid in (1, 2, 6, 11, 16, 45):
    mask = np.zeros(45, np.float32)
    mask[rng.permutation(45)[:n_valid]] = 1
    mask = mask.reshape(5, 9)
    for q in (0.0, 0.37, 0.8, 1.0):
      got = float(masked_quantile(jnp.asarray(x), jnp.asarray(mask), q))
      np.testing.assert_allclose(got, np.quantile(x[mask == 1].astype(np.float64), q), rtol=1e-6, atol=1e-6)


def test_stapo_mask_matches_numpy():
  rng = np.random.default_rng(10)
  b, t = 6, 12
  mask = (np.arange(t)[None] < np.array([12, 7, 3, 0, 10, 10])[:, None]).astype(np.float32)
  assert (mask.sum() - 1) % 5  # quantile position 0.8*(n-1) not an integer: no token sits on tau_h
  h = rng.random((b, t)).astype(np.float32) * 3
  prob = (10.0 ** rng.uniform(-4, 0, size=(b, t))).astype(np.float32)
  adv = np.array([1.0, -1.0, 0.5, 2.0, 0.0, 0.3], np.float32)
  got = np.asarray(stapo_mask(jnp.asarray(prob), jnp.asarray(h), jnp.asarray(adv), jnp.asarray(mask)))
  tau_h = np.quantile(h[mask == 1], 0.8)
  want = (mask == 1) & ~((adv[:, None] > 0) & (prob < 0.002) & (h < tau_h))
  np.testing.assert_array_equal(got, want)
  assert (mask == 1).sum() > want.sum()  # something was dropped


# ----------------------------------------------------------------------------- registry, metrics
def test_select_tokens_registry():
  rng = np.random.default_rng(11)
  b, t = 8, 10
  mask = jnp.asarray((np.arange(t)[None] < rng.integers(1, t + 1, size=b)[:, None]).astype(np.float32))
  u, h = jnp.asarray(rng.random((b, t)) * 0.6), jnp.asarray(rng.random((b, t)) * 2)
  prob, adv = jnp.asarray(10.0 ** rng.uniform(-4, 0, (b, t))), jnp.asarray(rng.normal(size=b))
  kw = dict(mask=mask, u=u, entropy=h, token_prob=prob, advantages=adv)
  loss_types = {}

  @functools.partial(jax.jit, static_argnames=("method", "top_fraction"))
  def select(method, top_fraction=0.1, **arrays):
    token_mask, loss_types[method] = selection.select_tokens(
        IctConfig(method=method, top_fraction=top_fraction), **arrays
    )
    return token_mask

  expected = {
      "grpo": (mask.astype(bool), "dapo"),
      "entropy": (entropy_mask(h, mask, 0.2), "bnpo"),
      "stapo": (stapo_mask(prob, h, adv, mask), "bnpo"),
      "ict": (ict_mask(u, mask, 0.1), "grpo"),
  }
  assert set(selection.SELECTORS) == set(expected)
  for method, (want_mask, want_loss) in expected.items():
    got_mask = select(method, **kw)
    np.testing.assert_array_equal(np.asarray(got_mask), np.asarray(want_mask))
    assert got_mask.dtype == jnp.bool_
    assert loss_types[method] == want_loss == selection.loss_type_for(method)
  assert selection.loss_type_for("grpo", dense_loss_type="grpo") == "grpo"
  got = select("ict", top_fraction=0.3, mask=mask, u=u)
  np.testing.assert_array_equal(np.asarray(got), np_ict(np.asarray(u), np.asarray(mask), 0.3))
  with pytest.raises(ValueError, match=r"'entropy', 'grpo', 'ict', 'stapo'"):
    selection.select_tokens(IctConfig(method="random"), mask=mask)
  with pytest.raises(ValueError, match="needs"):
    selection.select_tokens(IctConfig(method="stapo"), mask=mask, entropy=h)
  with pytest.raises(ValueError, match="dense_loss_type"):
    selection.loss_type_for("grpo", dense_loss_type="ppo")
  with pytest.raises(ValueError, match="top_fraction"):
    selection.ict_mask(u, mask, 0.0)


def test_selection_metrics_match_numpy():
  from ict_jax.grpo import finalize_metrics

  rng = np.random.default_rng(12)
  mask = (rng.random((5, 8)) < 0.7).astype(np.float32)
  u, h = rng.random((5, 8)).astype(np.float32), rng.random((5, 8)).astype(np.float32)
  sel = rng.random((5, 8)) < 0.3
  terms = selection.selection_metrics(jnp.asarray(u), jnp.asarray(mask), jnp.asarray(sel), entropy=jnp.asarray(h))
  got = finalize_metrics(terms)
  valid = mask == 1
  np.testing.assert_allclose(float(got["js_selected"]), u[valid & sel].mean(), rtol=1e-6)
  np.testing.assert_allclose(float(got["js_unselected"]), u[valid & ~sel].mean(), rtol=1e-6)
  np.testing.assert_allclose(float(got["selected_frac"]), (valid & sel).sum() / valid.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(got["entropy"]), h[valid].mean(), rtol=1e-6)
  # (sum, count) pairs add across micro-batches
  halves = [
      selection.selection_metrics(
          jnp.asarray(u[s]), jnp.asarray(mask[s]), jnp.asarray(sel[s]), entropy=jnp.asarray(h[s])
      )
      for s in (slice(0, 2), slice(2, 5))
  ]
  chex.assert_trees_all_close(finalize_metrics(jax.tree.map(jnp.add, *halves)), got, rtol=1e-6)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_signature_metrics_match_numpy(seed):
  """selected_prob: the selected valid tokens' mean probability; selected_high_entropy: their share
  strictly above numpy.median of all valid tokens' entropy (odd and even valid counts, ties at the
  median included: a token equal to the median is not above it)."""
  from ict_jax.grpo import finalize_metrics

  rng = np.random.default_rng(seed)
  mask = rng.random((6, 9)) < 0.6
  prob = rng.random((6, 9)).astype(np.float32)
  h = np.round(rng.random((6, 9)), 1).astype(np.float32)  # many exact ties
  sel = rng.random((6, 9)) < 0.4
  sel[0, :] = True  # selected padding must not count
  got = finalize_metrics(
      jax.jit(selection.signature_metrics)(jnp.asarray(prob), jnp.asarray(h), jnp.asarray(mask), jnp.asarray(sel))
  )
  median = np.median(h[mask])
  keep = mask & sel
  np.testing.assert_allclose(float(got["selected_prob"]), prob[keep].mean(), rtol=1e-6)
  assert float(got["selected_high_entropy"]) == pytest.approx((h[keep] > median).mean(), abs=1e-7)
  grpo_like = finalize_metrics(
      selection.signature_metrics(jnp.asarray(prob), jnp.asarray(h), jnp.asarray(mask), jnp.asarray(mask))
  )
  np.testing.assert_allclose(float(grpo_like["selected_prob"]), prob[mask].mean(), rtol=1e-6)
  assert float(grpo_like["selected_high_entropy"]) == pytest.approx((h[mask] > median).mean(), abs=1e-7)
  none = finalize_metrics(
      selection.signature_metrics(jnp.asarray(prob), jnp.asarray(h), jnp.asarray(mask), jnp.zeros_like(sel))
  )
  assert np.isnan(float(none["selected_prob"])) and np.isnan(float(none["selected_high_entropy"]))


# ----------------------------------------------------------------------------- sharding
def test_sharded_jit_matches_unsharded():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  logits, mask = grouped_batch(13, n=8, t=11, v=24, g=4)  # 2 rows per shard: groups span shards
  rng = np.random.default_rng(13)
  prob = (10.0 ** rng.uniform(-4, 0, size=mask.shape)).astype(np.float32)
  adv = rng.normal(size=8).astype(np.float32)

  @functools.partial(jax.jit, static_argnames=("chunk",))
  def select_all(logits, mask, prob, adv, chunk):
    stats = selection.sequence_stats(logits, mask, 4, chunk)
    return dict(
        stats,
        ict=selection.ict_mask(stats["js"], mask),
        entropy_mask=selection.entropy_mask(stats["entropy"], mask),
        stapo=selection.stapo_mask(prob, stats["entropy"], adv, mask),
    )

  want = select_all(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(prob), jnp.asarray(adv), chunk=4)
  got = select_all(
      jax.device_put(logits, rows),
      jax.device_put(mask, rows),
      jax.device_put(prob, rows),
      jax.device_put(adv, rows),
      chunk=4,
  )
  chex.assert_trees_all_close(got, want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got["js"]), np_js(logits, mask, 4), atol=2e-6, rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(got["ict"]), np_ict(np.asarray(want["js"]), mask, 0.1))


# ----------------------------------------------------------------------------- ICT ablations
def np_reference_scores(logits, mask, g, reference):
  """(JS, KL)(p_i || P) per token with P from scipy/numpy loops: "active_mean" averages the
  group's active rollouts, "others_mean" the other active rollouts (none -> score 0),
  "sequence_mean" row i's own real positions."""
  p = np_softmax(logits)
  n, t, _ = p.shape
  js, kl = np.zeros((n, t)), np.zeros((n, t))
  for grp in range(n // g):
    rows = range(grp * g, grp * g + g)
    for pos in range(t):
      for i in rows:
        if not mask[i, pos]:
          continue
        if reference == "sequence_mean":
          big = np.mean([p[i, s] for s in range(t) if mask[i, s]], axis=0)
        else:
          pool = [j for j in rows if mask[j, pos] and (reference == "active_mean" or j != i)]
          if not pool:
            continue
          big = np.mean([p[j, pos] for j in pool], axis=0)
        js[i, pos] = jensenshannon(p[i, pos], big, base=np.e) ** 2
        with np.errstate(divide="ignore", invalid="ignore"):
          kl[i, pos] = np.sum(np.where(p[i, pos] > 0, p[i, pos] * np.log(p[i, pos] / big), 0.0))
  return js, kl


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("reference", sorted(selection.REFERENCES))
def test_reference_and_kl_scores_match_scipy(reference, kernels, blocked_at_any_vocab):
  logits, mask = grouped_batch(13, t=19)
  logits[1, :, -3:] = -30.0  # KL to a leave-one-out mean is unbounded where the others give p = 0
  want_js, want_kl = np_reference_scores(logits, mask, 4, reference)
  fn = jax.jit(lambda x, m: selection.chunk_stats(x, m, 4, kernels=kernels, reference=reference, kl=True))
  got = fn(jnp.asarray(logits), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(got["js"]), want_js, atol=2e-6, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(got["kl"]), want_kl, atol=2e-5, rtol=1e-4)
  seq = jax.jit(lambda x, m: selection.sequence_stats(x, m, 4, 5, reference=reference, kl=True))(
      jnp.asarray(logits), jnp.asarray(mask)
  )
  np.testing.assert_allclose(np.asarray(seq["kl"]), want_kl, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(seq["js"]), want_js, atol=2e-6, rtol=1e-4)  # 4 chunks
  if reference == "active_mean":  # the default reproduces js_scores
    np.testing.assert_allclose(np.asarray(got["js"]), np_js(logits, mask, 4), atol=2e-6, rtol=1e-4)
  with pytest.raises(ValueError, match="reference"):
    selection.chunk_stats(jnp.asarray(logits), jnp.asarray(mask), 4, reference="median")


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_sequence_mean_in_the_fused_lm_head_matches_scipy(kernels, blocked_at_any_vocab):
  """The train step's path: the fused LM head computes the "sequence_mean" reference over every
  chunk of a response (3 chunks here) before scoring; JS = scipy's jensenshannon(p, P, base e)^2."""
  from ict_jax import lm_head

  rng = np.random.default_rng(3)
  n, c, d, v, temp = 8, 11, 16, 37, 0.7
  h = rng.normal(size=(n, c, d)).astype(np.float32)
  w = (rng.normal(size=(d, v)) * 0.5).astype(np.float32)
  ids = rng.integers(0, v, size=(n, c)).astype(np.int32)
  mask = (np.arange(c)[None] < np.array([11, 4, 0, 9, 1, 11, 7, 6])[:, None]).astype(np.float32)
  _, stats = lm_head.logp_and_stats(
      jnp.asarray(h),
      jnp.asarray(w),
      jnp.asarray(ids),
      jnp.asarray(mask),
      temperature=temp,
      group_size=4,
      chunk_size=4,
      reference="sequence_mean",
      kernels=kernels,
  )
  logits = np.einsum("ncd,dv->ncv", h.astype(np.float64), w.astype(np.float64)) / temp
  want_js, _ = np_reference_scores(logits, mask, 4, "sequence_mean")
  longer = (mask > 0) & (mask.sum(axis=1, keepdims=True) > 1)  # a one-token response is its own mean
  assert want_js[longer].min() > 1e-3 and np.abs(want_js[4]).max() == 0.0
  np.testing.assert_allclose(np.asarray(stats["js"]), want_js, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.3, 0.9])
def test_ict_mask_frequent_keeps_the_bottom(fraction):
  rng = np.random.default_rng(14)
  n, t = 9, 40
  u = (rng.integers(0, 5, size=(n, t)) / 8).astype(np.float32)
  lengths = np.array([0, 1, 9, 10, 11, 30, 40, 20, 5])
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  got = np.asarray(
      jax.jit(selection.ict_mask, static_argnames=("top_fraction", "keep"))(
          jnp.asarray(u), jnp.asarray(mask), fraction, "frequent"
      )
  )
  np.testing.assert_array_equal(got, np_ict(-u, mask, fraction))  # lowest u first, ties by position
  with pytest.raises(ValueError, match="keep"):
    selection.ict_mask(jnp.asarray(u), jnp.asarray(mask), fraction, "rare")


@pytest.mark.parametrize("score", sorted(selection.SCORES))
@pytest.mark.parametrize("keep", sorted(selection.KEEPS))
def test_select_tokens_ict_ablations(score, keep):
  rng = np.random.default_rng(15)
  b, t = 8, 12
  mask = (np.arange(t)[None] < rng.integers(1, t + 1, size=b)[:, None]).astype(np.float32)
  arrays = {name: rng.random((b, t)).astype(np.float32) for name in ("u", "kl", "entropy", "noise")}
  got, loss_type = (
      jax.jit(
          lambda m, a: selection.select_tokens(IctConfig(top_fraction=0.2, score=score, keep=keep), mask=m, **a)[0]
      )(jnp.asarray(mask), {k: jnp.asarray(v) for k, v in arrays.items()}),
      "grpo",
  )
  chosen = arrays[{"js": "u", "kl": "kl", "entropy": "entropy", "random": "noise"}[score]]
  want = np_ict(chosen if keep == "unique" else -chosen, mask, 0.2)
  np.testing.assert_array_equal(np.asarray(got), want)
  with pytest.raises(ValueError, match="needs"):
    selection.select_tokens(IctConfig(score=score), mask=jnp.asarray(mask), **{k: None for k in arrays})
  with pytest.raises(ValueError, match="ict.score"):
    selection.select_tokens(IctConfig(score="wasserstein"), mask=jnp.asarray(mask))
  with pytest.raises(ValueError, match="ict.keep"):
    selection.select_tokens(IctConfig(keep="rare"), mask=jnp.asarray(mask), u=jnp.asarray(arrays["u"]))


def test_config_choices_match_the_registries():
  from ict_jax import config as config_lib

  (score,), (keep,), (reference,) = (
      config_lib.rules_of(config_lib.IctConfig)[name] for name in ("score", "keep", "reference")
  )
  assert score.choices == tuple(selection.SCORES)
  assert keep.choices == tuple(selection.KEEPS)
  assert reference.choices == tuple(selection.REFERENCES)
  c = config_lib.default_config()
  c.ict.score = "wasserstein"
  with pytest.raises(config_lib.ConfigError, match="config.ict.score"):
    config_lib.validate(c)
