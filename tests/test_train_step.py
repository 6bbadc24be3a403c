"""train_step.py against an unfused reference: full logits from `model(ids, mask)`, numpy/scipy
statistics, `selection.*_mask`, `grpo.policy_loss`, and the chain rule through the logits.

The gradient the step computed is read from AdamW's first moment with b1 = 0 (mu == the
clipped gradient exactly; the reference applies the same global-norm clip, which only the
far-from-reference KL case triggers), so no Adam normalisation hides gradient errors.
Compilation dominates the run time on CPU, so every step variant is compiled once (with cheap
XLA:CPU code generation, `COMPILE_OPTIONS`) and shared by the tests through module-scoped
fixtures.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from scipy.spatial.distance import jensenshannon

from ict_jax import grpo, selection, sharding
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.config import OptimConfig
from ict_jax.models.qwen2 import init_model
from tiny import COMPILE_OPTIONS, tiny_config
from tiny import step_config as tiny_step_config

G, N, PROMPT, C, V = 4, 16, 5, 23, 256
TEMP = 0.7
# completion lengths, one per rollout: ceil(0.1 * len) ranges over 1..3
LENGTHS = np.array([23, 15, 9, 1, 20, 11, 5, 17, 12, 23, 3, 8, 19, 14, 2, 21])
CFG = tiny_config(V)
BETA = 0.1
MAX_GRAD_NORM = 100.0  # above every gradient norm here except the far-from-reference KL case


# ----------------------------------------------------------------------------- data
@functools.cache
def optimizer():
  # b1 = 0: Adam's first moment is the gradient itself; eps 1e-3: parameter updates are smooth
  # in the gradient, so float noise in tiny gradient entries cannot flip a +-lr step
  return ts.make_optimizer(
      OptimConfig(learning_rate=1e-3, b1=0.0, eps=1e-3, max_grad_norm=MAX_GRAD_NORM), total_steps=10
  )


@functools.cache
def model_and_params():
  """Random weights large enough for peaked, context-dependent next-token distributions."""
  graphdef, state = nnx.split(init_model(CFG, seed=0))
  rng = np.random.default_rng(1)

  def scale(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return x
    if "bias" in name:
      return jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype)
    return x * (25.0 if "embedding" in name else 10.0)

  return graphdef, jax.tree_util.tree_map_with_path(scale, state.to_pure_dict())


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt_len = np.repeat([5, 3, 4, 2], G)
  prompt_mask = (np.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).astype(np.int32)
  prompt_ids = rng.integers(1, V, (N, PROMPT)).astype(np.int32) * prompt_mask
  # the G rollouts of a prompt share it (left-padded)
  prompt_ids = np.repeat(prompt_ids[::G], G, 0)
  prompt_mask = np.repeat(prompt_mask[::G], G, 0)
  cmask = (np.arange(C)[None] < LENGTHS[:, None]).astype(np.int32)
  cids = rng.integers(1, V, (N, C)).astype(np.int32) * cmask
  adv = np.round(rng.normal(0, 1, N), 2).astype(np.float32)
  adv[::2] = np.abs(adv[::2]) + 0.1  # both signs in every group
  adv[1::2] = -np.abs(adv[1::2]) - 0.1
  return TrainBatch(
      prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=cids, completion_mask=cmask, advantages=adv
  )


# ----------------------------------------------------------------------------- reference
def np_stats(logits, mask):
  """logits [N, C, V] (temperature applied) -> float64 logp_all, entropy, renyi2, js [N, C]."""
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  logp_all = x - np.log(np.exp(x).sum(-1, keepdims=True))
  p = np.exp(logp_all)
  entropy = -(p * logp_all).sum(-1) * mask
  renyi2 = -np.log((p * p).sum(-1)) * mask
  js = np.zeros(mask.shape)
  for g in range(N // G):
    rows = range(g * G, (g + 1) * G)
    for t in range(C):
      active = [i for i in rows if mask[i, t]]
      if active:
        big_p = p[active, t].mean(0)
        for i in active:
          js[i, t] = jensenshannon(p[i, t], big_p, base=np.e) ** 2
  return logp_all, entropy, renyi2, js


def np_ict(js, mask, fraction):
  out = np.zeros(mask.shape, bool)
  for i in range(N):
    valid = np.flatnonzero(mask[i])
    k = max(1, math.ceil(Fraction(str(fraction)) * len(valid)))
    order = sorted(valid, key=lambda t: (-js[i, t], t))
    out[i, order[:k]] = True
    if len(valid) > k:  # the reference must not hinge on float rounding
      assert js[i, order[k - 1]] - js[i, order[k]] > 1e-5, (i, "near-tie in the JS top-k")
  return out


def cheap_jit(fn, **static):
  """jax.jit with COMPILE_OPTIONS; `static` keyword arguments are bound."""
  return jax.jit(functools.partial(fn, **static), compiler_options=COMPILE_OPTIONS)


class Reference:
  """Unfused loss / gradient / statistics of one batch; everything jitted once."""

  def __init__(self, norm="selected"):
    graphdef, self.kw = model_and_params()[0], {"selected_norm": norm}  # loss.selected_norm

    def logp_fn(params, b):
      model = nnx.merge(graphdef, params)
      ids = jnp.concatenate([b["prompt_ids"], b["completion_ids"]], 1)
      mask = jnp.concatenate([b["prompt_mask"], b["completion_mask"]], 1)
      logits = model(ids, mask)[:, PROMPT - 1 : PROMPT + C - 1] / TEMP  # [N, C, V]
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b["completion_ids"][..., None], -1)[..., 0]
      return logp, logits

    def fwd_vjp(params, b, cotangent):  # chain rule: d loss / d params = vjp(d loss / d logp)
      logp, vjp, logits = jax.vjp(lambda p: logp_fn(p, b), params, has_aux=True)
      return logp, logits, vjp(cotangent)[0]

    self._fn = cheap_jit(fwd_vjp)
    self._loss_fns: dict = {}
    self._ict = cheap_jit(selection.ict_mask, top_fraction=0.1)
    self._entropy = cheap_jit(selection.entropy_mask)
    self._stapo = cheap_jit(selection.stapo_mask)

  def forward(self, params, batch):
    logp, logits, _ = self._fn(params, model_inputs(batch), jnp.zeros((N, C), jnp.float32))
    return np.asarray(logp), np.asarray(logits)

  def _loss(self, logp, old, adv, mask, token_mask, ref_logp, loss_type, beta):
    key = (old is None, ref_logp is None, loss_type, beta)
    if key not in self._loss_fns:

      def loss_and_cotangent(lp, old, adv, mask, token_mask, ref_logp):
        def f(lp):
          o = jax.lax.stop_gradient(lp) if old is None else old
          return grpo.policy_loss(
              lp, o, adv, mask, ref_logp=ref_logp, beta=beta, loss_type=loss_type, token_mask=token_mask, **self.kw
          )

        return jax.value_and_grad(f, has_aux=True)(lp)

      self._loss_fns[key] = cheap_jit(loss_and_cotangent)
    return self._loss_fns[key](logp, old, adv, mask, token_mask, ref_logp)

  def __call__(self, params, batch, method, loss_type, *, select=True, old_logp=None, ref_logp=None, beta=0.0):
    """Loss, metrics, gradient, logp and stats; select=False: the dense (warm-up) mask."""
    logp, logits = self.forward(params, batch)
    mask = batch.completion_mask.astype(bool)
    logp_all, entropy, renyi2, js = np_stats(logits, mask)
    adv = batch.advantages
    token_mask, lt = mask, loss_type
    if method != "grpo" and select:
      lt = selection.loss_type_for(method)
    if method == "ict" and select:
      token_mask = np_ict(js, mask, 0.1)
      np.testing.assert_array_equal(np.asarray(self._ict(js.astype(np.float32), mask)), token_mask)
    elif method == "entropy":
      token_mask = np.asarray(self._entropy(entropy.astype(np.float32), mask))
      kept, dropped = entropy[token_mask], entropy[mask & ~token_mask]
      assert kept.min() - dropped.max() > 1e-4, "near-tie at the entropy threshold"
      assert token_mask.sum() == math.ceil(Fraction(1, 5) * mask.sum())
    elif method == "stapo":
      ids = batch.completion_ids[..., None]
      prob = np.exp(np.take_along_axis(logp_all, ids, -1)[..., 0])
      tau_h = np.quantile(entropy[mask], 0.8)
      spurious = (adv[:, None] > 0) & (prob < 0.002) & (entropy < tau_h) & mask
      assert 0 < spurious.sum() < mask.sum() // 2, "STAPO must drop some tokens, not most"
      candidates = (adv[:, None] > 0) & mask
      assert np.abs(prob[candidates] - 0.002).min() > 1e-6
      assert np.abs(entropy[candidates] - tau_h).min() > 1e-4
      token_mask = np.asarray(self._stapo(prob.astype(np.float32), entropy.astype(np.float32), adv, mask))
      np.testing.assert_array_equal(token_mask, mask & ~spurious)

    (loss, metrics), cotangent = self._loss(jnp.asarray(logp), old_logp, adv, mask, token_mask, ref_logp, lt, beta)
    _, _, grads = self._fn(params, model_inputs(batch), cotangent)
    valid = mask.sum()
    sel = token_mask & mask
    unsel = mask & ~sel
    median = np.median(entropy[mask])  # the whole step's valid tokens, whatever the micro-batches
    assert np.min(np.abs(entropy[mask] - median)[entropy[mask] != median]) > 1e-4, "near-tie at the median"
    return dict(
        loss=float(loss),
        metrics={k: float(v) for k, v in metrics.items()},
        grads=grads,
        logp=logp,
        token_mask=token_mask,
        means=dict(
            entropy=entropy.sum() / valid,
            renyi2=renyi2.sum() / valid,
            selected_frac=sel.sum() / valid,
            js_selected=js[sel].mean(),
            js_unselected=js[unsel].mean() if unsel.any() else np.nan,  # no token: no mean
            selected_prob=np.exp(np.take_along_axis(logp_all, batch.completion_ids[..., None], -1)[..., 0])[sel].mean(),
            selected_high_entropy=(entropy[sel] > median).mean(),
        ),
    )


def model_inputs(batch):
  return {k: jnp.asarray(getattr(batch, k)) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}


# ----------------------------------------------------------------------------- compiled steps
def compile_step(cfg: ts.StepConfig, *, mesh=None, state_sharding=None, donate=False):
  """The function train.py calls (`make_train_step`), with cheap XLA:CPU code generation."""
  return ts.make_train_step(
      model_and_params()[0],
      cfg,
      optimizer(),
      mesh=mesh,
      state_sharding=state_sharding,
      donate=donate,
      compiler_options=COMPILE_OPTIONS,
  )


def step_config(method, loss_type="grpo", **kw):
  kw.setdefault("warmup_steps", 2)
  return tiny_step_config(group_size=G, temperature=TEMP, method=method, loss_type=loss_type, chunk_size=3, **kw)


def test_step_config_holds_the_run_config_sections():
  """The step reads `cfg.ict` / `cfg.loss` as they are, and is a static jit argument (hashable)."""
  from ict_jax import config as config_lib
  from ict_jax import configs

  cd = configs.tiny_config()
  cfg = config_lib.validate(cd)
  scfg = ts.StepConfig.from_config(cfg)
  assert scfg.ict is cfg.ict and scfg.loss is cfg.loss
  assert (scfg.group_size, scfg.temperature, scfg.micro_batch_size, scfg.max_completion_length) == (8, 1.0, 0, 4)
  again = ts.StepConfig.from_config(config_lib.validate(cd))
  assert again == scfg and hash(again) == hash(scfg)
  cd.rollout.temperature, cd.ict.top_fraction = 0.0, 0.5  # greedy rollouts: the step's logits at T = 1
  other = ts.StepConfig.from_config(config_lib.validate(cd))
  assert other.temperature == 1.0 and other.ict.top_fraction == 0.5 and other != scfg


@functools.cache
def _initial_state(step):
  return ts.init_train_state(model_and_params()[1], optimizer(), step=step)


def state_at(step, params=None):
  """A fresh TrainState at `step` (the steps below never donate their inputs)."""
  if params is None:
    return _initial_state(step)
  return ts.init_train_state(params, optimizer(), step=step)


def grads_of(state):
  return optax.tree_utils.tree_get(state.opt_state, "mu")


def assert_tree_close(a, b, atol, rtol=1e-4, what=""):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), atol=atol, rtol=rtol, err_msg=f"{what}{jax.tree_util.keystr(path)}"
    )


def check_against_reference(metrics, new_state, logp, ref):
  m = {k: float(v) for k, v in metrics.items()}
  np.testing.assert_allclose(m["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
  norm = float(optax.global_norm(ref["grads"]))
  np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-5)
  clipped = jax.tree.map(lambda g: g * min(1.0, MAX_GRAD_NORM / norm), ref["grads"])
  assert_tree_close(grads_of(new_state), clipped, atol=1e-5, what="grad ")
  np.testing.assert_allclose(np.asarray(logp), ref["logp"], atol=2e-5)
  for name in ("entropy", "renyi2"):
    np.testing.assert_allclose(m[name], ref["means"][name], rtol=1e-5)
  for name in ("js_selected", "js_unselected", "selected_prob", "selected_high_entropy"):
    np.testing.assert_allclose(m[name], ref["means"][name], rtol=1e-4, atol=1e-6)
  assert m["selected_frac"] == pytest.approx(ref["means"]["selected_frac"], abs=1e-7)
  for name, value in ref["metrics"].items():
    np.testing.assert_allclose(m[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
  assert m["skipped"] == 0 and m["total_skipped"] == 0


@pytest.fixture(scope="module")
def reference():
  return Reference()


@pytest.fixture(scope="module")
def batch():
  return make_batch()


_STEPS: dict = {}


@pytest.fixture(scope="module")
def steps():
  """name -> compiled step, built lazily and shared by all tests."""

  def get(name):
    if name not in _STEPS:
      method, loss_type, mb, norm = SPECS[name]
      _STEPS[name] = compile_step(step_config(method, loss_type, micro_batch_size=mb, selected_norm=norm))
    return _STEPS[name]

  yield get
  _STEPS.clear()


# name -> (method, loss_type, micro_batch_size, loss.selected_norm); micro-batched variants are checked against
# the whole-batch reference, so each also checks exact gradient accumulation for its loss type.
SPECS = {
    "grpo/grpo/mb=2G": ("grpo", "grpo", 2 * G, "selected"),
    "grpo/bnpo/mb=G": ("grpo", "bnpo", G, "selected"),
    "grpo/dr_grpo/mb=2G": ("grpo", "dr_grpo", 2 * G, "selected"),
    "grpo/dapo/mb=G": ("grpo", "dapo", G, "selected"),
    "entropy": ("entropy", "grpo", 0, "selected"),
    "stapo": ("stapo", "grpo", 0, "selected"),
    "ict": ("ict", "grpo", 0, "selected"),
    "ict/mb=G": ("ict", "grpo", G, "selected"),
    "ict/response/mb=G": ("ict", "grpo", G, "response"),  # a selected token weighs A / L_i
}


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(SPECS))
def test_step_matches_unfused_reference(name, steps, reference, batch):
  method, loss_type, _, norm = SPECS[name]
  # ICT starts past its warm-up (warmup_steps=2) so that selection is active
  new_state, metrics, logp = steps(name)(state_at(2 if method == "ict" else 0), batch)
  ref = (reference if norm == "selected" else Reference(norm))(model_and_params()[1], batch, method, loss_type)
  check_against_reference(metrics, new_state, logp, ref)
  if method != "grpo":
    assert 0 < ref["means"]["selected_frac"] < 1


def test_micro_batching_equals_one_big_batch(steps, batch):
  """Exact accumulation, checked directly on ICT; every loss type of method grpo is checked
  micro-batched (G or 2G rows) against the whole-batch reference in
  test_step_matches_unfused_reference."""
  for s0 in (state_at(2), state_at(0)):  # ICT selection, then the dense warm-up
    a_state, a_metrics, a_logp = steps("ict")(s0, batch)
    b_state, b_metrics, b_logp = steps("ict/mb=G")(s0, batch)
    assert_tree_close(grads_of(a_state), grads_of(b_state), atol=5e-6, rtol=1e-5)  # |g| <~ 1
    assert_tree_close(a_state.params, b_state.params, atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(a_logp, b_logp, rtol=1e-5, atol=1e-6)
    assert a_metrics.keys() == b_metrics.keys()
    for k in a_metrics:
      np.testing.assert_allclose(a_metrics[k], b_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_micro_batch_must_hold_whole_groups(batch):
  fn = ts.make_train_step(model_and_params()[0], step_config("ict", micro_batch_size=G + 2), optimizer(), donate=False)
  with pytest.raises(ValueError, match="micro_batch_size"):
    jax.eval_shape(fn, state_at(0), batch)


def test_ict_warmup_selects_everything_then_top_fraction(steps, reference, batch):
  step = steps("ict")
  state = state_at(0)
  dense = reference(model_and_params()[1], batch, "ict", "grpo", select=False)
  for i in range(3):
    params = state.params
    state, metrics, logp = step(state, batch)
    if i == 0:  # dense GRPO, the grpo loss over all valid tokens
      check_against_reference(metrics, state, logp, dense)
    if i < 2:
      assert float(metrics["selected_frac"]) == 1.0
      assert float(metrics["trained_tokens"]) == LENGTHS.sum()
    else:
      k = np.array([max(1, math.ceil(Fraction(1, 10) * n)) for n in LENGTHS])
      want = k.sum() / LENGTHS.sum()
      assert float(metrics["selected_frac"]) == pytest.approx(want, abs=1e-7)
      ref = reference(params, batch, "ict", "grpo")
      assert ref["token_mask"].sum(1).tolist() == k.tolist()
      assert float(metrics["trained_tokens"]) == k.sum()
      check_against_reference(metrics, state, logp, ref)
  assert int(state.step) == 3


def test_step_that_trains_no_token_reports_no_token_statistics(steps, batch):
  """Every completion masked out (as loss.mask_truncated_completions does when all are
  truncated): the step counts 0 trained tokens and its token means are NaN, not 0; the loss and
  the gradient are 0."""
  empty = batch.replace(completion_mask=np.zeros_like(batch.completion_mask))
  for s0 in (state_at(0), state_at(2)):  # ICT's dense warm-up, then its selection
    state, metrics, _ = steps("ict")(s0, empty)
    m = {k: float(v) for k, v in metrics.items()}
    assert m["trained_tokens"] == 0 and m["loss"] == 0 and m["grad_norm"] == 0 and m["skipped"] == 0
    token_means = ("entropy", "renyi2", "selected_frac", "js_selected", "js_unselected", "clip_frac", "kl")
    for name in token_means + ("selected_prob", "selected_high_entropy"):
      assert np.isnan(m[name]), name
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads_of(state)))


def test_non_finite_update_is_skipped(steps, batch):
  step = steps("grpo/grpo/mb=2G")
  s0 = state_at(0)
  bad = batch.replace(advantages=batch.advantages.copy())
  bad.advantages[2] = np.nan  # one row of the first micro-batch
  s1, m1, _ = step(s0, bad)
  assert int(m1["skipped"]) == 1 and int(m1["total_skipped"]) == 1
  assert not np.isfinite(float(m1["loss"]))
  jax.tree.map(np.testing.assert_array_equal, s1.params, s0.params)
  jax.tree.map(np.testing.assert_array_equal, s1.opt_state.inner_state, s0.opt_state.inner_state)

  s2, m2, _ = step(s1, batch)  # a finite step updates again
  assert int(m2["skipped"]) == 0 and int(m2["total_skipped"]) == 1
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), s2.params, s1.params))
  assert sum(moved) >= len(moved) - 2  # all but possibly the k biases (gradient 0 in theory)

  poisoned = jax.tree.map(np.array, s2.params)
  poisoned["layers"]["mlp"]["down_proj"]["kernel"][1, 3, 5] = np.nan  # layer 1 of the stack
  s3 = ts.TrainState(step=s2.step, params=poisoned, opt_state=s2.opt_state)
  s4, m4, _ = step(s3, batch)
  assert int(m4["skipped"]) == 1 and int(m4["total_skipped"]) == 2
  jax.tree.map(np.testing.assert_array_equal, s4.params, poisoned)
  assert int(s4.step) == int(s2.step) + 1


def test_old_logp_and_kl_penalty(reference, batch):
  """num_iterations > 1 (old_logp given) and beta > 0 with a frozen reference policy."""
  rng = np.random.default_rng(3)
  mask = batch.completion_mask.astype(bool)
  params = model_and_params()[1]
  logp0, _ = reference.forward(params, batch)
  # ratios 1.65, 1.11, 0.90, 0.61: two outside the clip range, none near its edges
  delta = rng.choice([-0.5, -0.1, 0.1, 0.5], size=(N, C)).astype(np.float32)
  with_old = batch.replace(old_logp=(logp0 + delta).astype(np.float32))
  cfg = step_config("grpo", "grpo", beta=BETA)
  step = compile_step(cfg)

  # ref == policy: KL 0; old_logp != logp: ratio = exp(-delta)
  state, metrics, logp = step(state_at(0), with_old, params)
  ref = reference(params, batch, "grpo", "grpo", old_logp=with_old.old_logp, ref_logp=logp0, beta=BETA)
  check_against_reference(metrics, state, logp, ref)
  assert abs(float(metrics["kl"])) < 1e-6
  ratio = np.exp(-delta.astype(np.float64))
  np.testing.assert_allclose(float(metrics["ratio_mean"]), ratio[mask].mean(), rtol=1e-4)
  adv = batch.advantages[:, None]
  high = ((ratio > 1.2) & (adv > 0))[mask].mean()
  low = ((ratio < 0.8) & (adv < 0))[mask].mean()
  assert high > 0 and low > 0
  assert float(metrics["clip_frac_high"]) == pytest.approx(high, abs=1e-6)
  assert float(metrics["clip_frac_low"]) == pytest.approx(low, abs=1e-6)
  assert float(metrics["clip_frac"]) == pytest.approx(high + low, abs=1e-6)

  # a policy that moved away from the reference: KL = mean k3(ref - logp) > 0
  moved = jax.tree.map(lambda x: x, params)
  moved["embed"]["embedding"] = params["embed"]["embedding"] * 1.3
  logp1, _ = reference.forward(moved, batch)
  on_policy = batch.replace(old_logp=logp1)
  state, metrics, logp = step(state_at(0, moved), on_policy, params)
  d = logp0.astype(np.float64) - logp1
  kl = (np.exp(d) - d - 1)[mask].mean()
  assert kl > 1e-2
  assert float(metrics["grad_norm"]) > MAX_GRAD_NORM  # exp(ref - logp) is large: clipped
  np.testing.assert_allclose(float(metrics["kl"]), kl, rtol=1e-3)
  assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
  ref = reference(moved, batch, "grpo", "grpo", old_logp=logp1, ref_logp=logp0, beta=BETA)
  check_against_reference(metrics, state, logp, ref)


@pytest.mark.parametrize("chunk", [1, 3, C, 100])  # 3 does not divide C = 23
def test_chunked_logp_and_stats_equal_unchunked(chunk, reference, batch):
  graphdef, params = model_and_params()

  def fn(p, b):
    return ts.completion_logp_and_stats(nnx.merge(graphdef, p), b, temperature=TEMP, group_size=G, chunk_size=chunk)

  logp, stats = cheap_jit(fn)(params, batch)
  ref_logp, logits = reference.forward(params, batch)
  mask = batch.completion_mask.astype(bool)
  logp_all, entropy, renyi2, js = np_stats(logits, mask)
  np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5)
  gathered = np.take_along_axis(logp_all, batch.completion_ids[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(logp), gathered, atol=2e-5)
  np.testing.assert_allclose(np.asarray(stats["entropy"]), entropy, atol=2e-5)
  np.testing.assert_allclose(np.asarray(stats["renyi2"]), renyi2, atol=2e-5)
  np.testing.assert_allclose(np.asarray(stats["js"]), js, atol=2e-6)
  assert np.all(np.asarray(stats["js"])[~mask] == 0)


EXPECTED_SPECS = {  # (data, fsdp, tensor) -> params path -> spec
    (2, 2, 2): {
        ("embed", "embedding"): P("tensor", "fsdp"),  # layers: stacked [L, ...], unsharded L
        ("layers", "attn", "q_proj", "kernel"): P(None, "fsdp", "tensor", None),
        ("layers", "mlp", "down_proj", "kernel"): P(None, "tensor", "fsdp"),
    },
    (1, 8, 1): {
        ("embed", "embedding"): P(None, "fsdp"),
        ("layers", "attn", "q_proj", "kernel"): P(None, "fsdp", None, None),
        ("layers", "mlp", "down_proj", "kernel"): P(None, None, "fsdp"),
    },
    (8, 1, 1): {
        ("embed", "embedding"): P(None, None),
        ("layers", "attn", "q_proj", "kernel"): P(None, None, None, None),
        ("layers", "mlp", "down_proj", "kernel"): P(None, None, None),
    },
}


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


@pytest.mark.parametrize("shape", list(EXPECTED_SPECS), ids=lambda s: "x".join(map(str, s)))
def test_sharded_step_equals_single_device(shape, steps, batch):
  single = steps("ict")
  expected = [(state_at(2), None, None)]
  for _ in range(2):
    expected.append(single(expected[-1][0], batch))

  graphdef, params = model_and_params()
  mesh = sharding.make_mesh(shape)
  abstract = nnx.state(nnx.merge(graphdef, params), nnx.Param)
  params_sharding = sharding.pure_shardings(abstract, mesh)
  state_sharding = ts.train_state_shardings(optimizer(), jax.eval_shape(lambda: params), params_sharding, mesh)
  state = ts.init_train_state(params, optimizer(), mesh=mesh, params_sharding=params_sharding, step=2)
  nu = optax.tree_utils.tree_get(state.opt_state, "nu")
  for path, spec in EXPECTED_SPECS[shape].items():
    assert _get(state.params, path).sharding.spec == spec, path
    for moment in (grads_of(state), nu):  # Adam moments are born in their params' sharding
      assert _get(moment, path).sharding.spec == spec, path
  assert state.step.sharding.spec == P()

  step = compile_step(step_config("ict"), mesh=mesh, state_sharding=state_sharding, donate=True)
  for i in range(2):
    state, metrics, logp = step(state, batch)
    want_state, want_metrics, want_logp = expected[i + 1]
    assert_tree_close(grads_of(state), grads_of(want_state), atol=1e-5, what=f"step {i} grad ")
    assert_tree_close(state.params, want_state.params, atol=1e-5, what=f"step {i} ")
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), rtol=1e-5, atol=1e-6)
    for k in want_metrics:
      np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for path, spec in EXPECTED_SPECS[shape].items():
      assert _get(state.params, path).sharding.spec == spec, path
      assert _get(grads_of(state), path).sharding.spec == spec, path
    assert logp.sharding.spec == P(("data", "fsdp"))
  assert float(metrics["selected_frac"]) < 1.0


@pytest.mark.parametrize(
    "score,keep,fraction,reference_",
    [
        ("js", "frequent", 0.9, "sequence_mean"),
        ("kl", "unique", 0.2, "others_mean"),
        ("entropy", "unique", 0.3, "active_mean"),
        ("random", "unique", 0.1, "active_mean"),
    ],
)
def test_ict_ablations_in_the_compiled_step(score, keep, fraction, reference_, batch):
  """ICT's ablations run inside the compiled step: each response keeps ceil(f * len) tokens,
  "frequent" keeps the lowest JS scores, and the update is finite."""
  step = compile_step(step_config("ict", score=score, keep=keep, top_fraction=fraction, reference=reference_))
  # a rollout's batch: even rows stop at their last token, odd ones are truncated; answers end mid-way
  stop_pos = np.where(np.arange(N) % 2 == 0, LENGTHS - 1, -1).astype(np.int32)
  answer_end = (LENGTHS // 2).astype(np.int32)
  batch = batch.replace(stop_pos=stop_pos, answer_end=answer_end)
  state, metrics, _ = step(state_at(2), batch)
  post = sum(n - n // 2 - (i % 2 == 0) for i, n in enumerate(LENGTHS))  # positions >= end, not the stop
  assert float(metrics["post_answer_frac"]) == pytest.approx(post / LENGTHS.sum(), rel=1e-6)
  assert float(metrics["stop_advantage"]) == pytest.approx(batch.advantages[::2].mean(), rel=1e-5)
  shares = ("selected_stop_share", "selected_post_answer_share", "stop_selected_rate")
  assert all(0 <= float(metrics[k]) <= 1 for k in shares) and float(metrics["stop_entropy"]) > 0
  k = np.array([max(1, math.ceil(Fraction(str(fraction)) * n)) for n in LENGTHS])
  assert float(metrics["selected_frac"]) == pytest.approx(k.sum() / LENGTHS.sum(), abs=1e-7)
  assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
  if keep == "frequent":
    assert float(metrics["js_selected"]) < float(metrics["js_unselected"])
  if score == "js" and reference_ == "active_mean" and keep == "unique":
    assert float(metrics["js_selected"]) > float(metrics["js_unselected"])
