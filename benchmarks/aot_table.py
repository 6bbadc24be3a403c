"""The paper configs compiled for their targets with `python -m ict_jax.aot` -> a memory table.

    python benchmarks/aot_table.py [--only NAME,NAME] [--part train|sample|both] [--table_only]
        [--out DIR] [--no_docs] [--aot_args="--config.KEY=VALUE ..."]

Each run in RUNS and part (the train step, the sampler) is one `python -m ict_jax.aot --part PART`
process (one at a time; a 1.5B / 7B compile takes minutes and GBs of host memory) whose JSON goes
to benchmarks/results/aot/NAME.PART.json, command included; a JSON that exists is not compiled
again (delete it to redo). Then the tables of every JSON there are written between the AOT-TABLE
markers of benchmarks/RESULTS.md, the short recipe table between the AOT-RECIPES markers of
README.md and launch/README.md, and all reports into benchmarks/results/aot.json. Runs without a
JSON are listed as not measured.

`--out DIR` keeps the JSONs in DIR/aot/ and DIR/aot.json instead of benchmarks/results/,
`--no_docs` leaves RESULTS.md and the READMEs alone, and `--aot_args` adds arguments to every
`ict_jax.aot` run (the CI smoke test, tests/test_benchmarks_smoke.py, compiles one recipe on the
tiny model that way: `--aot_args="--config.model.preset=tiny --completion_len 16 ..."`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
RESULTS_MD = os.path.join(ROOT, "benchmarks", "RESULTS.md")
BEGIN, END = "<!-- AOT-TABLE BEGIN (benchmarks/aot_table.py) -->", "<!-- AOT-TABLE END -->"
RECIPE_READMES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "launch", "README.md")]
RECIPES_BEGIN, RECIPES_END = "<!-- AOT-RECIPES BEGIN (benchmarks/aot_table.py) -->", "<!-- AOT-RECIPES END -->"
CFG = {
    "0.5B": "configs/qwen2_5_0_5b_math.py",
    "1.5B": "configs/qwen2_5_1_5b_math.py",
    "7B": "configs/qwen2_5_7b_math.py",
}
V5E_7B = ["--config.mesh.fsdp=4", "--config.mesh.tensor=2"]  # float32 state (bf16 params refused)
# the padded update (the configs' default until 2026-12-06): every row at the batch's widest
# prompt + completion, micro-batches of N rows
PADDED = lambda n: [
    "--config.train.token_budget=0",
    "--config.train.micro_batch_tokens=0",
    f"--config.train.micro_batch_size={n}",
]

# name -> (model, target, extra aot arguments); the order is the order they are compiled in: the
# recipes README.md and launch/README.md show first (each config as written: the update on packed
# rows, `paper_config`), then the padded update on the same targets.
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "1.5b_v5e-8_packed": ("1.5B", "v5e-8", []),
    "1.5b_v5p-32_packed": ("1.5B", "v5p-32", []),
    "7b_v5p-32_packed": ("7B", "v5p-32", []),
    "7b_h100-8_packed": ("7B", "h100-8", []),  # cuDNN's sequence packing
    "0.5b_v5e-8_packed": ("0.5B", "v5e-8", []),
    "1.5b_h100-8_packed": ("1.5B", "h100-8", []),
    "0.5b_v5p-32_packed": ("0.5B", "v5p-32", []),
    "0.5b_h100-8_packed": ("0.5B", "h100-8", []),
    "1.5b_h200-8_packed": ("1.5B", "h200-8", []),
    "7b_h200-8_packed": ("7B", "h200-8", []),
    "0.5b_h200-8_packed": ("0.5B", "h200-8", []),
    "7b_v5e-8_mb8": ("7B", "v5e-8", V5E_7B + PADDED(8)),
    "1.5b_v5e-8_mb16": ("1.5B", "v5e-8", PADDED(16)),
    "1.5b_v5p-32": ("1.5B", "v5p-32", PADDED(64)),
    "7b_v5p-32": ("7B", "v5p-32", PADDED(32)),
    "7b_h100-8": ("7B", "h100-8", PADDED(32)),
    "0.5b_v5e-8_mb16": ("0.5B", "v5e-8", PADDED(16)),
    "1.5b_h100-8": ("1.5B", "h100-8", PADDED(64)),
    "0.5b_v5p-32": ("0.5B", "v5p-32", PADDED(128)),
    "0.5b_h100-8": ("0.5B", "h100-8", PADDED(128)),
    "1.5b_h200-8": ("1.5B", "h200-8", PADDED(64)),
    "7b_h200-8": ("7B", "h200-8", PADDED(32)),
    "0.5b_h200-8": ("0.5B", "h200-8", PADDED(128)),
    "1.5b_v5e-8_mb32": ("1.5B", "v5e-8", PADDED(32)),
    "1.5b_v5e-8": ("1.5B", "v5e-8", PADDED(64)),
    # LoRA (model.lora_rank): adapters + their AdamW state, the base frozen in bf16 (no optimizer
    # state): 7B on a v5e-8, which full fine-tuning does not fit
    "7b_v5e-8_lora16": ("7B", "v5e-8", V5E_7B + ["--config.model.lora_rank=16"]),
    # the same on the configs' mesh (fsdp=8): both fit since the tensor decode layout (the rollout
    # copy split over the 8 chips; replicated over fsdp it took 14.2 GiB a chip and did not)
    "7b_v5e-8_fsdp8_lora16": ("7B", "v5e-8", ["--config.model.lora_rank=16"]),
}
# the rows README.md and launch/README.md show: the configs as written (packed), 7B on v5e-8,
# which full fine-tuning fits in no form (its padded step at 8 rows shows by how much), and 7B
# with LoRA adapters on v5e-8
RECIPES = [name for name, (_, _, extra) in RUNS.items() if not extra] + ["7b_v5e-8_mb8", "7b_v5e-8_lora16"]
# the programs `ict_jax.aot --part` compiles; one JSON per run and part: NAME.PART.json
PARTS = ("train", "sample")
# runs whose sampler is another run's (the micro-batch is the train step's only): no sample part
SAME_SAMPLER = {
    "1.5b_v5e-8_mb32": "1.5b_v5e-8_mb16",
    "1.5b_v5e-8": "1.5b_v5e-8_mb16",
    "1.5b_v5e-8_packed": "1.5b_v5e-8_mb16",
    "1.5b_v5p-32_packed": "1.5b_v5p-32",
    "7b_v5p-32_packed": "7b_v5p-32",
    "7b_h100-8_packed": "7b_h100-8",
    "0.5b_v5e-8_packed": "0.5b_v5e-8_mb16",
    "1.5b_h100-8_packed": "1.5b_h100-8",
    "0.5b_v5p-32_packed": "0.5b_v5p-32",
    "0.5b_h100-8_packed": "0.5b_h100-8",
    "1.5b_h200-8_packed": "1.5b_h200-8",
    "7b_h200-8_packed": "7b_h200-8",
    "0.5b_h200-8_packed": "0.5b_h200-8",
}


# where the JSONs go (--out) and what every aot run gets on top of its own arguments (--aot_args)
OUT = {"dir": RESULTS_DIR, "aot_args": []}


def _path(name: str, part: str) -> str:
  return os.path.join(OUT["dir"], "aot", f"{name}.{part}.json")


def command(name: str, part: str) -> list[str]:
  model, target, extra = RUNS[name]
  json_path = os.path.relpath(_path(name, part), ROOT)
  return [
      "python",
      "-m",
      "ict_jax.aot",
      "--config",
      CFG[model],
      "--target",
      target,
      *extra,
      *OUT["aot_args"],
      "--part",
      part,
      "--json",
      json_path if not json_path.startswith("..") else _path(name, part),
  ]


def run(name: str, part: str) -> None:
  if part == "sample" and name in SAME_SAMPLER:
    return
  path = _path(name, part)
  if os.path.exists(path):
    print(f"{name}.{part}: have {os.path.relpath(path, ROOT)}")
    return
  cmd = command(name, part)
  print(f"{name}: {' '.join(cmd)}", flush=True)
  t0 = time.perf_counter()
  proc = subprocess.run(["nice", "-n", "10", sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True)
  print(proc.stdout + proc.stderr[-2000:], flush=True)
  if proc.returncode in (0, 1) and os.path.exists(path):
    with open(path) as f:
      report = json.load(f)
    report.update(command=" ".join(cmd), wall_s=time.perf_counter() - t0)
    with open(path, "w") as f:
      json.dump(report, f, indent=1)
  else:
    print(f"{name}: no report (exit {proc.returncode})", flush=True)


def _gib(n) -> str:
  return "—" if n is None else f"{n / 2**30:.2f}"


def _header(*columns: str) -> list[str]:
  """A markdown table's header and separator rows."""
  return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _mesh(shapes: dict) -> str:
  m = shapes["mesh"]
  return f"{m['data']}, {m['fsdp']}, {m['tensor']}"


