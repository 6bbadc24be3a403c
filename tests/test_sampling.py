"""ict_jax.sampling against transformers' generate / logits warpers and a full forward pass (the
compiled sampler's KV cache traffic: tests/test_sampling_cache.py)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ict_jax import load_pretrained, sampling, sharding  # noqa: E402
from ict_jax.sampling import generate, sample_fn, sample_logits  # noqa: E402

VOCAB = 256
PAD = 0
N_NEW = 12


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
  """A random tiny Qwen2 in transformers and ours: std 0.2 weights with unit norm scales, so
  greedy decoding does not collapse into repeating one token."""
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=VOCAB,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      tie_word_embeddings=True,
      rope_theta=10000.0,
      rms_norm_eps=1e-6,
      max_position_embeddings=64,
  )
  hf = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.2)
  path = os.path.join(tmp_path_factory.mktemp("hf"), "tiny")
  hf.save_pretrained(path)
  return hf, load_pretrained(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def model(hf_and_model):
  return hf_and_model[1]


def _prompts():
  """Two left-padded prompts of lengths 5 and 9."""
  rng = np.random.RandomState(0)
  ids = rng.randint(1, VOCAB, (2, 9))
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  ids[mask == 0] = PAD
  return ids, mask


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
  return nnx.merge(graphdef, state)(ids, mask)


def _full_logits(model, prompt_ids, prompt_mask, ids, mask):
  """Logits that predict each completion token, from one forward over prompt + completion."""
  full_ids = np.concatenate([prompt_ids, np.asarray(ids)], axis=1)
  full_mask = np.concatenate([prompt_mask, np.asarray(mask)], axis=1)
  logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(full_ids), jnp.asarray(full_mask)))
  p = prompt_ids.shape[1]
  return logits[:, p - 1 : p - 1 + ids.shape[1]]  # [B, N, V]


def _check_layout(ids, mask, logprobs, eos):
  """mask 1...1 0...0; the last token under the mask is EOS iff the row stopped early; no EOS
  earlier; pad and log-prob 0 after."""
  ids, mask, logprobs = map(np.asarray, (ids, mask, logprobs))
  for row_ids, row_mask, row_lp in zip(ids, mask, logprobs):
    n = int(row_mask.sum())
    assert n >= 1 and (row_mask[:n] == 1).all() and (row_mask[n:] == 0).all()
    assert not np.isin(row_ids[: n - 1], eos).any()
    if n < len(row_ids):
      assert row_ids[n - 1] in eos
    assert (row_ids[n:] == PAD).all() and (row_lp[n:] == 0).all()


def _hf_warped_logprobs(logits, temperature, top_k, top_p):
  """log-probs of transformers' sampling distribution (Temperature -> TopK -> TopP warpers)."""
  from transformers.generation import logits_process as lp

  scores = torch.tensor(np.asarray(logits, np.float32))
  scores = lp.TemperatureLogitsWarper(temperature)(None, scores)
  if top_k:
    scores = lp.TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1.0:
    scores = lp.TopPLogitsWarper(top_p)(None, scores)
  return torch.log_softmax(scores.double(), dim=-1).numpy()


# ---- greedy vs transformers --------------------------------------------------------------------
def test_greedy_matches_transformers_generate(hf_and_model):
  hf, model = hf_and_model
  ids, mask = _prompts()
  free, free_mask, _ = generate(model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(), pad_id=PAD)
  free = np.asarray(free)
  assert len(set(free.ravel().tolist())) > 6, "degenerate greedy tokens: test is not meaningful"
  assert (np.asarray(free_mask) == 1).all()
  eos = int(free[0, 4])  # a token row 0 emits: both rows must stop on it identically
  out, out_mask, lp = generate(
      model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(eos,), pad_id=PAD
  )
  _check_layout(out, out_mask, lp, (eos,))
  assert np.asarray(out_mask)[0].sum() <= 5
  for eos_ids, ours in (([], free), ([eos], np.asarray(out))):
    with torch.no_grad():
      ref = hf.generate(
          input_ids=torch.tensor(ids),
          attention_mask=torch.tensor(mask),
          max_new_tokens=N_NEW,
          do_sample=False,
          eos_token_id=eos_ids or None,
          pad_token_id=PAD,
      ).numpy()[:, ids.shape[1] :]
    ref = np.pad(ref, ((0, 0), (0, N_NEW - ref.shape[1])), constant_values=PAD)
    np.testing.assert_array_equal(ours, ref)


