"""Decode reads what was written: the decode loop runs in length-bounded phases, each step reading
only the completion slots within its phase's bound."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from compilers import LIBS_DIR, SKIP_REASON, libtpu_found

from ict_jax import sampling
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Qwen2Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def test_phase_bounds_and_the_slots_they_read():
  assert sampling.decode_phases(16) == (16,)
  assert sampling.decode_phases(64) == (16, 32, 48, 64)
  assert sampling.decode_phases(2048) == tuple(range(256, 2049, 256))
  assert sampling.decode_phases(100) == (16, 32, 48, 64, 80, 96, 100)
  ratio = sampling.kv_read_over_filled
  # one sub-batch of the paper's rollout on v5e-8 (64 prompts x 8 rows, 512 + 2048): every step
  # reading all 2048 completion slots reads ~2x what was written; 8 phases <= 1.2x
  assert ratio((2048,), 64, 512, 512) == pytest.approx(1.94, abs=0.01)
  assert ratio(sampling.decode_phases(2048), 64, 512, 512) <= 1.2
  # by hand: N 4 in one phase, 1 prompt of 2 slots, 2 rows: steps 1..3 read 2 + 2 x 4, of which
  # 2 + 2 x (i - 1) are written: 2 + 4 + 6
  assert ratio((4,), 1, 2, 2) == pytest.approx(30 / 12)


def test_stretches_cut_each_phase_into_up_to_four_of_at_least_sixteen_steps():
  """`decode_stretches`: the compacted decode's checks for finished rows. Each phase's steps in
  equal stretches ending at its bound, 4 when the phase has >= 64 steps; the ends strictly
  increase and the last is max_len."""
  stretch = lambda n: sampling.decode_stretches(sampling.decode_phases(n))
  assert stretch(64) == tuple((b, b) for b in (16, 32, 48, 64))  # 16-step phases: one stretch each
  assert stretch(256)[:3] == ((16, 32), (32, 32), (48, 64))
  assert stretch(2048) == tuple((64 * j, 256 * -(-j // 4)) for j in range(1, 33))  # every 64 steps
  for n in (16, 48, 100, 256, 1000, 2048):
    ends, bounds = zip(*stretch(n))
    assert ends[-1] == n and all(a < b for a, b in zip(ends, ends[1:])) and all(e <= b for e, b in zip(ends, bounds))
    assert sorted(set(bounds)) == list(sampling.decode_phases(n)) and all(e in ends for e in bounds)


def test_compacted_rows_keep_every_live_row_in_eighths_of_a_shard():
  # 128 rows a shard (1.5B v5e-8): units of 16 rows
  got = [sampling.compacted_rows(n, 128) for n in range(129)]
  for live, kept in enumerate(got):
    assert kept >= live and kept % 16 == 0 and kept <= 128 and kept - live < 16 or (live == 0 and kept == 16)
  assert sorted(set(got)) == list(range(16, 129, 16))  # at most 8 batch sizes
  # shards smaller than 8 rows: units of one row; a ragged shard rounds its unit up
  assert [sampling.compacted_rows(n, 4) for n in range(5)] == [1, 1, 2, 3, 4]
  assert [sampling.compacted_rows(n, 12) for n in (1, 2, 3, 11, 12)] == [2, 2, 4, 12, 12]


def test_finer_compaction_units_hold_a_tile_of_rows():
  """units 16: 128 rows a shard (v5e-8) in 16 units of 8 rows; 64 rows (v5p-32) keep units of 8 rows
  (8 units: a unit finer than an eighth holds at least 8 rows, a TPU tile); 32 rows units of 4 (an
  eighth); units 2 of 4 rows: 2 rows. Coarser units are taken as asked."""
  assert sorted({sampling.compacted_rows(n, 128, 16) for n in range(129)}) == list(range(8, 129, 8))
  assert sorted({sampling.compacted_rows(n, 64, 16) for n in range(65)}) == list(range(8, 65, 8))
  assert sorted({sampling.compacted_rows(n, 32, 16) for n in range(33)}) == list(range(4, 33, 4))
  assert [sampling.compacted_rows(n, 4, 2) for n in range(5)] == [2, 2, 2, 4, 4]
  assert sorted({sampling.compacted_rows(n, 128, 4) for n in range(129)}) == [32, 64, 96, 128]


def _sharp_model(seed, cfg=CFG):
  """Weights of std 0.2 (norm scales left at 1): greedy decoding that does not repeat one token."""
  model = init_model(cfg, seed=seed)
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: x if "scale" in str(p) else 10 * x, state))
  return model


@pytest.mark.parametrize("decode_attention", ["xla", "pallas_interpret"])
def test_phased_decode_matches_a_full_forward(decode_attention):
  """40 new tokens (bucket 64: phases 16, 32, 48, 64) for 2 prompts x 2 rows at temperature 1:
  the logits each token was sampled from equal one forward over prompt + completion, across the
  phase boundaries, on the 8-device mesh too; by the einsums and by the fused kernel (in the
  Pallas interpreter) over the joint cache."""
  import dataclasses

  from ict_jax import sharding

  model = _sharp_model(3, dataclasses.replace(CFG, decode_attention=decode_attention))
  rng = np.random.RandomState(0)
  ids = rng.randint(1, CFG.vocab_size, (2, 9))
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  ids = ids * mask
  kw = dict(max_new_tokens=40, temperature=1.0, rng=jax.random.key(0), eos_token_ids=(), pad_id=0, num_samples=2)
  for mesh in (None, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
    out, out_mask, _, logits = sampling.generate(model, ids, mask, mesh=mesh, return_logits=True, **kw)
    out = np.asarray(out)
    assert np.asarray(out_mask).all()
    full_ids = np.concatenate([np.repeat(ids, 2, 0), out], 1)
    full_mask = np.concatenate([np.repeat(mask, 2, 0), np.ones_like(out)], 1)
    ref = np.asarray(model(jnp.asarray(full_ids), jnp.asarray(full_mask)))[:, 8:48]
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-4, atol=1e-4)


def test_a_step_reads_only_its_phase_bound():
  """One decode step (jitted, cache donated) with a cache much larger than the weights: reading
  a bound of 256 of its 1024 completion slots accesses fewer bytes than reading all 1024, by at
  least the keys and values of the 768 slots it leaves unread (XLA's cost analysis; the in-place
  write of the new slot into the whole cache is the same in both)."""
  model = init_model(CFG)
  graphdef, state = nnx.split(model)
  b, s, p = 8, 1024, 16
  cache, prompt_cache = model.init_cache(b, s), model.init_cache(b, p)
  cost = {}
  for bound in (None, 256):

    def step(state, cache, tok, bound=bound):
      m = nnx.merge(graphdef, state)
      ones = jnp.ones((b,), jnp.int32)
      return sampling.decode_one(m, tok, p * ones, 100, cache, prompt_cache, jnp.ones((b, p)), bound)

    compiled = jax.jit(step, donate_argnums=1).lower(state, cache, jnp.zeros((b,), jnp.int32)).compile()
    c = compiled.cost_analysis()
    cost[bound] = (c[0] if isinstance(c, list) else c)["bytes accessed"]
  weights = sum(x.nbytes for x in jax.tree.leaves(state))
  assert sum(x.nbytes for x in cache) > 8 * weights  # the cache dominates: the check sees its reads
  unread = sum(x.nbytes for x in cache) * 768 // 1024
  assert cost[None] - cost[256] >= unread, (cost, unread)


_TPU_STEP_BYTES = textwrap.dedent("""
  import os, sys
  sys.path.insert(0, sys.argv[1])
  import libtpu
  os.environ.update(TPU_LIBRARY_PATH=libtpu.get_library_path(), TPU_SKIP_MDS_QUERY="1",
                    TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                    TPU_ACCELERATOR_TYPE="v5litepod-4", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  import json
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from ict_jax import sampling, sharding
  from ict_jax.aot.sampler import HBM_BYTES_OPTIONS, compile_decode_step, decode_cache
  from ict_jax.models.config import Qwen2Config
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                      chips_per_host_bounds=(2, 2, 1), num_slices=1)
  mesh = sharding.make_mesh((1, 4, 1), devices=list(topo.devices))
  def step_bytes(cfg, rows, slots, bound, **kw):
    policy = sampling.abstract_rollout_policy(cfg, dtype="bfloat16", mesh=mesh)
    cache, prompts = decode_cache(cfg, mesh, rows, slots, "bfloat16"), decode_cache(cfg, mesh, rows // 8, 16, "bfloat16")
    c = compile_decode_step(policy, mesh, cache, prompts, dict(greedy=False, top_k=0, use_top_p=False) | kw, bound,
                            HBM_BYTES_OPTIONS)
    c = c.cost_analysis()
    return (c[0] if isinstance(c, (list, tuple)) else c)["bytes accessed"]
  cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    dtype="bfloat16")
  costs = {f"phase_{b}": step_bytes(cfg, 64, 1024, b, greedy=True, top_k=1) for b in (128, 1024)}
  cfg = cfg.replace(vocab_size=151936, tie_word_embeddings=True)  # Qwen2.5's vocabulary, 128 rows a chip
  costs.update({m: step_bytes(cfg, 512, 128, 128, greedy=m == "greedy") for m in ("greedy", "plain")})
  # 64-value heads (Qwen2.5 0.5B's), 128 rows a chip, bound 256 of 1024 slots: the einsums and the kernel
  cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, dtype="bfloat16")
  for a in ("xla", "pallas"):
    costs[f"h64_{a}"] = step_bytes(cfg.replace(decode_attention=a), 512, 1024, 256, greedy=True, top_k=1)
  # the kernel alone at buckets off the tiling: a 100-slot cache read to 40 (48), a 24-slot prompt
  from jax.sharding import NamedSharding, PartitionSpec as P
  from ict_jax.models.decode_kernel import decode_attention
  sds = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))
  rows = ("data", "fsdp")
  q, k = sds((64, 1, 2, 7, 64), rows), sds((64, 1, 2, 64), rows)
  kv, pre = sds((3, 64, 2, 100, 128), None, rows), sds((3, 8, 2, 24, 128), None, rows)
  masks = tuple(jax.ShapeDtypeStruct(x, jnp.float32, sharding=NamedSharding(mesh, P(*sp)))
                for x, sp in (((8, 1, 1, 1, 1, 24), (rows,)), ((1, 1, 1, 1, 40), ()), ((1, 1, 1, 1, 1), ())))
  with jax.set_mesh(mesh):
    odd = jax.jit(lambda *a: decode_attention(*a[:4], a[4], jnp.int32(1), a[5])).lower(q, k, k, masks, kv, pre).compile()
  costs["odd_buckets"] = (lambda c: c[0] if isinstance(c, (list, tuple)) else c)(odd.cost_analysis())["bytes accessed"]
  policy = sampling.abstract_rollout_policy(cfg, dtype="bfloat16", mesh=mesh)
  costs["h64_weights"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(policy.state))
  print(json.dumps(costs))
