"""`python -m ict_jax.aot` (module docstring of `ict_jax.aot`): flags, the compiles, the report."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
from etils import epath

from ict_jax.aot.decode_grid import MODES
from ict_jax.aot.measure import Report
from ict_jax.aot.report import format_report
from ict_jax.aot.sampler import compile_sampler
from ict_jax.aot.step import compile_train_step
from ict_jax.aot.targets import TARGETS, AotError, GiB
from ict_jax.config import ConfigError
from ict_jax.length_model import LengthDistribution

PARTS = ("train", "sample", "both")  # --part: which programs to compile


def _fail(msg: str) -> None:
  print(f"ict_jax.aot: error: {msg}", file=sys.stderr)
  sys.exit(2)


def _train_in_a_child(argv: list[str], path: str) -> subprocess.Popen:
  """`python -m ict_jax.aot ARGS --part train --json path` started beside this process: --part
  both compiles the train step there while this one compiles the sampler (two compiles at once:
  each is one thread for most of its minutes)."""
  args, skip = [], False
  for a in argv[1:]:
    if skip or a.split("=", 1)[0] in ("--json", "--part"):
      skip = not skip and "=" not in a  # "--json X": skip X too
      continue
    args.append(a)
  cmd = [sys.executable, "-m", "ict_jax.aot", *args, "--part", "train", "--json", path]
  return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _train_report(child: subprocess.Popen, path: str) -> Report:
  """The child's train report (its bad-input line is this process's)."""
  _, err = child.communicate()
  if child.returncode not in (0, 1) or not os.path.exists(path):
    _fail(err.strip().splitlines()[-1].removeprefix("ict_jax.aot: error: ") if err.strip() else "train step: failed")
  d = json.loads(epath.Path(path).read_text())  # a local temporary file of this process's
  return Report(**{f.name: d[f.name] for f in dataclasses.fields(Report) if f.name in d})


def _flags():
  """The command line's flags (module docstring of `ict_jax.aot`)."""
  from absl import flags

  fl = flags.FlagValues()
  flags.DEFINE_string("target", "", f"one of {', '.join(TARGETS)}", flag_values=fl)
  flags.DEFINE_integer(
      "completion_len",
      0,
      "completion columns of the batch (0: " "rollout.max_new_tokens, what the trainer feeds)",
      flag_values=fl,
  )
  flags.DEFINE_integer("prompt_len", 0, "prompt columns (0: the bucket of data.max_prompt_len)", flag_values=fl)
  flags.DEFINE_string("json", "", "also write the report here as JSON", flag_values=fl)
  flags.DEFINE_float(
      "hbm_gib",
      0.0,
      "usable HBM per chip in GiB for the fit test and rollout.decode_batch_size=auto (0: the "
      "target's; less leaves headroom for other buffers)",
      flag_values=fl,
  )
  flags.DEFINE_enum("part", "both", PARTS, "train: the train step; sample: the sampler; both: both", flag_values=fl)
  # the length distribution of the step time's lower bound (`ict_jax.length_model`)
  d = LengthDistribution()
  flags.DEFINE_float("prompt_median", d.prompt_median, "prompt tokens: log-normal median", flag_values=fl)
  flags.DEFINE_float("prompt_sigma", d.prompt_sigma, "prompt tokens: log-normal sigma", flag_values=fl)
  flags.DEFINE_float("completion_median", d.completion_median, "completion tokens: log-normal median", flag_values=fl)
  flags.DEFINE_float("completion_sigma", d.completion_sigma, "completion tokens: log-normal sigma", flag_values=fl)
  flags.DEFINE_float("capped_share", d.capped_share, "share of completions at max_new_tokens", flag_values=fl)
  flags.DEFINE_integer("length_batches", 20, "simulated steps the bound averages", flag_values=fl)
  flags.DEFINE_integer("length_seed", 0, "seed of the simulated lengths", flag_values=fl)
  flags.DEFINE_enum(
      "decode_compiles",
      "few",
      MODES,
      "few: the decode step compiled at the first and last phase bound x the fewest and all rows, "
      "at 2 and 3 layers, the rest derived (affine; minutes); all: at every phase bound x every "
      "compacted row count, at the model's depth (the check of the derivation; an hour on 1.5B TPU)",
      flag_values=fl,
  )
  return fl