# ---- cache vs full forward, log-probs ----------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 20, 0.8)])
def test_cache_logits_and_logprobs_match_full_forward(model, temperature, top_k, top_p):
  ids, mask = _prompts()
  eos = (7, 8)
  out, out_mask, lp, logits = generate(
      model,
      ids,
      mask,
      max_new_tokens=N_NEW,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      rng=jax.random.key(3),
      eos_token_ids=eos,
      pad_id=PAD,
      num_samples=2,
      return_logits=True,
  )
  _check_layout(out, out_mask, lp, eos)
  rep_ids, rep_mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
  ref = _full_logits(model, rep_ids, rep_mask, out, out_mask)
  valid = np.asarray(out_mask) == 1
  logits = np.asarray(logits)
  np.testing.assert_allclose(logits[valid], ref[valid], rtol=1e-5, atol=1e-5)
  # log-prob of each sampled token under the warped distribution, from the full forward's logits
  ref_lp = _hf_warped_logprobs(ref.reshape(-1, VOCAB), temperature, top_k, top_p)
  ref_lp = np.take_along_axis(ref_lp, np.asarray(out).reshape(-1, 1), axis=1).reshape(out.shape)
  assert np.isfinite(ref_lp[valid]).all(), "sampled a token outside the top-k / top-p set"
  np.testing.assert_allclose(np.asarray(lp)[valid], ref_lp[valid], atol=1e-4)
  if top_k == 0 and top_p == 1.0:  # plain temperature: log_softmax(logits / T)
    plain = jax.nn.log_softmax(jnp.asarray(ref) / temperature, axis=-1)
    plain = np.take_along_axis(np.asarray(plain), np.asarray(out)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp)[valid], plain[valid], atol=1e-4)


# ---- the sampler's distribution ----------------------------------------------------------------
@pytest.mark.parametrize(
    "vocab,scale,temperature,top_k,top_p",
    [
        (64, 2.0, 0.8, 0, 1.0),
        (64, 2.0, 1.0, 10, 1.0),
        (64, 2.0, 1.5, 0, 0.7),
        (64, 2.0, 1.0, 20, 0.9),
        (2500, 2.0, 1.0, 0, 1.0),
        (2500, 0.3, 0.9, 0, 0.85),
    ],
)  # flat: nucleus > 256 tokens, bisection
def test_sampler_frequencies_match_transformers_warpers(vocab, scale, temperature, top_k, top_p):
  logits = np.random.RandomState(vocab + top_k).randn(1, vocab).astype(np.float32) * scale
  draws = 20000 if vocab <= 64 else 6000
  keys = jax.random.split(jax.random.key(0), draws)
  fn = jax.jit(
      jax.vmap(lambda k: sample_logits(jnp.asarray(logits), k, temperature=temperature, top_k=top_k, top_p=top_p))
  )
  tok, lp = (np.asarray(x)[:, 0] for x in fn(keys))
  ref_lp = _hf_warped_logprobs(logits, temperature, top_k, top_p)[0]
  np.testing.assert_allclose(lp, ref_lp[tok], atol=1e-5)  # also: every draw has probability > 0
  probs = np.exp(ref_lp)
  freq = np.bincount(tok, minlength=vocab) / draws
  tv = 0.5 * np.abs(freq - probs).sum()
  expected_tv = 0.5 * np.sqrt(2 * probs * (1 - probs) / (np.pi * draws)).sum()  # sampling noise
  assert tv < 2.0 * expected_tv + 1e-3, (tv, expected_tv)


