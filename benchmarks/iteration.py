"""Whole GRPO iterations: ict-jax (rollout + rewards + jitted step) vs TRL's `GRPOTrainer`.

One iteration = sample G completions for each of the prompts, score them, compute group
advantages, one optimizer step (AdamW, lr 1e-6, grad clip 1.0, beta 0, one pass). Both sides use
the same random weights (transformers' init, seeded, `save_pretrained`; ours loads them with
`ict_jax.load_pretrained`), the same prompts and the same tokenizer.

Model: the "bench" preset (vocab 151936, hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 704,
tied head), float32. 8 prompts of 32 tokens, 8 generations each, 64 new tokens, temperature 1,
no top-k / top-p. EOS is unreachable on both sides, so every completion has exactly 64 tokens:
ours gets `eos_token_ids=()`; TRL's tokenizer has EOS = PAD = id 151936, one past the model's
last logit (never sampled; no padding ever occurs since every prompt and completion has the same
length), and the model's `generation_config.eos_token_id` is cleared so TRL does not add
Qwen's 151643. Both sides count the completion tokens they got and the JSON reports them.

Tokenizer: a word-level `tokenizers.Tokenizer` whose vocabulary is "t0" .. "t{V-1}" (+ "<eos>"),
built in-process (no hub access); TRL gets it as a `PreTrainedTokenizerFast`, ours through a
four-method adapter. Reward (both): `len(completion text) / 1000`, negligible cost.

ict-jax: `ict_jax.rollout.Collector.collect` + `train_step.make_train_step` exactly as `ict_jax.train` calls
them, one CPU device, no mesh; `--method ict` (warm-up 0, so the ICT selection is live from the
first step) or `grpo` (dense); the step's LM head runs over `--chunk-size` (2) completion
positions at a time: [64, 2, V] float32 blocks of 128 rows (on this 2-core CPU, 2026-12-04 after
the row-blocked statistics: 7.0 s per step against 8.4 s with chunk 4 and 9.5 s with chunk 8).
TRL: `GRPOConfig(per_device_train_batch_size=P*G, num_generations=G, max_completion_length=64,
beta=0, loss_type="grpo", use_cpu=True, bf16=False, gradient_checkpointing=False)` (TRL's default is True; False makes TRL faster), iteration time
from a `TrainerCallback` (`on_step_begin` -> `on_step_end`; generation happens inside the step).

Each side runs in its own subprocess pinned to the first `--threads` CPUs (`sched_setaffinity`,
like `taskset`, before JAX / torch start their thread pools; torch also gets
`torch.set_num_threads`). `--warmup` iterations (default 1, they include compilation) run first
and are excluded; medians are over the next `--iterations`.

    python benchmarks/iteration.py [--iterations 5] [--warmup 1] [--method ict|grpo] [--threads 2]

Prints one JSON object: completion tokens/s of each side (tokens per iteration / median
iteration), the ratio ours / TRL, every iteration's seconds, our warm-up seconds and compile
estimate (warm-up minus the steady median: noisy on a loaded machine), our
split into sampling / rewards / step, TRL's generation seconds, settings and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "ITERATION_RESULT "
SMOKE_MODEL = dict(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


# ---- shared pieces (run inside each worker) ------------------------------------------------------
def _pin(threads: int) -> list[int]:
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) > threads:
    os.sched_setaffinity(0, cpus[:threads])
  return sorted(os.sched_getaffinity(0))


def word_tokenizer(vocab_size: int):
  """`tokenizers.Tokenizer`: "t{i}" <-> id i for i < vocab_size, "<eos>" = vocab_size."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {f"t{i}": i for i in range(vocab_size)}
  vocab["<eos>"] = vocab_size
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return tok


def prompt_texts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[str]:
  import numpy as np

  ids = np.random.RandomState(seed).randint(0, vocab_size, (n, length))
  return [" ".join(f"t{i}" for i in row) for row in ids]


def length_reward(completion: str, gold: object) -> float:
  """The benchmark's reward: text length / 1000 (trivial next to the model)."""
  return len(completion) / 1000.0


