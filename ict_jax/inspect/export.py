"""A checkpoint step written as a Hugging Face folder that transformers (and vLLM) serve: the
weights, config.json, generation_config.json (the stop ids), tokenizer.json and
tokenizer_config.json (with the chat template)."""

from __future__ import annotations

import logging
import os

from ict_jax.inspect.reader import Checkpoint

log = logging.getLogger("ict_jax.inspect")


def run_tokenizer(ckpt: Checkpoint):
  """The tokenizer the run trained with (`hf_tokenizer.load_tokenizer`): its task vocabulary, its
  checkpoint's tokenizer files (the copy in `<workdir>/tokenizer/`, else those of the run's
  `model.path` when it can be had), else the bundled Qwen2.5 tokenizer."""
  from ict_jax import hf_tokenizer
  from ict_jax.models.hf import resolve_model_dir

  workdir = os.fspath(ckpt.workdir)
  cfg = ckpt.config
  model_dir = ""
  if cfg is not None and cfg.model.path:
    try:
      model_dir = resolve_model_dir(cfg.model.path)
    except FileNotFoundError as e:
      log.warning("the run's model.path cannot be read for its tokenizer (%s)", e)
  return hf_tokenizer.load_tokenizer(workdir, model_dir)


# ---- export -------------------------------------------------------------------------------------------
def to_hf(
    ckpt: Checkpoint,
    out_dir: str | os.PathLike,
    step: int | None = None,
    *,
    dtype=None,
    mesh=None,
    item: str = "params",
) -> str:
  """Write the step's parameters as a Hugging Face folder that
  `transformers.AutoModelForCausalLM.from_pretrained` loads and `AutoTokenizer.from_pretrained`
  tokenizes with the run's ids: config.json + safetensors in `dtype` (default: the saved one;
  `python -m ict_jax.export` defaults to bfloat16), generation_config.json, tokenizer.json and
  tokenizer_config.json (`hf_tokenizer_files.write_tokenizer_files` of `run_tokenizer`). A run
  with a task vocabulary (`model.vocab="task"`) also gets its `task_vocab.json` copied along: it
  is the folder's tokenizer for ict-jax. Call on every host with a multi-host mesh (process 0
  writes). Returns `out_dir`."""
  import contextlib
  import tempfile

  from ict_jax import hf_tokenizer_files, sharding, storage, task_vocab
  from ict_jax.models.hf import save_pretrained

  storage.check_backend(out_dir, "the export folder")
  tok = run_tokenizer(ckpt)
  model = ckpt.restore_model(step, mesh=mesh, item=item)
  with contextlib.ExitStack() as stack:
    # a bucket: safetensors writes local files, so the folder is made locally and copied up
    url = storage.is_url(out_dir)
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ict_jax_export_")) if url else os.fspath(out_dir)
    save_pretrained(model, folder, dtype=dtype, token_ids=hf_tokenizer_files.token_ids(tok))
    if sharding.is_main_process():
      hf_tokenizer_files.write_tokenizer_files(folder, tok)
      if isinstance(tok, task_vocab.TaskTokenizer):
        tok.save(folder)
      if url:
        storage.upload(folder, out_dir)
  return os.fspath(out_dir)
