"""A checkpoint's own tokenizer: its `tokenizer.json` through Hugging Face `tokenizers`, its chat
template (`chat_template.jinja`, else tokenizer_config.json's `chat_template`) rendered with jinja2
the way transformers renders it, and its stop ids; no torch, no transformers.

`HFTokenizer` offers the interface the trainer uses of `ict_jax.tokenizer.Tokenizer` (encode,
decode, decode_batch, decode_pieces, token_to_id, apply_chat_template, batch_encode, pad_id,
eos_ids, vocab_size), with the ids of transformers' `AutoTokenizer.from_pretrained(dir)`:
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` gives the same ids, and
`encode(text)` those of `AutoTokenizer.encode(text, add_special_tokens=False)` (what a chat prompt
is encoded with, as in transformers' and TRL's chat path; `add_special_tokens=True` adds the
post-processor's tokens, a BOS for instance, as `AutoTokenizer.encode(text)` does).

The stop ids (`eos_ids`) are those generation stops at in transformers and vLLM: generation_config.json's
`eos_token_id` (else config.json's), then tokenizer_config.json's `eos_token`.

`load_tokenizer(*directories)` is the one rule from a model folder or a workdir to its tokenizer:
a task vocabulary (`task_vocab.json`), else a checkpoint's tokenizer files (in the folder, or in a
workdir's `tokenizer/`, where a run started from such a checkpoint keeps a copy), else the bundled
Qwen2.5 tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
from etils import epath

from ict_jax import storage, task_vocab
from ict_jax.tokenizer import DEFAULT_BUCKETS, Tokenizer, left_pad

TOKENIZER_JSON = "tokenizer.json"
CONFIG_JSON = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
# The files a checkpoint's tokenizer is made of; a run keeps a copy of those present in <workdir>/tokenizer/.
FILES = (TOKENIZER_JSON, CONFIG_JSON, CHAT_TEMPLATE_FILE, "special_tokens_map.json", GENERATION_CONFIG)
WORKDIR_SUBDIR = "tokenizer"
# transformers' special-token attributes, which a chat template sees by name (bos_token, ...).
SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def has_tokenizer(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds a Hugging Face `tokenizer.json`."""
  return bool(directory) and (epath.Path(directory) / TOKENIZER_JSON).exists()


