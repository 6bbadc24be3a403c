"""Qwen2 / Qwen2.5 decoder in Flax NNX.

Einsum letters match parameter and sharding names:
  B batch, T query length, S key length, D embed, N heads, K kv_heads, G groups (N/K),
  H head_dim, F mlp, V vocab.
Parameters carry logical axis names in their `axes` metadata (see `models/axes.py`).
The decoder stack is one `DecoderLayer` whose parameters are stacked on a leading `layers` axis
(L, logical name "layers"), run by `jax.lax.scan`: XLA compiles one layer, not L copies. A named
remat policy (`Qwen2Config.remat_policy`) wraps the scanned layer in the train step.
The KV cache is an explicit pytree passed in and returned, so decoding is a pure function; it is
stacked like the parameters, [L, B, K, S, H]: the layer scan reads each layer's old slice (xs) and
returns the new positions (ys), written after the scan by one in-place update (read before write).
With `decode_attention` "pallas" (TPU) the cache is one `JointCache` [L, B, K, S, 2H] (key | value
a slot) that the fused kernel (`models/decode_kernel.py`) reads in place, layer by layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ict_jax.models.attention import PackedSegments, attend
from ict_jax.models.axes import constrain
from ict_jax.models.config import Qwen2Config
from ict_jax.models import mlp_kernel
from ict_jax.models.decode_kernel import decode_attention

Array = jax.Array
_INIT_STD = 0.02


class LayerCache(NamedTuple):
  """Keys and values, [L, B, K, S, H] for the model (heads-major, as the attention dots read
  them); inside the scanned layer each is one layer's [B, K, S, H]."""

  k: Array
  v: Array


class JointCache(NamedTuple):
  """Keys and values side by side, [L, B, K, S, 2H]: slot s holds its key in lanes [0, H) and its
  value in [H, 2H) (`Qwen2Config.decode_attention` "pallas": the layout `models/decode_kernel.py`
  reads; a slot is one lane-dense row, written whole)."""

  kv: Array


CACHE_AXES = (None, "act_batch", "act_kv_heads", "act_cache_length", None)  # a cache array's logical axes


def make_cache(cfg: Qwen2Config, batch: int, length: int, make) -> LayerCache | JointCache:
  """The KV cache `cfg.decode_attention` reads, its arrays made by `make(shape)`: keys and values
  [L, B, K, S, H] each ("xla"), or one joint [L, B, K, S, 2H] ("pallas"); S = length."""
  joint = cfg.decode_attention != "xla"
  shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, length, cfg.head_dim * (2 if joint else 1))
  return JointCache(make(shape)) if joint else LayerCache(make(shape), make(shape))


# remat policy name -> jax.checkpoint policy (MaxText's names); "none" runs the layer as is.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only the layer's input
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the weight matmuls
}


