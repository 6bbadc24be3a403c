"""The one switch for the XLA:CPU formulations (`model.kernels`, `ict_jax/cpu_paths.py`): "auto"
resolves from the devices once at set-up (a TPU topology's compile-only devices: tests/test_aot.py),
and every "cpu" formulation gives the values of the portable path it replaces (which the reference
tests check on every mesh)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import cpu_paths, sampling, selection
from ict_jax.config import ConfigError, default_config, validate
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model
from ict_jax.setup import make_mesh, model_config, resolve_kernels


def _fake(platform: str, n: int):
  return [types.SimpleNamespace(platform=platform, id=i) for i in range(n)]


# ---- the switch ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "devices,want",
    [
        (_fake("tpu", 1), "portable"),
        (_fake("tpu", 8), "portable"),
        (_fake("gpu", 1), "portable"),
        (_fake("cuda", 8), "portable"),
        (_fake("cpu", 1), "cpu"),
        (_fake("cpu", 8), "portable"),
    ],
)
def test_auto_is_cpu_only_on_one_cpu_device(devices, want):
  assert resolve_kernels("auto", devices) == want
  assert resolve_kernels("portable", devices) == "portable"
  assert resolve_kernels("cpu", devices) == "cpu"  # an explicit choice is kept


def test_model_config_resolves_auto_from_the_mesh():
  """setup.model_config: the 8-device CPU mesh of the tests gets the portable kernels, a mesh of
  one CPU device the CPU ones; an explicit choice is passed through; a bad one is a ConfigError."""
  assert len(jax.devices()) == 8 and jax.devices()[0].platform == "cpu"
  cd = default_config()
  cfg = validate(cd)
  assert cfg.model.kernels == "auto"
  assert model_config(cfg, "", make_mesh(cfg)).kernels == "portable"  # 8 CPU devices
  cd.mesh.fsdp = 1
  one = validate(cd)
  assert model_config(one, "", make_mesh(one, devices=jax.devices()[:1])).kernels == "cpu"
  cd.model.kernels = "portable"
  assert model_config(validate(cd), "", make_mesh(one, devices=jax.devices()[:1])).kernels == "portable"
  cd.model.kernels = "cpu"
  assert model_config(validate(cd), "", make_mesh(cfg)).kernels == "cpu"
  cd.model.kernels = "fast"
  with pytest.raises(ConfigError, match="model.kernels"):
    validate(cd)
  with pytest.raises(ValueError, match="kernels"):
    Qwen2Config(kernels="auto")  # the model takes a resolved choice only


# ---- the decode head ----------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [8, 17])  # multiply-and-reduce (B <= 16, D 128); the einsum
@pytest.mark.parametrize("tied", [True, False])
def test_cpu_head_is_the_transposed_portable_head(batch, tied):
  model = init_model(
      Qwen2Config(
          vocab_size=1000,
          hidden_size=128,
          intermediate_size=64,
          num_hidden_layers=1,
          num_attention_heads=2,
          num_key_value_heads=1,
          tie_word_embeddings=tied,
      ),
      seed=1,
  )
  h = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, 128)), jnp.float32)
  portable = np.asarray(jax.jit(model.next_token_logits)(h))
  assert portable.shape == (batch, 1000)
  w = model.embed["embedding"][...] if tied else model.lm_head["kernel"][...].T
  ref = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(portable, ref, rtol=1e-5, atol=1e-5)
  got = jax.jit(lambda h: cpu_paths.head_logits(h, *model.head_weight()))(h)
  assert got.shape == (1000, batch)
  np.testing.assert_allclose(np.asarray(got).T, portable, rtol=1e-5, atol=1e-5)


# ---- greedy and plain sampling ------------------------------------------------------------------
def test_first_argmax_equals_numpy_argmax_with_ties_nan_and_inf():
  """The CPU greedy path's two-reduction argmax keeps numpy's semantics: first maximum, first NaN."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 5, (64, 37)).astype(np.float32)  # many ties
  x[3, 7] = np.nan
  x[5, :] = -np.inf
  x[6, [2, 9]] = np.nan
  x[7, :] = np.inf
  np.testing.assert_array_equal(np.asarray(cpu_paths.first_argmax(jnp.asarray(x))), np.argmax(x, -1))