def table(reports: dict[str, dict]) -> str:
  rows = _header(
      "model", "target", "mesh (data, fsdp, tensor)", "params", "micro-batch", "tokens / row", "args", "temps",
      "code", "peak", "usable HBM", "fits (margin)", "compile s",
      "collectives (all-gather / all-reduce / reduce-scatter / permute / all-to-all)", "model TFLOP / step",
  )  # fmt: skip
  for name in RUNS:
    model, target = _label(name), RUNS[name][1]
    r = reports.get(name)
    if r is None:
      rows.append(
          f"| {model} | {target} | | | | | | | | | | **not measured** (`{' '.join(command(name, 'train'))}`) " "| | | |"
      )
      continue
    s, c = r["shapes"], r["collectives"]
    fit = _fit(r)
    coll = (
        " / ".join(
            str(c.get(k, 0)) for k in ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
        )
        if c
        else "—"
    )
    rows.append(
        f"| {model} | {target} | {_mesh(s)} | "
        f"{s['param_dtype']} | {_micro(s)} | {s['prompt_len']} + {s['completion_len']} | "
        f"{_gib(r.get('argument_bytes'))} | {_gib(r.get('temp_bytes'))} | "
        f"{_gib(r.get('generated_code_bytes'))} | {_gib(r['peak_bytes_per_device'])} | "
        f"{_gib(r['hbm_bytes_per_device'])} | {fit} | {r['compile_s']:.0f} | {coll} | "
        f"{r['model_flops_per_step'] / 1e12:.0f} |"
    )
  return "\n".join(rows)


