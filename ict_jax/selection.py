"""Token selection inside the jitted train step: GRPO (all), 20-Entropy, STAPO, ICT.

Everything sees arrays only and is jit-able; fractions, quantiles, group sizes, chunk sizes
and method names are Python values (static under ``jax.jit``).

Logits statistics are computed chunk by chunk over the sequence: ``chunk_stats`` turns one
[N, C, V] chunk of (temperature-scaled) logits into Shannon entropy, Renyi-2 entropy and the
ICT Jensen-Shannon score in a single pass, so the train step can fuse it with the LM-head
matmul; ``sequence_stats`` / ``token_stats`` / ``js_scores`` run it over a full [N, T, V]
array with a ``fori_loop`` over T-chunks that slices the logits in place (the last chunk is
shifted left to end at T and overlaps its predecessor instead of padding, so no padded copy
of the logits is made). With ``kernels="cpu"`` (``ict_jax.cpu_paths``: XLA:CPU on one device),
``chunk_stats`` computes the same values over 2-D [<= 16 positions, V] slices of each response.

The masks that turn scores into selected tokens are `ict_jax.token_masks`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ict_jax.grpo import LOSS_TYPES
from ict_jax import cpu_paths
from ict_jax.token_masks import KEEPS, entropy_mask, ict_mask, masked_quantile, stapo_mask

if TYPE_CHECKING:  # the run config reads this module's registries: no import of it at run time
  from ict_jax.config import IctConfig

__all__ = [
    "KEEPS",
    "REFERENCES",
    "SCORES",
    "SELECTORS",
    "SEQUENCE_REFERENCE",
    "Score",
    "Selector",
    "chunk_stats",
    "entropy_mask",
    "ict_mask",
    "js_scores",
    "loss_type_for",
    "masked_quantile",
    "select_tokens",
    "selection_metrics",
    "sequence_reference",
    "sequence_stats",
    "signature_metrics",
    "stapo_mask",
    "token_stats",
]

LOG2 = math.log(2.0)

# The ICT ablations (config ict.reference / ict.keep / ict.score). What the paper compares the
# JS score against is not stated in what we have of it; "active_mean" is our reading.
REFERENCES: dict[str, str] = {
    "active_mean": "P_t = mean of p_{j,t} over the group's rollouts j still active at t, the "
    "scored rollout included (our reading; the default)",
    "others_mean": "P_{i,t} = mean over the group's other rollouts j != i active at t "
    "(leave-one-out; score 0 where no other rollout is active)",
    "sequence_mean": "P_i = mean of p_{i,s} over the real positions s of response i itself (a "
    "reading of the paper's 'distinctive distributional patterns': no position alignment "
    "across rollouts)",
}
SEQUENCE_REFERENCE = "sequence_mean"  # the reference that needs a pass over the whole response first


# ----------------------------------------------------------------------------- helpers
def _xlogy_ratio(p: jax.Array, log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """p * (log p - log q) with 0 log 0 = 0 (also when log_p is -inf)."""
  return jnp.where(p > 0, p * (log_p - log_q), 0.0)


def _safe_log(x: jax.Array) -> jax.Array:
  return jnp.log(jnp.where(x > 0, x, 1.0))


# ----------------------------------------------------------------------------- logits stats
def _entropies(logits: jax.Array, lse: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """logits [..., V] -> (p, log p, Shannon H, Renyi-2 H2), float32, no gradient.

  ``lse`` [...]: the rows' logsumexp when the caller already has it (saves two passes)."""
  logits = jax.lax.stop_gradient(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)))
  if lse is None:
    logp = jax.nn.log_softmax(logits, axis=-1)  # [..., V]
  else:
    logp = logits - jax.lax.stop_gradient(lse)[..., None]
  p = jnp.exp(logp)
  entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # [...]
  renyi2 = -jax.nn.logsumexp(2.0 * logp, axis=-1)  # -log sum p^2
  return p, logp, entropy, renyi2


