"""Prefill once per prompt: the G samples of a prompt read one prefilled copy of its keys/values."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax import sampling
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model

CFG = Qwen2Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _sharp_model(seed):
  """Weights of std 0.2 (norm scales left at 1): greedy decoding that does not repeat one token."""
  model = init_model(CFG, seed=seed)
  state = nnx.state(model, nnx.Param)
  sharp = jax.tree_util.tree_map_with_path(lambda path, x: x if "scale" in str(path) else 10 * x, state)
  nnx.update(model, sharp)
  return model


def _prompts(u=2, p=9):
  rng = np.random.RandomState(0)
  ids = rng.randint(1, CFG.vocab_size, (u, p))
  mask = np.ones_like(ids)
  mask[0, :4] = 0  # left padding: lengths 5 and 9
  return jnp.asarray(ids * mask), jnp.asarray(mask)


def test_shared_prompt_cache_matches_a_cache_per_row():
  """Three decode steps of 2 prompts x 3 rows: with the prompt prefilled once and read as the
  shared prefix (`prefill` + `decode_one`), the logits equal those of the per-row path (each row
  its own copy of the prompt in one cache of P + N slots, visible by `kv_mask`)."""
  model = _sharp_model(1)
  ids, mask = _prompts()
  r, n = 3, 4
  tokens = jnp.asarray(np.random.RandomState(1).randint(1, CFG.vocab_size, (2 * r, n)))

  logits0, prompt_cache = sampling.prefill(model, ids, mask)
  num_prompt = jnp.repeat(mask.sum(-1), r)
  cache = model.init_cache(2 * r, n)
  shared = [jnp.repeat(logits0, r, axis=0)]
  for i in range(1, n):
    logits, cache = sampling.decode_one(model, tokens[:, i - 1], num_prompt, i, cache, prompt_cache, mask)
    shared.append(logits)

  rep_ids, rep_mask = jnp.repeat(ids, r, axis=0), jnp.repeat(mask, r, axis=0)
  p = ids.shape[1]
  full = model.init_cache(2 * r, p + n)
  positions = jnp.maximum(jnp.cumsum(rep_mask, -1) - 1, 0)
  h, full = model.hidden_states(rep_ids, rep_mask, positions=positions, cache=full, cache_index=0, prefill=True)
  per_row = [model.next_token_logits(h[:, -1])]
  kv_mask = jnp.concatenate([rep_mask, jnp.ones((2 * r, n), jnp.int32)], axis=1)
  for i in range(1, n):
    h, full = model.hidden_states(
        tokens[:, i - 1 : i],
        jnp.ones((2 * r, 1), jnp.int32),
        positions=(num_prompt + i - 1)[:, None],
        cache=full,
        cache_index=p + i - 1,
        kv_mask=kv_mask,
    )
    per_row.append(model.next_token_logits(h[:, 0]))
  got, ref = np.stack(shared, 1), np.stack(per_row, 1)
  assert np.abs(ref).max() > 1e-3  # the check sees real logits
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # rows of one prompt fed different tokens differ after the first step: they share only the prompt
  assert not np.allclose(got[0, 1:], got[1, 1:])


def test_greedy_samples_of_a_prompt_equal_its_single_row_decode():
  """Greedy: the G rows of a prompt (one prefilled copy read by all G) are identical and equal the
  prompt decoded on its own, unsharded and on the 8-device mesh, in sub-batches of whole groups,
  of part of a group (R = 2 rows share a prefill) and of rows from two groups."""
  from ict_jax import sharding

  model = _sharp_model(2)
  ids, mask = map(np.asarray, _prompts())
  kw = dict(max_new_tokens=8, temperature=0.0, eos_token_ids=(), pad_id=0)
  ref = np.asarray(sampling.generate(model, ids, mask, **kw)[0])
  assert len(set(ref.ravel().tolist())) > 2
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  for m, size in ((None, None), (None, 2), (mesh, None), (mesh, 4), (mesh, 2)):
    got = np.asarray(sampling.generate(model, ids, mask, num_samples=4, mesh=m, decode_batch_size=size, **kw)[0])
    np.testing.assert_array_equal(got, np.repeat(ref, 4, axis=0), err_msg=f"mesh {m is not None}, size {size}")


def test_decode_layout():
  """Which rows share a prefilled prompt and the padding of a sub-batch (`generate`'s layout)."""
  layout = sampling.decode_layout
  assert layout(1024, 8, 1024, 8) == (1, 128, 8)  # one sub-batch: each prompt once
  assert layout(1024, 8, 256, 8).prefill_rows == 128  # 4 sub-batches of 32 whole groups
  assert layout(1024, 8, 4, 1) == (256, 1, 4)  # half a group a sub-batch: each prompt twice
  assert layout(1024, 8, 4, 1).prefill_rows == 256
  assert layout(8, 4, 2, 4) == (4, 2, 2)  # 2 rows a sub-batch over 4 shards: 1 padding prompt
  assert layout(24, 8, 12, 1) == (2, 3, 4)  # 12 rows: 3 half-groups


def test_prompt_kv_memory_is_per_prompt():
  """The compiled sampler (abstract weights: nothing runs) for 32 rows of 1024-token prompts and
  64 new tokens: with G 8 its prompt argument has 4 rows, not 32, and its temporaries (the KV
  caches) shrink by more than 4x against G 1 (32 x (1024 + 64) slots -> 4 x 1024 + 32 x 64)."""
  policy = sampling.abstract_rollout_policy(CFG.replace(max_position_embeddings=2048), dtype="bfloat16")
  mem, args = {}, {}
  for g in (1, 8):
    lowered = sampling.lower_generate(policy, 32, 1024, 64, num_samples=g)
    args[g] = lowered.args_info[0][1].shape  # (state, prompt_ids, ...)
    mem[g] = lowered.compile().memory_analysis().temp_size_in_bytes
  assert args == {1: (32, 1024), 8: (4, 1024)}
  kv = 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 2  # bytes a slot, bf16
  assert mem[1] >= 32 * 1088 * kv
  assert mem[8] < mem[1] / 4, mem