@pytest.mark.parametrize("vocab", [300, 2048, 4099])  # padded last group, exact, padded
def test_cpu_greedy_equals_portable_greedy(vocab):
  """The two-level greedy step on vocabulary-major logits [V, B] and the portable argmax on
  [B, V]: numpy's argmax (first maximum, first NaN) and scipy's log_softmax at that token, with
  ties spread over different blocks."""
  from scipy.special import log_softmax

  rng = np.random.default_rng(vocab)
  x = rng.integers(0, 6, (vocab, 9)).astype(np.float32)  # many ties, in many blocks
  x[:, 1] = rng.standard_normal(vocab)
  x[vocab - 1, 2] = 50.0  # the maximum in the last (padded) block
  x[[5, vocab // 2], 3] = np.nan
  x[:, 4] = -np.inf
  x[[vocab - 3, 7], 5] = np.inf
  key, one = jax.random.key(0), jnp.float32(1.0)
  cpu = jax.jit(functools.partial(cpu_paths.plain_step, greedy=True))
  portable = jax.jit(
      functools.partial(sampling.rules._sample_step, greedy=True, top_k=0, use_top_p=False, kernels="portable")
  )
  tok, lp = (np.asarray(a) for a in cpu(jnp.asarray(x), key, one))
  ptok, plp = (np.asarray(a) for a in portable(jnp.asarray(x.T), key, one, one))
  want = np.argmax(x, axis=0)
  np.testing.assert_array_equal(tok, want)
  np.testing.assert_array_equal(ptok, want)
  ref = log_softmax(x.astype(np.float64), axis=0)[want, np.arange(9)]
  finite = [0, 1, 2, 6, 7, 8]
  np.testing.assert_allclose(lp[finite], ref[finite], atol=1e-5)
  np.testing.assert_allclose(plp[finite], ref[finite], atol=1e-5)


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
@pytest.mark.parametrize("vocab,temperature", [(64, 0.8), (2500, 1.3)])
def test_plain_sampling_draws_the_tempered_softmax(kernels, vocab, temperature):
  """Plain temperature sampling, both kernel sets: every draw's log-prob is log_softmax(logits / T)
  at the drawn token, and the frequencies match that distribution to sampling noise (the two
  paths draw different tokens from the same key: the same distribution, not the same draw)."""
  from scipy.special import log_softmax

  logits = np.random.RandomState(vocab).randn(1, vocab).astype(np.float32) * 2.0
  draws = 20000 if vocab <= 64 else 6000
  keys = jax.random.split(jax.random.key(1), draws)
  step = functools.partial(sampling.rules._sample_step, greedy=False, top_k=0, use_top_p=False, kernels=kernels)
  fn = jax.jit(jax.vmap(lambda k: step(jnp.asarray(logits), k, jnp.float32(temperature), jnp.float32(1.0))))
  tok, lp = (np.asarray(x)[:, 0] for x in fn(keys))
  ref_lp = log_softmax(logits[0].astype(np.float64) / temperature)
  np.testing.assert_allclose(lp, ref_lp[tok], atol=1e-5)
  probs = np.exp(ref_lp)
  freq = np.bincount(tok, minlength=vocab) / draws
  tv = 0.5 * np.abs(freq - probs).sum()
  expected_tv = 0.5 * np.sqrt(2 * probs * (1 - probs) / (np.pi * draws)).sum()  # sampling noise
  assert tv < 2.0 * expected_tv + 1e-3, (tv, expected_tv)


def test_generate_cpu_kernels_equal_portable():
  """A model built with kernels "cpu" and the same weights with "portable": the same greedy
  tokens, log-probs to 1e-5, and the same logits returned."""
  cfg = Qwen2Config(
      vocab_size=512,
      hidden_size=128,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=64,
  )
  graphdef, state = nnx.split(init_model(cfg, seed=3))
  state = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, state)  # not near-uniform
  rng = np.random.RandomState(0)
  ids = rng.randint(1, 512, (4, 9))
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  out = {}
  for kernels in ("portable", "cpu"):
    model = nnx.merge(nnx.graphdef(init_model(cfg.replace(kernels=kernels))), state)
    assert model.cfg.kernels == kernels
    out[kernels] = [
        np.asarray(x)
        for x in sampling.generate(
            model, ids, mask, max_new_tokens=10, temperature=0.0, eos_token_ids=(), return_logits=True
        )
    ]
  assert len(set(out["cpu"][0].ravel().tolist())) > 4, "degenerate greedy tokens"
  np.testing.assert_array_equal(out["cpu"][0], out["portable"][0])
  np.testing.assert_allclose(out["cpu"][2], out["portable"][2], atol=1e-5)
  np.testing.assert_allclose(out["cpu"][3], out["portable"][3], rtol=1e-5, atol=1e-4)


# ---- the ICT statistics -------------------------------------------------------------------------
def test_small_vocabularies_take_the_fused_pass_large_ones_the_row_blocks():
  """The row blocks are unrolled (N x C / ROW_BLOCK slices): over the task vocabulary of the
  default run they made a 2,300-fusion step that compiled in 42 s. Below BLOCKED_MIN_VOCAB
  kernels "cpu" lowers to the very program of the portable pass; from it up, to the blocks."""

  def text(kernels, v):
    x = jax.ShapeDtypeStruct((16, 20, v), jnp.float32)
    m = jax.ShapeDtypeStruct((16, 20), jnp.float32)
    return jax.jit(lambda x, m: selection.chunk_stats(x, m, 8, kernels=kernels)).lower(x, m).as_text()

  small, large = cpu_paths.BLOCKED_MIN_VOCAB - 1, cpu_paths.BLOCKED_MIN_VOCAB
  assert text("cpu", small) == text("portable", small)
  assert text("cpu", large) != text("portable", large)
  # the blocks: one log-softmax slice per row and block, so the program grows with N x C
  assert text("cpu", large).count("exponential") > 4 * text("portable", large).count("exponential")


@pytest.mark.parametrize("reference", sorted(selection.REFERENCES))
def test_blocked_stats_equal_the_fused_pass(reference, blocked_at_any_vocab):
  """chunk_stats with kernels "cpu" (2-D row blocks) equals the portable fused [N, C, V] pass on
  every statistic, with -inf entries, unequal lengths, an empty row and a short last block."""
  rng = np.random.default_rng(5)
  n, c, v = 8, 21, 300
  logits = (rng.standard_normal((n, c, v)) * 3).astype(np.float32)
  logits[2, :, :7] = -np.inf
  lengths = np.array([21, 5, 0, 17, 21, 1, 9, 20])
  mask = (np.arange(c)[None] < lengths[:, None]).astype(np.float32)
  args = (jnp.asarray(logits), jnp.asarray(mask))
  got = {
      k: jax.jit(lambda x, m, k=k: selection.chunk_stats(x, m, 4, reference=reference, kl=True, kernels=k))(*args)
      for k in ("portable", "cpu")
  }
  assert set(got["cpu"]) == set(got["portable"]) == {"entropy", "renyi2", "js", "kl"}
  for name in got["cpu"]:
    np.testing.assert_allclose(np.asarray(got["cpu"][name]), np.asarray(got["portable"][name]), rtol=1e-5, atol=2e-6)


def test_lm_head_with_cpu_kernels_equals_portable(blocked_at_any_vocab):
  """The train step's fused LM head (`lm_head.logp_and_stats`) passes `kernels` down to its
  statistics: log-probs, every statistic and the gradients agree between the two kernel sets."""
  from ict_jax import lm_head

  rng = np.random.default_rng(0)
  n, c, d, v = 8, 11, 16, 97
  h = jnp.asarray(rng.normal(size=(n, c, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)) * 0.5, jnp.float32)
  ids = jnp.asarray(rng.integers(0, v, size=(n, c)), jnp.int32)
  mask = np.ones((n, c), np.float32)
  mask[1, 7:] = 0
  mask = jnp.asarray(mask)
  g = jnp.asarray(rng.normal(size=(n, c)), jnp.float32)

  def run(kernels):
    def f(h, w):
      return lm_head.logp_and_stats(h, w, ids, mask, temperature=0.7, group_size=4, chunk_size=4, kernels=kernels)

    (logp, stats), vjp = jax.vjp(f, h, w)
    return logp, stats, vjp((g, jax.tree.map(jnp.zeros_like, stats)))

  programs = {k: jax.jit(lambda k=k: run(k)) for k in ("portable", "cpu")}
  assert programs["cpu"].lower().as_text() != programs["portable"].lower().as_text()  # the switch reaches it
  portable, cpu = programs["portable"](), programs["cpu"]()
  for a, b in zip(jax.tree.leaves(portable), jax.tree.leaves(cpu)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-6)
