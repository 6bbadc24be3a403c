"""The task vocabulary (`model.vocab="task"`): compact ids that encode and decode exactly as the
full Qwen2.5 tokenizer does, saved with the run, carried by export, read by resume, eval and
`--init_from_hf`; and TRL's mask_truncated_completions."""

import json
import os

import numpy as np
import pytest

from ict_jax import config as config_lib
from ict_jax import configs
from ict_jax import task_vocab
from ict_jax.logs import read_log
from ict_jax.tokenizer import Tokenizer
from ict_jax.train import train

TEXTS = ["3+1+4=", "3+1=4,4+4=8;\\boxed{8}", "1+4=5,3+5=8;\\boxed{8}", "8", "What is 3 + 1 + 4?"]


@pytest.fixture(scope="module")
def full():
  return Tokenizer()


@pytest.fixture(scope="module")
def tok():
  return task_vocab.build(TEXTS)


def test_compact_ids_encode_and_decode_as_qwen(tok, full):
  kept = sorted({i for t in TEXTS for i in full.encode(t)} | {151643, 151644, 151645})
  assert tok.qwen_ids.tolist() == kept and tok.vocab_size == len(kept)
  for text in TEXTS + ["4+4=8<|endoftext|>"]:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.to_qwen(ids).tolist() == full.encode(text)  # same BPE split, ids renamed
    assert tok.decode(ids) == text == full.decode(full.encode(text))
    assert "".join(tok.decode_pieces(ids)) == text
    assert tok.decode_pieces(ids) == full.decode_pieces(full.encode(text))
  assert tok.to_qwen([tok.pad_id, *tok.eos_ids]).tolist() == [151643, 151645, 151643]
  assert tok.decode(tok.encode("8<|endoftext|>"), skip_special_tokens=True) == "8"
  # padding rows of the embedding (>= vocab_size) decode to nothing, as Qwen2.5's do
  assert tok.decode([*tok.encode("8"), tok.vocab_size, 127]) == "8"
  assert tok.decode_batch([tok.encode("8"), tok.encode("4+4")]) == ["8", "4+4"]


def test_text_outside_the_vocabulary_is_a_clear_error(tok):
  with pytest.raises(ValueError, match=r"'7'.*does not keep.*model.vocab='qwen'"):
    tok.encode("7")


def test_save_load_and_bad_files(tok, tmp_path):
  path = tok.save(tmp_path)
  assert path == os.path.join(tmp_path, task_vocab.FILENAME)
  again = task_vocab.TaskTokenizer.load(path)
  assert again.qwen_ids.tolist() == tok.qwen_ids.tolist() and again.encode(TEXTS[1]) == tok.encode(TEXTS[1])
  assert isinstance(task_vocab.load_tokenizer("", str(tmp_path)), task_vocab.TaskTokenizer)
  assert type(task_vocab.load_tokenizer(str(tmp_path / "none"))) is Tokenizer
  bad = tmp_path / "bad"
  bad.mkdir()
  for text, needle in [
      ("{", "not valid JSON"),
      ('{"format": "x"}', "format"),
      (json.dumps({"format": task_vocab.FORMAT, "qwen_ids": ["3"]}), "'qwen_ids' must be a list of ints"),
      (json.dumps({"format": task_vocab.FORMAT, "qwen_ids": [1, 2]}), "must keep"),
      (json.dumps({"format": task_vocab.FORMAT, "qwen_ids": [151643, 151644, 151645, 10**7]}), "outside"),
  ]:
    (bad / task_vocab.FILENAME).write_text(text)
    with pytest.raises(ValueError, match=needle) as e:
      task_vocab.TaskTokenizer.load(bad / task_vocab.FILENAME)
    assert str(bad / task_vocab.FILENAME) in str(e.value)


def test_model_vocab_size_pads_to_128():
  assert [task_vocab.model_vocab_size(n) for n in (1, 20, 128, 129)] == [128, 128, 128, 256]


def _chain(**overrides):
  c = configs.chain_config()
  c.warm_start.sft_steps = 20
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
  c.train.steps, c.train.checkpoint_every, c.train.eval_every = 2, 2, 0
  c.train.async_checkpointing = False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(getattr(c, section), name, value)
  return c


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("task_vocab") / "run")
  return workdir, train(_chain(), workdir, progress=False)


def test_run_saves_its_vocabulary_and_a_128_row_model(chain_run, full):
  from ict_jax import inspect as ci

  workdir, rows = chain_run
  tok = task_vocab.TaskTokenizer.load(os.path.join(workdir, task_vocab.FILENAME))
  # exactly the Qwen2.5 ids of level 1's prompts, answers and worked solutions, plus the chat ids
  from ict_jax.data import chain

  texts = []
  for operands, ops in chain.level_problems(1):
    ex = chain.make_example(operands, ops, 1)
    texts += [ex["prompt"], ex["answer"], *ex["solutions"].split("\n")]
  expected = {i for t in texts for i in full.encode(t)} | {151643, 151644, 151645}
  assert tok.qwen_ids.tolist() == sorted(expected)
  assert tok.vocab_size < 40
  with ci.open_checkpoint(workdir) as ckpt:
    assert ckpt.tensors()["embed/embedding"].shape[0] == 128
    assert ckpt.model_config.rope_theta == 10000.0  # the tiny preset's, not a Qwen default
    # the model of the saved run is the trainer's: its config and task_vocab.json through setup.model_config
    from ict_jax import setup

    run_model = setup.model_config(config_lib.validate(_chain()), "", None, tok)
    assert setup.model_config_from_checkpoint(workdir) == run_model == ckpt.model_config
  assert [r["step"] for r in rows] == [1, 2]
  samples = read_log(workdir, "samples")
  assert all(isinstance(s["completion"], str) for s in samples)
  assert any("=" in s["completion"] for s in samples)  # decoded through the task vocabulary


