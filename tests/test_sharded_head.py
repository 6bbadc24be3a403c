"""The compiled train step on the 8-device CPU mesh, read from its HLO text: the LM head stays
sharded (no chip holds a whole [D, V] head), the chunked log-softmax works on vocabulary shards,
the JS group mean moves no [k, V] block when a chip holds whole groups (and one per chunk when it
does not), the ICT step has no more collectives than the GRPO step, and a micro-batch that does
not split over data x fsdp is refused. Numerics on these meshes are checked against the
single-device step in tests/test_train_step.py (test_sharded_step_equals_single_device)."""

import collections
import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from ict_jax import sharding
from ict_jax import train_step as ts
from ict_jax.batch import TrainBatch
from ict_jax.config import OptimConfig
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import init_model
from tiny import step_config as tiny_step_config

G, N, P, C, K = 4, 16, 4, 15, 5  # K: the LM-head chunk (C = 3 chunks of 5)
D, V = 48, 512  # sizes no other dimension of the step has
CFG = Qwen2Config(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def batch():
  rng = np.random.default_rng(0)
  cmask = (np.arange(C)[None] < rng.integers(1, C + 1, N)[:, None]).astype(np.int32)
  return TrainBatch(
      prompt_ids=np.repeat(rng.integers(1, V, (N // G, P)), G, 0).astype(np.int32),
      prompt_mask=np.ones((N, P), np.int32),
      completion_ids=(rng.integers(1, V, (N, C)) * cmask).astype(np.int32),
      completion_mask=cmask,
      advantages=rng.normal(size=N).astype(np.float32),
  )


def compiled_text(mesh_shape, method="ict", micro_batch=N, tied=False, sparse_backward=True) -> str:
  cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
  graphdef, params = nnx.split(init_model(cfg, seed=0))
  mesh = sharding.make_mesh(mesh_shape)
  opt = ts.make_optimizer(OptimConfig(), 10)
  params_sharding = sharding.pure_shardings(params, mesh)
  params = jax.device_put(params.to_pure_dict(), params_sharding)
  state_sharding = ts.train_state_shardings(opt, jax.eval_shape(lambda: params), params_sharding, mesh)
  state = ts.init_train_state(params, opt, mesh=mesh, params_sharding=params_sharding)
  step = ts.make_train_step(
      graphdef,
      tiny_step_config(
          group_size=G, method=method, chunk_size=K, micro_batch_size=micro_batch, sparse_backward=sparse_backward
      ),
      opt,
      mesh=mesh,
      state_sharding=state_sharding,
      donate=False,
  )
  b = batch().map_rows(lambda v: sharding.put_global(v, sharding.batch_sharding(mesh, v.ndim)))
  with jax.set_mesh(mesh):
    return step.jitted.lower(state, b, None).compile().as_text()


def collectives(text: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
  """(kind, [(dtype, shape), ...] of its result) for every collective of the HLO text."""
  out = []
  for line in text.splitlines():
    m = _OP.search(line)
    if m:
      shapes = [(t, tuple(int(x) for x in dims.split(",") if x)) for t, dims in _SHAPE.findall(m.group(1))]
      out.append((m.group(2), shapes))
  return out


def shapes_in(text: str) -> set[tuple[int, ...]]:
  return {tuple(int(x) for x in dims.split(",") if x) for _, dims in _SHAPE.findall(text)}


def moves_vocab_rows(shapes) -> bool:
  """A collective result holding [.., K, V-ish] logits-like blocks (K positions x a vocabulary
  dimension of at least V / 8)."""
  return any(K in s and any(d >= V // 8 and d != D for d in s) for _, s in shapes)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 4, 2), (2, 2, 2)])
def test_lm_head_stays_sharded(mesh_shape):
  text = compiled_text(mesh_shape)
  assert (D, V) not in shapes_in(text) and (V, D) not in shapes_in(text)  # on no chip, any dtype
  gathers = [s for kind, shapes in collectives(text) for s in shapes if kind == "all-gather"]
  assert not [s for s in gathers if s[1] in ((D, V), (V, D))]
  shards = mesh_shape[1] * mesh_shape[2]
  assert (D, V // shards) in shapes_in(text)  # the head as each chip works on it


def test_tied_head_is_not_gathered_whole_in_float32():
  text = compiled_text((1, 8, 1), tied=True)
  assert not [s for kind, shapes in collectives(text) for s in shapes if kind == "all-gather" and s == ("f32", (V, D))]


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2), (2, 4, 1)])
def test_whole_groups_per_chip_move_no_vocab_blocks_and_ict_adds_no_collectives(mesh_shape):
  """Each data shard of the 16-row micro-batch holds 8 or 16 rows: whole groups of 4. The ICT
  step (JS score, per-response top-k, selection) has no more collectives of any kind than the
  GRPO step, both with the dense LM-head backward; the sparse backward's own row gathers are
  checked apart (they move [rows, D] hidden states, never [k, V] blocks)."""
  ict = collectives(compiled_text(mesh_shape, "ict", sparse_backward=False))
  grpo = collectives(compiled_text(mesh_shape, "grpo"))
  sparse = collectives(compiled_text(mesh_shape, "ict"))
  for ops in (ict, sparse):
    assert not [op for op in ops if moves_vocab_rows(op[1])]
  count = lambda ops: collections.Counter(kind for kind, _ in ops)
  for kind in COLLECTIVES:
    assert count(ict)[kind] <= count(grpo)[kind], (kind, count(ict), count(grpo))


def test_split_groups_cost_one_reduction_per_chunk():
  """data 8: 2 rows per chip < G = 4; the group mean is one all-reduce of the chunk's
  [N/G, 1, K, V] sums (in the chunk loop's body), not one slice per member."""
  ops = collectives(compiled_text((8, 1, 1), "ict"))
  vocab_ops = [op for op in ops if moves_vocab_rows(op[1])]
  assert [kind for kind, _ in vocab_ops] == ["all-reduce"], vocab_ops


def test_micro_batch_must_divide_over_data_x_fsdp():
  with pytest.raises(ValueError, match=r"train\.micro_batch_size.*data x fsdp = 1 x 8"):
    compiled_text((1, 8, 1), micro_batch=G)