def _dtype(name: str):
  return jnp.dtype(name)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str = "normal", stack: tuple[int, ...] = ()) -> nnx.Param:
  """A parameter of `stack + shape`; a stacked one gets the logical axis "layers" first."""
  shape, axes = tuple(stack) + tuple(shape), ("layers",) * len(stack) + tuple(axes)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=tuple(axes))


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs=None, stack=()):
    self.scale = _param(rngs, (dim,), ("norm",), param_dtype, "ones", stack)
    self.eps = eps

  def __call__(self, x: Array) -> Array:  # [..., D]
    return self.scale[...].astype(x.dtype) * self.normalize(x)

  def normalize(self, x: Array) -> Array:  # [..., D]: x / RMS(x) in x's dtype, before the scale
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """[B, T] int positions -> cos, sin [B, T, H] in float32 (HF `Qwen2RotaryEmbedding`)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x [B, T, *, H]; cos/sin [B, T, H]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  extra = (None,) * (x.ndim - 3)
  c = cos[:, :, *extra, :].astype(x.dtype)
  s = sin[:, :, *extra, :].astype(x.dtype)
  return x * c + rotated * s


class Proj(nnx.Module):
  """One weight projection: `einsum(equation, x, kernel) (+ bias)` in x's dtype. A module of its
  own whose `kernel` is a direct attribute, so `qwix` (LoRA, `ict_jax/lora.py`) finds the weight of
  the einsum it intercepts; `proj["kernel"]` reads a parameter as the former `nnx.Dict` did."""

  def __init__(self, equation: str, kernel: nnx.Param, bias: nnx.Param | None = None):
    self.equation = equation
    self.kernel = kernel
    if bias is not None:
      self.bias = bias

  def __getitem__(self, name: str) -> nnx.Param:
    return getattr(self, name)

  def __call__(self, x: Array) -> Array:
    out = jnp.einsum(self.equation, x, self.kernel[...].astype(x.dtype))
    bias = getattr(self, "bias", None)
    return out if bias is None else out + bias[...].astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs, stack=()):
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pd = _dtype(cfg.param_dtype)
    p = lambda shape, axes, init="normal": _param(rngs, shape, axes, pd, init, stack)
    self.cfg = cfg
    self.q_proj = Proj(
        "BTD,DNH->BTNH", p((d, n, h), ("embed", "heads", "head_dim")), p((n, h), ("heads", "head_dim"), "zeros")
    )
    self.k_proj = Proj(
        "BTD,DKH->BTKH", p((d, k, h), ("embed", "kv_heads", "head_dim")), p((k, h), ("kv_heads", "head_dim"), "zeros")
    )
    self.v_proj = Proj(
        "BTD,DKH->BTKH", p((d, k, h), ("embed", "kv_heads", "head_dim")), p((k, h), ("kv_heads", "head_dim"), "zeros")
    )
    self.o_proj = Proj("BTNH,NHD->BTD", p((n, h, d), ("heads", "head_dim", "embed")))

  def __call__(
      self,
      x: Array,
      cos: Array,
      sin: Array,
      mask,
      cache: LayerCache | None = None,
      prefill: bool = False,
      prefix: LayerCache | None = None,
      layer: Array | None = None,
  ):
    """x [B,T,D] -> ([B,T,D], (k, v)): the T new keys and values, [B,K,T,H] each (rotary applied),
    for the caller to write into the cache. Without a cache, or with `prefill` (an empty cache:
    nothing before the T tokens is visible), `mask` is the attention mask [B,T] and
    `cfg.attention` names the implementation (`models/attention.py`). When decoding, `cache` is
    this layer's OLD keys/values [B,K,S,H] (before the T new positions are written: read before
    write, so the stacked cache is only read inside the layer scan) and `mask` the additive biases
    (old [B,1,1,T|1,S], new [B,1,1,T,T]) of one softmax over the S cache slots and the T new tokens;
    only the first S slots of the cache, as many as `old` has biases, are read.
    `prefix` [U,K,P,H] (U dividing B) adds a block of P slots read by B/U consecutive rows each
    (a prompt's keys/values shared by its samples), its biases [U,1,1,1,1,P] first in `mask`.
    A `JointCache` (decode_attention "pallas") is passed whole, [L,B,K,S,2H] (and the prefix
    [L,U,K,P,2H]), with the `layer` to read: the kernel reads its slots in place."""
    cfg, dt = self.cfg, x.dtype
    split = cfg.split_attention and cache is not None and not prefill
    if split:  # q/k/v split on embed (`sampling.policy.TENSOR_RULES`): x's rows -> embed shards, partial
      x = constrain(x, (None, None, "act_split"))  # sums reduce-scattered back to rows by the constraints below
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q = constrain(q, ("act_batch", "act_length", "act_heads", None))
    k = constrain(k, ("act_batch", "act_length", "act_kv_heads", None))
    v = constrain(v, ("act_batch", "act_length", "act_kv_heads", None))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is None or prefill:  # the T tokens attend to themselves: scores [.., T, T]
      out = attend(q, k, v, mask, cfg.attention)
    elif isinstance(cache, JointCache):  # the fused kernel over the joint caches
      b, t = q.shape[:2]
      q = q.reshape(b, t, cfg.num_key_value_heads, cfg.num_groups, cfg.head_dim)  # [B,T,K,G,H]
      interpret = cfg.decode_attention == "pallas_interpret"
      out = decode_attention(q, k, v, mask, cache.kv, layer, None if prefix is None else prefix.kv, interpret=interpret)
      out = out.reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    else:  # decoding: one softmax over the (prefix,) S old cache slots and the T new tokens
      old_bias, new_bias = mask[-2:]
      s = old_bias.shape[-1]  # the slots that may hold keys (`hidden_states`' cache_read_len): read only those
      ck, cv = cache.k[:, :, :s].astype(dt), cache.v[:, :, :s].astype(dt)  # [B,K,S,H], heads-major
      b, t = q.shape[:2]
      q = q.reshape(b, t, cfg.num_key_value_heads, cfg.num_groups, cfg.head_dim)  # [B,T,K,G,H]
      scale = cfg.head_dim**-0.5
      old = jnp.einsum("BTKGH,BKSH->BKGTS", q, ck).astype(jnp.float32) * scale + old_bias  # [B,K,G,T,S]
      new = jnp.einsum("BTKGH,BUKH->BKGTU", q, k).astype(jnp.float32) * scale + new_bias  # [B,K,G,T,T]
      # one softmax over the blocks without joining them ([.., S + T] is off the lane tiling and
      # would be copied): a shared max, unnormalised weights, and the sum divided out after the dots
      top = jnp.maximum(jnp.max(old, axis=-1, keepdims=True), jnp.max(new, axis=-1, keepdims=True))
      if prefix is not None:  # rows [u*R, u*R + R) read prefix row u: viewed [U, R, ...], no copy
        u = prefix.k.shape[0]
        grouped = lambda x: x.reshape(u, b // u, *x.shape[1:])  # [B, ...] -> [U, R, ...]
        pre = jnp.einsum("URTKGH,UKPH->URKGTP", grouped(q), prefix.k.astype(dt)).astype(jnp.float32)
        pre = pre * scale + mask[0]  # [U,R,K,G,T,P]
        top = jnp.maximum(top, jnp.max(pre, axis=-1, keepdims=True).reshape(top.shape))
        e_pre = jnp.exp(pre - grouped(top))
      e_old, e_new = jnp.exp(old - top), jnp.exp(new - top)
      total = jnp.sum(e_old, axis=-1, keepdims=True) + jnp.sum(e_new, axis=-1, keepdims=True)  # [B,K,G,T,1]
      out = jnp.einsum("BKGTS,BKSH->BKGTH", e_old.astype(dt), cv, preferred_element_type=jnp.float32)
      out = out + jnp.einsum("BKGTU,BUKH->BKGTH", e_new.astype(dt), v, preferred_element_type=jnp.float32)
      if prefix is not None:
        total = total + jnp.sum(e_pre, axis=-1, keepdims=True).reshape(total.shape)
        pv = prefix.v.astype(dt)
        out_pre = jnp.einsum("URKGTP,UKPH->URKGTH", e_pre.astype(dt), pv, preferred_element_type=jnp.float32)
        out = out + out_pre.reshape(out.shape)
      out = (out / total).astype(dt)
      out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    out = constrain(out, ("act_batch", "act_length", "act_heads", None))
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,K,H] -> [B,K,T,H], the cache's layout
    if split:  # o split on its output embed: every row's heads in, [B, T, D / chips] out
      out = constrain(out, (None, None, None, None))
    h = self.o_proj(out)
    return constrain(h, (None, None, "act_split")) if split else h, (heads_major(k), heads_major(v))


class MLP(nnx.Module):

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs, stack=()):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, _dtype(cfg.param_dtype)
    self.gate_proj = Proj("BTD,DF->BTF", _param(rngs, (d, f), ("embed", "mlp"), pd, stack=stack))
    self.up_proj = Proj("BTD,DF->BTF", _param(rngs, (d, f), ("embed", "mlp"), pd, stack=stack))
    self.down_proj = Proj("BTF,FD->BTD", _param(rngs, (f, d), ("mlp", "embed"), pd, stack=stack))

  def __call__(self, x: Array, split: bool = False) -> Array:  # [B,T,D]
    """split: the weights split on the intermediate dimension over every chip (decode_weights
    "tensor", decoding): x's rows gathered, [B, T, F / chips] a chip, partial sums out."""
    if split:
      x = constrain(x, (None, None, None))
    gate, up = self.gate_proj(x), self.up_proj(x)
    names = (None, "act_length", "act_split") if split else ("act_batch", "act_length", "act_mlp")
    hidden = constrain(jax.nn.silu(gate) * up, names)
    return self.down_proj(hidden)


class DecoderLayer(nnx.Module):
  """One decoder layer; built with `stack=(L,)` it holds all L layers' parameters stacked, and
  is called on one layer's slice of them (see `Qwen2.hidden_states`)."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs, stack=()):
    pd = _dtype(cfg.param_dtype)
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, stack=stack)
    self.attn = Attention(cfg, rngs=rngs, stack=stack)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, stack=stack)
    self.mlp = MLP(cfg, rngs=rngs, stack=stack)

  def __call__(self, x, cos, sin, mask, cache=None, prefill: bool = False, prefix=None, layer=None, stacked=None):
    """-> (x [B,T,D], the T new (keys, values) [B,K,T,H]); see `Attention`. stacked: all layers
    stacked (decoding over a `JointCache`): with the MLP split over the chips, the fused decode MLP
    (`models/mlp_kernel.py`) reads layer `layer` of its norm scale and weights in place, where a
    chip's weights fit it."""
    h, new_kv = self.attn(self.input_norm(x), cos, sin, mask, cache, prefill, prefix, layer)
    x = x + h
    cfg = self.attn.cfg
    split = cfg.split_mlp and cache is not None and not prefill
    d, f = self.mlp.gate_proj.kernel.shape[-2:]
    if split and stacked is not None and mlp_kernel.fits(d, f, x.dtype.itemsize):
      rows = constrain(self.post_attn_norm.normalize(x), (None, None, None))  # every row, gathered
      mlp, scale = stacked.mlp, stacked.post_attn_norm.scale[...]
      weights = [p.kernel[...] for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]  # [L, ...]
      x = x + mlp_kernel.decode_mlp(rows, scale, *weights, layer, interpret=cfg.decode_attention == "pallas_interpret")
    else:
      x = x + self.mlp(self.post_attn_norm(x), split)  # split: reduce-scattered to rows by the constraint
    return constrain(x, ("act_batch", "act_length", "act_embed")), new_kv


def _stacked_layers(cfg: Qwen2Config, rngs: nnx.Rngs) -> DecoderLayer:
  """The L decoder layers as one `DecoderLayer` of stacked [L, ...] parameters. They are drawn
  layer by layer from `rngs` and then stacked, so a seed gives the same weights as L separate
  layers would (the layout changed, the initialisation did not)."""
  per_layer = [
      nnx.to_pure_dict(nnx.state(DecoderLayer(cfg, rngs=rngs), nnx.Param)) for _ in range(cfg.num_hidden_layers)
  ]
  stacked = nnx.eval_shape(lambda: DecoderLayer(cfg, rngs=nnx.Rngs(0), stack=(cfg.num_hidden_layers,)))
  state = nnx.state(stacked, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
  nnx.update(stacked, state)
  return stacked


class Qwen2(nnx.Module):
  """`Qwen2ForCausalLM` in NNX: `model(input_ids, attention_mask)` -> logits [B, T, V] (float32)."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed = nnx.Dict(embedding=_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd))
    self.layers = _stacked_layers(cfg, rngs)  # one DecoderLayer of [L, ...] parameters
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Dict(kernel=_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd))

  # ---- pieces the train step fuses with its chunked loss ------------------------------------
  def head_weight(self) -> tuple[Array, bool]:
    """(w, vocab_major): the LM head as stored, [V, D] for a tied embedding, else [D, V]."""
    if self.cfg.tie_word_embeddings:
      return self.embed["embedding"][...], True
    return self.lm_head["kernel"][...], False

  def logits_from_hidden(self, h: Array) -> Array:
    """h [B, T, D] (after the final norm) -> float32 logits [B, T, V]."""
    w, vocab_major = self.head_weight()
    logits = jnp.einsum(
        "BTD,VD->BTV" if vocab_major else "BTD,DV->BTV", h, w.astype(h.dtype), preferred_element_type=jnp.float32
    )
    return constrain(logits, ("act_batch", "act_length", "act_vocab"))

  def next_token_logits(self, h: Array) -> Array:
    """h [B, D] (after the final norm, one position per row) -> float32 logits [B, V]: the decode
    step's head (`cpu_paths.head_logits` is XLA:CPU's formulation). Computed vocabulary-major,
    [V, B], and returned transposed (a layout, not a copy; XLA keeps the layout the dot
    produces): the sampler's reductions over the vocabulary read either layout alike."""
    w, vocab_major = self.head_weight()
    names = ("act_vocab", "act_batch")
    if self.cfg.split_mlp:  # the vocabulary split over every chip: every row's
      h, names = constrain(h, (None, None)), ("act_split", None)  # logits on 1/chips of the ids
    logits = jnp.einsum(
        "BD,VD->VB" if vocab_major else "BD,DV->VB", h, w.astype(h.dtype), preferred_element_type=jnp.float32
    )
    return constrain(logits, names).T

  def init_cache(self, batch: int, length: int, dtype=None) -> LayerCache | JointCache:
    """Zeros [L, B, K, S, H] for keys and values (S = length), in `dtype` (default cfg.dtype);
    decode_attention "pallas": one `JointCache` [L, B, K, S, 2H] (`make_cache`)."""
    dt = dtype or _dtype(self.cfg.dtype)
    return make_cache(self.cfg, batch, length, lambda shape: constrain(jnp.zeros(shape, dt), CACHE_AXES))

  def _decoder_stack(
      self, x, cos, sin, mask, cache: LayerCache | None, cache_index, prefill: bool = False, prefix=None
  ):
    """x [B, T, D] through the L layers by `jax.lax.scan` over the stacked parameters -> (x [B, T, D],
    new cache or None). Decoding reads before it writes: each layer reads its own old slots of the
    stacked cache [L, B, K, S, H] by one `dynamic_slice` [layer, :, :, :s] (s: the slots the mask
    reads, `hidden_states`' cache_read_len), which XLA reads inside the consuming dot; the cache as
    the scan's xs, sliced [:s] inside the layer, made XLA materialise every layer's whole S slots
    before the slice (a copy of the cache a step in every bounded decode phase); sliced [:, :, :, :s]
    before the scan, a copy of the s slots. The T new keys/values come out as the scan's ys
    [L, B, K, T, H] and are written after the scan by ONE `dynamic_update_slice` at cache_index
    (in place on the decode loop's carry). A layer that wrote into the stacked cache and then read
    its slice back made XLA copy every layer's [B, K, S, H] every step. Prefill (an empty cache)
    reads nothing, so there each layer writes its T positions in place into the carried cache (no
    [L, B, K, T, H] ys the size of the prompt's cache next to it). Without a cache (the train step,
    scoring) the scanned layer is rematerialised by `cfg.remat_policy`."""
    graphdef, state = nnx.split(self.layers)
    if cache is None:

      def layer(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, cos, sin, mask)[0], None

      policy = self.cfg.remat_policy
      if policy != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[policy], prevent_cse=False)
      return jax.lax.scan(layer, x, state)[0], None

    zero = jnp.zeros((), jnp.int32)
    if prefill:  # nothing is read: each layer writes its T positions into the carried cache in place

      def prefill_layer(carry, xs):
        x, cache = carry
        layer_state, index = xs
        x, new = nnx.merge(graphdef, layer_state)(x, cos, sin, mask, None, True)
        start = (index, zero, zero, jnp.asarray(cache_index, jnp.int32), zero)
        write = lambda c, n: jax.lax.dynamic_update_slice(c, n[None].astype(c.dtype), start)  # [1,B,K,T,H]
        if isinstance(cache, JointCache):
          return (x, JointCache(write(cache.kv, jnp.concatenate(new, axis=-1)))), None
        return (x, LayerCache(write(cache.k, new[0]), write(cache.v, new[1]))), None

      index = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
      return jax.lax.scan(prefill_layer, (x, cache), (state, index))[0]

    s = mask[-2].shape[-1]  # the old slots' biases: the slots read
    index = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
    start = (zero, zero, zero, jnp.asarray(cache_index, jnp.int32), zero)
    names = (None, "act_batch", "act_kv_heads", None, None)
    write = lambda c, n: jax.lax.dynamic_update_slice(c, constrain(n.astype(c.dtype), names), start)
    if isinstance(cache, JointCache):  # the kernel reads layer `index` of the whole caches in place

      stacked = nnx.merge(graphdef, state)  # [L, ...]: the fused MLP reads its layer in place too

      def joint_layer(x, xs):
        layer_state, layer = xs
        return nnx.merge(graphdef, layer_state)(x, cos, sin, mask, cache, False, prefix, layer, stacked)

      x, new = jax.lax.scan(joint_layer, x, (state, index))
      x, new = jax.lax.optimization_barrier((x, new))  # read before write, as below
      return x, JointCache(write(cache.kv, jnp.concatenate(new, axis=-1)))  # [L, B, K, T, 2H]

    def cached_layer(x, xs):  # a shared prefix [L, U, K, P, H] is read like the cache, never written
      layer_state, index, pre = xs
      read = lambda c: jax.lax.dynamic_slice(c, (index, zero, zero, zero, zero), (1, *c.shape[1:3], s, c.shape[4]))
      old = LayerCache(read(cache.k)[0], read(cache.v)[0])  # this layer's [B, K, s, H]
      return nnx.merge(graphdef, layer_state)(x, cos, sin, mask, old, False, pre)

    x, new = jax.lax.scan(cached_layer, x, (state, index, prefix))
    # the write must follow every read of the old cache; the last layer's new keys/values do not
    # depend on its attention (the reads), x does: without this order XLA copies the whole cache
    x, new = jax.lax.optimization_barrier((x, new))
    return x, LayerCache(write(cache.k, new[0]), write(cache.v, new[1]))  # new: [L, B, K, T, H]

  def hidden_states(
      self,
      input_ids: Array,
      attention_mask: Array | None = None,
      *,
      positions: Array | None = None,
      cache: LayerCache | None = None,
      cache_index: Array | None = None,
      kv_mask: Array | None = None,
      prefill: bool = False,
      prefix: LayerCache | None = None,
      prefix_mask: Array | None = None,
      cache_read_len: int | None = None,
      segment_ids: Array | None = None,
      max_segments: int | None = None,
  ):
    """Final-normed hidden states [B, T, D] (and the updated cache when one is given).

    input_ids [B, T]; attention_mask [B, T] (1 = token, 0 = padding; left padding is fine).
    positions default to `cumsum(mask) - 1`. With a cache of length S, the T new tokens are
    written at `cache_index` and attend to cache keys where `kv_mask` [B, S] is 1; the cache is
    a `LayerCache` of [L, B, K, S, H] arrays (`init_cache`). `prefill` (static): the cache holds
    nothing visible yet, so the T tokens attend to each other only (scores [.., T, T], not
    [.., T, S]: a prompt does not pay for the max_new_tokens slots). `prefix` (decoding only) is a
    read-only `LayerCache` [L, U, K, P, H] before the cache, e.g. a prompt prefilled once for its
    B/U samples: rows [u*B/U, (u+1)*B/U) attend to its row u where `prefix_mask` [U, P] is 1.
    `cache_read_len` (static, decoding only): read only the first that many cache slots, which must
    hold every slot written before cache_index (the decode loop's length-bounded phases).
    `segment_ids` [B, T] (no cache): packed rows, several sequences a row (ids 1, 2, .. a row, 0
    padding) that attend within their sequence only; `positions` then give each token's position
    in its own sequence; `max_segments` (static): at most that many sequences a row (default T)."""
    cfg = self.cfg
    b, t = input_ids.shape
    if segment_ids is not None:
      if cache is not None or positions is None:
        raise ValueError("hidden_states: packed segment_ids take per-sequence positions and no cache")
      attention_mask = PackedSegments(segment_ids, max_segments)
    elif attention_mask is None:
      attention_mask = jnp.ones((b, t), jnp.int32)
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    if cache is None or prefill:  # keys are the T tokens themselves: the implementation masks
      mask = attention_mask  # [B, T], or the PackedSegments of packed rows
    else:  # biases of the S old cache slots and of the T new tokens (see `Attention`)
      s = cache[0].shape[3] if cache_read_len is None else cache_read_len
      bias = lambda allowed: jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)[:, None, None]
      old = jnp.arange(s)[None, :] < cache_index  # [1, S]: slots written before this call
      causal = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]  # [1, T, T]
      if kv_mask is not None:
        old = old & (kv_mask[:, :s] > 0)  # [B, S]
        new_valid = jax.lax.dynamic_slice_in_dim(kv_mask, cache_index, t, axis=1) > 0  # [B, T]
        causal = causal & new_valid[:, None, :]
      mask = (bias(old[:, None, :]), bias(causal))  # [B|1,1,1,1,S], [B|1,1,1,T,T]
      if prefix is not None:
        mask = (bias(prefix_mask[:, None, None, :] > 0),) + mask  # [U,1,1,1,1,P]
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    x = self.embed["embedding"][...][input_ids].astype(_dtype(cfg.dtype))
    x = constrain(x, ("act_batch", "act_length", "act_embed"))
    x, new_cache = self._decoder_stack(x, cos, sin, mask, cache, cache_index, prefill, prefix)
    h = self.final_norm(x)
    return h if cache is None else (h, new_cache)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None, **kw) -> Any:
    out = self.hidden_states(input_ids, attention_mask, **kw)
    if kw.get("cache") is None:
      return self.logits_from_hidden(out)
    h, cache = out
    return self.logits_from_hidden(h), cache


def init_model(cfg: Qwen2Config, seed: int = 0) -> Qwen2:
  """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
  return Qwen2(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: Qwen2Config) -> Qwen2:
  """The model's structure with `ShapeDtypeStruct` leaves: no memory, for planning shardings."""
  return nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(params=0)))
