"""The reports of `ict_jax.aot` as text."""

from __future__ import annotations

from ict_jax.aot.measure import Report
from ict_jax.aot.plan import format_bound
from ict_jax.aot.targets import GiB, Target


def _gib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def format_report(r: Report, target: Target) -> str:
  s = r.shapes
  if r.program == "sampler":
    head = (
        f"sampler on {r.target} ({target.chips} chips, mesh {s.get('mesh')}): {s.get('model')} "
        f"({s.get('num_params', 0):,} params, {s.get('dtype')} rollout copy), {s.get('rows')} rows x "
        f"({s.get('prompt_len')} + {s.get('completion_len')}) tokens, decode batch "
        f"{s.get('decode_batch_size')} ({s.get('sub_batches')} sub-batches, {s.get('rows_per_device')} rows a chip); "
        f"{r.prefill_rows} prompt rows prefilled ({s.get('samples_per_prompt')} rows read each), "
        f"{r.prefill_flops:.3e} prefill FLOPs; decode in {len(s.get('decode_phases', ()))} length-bounded "
        f"phases: KV slots read / written {r.kv_read_over_filled:.3f}"
    )
  else:
    head = (
        f"{r.program} on {r.target} ({target.chips} chips, mesh {s.get('mesh')}): "
        f"{s.get('model')} ({s.get('num_params', 0):,} params, {s.get('dtype')} compute, "
        f"{s.get('param_dtype')} params), {s.get('rows')} rows x ({s.get('prompt_len')} + "
        f"{s.get('completion_len')}) tokens, micro-batch {s.get('micro_batch_size')}"
    )
  lines = [head]
  if s.get("attention"):
    calls = f" ({r.cudnn_attention_calls} cuDNN attention calls compiled)" if r.cudnn_attention_calls else ""
    decode = f", decode attention {s['decode_attention']}" if s.get("decode_attention") else ""
    lines.append(f"  attention: {s['attention']}{calls}{decode}")
  if s.get("packed"):
    pk = s["packed"]
    lines.append(
        f"  packed (train.token_budget {pk['token_budget']}), the largest batch: {pk['micro_batches']} "
        f"micro-batches x {pk['packed_rows_per_micro_batch']} rows of {pk['width']} tokens, "
        f"LM head {pk['head_width']} columns"
    )
  if s.get("note"):
    lines.append(f"  note: {s['note']}")
  if s.get("method") == "ict" and 0 < s.get("rows_per_shard", 0) < s.get("group_size", 0):
    lines.append(
        f"  note: a row shard holds {s['rows_per_shard']} rows of a micro-batch, less than "
        f"a group ({s['group_size']}): the ICT group mean crosses chips"
    )
  lines += [
      f"  per chip: arguments {_gib(r.argument_bytes)}, outputs {_gib(r.output_bytes)} "
      f"(aliased {_gib(r.alias_bytes)}), temporaries {_gib(r.temp_bytes)}, generated code "
      f"{_gib(r.generated_code_bytes)}",
      f"  peak {_gib(r.peak_bytes_per_device)}"
      + (f" (+ {_gib(r.resident_bytes)} of train state held meanwhile)" if r.resident_bytes else "")
      + f" of {_gib(r.hbm_bytes_per_device)} usable HBM: "
      + (
          f"fits, margin {_gib(r.margin_bytes)}"
          if r.fits
          else "DOES NOT FIT"
          + (
              " (the compiler accepted it, but arguments + temporaries exceed the usable HBM)"
              if r.compiler_accepted
              else ""
          )
      ),
      f"  compile {r.compile_s:.1f} s",
  ]
  if r.collectives:
    lines.append(
        "  collectives: " + ", ".join(f"{k} {v}" for k, v in r.collectives.items() if v)
        if any(r.collectives.values())
        else "  collectives: none"
    )
  flops = r.model_flops_per_step
  if r.program != "sampler":
    lines.append(
        f"  model FLOPs per step {flops:.3e} ({flops / (target.chips * target.peak_tflops * 1e12):.2f} s "
        f"at 100% of {target.chips} x {target.peak_tflops:g} TFLOP/s)"
    )
  if r.decode_step_min_bytes:
    floor_s = r.decode_step_min_bytes / (target.hbm_tb_s * 1e12)
    got = "n/a" if r.decode_step_bytes is None else _gib(r.decode_step_bytes)
    ratio = "n/a" if r.decode_bytes_ratio is None else f"{r.decode_bytes_ratio:.2f}x"
    lines.append(
        f"  one decode step reads/writes {got} a chip, {ratio} the minimum {_gib(r.decode_step_min_bytes)} "
        f"(rollout weights read {_gib(s.get('rollout_weights_read_bytes'))} + KV cache {_gib(s.get('kv_cache_bytes'))}; "
        f"{floor_s * 1e3:.2f} ms at {target.hbm_tb_s:g} TB/s)"
    )
  if r.decode_phase_min_bytes:
    ratios = r.decode_phase_bytes_over_weights_kv
    lines.append(
        f"  decode phases {s.get('decode_phases')}: step bytes / (weights + that phase's KV) "
        + ("n/a (no cost analysis)" if ratios is None else ", ".join(f"{x:.2f}" for x in ratios))
    )
  if r.decode_step_collectives is not None:
    coll = {k: v for k, v in r.decode_step_collectives.items() if v}
    nbytes = sum((r.decode_step_collective_bytes or {}).values())
    lines.append(
        "  one decode step's collectives (all rows, last phase): "
        + (", ".join(f"{k} {v}" for k, v in coll.items()) + f", {nbytes / 2**20:.2f} MiB a chip" if coll else "none")
        + f"; decode step compiles: {len((r.decode_grid or {}).get('compiled', ()))} (bound, rows) at "
        f"{(r.decode_grid or {}).get('depths')} layers, {(r.decode_grid or {}).get('mode')}"
        + (
            f" (the rows' line misses the middle row count by {miss:.2%})"
            if (miss := (r.decode_grid or {}).get("affine_miss")) is not None
            else ""
        )
    )
  if r.decode_phase_grid_steps and any(r.decode_phase_grid_steps):
    lines.append(
        f"  decode phases' Pallas grid steps a step: {', '.join(map(str, r.decode_phase_grid_steps))} "
        "(~0.35 us each on TPU, not in the bytes)"
    )
  if r.step_bound is not None:
    lines.append(format_bound(r.step_bound, r.target))
  if r.error:
    lines.append(f"  {r.error}")
  if not r.fits and r.advice:
    lines.append(f"  to fit: {r.advice}")
  return "\n".join(lines)
