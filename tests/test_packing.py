"""Packed decoder tokens (`packing.py`, `config.train.token_budget`): the packed step's loss,
gradients, log-probs and selection masks are the padded step's on the same batch, on the 8-device
CPU mesh, for the four methods with micro-batching on and off; the plan's shapes are bounded and
bad settings are one clear error."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ict_jax import config as config_lib
from ict_jax import packing, selection, sharding
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.config import IctConfig, OptimConfig
from ict_jax.models import attention
from ict_jax.models.qwen2 import init_model
from tiny import COMPILE_OPTIONS, tiny_config
from tiny import step_config as tiny_step_config

G, N, PROMPT, C, V = 4, 16, 6, 24, 128
BUDGET = 64  # the most tokens a packed row holds: rows of min(64, PROMPT + C) = 30 tokens
LENGTHS = np.array([23, 15, 9, 1, 5, 7, 3, 8, 12, 24, 3, 8, 19, 14, 2, 21])  # group 2: one head block
CFG = tiny_config(V)
MESH_SHAPE = (2, 2, 2)  # data x fsdp = 4 rows of devices
METHODS = ("grpo", "ict", "entropy", "stapo")


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt_len = np.repeat([6, 3, 4, 2], G)
  pmask = (np.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).astype(np.int32)
  pids = np.repeat((rng.integers(1, V, (N, PROMPT)) * pmask)[::G], G, 0).astype(np.int32)
  cmask = (np.arange(C)[None] < LENGTHS[:, None]).astype(np.int32)
  cids = (rng.integers(1, V, (N, C)) * cmask).astype(np.int32)
  adv = np.round(rng.normal(0, 1, N), 2).astype(np.float32)
  adv[::2], adv[1::2] = np.abs(adv[::2]) + 0.1, -np.abs(adv[1::2]) - 0.1
  return TrainBatch(prompt_ids=pids, prompt_mask=pmask, completion_ids=cids, completion_mask=cmask, advantages=adv)


@functools.cache
def model():
  graphdef, state = nnx.split(init_model(CFG, seed=0))
  scale = lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * 8.0  # peaked distributions
  return graphdef, jax.tree_util.tree_map_with_path(scale, state.to_pure_dict())


def step_config(method, mb, **kw):
  return tiny_step_config(
      group_size=G, method=method, warmup_steps=0, chunk_size=8, micro_batch_size=mb, entropy_top_fraction=0.3, **kw
  )


@functools.cache
def mesh_and_state():
  graphdef, params = model()
  opt = ts.make_optimizer(OptimConfig(learning_rate=1e-3, b1=0.0, max_grad_norm=0.0), 10)  # mu == gradient
  mesh = sharding.make_mesh(MESH_SHAPE)
  abstract = nnx.state(nnx.merge(graphdef, params), nnx.Param)
  params_sharding = sharding.pure_shardings(abstract, mesh)
  state_sharding = ts.train_state_shardings(opt, jax.eval_shape(lambda: params), params_sharding, mesh)
  state = ts.init_train_state(params, opt, mesh=mesh, params_sharding=params_sharding)
  return mesh, state_sharding, state, opt


@functools.cache  # one compile a (method, micro-batch) for the tests that share it
def compiled_step(method, mb):
  mesh, state_sharding, _, opt = mesh_and_state()
  return ts.make_train_step(
      model()[0],
      step_config(method, mb),
      opt,
      mesh=mesh,
      state_sharding=state_sharding,
      donate=False,
      compiler_options=COMPILE_OPTIONS,
  )


def packed(batch, mb):
  rows = MESH_SHAPE[0] * MESH_SHAPE[1]
  return packing.pack_batch(batch, token_budget=BUDGET, group_size=G, block=8, micro_batch_size=mb, multiple=rows)


# each method once, micro-batching on and off twice each (every compile costs seconds on CI);
# the masks of all four methods, per micro-batch and whole, are checked below without a step
@pytest.mark.parametrize(
    "method,mb", [("grpo", 0), ("ict", 2 * G), ("entropy", 2 * G), ("stapo", 0)], ids=lambda x: str(x)
)
def test_packed_step_equals_padded_step(method, mb):
  _, _, state, _ = mesh_and_state()
  batch = make_batch()
  step = compiled_step(method, mb)
  want_state, want_m, want_logp = step(state, batch)
  pk = packed(batch, mb)
  assert pk.packed.ids.shape[1] == PROMPT + C and pk.packed.ids.size <= N * (PROMPT + C)
  assert pk.packed.head_ids.size <= N * C
  got_state, got_m, got_logp = step(state, pk)  # the same step function, a packed batch
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
  assert 0 < float(want_m["selected_frac"]) <= 1 and float(want_m["loss"]) != 0
  mask = batch.completion_mask > 0
  np.testing.assert_allclose(np.asarray(got_logp)[mask], np.asarray(want_logp)[mask], rtol=1e-5, atol=1e-5)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mu(got_state)), jax.tree.leaves(mu(want_state))):
    b = np.asarray(b)
    np.testing.assert_allclose(
        np.asarray(a), b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path)
    )


def test_packed_step_with_the_kl_term_equals_padded_step():
  """`loss.beta` > 0 (the paper configs' "0.001 to enable"): the reference model's log-probs on
  the packed batch (its own packed decoder pass and LM head) give the padded step's KL, loss and
  gradients."""
  mesh, state_sharding, state, opt = mesh_and_state()
  graphdef = model()[0]
  ref = jax.tree.map(lambda x: x * 0.9, state.params)  # a reference the policy has moved from
  step = ts.make_train_step(
      graphdef,
      step_config("grpo", 0, beta=0.05),
      opt,
      mesh=mesh,
      state_sharding=state_sharding,
      donate=False,
      compiler_options=COMPILE_OPTIONS,
  )
  batch = make_batch()
  want_state, want_m, _ = step(state, batch, ref)
  got_state, got_m, _ = step(state, packed(batch, 0), ref)
  assert float(want_m["kl"]) > 1e-4
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  for a, b in zip(jax.tree.leaves(mu(got_state)), jax.tree.leaves(mu(want_state))):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_balanced_step_equals_padded_step_on_the_permuted_batch():
  """Token-balanced micro-batches (`balance=True`) on a batch whose consecutive micro-batches hold
  135 and 99 tokens: whole groups reordered to 107 and 127 tokens (here back to `make_batch()`'s
  order), and the packed step equals the padded step on that reordered batch; 20-Entropy, whose
  thresholds are per micro-batch, so the composition matters."""
  _, _, state, _ = mesh_and_state()
  want_batch = make_batch()
  order = np.concatenate([np.arange(G) + g * G for g in (0, 2, 1, 3)])
  tokens = lambda b: (b.prompt_mask.sum(1) + b.completion_mask.sum(1)).reshape(2, -1).sum(1).tolist()
  shuffled = want_batch.map_rows(lambda v: v[order])
  assert tokens(shuffled) == [135, 99] and tokens(want_batch) == [107, 127]
  rows = MESH_SHAPE[0] * MESH_SHAPE[1]
  pk = packing.pack_batch(
      shuffled, token_budget=BUDGET, group_size=G, block=8, micro_batch_size=2 * G, multiple=rows, balance=True
  )
  jax.tree_util.tree_map_with_path(  # every array of want_batch, and no other but the layout
      lambda path, a, b: np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path)),
      pk.replace(packed=None),
      want_batch,
  )
  step = compiled_step("entropy", 2 * G)
  want_state, want_m, _ = step(state, want_batch)
  got_state, got_m, _ = step(state, pk)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
  mu = lambda s: jax.tree.leaves(optax.tree_utils.tree_get(s.opt_state, "mu"))
  for a, b in zip(mu(got_state), mu(want_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_balance_groups_moves_whole_groups_and_evens_tokens():
  """`balance_groups`: a permutation of whole groups, mb / G groups a micro-batch, whose
  micro-batches' real tokens differ by at most the largest group's; a hand-solved case."""
  g, mb = 8, 64
  rng = np.random.default_rng(0)
  for trial in range(20):
    n = mb * int(rng.integers(1, 5))
    pmask = np.arange(40)[None] >= 40 - rng.integers(1, 41, n)[:, None]
    cmask = np.arange(300)[None] < np.minimum(rng.lognormal(4, 1.2, n).astype(int) + 1, 300)[:, None]
    perm = packing.balance_groups(pmask, cmask, group_size=g, micro_batch_size=mb)
    assert sorted(perm.tolist()) == list(range(n))
    groups = perm.reshape(-1, g)
    np.testing.assert_array_equal(groups, groups[:, :1] + np.arange(g))  # whole groups, rows in order
    per_group = (pmask.sum(1) + cmask.sum(1)).reshape(-1, g).sum(1)
    load = per_group[groups[:, 0] // g].reshape(n // mb, -1).sum(1)
    assert load.max() - load.min() <= per_group.max(), (trial, load)
  # groups of 10, 10, 1, 1 tokens in micro-batches of two groups: {10, 1} and {10, 1}
  cmask = np.repeat(np.array([10, 10, 1, 1]), 2)[:, None] > np.arange(10)[None]
  perm = packing.balance_groups(np.zeros((8, 1)), cmask, group_size=2, micro_batch_size=4)
  np.testing.assert_array_equal(perm, [0, 1, 4, 5, 2, 3, 6, 7])


def test_packed_selection_masks_equal_padded():
  """Each method's token mask, whole batch and per micro-batch, from the packed and the padded
  decoder's statistics (the dot_product block mask, einsum's is in the steps above)."""
  graphdef = nnx.split(init_model(dataclasses.replace(CFG, attention="dot_product")))[0]
  net = nnx.merge(graphdef, model()[1])
  batch = make_batch(1)
  pk = packing.pack_batch(batch, token_budget=BUDGET, group_size=G, block=8)
  pk = pk.map_rows(jnp.asarray)
  stats = jax.jit(lambda b: ts.completion_logp_and_stats(net, b, temperature=1.0, group_size=G, chunk_size=8))
  lp_pad, st_pad = stats(batch.map_rows(jnp.asarray))
  lp_pk, st_pk = stats(pk)
  mask = jnp.asarray(batch.completion_mask)

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def select(method, lp, st, rows):  # the selection the step makes on the micro-batch `rows`
    rows = slice(*rows)
    return selection.select_tokens(
        IctConfig(method=method, top_fraction=0.2, entropy_top_fraction=0.2, stapo_tau_p=0.3, stapo_tau_h_quantile=0.5),
        "grpo",
        mask=mask[rows],
        u=st["js"][rows],
        entropy=st["entropy"][rows],
        token_prob=jnp.exp(lp[rows]),
        advantages=jnp.asarray(batch.advantages)[rows],
    )[0]

  # the ablation's others_mean reference, over each piece's other rows (stacked slots hold two)
  others = jax.jit(
      lambda b: ts.completion_logp_and_stats(
          net, b, temperature=1.0, group_size=G, chunk_size=8, reference="others_mean"
      )[1]["js"]
  )
  want_js, got_js = np.asarray(others(batch.map_rows(jnp.asarray))), np.asarray(others(pk))
  np.testing.assert_allclose(got_js[mask > 0], want_js[mask > 0], rtol=1e-4, atol=1e-6)
  assert (want_js[mask > 0] > 0).mean() > 0.5 and not np.allclose(want_js, np.asarray(st_pad["js"]))
  for method in METHODS:
    for rows in ((0, N), (0, 2 * G), (2 * G, N)):  # the whole batch, then two micro-batches
      want, got = select(method, lp_pad, st_pad, rows), select(method, lp_pk, st_pk, rows)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{method} rows {rows}")
      assert 0 < int(want.sum()) < int(mask[slice(*rows)].sum()) or method == "grpo"


def test_plan_keeps_micro_batches_apart_and_shapes_bounded():
  batch = make_batch()
  out = packing.pack_batch(batch, token_budget=BUDGET, group_size=G, block=8, micro_batch_size=2 * G, multiple=4)
  rows = out.packed.ids.shape[0] // 2
  assert rows % 4 == 0
  lengths = batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)
  seg, pos = out.packed.segments, out.packed.positions
  for m in range(2):  # each micro-batch's rows hold its own sequences' tokens, each once
    block = slice(m * rows, (m + 1) * rows)
    assert (seg[block] > 0).sum() == lengths[m * 2 * G : (m + 1) * 2 * G].sum()
    real = pos[block][seg[block] > 0]
    assert sorted(np.bincount(real)[:1]) == [2 * G]  # one position 0 a sequence
  assert out.packed.head_index.max() < rows * (PROMPT + C)
  whole = packing.pack_batch(batch, token_budget=BUDGET, group_size=G, block=8)
  assert whole.packed.ids.shape[0] < N  # fewer decoder rows
  # the head's columns: a (group, block of 8) pair's live rows are a piece, stacked best fit in
  # slots of G = 4 rows; micro-batch 0's pieces have 4, 4, 3 and 1 rows: 3 slots ([4], [4], [3 + 1])
  # over its 2 stripes, 2 blocks of 8 columns each; micro-batch 1's 4, 4, 3, 2, 2, 1: 4 slots, 2
  # blocks; the whole batch's 7 slots in 4 stripes: 2 (side by side, whole groups: 2, 3 and 3 blocks)
  assert out.packed.head_ids.shape == whole.packed.head_ids.shape == (N, 16)
  seg = out.packed.head_segments.reshape(N // G, G, 2, 8)[..., 0]  # [stripe, row, slot]: one column each
  pieces_a_slot = [len(set(seg[i, :, j]) - {0}) for i in range(N // G) for j in range(2)]
  assert sorted(pieces_a_slot) == [0, 1, 1, 1, 1, 2, 2, 2]  # [4] x 4, [3 + 1] x 2, [2 + 2], one empty
  short = batch.replace(completion_mask=batch.completion_mask * (np.arange(C) < 8))  # 8 columns...
  short.completion_mask[0] = batch.completion_mask[0]  # ...but one row of 23: 3 + 1 + 1 + 1 blocks
  assert packing.pack_batch(short, token_budget=BUDGET, group_size=G, block=8).packed.head_ids.shape == (N, 16)
  # each real completion token sits once in the head's input, and comes back to its column
  for m in range(2):
    rows_m = slice(m * 2 * G, (m + 1) * 2 * G)
    flat_ids = out.packed.head_ids[rows_m].reshape(-1)
    assert out.packed.head_mask[rows_m].sum() == batch.completion_mask[rows_m].sum()
    live = out.packed.unhead_index[rows_m] < flat_ids.size
    np.testing.assert_array_equal(flat_ids[out.packed.unhead_index[rows_m][live]], batch.completion_ids[rows_m][live])
    assert live[batch.completion_mask[rows_m] > 0].all()
  # the bucket ladder: multiples of 4, 16 values a power of two, never below the rows needed
  ladder = {packing.packed_rows_bucket(r, 4) for r in range(1, 1025)}
  assert all(packing.packed_rows_bucket(r, 4) >= r for r in range(1, 1025)) and not any(x % 4 for x in ladder)
  assert len(ladder) <= 16 * np.log2(1024 / 4) + 16
  assert all(packing.packed_rows_bucket(r) <= r * 17 / 16 for r in range(1, 4000))
  with pytest.raises(ValueError, match="config.train.token_budget"):
    packing.pack_batch(batch, token_budget=20, group_size=G)


def test_packed_attention_equals_each_sequence_alone():
  rng = np.random.default_rng(0)
  t, lens = 16, (5, 7, 3)
  q = jnp.asarray(rng.normal(size=(1, t, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, t, 2, 8)), jnp.float32) for _ in range(2))
  seg = np.zeros((1, t), np.int32)
  seg[0, :15] = np.repeat([1, 2, 3], lens)
  packed = attention.PackedSegments(jnp.asarray(seg))
  runs = {impl: attention.attend(q, k, v, packed, impl) for impl in ("einsum", "dot_product", "cudnn")}
  # (float32 "cudnn" is XLA's call with the block mask; bfloat16 cuDNN: tests/test_attention.py).
  # "splash" (the TPU default) takes the ids as its kernel's segment ids: the kernel in the Pallas
  # interpreter, as `attend` calls it on TPU
  runs["splash"] = attention.splash_attention(q, k, v, packed.ids, interpret=True)
  for impl, got in runs.items():
    start = 0
    for n in lens:
      s = slice(start, start + n)
      alone = attention.einsum_attention(q[:, s], k[:, s], v[:, s], jnp.ones((1, n), jnp.int32))
      np.testing.assert_allclose(np.asarray(got[:, s]), np.asarray(alone), rtol=1e-5, atol=1e-5, err_msg=impl)
      start += n
  # and the splash kernels' backward pass (dq, dk, dv) on packed rows: the block mask's gradients
  w = jnp.asarray(rng.normal(size=(1, t, 1, 1)), jnp.float32) * (seg[..., None, None] > 0)
  loss = lambda fn: lambda q, k, v: jnp.sum((fn(q, k, v) * w) ** 2)
  want = jax.grad(loss(lambda *a: attention.attend(*a, packed, "einsum")), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(lambda *a: attention.splash_attention(*a, packed.ids, interpret=True)), argnums=(0, 1, 2))(
      q, k, v
  )
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


TOKENS = 4 * (PROMPT + C)  # token-budget micro-batches of 4 packed rows of 30 tokens


def test_token_micro_batches_hold_whole_groups_in_their_rows():
  """`token_micro_batches`: every group in one micro-batch, every packed row within its width,
  sequences never overlapping, and no more micro-batches than first fit decreasing opens; a group
  that cannot fit one micro-batch is one error."""
  lengths = make_batch().prompt_mask.sum(1) + LENGTHS
  width, rows = PROMPT + C, packing.micro_batch_tokens_rows(TOKENS, PROMPT + C, G, 4)
  assert rows == 4 and packing.micro_batch_tokens_rows(TOKENS, PROMPT + C, 8, 4) == 8  # a group fits
  micro, where, offset, rows = packing.token_micro_batches(lengths, group_size=G, width=width, rows=rows, multiple=4)
  assert rows == 4  # 3 micro-batches of 4 rows each are needed (below)
  assert (micro.reshape(-1, G) == micro[::G, None]).all()  # whole groups
  m = int(micro.max()) + 1
  # groups of 72, 35, 63 and 64 tokens, micro-batches of 120: no two of the three largest share one
  assert lengths.reshape(-1, G).sum(1).tolist() == [72, 35, 63, 64] and m == 3
  used = np.zeros((m, rows, width), int)
  for i in range(len(lengths)):
    used[micro[i], where[i], offset[i] : offset[i] + lengths[i]] += 1
    assert offset[i] + lengths[i] <= width
  assert used.max() == 1 and used.sum() == lengths.sum()
  with pytest.raises(ValueError, match="a group of 4 sequences .* does not fit a micro-batch of 1 rows of 30"):
    packing.token_micro_batches(np.full(8, 20), group_size=G, width=width, rows=1)
  # 32 sequences of 5 tokens, rows of 30 (6 sequences each), micro-batches of <= 16 rows: one
  # micro-batch, its rows shrunk by 4 while they hold all 32: 8 (4 hold 24)
  assert packing.token_micro_batches(np.full(32, 5), group_size=G, width=width, rows=16, multiple=4)[3] == 8


@functools.cache
def token_packed():
  return packing.pack_batch(
      make_batch(), token_budget=BUDGET, group_size=G, block=8, multiple=4, micro_batch_tokens=TOKENS
  )


def test_token_micro_batch_step_equals_padded_step():
  """Micro-batches formed by tokens (each 4 packed rows, as many whole groups as fit, empty row
  slots after them): ICT's step (micro-batch invariant) equals the padded whole-batch step on the
  input batch, each slot's log-probs its source row's; the empty slots count in no denominator
  (loss_type grpo: a mean over sequences)."""
  _, _, state, _ = mesh_and_state()
  batch = make_batch()
  pk = token_packed()
  src, mb = pk.packed.source_row, pk.packed.micro_batch_rows
  assert len(src) > N and (src < 0).any() and sorted(src[src >= 0]) == list(range(N))
  assert pk.packed.ids.shape == (len(src) // mb * 4, PROMPT + C)
  step = compiled_step("ict", 2 * G)  # its micro_batch_size is the packed batch's here
  want_state, want_m, want_logp = step(state, batch)
  got_state, got_m, got_logp = step(state, pk)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
  mask = batch.completion_mask[src[src >= 0]] > 0
  got = np.asarray(got_logp)[src >= 0][mask]
  np.testing.assert_allclose(got, np.asarray(want_logp)[src[src >= 0]][mask], rtol=1e-5, atol=1e-5)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  for a, b in zip(jax.tree.leaves(mu(got_state)), jax.tree.leaves(mu(want_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_token_micro_batch_entropy_step_equals_its_padded_layout():
  """20-Entropy's threshold is per micro-batch: the token-budget step equals the padded step on
  the same slots (the packed keys dropped, micro-batches of the packed batch's rows)."""
  _, _, state, _ = mesh_and_state()
  pk = token_packed()
  laid = pk.replace(packed=None)  # the padded step on these slots: micro-batches of pk's rows
  step = compiled_step("entropy", pk.packed.micro_batch_rows)
  _, want_m, want_logp = step(state, laid)
  _, got_m, got_logp = step(state, pk)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
  mask = pk.completion_mask > 0
  np.testing.assert_allclose(np.asarray(got_logp)[mask], np.asarray(want_logp)[mask], rtol=1e-5, atol=1e-5)
  assert 0 < float(want_m["selected_frac"]) < 1


@pytest.mark.parametrize(
    "budget,attention,match,tokens,mb",
    [
        (519, "auto", "config.train.token_budget: 519 tokens .* shorter than one sequence .* = 520", 0, 0),
        (0, "auto", "config.train.micro_batch_tokens: token-budget micro-batches need packed rows", 1024, 0),
        (520, "auto", "config.train.micro_batch_tokens: 519 tokens is less than one packed row", 519, 0),
        (520, "auto", r"config.train.micro_batch_tokens: .* train.micro_batch_size \(8\) must be 0", 1040, 8),
        (520, "sequence_mean", "config.ict.reference: 'sequence_mean' .* packed LM head", 0, 0),
    ],
)
def test_bad_packing_settings_are_one_config_error(budget, attention, match, tokens, mb):
  c = config_lib.default_config()  # data.max_prompt_len 512 + rollout.max_new_tokens 8
  c.train.token_budget, c.model.attention, c.model.dtype = budget, attention, "bfloat16"
  if attention == "sequence_mean":  # not an attention: the ICT reference packing cannot take
    c.model.attention, c.ict.reference = "auto", attention
  c.train.micro_batch_tokens, c.train.micro_batch_size = tokens, mb
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)
  c.train.token_budget, c.train.micro_batch_tokens, c.train.micro_batch_size = 520, 1040, 0
  c.model.attention, c.ict.reference = "splash", "active_mean"
  assert config_lib.validate(c).train.micro_batch_tokens == 1040
