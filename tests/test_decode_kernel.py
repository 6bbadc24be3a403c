"""The fused decode-attention kernel (models/decode_kernel.py), run in the Pallas interpreter:
its output against numpy, and the model's decode over the joint cache against the XLA path
and a forward without a cache. Its TPU compile is checked in test_decode_phases (libtpu)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_config

from ict_jax import sampling, setup
from ict_jax.config import ConfigError
from ict_jax.models import decode_kernel
from ict_jax.models.qwen2 import JointCache, LayerCache, init_model

NEG = np.finfo(np.float32).min


def _numpy_decode(q, k, v, cache, prefix, cache_bias, prefix_bias, layer):
  """float64 softmax over [the prompt block's slots, the cache's first s slots, the new token]:
  q [B, K, G, H], k, v [B, K, H], cache [L, B, K, S, 2H], prefix [L, U, K, P, 2H] -> [B, K, G, H]."""
  q, k, v, cache, prefix = (np.asarray(x, np.float64) for x in (q, k, v, cache, prefix))
  b, h = q.shape[0], q.shape[-1]
  s = cache_bias.shape[-1]
  pre = np.repeat(prefix[layer], b // prefix.shape[1], axis=0)  # [B, K, P, 2H]
  slots = np.concatenate([pre, cache[layer, :, :, :s], np.concatenate([k, v], -1)[:, :, None]], axis=2)
  bias = np.concatenate([np.repeat(prefix_bias, b // prefix.shape[1], 0), cache_bias, np.zeros((b, 1))], 1)
  scores = np.einsum("bkgh,bksh->bkgs", q, slots[..., :h]) / np.sqrt(h) + bias[:, None, None, :]
  p = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("bkgs,bksh->bkgh", p / p.sum(-1, keepdims=True), slots[..., h:])


@pytest.mark.parametrize(
    "slots, prompt_len, prompts, group, block_kib, rows",
    [
        (384, 256, 3, 2, 2048, 2),  # cache blocks of 128 (384), one prompt a row block
        (256, 40, 8, 2, 512, 4),  # cache blocks of 128, two prompts a row block (the budget)
        (40, 128, 2, 4, 128, 2),  # one odd cache block, half a prompt a row block (the budget)
        (256, 0, 4, 2, 2048, 4),  # no prompt block (the cache holds the prompt)
        (256, 512, 8, 1, 2048, 4),  # a prompt copy a row: 128-slot prompt blocks, padding ones skipped
    ],
)
def test_kernel_matches_numpy(monkeypatch, slots, prompt_len, prompts, group, block_kib, rows):
  """`prompts` x `group` rows, 2 KV heads of 3 query heads: the prompt block, the cache's first
  `slots` slots (the rest unwritten), left padding in a prompt and a hole in one row's cache;
  row blocks (at most `block_kib` KiB of cache) of several prompts, one, or a part of one."""
  monkeypatch.setattr(decode_kernel, "BLOCK_BYTES", block_kib << 10)
  _check_against_numpy(slots, prompt_len, prompts, group, rows)


def test_prompt_blocks_holding_keys():
  """`first_key_blocks`: each prompt's first 128-slot block holding a key (left padding: the
  prompt's last slots), 4 for an all-padding one, against the lengths; `prompt_blocks_read`: from
  there to the last block for every prompt of a row block, at least the last one."""
  p, bp = 512, 128
  lens = np.array([512, 385, 384, 129, 128, 1, 0])
  bias = np.where(np.arange(p)[None, :] >= p - lens[:, None], 0.0, NEG).astype(np.float32)
  first = np.asarray(decode_kernel.first_key_blocks(jnp.asarray(bias), bp))
  np.testing.assert_array_equal(first, [0, 0, 1, 2, 3, 3, 4])
  assert decode_kernel.prompt_blocks_read([128, 1], p, bp) == 2  # the last block of each of 2 prompts
  assert decode_kernel.prompt_blocks_read([129, 20, 0], p, bp) == 6  # the longest needs 2 blocks
  assert decode_kernel.prompt_blocks_read([0, 0], p, bp) == 2
  assert decode_kernel.prompt_blocks_read([512], p, bp) == 4


def test_kernel_matches_numpy_per_shard_with_two_prompts_a_row_block(monkeypatch):
  """On the 8-device mesh (rows over data 2 x fsdp 4): 48 prompts x 2 rows, each shard's 12 rows
  in 3 row blocks of 2 prompts (a 512 KiB budget): a block's prompts are found from the shard's
  first row and prompt (scalar-prefetched) with several prompts a block; and 16 rows with a prompt
  copy each (2 a shard, a row a block), whose skipped padding blocks are found per shard alike."""
  from ict_jax import sampling, sharding
  from ict_jax.models.axes import axis_rules

  monkeypatch.setattr(decode_kernel, "BLOCK_BYTES", 512 << 10)
  with jax.set_mesh(sharding.make_mesh((2, 4, 1))), axis_rules(sampling.DECODE_RULES):
    _check_against_numpy(256, 40, 48, 2, 4, local_rows=12)
    _check_against_numpy(256, 512, 16, 1, 1, local_rows=2)
    _check_against_numpy(256, 40, 48, 2, 2, local_rows=12, h=128)  # 128-lane heads: q not padded


def test_kernel_matches_numpy_with_128_lane_heads(monkeypatch):
  """Heads of 128 values (Qwen2.5 1.5B, 7B): q goes in unpadded, the kernel scores against a
  slot's key lanes and writes only the value lanes; a prompt block and a prompt copy a row."""
  monkeypatch.setattr(decode_kernel, "BLOCK_BYTES", 2048 << 10)
  _check_against_numpy(384, 256, 3, 2, 2, h=128)
  _check_against_numpy(256, 512, 8, 1, 4, h=128)


