"""Host work overlapped with the devices: rewards scored while the next decode sub-batch runs,
a step's metrics in one device-to-host transfer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ict_jax import grpo, rollout, task_vocab
from ict_jax.data.prompts import encode_prompts
from ict_jax.models.config import Qwen2Config
from ict_jax.models.qwen2 import Qwen2
from ict_jax.rewards import REWARDS, RewardPool
from ict_jax.sampling import bucket_length, generate, host
from ict_jax.tokenizer import left_pad


def parity(completion, gold):
  """A reward that varies with the text (random weights never produce the right answer)."""
  return float((len(completion) + int(gold)) % 2)


class RecordingPool:
  """A RewardPool that notes each submission in `events`."""

  def __init__(self, pool, events):
    self.pool, self.events = pool, events

  def submit(self, kind, texts, golds):
    self.events.append("score")
    return self.pool.submit(kind, texts, golds)


def test_rewards_of_sub_batch_j_are_scored_while_j_plus_1_decodes(monkeypatch):
  """8 decode sub-batches of 2 rows (half a group: each prompt prefilled twice): each is launched before the previous one's tokens are fetched, and
  handed to the reward pool before the next one's are; the tokens are `generate`'s (one program
  over all the sub-batches) and the rewards and advantages those of scoring after all decoding."""
  tok = task_vocab.build(["1+2=3;\\boxed{3}"])
  model = Qwen2(Qwen2Config.preset("tiny", vocab_size=128), rngs=nnx.Rngs(jax.random.key(0)))
  examples = [{"prompt": p, "answer": a} for p, a in (("1+2=", "3"), ("2+1=", "3"), ("1+1=", "2"), ("3=", "3"))]
  kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)
  events = []
  launch, fetch = host._generate_jit, rollout.local_rows
  monkeypatch.setattr(host, "_generate_jit", lambda *a, **k: (events.append("launch"), launch(*a, **k))[1])
  monkeypatch.setattr(rollout, "local_rows", lambda x: (events.append("fetch"), fetch(x))[1])
  with RewardPool(num_workers=0, rewards=dict(REWARDS, parity=parity)) as pool:
    collector = rollout.Collector(
        tok, rollout.Sampling(**kw), rollout.Scoring(reward_kind="parity", format_weight=0.5), group_size=4,
        prompt_style="plain", max_prompt_len=16, decode_batch_size=2,
    )  # fmt: skip
    roll = collector.collect(model, examples, RecordingPool(pool, events), rng=jax.random.key(3))
    monkeypatch.undo()
    one = ["fetch", "fetch", "score", "score"]  # its ids and mask fetched, its reward and format score submitted
    assert events == ["launch"] + [e for j in range(8) for e in ["launch"] * (j < 7) + one]

    _, _, tokens = encode_prompts(examples, tok, style="plain", max_len=16)
    ids, mask = left_pad(tokens, tok.pad_id, bucket=(bucket_length(max(map(len, tokens))),))
    c_ids, c_mask = generate(
        model, ids, mask, rng=jax.random.key(3), eos_token_ids=tok.eos_ids, pad_id=tok.pad_id, num_samples=4,
        return_logprobs=False, decode_batch_size=2, **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(roll.completion_ids), np.asarray(c_ids))
    np.testing.assert_array_equal(np.asarray(roll.completion_mask), np.asarray(c_mask))
    texts = rollout.decode_completions(tok, c_ids, c_mask, tok.eos_ids)
    golds = [ex["answer"] for ex in examples for _ in range(4)]
    want = pool.score_batch("parity", texts, golds)[0] + 0.5 * pool.score_batch("format", texts, golds)[0]
  assert want.min() < want.max()  # the rewards differ between rows: the row order is tested
  np.testing.assert_array_equal(roll.rewards, want)
  np.testing.assert_array_equal(roll.advantages, np.asarray(grpo.group_advantages(jnp.asarray(want), 4)))
  assert roll.completions == texts and roll.rows.tolist() == list(range(16)) and roll.golds == golds


def test_a_steps_metrics_come_back_in_one_transfer(monkeypatch):
  """`learner.fetch_metrics`: one jax.device_get of the whole tree (the loop read each metric with
  its own blocking read before), replicated metrics of the 8-device mesh and a host number alike,
  and no other read (the guard raises on an implicit transfer where the platform has them)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ict_jax import learner, sharding

  mesh = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
  x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("data")))
  step = jax.jit(
      lambda x: {"loss": x.sum(), "max": x.max(), "count": (x > 2).sum()}, out_shardings=NamedSharding(mesh, P())
  )
  metrics = step(x)
  calls, device_get = [], jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda tree: (calls.append(tree), device_get(tree))[1])
  with jax.transfer_guard_device_to_host("disallow"):
    got = learner.fetch_metrics({**metrics, "learning_rate": 0.5})
  assert len(calls) == 1
  assert got == {"loss": 28.0, "max": 7.0, "count": 5.0, "learning_rate": 0.5}
  assert all(type(v) is float for v in got.values())
