"""A model by Hugging Face hub id, offline: `model.path`, `--init_from_hf`, `load_pretrained` and
`ict_jax.eval --hf` resolve `org/name` from a hub cache the test writes (a tiny Qwen2 saved by
transformers with its own byte-level BPE tokenizer and a chat template unlike Qwen's, in the
`models--org--name/snapshots/<rev>` layout; HF_HUB_OFFLINE=1 from conftest), and the checkpoint's
tokenizer gives transformers' `AutoTokenizer` ids on texts and chats."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ict_jax import configs  # noqa: E402
from ict_jax.data.prompts import MATH_INSTRUCTION  # noqa: E402
from ict_jax.hf_tokenizer import HFTokenizer, load_tokenizer  # noqa: E402
from ict_jax.models.hf import resolve_model_dir  # noqa: E402

REPO_ID = "org/tiny"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
# Not Qwen's: a BOS, upper-case roles, a trimmed system prompt, no default system turn.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ '<|im_start|>SYSTEM: ' + m['content'] | trim }}{% else %}"
    "{{ '<|im_start|>' + m['role'] | upper + ': ' + m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>ASSISTANT: ' }}{% endif %}"
)
CORPUS = [f"What is {a} + {b}?\n{MATH_INSTRUCTION}" for a in range(10) for b in range(10)] + [
    f"{a}+{b}={a + b}" for a in range(10) for b in range(10)
]
TEXTS = ["What is 3 + 5?", "  2+2=4\n\nso", "naïve café: 数学 🙂", "<|im_start|>user: hi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is 3 + 5?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "数学 🙂"},
    ],
]


def _tiny_tokenizer():
  """A byte-level BPE of ~400 tokens with Qwen2's normaliser and pre-tokenizer (transformers 5
  rebuilds a qwen2 checkpoint's tokenizer with them from the vocabulary and merges)."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  from ict_jax.tokenizer import PRETOKENIZE_REGEX

  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
  )
  tok.train_from_iterator(CORPUS, trainer)
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
  )


def write_hub_model(cache, repo_id=REPO_ID, template_in_config=False) -> str:
  """A tiny Qwen2 + its tokenizer in the hub cache layout; -> its snapshot folder."""
  snapshot = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots", REVISION)
  tok = _tiny_tokenizer()
  tok.save_pretrained(snapshot)
  if template_in_config:  # the older layout: the template inside tokenizer_config.json
    os.remove(os.path.join(snapshot, "chat_template.jinja"))
    config_path = os.path.join(snapshot, "tokenizer_config.json")
    config = json.load(open(config_path))
    json.dump({**config, "chat_template": TEMPLATE}, open(config_path, "w"))
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(
      transformers.Qwen2Config(
          vocab_size=512,
          hidden_size=16,
          intermediate_size=32,
          num_hidden_layers=2,
          num_attention_heads=2,
          num_key_value_heads=1,
          tie_word_embeddings=True,
          max_position_embeddings=512,
          bos_token_id=tok.convert_tokens_to_ids("<s>"),
          eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
      )
  )
  model.save_pretrained(snapshot)
  refs = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "refs")
  os.makedirs(refs, exist_ok=True)
  with open(os.path.join(refs, "main"), "w") as f:
    f.write(REVISION)
  return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("hub"))
  write_hub_model(cache)
  write_hub_model(cache, "org/tiny-config-template", template_in_config=True)
  return cache


@pytest.fixture
def hub(hub_cache, monkeypatch):
  """The test's hub cache as huggingface_hub's (in this process and in subprocesses)."""
  from huggingface_hub import constants

  assert constants.HF_HUB_OFFLINE  # conftest: nothing downloads
  monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
  monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
  return hub_cache