def _micro(s: dict) -> str:
  """A train report's micro-batch: its rows, and for the packed step the tokens it is made of."""
  pk = s.get("packed")
  return f"{s['micro_batch_size']}" if not pk else f"{s['micro_batch_size']} packed ({pk['micro_batch_tokens']} tokens)"


def _fit(r: dict) -> str:
  if r["fits"]:
    return f"yes ({_gib(r['margin_bytes'])})"
  accepted = r.get("compiler_accepted", bool(r.get("collectives")))  # older reports: compiled = counted
  return "**no** (compiled, but peak > usable)" if accepted else "**no** (compiler: out of memory)"


def _ratio(r: dict) -> str:
  x = r.get("decode_bytes_ratio")
  return "—" if x is None else f"{x:.2f}"


def _phase_ratios(r: dict) -> str:
  """Each decode phase's step bytes / (weights + that phase's KV), issue 25's goal <= 1.3."""
  x = r.get("decode_phase_bytes_over_weights_kv")
  if not x:
    return "—"
  # a report without the key predates the count that leaves out VMEM staging
  # (ict_jax.aot.sampler.HBM_BYTES_OPTIONS); only TPU targets give phase bytes at all
  staged = "decode_bytes_options" not in r
  text = " / ".join(f"{v:.2f}" for v in x) + (" (VMEM staging counted)" if staged else "")
  grid = r.get("decode_phase_grid_steps")  # the fused decode kernel's grid steps a step (TPU)
  return text + (f"; Pallas grid steps {' / '.join(map(str, grid))}" if grid and any(grid) else "")


def _bound(r: dict | None, parts: bool = False) -> str:
  """The sampler report's lower bound on a step's time: seconds (h for train.steps)."""
  b = r and r.get("step_bound")
  if not b:
    return "—"
  text = f"{b['step_time_lower_bound_s']:.1f} s ({b['hours_lower_bound']:.1f} h)"
  if parts:
    text += f": update {b['update_s']:.1f} + prefill {b['prefill_s']:.2f} + decode {b['decode_s']:.1f}"
  return text


