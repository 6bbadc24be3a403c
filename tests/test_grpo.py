"""grpo.py against an independent numpy transcription of TRL 1.16 GRPOTrainer and TRL itself."""

from __future__ import annotations

import collections
import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ict_jax import grpo

LOSS_NAMES = ("grpo", "bnpo", "dr_grpo", "dapo")
_STATIC = ("beta", "epsilon_low", "epsilon_high", "loss_type", "max_completion_length", "selected_norm")
# jitted entry points keep the tests fast (eager mode compiles every primitive separately)
policy_loss = jax.jit(grpo.policy_loss, static_argnames=_STATIC)
policy_loss_terms = jax.jit(grpo.policy_loss_terms, static_argnames=_STATIC)
group_advantages = jax.jit(grpo.group_advantages, static_argnames=("group_size", "scale"))


# ----------------------------------------------------------------------------- numpy reference
def np_advantages(r, g, scale, eps=1e-4):
  """TRL: A = r - groupmean, divided by (std + 1e-4), std unbiased over group or batch."""
  r = np.asarray(r, np.float64)
  grouped = r.reshape(-1, g)
  mean = np.repeat(grouped.mean(1), g)
  if scale == "group":
    std = np.repeat(grouped.std(1, ddof=1), g) if g > 1 else np.zeros_like(r)
  else:
    std = np.full_like(r, r.std(ddof=1) if r.size > 1 else 0.0)
  adv = r - mean
  return adv if scale == "none" else adv / (std + eps)


def np_loss(
    logp,
    old,
    adv,
    mask,
    *,
    ref=None,
    beta=0.0,
    el=0.2,
    eh=0.2,
    loss_type="dapo",
    token_mask=None,
    num_items=None,
    max_len=None,
):
  logp, old, mask = (np.asarray(x, np.float64) for x in (logp, old, mask))
  a = np.asarray(adv, np.float64)[:, None]
  m = mask if token_mask is None else mask * np.asarray(token_mask, np.float64)
  coef1 = np.exp(logp - old)
  coef2 = np.clip(coef1, 1 - el, 1 + eh)
  per_tok = -np.minimum(coef1 * a, coef2 * a)
  kl = np.zeros_like(per_tok)
  if ref is not None:
    d = np.asarray(ref, np.float64) - logp
    kl = np.exp(d) - d - 1
    per_tok = per_tok + beta * kl
  b, t = logp.shape
  if loss_type == "grpo":
    loss = np.mean([(per_tok[i] * m[i]).sum() / max(m[i].sum(), 1.0) for i in range(b)])
  elif loss_type == "bnpo":
    loss = (per_tok * m).sum() / max(m.sum(), 1.0)
  elif loss_type == "dr_grpo":
    loss = (per_tok * m).sum() / (b * (max_len or t))
  else:
    loss = (per_tok * m).sum() / max(m.sum() if num_items is None else num_items, 1.0)
  low = (coef1 < 1 - el) & (a < 0)
  high = (coef1 > 1 + eh) & (a > 0)
  mean = lambda x: (x * m).sum() / max(m.sum(), 1.0)  # noqa: E731
  metrics = dict(
      clip_frac_low=mean(low),
      clip_frac_high=mean(high),
      clip_frac=mean(low | high),
      kl=mean(kl),
      ratio_mean=mean(coef1),
  )
  return loss, metrics


