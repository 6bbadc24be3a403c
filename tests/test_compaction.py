"""Finished rows stop costing (`sampling/compact.py`): the decode with the finished rows dropped
between stretches (`plan.decode_stretches`) gives the tokens, masks and log-probs of the decode
that keeps every row to the end (`compact_rows=False`, one program) and of the EOS-free stream cut
at each row's first stop token (numpy), greedy and sampled, on the 8-device mesh, in sub-batches;
a key a row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import sampling, sharding
from ict_jax.models.qwen2 import Qwen2
from ict_jax.sampling import compact, decode_phases, generate
from tiny import tiny_config

VOCAB = 128
PAD = 0
N_NEW = 60  # bucket 64: phases (16, 32, 48, 64), three boundaries to compact at
SAMPLES = 4
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9)


def _model(**cfg):
  """The tiny Qwen2 with its weights (not its norm scales) x 10: greedy decoding varies its tokens
  instead of repeating one, so stop tokens end the rows at different lengths."""
  graphdef, state = nnx.split(Qwen2(tiny_config(VOCAB, 128, **cfg), rngs=nnx.Rngs(jax.random.key(0))))
  scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 10
  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(scale, state))


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})  # 4 row shards


def _prompts(n: int = 4):
  """n left-padded prompts of 4 to 9 tokens."""
  ids = np.random.RandomState(0).randint(1, VOCAB, (n, 9))
  mask = np.ones_like(ids)
  for row in range(n):
    mask[row, : (3, 0, 5, 1, 2, 4, 0, 1)[row % 8]] = 0
  ids[mask == 0] = PAD
  return ids, mask


def _run(model, eos, *, compact_rows, mesh=None, decode_batch_size=None, samples=SAMPLES, width=0, **sampling_kw):
  """16 rows: 16 / samples prompts, `samples` rows each (left-padded to `width` columns if wider)."""
  ids, mask = _prompts(16 // samples)
  if width:
    pad = ((0, 0), (width - ids.shape[1], 0))
    ids, mask = np.pad(ids, pad, constant_values=PAD), np.pad(mask, pad)
  kw = dict(temperature=0.0) | sampling_kw
  out = generate(
      model, ids, mask, max_new_tokens=N_NEW, rng=jax.random.key(7), eos_token_ids=eos, pad_id=PAD,
      num_samples=samples, mesh=mesh, decode_batch_size=decode_batch_size, compact_rows=compact_rows, **kw,
  )  # fmt: skip
  return [np.asarray(x) for x in out]


def _cut(stream: np.ndarray, stream_lp: np.ndarray, eos) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The EOS-free completions [rows, N] cut after each row's first token in `eos`: the reference."""
  ids, mask, lp = stream.copy(), np.ones_like(stream), stream_lp.copy()
  for r, row in enumerate(stream):
    hits = np.flatnonzero(np.isin(row, eos))
    if hits.size:
      end = hits[0] + 1
      ids[r, end:], mask[r, end:], lp[r, end:] = PAD, 0, 0.0
  return ids, mask, lp