def _rollout(r: dict | None) -> str:
  """The rollout's decode against its limit (issue 41): decode seconds / the limit's (the weights
  split over the chips + the KV really read, at the HBM bandwidth), the compiled bytes / the
  limit's, the rows x steps computed / the tokens generated; a report from before says so."""
  b = r and r.get("step_bound")
  if not b:
    return "—"
  if "decode_limit_s" not in b:
    return "not regenerated (every row to its sub-batch's longest)"
  return (
      f"decode {b['decode_s']:.1f} s = {b['decode_s_over_limit']:.1f}x the limit {b['decode_limit_s']:.1f} s "
      f"(bytes {b['decode_bytes_over_limit']:.1f}x; collectives {b['decode_ici_s']:.2f} s); "
      f"row-steps / tokens {b['live_row_steps_over_real']:.2f}"
  )


def sampler_table(reports: dict[str, dict]) -> str:
  """The sampler reports (`ict_jax.aot --part sample`): bytes per chip."""
  rows = _header(
      "model", "target", "mesh (data, fsdp, tensor)", "rollout dtype", "decode batch (rows a chip)", "tokens / row",
      "rollout weights", "KV cache", "args", "temps", "peak", "+ train state", "usable HBM", "fits (margin)",
      "compile s", "decode step bytes", "minimum (weights + KV)", "ratio",
      "each decode phase: bytes / (weights + its KV)", "step time lower bound (h for train.steps): s",
  )  # fmt: skip
  for name in RUNS:
    model, target = _label(name), RUNS[name][1]
    if name in SAME_SAMPLER:  # its sampler is another row's
      continue
    r = reports.get(name)
    if r is None:
      rows.append(
          f"| {model} | {target} |"
          + " |" * 12
          + f" **not measured** (`{' '.join(command(name, 'sample'))}`) | | | | | |"
      )
      continue
    r = r["sampler"]
    s = r["shapes"]
    rows.append(
        f"| {model} | {target} | {_mesh(s)} | {s['dtype']} | "
        f"{r['decode_batch_size']} ({s['rows_per_device']}) | {s['prompt_len']} + {s['completion_len']} | "
        f"{_gib(s['rollout_policy_bytes'])} | {_gib(s['kv_cache_bytes'])} | {_gib(r.get('argument_bytes'))} | "
        f"{_gib(r.get('temp_bytes'))} | {_gib(r['peak_bytes_per_device'])} | {_gib(r['resident_bytes'])} | "
        f"{_gib(r['hbm_bytes_per_device'])} | {_fit(r)} | {r['compile_s']:.0f} | {_gib(r.get('decode_step_bytes'))} | "
        f"{_gib(r.get('decode_step_min_bytes'))} | {_ratio(r)} | {_phase_ratios(r)} | {_bound(r, parts=True)} |"
    )
  return "\n".join(rows)


def _label(name: str) -> str:
  """The model column: the model, and its LoRA rank where the run trains adapters."""
  model, _, extra = RUNS[name]
  rank = [a.split("=", 1)[1] for a in extra if a.startswith("--config.model.lora_rank=")]
  return f"{model} LoRA r{rank[0]}" if rank else model