class _WordTokenizerAdapter:
  """What `ict_jax.rollout.Collector` needs of a tokenizer, over the word-level tokenizer."""

  def __init__(self, tok):
    self._tok = tok
    self.pad_id = 0  # never used: every prompt and completion has the full length
    self.eos_ids = ()  # EOS disabled

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, rows, skip_special_tokens: bool = False) -> list[str]:
    return self._tok.decode_batch([[int(i) for i in r] for r in rows], skip_special_tokens=skip_special_tokens)

  def decode_pieces(self, ids) -> list[str]:
    """Each token's text (the rollout's answer positions): the word-level decoder joins words with
    one space, so every piece but the last carries its trailing space and the pieces join to
    `decode(ids)`."""
    words = [self._tok.id_to_token(int(i)) or "" for i in ids]
    return [w + " " for w in words[:-1]] + words[-1:]


def _summary(times: list[float], warmup: int, tokens: int) -> dict:
  steady = times[warmup:]
  median = statistics.median(steady)
  return {
      "tokens_per_s": round(tokens / median, 1),
      "median_s": round(median, 4),
      "warmup_s": [round(t, 3) for t in times[:warmup]],
      "iteration_s": [round(t, 4) for t in steady],
  }


# ---- ict-jax ---------------------------------------------------------------------------------------
def run_ours(args) -> dict:
  cpus = _pin(args.threads)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import ict_jax
  from ict_jax import train_step as ts
  from ict_jax.config import IctConfig, LossConfig, OptimConfig
  from ict_jax.rewards.pool import RewardPool
  from ict_jax.rollout import Collector, Sampling, Scoring

  from ict_jax.setup import resolve_kernels

  # kernels "auto" as a run resolves it: the XLA:CPU formulations on one CPU device
  model = ict_jax.load_pretrained(args.model_dir, dtype=jnp.float32, kernels=resolve_kernels("auto"))
  vocab = model.cfg.vocab_size
  graphdef, _ = nnx.split(model)
  params = nnx.state(model, nnx.Param).to_pure_dict()
  del model
  optimizer = ts.make_optimizer(OptimConfig(learning_rate=1e-6, max_grad_norm=1.0), 1000)
  state = ts.init_train_state(params, optimizer)
  step_fn = ts.make_train_step(
      graphdef,
      ts.StepConfig(
          IctConfig(method=args.method, warmup_steps=0, chunk_size=args.chunk_size),
          LossConfig(loss_type="grpo", beta=0.0, epsilon_low=0.2, epsilon_high=0.2),
          group_size=args.generations,
          temperature=1.0,
      ),
      optimizer,
  )
  tok = _WordTokenizerAdapter(word_tokenizer(vocab))
  examples = [{"prompt": p, "answer": ""} for p in prompt_texts(args.prompts, args.prompt_len, vocab)]
  base_key = jax.random.key(0)
  collector = Collector(
      tok,
      Sampling(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0),
      Scoring(reward_kind="length"),
      group_size=args.generations,
      prompt_style="plain",
      max_prompt_len=args.prompt_len,
  )
  times, parts, tokens = [], [], []
  with RewardPool(num_workers=0, rewards={"length": length_reward}) as pool:
    for it in range(args.warmup + args.iterations):
      t0 = time.perf_counter()
      roll = collector.collect((graphdef, state.params), examples, pool, rng=jax.random.fold_in(base_key, it))
      t1 = time.perf_counter()
      state, metrics, _ = step_fn(state, roll.batch(), None)
      metrics = jax.device_get(metrics)
      t2 = time.perf_counter()
      if not np.isfinite(float(metrics["loss"])):
        raise RuntimeError(f"iteration {it}: non-finite loss {metrics['loss']}")
      times.append(t2 - t0)
      tokens.append(int(roll.stats["completion_tokens"]))
      parts.append(
          {
              "sample_s": roll.stats["sample_s"],
              "reward_s": roll.stats["reward_s"],
              "rollout_other_s": (t1 - t0) - roll.stats["sample_s"] - roll.stats["reward_s"],
              "step_s": t2 - t1,
          }
      )
  steady = parts[args.warmup :]
  out = _summary(times, args.warmup, args.prompts * args.generations * args.new_tokens)
  out.update(
      median_parts_s={k: round(statistics.median(p[k] for p in steady), 4) for k in steady[0]},
      warmup_parts_s=[{k: round(v, 3) for k, v in p.items()} for p in parts[: args.warmup]],
      compile_s=round(sum(times[: args.warmup]) - args.warmup * out["median_s"], 2),
      completion_tokens=tokens,
      cpus=cpus,
      method=args.method,
      jax=jax.__version__,
      devices=[str(d) for d in jax.devices()],
  )
  return out