def random_batch(seed, b=12, t=9, spread=0.4):
  """Unequal lengths (one empty row), ratios well beyond the clip range, mixed-sign A."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[3] = 0
  lengths[5] = t
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  logp = rng.normal(-1.5, 0.8, size=(b, t)).astype(np.float32)
  old = (logp + rng.normal(0, spread, size=(b, t))).astype(np.float32)
  ref = (logp + rng.normal(0, spread, size=(b, t))).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  adv[1] = 0.0
  token_mask = rng.random((b, t)) < 0.4
  return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask, token_mask=token_mask)


# ----------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_formula(scale):
  rng = np.random.default_rng(0)
  g = 4
  r = rng.normal(size=6 * g).astype(np.float32)
  r[:g] = 0.7  # constant group
  r[g : 2 * g] = [0.0, 1.0, 1.0, 0.0]
  out = np.asarray(group_advantages(jnp.asarray(r), g, scale=scale))
  np.testing.assert_allclose(out, np_advantages(r, g, scale), rtol=1e-5, atol=1e-5)
  assert np.all(out[:g] == 0.0)


def test_group_advantages_degenerate_cases_are_exact_zero():
  cases = [([0.1, 0.1, 0.1], 3), ([0.1] * 6, 2), ([0.3, -2.0, 5.0], 1), ([0.5], 1)]
  for r, g in cases:
    for scale in ("group", "batch", "none"):
      out = np.asarray(group_advantages(jnp.asarray(r, jnp.float32), g, scale=scale))
      assert np.all(out == 0.0), (r, g, scale, out)


def test_group_advantages_binary_rewards_scale():
  # G=2 with rewards (0, 1): unbiased std = 1/sqrt(2), so A = -+0.5/(0.7071+1e-4).
  out = np.asarray(group_advantages(jnp.asarray([0.0, 1.0]), 2))
  np.testing.assert_allclose(out, [-0.5 / (np.sqrt(0.5) + 1e-4), 0.5 / (np.sqrt(0.5) + 1e-4)], rtol=1e-6)


def test_group_advantages_errors():
  with pytest.raises(ValueError, match="group.*batch.*none"):
    group_advantages(jnp.zeros(4), 2, scale="std")
  with pytest.raises(ValueError, match="group_size=3"):
    group_advantages(jnp.zeros(4), 3)


def test_group_advantages_match_trl_nanstd():
  utils = pytest.importorskip("trl.trainer.utils")
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  r = rng.normal(size=20).astype(np.float32)
  tr = torch.tensor(r)
  mean = tr.view(-1, 5).mean(1).repeat_interleave(5)
  expected = {
      "group": (tr - mean) / (utils.nanstd(tr.view(-1, 5), dim=1).repeat_interleave(5) + 1e-4),
      "batch": (tr - mean) / (utils.nanstd(tr).expand_as(tr) + 1e-4),
      "none": tr - mean,
  }
  for scale, want in expected.items():
    got = np.asarray(group_advantages(jnp.asarray(r), 5, scale=scale))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- loss vs numpy
@pytest.mark.parametrize("loss_type", LOSS_NAMES)
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("with_token_mask", [False, True])
def test_policy_loss_matches_numpy(loss_type, with_kl, with_token_mask):
  d = random_batch(2)
  kw = dict(
      ref=d["ref"] if with_kl else None,
      beta=0.04 if with_kl else 0.0,
      el=0.2,
      eh=0.28,
      loss_type=loss_type,
      token_mask=d["token_mask"] if with_token_mask else None,
  )
  want_loss, want_metrics = np_loss(d["logp"], d["old"], d["adv"], d["mask"], **kw)
  loss, metrics = policy_loss(
      jnp.asarray(d["logp"]),
      jnp.asarray(d["old"]),
      jnp.asarray(d["adv"]),
      jnp.asarray(d["mask"]),
      ref_logp=None if kw["ref"] is None else jnp.asarray(kw["ref"]),
      beta=kw["beta"],
      epsilon_low=0.2,
      epsilon_high=0.28,
      loss_type=loss_type,
      token_mask=None if kw["token_mask"] is None else jnp.asarray(kw["token_mask"]),
  )
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
  assert set(metrics) == set(want_metrics)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert want_metrics["clip_frac_low"] > 0 and want_metrics["clip_frac_high"] > 0  # data exercises clipping


def np_token_weights(mask, token_mask, loss_type, selected_norm):
  """w [B, T]: the weight of token t of response i in the loss, loss = -sum w * A_i * ratio near
  ratio 1. k_i selected of L_i valid tokens: "grpo" M / (B k_i) or M / (B L_i); "bnpo" / "dapo"
  M / sum M or M / sum mask; "dr_grpo" M / (B T) either way."""
  mask = np.asarray(mask, np.float64)
  m = mask * token_mask
  b, t = m.shape
  norm = m if selected_norm == "selected" else mask
  if loss_type == "grpo":
    return m / (b * np.maximum(norm.sum(1, keepdims=True), 1.0))
  if loss_type == "dr_grpo":
    return m / (b * t)
  return m / max(norm.sum(), 1.0)


@pytest.mark.parametrize("loss_type", LOSS_NAMES)
@pytest.mark.parametrize("selected_norm", sorted(grpo.SELECTED_NORMS))
def test_selected_norm_token_weights_match_numpy(loss_type, selected_norm):
  """d loss / d logp on-policy (ratio 1, inside the clip) is -A_i w_it: the per-token weights of
  both normalisations against numpy; "response" gives a selected token of ICT's per-sequence loss
  k_i / L_i of its "selected" weight."""
  d = random_batch(7)
  args = [jnp.asarray(d[k]) for k in ("logp", "logp", "adv", "mask")]

  def loss(lp):
    return policy_loss(
        lp, *args[1:], loss_type=loss_type, token_mask=jnp.asarray(d["token_mask"]), selected_norm=selected_norm
    )[0]

  grad = np.asarray(jax.grad(loss)(args[0]), np.float64)
  want = np_token_weights(d["mask"], d["token_mask"], loss_type, selected_norm)
  np.testing.assert_allclose(grad, -d["adv"][:, None] * want, rtol=1e-5, atol=1e-8)
  if loss_type == "grpo" and selected_norm == "response":  # the ratio the issue names: k_i / L_i
    sel = np_token_weights(d["mask"], d["token_mask"], "grpo", "selected")
    k, length = (d["mask"] * d["token_mask"]).sum(1), d["mask"].sum(1)
    rows = k > 0
    np.testing.assert_allclose((want.sum(1) / sel.sum(1))[rows], (k / length)[rows], rtol=1e-6)
  dense = policy_loss_terms(*args, loss_type=loss_type, selected_norm=selected_norm)
  plain = policy_loss_terms(*args, loss_type=loss_type)  # without a selection the two are one loss
  chex.assert_trees_all_equal(dense, plain)


def test_selected_norm_default_is_todays_loss_and_bad_names_raise():
  """The default is "selected", bit for bit the loss before loss.selected_norm existed (which the
  numpy reference of test_policy_loss_matches_numpy transcribes: normalised by M)."""
  d = random_batch(8)
  args = [jnp.asarray(d[k]) for k in ("logp", "old", "adv", "mask")]
  for loss_type in LOSS_NAMES:
    tm = jnp.asarray(d["token_mask"])
    default = policy_loss_terms(*args, loss_type=loss_type, token_mask=tm)
    chex.assert_trees_all_equal(
        default, policy_loss_terms(*args, loss_type=loss_type, token_mask=tm, selected_norm="selected")
    )
  with pytest.raises(ValueError, match="selected_norm='tokens'"):
    grpo.policy_loss_terms(*args, selected_norm="tokens")
  from ict_jax import config as config_lib, configs

  cd = configs.tiny_config()
  assert config_lib.validate(cd).loss.selected_norm == "selected"
  cd.loss.selected_norm = "tokens"
  with pytest.raises(config_lib.ConfigError, match="loss.selected_norm"):
    config_lib.validate(cd)


def test_dr_grpo_max_completion_length_and_dapo_num_items():
  d = random_batch(3)
  args = [jnp.asarray(d[k]) for k in ("logp", "old", "adv", "mask")]
  loss, _ = policy_loss(*args, loss_type="dr_grpo", max_completion_length=32)
  want, _ = np_loss(d["logp"], d["old"], d["adv"], d["mask"], loss_type="dr_grpo", max_len=32)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  loss, _ = policy_loss(*args, loss_type="dapo", num_items=77)
  want, _ = np_loss(d["logp"], d["old"], d["adv"], d["mask"], loss_type="dapo", num_items=77)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  with pytest.raises(ValueError, match="num_items"):
    policy_loss(*args, loss_type="grpo", num_items=77)


def test_loss_registry():
  assert {k: v.display_name for k, v in grpo.LOSS_TYPES.items()} == {
      "grpo": "GRPO",
      "bnpo": "BNPO",
      "dr_grpo": "Dr. GRPO",
      "dapo": "DAPO",
  }
  d = random_batch(0)
  with pytest.raises(ValueError, match=r"'bnpo', 'dapo', 'dr_grpo', 'grpo'"):
    policy_loss(*(jnp.asarray(d[k]) for k in ("logp", "old", "adv", "mask")), loss_type="ppo")


# ----------------------------------------------------------------------------- TRL itself
def _trl_loss(trl_cls, torch, d, loss_type, beta, el, eh):
  """Run TRL 1.16 GRPOTrainer._compute_loss on a minimal stand-in for the trainer."""
  b, t = d["mask"].shape
  logp = torch.tensor(d["logp"], dtype=torch.float64)
  identity = lambda x, **_: x  # noqa: E731
  fake = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
      top_entropy_quantile=1.0,
      off_policy_mask_threshold=None,
      importance_sampling_level="token",
      beta=beta,
      loss_type=loss_type,
      epsilon_low=el,
      epsilon_high=eh,
      use_vllm=False,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
      model=types.SimpleNamespace(training=True),
      current_gradient_accumulation_steps=1,
      max_completion_length=t,
      _entropy_bonus_enabled=False,
      aux_loss_enabled=False,
      accelerator=types.SimpleNamespace(num_processes=1, reduce=identity, gather=identity, gather_for_metrics=identity),
      _metrics={"train": collections.defaultdict(list)},
  )
  inputs = {
      "prompt_ids": torch.zeros((b, 1), dtype=torch.long),
      "prompt_mask": torch.ones((b, 1)),
      "completion_ids": torch.zeros((b, t), dtype=torch.long),
      "completion_mask": torch.tensor(d["mask"], dtype=torch.float64),
      "advantages": torch.tensor(d["adv"], dtype=torch.float64),
      "old_per_token_logps": torch.tensor(d["old"], dtype=torch.float64),
      "ref_per_token_logps": torch.tensor(d["ref"], dtype=torch.float64),
      "num_items_in_batch": torch.tensor(float(d["mask"].sum())),
  }
  loss = trl_cls._compute_loss(fake, None, inputs)
  return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", LOSS_NAMES)
def test_policy_loss_matches_trl_compute_loss(loss_type):
  torch = pytest.importorskip("torch")
  trainer = pytest.importorskip("trl.trainer.grpo_trainer")
  d = random_batch(4)
  for beta in (0.0, 0.04):
    want, trl_metrics = _trl_loss(trainer.GRPOTrainer, torch, d, loss_type, beta, 0.2, 0.28)
    loss, metrics = policy_loss(
        jnp.asarray(d["logp"]),
        jnp.asarray(d["old"]),
        jnp.asarray(d["adv"]),
        jnp.asarray(d["mask"]),
        ref_logp=jnp.asarray(d["ref"]) if beta else None,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    for ours, theirs in (
        ("clip_frac_low", "clip_ratio/low_mean"),
        ("clip_frac_high", "clip_ratio/high_mean"),
        ("clip_frac", "clip_ratio/region_mean"),
    ) + ((("kl", "kl"),) if beta else ()):
      np.testing.assert_allclose(float(metrics[ours]), trl_metrics[theirs], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("loss_type", LOSS_NAMES)
def test_microbatch_accumulation_is_exact(loss_type):
  d = random_batch(5, b=12)
  kw = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type)
  j = {k: jnp.asarray(v) for k, v in d.items()}

  @jax.jit
  def numerator_and_grad(logp, old, adv, mask, ref, token_mask):
    def num(x):
      t = grpo.policy_loss_terms(x, old, adv, mask, ref_logp=ref, token_mask=token_mask, **kw)
      return t.numerator, t

    return jax.value_and_grad(num, has_aux=True)(logp)

  parts = [
      numerator_and_grad(*(j[k][sl] for k in ("logp", "old", "adv", "mask", "ref", "token_mask")))
      for sl in (slice(0, 3), slice(3, 8), slice(8, 12))
  ]
  acc = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), [terms for (_, terms), _ in parts])
  grads = jnp.concatenate([g for _, g in parts]) / jnp.maximum(acc.denominator, 1.0)

  # one big batch, through the public scalar loss
  (loss, metrics), full_grad = jax.jit(
      jax.value_and_grad(
          lambda x: policy_loss(x, j["old"], j["adv"], j["mask"], ref_logp=j["ref"], token_mask=j["token_mask"], **kw),
          has_aux=True,
      )
  )(j["logp"])
  np.testing.assert_allclose(float(grpo.loss_from_terms(acc.numerator, acc.denominator)), float(loss), rtol=1e-6)
  chex.assert_trees_all_close(grpo.finalize_metrics(acc.metrics), metrics, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grads), np.asarray(full_grad), rtol=1e-5, atol=1e-8)
  want, _ = np_loss(
      d["logp"],
      d["old"],
      d["adv"],
      d["mask"],
      ref=d["ref"],
      beta=0.05,
      eh=0.28,
      loss_type=loss_type,
      token_mask=d["token_mask"],
  )
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)


def test_dapo_num_items_per_microbatch_sums_to_full_loss():
  d = random_batch(6, b=10)
  j = {k: jnp.asarray(v) for k, v in d.items()}
  total = float(d["mask"].sum())
  losses = [
      policy_loss(j["logp"][sl], j["old"][sl], j["adv"][sl], j["mask"][sl], loss_type="dapo", num_items=total)[0]
      for sl in (slice(0, 4), slice(4, 10))
  ]
  full, _ = policy_loss(j["logp"], j["old"], j["adv"], j["mask"], loss_type="dapo")
  np.testing.assert_allclose(float(sum(losses)), float(full), rtol=1e-6)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("loss_type", LOSS_NAMES)
def test_gradient_matches_finite_differences_float64(loss_type):
  d = random_batch(7, b=6, t=5)
  el, eh, h = 0.2, 0.28, 1e-6
  ratio = np.exp(d["logp"].astype(np.float64) - d["old"])
  assert np.min(np.abs(ratio - (1 - el))) > 1e-3 and np.min(np.abs(ratio - (1 + eh))) > 1e-3
  with jax.enable_x64(True):
    j = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in d.items()}

    def f(logp):
      return policy_loss(
          logp,
          j["old"],
          j["adv"],
          j["mask"],
          ref_logp=j["ref"],
          beta=0.1,
          epsilon_low=el,
          epsilon_high=eh,
          loss_type=loss_type,
          token_mask=j["token_mask"],
      )[0]

    grad = np.asarray(jax.grad(f)(j["logp"]))
    assert grad.dtype == np.float64
    x0 = np.asarray(j["logp"])
    fd = np.zeros_like(x0)
    for idx in np.ndindex(x0.shape):
      e = np.zeros_like(x0)
      e[idx] = h
      fd[idx] = (float(f(jnp.asarray(x0 + e))) - float(f(jnp.asarray(x0 - e)))) / (2 * h)
  np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
  m = d["mask"] * d["token_mask"]
  assert np.all(grad[m == 0] == 0) and np.any(grad[m == 1] != 0)


# ----------------------------------------------------------------------------- sharding
def test_sharded_jit_matches_unsharded():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  rows2 = NamedSharding(mesh, P(("data", "fsdp"), None))
  d = random_batch(8, b=16, t=7)
  rewards = np.random.default_rng(8).integers(0, 2, size=16).astype(np.float32)

  @functools.partial(jax.jit, static_argnames=("loss_type",))
  def step(rewards, logp, old, ref, mask, token_mask, loss_type):
    adv = group_advantages(rewards, 4)
    return policy_loss(
        logp, old, adv, mask, ref_logp=ref, beta=0.02, epsilon_high=0.28, loss_type=loss_type, token_mask=token_mask
    )

  args = [d[k] for k in ("logp", "old", "ref", "mask", "token_mask")]
  sharded = [jax.device_put(rewards, rows)] + [jax.device_put(a, rows2) for a in args]
  for loss_type in ("grpo", "bnpo"):  # per-sequence and token-mean reductions (dapo/dr_grpo share them)
    want = step(jnp.asarray(rewards), *map(jnp.asarray, args), loss_type=loss_type)
    got = step(*sharded, loss_type=loss_type)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    want_np, _ = np_loss(
        d["logp"],
        d["old"],
        np_advantages(rewards, 4, "group"),
        d["mask"],
        ref=d["ref"],
        beta=0.02,
        eh=0.28,
        loss_type=loss_type,
        token_mask=d["token_mask"],
    )
    np.testing.assert_allclose(float(got[0]), want_np, rtol=1e-5, atol=1e-6)
