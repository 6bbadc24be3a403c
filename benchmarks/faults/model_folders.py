"""Bad --init_from_hf folders (a wrong-shaped or missing tensor, a bad config.json, a truncated
safetensors file, another model_type): one `error:` line naming the file (and tensor), exit != 0."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.faults.harness import Run, metrics, quick_flags, row
from benchmarks.faults.registry import Context, scenario


def _hf_folder(path: Path) -> None:
  """A small valid Qwen2 folder (vocabulary of the bundled tokenizer), written by ict_jax."""
  from flax import nnx

  from ict_jax import save_pretrained
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import Qwen2

  cfg = Qwen2Config(
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=256,
  )
  save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(params=0)), str(path))


def _rewrite(path: Path, mutate) -> None:
  from safetensors.numpy import load_file, save_file

  f = path / "model.safetensors"
  tensors = load_file(str(f))
  mutate(tensors)
  save_file(tensors, str(f), metadata={"format": "pt"})


def _set_model_type(path: Path) -> None:
  cfg = json.loads((path / "config.json").read_text())
  cfg["model_type"] = "llama"
  (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path: Path) -> None:
  f = path / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[: len(data) // 2])


HF_FAULTS = {  # name -> (mutation, words the error line must contain)
    "wrong-shaped tensor": (
        lambda p: _rewrite(
            p,
            lambda t: t.update(
                {"model.layers.0.self_attn.k_proj.weight": __import__("numpy").zeros((8, 15), "float32")}
            ),
        ),
        ("model.safetensors", "model.layers.0.self_attn.k_proj.weight", "(8, 15)"),
    ),
    "missing tensor": (
        lambda p: _rewrite(p, lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
        ("model.layers.0.mlp.up_proj.weight", "missing"),
    ),
    "bad config.json": (lambda p: (p / "config.json").write_text("{not json"), ("config.json", "JSON")),
    "truncated safetensors": (_truncate, ("model.safetensors", "truncated")),
    "model_type llama": (_set_model_type, ("config.json", "llama")),
}


def bad_model_folders(root, *, names=None, data_dir="") -> dict:
  root = Path(root)
  data_dir = data_dir or str(root / "data")
  base = root / "hf_base"
  if not base.exists():
    _hf_folder(base)
  import contextlib

  from ict_jax.data import prepare

  with contextlib.redirect_stdout(sys.stderr):  # tfds prints; stdout is the table's
    prepare("synthetic_arith", data_dir, config="level1")  # built already, as on any re-run
  cases = []
  for name in names or HF_FAULTS:
    mutate, needles = HF_FAULTS[name]
    folder = root / ("hf_" + re.sub(r"\W+", "_", name))
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    mutate(folder)
    flags = quick_flags(2, 1, sft=0, data_dir=data_dir) + [f"--init_from_hf={folder}"]
    r = Run(root / f"w_{folder.name}", flags, root / "logs", name=folder.name)
    rc = r.wait()
    lines = r.error_lines()
    errors = [l for l in lines if "error:" in l]
    ok = (
        rc != 0
        and len(lines) == 1
        and len(errors) == 1
        and all(n in errors[0] for n in needles)
        and "Traceback" not in r.stderr()
        and not metrics(r.workdir)
    )
    cases.append(
        {
            "name": name,
            "rc": rc,
            "stderr_lines": len(lines),
            "error": errors[0] if errors else None,
            "seconds": round(r.seconds, 1),
            "ok": ok,
        }
    )
  return row(
      "bad --init_from_hf folders",
      ", ".join(c["name"] for c in cases) + " (CLI)",
      "exit != 0, stderr is one `error:` line naming the file (and tensor), no traceback",
      "; ".join(
          f"{c['name']}: rc {c['rc']}, {c['stderr_lines']} stderr line(s), "
          f"`{(c['error'] or 'NO ERROR LINE').split('error: ')[-1][:90]}`"
          for c in cases
      ),
      all(c["ok"] for c in cases),
      cases=cases,
  )


@scenario("hf")
def _run(ctx: Context) -> dict:
  return bad_model_folders(ctx.root, data_dir=ctx.data_dir)