@pytest.mark.parametrize("scale", [4.0, 0.2])  # peaked: fast path; flat: bisection
def test_top_p_threshold_is_the_smallest_nucleus(scale):
  rng = np.random.RandomState(0)
  logits = rng.randn(3, 3000).astype(np.float32) * scale
  e = np.exp(logits - logits.max(-1, keepdims=True))
  top_p = np.float32(0.8)
  t = np.asarray(jax.jit(sampling.rules._top_p_threshold)(jnp.asarray(e), top_p))
  for row, thr in zip(e, t):
    desc = np.sort(row)[::-1].astype(np.float64)
    n = int(np.searchsorted(np.cumsum(desc), top_p * desc.sum()) + 1)  # smallest prefix
    assert (n > 256) == (scale < 1.0)  # both code paths are exercised
    assert thr == np.float32(desc[n - 1]), (thr, desc[n - 2 : n + 1])


def test_sample_logits_greedy_is_argmax():
  logits = np.random.RandomState(1).randn(4, 300).astype(np.float32)
  tok, lp = jax.jit(functools.partial(sample_logits, temperature=0.0))(logits, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
  ref = np.asarray(jax.nn.log_softmax(logits))[np.arange(4), logits.argmax(-1)]
  np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-6)


# ---- generate: keys, top_k=1, group layout, sharding, bucketing --------------------------------
def _greedy(model, ids, mask):
  return generate(model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(7, 8), pad_id=PAD)


def test_keys_top_k_1_and_group_layout(model):
  ids, mask = _prompts()
  kw = dict(max_new_tokens=N_NEW, eos_token_ids=(7, 8), pad_id=PAD, num_samples=2, return_logits=True)
  greedy = np.asarray(_greedy(model, ids, mask)[0])
  top1, _, top1_lp, _ = generate(model, ids, mask, temperature=1.0, top_k=1, rng=jax.random.key(5), **kw)
  np.testing.assert_array_equal(np.asarray(top1), np.repeat(greedy, 2, axis=0))  # g*G.. = prompt g
  np.testing.assert_allclose(np.asarray(top1_lp), 0.0, atol=1e-6)  # one candidate: probability 1
  sample = lambda seed: np.asarray(generate(model, ids, mask, temperature=0.7, rng=jax.random.key(seed), **kw)[0])
  a, b, c = sample(0), sample(0), sample(1)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  assert (a[0] != a[1]).any()  # the G samples of one prompt differ
  # every row stops at its first token, so the decode loop exits at once: no logits after step 0
  stop = tuple(sorted(set(a[:, 0].tolist())))
  _, m, _, lg = generate(model, ids, mask, temperature=0.7, rng=jax.random.key(0), **dict(kw, eos_token_ids=stop))
  m, lg = np.asarray(m), np.asarray(lg)
  assert (m[:, 0] == 1).all() and (m[:, 1:] == 0).all()
  assert (lg[:, 0] != 0).any() and (lg[:, 1:] == 0).all()


def test_mesh_2x2x2_matches_unsharded(model):
  ids, mask = _prompts()
  ref = [np.repeat(np.asarray(x), 3, axis=0) for x in _greedy(model, ids, mask)]
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  kw = dict(max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(7, 8), pad_id=PAD, num_samples=3)
  got = generate(model, ids, mask, mesh=mesh, **kw)  # 6 rows, padded to a multiple of 4 shards
  with jax.set_mesh(mesh):  # the mesh from the context
    got_ctx = generate(model, ids, mask, **kw)
  graphdef, state = nnx.split(model)  # the mesh the parameters live on
  on_mesh = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
  got_params = generate(on_mesh, ids, mask, **kw)
  for out in (got, got_ctx, got_params):
    assert all(x.shape == (6, N_NEW) for x in out)
    np.testing.assert_array_equal(np.asarray(out[0]), ref[0])
    np.testing.assert_array_equal(np.asarray(out[1]), ref[1])
    np.testing.assert_allclose(np.asarray(out[2]), ref[2], atol=1e-5)


def test_sample_fn_inside_jit_matches_generate(model):
  ids, mask = _prompts()
  graphdef, state = nnx.split(model)
  ref = _greedy(model, ids, mask)

  @jax.jit
  def run(state, ids, mask, key):
    return sample_fn(
        graphdef, state, ids, mask, key, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(7, 8), pad_id=PAD
    )

  got = run(state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), atol=1e-5)