def main(argv=None) -> None:

  from ict_jax import cli_config
  from ict_jax import config as config_lib

  fl = _flags()
  argv = sys.argv if argv is None else argv
  try:  # flag and --config.* override errors become one line, not a traceback
    cd = cli_config.parse(fl, argv)
  except config_lib.ConfigError as e:
    _fail(str(e))
  if fl.target not in TARGETS:
    _fail(f"--target {fl.target!r}: unknown; expected one of {', '.join(TARGETS)}")
  if fl.completion_len < 0 or fl.prompt_len < 0:
    _fail("--completion_len and --prompt_len must be >= 0")
  if fl.hbm_gib < 0:
    _fail(f"--hbm_gib must be >= 0, got {fl.hbm_gib}")
  if fl.length_batches < 1:
    _fail(f"--length_batches must be >= 1, got {fl.length_batches}")
  try:
    lengths = LengthDistribution(
        prompt_median=fl.prompt_median,
        prompt_sigma=fl.prompt_sigma,
        completion_median=fl.completion_median,
        completion_sigma=fl.completion_sigma,
        capped_share=fl.capped_share,
    )
  except ValueError as e:
    _fail(f"--{str(e).split('.', 1)[1]}")
  target = TARGETS[fl.target]
  if fl.hbm_gib:
    target = dataclasses.replace(target, usable_hbm=int(fl.hbm_gib * GiB))
  reports, child, tmp = [], None, tempfile.mkdtemp(prefix="ict_aot_")
  try:
    cfg = config_lib.validate(cd)
    if fl.part == "both":
      child = _train_in_a_child(list(argv), os.path.join(tmp, "train.json"))
    elif fl.part == "train":
      reports.append(compile_train_step(cfg, target, prompt_len=fl.prompt_len, completion_len=fl.completion_len))
    if fl.part in ("sample", "both"):
      reports.append(
          compile_sampler(
              cfg,
              target,
              prompt_len=fl.prompt_len,
              completion_len=fl.completion_len,
              lengths=lengths,
              length_batches=fl.length_batches,
              length_seed=fl.length_seed,
              decode_compiles=fl.decode_compiles,
          )
      )
    if child is not None:
      reports.insert(0, _train_report(child, os.path.join(tmp, "train.json")))
  except (ConfigError, AotError) as e:
    _fail(" ".join(str(e).split()))
  finally:
    if child is not None and child.poll() is None:
      child.kill()
    shutil.rmtree(tmp, ignore_errors=True)
  fits = all(r.fits for r in reports)
  if fl.json:  # first: a compile of many minutes must not be lost to a closed stdout
    by_program = {r.program: r.to_json() for r in reports}
    out = {
        **by_program.get("train_step", {}),
        **({"sampler": by_program["sampler"]} if "sampler" in by_program else {}),
        **{  # the step's lower bound and the decode phases' bytes ratios, from the sampler
            k: by_program["sampler"][k]
            for k in ("step_time_lower_bound_s", "hours_lower_bound", "decode_phase_bytes_over_weights_kv")
            if "sampler" in by_program
        },
        **{  # the rollout's decode against its limit (`plan.step_bound`)
            k: by_program["sampler"]["step_bound"][k]
            for k in ("decode_s", "decode_limit_s", "decode_bytes_over_limit", "live_row_steps_over_real")
            if "sampler" in by_program and by_program["sampler"]["step_bound"]
        },
        "fits": fits,
        "part": fl.part,
        "config": fl["config"].config_filename,
        "chips": target.chips,
        "peak_tflops_per_chip": target.peak_tflops,
        "hbm_tb_s_per_chip": target.hbm_tb_s,
        "ici_gb_s_per_chip": target.ici_gb_s,
        "jax": jax.__version__,
    }
    epath.Path(fl.json).write_text(json.dumps(out, indent=1))
  print("\n".join(format_report(r, target) for r in reports), flush=True)
  sys.exit(0 if fits else 1)


if __name__ == "__main__":
  main()
