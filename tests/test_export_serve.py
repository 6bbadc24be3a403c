"""`python -m ict_jax.export` writes a folder transformers serves: `AutoTokenizer.from_pretrained(out)`
gives the ids of the run's tokenizer (the bundled Qwen2.5 one, a task vocabulary) on text and chat,
generation_config.json holds its stop ids, and `AutoModelForCausalLM.from_pretrained(out)` computes
ict-jax's logits (bfloat16 by default, float32 on request) and generates."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ict_jax import config as config_lib  # noqa: E402
from ict_jax import configs, task_vocab  # noqa: E402
from ict_jax import inspect as ins  # noqa: E402
from ict_jax.checkpoint import Checkpointer  # noqa: E402
from ict_jax.export import main as export_main  # noqa: E402
from ict_jax.models.config import Qwen2Config  # noqa: E402
from ict_jax.models.qwen2 import init_model  # noqa: E402
from ict_jax.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "What is 3 + 5?",
    "  Hello, world!\n\n\tI'm here; don't   panic. 1234567",
    "数学问题：求 √2 的值。naïve café 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # 😀\r\n",
]
CHATS = [
    [{"role": "user", "content": "What is 3 + 5?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "数学 🙂"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]
TASK_TEXTS = ["3+1+4=", "3+1=4,4+4=8;\\boxed{8}", "1+4=5,3+5=8;\\boxed{8}", "8", "What is 3 + 1 + 4?"]


def _save_run(workdir, mcfg, cfg):
  params = nnx.to_pure_dict(nnx.state(init_model(mcfg, seed=3), nnx.Param))
  with Checkpointer(workdir, async_save=False) as ck:
    ck.save(1, {"state": {"params": params}}, {"data_position": 0, "config": config_lib.to_dict(cfg)}, force=True)


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
  """A checkpoint of the tiny preset on Qwen2.5's vocabulary (the bundled tokenizer)."""
  workdir = str(tmp_path_factory.mktemp("qwen_run"))
  _save_run(workdir, Qwen2Config.preset("tiny"), config_lib.validate(configs.tiny_config()))
  return workdir


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
  """A `model.vocab="task"` run: its task_vocab.json and a checkpoint with its 128 rows."""
  workdir = str(tmp_path_factory.mktemp("task_run"))
  tok = task_vocab.build(TASK_TEXTS)
  tok.save(workdir)
  mcfg = Qwen2Config.preset("tiny", vocab_size=task_vocab.model_vocab_size(tok.vocab_size))
  _save_run(workdir, mcfg, config_lib.validate(configs.chain_config()))
  return workdir, tok


def _ict_jax_logits(workdir, ids):
  with ins.open_checkpoint(workdir) as ckpt:
    model = ckpt.restore_model()
  return np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float32)


def _hf_logits(folder, ids, dtype=None):
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
  with torch.no_grad():
    return model, model(torch.tensor(ids)).logits.float().numpy()


def test_export_of_the_qwen_vocabulary_serves(qwen_run, tmp_path):
  out = str(tmp_path / "bf16")
  assert export_main(["--workdir", qwen_run, "--out", out]) == 0
  for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    assert os.path.isfile(os.path.join(out, name)), name
  ours, ref = Tokenizer(), transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS:
    ids = ours.encode(text)
    assert ref.encode(text) == ids and ref.decode(ids) == ours.decode(ids)
    assert ref.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
  for chat in CHATS:
    assert ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == ours.apply_chat_template(chat)
    want = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert list(ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)) == want
  generation = json.load(open(os.path.join(out, "generation_config.json")))
  assert generation["eos_token_id"] == list(ours.eos_ids) and ref.pad_token_id == ours.pad_id
  assert ref.eos_token_id == ours.im_end_id
  # bf16 by default: logits within bf16 rounding of ict-jax's float32 ones
  ids = np.asarray([ours.apply_chat_template(CHATS[0], tokenize=True)], np.int64)
  model, got = _hf_logits(out, ids)
  assert next(model.parameters()).dtype == torch.bfloat16
  want = _ict_jax_logits(qwen_run, ids)
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=0.05 * scale, rtol=0)
  assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99
  generated = model.generate(torch.tensor(ids), max_new_tokens=4, do_sample=False)
  assert generated.shape == (1, ids.shape[1] + 4) or int(generated[0, -1]) in ours.eos_ids


def test_float32_export_equals_ict_jax_and_generates_its_greedy_tokens(qwen_run, tmp_path):
  import jax

  from ict_jax import sampling

  out = str(tmp_path / "f32")
  assert export_main(["--workdir", qwen_run, "--out", out, "--dtype", "float32"]) == 0
  tok = Tokenizer()
  prompt = tok.apply_chat_template(CHATS[2], tokenize=True)
  ids = np.asarray([prompt], np.int64)
  model, got = _hf_logits(out, ids, dtype=torch.float32)
  np.testing.assert_allclose(got, _ict_jax_logits(qwen_run, ids), atol=2e-4, rtol=1e-4)
  # greedy decoding: transformers' generate and ict-jax's sampler take the same tokens
  with ins.open_checkpoint(qwen_run) as ckpt:
    ours = ckpt.restore_model()
  new = 5
  hf_out = model.generate(
      torch.tensor(ids), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_id
  )
  c_ids, _, _ = sampling.generate(
      ours,
      jnp.asarray(ids, jnp.int32),
      jnp.ones(ids.shape, jnp.int32),
      rng=jax.random.key(0),
      max_new_tokens=new,
      temperature=0.0,
      top_p=1.0,
      top_k=0,
      eos_token_ids=(),
      pad_id=tok.pad_id,
  )
  assert hf_out[0, ids.shape[1] :].tolist() == np.asarray(c_ids)[0].tolist()


def test_export_of_a_task_vocabulary_serves_its_ids(task_run, tmp_path):
  workdir, tok = task_run
  out = str(tmp_path / "task")
  assert export_main(["--workdir", workdir, "--out", out, "--dtype", "float32"]) == 0
  ref = transformers.AutoTokenizer.from_pretrained(out)
  for text in TASK_TEXTS + ["4+4=8<|endoftext|>", "3+1=4<|im_end|>"]:
    ids = tok.encode(text)
    assert ref.encode(text) == ids and ref.decode(ids) == tok.decode(ids)
  chat_ids = [tok.im_start_id, *tok.encode("3+1+4="), tok.im_end_id]
  assert ref.encode("<|im_start|>3+1+4=<|im_end|>") == chat_ids
  config = json.load(open(os.path.join(out, "config.json")))
  generation = json.load(open(os.path.join(out, "generation_config.json")))
  assert config["vocab_size"] == 128 and generation["eos_token_id"] == list(tok.eos_ids)
  assert config["eos_token_id"] == tok.pad_id < 128 and ref.pad_token_id == tok.pad_id
  assert open(os.path.join(out, task_vocab.FILENAME)).read() == open(os.path.join(workdir, task_vocab.FILENAME)).read()
  ids = np.asarray([tok.encode("3+1+4=")], np.int64)
  model, got = _hf_logits(out, ids, dtype=torch.float32)
  np.testing.assert_allclose(got, _ict_jax_logits(workdir, ids), atol=2e-4, rtol=1e-4)
  assert model.generate(torch.tensor(ids), max_new_tokens=3, do_sample=False).shape[1] <= ids.shape[1] + 3