def test_bucket_length():
  got = [sampling.bucket_length(n) for n in (1, 16, 17, 100, 128, 129)]
  assert got == [16, 16, 32, 128, 128, 256]
  assert sampling.bucket_length(5, [8, 24]) == 8 and sampling.bucket_length(9, [8, 24]) == 24
  assert sampling.bucket_length(30, [8, 24]) == 32  # past the list: next power of two


def test_bucketed_shapes_reuse_one_compilation(model):
  ids, mask = _prompts()
  kw = dict(rng=jax.random.key(0), eos_token_ids=(7, 8), pad_id=PAD, num_samples=2, return_logits=True)
  generate(model, ids, mask, max_new_tokens=5, temperature=0.7, **kw)
  before = sampling.decode._generate_jit._cache_size()
  out = generate(model, ids[:, 2:], mask[:, 2:], max_new_tokens=9, temperature=0.7, **kw)
  assert out[0].shape == (4, 9) and out[3].shape == (4, 9, VOCAB)  # cut back from the buckets
  generate(model, ids, mask, max_new_tokens=3, temperature=0.5, **dict(kw, eos_token_ids=(1,)))
  assert sampling.decode._generate_jit._cache_size() == before


# ---- bad inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=60), "context"),  # 9 prompt tokens + 60 > 64 positions
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(num_samples=0), "num_samples"),
        (dict(rng=None), "rng"),
        (dict(prompt_mask=np.ones((2, 8), np.int32)), "shape"),
        (dict(prompt_ids=np.ones((2, 70), np.int32), prompt_mask=np.ones((2, 70), np.int32)), "context"),
        (dict(prompt_mask=np.zeros((2, 9), np.int32)), "no tokens"),
        (dict(prompt_mask=np.full((2, 9), 2)), "only 0"),
        (dict(prompt_ids=np.ones((2, 9), np.float32)), "integers"),
        (dict(eos_token_ids=("<eos>",)), "eos_token_ids"),
        (dict(prompt_mask=np.tile([1, 1, 1, 1, 1, 0, 0, 0, 0], (2, 1))), "left-padded"),
        (dict(prompt_ids=np.full((2, 9), VOCAB)), "token ids"),
        (dict(decode_batch_size=3), "does not divide"),  # 2 rows
        (dict(decode_batch_size=0), "decode_batch_size"),
        (dict(rollout_dtype="float64"), "rollout_dtype"),
    ],
)
def test_bad_inputs_raise_before_compiling(model, change, match):
  ids, mask = _prompts()
  kw = dict(prompt_ids=ids, prompt_mask=mask, max_new_tokens=4, temperature=1.0, rng=jax.random.key(0))
  kw.update(change)
  before = sampling.decode._generate_jit._cache_size()
  with pytest.raises(ValueError, match=match):
    generate(model, **kw)
  assert sampling.decode._generate_jit._cache_size() == before


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_generate_with_a_128_wide_model_matches_full_forward(kernels):
  """Both kernel sets (hidden 128: "cpu" takes the multiply-and-reduce decode head and the
  two-level reductions): greedy tokens are the argmax of a full forward over the same sequence
  and log-probs its log_softmax."""
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import init_model

  model = init_model(
      Qwen2Config(
          vocab_size=VOCAB,
          hidden_size=128,
          intermediate_size=96,
          num_hidden_layers=2,
          num_attention_heads=4,
          num_key_value_heads=2,
          max_position_embeddings=64,
          kernels=kernels,
      ),
      seed=2,
  )
  graphdef, state = nnx.split(model)

  def scale(path, x):  # the matrices (per layer: [L, ...] stacked) and biases: not near-uniform
    stacked = getattr(path[0], "key", None) == "layers"
    return x * 10.0 if x.ndim - stacked == 2 else x

  state = jax.tree_util.tree_map_with_path(scale, state)
  model = nnx.merge(graphdef, state)
  ids, mask = _prompts()
  out, out_mask, lp = generate(model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(), pad_id=PAD)
  ref = _full_logits(model, ids, mask, out, out_mask)
  out = np.asarray(out)
  assert len(set(out.ravel().tolist())) > 4, "degenerate greedy tokens: test is not meaningful"
  np.testing.assert_array_equal(out, ref.argmax(-1))
  ref_lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(jnp.asarray(ref))), out[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-4)


