"""The compiled sampler's KV cache: the bytes one decode step reads (about the weights + the
cache), the decode loop writing the cache in place and once a step after the layer scan, and
decode sub-batches shrinking the compiled program's memory (tests/test_sampling.py checks the
sampler's outputs against transformers and a full forward pass)."""

import jax
import jax.numpy as jnp
from flax import nnx

from ict_jax import sampling


def _cache_test_config():
  from ict_jax.models.config import Qwen2Config

  return Qwen2Config(
      vocab_size=256,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=4,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=2048,
  )


def test_one_decode_step_reads_about_weights_plus_cache():
  """One decode step alone (jitted, cache donated), with a KV cache much larger than the weights:
  the bytes the compiled step accesses (XLA's cost analysis) stay within 1.5x of weights + cache.
  Scanning the cache as the layer scan's xs -> ys (slicing each layer out and re-stacking the
  whole cache every step) accessed 5.3x."""
  from ict_jax.models.qwen2 import init_model

  model = init_model(_cache_test_config())
  graphdef, state = nnx.split(model)
  b, s = 8, 1024
  cache = model.init_cache(b, s)  # [L, B, K, S, H] = [4, 8, 2, 1024, 16]: 8 MiB for K and V

  def step(state, cache, tok, i):
    m = nnx.merge(graphdef, state)
    h, cache = m.hidden_states(
        tok[:, None],
        jnp.ones((b, 1), jnp.int32),
        positions=jnp.full((b, 1), i),
        cache=cache,
        cache_index=i,
        kv_mask=jnp.ones((b, s), jnp.int32),
    )
    return m.next_token_logits(h[:, 0]), cache

  compiled = jax.jit(step, donate_argnums=1).lower(state, cache, jnp.zeros((b,), jnp.int32), jnp.int32(5)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  weights = sum(x.nbytes for x in jax.tree.leaves(state))
  cache_bytes = sum(x.nbytes for x in cache)
  assert cache_bytes > 8 * weights  # the cache dominates: the check sees cache traffic
  assert cost["bytes accessed"] <= 1.5 * (weights + cache_bytes), (cost["bytes accessed"], weights, cache_bytes)


def _hlo_computations(hlo: str) -> dict[str, list[str]]:
  """Compiled HLO text -> {computation name: its instruction lines}."""
  import re

  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def test_decode_loop_writes_the_cache_in_place():
  """In the compiled sampler, no loop body (the decode step's, the layer scan's) makes a
  [L, B, K, S, H] array other than by an in-place dynamic-update-slice: no copy of the cache, no
  fresh stacked buffer per step. The xs -> ys layer scan made a zero [L, ...] buffer and copied
  the whole cache twice in every decode step."""
  import re

  policy = sampling.abstract_rollout_policy(_cache_test_config(), dtype="float32")
  hlo = sampling.lower_generate(policy, 8, 64, 1024).compile().as_text()
  comps = _hlo_computations(hlo)
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  assert len(bodies) >= 2  # the decode loop and the layer scan inside it (at least)
  # the stacked decode cache (1024 completion slots) and the prompt cache (64 slots)
  full = r"= f32\[4,8,2,(?:1024|64),16\]\S* ([\w\-]+)\((.*)"
  made = []
  for body in bodies:
    for line in comps[body]:
      m = re.search(full, line)
      if not m or m.group(1) in ("parameter", "get-tuple-element", "bitcast", "tuple"):
        continue
      if m.group(1) == "dynamic-update-slice":
        continue
      called = re.search(r"calls=%?([\w.\-]+)", m.group(2))
      root = [x for x in comps.get(called.group(1), []) if "ROOT" in x] if called else []
      if m.group(1) == "fusion" and root and " dynamic-update-slice(" in root[0]:
        continue  # a fused in-place update
      made.append(line.strip()[:120])
  assert not made, made


def test_decode_step_writes_the_cache_once_after_the_layer_scan():
  """Read before write: in the compiled sampler the decode step's layer scan only reads the
  stacked cache [L, B, K, S, H] (each layer its old slice) and the step writes the new position of
  all L layers once, after the scan: the only instructions that make a decode-cache-shaped array
  are two in-place updates (K and V) of [L, B, K, 1, H] in each decode loop's body (one loop a
  phase), which holds the layer scan's loop (the prompt's keys/values are in their own cache,
  written by the prefill). Writing each layer's position inside the layer scan and reading the
  slice back made XLA copy every layer's [B, K, S, H] every step (1.5B on v5e-8: 2.34x the
  minimum bytes a step reads)."""
  import re

  policy = sampling.abstract_rollout_policy(_cache_test_config(), dtype="float32")
  hlo = sampling.lower_generate(policy, 8, 64, 1024).compile().as_text()
  comps = _hlo_computations(hlo)
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  full = r"= f32\[4,8,2,1024,16\]\S* ([\w\-]+)\((.*)"  # the stacked decode cache: 1024 slots
  writes = []  # (update shape, whether the body holds a loop)
  for body in bodies:
    for line in comps[body]:
      m = re.search(full, line)
      if not m or m.group(1) in ("parameter", "get-tuple-element", "bitcast", "tuple"):
        continue
      called = re.search(r"calls=%?([\w.\-]+)", line)
      scope = comps[called.group(1)] if called else comps[body]
      dus = [x for x in (scope if called else [line]) if " dynamic-update-slice(" in x]
      assert len(dus) == 1, line.strip()[:160]  # a write in place, not a copy or a fresh buffer
      update = re.findall(r"%([\w.\-]+)", dus[0].split(" dynamic-update-slice(", 1)[1])[1]
      made = [x for x in scope if re.match(rf"\s*(ROOT )?%?{re.escape(update)} = ", x)]
      assert len(made) == 1, (update, line.strip()[:160])
      shape = re.search(r" = (\w+\[[\d,]*\])", made[0]).group(1)
      writes.append((shape, any(" while(" in x for x in comps[body])))
  phases = len(sampling.decode_phases(1024))  # one decode loop a length-bounded phase
  assert sorted(writes) == [("f32[4,8,2,1,16]", True)] * 2 * phases, writes


def test_sub_batches_shrink_the_compiled_programs_memory():
  """lower_generate on an abstract rollout policy (no weights in memory): decoding 32 rows as 4
  sub-batches of 8 keeps one sub-batch's KV cache live, so the compiled program's temporaries
  shrink by ~4x, and its arguments are the bfloat16 weights, whole on each device."""
  from ict_jax.models.config import Qwen2Config

  cfg = Qwen2Config(
      vocab_size=256,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=2048,
  )
  policy = sampling.abstract_rollout_policy(cfg, dtype="bfloat16")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(policy.state))
  mem = {}
  for size in (32, 8):
    compiled = sampling.lower_generate(policy, 32, 64, 1024, decode_batch_size=size).compile()
    mem[size] = compiled.memory_analysis()
  cache_bytes = 2 * 2 * 2 * (64 + 1024) * 16 * 2  # K and V x layers x KV heads x slots x H x 2 B
  # (num_samples 1: a row's prompt slots are its own)
  assert mem[32].temp_size_in_bytes >= 32 * cache_bytes
  assert mem[8].temp_size_in_bytes < mem[32].temp_size_in_bytes / 2.5
  weights = sum(x.size * 2 for x in jax.tree.leaves(policy.state))
  assert mem[8].argument_size_in_bytes >= weights
