"""GRPO advantages and the clipped-surrogate policy loss.

Numerics follow TRL 1.16 ``GRPOTrainer`` (``_generate_and_score_completions`` for the
advantages, ``_compute_loss`` for the loss), written for JAX arrays: every function here is
pure and jit-able; the arguments that change shapes or Python control flow (``group_size``,
``scale``, ``loss_type``, ``max_completion_length``) must be static under ``jax.jit``.

Exact gradient accumulation. ``policy_loss_terms`` returns ``LossTerms(numerator,
denominator, metrics)``. Summing the terms of several micro-batches (``jax.tree.map(jnp.add,
a, b)``) and calling ``loss_from_terms`` gives the loss of the whole batch, for every loss
type; because the denominator never depends on the parameters, the gradient of the full
loss is ``sum_k grad(numerator_k) / denominator`` as well. (TRL instead divides each
micro-batch loss by the number of accumulation steps, which is exact only for equal-sized
micro-batches and for "dapo".)

Selection masks. ``token_mask`` (ICT, 20-Entropy, STAPO, see ``selection.py``) multiplies
the completion mask: ``M = mask * token_mask`` is used both to zero the per-token loss
(clipped surrogate *and* KL penalty, the ICT paper's psi) and as the normaliser. TRL's own
``entropy_mask`` zeroes only the surrogate and keeps normalising by the completion mask; with
``token_mask=None`` the two coincide.

Normalising a selection (``selected_norm``, config ``loss.selected_norm``). With k_i of the L_i
valid tokens of response i selected, "selected" (the default) normalises by M itself: the
per-sequence loss ("grpo", ICT) is sum_t L_t M_t / k_i, so a selected token weighs A / k_i, and
the token-mean losses ("bnpo", "dapo": 20-Entropy, STAPO) divide by the selected tokens of the
step, sum M. "response" applies M inside the ordinary per-token mean over all valid tokens:
sum_t L_t M_t / L_i per sequence (A / L_i, as in GRPO without selection), sum(L M) / sum(mask) for
the token means, as TRL's ``entropy_mask``. "dr_grpo" divides by a constant and is the same under
both; so is every loss without a token_mask.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "ADVANTAGE_SCALES",
    "LOSS_TYPES",
    "LossTerms",
    "LossType",
    "SELECTED_NORMS",
    "finalize_metrics",
    "get_loss_type",
    "group_advantages",
    "loss_from_terms",
    "policy_loss",
    "policy_loss_terms",
]

ADVANTAGE_SCALES = ("group", "batch", "none")


def _unbiased_std(centered: jax.Array, axis: int | None) -> jax.Array:
  """sqrt(sum(x^2) / (n - 1)) of already-centred values; 0 when n == 1 (torch gives NaN)."""
  n = centered.size if axis is None else centered.shape[axis]
  if n < 2:
    return jnp.zeros_like(jnp.sum(centered, axis=axis, keepdims=axis is not None))
  return jnp.sqrt(jnp.sum(centered**2, axis=axis, keepdims=axis is not None) / (n - 1))


def group_advantages(rewards: jax.Array, group_size: int, scale: str = "group", eps: float = 1e-4) -> jax.Array:
  """Group-relative advantages, TRL ``scale_rewards`` semantics.

  Args:
    rewards: [N] with N = num_prompts * group_size; rows g*G .. g*G+G-1 are the G
      completions of prompt g.
    group_size: G (static).
    scale: "group": A = (r - group mean) / (unbiased group std + eps);
      "batch": A = (r - group mean) / (unbiased std of all N rewards + eps);
      "none": A = r - group mean.
    eps: added to the std (TRL hard-codes 1e-4).

  Returns:
    [N] float32 (float64 under x64 for float64 rewards). A group whose rewards are all
    equal gets exactly 0 (not a rounding residue, never NaN), and so does group_size=1.
  """
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"grpo.group_advantages: scale={scale!r}; expected one of {ADVANTAGE_SCALES}")
  if rewards.ndim != 1:
    raise ValueError(f"grpo.group_advantages: rewards must be [N], got shape {rewards.shape}")
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(
        f"grpo.group_advantages: N={rewards.shape[0]} is not a positive multiple of " f"group_size={group_size}"
    )
  r = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
  grouped = r.reshape(-1, group_size)  # [P, G]
  centered = grouped - grouped.mean(axis=1, keepdims=True)  # [P, G]
  constant = grouped.max(axis=1, keepdims=True) == grouped.min(axis=1, keepdims=True)
  if scale == "group":
    adv = centered / (_unbiased_std(centered, axis=1) + eps)
  elif scale == "batch":
    adv = centered / (_unbiased_std(r - r.mean(), axis=None) + eps)
  else:
    adv = centered
  return jnp.where(constant, jnp.zeros_like(adv), adv).reshape(-1)


# ----------------------------------------------------------------------------- loss types
class LossType(NamedTuple):
  """How per-token losses L*M [B, T] are reduced to (numerator, denominator)."""

  display_name: str
  reduce: Callable[[jax.Array, jax.Array, int], tuple[jax.Array, jax.Array]]
  description: str


def _per_sequence_mean(weighted, m, length):
  del length
  seq = weighted.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)  # [B]
  return seq.sum(), jnp.asarray(weighted.shape[0], weighted.dtype)


def _token_mean(weighted, m, length):
  del length
  return weighted.sum(), m.sum()


def _constant_length(weighted, m, length):
  del m
  return weighted.sum(), jnp.asarray(weighted.shape[0] * length, weighted.dtype)


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(
        "GRPO",
        _per_sequence_mean,
        "mean over sequences of sum_t(L*M)/max(sum_t M, 1); terms: (sum of per-sequence means, B)",
    ),
    "bnpo": LossType("BNPO", _token_mean, "sum(L*M)/max(sum(M), 1) over the batch; terms: (sum L*M, sum M)"),
    "dr_grpo": LossType(
        "Dr. GRPO",
        _constant_length,
        "sum(L*M)/(B*max_completion_length); terms: (sum L*M, B*max_completion_length)",
    ),
    "dapo": LossType(
        "DAPO",
        _token_mean,
        "sum(L*M)/num_items, num_items = selected tokens of the whole step (all micro-batches, "
        "all hosts); terms: (sum L*M, sum M)",
    ),
}


SELECTED_NORMS: dict[str, str] = {
    "selected": "normalise by the selected tokens M (a selected token weighs A / k_i in a per-sequence "
    "mean over k_i selected tokens)",
    "response": "normalise by all valid tokens (M applied inside the ordinary per-token mean: a selected "
    "token weighs A / L_i, as in GRPO)",
}


def get_loss_type(name: str) -> LossType:
  """Registry lookup; unknown names raise ValueError listing the valid ones."""
  if name not in LOSS_TYPES:
    raise ValueError(f"grpo: unknown loss_type={name!r}; expected one of {sorted(LOSS_TYPES)}")
  return LOSS_TYPES[name]


# ----------------------------------------------------------------------------- the loss
class LossTerms(NamedTuple):
  """Additive pieces of the loss: loss = numerator / max(denominator, 1).

  metrics maps a name to (sum, count); all leaves add across micro-batches.
  """

  numerator: jax.Array
  denominator: jax.Array
  metrics: dict[str, tuple[jax.Array, jax.Array]]


def loss_from_terms(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """The loss from (possibly accumulated) terms; an empty batch gives 0, not NaN."""
  return numerator / jnp.maximum(denominator, 1.0)


def finalize_metrics(metrics: dict[str, tuple[jax.Array, jax.Array]]) -> dict[str, jax.Array]:
  """(sum, count) pairs -> means; NaN where count == 0 (a mean over no token, e.g. the entropy of a
  step whose every completion was masked out, is not 0; the logs show it as missing)."""
  return {k: jnp.where(c > 0, s / jnp.maximum(c, 1.0), jnp.nan) for k, (s, c) in metrics.items()}


def _is_zero(x) -> bool:
  return isinstance(x, (int, float)) and x == 0


def policy_loss_terms(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "dapo",
    token_mask: jax.Array | None = None,
    max_completion_length: int | None = None,
    num_rows: jax.Array | None = None,
    selected_norm: str = "selected",
) -> LossTerms:
  """Clipped-surrogate loss as additive (numerator, denominator, metrics).

  Args:
    logp: [B, T] log pi_theta(y_t) (differentiated).
    old_logp: [B, T] log pi_old(y_t) of the sampling policy (no gradient); pass
      ``jax.lax.stop_gradient(logp)`` for on-policy steps (TRL's default).
    advantages: [B] one per completion.
    mask: [B, T] completion mask (1 on valid tokens, EOS included).
    ref_logp: [B, T] reference-policy log-probs; the k3 penalty is added when given and
      beta is not the literal 0.
    beta: KL coefficient (may be traced).
    epsilon_low, epsilon_high: clip range [1 - eps_low, 1 + eps_high] (clip-higher).
    loss_type: one of LOSS_TYPES (static).
    token_mask: [B, T] optional selection (bool or 0/1); M = mask * token_mask.
    max_completion_length: T used by "dr_grpo" (static); default mask.shape[1].
    num_rows: the completions among the B rows (default B): a token-budget micro-batch's empty
      row slots (`PackedLayout.source_row` -1, all-zero masks) count in no per-sequence denominator.
    selected_norm: a key of ``SELECTED_NORMS`` (static): the loss type's denominator counts the
      selected tokens M ("selected") or every valid token ("response"); see the module docstring.

  Per token: ratio = exp(logp - old_logp);
    L = -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A) + beta*k3,
    k3 = exp(ref - logp) - (ref - logp) - 1.
  Metrics (sum, count over M, no gradient): clip_frac_low (ratio < 1-eps_low and A < 0),
  clip_frac_high (ratio > 1+eps_high and A > 0), clip_frac (either), kl (mean k3, 0
  without ref_logp), ratio_mean.
  """
  kind = get_loss_type(loss_type)
  if selected_norm not in SELECTED_NORMS:
    raise ValueError(f"grpo: unknown selected_norm={selected_norm!r}; expected one of {sorted(SELECTED_NORMS)}")
  if logp.ndim != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
    raise ValueError(
        "grpo.policy_loss: logp, old_logp and mask must all be [B, T]; got "
        f"{logp.shape}, {old_logp.shape}, {mask.shape}"
    )
  if advantages.shape != logp.shape[:1]:
    raise ValueError(f"grpo.policy_loss: advantages must be [B]={logp.shape[:1]}, got {advantages.shape}")
  for name, extra in (("ref_logp", ref_logp), ("token_mask", token_mask)):
    if extra is not None and extra.shape != logp.shape:
      raise ValueError(f"grpo.policy_loss: {name} must be {logp.shape}, got {extra.shape}")
  length = mask.shape[1] if max_completion_length is None else int(max_completion_length)

  dtype = jnp.promote_types(logp.dtype, jnp.float32)
  logp = logp.astype(dtype)
  old_logp = jax.lax.stop_gradient(old_logp.astype(dtype))
  adv = jax.lax.stop_gradient(advantages.astype(dtype))[:, None]  # [B, 1]
  m = mask.astype(dtype)
  if token_mask is not None:
    m = m * token_mask.astype(dtype)
  m = jax.lax.stop_gradient(m)  # [B, T]

  ratio = jnp.exp(logp - old_logp)  # [B, T]
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)  # [B, T]
  if ref_logp is not None:
    delta = jax.lax.stop_gradient(ref_logp.astype(dtype)) - logp
    k3 = jnp.exp(delta) - delta - 1.0  # [B, T]
    if not _is_zero(beta):
      per_token = per_token + beta * k3
  else:
    k3 = jnp.zeros_like(per_token)

  norm = m if selected_norm == "selected" else jax.lax.stop_gradient(mask.astype(dtype))  # [B, T]
  numerator, denominator = kind.reduce(per_token * m, norm, length)
  if num_rows is not None and kind.reduce is not _token_mean:  # B counted by the per-row types
    denominator = denominator / logp.shape[0] * jnp.asarray(num_rows, denominator.dtype)  # exact

  sg_ratio = jax.lax.stop_gradient(ratio)
  low = ((sg_ratio < 1.0 - epsilon_low) & (adv < 0)).astype(dtype)
  high = ((sg_ratio > 1.0 + epsilon_high) & (adv > 0)).astype(dtype)
  count = m.sum()
  msum = lambda x: jnp.sum(x * m)  # noqa: E731
  metrics = {
      "clip_frac_low": (msum(low), count),
      "clip_frac_high": (msum(high), count),
      "clip_frac": (msum(jnp.maximum(low, high)), count),
      "kl": (msum(jax.lax.stop_gradient(k3)), count),
      "ratio_mean": (msum(sg_ratio), count),
  }
  return LossTerms(numerator, denominator, metrics)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "dapo",
    token_mask: jax.Array | None = None,
    num_items: jax.Array | int | None = None,
    max_completion_length: int | None = None,
    selected_norm: str = "selected",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Scalar loss and metric means; see ``policy_loss_terms`` for the arguments.

  num_items ("dapo" only): the number of selected valid tokens of the whole optimisation
  step, summed over micro-batches and hosts; the loss is sum(L*M) / num_items, so summing
  the gradients of the micro-batch losses gives the step's gradient. Default: sum(M) of
  this call (then "dapo" equals "bnpo").
  """
  terms = policy_loss_terms(
      logp,
      old_logp,
      advantages,
      mask,
      ref_logp=ref_logp,
      beta=beta,
      epsilon_low=epsilon_low,
      epsilon_high=epsilon_high,
      loss_type=loss_type,
      token_mask=token_mask,
      max_completion_length=max_completion_length,
      selected_norm=selected_norm,
  )
  denominator = terms.denominator
  if num_items is not None:
    if loss_type != "dapo":
      raise ValueError(f"grpo.policy_loss: num_items is only used by loss_type='dapo', got {loss_type!r}")
    denominator = jnp.asarray(num_items, terms.numerator.dtype)
  return loss_from_terms(terms.numerator, denominator), finalize_metrics(terms.metrics)
