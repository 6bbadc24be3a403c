"""`python -m ict_jax.export`: a training checkpoint -> a Hugging Face folder.

    python -m ict_jax.export --workdir W [--step S] --out DIR [--dtype float32] [--mesh 1,-1,1]

Reads only `state.params` of `<W>/checkpoints/<S>/` (default: the latest step), each tensor into
its sharding on the mesh, and writes a folder transformers serves: `config.json`, the weights as
safetensors (bfloat16 unless --dtype says otherwise), `generation_config.json` (the stop ids),
`tokenizer.json` and `tokenizer_config.json` with the chat template (the run's tokenizer: its
checkpoint's own, else Qwen2.5's, a task vocabulary renumbered to its ids), so that
`AutoTokenizer.from_pretrained(DIR)` gives the run's ids and
`AutoModelForCausalLM.from_pretrained(DIR).generate(...)` runs. A LoRA run's (model.lora_rank)
`state.params` are its adapters: they are merged into the base it froze (model.path's weights),
W + alpha / rank * A.B, and the folder is a plain Qwen2 checkpoint. Run it on every host of a
multi-host job (the parameters are gathered; process 0 writes).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m ict_jax.export", description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a training workdir (or its checkpoints/ folder)")
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  p.add_argument("--out", required=True, help="the Hugging Face folder to write (local or gs://)")
  p.add_argument(
      "--dtype",
      choices=("float32", "bfloat16", "float16"),
      default="bfloat16",
      help="dtype of the written tensors (float32: the saved float32 weights exactly)",
  )
  p.add_argument(
      "--mesh",
      type=_ints,
      help="data,fsdp,tensor sizes (-1: the rest) to read the " "parameters onto; default: one device",
  )
  p.add_argument(
      "--ref",
      action="store_true",
      help="export the frozen reference policy (ref_params) " "instead of the trained parameters",
  )
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  logging.getLogger("absl").setLevel(logging.ERROR)
  logging.getLogger("fsspec").setLevel(logging.WARNING)
  from ict_jax import inspect as ckpt_inspect
  from ict_jax import sharding, storage
  from ict_jax.checkpoint import CheckpointError
  from ict_jax.config import ConfigError

  try:  # gs:// without gcsfs: one line before any checkpoint is read
    storage.check_backend(args.workdir, "--workdir")
    storage.check_backend(args.out, "--out")
  except ConfigError as e:
    print(f"ict_jax.export: error: {e}", file=sys.stderr)
    return 2

  try:
    mesh = sharding.make_mesh(args.mesh) if args.mesh else None
  except ValueError as e:
    print(f"ict_jax.export: error: --mesh: {e}", file=sys.stderr)
    return 2
  try:
    with ckpt_inspect.open_checkpoint(args.workdir, args.step) as ckpt:
      out = ckpt_inspect.to_hf(ckpt, args.out, dtype=args.dtype, mesh=mesh, item="ref_params" if args.ref else "params")
      print(f"wrote step {ckpt.step} of {args.workdir} to {out}")
  except (CheckpointError, KeyError, ValueError, FileNotFoundError, ConfigError) as e:
    message = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) is quoted
    print(f"ict_jax.export: error: {message}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