def _group_reference(pg: jax.Array, w: jax.Array, group_size: int, reference: str) -> tuple[jax.Array, jax.Array]:
  """pg [P, G, C, V], w [P, G, C, 1] -> (reference P [P, 1 or G, C, V], has-reference [P, *, C, 1]).

  See ``REFERENCES``: "active_mean" is the mean of the active rollouts' p (the same for all
  members); "others_mean" leaves the scored rollout out (none -> no reference, score 0)."""
  if reference == "active_mean":
    # One reduction over the group axis: local when a device holds whole groups, else one
    # all-reduce of [P, 1, C, V] over the devices that share a group (G - 1 slices of a
    # sharded group axis would each move a [C, V] block). XLA:CPU on one device takes the
    # row-blocked path (cpu_paths.blocked_stats), where this strided reduction's speed does not matter.
    active = w.sum(axis=1, keepdims=True)  # [P, 1, C, 1]
    total = (pg * w).sum(axis=1, keepdims=True)  # [P, 1, C, V]
    return total / jnp.maximum(active, 1.0), (active > 0).astype(pg.dtype)
  # others_mean (an ablation): per-member sums, so G slices of the group axis
  members = [(pg[:, g : g + 1] * w[:, g : g + 1], w[:, g : g + 1]) for g in range(group_size)]
  others = [_sum_of_others(members, g) for g in range(group_size)]
  total = jnp.concatenate([o[0] for o in others], axis=1)  # [P, G, C, V]
  count = jnp.concatenate([o[1] for o in others], axis=1)  # [P, G, C, 1]
  return total / jnp.maximum(count, 1.0), (count > 0).astype(pg.dtype)


def _segment_reference(pg: jax.Array, w: jax.Array, seg: jax.Array, reference: str) -> tuple[jax.Array, jax.Array]:
  """`_group_reference` when a stripe of G rows holds several groups' pieces (the packed LM head):
  pg [P, G, C, V], w [P, G, C, 1], seg [P, G, C] -> (P [P, G, C, V], has-reference [P, G, C, 1]),
  row g's reference the mean of p over the active rows h of its stripe with seg[h] == seg[g]
  ("others_mean": h != g), one weighted sum (no subtraction) per row."""
  same = (seg[:, :, None, :] == seg[:, None, :, :]).astype(pg.dtype)  # [P, G(g), G(h), C]
  weights = same * w[:, None, :, :, 0]  # row h's weight in row g's reference
  if reference != "active_mean":  # others_mean
    weights = weights * (1.0 - jnp.eye(pg.shape[1], dtype=pg.dtype))[None, :, :, None]
  # a sum of probabilities, not a matmul to round: full float32 on the MXU as well
  total = jnp.einsum("pghc,phcv->pgcv", weights, pg, precision=jax.lax.Precision.HIGHEST)
  count = weights.sum(axis=2)[..., None]  # [P, G, C, 1]
  return total / jnp.maximum(count, 1.0), (count > 0).astype(pg.dtype)


def _sum_of_others(members, i):
  """Sum of the tuples members[j], j != i, added directly: (total - member i) would cancel
  catastrophically where member i holds most of the mass."""
  rest = [m for j, m in enumerate(members) if j != i]
  return tuple(sum(parts[1:], parts[0]) for parts in zip(*rest))


def _js_to(p: jax.Array, logp: jax.Array, big_p: jax.Array, valid: jax.Array, kl: bool) -> dict[str, jax.Array]:
  """p, logp [..., V], a reference big_p broadcastable to them, valid [...] ->
  {"js": JS(p || P) [...]} (+ "kl": KL(p || P)), 0 where valid == 0."""
  log_big_p = _safe_log(big_p)
  log_mid = _safe_log(0.5 * (p + big_p))
  kl_p = _xlogy_ratio(p, logp, log_mid).sum(axis=-1)
  kl_big = _xlogy_ratio(jnp.broadcast_to(big_p, p.shape), log_big_p, log_mid).sum(axis=-1)
  out = {"js": jnp.clip(0.5 * (kl_p + kl_big), 0.0, LOG2) * valid}
  if kl:
    log_ref = jnp.log(jnp.maximum(big_p, _TINY))
    out["kl"] = jnp.maximum(_xlogy_ratio(p, logp, log_ref).sum(axis=-1), 0.0) * valid
  return out