def _read_json(path: epath.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{os.fspath(path)}: not valid JSON ({e})") from None


def _token_content(value) -> str | None:
  """A special token of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
  """An `eos_token_id` of a config: an int, a list of ints, or null."""
  if isinstance(value, bool):
    return []
  if isinstance(value, int):
    return [value]
  if isinstance(value, list):
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
  return []


def _chat_template(folder: epath.Path, config: Mapping) -> str | None:
  """The default chat template: chat_template.jinja (which transformers prefers), else the config's
  `chat_template` (a string, or a list of {"name", "template"} with a "default")."""
  if (folder / CHAT_TEMPLATE_FILE).exists():
    return (folder / CHAT_TEMPLATE_FILE).read_text()
  value = config.get("chat_template")
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    value = named.get("default")
  return value if isinstance(value, str) else None


def _generation_extension():
  """jinja2 `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag), rendered
  as its body."""
  import jinja2.ext
  import jinja2.nodes

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  return Generation


def compile_chat_template(template: str):
  """A jinja2 template in transformers' environment: sandboxed, trim_blocks and lstrip_blocks,
  loop controls, its `tojson` (no HTML escaping), `raise_exception` and `strftime_now`."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(template)


class HFTokenizer:
  """The tokenizer of a Hugging Face folder (local or gs://) holding `tokenizer.json`."""

  def __init__(self, directory: str | os.PathLike):
    import tokenizers

    folder = epath.Path(directory)
    self.source = os.fspath(directory)
    path = folder / TOKENIZER_JSON
    try:
      self._tok = tokenizers.Tokenizer.from_str(path.read_text())
    except Exception as e:  # pylint: disable=broad-except  # tokenizers raises its own Exception
      raise ValueError(f"{os.fspath(path)}: not a Hugging Face tokenizer file ({e})") from None
    config = _read_json(folder / CONFIG_JSON) if (folder / CONFIG_JSON).exists() else {}
    if not isinstance(config, dict):
      raise ValueError(f"{os.fspath(folder / CONFIG_JSON)}: expected a JSON object")
    self.config = config
    self.chat_template = _chat_template(folder, config)
    self._template = None
    self.special_tokens_map = {k: v for k in SPECIAL_ATTRIBUTES if (v := _token_content(config.get(k)))}
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
    self.model_eos_ids = self._model_eos_ids(folder)
    eos = list(self.model_eos_ids)
    eos_token = self.special_tokens_map.get("eos_token")
    if eos_token is not None and self._tok.token_to_id(eos_token) is not None:
      eos.append(self._tok.token_to_id(eos_token))
    self.eos_ids = tuple(dict.fromkeys(eos))  # generation stops at any of them
    if not self.eos_ids:
      raise ValueError(
          f"{self.source}: no stop token (no eos_token_id in {GENERATION_CONFIG} or config.json, "
          f"no eos_token in {CONFIG_JSON})"
      )
    pad = self.special_tokens_map.get("pad_token")
    pad_id = self._tok.token_to_id(pad) if pad is not None else None
    self.pad_id = pad_id if pad_id is not None else self.eos_ids[0]
    self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))

  @staticmethod
  def _model_eos_ids(folder: epath.Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's (what transformers' generate uses)."""
    for name in (GENERATION_CONFIG, "config.json"):
      if (folder / name).exists():
        data = _read_json(folder / name)
        ids = _ids(data.get("eos_token_id")) if isinstance(data, dict) else []
        if ids:
          return tuple(ids)
    return ()

  # ---- ids <-> text -------------------------------------------------------------------------
  def encode(self, text: str, allowed_special="all", add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`: AutoTokenizer's `encode(text, add_special_tokens=add_special_tokens)`.
    `allowed_special=set()` encodes special-token strings as ordinary text (untrusted input)."""
    if not isinstance(text, str):
      raise TypeError(f"HFTokenizer.encode expects a str, got {type(text).__name__}")
    if allowed_special == "all":
      return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
    self._tok.encode_special_tokens = True
    try:
      return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
    finally:
      self._tok.encode_special_tokens = False

  def _in_vocab(self, ids) -> list[int]:
    """The ids of `ids` inside the vocabulary, flat (embedding padding rows decode to nothing)."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    return flat[(flat >= 0) & (flat < self.vocab_size)].tolist()

  def _clean(self, text: str) -> str:
    if not self._cleanup:
      return text
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
      text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
      text = text.replace(a, b)
    return text

  def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
    return self._clean(self._tok.decode(self._in_vocab(ids), skip_special_tokens=skip_special_tokens))

  def decode_batch(self, rows, skip_special_tokens: bool = False) -> list[str]:
    texts = self._tok.decode_batch([self._in_vocab(r) for r in rows], skip_special_tokens=skip_special_tokens)
    return [self._clean(t) for t in texts]

  def decode_pieces(self, ids: Iterable[int] | np.ndarray) -> list[str]:
    """The text of each token of `ids` (joining to `decode(ids)`): a character whose bytes span
    several tokens appears whole at the token that completes it; ids outside the vocabulary get ""."""
    from tokenizers.decoders import DecodeStream

    flat = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
    stream = DecodeStream(skip_special_tokens=False)
    pieces, last = [], None
    for k, i in enumerate(flat):
      if 0 <= i < self.vocab_size:
        pieces.append(stream.step(self._tok, i) or "")
        last = k
      else:
        pieces.append("")
    if last is not None:  # an unfinished character at the end (U+FFFD), or a decoder's cleanup
      whole, joined = self.decode(flat), "".join(pieces)
      if whole != joined:
        if not whole.startswith(joined):
          return self._prefix_pieces(flat)
        pieces[last] += whole[len(joined) :]
    return pieces

  def _prefix_pieces(self, flat: list[int]) -> list[str]:
    """decode_pieces by decoding every prefix (for decoders whose stream is not a prefix)."""
    pieces, before = [], ""
    for k in range(len(flat)):
      now = self.decode(flat[: k + 1])
      common = len(os.path.commonprefix([before, now]))
      pieces.append(now[common:])
      before = now
    return pieces

  def token_to_id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise KeyError(f"{token!r} is not a token of {self.source}'s tokenizer")
    return i

  # ---- chat template ------------------------------------------------------------------------
  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      tokenize: bool = False,
      **kwargs,
  ) -> str | list[int]:
    """The checkpoint's chat template around `messages` (a list of {"role", "content", ...}), as
    transformers renders it (the special tokens by name, `kwargs` such as tools= passed through);
    `tokenize=True` -> the ids of AutoTokenizer's `apply_chat_template(..., tokenize=True)`."""
    if self.chat_template is None:
      raise ValueError(
          f"{self.source}: the tokenizer has no chat template ({CHAT_TEMPLATE_FILE} or {CONFIG_JSON}'s "
          "chat_template); use data.prompt_style='plain' (or --prompt_style plain) for this model"
      )
    if not messages:
      raise ValueError("apply_chat_template: messages is empty")
    chat = []
    for k, m in enumerate(messages):
      if not isinstance(m, Mapping):
        raise TypeError(f"messages[{k}]: expected a dict with 'role' and 'content', got {type(m).__name__}")
      chat.append({key: value for key, value in m.items() if value is not None})
    if self._template is None:
      self._template = compile_chat_template(self.chat_template)
    variables = {**self.special_tokens_map, **kwargs}
    text = self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
    return self.encode(text) if tokenize else text

  # ---- batches ------------------------------------------------------------------------------
  def batch_encode(self, texts: Sequence[str], bucket=DEFAULT_BUCKETS, max_length: int | None = None):
    """Encode and LEFT-pad: `(ids int32 [batch, width], mask int32 [batch, width])` (see
    `Tokenizer.batch_encode`)."""
    if isinstance(texts, str):
      raise TypeError("batch_encode expects a sequence of str, got a single str")
    return left_pad([self.encode(t) for t in texts], self.pad_id, bucket=bucket, max_length=max_length)

  # ---- files ----------------------------------------------------------------------------------
  def save(self, directory: str | os.PathLike) -> None:
    """Copy the tokenizer's files into `directory` (a workdir's `tokenizer/`, an export), with a
    generation_config.json of the stop ids when the folder had none (config.json's ids)."""
    src, out = epath.Path(self.source), epath.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
      if (src / name).exists():
        _write(out / name, (src / name).read_text())
    if not (src / GENERATION_CONFIG).exists() and self.model_eos_ids:
      _write(out / GENERATION_CONFIG, json.dumps({"eos_token_id": list(self.model_eos_ids)}, indent=2))


def _write(path: epath.Path, text: str) -> None:
  """Write a whole file: one object PUT in a bucket, a rename locally (never half a file)."""
  if storage.is_url(path):
    path.write_text(text)
    return
  tmp = path.parent / (path.name + ".tmp")
  tmp.write_text(text)
  tmp.replace(path)


def load_tokenizer(*directories: str | os.PathLike):
  """The tokenizer of a model folder or workdir, the first of `directories` (empty ones skipped)
  that has one: its task vocabulary (`task_vocab.json`, `model.vocab="task"`), else its
  `tokenizer.json` (a workdir: in `tokenizer/`), else the bundled Qwen2.5 `Tokenizer`."""
  dirs = [os.fspath(d) for d in directories if d]
  vocab = task_vocab.find(dirs)
  if vocab:
    return task_vocab.TaskTokenizer.load(vocab)
  for d in dirs:
    for folder in (epath.Path(d), epath.Path(d) / WORKDIR_SUBDIR):
      if has_tokenizer(folder):
        return HFTokenizer(folder)
  return Tokenizer()