def test_resolve_model_dir(hub, tmp_path):
  snapshot = resolve_model_dir(REPO_ID)
  assert snapshot == os.path.join(hub, "models--org--tiny", "snapshots", REVISION)
  assert resolve_model_dir(snapshot) == snapshot and resolve_model_dir("") == ""
  with pytest.raises(FileNotFoundError) as e:
    resolve_model_dir("org/missing")
  message = str(e.value)
  assert "org/missing" in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message
  with pytest.raises(FileNotFoundError, match="not a directory"):
    resolve_model_dir(str(tmp_path / "nope" / "x"))


@pytest.mark.parametrize("repo_id", [REPO_ID, "org/tiny-config-template"])
def test_checkpoint_tokenizer_ids_equal_autotokenizer(hub, repo_id):
  folder = resolve_model_dir(repo_id)
  ours, ref = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
  assert isinstance(ours, HFTokenizer)
  for text in TEXTS + CORPUS[:3]:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids)
    assert "".join(ours.decode_pieces(ids)) == ours.decode(ids)
  for chat in CHATS:
    for gen in (True, False):
      text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
      assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
      want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
      assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == list(want)
  assert text.startswith("<s><|im_start|>USER: ")  # the checkpoint's template, not Qwen's
  # the stop ids: generation_config.json's eos_token_id, then the tokenizer's eos_token
  generation = json.load(open(os.path.join(folder, "generation_config.json")))
  assert ours.eos_ids[0] == generation["eos_token_id"] == ref.eos_token_id
  assert ours.pad_id == ref.pad_token_id and ours.vocab_size == len(ref)
  # padding rows of the embedding (>= the vocabulary) decode to nothing; pieces of a split character
  ids = ours.encode("é🙂")
  assert ours.decode(ids + [500, 511]) == "é🙂" and ours.decode_pieces(ids + [500])[-1] == ""
  pieces = ours.decode_pieces(ids)
  assert "".join(pieces) == "é🙂" and len(pieces) == len(ids) and all("\ufffd" not in p for p in pieces)
  batch, mask = ours.batch_encode(["2+2", "What is 3 + 5?"], bucket=None)
  assert batch[0, 0] == ours.pad_id and mask.sum(1).tolist() == [len(ours.encode(t)) for t in ("2+2", "What is 3 + 5?")]


def test_load_pretrained_by_hub_id_equals_transformers(hub):
  import jax.numpy as jnp

  from ict_jax import load_pretrained

  folder = resolve_model_dir(REPO_ID)
  ids = np.asarray([HFTokenizer(folder).encode("What is 3 + 5?")], np.int64)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    want = hf(torch.tensor(ids)).logits.numpy()
  got = np.asarray(load_pretrained(REPO_ID)(jnp.asarray(ids, jnp.int32)))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def _hub_run_config(**overrides):
  c = configs.tiny_config()
  c.model.path = REPO_ID
  c.data.prompt_style, c.data.max_prompt_len = "chat", 64
  c.warm_start.sft_steps = 0
  c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens = 4, 4, 3
  c.train.steps, c.train.checkpoint_every, c.train.eval_every = 1, 1, 0
  c.train.async_checkpointing = False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  return c


@pytest.fixture
def hub_run(hub, tmp_path):
  """One step from `model.path=org/tiny` (chat prompts) -> workdir."""
  from ict_jax.train import train

  workdir = str(tmp_path / "run")
  out = train(_hub_run_config(), workdir, progress=False)
  assert [r["step"] for r in out] == [1] and np.isfinite(out[0]["loss"])
  return workdir