def _js_to_group_mean(
    p: jax.Array,
    logp: jax.Array,
    mask: jax.Array,
    group_size: int,
    reference: str = "active_mean",
    kl: bool = False,
    seq_ref: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """p, logp [N, C, V], mask [N, C] -> {"js": JS(p_i || P) [N, C]} (+ "kl": KL(p_i || P)).

  seq_ref [N, V]: the "sequence_mean" reference (default: the mean over this chunk's positions).
  segments [N, C]: the reference of row i at a position is over the rows of its G with the same
  segment there (`_segment_reference`); default: all G rows."""
  n, c, v = p.shape  # chunk_stats has checked that G divides N
  if reference == SEQUENCE_REFERENCE:
    if seq_ref is None:
      seq_ref = _mean_over_positions(p, mask)
    return _js_to(p, logp, seq_ref[:, None, :].astype(p.dtype), mask.astype(p.dtype), kl)
  pg = p.reshape(n // group_size, group_size, c, v)  # [P, G, C, V]
  w = mask.astype(p.dtype).reshape(n // group_size, group_size, c, 1)  # [P, G, C, 1]
  if segments is None:
    big_p, has_ref = _group_reference(pg, w, group_size, reference)
  else:
    big_p, has_ref = _segment_reference(pg, w, segments.reshape(pg.shape[:3]), reference)
  out = _js_to(pg, logp.reshape(pg.shape), big_p, (w * has_ref)[..., 0], kl)
  return {k: x.reshape(n, c) for k, x in out.items()}


def _mean_over_positions(p: jax.Array, mask: jax.Array) -> jax.Array:
  """p [N, C, V], mask [N, C] -> [N, V]: each row's mean of p over its real positions."""
  w = mask.astype(p.dtype)
  return jnp.einsum("ncv,nc->nv", p, w) / jnp.maximum(w.sum(axis=1), 1.0)[:, None]


def sequence_reference(logits: jax.Array, mask: jax.Array, chunk_size: int = 128) -> jax.Array:
  """The "sequence_mean" reference: P_i = (1 / len_i) sum_s mask[i, s] softmax(logits[i, s]),
  [N, V] float32, no gradient, from logits [N, T, V] (temperature-scaled) and mask [N, T], summed
  in T-chunks of `chunk_size` (the logits sliced in place, as `sequence_stats`)."""
  n, t, v = logits.shape
  c = max(1, min(int(chunk_size), t))
  valid = mask.astype(jnp.float32)

  def body(k, total):
    start = jnp.minimum(k * c, t - c)  # the last chunk overlaps its predecessor: count each s once
    x = jax.lax.stop_gradient(jax.lax.dynamic_slice_in_dim(logits, start, c, axis=1)).astype(jnp.float32)
    w = jax.lax.dynamic_slice_in_dim(valid, start, c, axis=1) * (start + jnp.arange(c) >= k * c)
    return total + jnp.einsum("ncv,nc->nv", jax.nn.softmax(x, axis=-1), w)

  total = jax.lax.fori_loop(0, -(-t // c), body, jnp.zeros((n, v), jnp.float32))
  return total / jnp.maximum(valid.sum(axis=1), 1.0)[:, None]


_TINY = 1e-37  # floor inside log(): 0 * log(floor) = 0 where the exact value is 0 log 0


def chunk_stats(
    logits_chunk: jax.Array,
    mask_chunk: jax.Array,
    group_size: int | None,
    lse: jax.Array | None = None,
    *,
    reference: str = "active_mean",
    kl: bool = False,
    kernels: str = "portable",
    seq_ref: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """One pass over a logits chunk -> per-token statistics, all [N, C] float32, no gradient.

  Args:
    logits_chunk: [N, C, V] logits already divided by the sampling temperature.
    mask_chunk: [N, C] completion mask (1 = active).
    group_size: G; rows g*G .. g*G+G-1 are the rollouts of prompt g. None skips "js".
    lse: optional [N, C] logsumexp of the logits (the LM head has it already).
    reference: the distribution P the scores compare with, a key of ``REFERENCES``.
    kl: also return "kl" = KL(p || P) (the "kl" score of the ICT ablation).
    kernels: "portable" (one fused [N, C, V] pass) or "cpu" (the same values over 2-D row
      blocks, ``cpu_paths.blocked_stats``, for a vocabulary of ``cpu_paths.BLOCKED_MIN_VOCAB`` or
      more); see ``ict_jax.cpu_paths``.
    seq_ref: [N, V] the "sequence_mean" reference of each row (``sequence_reference`` of the
      whole response); default: the mean over this chunk's real positions, the same when the
      chunk holds the whole response.
    segments: [N, C] int: several groups' pieces stacked in one stripe of G rows (the packed
      LM head, `packing.pack_batch`): a row's reference is over the rows of its stripe with the
      same segment at that position. Always the portable formulation.

  Returns dict with
    entropy: H = -sum_v p log p;  renyi2: H2 = -log sum_v p^2;
    js: 0.5 KL(p||m) + 0.5 KL(P||m), m = (p + P)/2, P the reference (default: the mean of p
      over the group's rows active at that position), natural log, in [0, log 2];
  every entry is 0 where mask_chunk == 0.
  """
  if group_size is not None and (group_size < 1 or logits_chunk.shape[0] % group_size):
    raise ValueError(
        f"selection: N={logits_chunk.shape[0]} rows is not a positive multiple " f"of group_size={group_size}"
    )
  if reference not in REFERENCES:
    raise ValueError(f"selection: unknown reference={reference!r}; expected one of {sorted(REFERENCES)}")
  if kernels not in cpu_paths.KERNELS:
    raise ValueError(f"selection: unknown kernels={kernels!r}; expected one of {cpu_paths.KERNELS}")
  if kernels == "cpu" and segments is None and cpu_paths.use_blocked_stats(logits_chunk.shape[-1]):
    logits = jax.lax.stop_gradient(logits_chunk.astype(jnp.promote_types(logits_chunk.dtype, jnp.float32)))
    lse = jax.nn.logsumexp(logits, axis=-1) if lse is None else lse
    if reference == SEQUENCE_REFERENCE and seq_ref is None and group_size is not None:
      seq_ref = _mean_over_positions(jnp.exp(logits - jax.lax.stop_gradient(lse)[..., None]), mask_chunk)
    return cpu_paths.blocked_stats(
        logits,
        jax.lax.stop_gradient(lse).astype(logits.dtype),
        mask_chunk.astype(logits.dtype),
        group_size,
        reference=reference,
        kl=kl,
        seq_ref=seq_ref,
    )
  p, logp, entropy, renyi2 = _entropies(logits_chunk, lse)
  valid = mask_chunk.astype(entropy.dtype)
  out = {"entropy": entropy * valid, "renyi2": renyi2 * valid}
  if group_size is not None:
    out.update(_js_to_group_mean(p, logp, mask_chunk, group_size, reference, kl, seq_ref, segments))
  return out


def sequence_stats(
    logits: jax.Array,
    mask: jax.Array | None = None,
    group_size: int | None = None,
    chunk_size: int = 128,
    *,
    reference: str = "active_mean",
    kl: bool = False,
    kernels: str = "portable",
) -> dict[str, jax.Array]:
  """``chunk_stats`` over logits [N, T, V] in T-chunks of ``chunk_size`` -> dict of [N, T]."""
  n, t, _ = logits.shape
  if mask is None:
    mask = jnp.ones((n, t), jnp.float32)
  if mask.shape != (n, t):
    raise ValueError(f"selection: mask must be [N, T]={(n, t)}, got {mask.shape}")
  if chunk_size < 1:
    raise ValueError(f"selection: chunk_size={chunk_size}; expected >= 1")
  c = min(int(chunk_size), t)
  n_chunks = -(-t // c)
  names = ("entropy", "renyi2") + (("js",) + (("kl",) if kl else ()) if group_size is not None else ())
  dtype = jnp.promote_types(logits.dtype, jnp.float32)
  seq_ref = sequence_reference(logits, mask, c) if reference == SEQUENCE_REFERENCE and group_size is not None else None

  def body(k, out):
    start = jnp.minimum(k * c, t - c)  # last chunk ends at T, overlapping the previous one
    stats = chunk_stats(
        jax.lax.dynamic_slice_in_dim(logits, start, c, axis=1),  # [N, C, V]
        jax.lax.dynamic_slice_in_dim(mask, start, c, axis=1),  # [N, C]
        group_size,
        reference=reference,
        kl=kl,
        kernels=kernels,
        seq_ref=seq_ref,
    )
    return {name: jax.lax.dynamic_update_slice_in_dim(out[name], stats[name], start, axis=1) for name in names}

  init = {name: jnp.zeros((n, t), dtype) for name in names}
  return jax.lax.fori_loop(0, n_chunks, body, init)


def token_stats(
    logits: jax.Array, mask: jax.Array | None = None, chunk_size: int = 128, *, kernels: str = "portable"
) -> dict[str, jax.Array]:
  """Shannon and Renyi-2 entropy [N, T] of logits [N, T, V] (0 where mask == 0)."""
  return sequence_stats(logits, mask, None, chunk_size, kernels=kernels)


def js_scores(
    logits: jax.Array, mask: jax.Array, group_size: int, chunk_size: int = 128, *, kernels: str = "portable"
) -> jax.Array:
  """ICT score u [N, T] = JS(p_{i,t} || P_t) per token, 0 on padding, no gradient."""
  return sequence_stats(logits, mask, group_size, chunk_size, kernels=kernels)["js"]


# ----------------------------------------------------------------------------- registry
class Selector(NamedTuple):
  """A token-selection method: which inputs it needs and the loss type it trains with.

  loss_type None means "the configured dense loss type" (plain GRPO). `fn(mask, cfg, **inputs)`
  gets the run's `IctConfig` as cfg.
  """

  needs: tuple[str, ...]
  loss_type: str | None
  fn: Callable[..., jax.Array]
  description: str


SELECTORS: dict[str, Selector] = {
    "grpo": Selector(
        (),
        None,
        lambda mask, **_: mask.astype(bool),
        "all valid tokens; the configured loss type",
    ),
    "entropy": Selector(
        ("entropy",),
        "bnpo",
        lambda mask, entropy, cfg, **_: entropy_mask(entropy, mask, cfg.entropy_top_fraction),
        "20-Entropy: top 20% entropy tokens of the batch; token mean over the selected tokens "
        "(bnpo over M, as verl's token-mean with the entropy-masked response mask)",
    ),
    "stapo": Selector(
        ("token_prob", "entropy", "advantages"),
        "bnpo",
        lambda mask, token_prob, entropy, advantages, cfg, **_: stapo_mask(
            token_prob, entropy, advantages, mask, cfg.stapo_tau_p, cfg.stapo_tau_h_quantile
        ),
        "STAPO: drop positive-advantage low-probability low-entropy tokens; token mean over "
        "the kept tokens (bnpo over M)",
    ),
    "ict": Selector(
        ("u",),
        "grpo",  # ("u",) for the default score; select_tokens asks for the chosen one
        lambda mask, cfg, **inputs: ict_mask(inputs[SCORES[cfg.score].input], mask, cfg.top_fraction, cfg.keep),
        "ICT: top 10% JS tokens of each response; Sparse-GRPO, i.e. per-sequence mean over "
        "the selected tokens then mean over sequences (grpo over M)",
    ),
}


class Score(NamedTuple):
  """An ICT score: the ``select_tokens`` input that holds it [N, T] and what it is."""

  input: str
  description: str


SCORES: dict[str, Score] = {
    "js": Score("u", "JS(p_i || P) to the group reference (ICT's score)"),
    "kl": Score("kl", "KL(p_i || P) to the group reference"),
    "entropy": Score("entropy", "the token's Shannon entropy (per response, unlike 20-Entropy's " "batch-wide top-k)"),
    "random": Score("noise", "uniform noise: a random top_fraction of each response"),
}


def loss_type_for(method: str, dense_loss_type: str = "dapo") -> str:
  """The grpo loss_type a selection method trains with (a Python string, usable before jit).

  grpo -> dense_loss_type; entropy -> "bnpo"; stapo -> "bnpo"; ict -> "grpo".
  """
  if method not in SELECTORS:
    raise ValueError(f"selection: unknown method={method!r}; expected one of {sorted(SELECTORS)}")
  if dense_loss_type not in LOSS_TYPES:
    raise ValueError(f"selection: dense_loss_type={dense_loss_type!r}; expected one of {sorted(LOSS_TYPES)}")
  return SELECTORS[method].loss_type or dense_loss_type


def select_tokens(
    ict: IctConfig,
    dense_loss_type: str = "dapo",
    *,
    mask: jax.Array,
    u: jax.Array | None = None,
    entropy: jax.Array | None = None,
    token_prob: jax.Array | None = None,
    advantages: jax.Array | None = None,
    kl: jax.Array | None = None,
    noise: jax.Array | None = None,
) -> tuple[jax.Array, str]:
  """Selection mask bool [B, T] of the method `ict.method` and the loss_type to train it with.

  grpo -> (mask, dense_loss_type); entropy -> "bnpo"; stapo -> "bnpo"; ict -> "grpo".
  With grpo.policy_loss_terms the "bnpo" and "dapo" terms are identical (sum L*M, sum M),
  so "bnpo" here normalises over the selected tokens of the whole step when accumulated.
  Call it inside the jitted step (the string is a trace-time value); ``loss_type_for``
  gives the same string outside jit. The method reads its settings from `ict` (the run config's
  section: top_fraction, entropy_top_fraction, stapo_tau_p, stapo_tau_h_quantile).

  ICT's ablations: ``ict.score`` (a key of ``SCORES``: js -> ``u``, kl -> ``kl``, entropy ->
  ``entropy``, random -> ``noise``, uniform [B, T]) and ``ict.keep`` (a key of ``KEEPS``).
  """
  method = ict.method
  loss_type = loss_type_for(method, dense_loss_type)
  if ict.score not in SCORES:
    raise ValueError(f"selection: unknown ict.score={ict.score!r}; expected one of {sorted(SCORES)}")
  if ict.keep not in KEEPS:
    raise ValueError(f"selection: unknown ict.keep={ict.keep!r}; expected one of {sorted(KEEPS)}")
  selector = SELECTORS[method]
  needs = (SCORES[ict.score].input,) if method == "ict" else selector.needs
  inputs = {"u": u, "entropy": entropy, "token_prob": token_prob, "advantages": advantages, "kl": kl, "noise": noise}
  missing = [name for name in needs if inputs[name] is None]
  if missing:
    raise ValueError(f"selection: method {method!r} needs {missing} (got None)")
  token_mask = selector.fn(mask=mask, cfg=ict, **inputs)
  return token_mask, loss_type


def selection_metrics(
    u: jax.Array,
    mask: jax.Array,
    token_mask: jax.Array,
    entropy: jax.Array | None = None,
    renyi2: jax.Array | None = None,
) -> dict[str, tuple[jax.Array, jax.Array]]:
  """(sum, count) pairs over valid tokens; finalise with ``grpo.finalize_metrics``.

  js_selected / js_unselected: mean u of the selected / unselected valid tokens;
  selected_frac: selected valid tokens / valid tokens; entropy, renyi2 (when given):
  mean over valid tokens.
  """
  valid = mask.astype(bool)
  sel = (valid & token_mask.astype(bool)).astype(jnp.float32)
  unsel = (valid & ~token_mask.astype(bool)).astype(jnp.float32)
  v = valid.astype(jnp.float32)
  u = jax.lax.stop_gradient(u.astype(jnp.float32))
  out = {
      "js_selected": (jnp.sum(u * sel), sel.sum()),
      "js_unselected": (jnp.sum(u * unsel), unsel.sum()),
      "selected_frac": (sel.sum(), v.sum()),
  }
  for name, x in (("entropy", entropy), ("renyi2", renyi2)):
    if x is not None:
      out[name] = (jnp.sum(jax.lax.stop_gradient(x.astype(jnp.float32)) * v), v.sum())
  return out


def signature_metrics(
    token_prob: jax.Array, entropy: jax.Array, mask: jax.Array, token_mask: jax.Array
) -> dict[str, tuple[jax.Array, jax.Array]]:
  """The ICT paper's signature of the selected tokens, as (sum, count) pairs.

  token_prob [N, T]: the sampled token's probability under the current policy (exp of its
  log-prob); entropy [N, T]: its Shannon entropy; mask, token_mask [N, T] (bool or 0/1). Every
  method has a selection: GRPO's is every valid token.

  selected_prob: mean token_prob over the selected valid tokens (the paper reports ~0.18).
  selected_high_entropy: the share of the selected valid tokens whose entropy is above the median
    (``numpy.median``, linear interpolation) of the entropies of all valid tokens passed here
    (the paper: ~50%). The train step passes the whole step's [N, C] (every micro-batch), so the
    median is the step's, not a micro-batch's. Call it once per step: the median does not add
    across calls, so these pairs must not be summed over micro-batches.
  """
  valid = mask.astype(bool)
  sel = (valid & token_mask.astype(bool)).astype(jnp.float32)
  entropy = jax.lax.stop_gradient(entropy.astype(jnp.float32))
  median = masked_quantile(entropy, valid, 0.5)
  high = (entropy > median).astype(jnp.float32)
  prob = jax.lax.stop_gradient(token_prob.astype(jnp.float32))
  return {
      "selected_prob": (jnp.sum(prob * sel), sel.sum()),
      "selected_high_entropy": (jnp.sum(high * sel), sel.sum()),
  }