# ---- the rollout copy and the memory plan ------------------------------------------------------
def test_decode_sub_batches_match_one_batch(model):
  """decode_batch_size splits the rows into sub-batches decoded one after the other: greedy
  tokens and log-probs equal the one-batch run, unsharded and on a mesh (8 rows: sub-batches of
  4 fill the 4 row shards; of 2 they are padded to 4)."""
  ids, mask = _prompts()
  kw = dict(max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(7, 8), pad_id=PAD, num_samples=4)
  ref = [np.asarray(x) for x in generate(model, ids, mask, **kw)]
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  for m, size in ((None, 2), (mesh, 4), (mesh, 2)):
    got = generate(model, ids, mask, mesh=m, decode_batch_size=size, **kw)
    np.testing.assert_array_equal(np.asarray(got[0]), ref[0])
    np.testing.assert_array_equal(np.asarray(got[1]), ref[1])
    np.testing.assert_allclose(np.asarray(got[2]), ref[2], atol=1e-5)
  # the same sub-batches dispatched one by one (`rollout.collect`): batch padding rows marked -1
  parts = list(sampling.generate_sub_batches(model, ids, mask, mesh=mesh, decode_batch_size=2, **kw))
  assert [sorted(r for r in p.rows if r >= 0) for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert all(sorted(p.rows) == [-1, -1, r, r + 1] for p, r in zip(parts, range(0, 8, 2)))
  for got, want in zip(sampling.join_sub_batches(parts), ref):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_sampled_sub_batches_match_full_forward(model):
  ids, mask = _prompts()
  out, out_mask, lp, logits = generate(
      model,
      ids,
      mask,
      max_new_tokens=N_NEW,
      temperature=0.8,
      rng=jax.random.key(1),
      eos_token_ids=(7, 8),
      pad_id=PAD,
      num_samples=2,
      return_logits=True,
      decode_batch_size=1,
  )
  _check_layout(out, out_mask, lp, (7, 8))
  rep_ids, rep_mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
  ref = _full_logits(model, rep_ids, rep_mask, out, out_mask)
  valid = np.asarray(out_mask) == 1
  np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], rtol=1e-5, atol=1e-5)
  ref_lp = np.asarray(jax.nn.log_softmax(jnp.asarray(ref) / 0.8, axis=-1))
  ref_lp = np.take_along_axis(ref_lp, np.asarray(out)[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(lp)[valid], ref_lp[valid], atol=1e-4)


def test_return_logprobs_false_leaves_them_out(model):
  ids, mask = _prompts()
  kw = dict(max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(7, 8), pad_id=PAD)
  ref = generate(model, ids, mask, **kw)
  got = generate(model, ids, mask, return_logprobs=False, **kw)
  assert len(got) == 2
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))


def test_auto_decode_batch_size():
  auto = sampling.auto_decode_batch_size
  assert auto(64, 4, 10**6, None) == 64  # no memory statistics (CPU): all rows
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert sampling.free_device_bytes(mesh.devices.flat) is None  # XLA:CPU reports none
  from ict_jax.models.config import Qwen2Config

  resolve = functools.partial(
      sampling.resolve_decode_batch_size,
      cfg=Qwen2Config.preset("tiny"),
      prompt_len=32,
      new_len=32,
      group_size=4,
      mesh=mesh,
      dtype="float32",
  )
  assert resolve("auto", 24) == 24 and resolve(None, 24) == 24 and resolve(6, 24) == 6
  # 64 rows over 4 row shards, 1 MB a row, 5 MB free: 0.8 x 5 MB holds 4 rows a device -> 16
  assert auto(64, 4, 10**6, 5 * 10**6) == 16
  assert auto(48, 4, 10**6, 2 * 10**6) == 4  # 1 row a device: the largest divisor <= 4
  with pytest.raises(ValueError, match="not even one row"):
    auto(64, 4, 10**6, 10**6)
  # groups of 8 rows share one prompt of 2 MB: 32 rows (4 prompts, 1 a device) need 8 x 1 + 2 MB
  # a device; 16 rows 4 + 2 x 2 MB (2 prompts do not split over 4 shards: both on every device);
  # 8 rows 2 + 2 MB
  kw = dict(group_size=8, prompt_bytes=2 * 10**6)
  assert auto(64, 4, 10**6, 13 * 10**6, **kw) == 32
  assert auto(64, 4, 10**6, 10 * 10**6, **kw) == 16
  assert auto(64, 4, 10**6, 9 * 10**6, **kw) == 8
  q = Qwen2Config.preset("qwen2_5_7b")  # 2 x 28 layers x 4 KV heads x 128 x 2 bytes = 56 KiB a token
  row = sampling.decode_row_bytes(q, 2304, None, "bfloat16")
  assert row == 56 * 1024 * 2304 + 8 * 152064 * 4
  mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})  # KV heads and vocab over 4
  assert sampling.decode_row_bytes(q, 2304, mesh, "bfloat16") == 14 * 1024 * 2304 + 8 * 38016 * 4


