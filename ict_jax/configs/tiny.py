"""The embedded CPU default, `chain_config()`: `python -m ict_jax.train` with no --config loads this
file (`cli_config.parse`), configs/tiny.py imports it."""

import ml_collections

from ict_jax.configs.tiny_arith import tiny_config


def chain_config() -> ml_collections.ConfigDict:
  """The embedded default (`python -m ict_jax.train` with no flags): the tiny
  model over the task vocabulary (the ~30 tokens of the task's text, ict_jax/task_vocab.py) on
  `synthetic_chain` level 1 ("3+1+4=" -> "3+1=4,4+4=8;\\boxed{8}", rewarded on the boxed answer):
  200 warm-start steps on the worked solutions, then 800 ICT steps of 16 prompts x 8 (top 30% of
  each response's tokens), a truncated completion scoring 0, with pass@1 / pass@4 on the 25
  held-out problems every 100 steps. Eight seeds on an AMD EPYC box: the reward rose +0.24..+0.42
  between the first and last fifth of the steps, ~2.5 minutes a run on 2 cores
  (benchmarks/RESULTS.md, "The default run on AMD EPYC")."""
  c = tiny_config()
  c.data.name, c.data.config = "synthetic_chain", "level1"
  # 128 embedding rows instead of 151,936: the full vocabulary's LM head was ~all of a step's
  # FLOPs, so a step is ~30x cheaper and the 6 minutes hold 400 RL steps instead of ~40, which
  # is what this task's slow, steady rise needs (with the full vocabulary: +0.02..+0.07 in 40 steps)
  c.model.vocab = "task"
  c.rollout.prompts_per_step, c.rollout.max_new_tokens = 16, 20
  c.ict.chunk_size = 20
  # lr 3e-4 with the paper's 10 dense warm-up steps: 1e-4 rose +0.09 in 400 steps, 1e-3 collapsed
  # (seed 0); 16 prompts a step rise more steadily than 8
  c.optim.learning_rate, c.ict.warmup_steps = 3e-4, 10
  # ICT keeps the top 30% of each response's tokens by JS, not the paper's 10%: a response here is
  # ~17 tokens, so 10% is two, and at lr 3e-4 those sparse updates broke the policy on some seeds
  # (entropy 0.5 -> 0.7, stuttering past the box; 1 of 5 RL seeds on Sapphire Rapids, seed 0 on AMD
  # EPYC at step ~180), where 30% was stable on every seed tried (benchmarks/RESULTS.md)
  c.ict.top_fraction = 0.3
  # A completion that runs past the box to the 20-token limit ("\\boxed{7}1}1=") scores 0 and is
  # trained on: its run-on tokens get a negative advantage whenever a group-mate stops. Scored by
  # the verifier, a truncated success was reinforced like a finished one and the responses learned
  # to run on; masked out of the loss (TRL's mask_truncated_completions, the earlier default), its
  # reward still raised its group's mean, so the advantages of the trained (finished) completions
  # summed below 0, pushing their tokens, the stop token among them, down on balance (our reading):
  # on an AMD EPYC box seed 0 ended with every completion truncated and no token trained
  # (benchmarks/RESULTS.md, "The default run on AMD EPYC")
  c.reward.score_truncated, c.reward.truncated_reward = False, 0.0
  c.loss.mask_truncated_completions = False
  # warm-start lr 3e-3, 200 steps of 16 worked solutions: RL starts at a T=1 reward of ~0.4-0.55
  # (AMD EPYC, seeds 1, 3); after 300 steps some seeds started at 0.7 and had little left to gain
  c.warm_start.sft_steps, c.warm_start.sft_batch_size, c.warm_start.sft_learning_rate = 200, 16, 3e-3
  c.train.steps, c.train.checkpoint_every = 800, 100
  c.train.eval_every, c.train.eval_prompts = 100, 25
  return c


get_config = chain_config
