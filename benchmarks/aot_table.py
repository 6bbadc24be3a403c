"""The paper configs compiled for their targets with `python -m ict_jax.aot` -> a memory table.

    python benchmarks/aot_table.py [--only NAME,NAME] [--table_only]

Each run in RUNS is one `python -m ict_jax.aot` process (one at a time; a 1.5B / 7B compile takes
minutes and GBs of host memory) whose JSON goes to benchmarks/results/aot/NAME.json, command
included; a run whose JSON exists is not compiled again (delete it to redo). Then the markdown
table of every JSON there is written between the AOT-TABLE markers of benchmarks/RESULTS.md and
all reports into benchmarks/results/aot.json. Runs without a JSON are listed as not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "benchmarks", "results", "aot")
RESULTS_MD = os.path.join(ROOT, "benchmarks", "RESULTS.md")
BEGIN, END = "<!-- AOT-TABLE BEGIN (benchmarks/aot_table.py) -->", "<!-- AOT-TABLE END -->"
CFG = {
    "0.5B": "configs/qwen2_5_0_5b_math.py",
    "1.5B": "configs/qwen2_5_1_5b_math.py",
    "7B": "configs/qwen2_5_7b_math.py",
}
V5E_7B = ["--config.mesh.fsdp=4", "--config.mesh.tensor=2"]  # float32 state (bf16 params refused)

# name -> (model, target, extra aot arguments); the order is the order they are compiled in: the
# recipes README.md and launch/README.md show first, then the rest of their mesh table.
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "1.5b_v5e-8_mb16": ("1.5B", "v5e-8", ["--config.train.micro_batch_size=16"]),
    "1.5b_v5p-32": ("1.5B", "v5p-32", []),
    "7b_v5p-32": ("7B", "v5p-32", []),
    "7b_h100-8": ("7B", "h100-8", []),
    "0.5b_v5e-8_mb16": ("0.5B", "v5e-8", ["--config.train.micro_batch_size=16"]),
    "1.5b_h100-8": ("1.5B", "h100-8", []),
    "0.5b_v5p-32": ("0.5B", "v5p-32", []),
    "0.5b_h100-8": ("0.5B", "h100-8", []),
    "1.5b_h200-8": ("1.5B", "h200-8", []),
    "7b_h200-8": ("7B", "h200-8", []),
    "0.5b_h200-8": ("0.5B", "h200-8", []),
    "1.5b_v5e-8_mb32": ("1.5B", "v5e-8", ["--config.train.micro_batch_size=32"]),
    "7b_v5e-8_mb8": ("7B", "v5e-8", V5E_7B + ["--config.train.micro_batch_size=8"]),
}
# the programs `ict_jax.aot --part` compiles; one JSON per run and part: NAME.PART.json
PARTS = ("train", "sample")


def _path(name: str, part: str) -> str:
  return os.path.join(OUT_DIR, f"{name}.{part}.json")


def command(name: str, part: str) -> list[str]:
  model, target, extra = RUNS[name]
  return [
      "python",
      "-m",
      "ict_jax.aot",
      "--config",
      CFG[model],
      "--target",
      target,
      *extra,
      "--part",
      part,
      "--json",
      f"benchmarks/results/aot/{name}.{part}.json",
  ]


def run(name: str, part: str) -> None:
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


def table(reports: dict[str, dict]) -> str:
  rows = [
      "| model | target | mesh (data, fsdp, tensor) | params | micro-batch | tokens / row "
      "| args | temps | code | peak | usable HBM | fits (margin) | compile s | collectives "
      "(all-gather / all-reduce / reduce-scatter / permute / all-to-all) | model TFLOP / step |",
      "|" + "---|" * 15,
  ]
  for name in RUNS:
    model, target, _ = RUNS[name]
    r = reports.get(name)
    if r is None:
      rows.append(
          f"| {model} | {target} | | | | | | | | | | **not measured** (`{' '.join(command(name, 'train'))}`) " "| | | |"
      )
      continue
    s, c = r["shapes"], r["collectives"]
    mesh = s["mesh"]
    accepted = r.get("compiler_accepted", bool(c))  # reports before the key: compiled = counted
    fit = (
        f"yes ({_gib(r['margin_bytes'])})"
        if r["fits"]
        else "**no** (compiled, but peak > usable)"
        if accepted
        else "**no** (compiler: out of memory)"
    )
    coll = (
        " / ".join(
            str(c.get(k, 0)) for k in ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
        )
        if c
        else "—"
    )
    rows.append(
        f"| {model} | {target} | {mesh['data']}, {mesh['fsdp']}, {mesh['tensor']} | "
        f"{s['param_dtype']} | {s['micro_batch_size']} | {s['prompt_len']} + {s['completion_len']} | "
        f"{_gib(r.get('argument_bytes'))} | {_gib(r.get('temp_bytes'))} | "
        f"{_gib(r.get('generated_code_bytes'))} | {_gib(r['peak_bytes_per_device'])} | "
        f"{_gib(r['hbm_bytes_per_device'])} | {fit} | {r['compile_s']:.0f} | {coll} | "
        f"{r['model_flops_per_step'] / 1e12:.0f} |"
    )
  return "\n".join(rows)


def write_results(reports: dict[str, dict]) -> None:
  with open(os.path.join(ROOT, "benchmarks", "results", "aot.json"), "w") as f:
    json.dump(reports, f, indent=1, sort_keys=True)
  text = open(RESULTS_MD).read()
  block = f"{BEGIN}\n{table(reports['train'])}\n{END}"
  if BEGIN in text:
    head, rest = text.split(BEGIN, 1)
    text = head + block + rest.split(END, 1)[1]
  else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
  with open(RESULTS_MD, "w") as f:
    f.write(text)


def load_reports() -> dict[str, dict[str, dict]]:
  """{part: {name: report}} of every JSON in OUT_DIR."""
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
  args = ap.parse_args()
  names = [n for n in args.only.split(",") if n] or list(RUNS)
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    sys.exit(f"aot_table: unknown run(s) {unknown}; runs are {list(RUNS)}")
  os.makedirs(OUT_DIR, exist_ok=True)
  parts = PARTS if args.part == "both" else (args.part,)
  if not args.table_only:
    for part in parts:
      for name in names:
        run(name, part)
  reports = load_reports()
  write_results(reports)
  print(table(reports["train"]))


if __name__ == "__main__":
  main()