# ---- TRL -------------------------------------------------------------------------------------------
def run_trl(args) -> dict:
  cpus = _pin(args.threads)
  import datasets
  import torch
  import transformers
  import trl
  from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  model = Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
  vocab = model.config.vocab_size
  model.generation_config.eos_token_id = None  # else TRL adds Qwen's 151643 to its EOS ids
  model.config.eos_token_id = None
  tokenizer = PreTrainedTokenizerFast(
      tokenizer_object=word_tokenizer(vocab), eos_token="<eos>", pad_token="<eos>", unk_token="<eos>"
  )
  assert tokenizer.eos_token_id == vocab, tokenizer.eos_token_id  # one past the last logit
  dataset = datasets.Dataset.from_dict({"prompt": prompt_texts(args.prompts, args.prompt_len, vocab)})
  seen = {"completion_tokens": [], "prompt_tokens": set()}

  def reward(prompts, completions, completion_ids, **kwargs):
    seen["completion_tokens"].append(sum(len(c) for c in completion_ids))
    seen["prompt_tokens"].update(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    return [length_reward(c, None) for c in completions]

  class Timer(TrainerCallback):

    def __init__(self):
      self.times, self._t = [], 0.0

    def on_step_begin(self, args_, state, control, **kw):
      self._t = time.perf_counter()

    def on_step_end(self, args_, state, control, **kw):
      self.times.append(time.perf_counter() - self._t)

  steps = args.warmup + args.iterations
  with tempfile.TemporaryDirectory() as out_dir:
    config = trl.GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        gradient_accumulation_steps=1,
        num_iterations=1,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-6,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=steps + 1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        disable_tqdm=True,
        log_completions=False,
        seed=0,
        dataloader_num_workers=0,
    )
    timer = Timer()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    gen_times = []
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
      t = time.perf_counter()
      result = generate(*a, **kw)
      gen_times.append(time.perf_counter() - t)
      return result

    trainer._generate_single_turn = timed_generate
    trainer.train()
  if len(timer.times) != steps:
    raise RuntimeError(f"TRL ran {len(timer.times)} steps, expected {steps}")
  out = _summary(timer.times, args.warmup, args.prompts * args.generations * args.new_tokens)
  out.update(
      median_generate_s=round(statistics.median(gen_times[args.warmup :]), 4),
      completion_tokens=seen["completion_tokens"],
      prompt_tokens=sorted(seen["prompt_tokens"]),
      cpus=cpus,
      torch_threads=torch.get_num_threads(),
      trl=trl.__version__,
      torch=torch.__version__,
      transformers=transformers.__version__,
  )
  return out


# ---- driver ----------------------------------------------------------------------------------------
def _save_model(out_dir: str, smoke: bool) -> dict:
  """Seeded random transformers Qwen2 with the benchmark config, saved; returns the config."""
  import torch
  import transformers

  from ict_jax.models.config import Qwen2Config

  cfg = Qwen2Config.preset("bench", **(SMOKE_MODEL if smoke else {}))
  hf_cfg = transformers.Qwen2Config(
      **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type", "torch_dtype")}
  )
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(hf_cfg).float().save_pretrained(out_dir)
  return {
      "vocab": cfg.vocab_size,
      "hidden": cfg.hidden_size,
      "layers": cfg.num_hidden_layers,
      "heads": cfg.num_attention_heads,
      "kv_heads": cfg.num_key_value_heads,
      "mlp": cfg.intermediate_size,
      "tied": cfg.tie_word_embeddings,
  }