def _check_against_numpy(slots, prompt_len, prompts, group, rows, local_rows=None, h=64):
  """h 64: q padded to the joint width by the caller; 128: q as it is, the key lanes sliced."""
  rng = np.random.default_rng(slots + prompt_len)
  layers, heads, g, length = 3, 2, 3, 512
  b = prompts * group
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  q, k, v = f(b, heads, g, h), f(b, heads, h), f(b, heads, h)
  cache, prefix = f(layers, b, heads, length, 2 * h), f(layers, prompts, heads, prompt_len, 2 * h)
  cache_bias = np.zeros((b, slots), np.float32)
  cache_bias[:, slots // 3 :] = NEG  # written so far: a third
  cache_bias[b - 2, 1:5] = NEG
  prefix_bias = np.zeros((prompts, prompt_len), np.float32)
  prefix_bias[1, : prompt_len // 4] = NEG  # left padding
  if group == 1 and prompt_len:  # rows with their own prompts: padding of every length, one all padding
    for u, pad in enumerate(np.linspace(0, prompt_len, prompts).astype(int)):
      prefix_bias[u, :pad] = NEG
  mask = (cache_bias[:, None, None, None, :], np.zeros((1, 1, 1, 1, 1), np.float32))
  if prompt_len:
    mask = (prefix_bias[:, None, None, None, None, :],) + mask
  read = -(-slots // 16) * 16  # the bound read up to a bf16 tile's 16 slots
  local = local_rows or b
  assert decode_kernel.blocks(local, group if prompt_len else 1, read, prompt_len, heads * 2 * h * 4).rows == rows
  out = jax.jit(decode_kernel.decode_attention, static_argnames="interpret")(
      jnp.asarray(q[:, None]),
      jnp.asarray(k[:, None]),
      jnp.asarray(v[:, None]),
      tuple(jnp.asarray(m) for m in mask),
      jnp.asarray(cache),
      jnp.int32(2),
      jnp.asarray(prefix) if prompt_len else None,
      interpret=True,
  )
  ref = _numpy_decode(q, k, v, cache, prefix, cache_bias, prefix_bias, 2)
  np.testing.assert_allclose(np.asarray(out)[:, 0], ref, rtol=1e-4, atol=1e-5)


CFG = tiny_config(128, max_position_embeddings=2048)  # head_dim 8


def test_joint_cache_layout():
  """decode_attention "pallas": one [L, B, K, S, 2H] array a cache; "xla": keys and values."""
  joint = init_model(dataclasses.replace(CFG, decode_attention="pallas_interpret")).init_cache(3, 32)
  assert isinstance(joint, JointCache) and joint.kv.shape == (2, 3, 2, 32, 16)
  plain = init_model(CFG).init_cache(3, 32)
  assert isinstance(plain, LayerCache) and plain.k.shape == (2, 3, 2, 32, 8)


def test_decode_with_a_kv_mask_matches_the_xla_path():
  """One new token a step over a cache with holes (`kv_mask`), no prompt block: the kernel path's
  hidden states and the cache it writes (keys | values) at the real tokens equal the einsum
  path's. More than one new token a row is the einsum path's alone: a clear error."""
  rng = np.random.RandomState(1)
  models = {a: init_model(dataclasses.replace(CFG, decode_attention=a), seed=5) for a in ("xla", "pallas_interpret")}
  ids = jnp.asarray(rng.randint(1, CFG.vocab_size, (2, 8)))
  kv_mask = np.ones((2, 24), np.int32)
  kv_mask[0, :3] = 0
  kv_mask[1, 6] = 0
  out = {}
  for name, model in models.items():
    cache, h = model.init_cache(2, 24), []
    for i in range(8):
      hs, cache = model.hidden_states(
          ids[:, i : i + 1],
          positions=jnp.full((2, 1), i),
          cache=cache,
          cache_index=jnp.int32(i),
          kv_mask=jnp.asarray(kv_mask),
      )
      h.append(np.asarray(hs))
    out[name] = (np.concatenate(h, 1), cache)
  real = kv_mask[:, :8] > 0  # a padding token's own output is never read
  np.testing.assert_allclose(out["pallas_interpret"][0][real], out["xla"][0][real], rtol=1e-5, atol=1e-5)
  joint, plain = out["pallas_interpret"][1].kv, out["xla"][1]
  # the slots of real tokens: a padding token sees no key, not even its own, so its output (and
  # the keys / values the next layer writes from it) are arbitrary in both paths and never read
  # (masked for every row); the kernel skips the cache blocks it has no key in
  want = np.concatenate([plain.k, plain.v], -1)  # [L, B, K, S, 2H]
  for row in range(2):
    slots = np.flatnonzero(kv_mask[row, :8])
    np.testing.assert_allclose(joint[:, row][:, :, slots], want[:, row][:, :, slots], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(joint[0], want[0], rtol=1e-6, atol=1e-6)  # layer 0: from the embeddings
  with pytest.raises(ValueError, match="takes one new token a row, got 3"):
    models["pallas_interpret"].hidden_states(
        ids[:, :3], cache=models["pallas_interpret"].init_cache(2, 24), cache_index=jnp.int32(0)
    )


@pytest.mark.parametrize("mesh_shape", [None, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_greedy_rollout_over_the_joint_cache_equals_the_xla_rollout(mesh_shape):
  """Prompts shared by 4 samples (the prompt block read once a prompt), bounded decode phases:
  greedy tokens, log-probs and logits equal the einsum path's, unsharded and on the 8-device
  mesh (the kernel per shard of rows and KV heads)."""
  from ict_jax import sharding

  mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
  rng = np.random.RandomState(0)
  ids = rng.randint(1, CFG.vocab_size, (2, 9))
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  kw = dict(max_new_tokens=24, temperature=0.0, rng=jax.random.key(0), eos_token_ids=(), pad_id=0, num_samples=4)
  outs = {}
  for name in ("xla", "pallas_interpret"):
    model = init_model(dataclasses.replace(CFG, decode_attention=name), seed=3)
    outs[name] = [
        np.asarray(x) for x in sampling.generate(model, ids * mask, mask, mesh=mesh, return_logits=True, **kw)
    ]
  (ids_x, mask_x, lp_x, logits_x), (ids_p, mask_p, lp_p, logits_p) = outs["xla"], outs["pallas_interpret"]
  np.testing.assert_array_equal(ids_p, ids_x)
  np.testing.assert_array_equal(mask_p, mask_x)
  np.testing.assert_allclose(lp_p, lp_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits_p, logits_x, rtol=1e-4, atol=1e-4)


def test_decode_attention_choice_resolves_by_platform():
  cpu = jax.devices("cpu")
  assert setup.resolve_decode_attention("auto", cpu) == "xla"
  assert setup.resolve_decode_attention("pallas_interpret", cpu) == "pallas_interpret"
  with pytest.raises(
      ConfigError, match=r"config.model.decode_attention: 'pallas' is a TPU kernel and the devices are cpu"
  ):
    setup.resolve_decode_attention("pallas", cpu)
  with pytest.raises(ValueError, match=r"Qwen2Config.decode_attention: expected one of"):
    dataclasses.replace(CFG, decode_attention="flash")


@pytest.mark.parametrize("bound, steps", [(256, 12), (512, 20), (768, 28), (2048, 68)])
def test_grid_steps_at_qwen2_5_0_5b_shapes(bound, steps):
  """One v5e chip's share of the 0.5B recipe's decode (128 rows of 16 prompts, 2 KV heads of 7
  query heads, 64-value heads, 512 prompt slots, 2048 completion slots, bf16), counted from the
  traced program as `ict_jax.aot` counts it: a grid step reads all KV heads of 32 rows (4 whole
  prompts) and 128 slots (a 2 MiB block), so 4 row blocks x (the prompt block + bound / 128 cache
  blocks). A step a prompt and KV head (the kernel before) took 64, 64, 128 and 160."""
  from ict_jax.aot.sampler import pallas_grid_steps

  f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  bias = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  args = (
      f(128, 1, 2, 7, 64),
      f(128, 1, 2, 64),
      f(128, 1, 2, 64),
      (bias(16, 1, 1, 1, 1, 512), bias(128, 1, 1, 1, bound), bias(1, 1, 1, 1, 1)),
      f(24, 128, 2, 2048, 128),
      f(24, 16, 2, 512, 128),
  )
  jaxpr = jax.make_jaxpr(lambda q, k, v, m, kv, pre: decode_kernel.decode_attention(q, k, v, m, kv, 3, pre))(*args)
  assert pallas_grid_steps(jaxpr.jaxpr) == steps
