"""The rollout's decode step compiled alone for a target (`compile_decode_step`): its layer scan
unrolled, its cache in the decoding layout (`decode_cache`), for the bytes, FLOPs and collectives
one step of the sampler's decode loop costs; `pallas_grid_steps` counts its Pallas grid steps."""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from ict_jax import sampling
from ict_jax.models.axes import axis_rules, logical_to_spec
from ict_jax.models.qwen2 import CACHE_AXES, JointCache, LayerCache, make_cache


def _decode_step(
    state, cache, prompt_cache, tok, num_prompt, i, prompt_mask, rng, temperature, top_p, *, graphdef, kw, read_len
):
  """One step of the sampler's decode loop (`sampling.decode._decode_rows`'s while-loop body,
  without writing the outputs): token i - 1 [b] in, its KV written at completion slot i - 1, the
  shared prompt cache and the first read_len completion slots (the phase's bound) read, token i
  sampled."""
  model = nnx.merge(graphdef, state)
  logits, cache = sampling.decode_one(model, tok, num_prompt, i, cache, prompt_cache, prompt_mask, read_len)
  kernels, split = model.cfg.kernels, model.cfg.split_mlp
  keys = sampling.rules.row_keys(rng, jnp.arange(tok.shape[0], dtype=jnp.int32), i)  # as the sampler draws
  tok, _ = sampling.rules._sample_step(logits, keys, temperature, top_p, kernels=kernels, vocab_split=split, **kw)
  return tok, cache


def decode_cache(mcfg, mesh, batch: int, cache_len: int, dtype: str) -> LayerCache | JointCache:
  """The abstract KV cache `Qwen2.init_cache` makes for a decode batch, in the decoding layout
  (decode_attention "pallas": one joint [L, B, K, S, 2H] array)."""

  def struct(shape):
    with axis_rules(sampling.DECODE_RULES):
      spec = logical_to_spec(CACHE_AXES, shape, dict(mesh.shape))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  return make_cache(mcfg, batch, cache_len, struct)


@contextlib.contextmanager
def _unrolled_scans():
  """`jax.lax.scan` unrolled while a program is traced: `cost_analysis()` counts a loop body once,
  so the decode step's layer scan must be straight-line code for its bytes to count every layer."""
  scan = jax.lax.scan

  def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  jax.lax.scan = unrolled
  try:
    yield
  finally:
    jax.lax.scan = scan


# libtpu's cost analysis counts an operand staged into on-chip VMEM by memory-space assignment
# (MSA) several times: the HBM read, the VMEM write, each read from VMEM (a 37 MiB logits array
# reduced twice on v5p: 7 x its bytes with MSA, 3 x without). The decode step's bytes are counted
# with MSA off: what the step moves through HBM when nothing is kept on-chip, an upper bound on
# the HBM traffic of the program the sampler runs (MSA only moves traffic off HBM).
HBM_BYTES_OPTIONS = {"xla_msa_enable": False}


def compile_decode_step(
    policy,
    mesh,
    cache: LayerCache,
    prompt_cache: LayerCache,
    sample_kw: dict,
    read_len: int | None = None,
    compiler_options: dict | None = None,
    *,
    traced: bool = False,
):
  """`_decode_step` compiled for `mesh` (the decode cache donated, as the loop carries it in
  place; the prompt cache only read), reading read_len completion slots (a decode phase's bound;
  None: all), its layer scan unrolled (`_unrolled_scans`). traced=True: (the compiled step, its
  `jax.stages.Traced`, whose jaxpr `pallas_grid_steps` counts).

  The layouts of the cache and the weights are the compiler's choice (`Layout.AUTO`), as inside
  the sampler, where the cache is made in the program and a weight relayout is loop-invariant
  (done once, before the loop): with the default layouts of arguments, XLA relayouts the whole
  cache into and out of the layer scan (4 x its bytes: 1.5B on v5e-8, 64 rows a chip, 18 GB) and
  the tied embedding for its gather, and the step would be charged for what the loop does not do."""
  batch, prompts, prompt_len = cache[0].shape[1], prompt_cache[0].shape[1], prompt_cache[0].shape[3]
  cache_formats = type(cache)(*(Format(Layout.AUTO, x.sharding) for x in cache))
  rows, repl = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
  sds = jax.ShapeDtypeStruct
  args = (
      policy.state,
      cache,
      prompt_cache,
      sds((batch,), jnp.int32, sharding=rows),  # the last token
      sds((batch,), jnp.int32, sharding=rows),  # prompt lengths
      sds((), jnp.int32, sharding=repl),  # i
      sds((prompts, prompt_len), jnp.int32, sharding=sampling.prompt_sharding(mesh, prompts)),
      sds((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=repl),
      sds((), jnp.float32, sharding=repl),
      sds((), jnp.float32, sharding=repl),
  )
  in_shardings = list(jax.tree.map(lambda x: x.sharding, args))
  in_shardings[0] = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), policy.state)
  in_shardings[1] = cache_formats
  in_shardings[2] = type(prompt_cache)(*(Format(Layout.AUTO, x.sharding) for x in prompt_cache))
  step = jax.jit(
      functools.partial(_decode_step, graphdef=policy.graphdef, kw=sample_kw, read_len=read_len),
      in_shardings=tuple(in_shardings),
      out_shardings=(rows, cache_formats),
      donate_argnums=(1,),
      compiler_options=compiler_options,
  )
  with jax.set_mesh(mesh), axis_rules(sampling.DECODE_RULES), _unrolled_scans():
    trace = step.trace(*args)
    compiled = trace.lower().compile()
  return (compiled, trace) if traced else compiled


def pallas_grid_steps(jaxpr) -> int:
  """The Pallas grid steps one run of `jaxpr` takes (a device's, inside `shard_map`): each
  `pallas_call`'s grid size, times the length of a scan around it; a cond's largest branch; a
  while loop's body once. A TPU grid step costs ~0.35 us whatever it reads (Pallas TPU docs,
  "Matrix Multiplication"), which a byte count does not see."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "pallas_call":
      total += math.prod(eqn.params["grid_mapping"].grid)
      continue
    inner = [pallas_grid_steps(j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]
    if name == "cond":
      total += max(inner, default=0)
    else:
      total += sum(inner) * (eqn.params["length"] if name == "scan" else 1)
  return total
