"""A checkpoint step written as a Hugging Face folder."""

from __future__ import annotations

import os

from ict_jax.inspect.reader import Checkpoint


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
  """Write the step's parameters as a Hugging Face folder (`config.json` + safetensors) that
  `transformers.AutoModelForCausalLM.from_pretrained` loads; `dtype` defaults to the saved one.
  Call on every host with a multi-host mesh (process 0 writes). A run with a task vocabulary
  (`model.vocab="task"`) gets its `task_vocab.json` copied along: it is the folder's tokenizer.
  Returns `out_dir`."""
  import contextlib
  import tempfile

  from ict_jax import sharding, storage, task_vocab
  from ict_jax.models.hf import save_pretrained

  storage.check_backend(out_dir, "the export folder")
  model = ckpt.restore_model(step, mesh=mesh, item=item)
  vocab = task_vocab.find([os.fspath(ckpt.workdir)])
  with contextlib.ExitStack() as stack:
    # a bucket: safetensors writes local files, so the folder is made locally and copied up
    url = storage.is_url(out_dir)
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ict_jax_export_")) if url else os.fspath(out_dir)
    save_pretrained(model, folder, dtype=dtype)
    if sharding.is_main_process():
      if vocab:
        task_vocab.TaskTokenizer.load(vocab).save(folder)
      if url:
        storage.upload(folder, out_dir)
  return os.fspath(out_dir)