def _stops(stream: np.ndarray, shards: int = 4) -> tuple[int, ...]:
  """Two stop tokens under which the rows end in as many different phases as possible, with one
  row at least running to the end and, at as many phase boundaries as can be, fewer rows live in
  the fullest of `shards` row blocks than a block holds: finished rows to drop, on the mesh too."""
  bounds = decode_phases(64)
  eq = stream[:, :, None] == np.arange(VOCAB)  # [rows, N, V]
  hit, first = eq.any(axis=1), eq.argmax(axis=1)  # [rows, V]: whether and where a token first comes
  best, best_score = (), -1
  for a in range(1, VOCAB):
    for b in range(a + 1, VOCAB):
      ends = np.where(hit[:, [a, b]], first[:, [a, b]] + 1, N_NEW + 1).min(axis=1)
      n = np.minimum(ends, N_NEW)  # each row's tokens
      if n.min() >= 16 or n.max() < N_NEW:
        continue
      live = [(n > bound).reshape(shards, -1).sum(axis=1).max() for bound in bounds[:-1]]
      shrinks = sum(most < len(n) // shards for most in live)
      score = shrinks * 1000 + len(set(np.searchsorted(bounds, n).tolist())) * 100 + len(set(n.tolist()))
      if score > best_score:
        best, best_score = (a, b), score
  return best


@pytest.fixture(scope="module", params=["greedy", "sampled"])
def case(request, model):
  """(sampling kwargs, stop tokens, the reference outputs cut from the EOS-free stream). Greedy:
  16 prompts of 1 row (a prompt's rows would be equal); sampled: 4 prompts of 4 rows."""
  kw = dict(samples=1) if request.param == "greedy" else dict(SAMPLED, samples=SAMPLES)
  stream = _run(model, (), compact_rows=False, **kw)
  eos = _stops(stream[0])
  lengths = _cut(stream[0], stream[2], eos)[1].sum(axis=1)
  assert len(set(lengths.tolist())) >= 3 and lengths.min() < 16 and lengths.max() == N_NEW, lengths
  return kw, eos, _cut(stream[0], stream[2], eos)


def _check(got, want):
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_allclose(got[2], want[2], atol=1e-5)  # float rounding of other batch shapes / meshes


@pytest.mark.parametrize(
    "where,decode_batch_size,min_stretch", [("one device", None, 16), ("mesh", None, 8), ("mesh", 8, 16)]
)
def test_compacted_rows_give_the_full_decodes_tokens(
    model, mesh, case, where, decode_batch_size, min_stretch, monkeypatch
):
  """Rows ending at scripted, different lengths: the compacted decode equals the decode that keeps
  every row (the product's path with compact_rows False) and the EOS-free stream cut at each
  row's first stop token; finished rows were dropped (fewer rows a shard at the boundaries).
  min_stretch 8: checks every 8 steps, mid-phase (`plan.decode_stretches`); 16: at the phases'."""
  monkeypatch.setattr(sampling.plan, "_MIN_STRETCH", min_stretch)
  kw, eos, ref = case
  m = mesh if where == "mesh" else None
  kept = []
  real = compact._compact
  monkeypatch.setattr(compact, "_compact", lambda c, *a, **k: (kept.append(k["keep"]), real(c, *a, **k))[1])
  full = _run(model, eos, compact_rows=False, mesh=m, decode_batch_size=decode_batch_size, **kw)
  got = _run(model, eos, compact_rows=True, mesh=m, decode_batch_size=decode_batch_size, **kw)
  _check(full, ref)
  _check(got, ref)
  shards = 1 if m is None else 4
  rows = (16 if decode_batch_size is None else decode_batch_size) // shards
  assert kept and all(k < rows for k in kept)  # the batch shrank


def test_compaction_units_set_the_rows_kept(model, mesh, case, monkeypatch):
  """compaction_units 2 (4 rows a shard): every compaction keeps a multiple of 2 rows a shard (1-row
  units by default here), and the tokens stay the reference's."""
  kw, eos, ref = case
  kept = []
  real = compact._compact
  monkeypatch.setattr(compact, "_compact", lambda c, *a, **k: (kept.append(k["keep"]), real(c, *a, **k))[1])
  _check(_run(model, eos, compact_rows=True, mesh=mesh, compaction_units=2, **kw), ref)
  assert kept and all(k == 2 for k in kept)
  with pytest.raises(ValueError, match="compaction_units must be an int >= 1"):
    _run(model, eos, compact_rows=True, compaction_units=0, **kw)


def test_sub_batches_one_by_one_match_generate(model, mesh, case):
  """`generate_sub_batches` (each sub-batch's phases driven by a worker thread while the caller
  holds the previous one) joins to `generate`'s outputs."""
  kw, eos, ref = case
  kw = dict(kw)
  samples = kw.pop("samples")
  ids, mask = _prompts(16 // samples)
  parts = list(
      sampling.generate_sub_batches(
          model, ids, mask, max_new_tokens=N_NEW, rng=jax.random.key(7), eos_token_ids=eos, pad_id=PAD,
          num_samples=samples, mesh=mesh, decode_batch_size=4, **(dict(temperature=0.0) | kw),
      )  # fmt: skip
  )
  assert len(parts) == 4 and sorted(r for p in parts for r in p.rows.tolist()) == list(range(16))
  _check([np.asarray(x) for x in sampling.join_sub_batches(parts)], ref)


def test_compiled_decode_programs_stay_within_the_bound(model, mesh, monkeypatch):
  """A decode of max_len 64 (4 phases, of 2 stretches here) compiles `_open` once, at most one
  `_phase` a phase bound and computed rows (a stretch's last step is traced), and over any
  rollouts at most phases x 8 of them (`plan.compacted_rows`: multiples of 1/8 of a shard's rows).
  Counted from jax's caches of each program, on a fresh shape (a prompt bucket no other test uses)."""
  monkeypatch.setattr(sampling.plan, "_MIN_STRETCH", 8)
  ids = np.random.RandomState(1).randint(1, VOCAB, (4, 20))  # prompt bucket 32
  mask = np.ones_like(ids)
  before = [f._cache_size() for f in (compact._open, compact._phase, compact._close)]
  real, pairs = compact._phase, set()
  spy = lambda state, c, *a, **k: (pairs.add((k["bound"], c.tok.shape[0])), real(state, c, *a, **k))[1]
  stream = np.asarray(
      generate(model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=(), pad_id=PAD,
               num_samples=8, mesh=mesh, compact_rows=False)[0]
  )  # fmt: skip
  eos = _stops(stream)
  kw = dict(max_new_tokens=N_NEW, temperature=0.0, eos_token_ids=eos, pad_id=PAD, num_samples=8, mesh=mesh)
  monkeypatch.setattr(compact, "_phase", spy)
  got = generate(model, ids, mask, **kw)
  np.testing.assert_array_equal(np.asarray(got[0]), _cut(stream, np.zeros(stream.shape, np.float32), eos)[0])
  phases = len(decode_phases(64))
  opened, phased, closed = (f._cache_size() - b for f, b in zip((compact._open, real, compact._close), before))
  assert opened == 1 and closed == 1
  assert len(sampling.decode_stretches(decode_phases(64))) == 2 * phases
  assert 1 <= phased == len(pairs) <= 8 * phases  # a program a (bound, rows) run
  generate(model, ids, mask, **kw)  # the same rollout again compiles nothing
  assert real._cache_size() - before[1] == phased
  assert real._cache_size() <= 8 * phases * 64  # a loose guard over the whole session


def test_only_moved_rows_cross_devices(model, mesh):
  """The compaction program without moves (cap 0: a gather within each row shard) has no
  collective; with moves (cap 2) its only collectives are collective-permutes, which carry the
  moved rows to the neighbouring shards (`balance`)."""
  from ict_jax.sampling import host

  ids, mask = _prompts()
  job = host._prepare(model, ids, mask, max_new_tokens=N_NEW, temperature=0.0, num_samples=SAMPLES, mesh=mesh,
                      pad_id=PAD, eos_token_ids=(1,))  # fmt: skip
  with jax.set_mesh(mesh):
    graphdef, state = sampling.as_rollout_policy(model, mesh=mesh)
    ids_, mask_, rows, rng, *scalars = host._place(job, job.ids, job.mask, job.rows(0))
    flags = sampling.decode.Flags(64, True, 0, False, True, False, 4)
    c, _ = compact._open(
        state, ids_, mask_, rows, rng, tuple(scalars), 16, graphdef=graphdef, flags=flags, samples=SAMPLES, bound=16
    )
    counts = jnp.asarray(np.stack(sampling.balance.moves(np.array([1, -1, 0]))), jnp.int32)
    for cap in (0, 2):
      hlo = compact._compact.lower(c, counts, shards=4, keep=2, cap=cap).compile().as_text()
      for op in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
        assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op
      assert ("collective-permute" in hlo) == (cap > 0)


@pytest.mark.parametrize("kernels,greedy", [("portable", False), ("cpu", False), ("cpu", True)])
def test_a_key_a_row_draws_each_row_alone(kernels, greedy):
  """`rules._sample_step` with a key a row (the decode loop's): the rows permuted with their keys
  give the same draws permuted, and a row's draw does not change when the other rows' logits do."""
  logits = np.random.RandomState(3).randn(6, 300).astype(np.float32) * 2
  keys = jax.random.split(jax.random.key(2), 6)
  step = functools.partial(sampling.rules._sample_step, greedy=greedy, top_k=0, use_top_p=False, kernels=kernels)
  run = jax.jit(lambda x, k: step(x, k, jnp.float32(1.0), jnp.float32(1.0)))
  tok, lp = (np.asarray(v) for v in run(logits, keys))
  perm = np.array([3, 0, 5, 1, 4, 2])
  ptok, plp = (np.asarray(v) for v in run(logits[perm], keys[perm]))
  np.testing.assert_array_equal(ptok, tok[perm])
  np.testing.assert_allclose(plp, lp[perm], atol=1e-6)
  other = logits.copy()
  other[1:] = np.random.RandomState(4).randn(5, 300) * 2
  np.testing.assert_array_equal(np.asarray(run(other, keys)[0])[0], tok[0])
  if not greedy:  # the draws are random: 6 rows of one logits row with 6 keys do not all agree
    same = np.repeat(logits[:1], 6, axis=0)
    assert len(set(np.asarray(run(same, keys)[0]).tolist())) > 1


def test_a_rows_tokens_do_not_depend_on_its_batch(model):
  """Sampled at T=1: the rows of prompt 0 decoded alone equal its rows decoded with three other
  prompts (row r draws with fold_in(fold_in(rng, r), i))."""
  ids, mask = _prompts()
  kw = dict(max_new_tokens=N_NEW, rng=jax.random.key(7), eos_token_ids=(), pad_id=PAD, num_samples=SAMPLES, **SAMPLED)
  alone = generate(model, ids[:1], mask[:1], **kw)
  together = generate(model, ids, mask, **kw)
  np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(together[0])[:SAMPLES])
  np.testing.assert_allclose(np.asarray(alone[2]), np.asarray(together[2])[:SAMPLES], atol=2e-6)


def test_compaction_over_the_joint_cache(case, monkeypatch):
  """decode_attention "pallas_interpret" (the fused TPU kernel in the Pallas interpreter, over the
  joint cache): compacted, the rows read a prompt copy each (the kernel's group of 1) and give the
  reference tokens of the einsum path."""
  kw, eos, ref = case
  kept = []
  real = compact._compact
  monkeypatch.setattr(compact, "_compact", lambda c, *a, **k: (kept.append(k["keep"]), real(c, *a, **k))[1])
  joint = _model(decode_attention="pallas_interpret")
  got = _run(joint, eos, compact_rows=True, **kw)
  _check(got, ref)
  assert kept and all(k < 16 for k in kept)
  # 256 prompt slots (buckets 64, 256): the prompt copies in two 128-slot blocks, the first all
  # padding, which the kernel skips (`decode_kernel.first_key_blocks`): the same tokens
  wide = _run(joint, eos, compact_rows=True, width=200, buckets=(64, 256), **kw)
  _check(wide, ref)


def test_compaction_keeps_the_rows_the_bound_plans(model, mesh, case, monkeypatch):
  """On the mesh, the rows each shard keeps at each compaction, in their order (the live rows, the
  longest prompt first, then those taken in from the neighbouring shards), are those
  `aot.plan.stretch_batches` lays out to count the bound's bytes; greedy (a prompt a row), the
  order by prompt length is not the rows' own order."""
  from ict_jax.aot import plan

  kw, eos, ref = case
  kept, caps = [], []
  real = compact._compact

  def record(c, *a, **k):
    out = real(c, *a, **k)
    kept.append(np.asarray(out.row_ids))
    caps.append(k["cap"])
    return out

  monkeypatch.setattr(compact, "_compact", record)
  _check(_run(model, eos, compact_rows=True, mesh=mesh, **kw), ref)
  _, mask = _prompts(16 // kw["samples"])
  prompt = np.repeat(mask.sum(axis=1), kw["samples"])  # [rows]: each row's prompt length
  lens = ref[1].sum(axis=1)  # a row decodes at step i while its tokens > i
  ends = [end for end, _ in sampling.decode_stretches(decode_phases(64))]
  compactions = lambda batches: [b.rows.reshape(-1).tolist() for b in batches if b.compacted]
  planned = compactions(plan.stretch_batches(ends, lens, 4, prompt))
  assert len(kept) >= 2 and [k.tolist() for k in kept] == planned[: len(kept)]
  assert any(caps)  # rows crossed devices (`balance.plan`): the layouts compared include the moves
  if kw["samples"] == 1:  # a shard's rows from 4 prompts of different lengths (sampled: one prompt)
    assert compactions(plan.stretch_batches(ends, lens, 4))[: len(kept)] != planned[: len(kept)]


def test_a_step_reads_a_prompt_only_while_a_row_of_it_decodes(model, case, monkeypatch):
  """The prompt mask each decode step passes to the model (`decode.live_prompt_mask`) is the
  prompt's own while one of its rows still decodes and all padding once every row of it has
  emitted its stop token (the fused kernel skips a padding prompt's blocks), counted from the
  reference lengths; the tokens stay the reference's. Every row kept to the end, one device."""
  from ict_jax.sampling import decode

  kw, eos, ref = case
  seen = {}
  real = decode.decode_one

  def spy(model, tok, num_prompt, i, cache, prompt_cache, prompt_mask, read_len=None):
    jax.debug.callback(lambda i, m: seen.setdefault(int(i), np.asarray(m).sum(axis=1)), i, prompt_mask)
    return real(model, tok, num_prompt, i, cache, prompt_cache, prompt_mask, read_len)

  monkeypatch.setattr(decode, "decode_one", spy)
  _check(_run(model, eos, compact_rows=False, width=24, **kw), ref)  # 24 columns: a shape no other test traces
  samples = kw["samples"]
  _, mask = _prompts(16 // samples)
  lens = ref[1].sum(axis=1).reshape(-1, samples)  # [prompts, R]: each row's tokens
  assert sorted(seen) == list(range(1, N_NEW))
  for i, got in seen.items():
    live = (lens > i).any(axis=1)  # step i: a row of n tokens has emitted its last at step n - 1
    np.testing.assert_array_equal(got, np.where(live, mask.sum(axis=1), 0), err_msg=f"step {i}")
  assert any(not (lens > i).any(axis=1).all() for i in seen)  # some prompt finished early
