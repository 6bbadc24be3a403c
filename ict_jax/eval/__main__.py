"""`python -m ict_jax.eval`: pass@k of a checkpoint or a Hugging Face model on the benchmarks.

    python -m ict_jax.eval --workdir W [--step S] --benchmarks math500,gsm8k --k 1,4 --n 8 \\
        --temperature 0.6 [--max_new_tokens 1024] [--limit 50] [--out DIR] [--seed 0]
    python -m ict_jax.eval --hf DIR --benchmarks gsm8k --manual_dir ~/eval_data
    python -m ict_jax.eval --workdir W --files test.jsonl [--prompt_field q --answer_field solution]

Benchmark files are read from `<manual_dir>/<benchmark>/` (e.g. ~/eval_data/gsm8k/test.jsonl),
or from the folder given by `--manual NAME=DIR`. The `files` benchmark is your own files
(`--files`; with --workdir, the run's data.eval_files and columns by default), checked as the run's
reward.kind checks its answer column. Writes results.json, results.md and
samples_<benchmark>.jsonl into --out (default `<workdir>/eval/step_<S>/` or `<hf>/eval/`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

from ict_jax.eval import benchmarks as registry


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m ict_jax.eval",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a training workdir (config.json + checkpoints/)")
  src.add_argument(
      "--hf", help="a Hugging Face Qwen2 folder, or a hub id (org/name; from the cache with HF_HUB_OFFLINE=1)"
  )
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  p.add_argument(
      "--benchmarks",
      help=f"comma-separated, from: {', '.join(registry.BENCHMARKS)} (default: math500,gsm8k, or files with --files)",
  )
  p.add_argument(
      "--files",
      help="the files benchmark's files: comma-separated paths or globs (.jsonl, .json, .parquet) or "
      "hf:NAME[:SPLIT] (default with --workdir: the run's data.eval_files)",
  )
  p.add_argument("--prompt_field", help="the files' prompt column (default: the run's data.prompt_field, or prompt)")
  p.add_argument("--answer_field", help="the files' answer column (default: the run's data.answer_field, or answer)")
  p.add_argument(
      "--answer_type",
      choices=("math_boxed", "choice", "answer"),
      help="how the files' answers are checked (default: the run's reward.kind, or math_boxed)",
  )
  p.add_argument("--k", type=_ints, default=[1, 4], help="pass@k values, e.g. 1,4")
  p.add_argument("--n", type=int, default=8, help="samples per problem (>= every k)")
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument(
      "--max_new_tokens", type=int, help="default: the run's rollout.max_new_tokens (--workdir) or 1024 (--hf)"
  )
  p.add_argument("--limit", type=int, help="only the first LIMIT problems of each benchmark")
  p.add_argument("--out", help="output folder")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch_size", type=int, default=16, help="problems per generation call")
  p.add_argument(
      "--prompt_style",
      choices=("chat", "plain"),
      help="default: the run's data.prompt_style (--workdir) or chat (--hf)",
  )
  p.add_argument(
      "--dtype",
      choices=("float32", "bfloat16", "float16"),
      help="compute dtype (default: the run's model.dtype, or bfloat16 for --hf)",
  )
  p.add_argument(
      "--mesh",
      type=_ints,
      help="data,fsdp,tensor sizes (-1: the rest); default: the " "run's config.mesh (--workdir) or 1,-1,1",
  )
  p.add_argument(
      "--data_dir",
      help="tfds data_dir for the built benchmarks, a local folder (default: the run's "
      "data.data_dir, else <workdir>/data, or $TFDS_DATA_DIR / ~/tensorflow_datasets for a gs:// workdir; "
      "<hf>/eval/data for --hf)",
  )
  p.add_argument(
      "--manual_dir", help="folder with one sub-folder of files per benchmark " "(default: <data_dir>/manual)"
  )
  p.add_argument(
      "--manual",
      action="append",
      default=[],
      metavar="NAME=DIR",
      help="the files of benchmark NAME are in DIR (repeatable)",
  )
  p.add_argument(
      "--reward_workers",
      type=int,
      help="answer-checking processes (0: in-process; " "default: the run's reward.num_workers, or 4)",
  )
  p.add_argument("--reward_timeout", type=float, default=10.0, help="seconds per answer check")
  p.add_argument("--no_progress", action="store_true", help="no progress bars")
  return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list:
  """Everything that can be checked before loading a model; p.error (exit 2) otherwise."""
  from ict_jax.eval.run import check_ks

  if a.benchmarks is None:
    a.benchmarks = registry.FILES if a.files else "math500,gsm8k"
  try:
    benches = registry.parse(a.benchmarks)
  except KeyError as e:
    p.error(f"--benchmarks: {e.args[0]}")
  if (a.files or a.prompt_field or a.answer_field or a.answer_type) and registry.FILES not in a.benchmarks.split(","):
    p.error(f"--files / --prompt_field / --answer_field / --answer_type: the files benchmark is not in --benchmarks")
  try:
    a.k = list(check_ks(a.k, a.n))
  except ValueError as e:
    p.error(f"--k/--n: {e}")
  for name in ("batch_size", "max_new_tokens", "limit"):
    value = getattr(a, name)
    if value is not None and value < 1:
      p.error(f"--{name}: expected >= 1, got {value}")
  if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
    p.error("--temperature must be >= 0, --top_p in (0, 1], --top_k >= 0")
  if a.step is not None and a.hf:
    p.error("--step applies to --workdir only")
  manual = {}
  for item in a.manual:
    name, sep, folder = item.partition("=")
    if not sep or not folder or name not in registry.BENCHMARKS or name == registry.FILES:
      names = ", ".join(b for b in registry.BENCHMARKS if b != registry.FILES)
      p.error(f"--manual {item!r}: expected NAME=DIR with NAME one of {names} (the files benchmark: --files)")
    manual[name] = folder
  a.manual = manual
  if a.mesh is not None and len(a.mesh) != 3:
    p.error(f"--mesh: expected three sizes data,fsdp,tensor, got {a.mesh}")
  return benches


def _files_benchmark(a: argparse.Namespace, cfg, benches: list):
  """-> (the `FileSplit` the files benchmark reads, or None; the benchmarks with its answer type):
  --files / --prompt_field / --answer_field / --answer_type, else the run's data.eval_files, columns
  and reward.kind (a run on files), else prompt / answer / math_boxed."""
  import dataclasses

  from ict_jax.data.files import FILES, FileSplit

  if not any(b.name == FILES for b in benches):
    return None, benches
  data = cfg.data if cfg is not None and FILES in cfg.data.name.split("+") else None
  spec = a.files or (data.eval_files if data is not None else "")
  split = FileSplit(
      spec,
      a.prompt_field or (data.prompt_field if data is not None else "prompt"),
      a.answer_field or (data.answer_field if data is not None else "answer"),
      "test" if data is None else data.eval_split,
      "--files" if a.files or data is None else f"{a.workdir}: config.data.eval_files",
  )
  kind = {"math": "math_boxed"}.get(cfg.reward.kind, cfg.reward.kind) if cfg is not None else "math_boxed"
  answer_type = a.answer_type or (kind if kind in ("math_boxed", "choice", "answer") else "math_boxed")
  return split, [dataclasses.replace(b, answer_type=answer_type) if b.name == FILES else b for b in benches]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Run the CLI; returns the results.json dict. Exits with status 2 on a usage or input error."""
  p = parser()
  a = p.parse_args(argv)
  benches = _check_args(p, a)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  logging.getLogger("fsspec").setLevel(logging.WARNING)  # gs://: a line per file opened otherwise
  logging.getLogger("absl").setLevel(logging.ERROR)
  from ict_jax.checkpoint import CheckpointError
  from ict_jax.config import ConfigError

  try:
    return _run(a, benches)
  except (FileNotFoundError, ConfigError, CheckpointError, ValueError, KeyError) as e:
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"ict_jax.eval: error: {message}", file=sys.stderr)
    sys.exit(2)