def test_resume_export_eval_and_init_from_hf_use_the_vocabulary(chain_run, tmp_path):
  from ict_jax.eval import loading
  from ict_jax.export import main as export_main

  workdir, rows = chain_run
  resumed = train(_chain(**{"train.steps": 3}), workdir, progress=False)
  assert [r["step"] for r in resumed] == [3]
  hf = str(tmp_path / "hf")
  assert export_main(["--workdir", workdir, "--out", hf]) == 0
  assert json.load(open(os.path.join(hf, "config.json")))["vocab_size"] == 128
  assert open(os.path.join(hf, task_vocab.FILENAME)).read() == open(os.path.join(workdir, task_vocab.FILENAME)).read()
  loaded, _ = loading.load_workdir(workdir)
  assert loaded.model.cfg.vocab_size == 128
  # a new run from the exported folder takes the folder's tokenizer, whatever model.vocab says
  again = str(tmp_path / "again")
  out = train(_chain(**{"model.vocab": "qwen", "warm_start.sft_steps": 0}), again, init_from_hf=hf, progress=False)
  assert len(out) == 2 and os.path.exists(os.path.join(again, task_vocab.FILENAME))


def test_task_vocab_needs_a_model_trained_here(tmp_path):
  from ict_jax.config import ConfigError
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.hf import save_pretrained
  from ict_jax.models.qwen2 import Qwen2

  import jax
  from flax import nnx

  hf = str(tmp_path / "qwen")
  save_pretrained(Qwen2(Qwen2Config.preset("tiny"), rngs=nnx.Rngs(jax.random.key(0))), hf)
  with pytest.raises(ConfigError, match="model.vocab='task'.*has no task_vocab.json"):
    train(_chain(), str(tmp_path / "w"), init_from_hf=hf, progress=False)


def test_truncated_completions_masked_as_trl_or_rescored():
  """TRL's mask_truncated_completions: `completion_mask * (~truncated)`, truncated = no EOS among
  the completion's tokens; the rewards and advantages are left as they are. score_truncated=False:
  the truncated rows get truncated_reward (and the group advantages follow), the mask is kept.
  Either way the verifier's scores of the truncated and the stopped rows are reported apart."""
  import jax

  from ict_jax.data.iterator import PromptIterator
  from ict_jax.models.config import Qwen2Config
  from ict_jax.models.qwen2 import Qwen2
  from ict_jax.rewards.pool import RewardPool
  from ict_jax.rollout import Collector, Sampling, Scoring

  from flax import nnx

  tok = task_vocab.build(["1+2=3;\\boxed{3}"])
  model = Qwen2(Qwen2Config.preset("tiny", vocab_size=128), rngs=nnx.Rngs(jax.random.key(0)))
  examples = [{"prompt": "1+2=", "answer": "3"}] * 4
  kw = dict(group_size=4, prompt_style="plain", max_prompt_len=16)
  sampling = Sampling(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)
  collector = lambda **scoring: Collector(tok, sampling, Scoring(reward_kind="answer", **scoring), **kw)
  with RewardPool(num_workers=0) as pool:
    rolls = [collector(mask_truncated=m).collect(model, examples, pool, rng=jax.random.key(3)) for m in (False, True)]
    penalised = collector(score_truncated=False, truncated_reward=-0.5).collect(
        model, examples, pool, rng=jax.random.key(3)
    )
  ids, mask = np.asarray(rolls[0].completion_ids), np.asarray(rolls[0].completion_mask)
  truncated = ~((mask > 0) & np.isin(ids, tok.eos_ids)).any(axis=1)
  assert 0 < truncated.sum() < len(truncated)  # random weights over 128 rows: some stop, some run on
  assert rolls[0].stats["truncated_rate"] == rolls[1].stats["truncated_rate"] == truncated.mean()
  np.testing.assert_array_equal(np.asarray(rolls[1].completion_mask), mask * ~truncated[:, None])
  np.testing.assert_array_equal(rolls[1].rewards, rolls[0].rewards)
  np.testing.assert_array_equal(rolls[1].advantages, rolls[0].advantages)
  assert rolls[1].stats["response_len"] == rolls[0].stats["response_len"]  # lengths as sampled
  scores = rolls[0].rewards  # the verifier's
  for roll in (*rolls, penalised):
    assert roll.stats["reward_truncated"] == pytest.approx(scores[truncated].mean())
    assert roll.stats["reward_complete"] == pytest.approx(scores[~truncated].mean())
  np.testing.assert_array_equal(penalised.rewards, np.where(truncated, -0.5, scores))
  g = penalised.rewards.reshape(-1, 4)
  want = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)
  np.testing.assert_allclose(penalised.advantages, want.reshape(-1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(penalised.completion_mask), mask)
  assert penalised.stats["reward_mean"] == pytest.approx(penalised.rewards.mean())