def test_rollout_policy_casts_and_lays_out_for_decoding(model):
  """make_rollout_policy: bfloat16 weights, nothing over fsdp, heads over tensor; the bf16
  rollout's logits match the float32 forward to bfloat16 precision."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  graphdef, state = nnx.split(model)
  on_mesh = jax.device_put(state, sharding.state_shardings(state, mesh))
  policy = sampling.make_rollout_policy(graphdef, on_mesh, dtype="bfloat16", mesh=mesh)
  assert nnx.merge(*policy).cfg.dtype == "bfloat16"
  for path, x in jax.tree_util.tree_leaves_with_path(policy.state):
    assert x.dtype == jnp.bfloat16, path
    assert "fsdp" not in jax.tree.leaves(tuple(x.sharding.spec)), (path, x.sharding.spec)
  q = policy.state["layers"]["attn"]["q_proj"]["kernel"]  # [L, D, N, H]: stacked layers
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
  ids, mask = _prompts()
  out, out_mask, logits = generate(
      policy,
      ids,
      mask,
      max_new_tokens=N_NEW,
      temperature=1.0,
      rng=jax.random.key(0),
      eos_token_ids=(),
      pad_id=PAD,
      return_logits=True,
      return_logprobs=False,
      mesh=mesh,
  )
  ref = _full_logits(model, ids, mask, out, out_mask)
  np.testing.assert_allclose(np.asarray(logits), ref, atol=0.05 * np.abs(ref).max())


def _all_gather_shapes(hlo: str) -> list[str]:
  import re

  return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


def test_decode_program_gathers_no_weights(model):
  """On the 8-device CPU mesh (fsdp 4, tensor 2) the compiled sampler, prefill and decode loop
  body alike, all-gathers no weight when it decodes with the rollout copy; with the training
  layout (FSDP-sharded) it gathers every matrix (the check can fail)."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  graphdef, state = nnx.split(model)
  policy = sampling.make_rollout_policy(graphdef, state, mesh=mesh)
  layout = sampling.decode_shardings(nnx.state(model, nnx.Param), mesh)
  train = jax.device_put(state, sharding.state_shardings(state, mesh)).to_pure_dict()
  f32 = lambda shape: f"f32[{','.join(map(str, shape))}]"
  # as a gather over fsdp makes them: the whole stacked [L, ...] array, or one layer's slice of it
  # (inside the scanned decoder stack)
  weights = [
      {f32(s.shard_shape(x.shape))} | ({f32(s.shard_shape(x.shape)[1:])} if x.ndim > 2 else set())
      for x, s in zip(jax.tree.leaves(train), jax.tree.leaves(layout))
      if "fsdp" in jax.tree.leaves(tuple(x.sharding.spec))
  ]
  assert len(weights) >= 4  # q/k/v/o, MLP and embedding matrices
  hlo = sampling.lower_generate(policy, 8, 16, 16, mesh=mesh).compile().as_text()
  assert "while" in hlo
  gathered = set(_all_gather_shapes(hlo))
  assert not any(w & gathered for w in weights), gathered
  hlo = sampling.lower_generate(sampling.RolloutPolicy(graphdef, train), 8, 16, 16, mesh=mesh).compile().as_text()
  gathered = set(_all_gather_shapes(hlo))
  assert all(w & gathered for w in weights), (weights, gathered)