def _run(a: argparse.Namespace, benches: list) -> dict[str, Any]:
  import jax
  from ict_jax import setup, sharding
  from ict_jax.eval import loading
  from ict_jax.eval.run import evaluate_benchmarks, load_benchmarks, markdown_table, summary, write_results
  from ict_jax.rewards.pool import RewardPool
  from ict_jax import hf_tokenizer
  from ict_jax.models.hf import resolve_model_dir

  from ict_jax import storage

  for what, path in (("--workdir", a.workdir), ("--hf", a.hf), ("--out", a.out)):
    if path:
      storage.check_backend(path, what)  # gs:// without gcsfs: one line, before anything is read
  storage.check_data_dir(a.data_dir, "--data_dir")
  sharding.maybe_initialize_distributed()
  cfg = setup.read_run_config(a.workdir, a.step) if a.workdir else None
  hf_dir = ""
  if cfg is not None:
    prompt_style = a.prompt_style or cfg.data.prompt_style
    max_new_tokens = a.max_new_tokens or cfg.rollout.max_new_tokens
    storage.check_data_dir(cfg.data.data_dir, f"{a.workdir}: config.data.data_dir")
    data_dir = storage.data_dir(a.data_dir or cfg.data.data_dir, a.workdir)
    workers = cfg.reward.num_workers if a.reward_workers is None else a.reward_workers
  else:
    # results next to a local folder; a hub id's in ./eval/<org--name>, never inside the hub cache
    local = os.path.isdir(os.path.expanduser(a.hf))
    home = os.path.join(a.hf, "eval") if local else os.path.join("eval", a.hf.replace("/", "--"))
    prompt_style = a.prompt_style or "chat"
    max_new_tokens = a.max_new_tokens or 1024
    data_dir = a.data_dir or os.path.join(home, "data")
    workers = 4 if a.reward_workers is None else a.reward_workers
  manual_root = os.path.expanduser(a.manual_dir or os.path.join(data_dir, "manual"))
  manual = {b.name: a.manual.get(b.name) or os.path.join(manual_root, b.name) for b in benches}
  files, benches = _files_benchmark(a, cfg, benches)
  examples = load_benchmarks(benches, data_dir=data_dir, manual_dirs=manual, limit=a.limit, files=files)
  if cfg is None:  # after the benchmarks' files are read: a bad file is said before any download
    hf_dir = resolve_model_dir(a.hf)  # a hub id: its snapshot, one line when it cannot be had

  mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, a.mesh))) if a.mesh is not None else None
  if cfg is not None:
    loaded, mesh = loading.load_workdir(a.workdir, step=a.step, mesh=mesh, dtype=a.dtype, config=cfg)
    out = a.out or os.path.join(a.workdir, "eval", f"step_{loaded.step}")
  else:
    mesh = mesh if mesh is not None else sharding.make_mesh()
    loaded = loading.load_hf(a.hf, dtype=a.dtype or "bfloat16", mesh=mesh)
    out = a.out or home
  settings = dict(
      n=a.n,
      ks=a.k,
      temperature=a.temperature,
      top_p=a.top_p,
      top_k=a.top_k,
      max_new_tokens=max_new_tokens,
      prompt_style=prompt_style,
      seed=a.seed,
      limit=a.limit,
      batch_size=a.batch_size,
      dtype=str(loaded.model.cfg.dtype),
      source=a.workdir or a.hf,
  )
  if files is not None:
    settings.update(files=files.spec, prompt_field=files.prompt_field, answer_field=files.answer_field)
  with RewardPool(num_workers=workers, timeout_s=a.reward_timeout) as pool:
    results = evaluate_benchmarks(
        loaded.model,
        hf_tokenizer.load_tokenizer(a.workdir or hf_dir),  # the checkpoint's own, else Qwen2.5's
        benches,
        examples,
        seed=a.seed,
        progress=not a.no_progress and sharding.is_main_process(),
        n=a.n,
        ks=a.k,
        max_new_tokens=max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        prompt_style=prompt_style,
        mesh=mesh,
        reward_pool=pool,
        batch_size=a.batch_size,
    )
  report = summary(loaded.label, loaded.step, settings, results, {b.name: b.title for b in benches})
  if jax.process_index() == 0:
    write_results(out, report, results)
    print(markdown_table([report]), end="")
    logging.getLogger("ict_jax.eval").info("wrote %s", out)
  return report


def cli() -> None:
  """The `ict-jax-eval` command: `main` with its results dict left out of the exit status."""
  main()


if __name__ == "__main__":
  main()
