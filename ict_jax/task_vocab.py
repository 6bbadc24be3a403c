"""A task vocabulary: the bundled Qwen2.5 tokenizer restricted to the tokens a task's text uses.

`config.model.vocab = "task"` (the CPU default) gives a model trained from scratch an embedding
and LM head of ~128 rows instead of Qwen2.5's 151,936. Text is still split by Qwen2.5's BPE; each
Qwen id the task uses gets a compact id (its index in the sorted list of kept Qwen ids), and
decoding maps back. On the tiny model the 151,936-row LM head is almost all of a step's FLOPs
and memory, so the compact head makes a step ~30x cheaper (benchmarks/RESULTS.md) and leaves
the model's capacity to the task's ~30 tokens.

The kept ids are every id of the train and eval splits' prompts, worked solutions and answers,
plus the three chat ids (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`), so the pad and stop ids
map as with the full tokenizer. They are saved as `task_vocab.json` in the workdir at the first
start (a resume reads it back, so the parameter shapes do not depend on the data afterwards) and
next to an exported Hugging Face folder, whose tokenizer they are (`load_tokenizer`). A pretrained
Qwen2.5 keeps the full vocabulary (`model.vocab = "qwen"`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np
from etils import epath

from ict_jax import storage
from ict_jax.tokenizer import Tokenizer

VOCABS = ("qwen", "task")  # model.vocab: Qwen2.5's 151,936 rows, or this module's task vocabulary

FILENAME = "task_vocab.json"
FORMAT = "ict_jax.task_vocab/1"
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_MULTIPLE = 128  # embedding rows are padded like Qwen2.5's (151,665 -> 151,936)


def model_vocab_size(num_tokens: int) -> int:
  """Embedding rows for `num_tokens` kept tokens: rounded up to a multiple of PAD_MULTIPLE (the
  extra rows decode to nothing, as Qwen2.5's padding rows do)."""
  return -(-num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE


class TaskTokenizer(Tokenizer):
  """`Tokenizer` with compact ids: id k is the Qwen2.5 id `qwen_ids[k]`. Same interface (encode,
  decode, decode_batch, decode_pieces, chat template, pad / stop ids): only encoding and the
  `_to_qwen` map of decoding differ; `vocab_size` is the number of kept tokens."""

  def __init__(self, qwen_ids: Iterable[int], vocab_file: str | os.PathLike | None = None, source: str = ""):
    super().__init__(vocab_file)
    kept = sorted({int(i) for i in qwen_ids})
    full = self._enc.n_vocab
    bad = [i for i in kept if not 0 <= i < full]
    if bad:
      raise ValueError(f"{source or 'task vocabulary'}: ids {bad[:5]} are outside Qwen2.5's 0..{full - 1}")
    missing = [t for t in CHAT_TOKENS if self.special_tokens[t] not in kept]
    if missing:
      raise ValueError(f"{source or 'task vocabulary'}: must keep {missing} (the pad and stop ids)")
    self.source = source
    self.qwen_ids = np.asarray(kept, np.int64)  # [vocab] compact id -> Qwen2.5 id
    self._compact = {q: k for k, q in enumerate(kept)}
    self.special_tokens = {t: self._compact[q] for t, q in self.special_tokens.items() if q in self._compact}
    self.pad_id = self._compact[self.pad_id]
    self.im_start_id = self._compact[self.im_start_id]
    self.im_end_id = self._compact[self.im_end_id]
    self.eos_ids = (self.im_end_id, self.pad_id)
    self.vocab_size = len(kept)

  # ---- compact <-> Qwen2.5 ids ----------------------------------------------------------------
  def _to_qwen(self, ids: np.ndarray) -> np.ndarray:
    return self.qwen_ids[ids]

  def to_qwen(self, ids) -> np.ndarray:
    """Qwen2.5 ids of compact `ids` (any shape); ids outside the vocabulary (padding rows) are
    dropped, so the result is flat."""
    return self._qwen_ids(ids)[0]

  def encode(self, text: str, allowed_special="all") -> list[int]:
    qwen = super().encode(text, allowed_special)
    try:
      return [self._compact[q] for q in qwen]
    except KeyError as e:
      piece = self._enc.decode_single_token_bytes(e.args[0]).decode("utf-8", errors="replace")
      raise ValueError(
          f"{self.source or 'task vocabulary'}: the text {text[:60]!r} has the token {piece!r} (Qwen2.5 id "
          f"{e.args[0]}), which the task vocabulary does not keep; it holds the tokens of the task's "
          "data only (config.model.vocab='task'). Use model.vocab='qwen' for open-ended text."
      ) from None

  # ---- files ----------------------------------------------------------------------------------
  def save(self, directory: str | os.PathLike) -> str:
    """Write `<directory>/task_vocab.json`; returns its path."""
    path = epath.Path(directory) / FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": FORMAT, "qwen_ids": self.qwen_ids.tolist()})
    if storage.is_url(path):  # one object PUT: whole or absent
      path.write_text(text)
      return os.fspath(path)
    tmp = path.parent / (FILENAME + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # never a half-written vocabulary next to a checkpoint
    return os.fspath(path)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "TaskTokenizer":
    path = epath.Path(path)
    try:
      data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise ValueError(f"{path}: expected a JSON object with format {FORMAT!r}")
    ids = data.get("qwen_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
      raise ValueError(f"{path}: field 'qwen_ids' must be a list of ints (Qwen2.5 token ids)")
    return cls(ids, source=os.fspath(path))


def build(texts: Iterable[str], base: Tokenizer | None = None) -> TaskTokenizer:
  """The task vocabulary of `texts`: every Qwen2.5 id they encode to, plus CHAT_TOKENS."""
  base = base or Tokenizer()
  kept = {base.special_tokens[t] for t in CHAT_TOKENS}
  for text in texts:
    kept.update(base.encode(text))
  return TaskTokenizer(kept, base.vocab_file)


def find(directories: Sequence[str]) -> str | None:
  """The first `<dir>/task_vocab.json` that exists among `directories` (empty ones skipped)."""
  for d in directories:
    if d and (epath.Path(d) / FILENAME).exists():
      return os.fspath(epath.Path(d) / FILENAME)
  return None


def load_tokenizer(*directories: str) -> Tokenizer:
  """The tokenizer of a model folder or workdir: its task vocabulary when one of `directories`
  holds `task_vocab.json`, else the full Qwen2.5 tokenizer."""
  path = find(directories)
  return TaskTokenizer.load(path) if path else Tokenizer()
