"""`ict_jax.eval`: pass@k through the evaluation loop, the CLI on a Hugging Face folder and on a
training workdir, the benchmark builders, and argument errors.

The end-to-end model is a 1-layer Qwen2 (hidden 16, the real 151,936-token vocabulary) built with
`transformers` whose weights are set so that every next token is "A" or "B" with probability
~1/2 each, whatever the prompt: one-token answers to multiple-choice questions are then right
about half the time, so pass@1 and pass@4 are non-trivial and checkable from the samples.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ict_jax.eval import run
from ict_jax.eval.__main__ import main
from ict_jax.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def reference_pass_at_k(n: int, c: int, k: int) -> float:
  """1 - C(n-c, k) / C(n, k) with exact integers."""
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer()


@pytest.fixture(scope="module")
def ab_model_dir(tmp_path_factory, tok):
  """HF folder of a Qwen2 that emits "A" or "B" (equal logits 20, every other logit 0)."""
  cfg = transformers.Qwen2Config(
      vocab_size=151936,
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=512,
      rope_theta=10000.0,
      tie_word_embeddings=False,
  )
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  (a_id,), (b_id,) = tok.encode("A"), tok.encode("B")
  with torch.no_grad():
    layer = model.model.layers[0]
    layer.self_attn.v_proj.weight.zero_()  # attention output = v bias, whatever the input
    layer.self_attn.v_proj.bias.zero_()
    layer.self_attn.v_proj.bias[0] = 1.0
    layer.self_attn.o_proj.weight.zero_()
    layer.self_attn.o_proj.weight[0, 0] = 1000.0  # residual dim 0 += 1000
    layer.mlp.down_proj.weight.zero_()
    model.lm_head.weight.zero_()  # after the final norm h ~ 4 * e_0
    model.lm_head.weight[a_id, 0] = 5.0
    model.lm_head.weight[b_id, 0] = 5.0
  path = tmp_path_factory.mktemp("ab_model")
  model.save_pretrained(path)
  return str(path)


def write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_benchmark_files(root):
  write_jsonl(
      root / "gsm8k" / "test.jsonl",
      [
          {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=7\n#### 7"},
          {"question": "What is 10 - 2?", "answer": "#### 8"},
          {"question": "How many legs do 2 cats have?", "answer": "2*4=8\n#### 8"},
      ],
  )
  mmlu = [
      {
          "question": f"Question {i}: pick {'AB'[i % 2]}.",
          "subject": "college_physics",
          "choices": ["alpha", "beta", "gamma", "delta"],
          "answer": i % 2,
      }
      for i in range(4)
  ]
  mmlu.insert(2, {"question": "Not STEM.", "subject": "philosophy", "choices": ["w", "x", "y", "z"], "answer": 0})
  write_jsonl(root / "mmlu_stem" / "test.jsonl", mmlu)


# ---- the loop with a fake sampler ------------------------------------------------------------
def test_evaluate_pass_at_k_matches_the_formula_on_a_fake_sampler(tok):
  n, ks = 8, (1, 2, 4, 8)
  num_correct = [0, 1, 2, 5, 8, 3, 7]
  examples = [
      {"id": f"p{g}", "question": f"q{g}", "prompt": f"{g}+{g}=", "answer": str(2 * g)} for g in range(len(num_correct))
  ]
  by_prompt = {tuple(tok.encode(ex["prompt"])): g for g, ex in enumerate(examples)}
  keys = []

  def sampler(prompt_ids, num_samples, rng):
    keys.append(np.asarray(__import__("jax").random.key_data(rng)).tolist())
    out = []
    for ids in prompt_ids:
      g = by_prompt[tuple(ids)]
      c = num_correct[g]
      # correct samples at varying positions inside the group
      flags = np.roll(np.arange(num_samples) < c, g)
      out += [f"so \\boxed{{{2 * g}}}" if f else f"so \\boxed{{{2 * g + 1}}}" for f in flags]
    return out

  res = run.evaluate(
      None,
      tok,
      examples,
      answer_type="math_boxed",
      n=n,
      ks=ks,
      max_new_tokens=4,
      prompt_style="plain",
      rng=3,
      batch_size=3,
      sampler=sampler,
  )
  assert res["num_problems"] == len(examples) and res["num_skipped"] == 0
  assert [p["num_correct"] for p in res["per_problem"]] == num_correct
  assert [sum(p["correct"]) for p in res["per_problem"]] == num_correct
  assert [p["id"] for p in res["per_problem"]] == [ex["id"] for ex in examples]
  for k in ks:
    want = np.mean([reference_pass_at_k(n, c, k) for c in num_correct])
    assert res[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
  assert res["mean_correct"] == pytest.approx(sum(num_correct) / (n * len(num_correct)))
  assert len(keys) == 3 and len({tuple(k) for k in keys}) == 3  # 3 batches, 3 distinct keys

  # multiple choice, and an over-long prompt skipped and counted
  examples = [
      {"question": "?", "prompt": "1", "answer": "B"},
      {"question": "?", "prompt": "2", "answer": 2},
      {"question": "?", "prompt": "3 " * 50, "answer": "A"},
  ]
  letters = {"1": ["\\boxed{B}", "The answer is (B).", "A", "C"], "2": ["\\boxed{A}"] * 4}
  res = run.evaluate(
      None,
      tok,
      examples,
      answer_type="choice",
      n=4,
      ks=(1, 4),
      max_new_tokens=4,
      prompt_style="plain",
      sampler=lambda p, n_, r: [x for ids in p for x in letters[tok.decode(ids)]],
      max_prompt_len=20,
  )
  assert res["num_skipped"] == 1 and res["num_problems"] == 2
  assert [p["correct"] for p in res["per_problem"]] == [[True, True, False, False], [False] * 4]
  assert res["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
  assert res["pass@4"] == pytest.approx((1.0 + 0.0) / 2)


def test_check_ks_and_evaluate_argument_errors(tok):
  assert run.check_ks([4, 1, 4], 8) == (1, 4)
  with pytest.raises(ValueError, match=r"pass@8 needs n >= k .* n = 4"):
    run.check_ks([1, 8], 4)
  with pytest.raises(ValueError, match="empty"):
    run.check_ks([], 4)
  with pytest.raises(ValueError, match="unknown answer_type 'essay'"):
    run.evaluate(
        None,
        tok,
        [{"prompt": "1", "answer": "1"}],
        answer_type="essay",
        n=1,
        max_new_tokens=1,
        sampler=lambda *a: ["1"],
    )
  with pytest.raises(KeyError, match="no 'answer' field"):
    run.evaluate(
        None,
        tok,
        [{"prompt": "1"}],
        answer_type="math_boxed",
        n=1,
        max_new_tokens=1,
        prompt_style="plain",
        sampler=lambda *a: ["1"],
    )


def test_markdown_table_rows_and_columns():
  def result(model, step, p1, p4):
    return {
        "model": model,
        "step": step,
        "settings": {"ks": [1, 4]},
        "benchmarks": {"gsm8k": {"title": "GSM8K", "pass@1": p1, "pass@4": p4}},
        "average": {"pass@1": p1, "pass@4": p4},
    }

  table = run.markdown_table([result("grpo", 100, 0.5, 0.75), result("ict", 100, 0.625, 0.8125)])
  lines = table.strip().splitlines()
  assert lines[0] == "| Model | GSM8K P@1 | GSM8K P@4 | Average P@1 | Average P@4 |"
  assert lines[2] == "| grpo (step 100) | 50.0 | 75.0 | 50.0 | 75.0 |"
  assert lines[3] == "| ict (step 100) | 62.5 | 81.2 | 62.5 | 81.2 |"


# ---- builders ----------------------------------------------------------------------------------
def test_eval_builders_choices_years_and_shuffles(tmp_path):
  from ict_jax.data import load_split
  from ict_jax.data.eval_sets import LETTERS, shuffled_options

  write_jsonl(
      tmp_path / "aime" / "train.jsonl",
      [
          {"problem": "P1", "answer": 33, "url": "https://aops/wiki/2024_AIME_I_Problems/Problem_1"},
          {"problem": "P2", "answer": "204", "url": "https://aops/wiki/2023_AIME_II_Problems/Problem_3"},
          {"Problem": "P3", "Answer": "7", "year": 2024},
      ],
  )
  aime = load_split("aime/2024", "test", data_dir=tmp_path / "data", manual_dir=tmp_path / "aime")
  assert [(e["question"], e["answer"], e["year"]) for e in aime] == [("P1", "33", 2024), ("P3", "7", 2024)]

  rows = [
      {
          "Question": f"Q{i}?",
          "Correct Answer": f"right{i}",
          "Incorrect Answer 1": f"w1_{i}",
          "Incorrect Answer 2": f"w2_{i}",
          "Incorrect Answer 3": f"w3_{i}",
      }
      for i in range(6)
  ]
  write_jsonl(tmp_path / "gpqa" / "gpqa_diamond" / "train-00000-of-00001.jsonl", rows)
  gpqa = load_split("gpqa", "test", data_dir=tmp_path / "data", manual_dir=tmp_path / "gpqa")
  assert len(gpqa) == 6
  positions = set()
  for i, ex in enumerate(gpqa):
    lines = ex["question"].split("\n")
    assert lines[0] == f"Q{i}?" and lines[1] == ""
    opts = {line[1]: line[4:] for line in lines[2:]}
    assert sorted(opts) == list("ABCD") and opts[ex["answer"]] == f"right{i}"
    assert sorted(opts.values()) == sorted([f"right{i}", f"w1_{i}", f"w2_{i}", f"w3_{i}"])
    positions.add(ex["answer"])
    again, letter = shuffled_options(f"Q{i}?", f"right{i}", [f"w1_{i}", f"w2_{i}", f"w3_{i}"], 0)
    assert letter == ex["answer"] and [opts[c] for c in LETTERS[:4]] == again
  assert len(positions) > 1  # the correct option is not always in the same place

  from ict_jax.data.eval_sets import answer_letter
  from ict_jax.data.readers import RowError

  assert [answer_letter(v, 4) for v in (2, np.int64(0), "(c)", " B ", "3")] == ["C", "A", "C", "B", "D"]
  for bad in (4, -1, "E", "AB", None, True):
    with pytest.raises(RowError):
      answer_letter(bad, 4)


# ---- the CLI -----------------------------------------------------------------------------------
def check_outputs(out, results, n, ks, gsm_problems=3, mmlu_problems=4):
  on_disk = json.loads((out / "results.json").read_text())
  assert on_disk == json.loads(json.dumps(results))
  table = (out / "results.md").read_text()
  assert "| Model | GSM8K P@1 | GSM8K P@4 | MMLU-STEM P@1 | MMLU-STEM P@4 | Average P@1 | Average P@4 |" in table
  for name, problems in (("gsm8k", gsm_problems), ("mmlu_stem", mmlu_problems)):
    b = on_disk["benchmarks"][name]
    assert b["num_problems"] == problems and b["n"] == n and b["ks"] == ks
    samples = [json.loads(line) for line in (out / f"samples_{name}.jsonl").read_text().splitlines()]
    assert len(samples) == problems
    for s in samples:
      assert len(s["completions"]) == len(s["correct"]) == n and s["num_correct"] == sum(s["correct"])
      want = [c.strip() == s["gold"] for c in s["completions"]]  # "A"/"B" vs the gold letter
      assert s["correct"] == (want if name == "mmlu_stem" else [False] * n)
    for k in ks:
      want = np.mean([reference_pass_at_k(n, s["num_correct"], k) for s in samples])
      assert 0.0 <= b[f"pass@{k}"] <= 1.0 and b[f"pass@{k}"] == pytest.approx(want)
      assert f"{100 * b[f'pass@{k}']:.1f}" in table
    assert b["pass@1"] <= b["pass@4"]
  mmlu = [json.loads(line) for line in (out / "samples_mmlu_stem.jsonl").read_text().splitlines()]
  assert [s["gold"] for s in mmlu] == ["A", "B", "A", "B"][:mmlu_problems]
  assert "(A) alpha\n(B) beta\n(C) gamma\n(D) delta" in mmlu[0]["prompt"]
  assert 0.0 < on_disk["benchmarks"]["mmlu_stem"]["pass@1"] < 1.0  # the A/B model is right ~half the time
  for k in ks:
    assert on_disk["average"][f"pass@{k}"] == pytest.approx(
        np.mean([on_disk["benchmarks"][b][f"pass@{k}"] for b in ("gsm8k", "mmlu_stem")])
    )
  return on_disk, mmlu


def test_model_sampler_makes_the_rollout_copy_once(ab_model_dir, tok, monkeypatch):
  """Three batches on the 8-device mesh: one cast + reshard of the weights into the decoding
  layout (in __init__), and each batch's texts equal `generate` on the model itself, which makes
  its own copy per call (the path before the copy was hoisted)."""
  import jax

  from ict_jax import sampling
  from ict_jax.models.hf import load_pretrained
  from ict_jax.rollout import decode_completions
  from ict_jax.sharding import make_mesh
  from ict_jax.tokenizer import left_pad

  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  model = load_pretrained(ab_model_dir, mesh=mesh)
  real, calls = sampling.make_rollout_policy, []
  monkeypatch.setattr(sampling.policy, "make_rollout_policy", lambda *a, **k: calls.append(k) or real(*a, **k))
  kw = dict(max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0)
  sampler = run.ModelSampler(model, tok, batch_size=2, width=8, mesh=mesh, **kw)
  prompts = [tok.encode(f"{g}+{g}=") for g in range(2)]
  keys = [jax.random.key(i) for i in range(3)]
  got = [sampler(prompts, 2, k) for k in keys]
  assert len(calls) == 1 and calls[0]["mesh"] is mesh

  ids, mask = left_pad(prompts, tok.pad_id, bucket=(8,))
  for key, texts in zip(keys, got):
    c_ids, c_mask, _ = sampling.generate(
        model, ids, mask, rng=key, num_samples=2, eos_token_ids=tok.eos_ids, pad_id=tok.pad_id, mesh=mesh, **kw
    )
    assert texts == decode_completions(tok, np.asarray(c_ids), np.asarray(c_mask), tok.eos_ids)
    assert set(texts) <= {"AAA", "AAB", "ABA", "ABB", "BAA", "BAB", "BBA", "BBB"}, texts
  assert len(calls) == 4  # generate(model, ...) copies once per call


def test_cli_hf_end_to_end(tmp_path, ab_model_dir):
  write_benchmark_files(tmp_path / "files")
  out = tmp_path / "out"
  argv = [
      "--hf",
      ab_model_dir,
      "--benchmarks",
      "gsm8k,mmlu_stem",
      "--k",
      "1,4",
      "--n",
      "4",
      "--temperature",
      "1.0",
      "--max_new_tokens",
      "1",
      "--manual_dir",
      str(tmp_path / "files"),
      "--data_dir",
      str(tmp_path / "data"),
      "--dtype",
      "float32",
      "--reward_workers",
      "0",
      "--batch_size",
      "3",
      "--no_progress",
      "--out",
      str(out),
  ]
  results = main(argv)
  assert results["model"] == "ab_model0" and results["step"] is None
  on_disk, mmlu = check_outputs(out, results, n=4, ks=[1, 4])
  assert mmlu[0]["prompt"].endswith(
      "(D) delta\nPlease reason step by step, and put the letter of the "
      "correct option within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
  )


def test_cli_argument_and_input_errors(tmp_path, ab_model_dir, capsys):
  base = ["--hf", ab_model_dir, "--no_progress", "--dtype", "float32", "--reward_workers", "0"]
  cases = [
      (["--benchmarks", "gsm8k", "--k", "1,8", "--n", "4"], r"pass@8 needs n >= k"),
      (["--benchmarks", "gsm8k,mmlu"], r"unknown benchmark 'mmlu'; known: math500, gsm8k"),
      (["--benchmarks", "gsm8k", "--manual", "nope=/x"], r"--manual 'nope=/x': expected NAME=DIR"),
      (
          [
              "--benchmarks",
              "gsm8k",
              "--manual_dir",
              str(tmp_path / "missing"),
              "--data_dir",
              str(tmp_path / "data"),
              "--out",
              str(tmp_path / "o"),
          ],
          r"gsm8k: .*missing.* (does not exist|is empty)",
      ),
  ]
  for args, pattern in cases:
    with pytest.raises(SystemExit) as e:
      main(base + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert __import__("re").search(pattern, err, flags=__import__("re").S), err
  assert not (tmp_path / "o").exists()


def test_cli_workdir_after_one_training_step(tmp_path, ab_model_dir, capsys):
  import jax
  from flax import nnx
  from ict_jax.configs import tiny_config
  from ict_jax.eval.loading import load_workdir
  from ict_jax.models.hf import load_pretrained
  from ict_jax.train import train

  c = tiny_config()
  c.model.path = ab_model_dir
  c.train.steps, c.warm_start.sft_steps, c.train.async_checkpointing = 1, 0, False
  c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens = 4, 2, 2
  c.ict.method, c.ict.chunk_size, c.optim.learning_rate = "grpo", 16, 1e-4
  workdir = tmp_path / "run"
  train(c, str(workdir), progress=False)

  # the restored parameters are the checkpoint's: AdamW moved each by at most lr from the start
  loaded, mesh = load_workdir(str(workdir))
  assert loaded.step == 1 and loaded.config.model.path == ab_model_dir and mesh.shape["fsdp"] == 8
  with pytest.MonkeyPatch.context() as mp:  # a relative --workdir works too (Orbax wants absolute)
    mp.chdir(tmp_path)
    assert load_workdir("run")[0].step == 1
  start = nnx.state(load_pretrained(ab_model_dir), nnx.Param).to_pure_dict()
  got = nnx.state(loaded.model, nnx.Param).to_pure_dict()
  assert jax.tree.structure(got) == jax.tree.structure(start)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(start)):
    assert a.shape == b.shape and np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1.01e-4

  # same generation shapes as the training rollout (2 prompts x 4 samples, width 16): no compile
  argv = [
      "--workdir",
      str(workdir),
      "--benchmarks",
      "synthetic",
      "--k",
      "1,4",
      "--n",
      "4",
      "--temperature",
      "1.0",
      "--reward_workers",
      "0",
      "--batch_size",
      "2",
      "--limit",
      "5",
      "--no_progress",
  ]
  results = main(argv)
  out = workdir / "eval" / "step_1"
  assert results["model"] == "run" and results["step"] == 1
  s = results["settings"]
  assert (s["prompt_style"], s["max_new_tokens"]) == ("plain", 2)  # the run's config
  assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
  assert "| run (step 1) |" in (out / "results.md").read_text()
  samples = [json.loads(line) for line in (out / "samples_synthetic.jsonl").read_text().splitlines()]
  assert len(samples) == results["benchmarks"]["synthetic"]["num_problems"] == 5
  for p in samples:
    a, b = p["prompt"].rstrip("=").split("+")
    assert p["gold"] == str(int(a) + int(b)) and len(p["completions"]) == 4
    assert p["correct"] == [c.strip() == p["gold"] for c in p["completions"]]

  with pytest.raises(SystemExit) as e:
    main(argv + ["--step", "5"])
  assert e.value.code == 2
  assert "no checkpoint for step 5" in capsys.readouterr().err

  # without config.json the config comes from the checkpoint's meta
  from ict_jax.setup import read_run_config

  saved = read_run_config(str(workdir))
  (workdir / "config.json").unlink()
  assert read_run_config(str(workdir)) == saved == loaded.config


def test_periodic_eval_reports_the_papers_pass_at_4():
  """The periodic eval (and so every run's validation) reports pass@1, pass@4 (the ICT paper's
  metric; compare_methods chooses lrs on it) and pass@samples."""
  from ict_jax.eval.periodic import PeriodicEval

  fields = dict(examples=[], tokenizer=None, every=1, answer_type="answer", prompt_style="chat", max_new_tokens=1)
  fields.update(max_prompt_len=1, temperature=1.0, top_p=1.0, top_k=0, batch_size=1, seed=0)
  assert [PeriodicEval(samples=n, **fields).ks for n in (1, 3, 4, 8)] == [(1,), (1, 3), (1, 4), (1, 4, 8)]