def recipes_table(reports: dict[str, dict[str, dict]], names=None) -> str:
  """The short table README.md and launch/README.md show: per recipe (`names`, default RECIPES),
  does each program fit."""
  rows = _header(
      "model", "target", "mesh (data, fsdp, tensor)", "micro-batch", "train step: peak / usable GiB a chip, fits",
      "decode batch", "sampler: peak + train state / usable GiB, fits", "decode step bytes / minimum",
      "step time LOWER BOUND (h for train.steps)", "rollout: decode vs its limit",
  )  # fmt: skip
  for name in names or RECIPES:
    model, target = _label(name), RUNS[name][1]
    t, r = reports["train"].get(name), reports["sample"].get(SAME_SAMPLER.get(name, name))
    if t is None and r is None:
      rows.append(f"| {model} | {target} | | | not measured | | not measured | | | |")
      continue
    r = r and r["sampler"]
    train = (
        "not measured"
        if t is None
        else f"{_gib(t['peak_bytes_per_device'])} / {_gib(t['hbm_bytes_per_device'])}, "
        + ("yes" if t["fits"] else "**no**")
    )
    sample = (
        "not measured"
        if r is None
        else f"{_gib(r['peak_bytes_per_device'])} + {_gib(r['resident_bytes'])} / {_gib(r['hbm_bytes_per_device'])}, "
        + ("yes" if r["fits"] else "**no**")
    )
    fits = bool(t and t["fits"] and r and r["fits"])
    bound = _bound(r) if fits else "—"  # no bound for a recipe that does not run
    rows.append(
        f"| {model} | {target} | {_mesh((t or r)['shapes'])} | "
        f"{_micro(t['shapes']) if t else '—'} | {train} | {r['decode_batch_size'] if r else '—'} | "
        f"{sample} | {_ratio(r) + 'x' if r and r.get('decode_bytes_ratio') else '—'} | {bound} | "
        f"{_rollout(r) if fits else '—'} |"
    )
  return "\n".join(rows)


def _replace_block(path: str, begin: str, end: str, body: str) -> None:
  text = open(path).read()
  block = f"{begin}\n{body}\n{end}"
  if begin in text:
    head, rest = text.split(begin, 1)
    text = head + block + rest.split(end, 1)[1]
  else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
  with open(path, "w") as f:
    f.write(text)


def write_results(reports: dict[str, dict[str, dict]], docs: bool = True) -> None:
  with open(os.path.join(OUT["dir"], "aot.json"), "w") as f:
    json.dump(reports, f, indent=1, sort_keys=True)
  if not docs:
    return
  body = (
      f"Train step (`--part train`):\n\n{table(reports['train'])}\n\n"
      f"Sampler (`--part sample`; bytes a chip; the train state stays on the chips while sampling):\n\n"
      f"{sampler_table(reports['sample'])}"
  )
  _replace_block(RESULTS_MD, BEGIN, END, body)
  for readme in RECIPE_READMES:  # only where the markers are: a README is not appended to
    if RECIPES_BEGIN in open(readme).read():
      _replace_block(readme, RECIPES_BEGIN, RECIPES_END, recipes_table(reports))


def load_reports() -> dict[str, dict[str, dict]]:
  """{part: {name: report}} of every JSON in the output folder's aot/."""
  reports: dict[str, dict[str, dict]] = {part: {} for part in PARTS}
  for part in PARTS:
    for name in RUNS:
      if os.path.exists(_path(name, part)):
        with open(_path(name, part)) as f:
          reports[part][name] = json.load(f)
        reports[part][name].setdefault("command", " ".join(command(name, part)))  # a run by hand
  return reports


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
  ap.add_argument("--part", default="both", choices=(*PARTS, "both"), help="which programs to compile")
  ap.add_argument("--table_only", action="store_true", help="compile nothing; rewrite the table")
  ap.add_argument("--out", default=RESULTS_DIR, help="folder of aot/NAME.PART.json and aot.json")
  ap.add_argument("--no_docs", action="store_true", help="write the JSONs only, not RESULTS.md or the READMEs")
  ap.add_argument("--aot_args", default="", help="extra arguments of every ict_jax.aot run (one string)")
  args = ap.parse_args()
  OUT.update(dir=os.path.abspath(args.out), aot_args=shlex.split(args.aot_args))
  names = [n for n in args.only.split(",") if n] or list(RUNS)
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    sys.exit(f"aot_table: unknown run(s) {unknown}; runs are {list(RUNS)}")
  os.makedirs(os.path.join(OUT["dir"], "aot"), exist_ok=True)
  parts = PARTS if args.part == "both" else (args.part,)
  if not args.table_only:
    for part in parts:
      for name in names:
        run(name, part)
  reports = load_reports()
  write_results(reports, docs=not args.no_docs)
  print(recipes_table(reports, [n for n in args.only.split(",") if n] or None))  # these runs, or the recipes


if __name__ == "__main__":
  main()