""")


@pytest.fixture(scope="module")
def tpu_step_bytes(tmp_path_factory):
  """`cost_analysis()` bytes accessed a chip of decode steps as `ict_jax.aot` compiles them for a
  TPU (v5e, 4 chips), one subprocess (libtpu on the CPU, compile only)."""
  if not libtpu_found():
    pytest.skip(SKIP_REASON)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, "-c", _TPU_STEP_BYTES, LIBS_DIR],
      env=env,
      cwd=str(tmp_path_factory.mktemp("tpu")),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_bounded_phase_step_skips_the_unread_slots_on_tpu(tpu_step_bytes):
  """64 rows x 1024 completion slots: the phase of bound 128 reads 7/8 of the cache less than
  the step reading all 1024 slots. Each layer slicing its own [B, K, S, H] made XLA materialise
  every layer's whole cache before the slice: the bounded step then read ~2.8x the full step's
  bytes."""
  kv_bytes_per_chip = 2 * 2 * (64 // 4) * 2 * 1024 * 16 * 2  # keys + values [L, B/4, K, S, H] bf16
  assert tpu_step_bytes["phase_1024"] - tpu_step_bytes["phase_128"] >= (1 - 128 / 1024) * kv_bytes_per_chip


def test_plain_sampling_costs_what_greedy_costs_on_tpu(tpu_step_bytes):
  """Qwen2.5's 151,936-id vocabulary, 128 rows a chip: a decode step sampling at temperature 1
  (the paper configs') moves at most one [rows, V] float32 logits array's bytes more than the
  greedy step (measured: 0.0; the Gumbel-max draw's noise is made inside its argmax). The
  inverse-CDF draw before it moved 3.1 more (counted as `ict_jax.aot` counts, without on-chip
  staging); built as a [B, V] weight array, earlier still, it was written, re-laid out and padded."""
  logits_bytes_per_chip = (512 // 4) * 151936 * 4
  assert tpu_step_bytes["plain"] - tpu_step_bytes["greedy"] <= logits_bytes_per_chip


def test_the_fused_decode_kernel_reads_about_weights_plus_kv_on_tpu(tpu_step_bytes):
  """64-value heads (Qwen2.5 0.5B's), 128 rows a chip, phase bound 256: the decode step with the
  fused kernel over the joint cache (decode_attention "pallas", compiled by Mosaic) accesses
  less than the einsums' step and at most 1.3x its rollout weights + the KV it reads (the
  einsums' step: the scores' round trips and the slots-minor cache's one-slot write)."""
  kv = 2 * 128 * 2 * (256 * 2 * 64) * 2  # layers x rows x KV heads x (256 slots x key | value) bf16
  prompts = 2 * 16 * 2 * (16 * 2 * 64) * 2  # 16 prompts a chip, 16 slots
  minimum = tpu_step_bytes["h64_weights"] + kv + prompts
  assert tpu_step_bytes["h64_pallas"] < tpu_step_bytes["h64_xla"]
  assert tpu_step_bytes["h64_pallas"] <= 1.3 * minimum, (
      tpu_step_bytes["h64_pallas"] / minimum,
      tpu_step_bytes["h64_xla"] / minimum,
  )


def test_the_fused_decode_kernel_compiles_at_buckets_off_the_tiling_on_tpu(tpu_step_bytes):
  """Mosaic takes the kernel at a phase bound (40) and a prompt bucket (24) that are not
  multiples of the 128-slot blocks, nor the bound of a bf16 tile's 16 rows (read to 48, the
  extra slots masked): the odd `rollout` buckets a config may list."""
  kv = 64 // 4 * 2 * 48 * 128 * 2  # rows a chip x KV heads x 48 slots x key | value bf16
  assert tpu_step_bytes["odd_buckets"] >= kv