def test_train_one_step_from_a_hub_id(hub_run):
  from ict_jax.build import load_examples
  from ict_jax import config as config_lib
  from ict_jax.logs import read_log

  ref = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(REPO_ID))
  cfg = config_lib.validate(_hub_run_config())
  src = load_examples(cfg, cfg.data.train_split, hub_run)
  rendered = {
      ref.apply_chat_template(
          [{"role": "user", "content": f"{src[i]['question']}\n{MATH_INSTRUCTION}"}],
          add_generation_prompt=True,
          tokenize=False,
      )
      for i in range(len(src))
  }
  samples = read_log(hub_run, "samples")
  assert samples and all(s["prompt"] in rendered for s in samples)  # the checkpoint's chat template
  # the run keeps the checkpoint's tokenizer: a resume, eval and export read it from the workdir
  assert isinstance(load_tokenizer(hub_run), HFTokenizer)
  from ict_jax import setup

  resumed = setup.make_tokenizer(config_lib.validate(_hub_run_config(**{"model.path": ""})), hub_run, "", None)
  assert isinstance(resumed, HFTokenizer) and resumed.source == os.path.join(hub_run, "tokenizer")
  assert resumed.apply_chat_template(CHATS[1], tokenize=True) == list(
      ref.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=True, return_dict=False)
  )
  assert (
      open(os.path.join(hub_run, "tokenizer", "tokenizer.json")).read()
      == open(os.path.join(resolve_model_dir(REPO_ID), "tokenizer.json")).read()
  )


def test_export_of_a_hub_run_carries_its_tokenizer(hub_run, tmp_path):
  from ict_jax.export import main as export_main

  out = str(tmp_path / "export")
  assert export_main(["--workdir", hub_run, "--out", out]) == 0
  exported, ref = (transformers.AutoTokenizer.from_pretrained(d) for d in (out, resolve_model_dir(REPO_ID)))
  for chat in CHATS:
    want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(
        exported.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    ) == list(want)
  assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == ref.eos_token_id
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert next(model.parameters()).dtype == torch.bfloat16  # the export's default
  ids = torch.tensor([exported.encode("What is 3 + 5?", add_special_tokens=False)])
  assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] <= ids.shape[1] + 3


def test_missing_hub_id_is_one_config_error(hub, tmp_path):
  from ict_jax.config import ConfigError
  from ict_jax.train import train

  with pytest.raises(ConfigError) as e:
    train(_hub_run_config(**{"model.path": "org/missing"}), str(tmp_path / "w"), progress=False)
  assert str(e.value).startswith("config.model.path: org/missing") and "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="^--init_from_hf: org/nothere"):
    train(_hub_run_config(), str(tmp_path / "w2"), init_from_hf="org/nothere", progress=False)


def test_init_from_hf_hub_id_and_eval_hf_hub_id(hub, tmp_path, monkeypatch):
  from test_eval import write_benchmark_files

  from ict_jax.eval.__main__ import main as eval_main
  from ict_jax.train import train

  out = train(_hub_run_config(**{"model.path": ""}), str(tmp_path / "w"), init_from_hf=REPO_ID, progress=False)
  assert [r["step"] for r in out] == [1]
  monkeypatch.chdir(tmp_path)  # a hub id's results go to ./eval/org--tiny
  write_benchmark_files(tmp_path / "files")
  argv = ["--hf", REPO_ID, "--benchmarks", "gsm8k", "--k", "1", "--n", "1", "--max_new_tokens", "2"]
  argv += ["--manual_dir", str(tmp_path / "files"), "--dtype", "float32", "--reward_workers", "0", "--no_progress"]
  results = eval_main(argv)
  assert results["model"] == REPO_ID
  samples = [json.loads(l) for l in open(tmp_path / "eval" / "org--tiny" / "samples_gsm8k.jsonl")]
  ref = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(REPO_ID))
  questions = [json.loads(l)["question"] for l in open(tmp_path / "files" / "gsm8k" / "test.jsonl")]
  want = {
      ref.apply_chat_template(
          [{"role": "user", "content": f"{q}\n{MATH_INSTRUCTION}"}], add_generation_prompt=True, tokenize=False
      )
      for q in questions
  }
  assert {s["prompt"] for s in samples} == want  # the checkpoint's chat template
  with pytest.raises(SystemExit) as e:
    eval_main(["--hf", "org/missing", "--benchmarks", "gsm8k", "--manual_dir", str(tmp_path / "files")])
  assert e.value.code == 2
