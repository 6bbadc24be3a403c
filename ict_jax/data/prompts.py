"""Prompt text for an example.

``chat``: Qwen2.5's chat template around one user message, the question followed by Qwen2.5-Math's
instruction ``Please reason step by step, and put your final answer within \\boxed{}.``
``plain``: the example's short ``prompt`` field as is (``"3+5="``), for tiny models with tiny context.

A ``prompt`` that is a list of chat messages (TRL's conversational format, ``data.name="files"``)
is the tokenizer's chat template around those messages with the generation prompt, in either
style (the messages are the whole prompt: no instruction is added). A string prompt of a file
(`files.FileExample`) is its ``prompt`` in either style, wrapped with the instruction for ``chat``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ict_jax.data.files import FileExample

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
STYLES = ("plain", "chat")  # data.prompt_style


class ChatTokenizer(Protocol):

  def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False) -> Any:
    ...


def format_prompt(
    question: str,
    tokenizer: ChatTokenizer,
    *,
    instruction: str = MATH_INSTRUCTION,
    system: str | None = None,
) -> str:
  """Chat prompt ending in ``<|im_start|>assistant\\n``; ``system=None`` keeps Qwen's default."""
  content = f"{question}\n{instruction}" if instruction else question
  messages = [{"role": "user", "content": content}]
  if system is not None:
    messages.insert(0, {"role": "system", "content": system})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_prompt(
    example: Mapping[str, Any],
    tokenizer: ChatTokenizer | None = None,
    *,
    style: str = "chat",
    instruction: str = MATH_INSTRUCTION,
    system: str | None = None,
) -> str:
  """Prompt text of a dataset example (a dict with ``question`` and ``prompt``; a file's example:
  with ``prompt``, a string or chat messages) in ``style``."""
  if style not in STYLES:
    raise ValueError(f"unknown prompt style {style!r}; expected one of {STYLES}")
  prompt = example.get("prompt")
  if isinstance(prompt, list):  # chat messages
    if tokenizer is None:
      raise ValueError("a prompt of chat messages needs a tokenizer with apply_chat_template")
    return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
  if style == "plain":
    return str(example["prompt"])
  if tokenizer is None:
    raise ValueError("prompt style 'chat' needs a tokenizer with apply_chat_template")
  question = example["prompt"] if isinstance(example, FileExample) else example["question"]
  return format_prompt(str(question), tokenizer, instruction=instruction, system=system)


class PromptError(ValueError):
  """An example whose prompt the tokenizer's chat template refuses (e.g. a role it has no turn for)."""


def _field_needed(example, style: str) -> str:
  if style == "plain" or isinstance(example, FileExample) or isinstance(example.get("prompt"), list):
    return "prompt"
  return "question"


def encode_prompts(
    examples,
    tokenizer,
    *,
    style: str,
    instruction: str = MATH_INSTRUCTION,
    max_len: int | None = None,
) -> tuple[list, list[str], list[list[int]]]:
  """-> (kept examples, their prompt texts, their token ids), the one prompt encoding of training,
  rollouts and evaluation. Prompts over ``max_len`` tokens are left out (the caller counts them);
  KeyError naming the example when a field the style needs is missing, PromptError naming it when
  the chat template refuses its messages."""
  kept, texts, ids = [], [], []
  for i, ex in enumerate(examples):
    for field in ("answer", _field_needed(ex, style)):
      if field not in ex:
        raise KeyError(f"example {i} has no {field!r} field (it has {sorted(ex)})")
    try:
      text = build_prompt(ex, tokenizer, style=style, instruction=instruction)
    except (ValueError, TypeError) as e:
      if not isinstance(ex.get("prompt"), list):
        raise
      raise PromptError(f"{ex.get('id', f'example {i}')}: the chat template refuses its messages ({e})") from None
    toks = tokenizer.encode(text)
    if max_len is None or len(toks) <= max_len:
      kept.append(ex)
      texts.append(text)
      ids.append(toks)
  return kept, texts, ids


class Subset:
  """Random access to the examples of `source` at `indices`, in that order."""

  def __init__(self, source, indices):
    self.source, self.indices = source, list(indices)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i: int):
    return self.source[self.indices[i]]


def drop_long_prompts(source, tokenizer, *, style: str, max_len: int, dataset: str = ""):
  """-> (the examples of `source` whose prompt fits `max_len` tokens, the ones left out).

  The prompts are formatted and tokenized as the rollouts do (`encode_prompts`), so a batch
  drawn from the result never loses a prompt to the length limit and the train step always gets
  prompts_per_step x group_size rows. Each example left out is logged with its id (for files the
  user supplied, `dataset/file:row`) and its token count, like the rows a build skips; returned
  as {"id", "tokens"} dicts. ValueError when no prompt fits."""
  from ict_jax.data.readers import MAX_WARNINGS_PER_FILE, logger

  examples = [source[i] for i in range(len(source))]
  _, _, encoded = encode_prompts(examples, tokenizer, style=style)  # every one, in order
  keep, dropped = [], []
  for i, (ex, ids) in enumerate(zip(examples, encoded)):
    if len(ids) <= max_len:
      keep.append(i)
      continue
    dropped.append({"id": str(ex.get("id", i)), "tokens": len(ids)})
    if len(dropped) <= MAX_WARNINGS_PER_FILE:
      logger.warning(
          "%s: leaving out %s: its prompt has %d tokens, over data.max_prompt_len=%d",
          dataset,
          dropped[-1]["id"],
          dropped[-1]["tokens"],
          max_len,
      )
  if not keep:
    raise ValueError(f"{dataset}: none of the {len(examples)} prompts fits data.max_prompt_len={max_len} tokens")
  if dropped:
    logger.warning(
        "%s: %d of %d prompts are over data.max_prompt_len=%d tokens and left out (%d kept)",
        dataset,
        len(dropped),
        len(examples),
        max_len,
        len(keep),
    )
  return (Subset(source, keep) if dropped else source), dropped