def _worker_env() -> dict:
  env = dict(
      os.environ,
      HF_HUB_OFFLINE="1",
      TRANSFORMERS_OFFLINE="1",
      HF_DATASETS_OFFLINE="1",
      JAX_PLATFORMS="cpu",
      TOKENIZERS_PARALLELISM="false",
      TRANSFORMERS_VERBOSITY="error",
  )
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  # one CPU device: drop a forced host device count inherited from a test harness
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def _run_worker(side: str, args, model_dir: str) -> dict:
  cmd = [
      sys.executable,
      os.path.abspath(__file__),
      "--worker",
      side,
      "--model-dir",
      model_dir,
      "--iterations",
      str(args.iterations),
      "--warmup",
      str(args.warmup),
      "--method",
      args.method,
      "--threads",
      str(args.threads),
      "--prompts",
      str(args.prompts),
      "--generations",
      str(args.generations),
      "--prompt-len",
      str(args.prompt_len),
      "--new-tokens",
      str(args.new_tokens),
      "--chunk-size",
      str(args.chunk_size),
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_worker_env(), cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_TAG)]
  if proc.returncode or not lines:
    tail = (proc.stderr or proc.stdout)[-4000:]
    raise RuntimeError(f"benchmarks/iteration.py: the {side} worker failed (exit {proc.returncode}):\n{tail}")
  return json.loads(lines[-1][len(RESULT_TAG) :])


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--iterations", type=int, default=5, help="timed iterations after the warm-up")
  ap.add_argument("--warmup", type=int, default=1, help="untimed first iterations (compilation)")
  ap.add_argument("--method", choices=("ict", "grpo"), default="ict")
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--generations", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument(
      "--chunk-size",
      type=int,
      default=2,
      help="ours: completion positions per fused LM-head chunk of the step (memory "
      "knob); 2 = [64, 2, V] blocks of 128 rows, the fastest on 2 CPU cores",
  )
  ap.add_argument(
      "--smoke", action="store_true", help="tiny model (vocab 512, hidden 32, 2 layers) and 2 prompts x 4 x 8 tokens"
  )
  ap.add_argument("--skip-trl", action="store_true", help="time ict-jax only")
  ap.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
  ap.add_argument("--model-dir", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.iterations < 1 or args.warmup < 0:
    ap.error("--iterations must be >= 1 and --warmup >= 0")
  if args.generations < 2:
    ap.error("--generations must be >= 2 (group advantages)")
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  if args.worker:
    result = (run_ours if args.worker == "ours" else run_trl)(args)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return
  if args.smoke:
    args.prompts, args.generations, args.prompt_len, args.new_tokens = 2, 4, 8, 8

  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as model_dir:
    model = _save_model(model_dir, args.smoke)
    ours = _run_worker("ours", args, model_dir)
    trl_result = None if args.skip_trl else _run_worker("trl", args, model_dir)
  tokens = args.prompts * args.generations * args.new_tokens
  report = {
      "benchmark": "iteration",
      "method": args.method,
      "prompts": args.prompts,
      "generations": args.generations,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "tokens_per_iteration": tokens,
      "dtype": "float32",
      "chunk_size": args.chunk_size,
      "model": model,
      "threads": args.threads,
      "warmup_iterations": args.warmup,
      "iterations": args.iterations,
      "ours": ours,
      "trl": trl_result,
      "ratio_ours_over_trl": (round(ours["tokens_per_s"] / trl_result["tokens_per_s"], 2) if trl_result else None),
      "loadavg_before": [round(x, 2) for x in load_before],
      "loadavg_after": [round(x, 2) for x in os.getloadavg()],
      "nproc": os.cpu_count(),
      "python": platform.python_version(),
  }
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
