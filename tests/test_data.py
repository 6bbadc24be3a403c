"""Data: tfds builds read back through as_data_source, answer extraction, bad rows, prompt iteration."""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ict_jax import data
from ict_jax.data import gsm8k, math as math_data, synthetic
from ict_jax.data.iterator import PromptIterator
from ict_jax.data.prompts import MATH_INSTRUCTION, build_prompt, format_prompt


def write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_parquet(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)


def all_examples(src):
  return [src[i] for i in range(len(src))]


# ---- synthetic arithmetic ------------------------------------------------------------------------
def test_level_sizes_and_answers():
  assert len(synthetic.level_problems(1)) == 10 * 10
  assert len(synthetic.level_problems(2)) == 100 + 10 * 11 // 2
  assert len(synthetic.level_problems(3)) == 100 * 100
  assert len(synthetic.level_problems(4)) == 100 * 100 + 100 * 101 // 2 + 13 * 13
  for level in (2, 4):
    for a, op, b in synthetic.level_problems(level)[::97]:
      ex = synthetic.make_example(a, op, b, level)
      x, y = (int(v) for v in re.fullmatch(r"(\d+)[-+*](\d+)=", ex["prompt"]).groups())
      expected = {"+": x + y, "-": x - y, "*": x * y}[op]
      assert ex["answer"] == str(expected) and int(ex["answer"]) >= 0
      assert ex["question"] == f"What is {x} {op} {y}?"


def test_split_is_seeded_and_disjoint():
  train = synthetic.split_examples((1, 2), 0.2, 0, "train")
  test = synthetic.split_examples((1, 2), 0.2, 0, "test")
  assert len(test) == 20 + 31 and len(train) == 80 + 124
  assert not {e["id"] for e in train} & {e["id"] for e in test}
  assert {e["level"] for e in test} == {1, 2}
  assert synthetic.split_examples((1,), 0.2, 0, "test") == synthetic.split_examples((1,), 0.2, 0, "test")
  assert synthetic.split_examples((1,), 0.2, 1, "test") != synthetic.split_examples((1,), 0.2, 0, "test")


def test_synthetic_build_and_read_back(tmp_path):
  train = data.load_split("synthetic_arith", "train", tmp_path / "a")
  test = data.load_split("synthetic_arith/level1", "test", tmp_path / "a")
  assert (len(train), len(test)) == (80, 20)
  rows = all_examples(train) + all_examples(test)
  assert {(r["prompt"], r["answer"]) for r in rows} == {(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)}
  ex = test[3]
  assert set(ex) == {"id", "question", "prompt", "answer", "level"}
  assert isinstance(ex["answer"], str) and isinstance(ex["level"], int) and ex["level"] == 1
  # a second build elsewhere gives the same examples in the same order
  again = data.load_split("synthetic_arith", "test", tmp_path / "b")
  assert all_examples(again) == all_examples(test)
  with pytest.raises(KeyError, match="no split 'validation'"):
    data.load_split("synthetic_arith", "validation", tmp_path / "a")
  with pytest.raises(KeyError, match="unknown dataset 'nope'"):
    data.load_split("nope", "train", tmp_path / "a")


def test_synthetic_custom_seed_config(tmp_path):
  cfg = synthetic.SyntheticArithConfig(name="seed7", levels=(1,), seed=7)
  test = all_examples(data.load_split("synthetic_arith", "test", tmp_path, config=cfg))
  expected = synthetic.split_examples((1,), 0.2, 7, "test")
  assert sorted(e["id"] for e in test) == sorted(e["id"] for e in expected)


# ---- answer extraction ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "solution, answer",
    [
        ("She pays 2 * 500 = <<2*500=1000>>1000.\n#### 1,000", "1000"),
        ("a #### 3 then\n#### -12,345,678 ", "-12345678"),
        ("no marker 42", None),
        ("#### ", None),
    ],
)
def test_gsm8k_final_answer(solution, answer):
  assert gsm8k.final_answer(solution) == answer


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("first \\boxed{1}, then \\boxed{2}, finally \\boxed{ 3 }", "3"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
        ("\\boxed{a_{n}^{2}} + \\fbox{7}", "7"),
        ("answer: $\\boxed 5$", "5"),
        ("\\boxed{\\sqrt{2", None),
        ("no box at all", None),
    ],
)
def test_last_boxed(text, answer):
  assert math_data.last_boxed(text) == answer


@pytest.mark.parametrize("value, level", [("Level 5", 5), (3, 3), ("2", 2), ("Level ?", 0), (None, 0)])
def test_parse_level(value, level):
  assert math_data.parse_level(value) == level


# ---- gsm8k / math from local files ---------------------------------------------------------------
def test_gsm8k_jsonl_with_bad_rows(tmp_path, caplog):
  manual = tmp_path / "manual"
  good = [{"question": f"Q{i}?", "answer": f"step\n#### {i},000"} for i in range(3)]
  lines = [
      json.dumps(good[0]).encode(),
      b"{not json",
      b'{"question": "caf\xe9"}',
      json.dumps({"question": "Q?"}).encode(),
      b"",
      json.dumps(good[1]).encode(),
      json.dumps({"question": "Q?", "answer": "no marker"}).encode(),
      json.dumps(good[2]).encode(),
  ]
  manual.mkdir()
  (manual / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  write_jsonl(manual / "test.jsonl", good[:1])
  with caplog.at_level(logging.WARNING, logger="ict_jax.data"):
    builder = data.prepare("gsm8k", tmp_path / "data", manual)
  train = all_examples(data.load_split("gsm8k", "train", tmp_path / "data", manual))
  assert sorted((e["question"], e["answer"]) for e in train) == [("Q0?", "0000"), ("Q1?", "1000"), ("Q2?", "2000")]
  assert {e["id"] for e in train} == {"gsm8k/train.jsonl:1", "gsm8k/train.jsonl:6", "gsm8k/train.jsonl:8"}
  assert all(e["prompt"] == e["question"] and "####" in e["solution"] for e in train)
  skipped = builder.info.metadata["skipped_rows"]
  assert [(s["file"], s["row"]) for s in skipped["train"]] == [("train.jsonl", r) for r in (2, 3, 4, 7)]
  assert "invalid JSON" in skipped["train"][0]["reason"] and "UTF-8" in skipped["train"][1]["reason"]
  assert "'answer'" in skipped["train"][2]["reason"] and "####" in skipped["train"][3]["reason"]
  assert skipped["test"] == []
  logged = caplog.text
  for row in (2, 3, 4, 7):
    assert f"train.jsonl:{row}" in logged
  # the skip report is saved with the dataset
  assert data.make_builder("gsm8k", tmp_path / "data").info.metadata["skipped_rows"] == skipped


def test_gsm8k_parquet_in_main_subfolder(tmp_path):
  manual = tmp_path / "manual"
  rows = [
      {"question": "A?", "answer": "#### 7"},
      {"question": "B?", "answer": None},
      {"question": "C?", "answer": "x #### 1,5"},
  ]
  write_parquet(manual / "main" / "test-00000-of-00001.parquet", rows)
  write_parquet(manual / "socratic" / "test-00000-of-00001.parquet", rows)  # not read for gsm8k
  builder = data.prepare("gsm8k", tmp_path / "data", manual)
  test = all_examples(data.load_split("gsm8k", "test", tmp_path / "data", manual))
  assert sorted(e["answer"] for e in test) == ["15", "7"]
  assert list(builder.info.splits) == ["test"]
  assert builder.info.metadata["skipped_rows"]["test"][0]["file"] == "main/test-00000-of-00001.parquet"
  assert builder.info.metadata["skipped_rows"]["test"][0]["row"] == 2


def test_math_jsonl_and_parquet(tmp_path):
  manual = tmp_path / "manual"
  write_jsonl(
      manual / "train.jsonl",
      [
          {
              "problem": "Half of one?",
              "solution": "It is $\\boxed{\\frac{1}{2}}$.",
              "level": "Level 2",
              "type": "Algebra",
          },
          {
              "problem": "Two boxes",
              "solution": "Try \\boxed{1}; no, \\boxed{2}.",
              "level": "Level ?",
              "type": "Prealgebra",
          },
          {"problem": "No box", "solution": "it is 4"},
          {"problem": "", "solution": "\\boxed{9}"},
      ],
  )
  write_parquet(
      manual / "geometry" / "test-00000-of-00001.parquet",
      [
          {"problem": "Area?", "solution": "$\\boxed{4\\pi}$", "level": "Level 5", "type": "Geometry"},
      ],
  )
  write_parquet(
      manual / "algebra" / "test-00000-of-00001.parquet",
      [
          {
              "problem": "MATH-500 style",
              "solution": "x = 3",
              "answer": "3",
              "subject": "Algebra",
              "level": 1,
              "unique_id": "test/algebra/1.json",
          },
      ],
  )
  builder = data.prepare("math", tmp_path / "data", manual)
  train = sorted(all_examples(data.load_split("math", "train", tmp_path / "data", manual)), key=lambda e: e["id"])
  assert [(e["answer"], e["level"], e["type"]) for e in train] == [
      ("\\frac{1}{2}", 2, "Algebra"),
      ("2", 0, "Prealgebra"),
  ]
  assert [(s["row"], s["file"]) for s in builder.info.metadata["skipped_rows"]["train"]] == [
      (3, "train.jsonl"),
      (4, "train.jsonl"),
  ]
  test = {e["question"]: e for e in all_examples(data.load_split("math", "test", tmp_path / "data", manual))}
  assert test["Area?"]["answer"] == "4\\pi" and test["Area?"]["level"] == 5
  assert test["MATH-500 style"]["answer"] == "3" and test["MATH-500 style"]["type"] == "Algebra"
  assert test["MATH-500 style"]["id"] == "test/algebra/1.json"


# ---- errors --------------------------------------------------------------------------------------
def test_missing_or_empty_manual_dir(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError) as err:
    data.prepare("gsm8k", tmp_path / "data", missing)
  msg = str(err.value)
  assert str(missing) in msg and "train.jsonl" in msg and "test.jsonl" in msg and '"question"' in msg
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=re.escape(str(empty))) as err:
    data.prepare("math", tmp_path / "data", empty)
  assert '"problem"' in str(err.value) and '"solution"' in str(err.value)
  other = tmp_path / "other"
  (other / "x").mkdir(parents=True)
  (other / "notes.txt").write_text("hi")
  with pytest.raises(FileNotFoundError, match=r"no file for splits \['train', 'test'\].*notes.txt"):
    data.prepare("gsm8k", tmp_path / "data", other)


def test_empty_file_is_an_error_then_rebuild(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  (manual / "test.jsonl").write_text("\n  \n")
  with pytest.raises(ValueError, match=re.escape(str(manual / "test.jsonl")) + " is empty"):
    data.prepare("gsm8k", tmp_path / "data", manual)
  write_jsonl(manual / "test.jsonl", [{"question": "x", "answer": "no marker"}])
  with pytest.raises(ValueError, match=r"gsm8k test: no usable row in \['test.jsonl'\]"):
    data.prepare("gsm8k", tmp_path / "data", manual)
  write_jsonl(manual / "test.jsonl", [{"question": "x", "answer": "#### 1"}])
  assert len(data.load_split("gsm8k", "test", tmp_path / "data", manual)) == 1
  empty = pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
  pq.write_table(empty, manual / "train.parquet")  # zero-row Parquet file
  with pytest.raises(ValueError, match="train.parquet is empty"):
    data.prepare("gsm8k", tmp_path / "data2", manual)


# ---- prompts -------------------------------------------------------------------------------------
class FakeTemplate:

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    assert add_generation_prompt and not tokenize
    return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_prompts():
  assert MATH_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
  assert format_prompt("1+1?", FakeTemplate()) == "user:1+1?\n" + MATH_INSTRUCTION
  assert format_prompt("1+1?", FakeTemplate(), instruction="", system="S") == "system:S|user:1+1?"
  ex = {"question": "What is 3 + 5?", "prompt": "3+5="}
  assert build_prompt(ex, style="plain") == "3+5="
  assert build_prompt(ex, FakeTemplate()) == "user:What is 3 + 5?\n" + MATH_INSTRUCTION
  with pytest.raises(ValueError, match="unknown prompt style 'x'"):
    build_prompt(ex, FakeTemplate(), style="x")


def test_prompt_with_qwen_template():
  from ict_jax.tokenizer import Tokenizer

  text = format_prompt("What is 3 + 5?", Tokenizer())
  assert text == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is 3 + 5?\nPlease reason step by step, and put your final answer within "
      "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
  )


# ---- iterator ------------------------------------------------------------------------------------
def test_prompt_iterator_epochs_and_resume():
  source = list(range(10))
  it = PromptIterator(source, batch_size=4, seed=3)
  stream = [x for _ in range(10) for x in next(it)]  # 40 examples = 4 epochs
  assert it.position == 40 and it.epoch == 4
  epochs = [stream[k * 10 : (k + 1) * 10] for k in range(4)]
  assert all(sorted(e) == source for e in epochs)
  assert len({tuple(e) for e in epochs}) == 4  # reshuffled each epoch
  # same seed -> same stream; another seed -> another
  again = PromptIterator(source, 4, seed=3)
  assert [x for _ in range(10) for x in next(again)] == stream
  other = PromptIterator(source, 4, seed=4)
  assert [x for _ in range(10) for x in next(other)] != stream
  # resume from a saved position (mid-epoch) continues exactly
  resumed = PromptIterator(source, 4, seed=3, position=12)
  assert [x for _ in range(7) for x in next(resumed)] == stream[12:]
  # unshuffled order
  assert next(PromptIterator(source, 3, seed=0, shuffle=False)) == [0, 1, 2]


def test_prompt_iterator_shards_and_errors():
  source = [f"ex{i}" for i in range(7)]
  whole = PromptIterator(source, 6, seed=1)
  shards = [PromptIterator(source, 6, seed=1, num_shards=3, shard_index=k) for k in range(3)]
  for _ in range(4):
    assert next(whole) == [x for s in shards for x in next(s)]
  assert {s.position for s in shards} == {whole.position}
  with pytest.raises(ValueError, match="divisible"):
    PromptIterator(source, 5, seed=0, num_shards=2)
  with pytest.raises(ValueError, match="no examples"):
    PromptIterator([], 1, seed=0)
  with pytest.raises(ValueError, match="position"):
    PromptIterator(source, 1, seed=0, position=-1)


def test_prompt_iterator_over_tfds_source(tmp_path):
  src = data.load_split("synthetic_arith", "test", tmp_path)
  it = PromptIterator(src, batch_size=8, seed=0)
  batches = [next(it) for _ in range(5)]  # 40 = 2 epochs of 20
  ids = [e["id"] for b in batches for e in b]
  assert sorted(ids[:20]) == sorted(ids[20:]) == sorted(e["id"] for e in all_examples(src))


def test_drop_long_prompts_keeps_the_fitting_ones_in_order():
  """Plain prompts against a character tokenizer (one token a character): the ones over max_len
  are left out and reported by id; none fitting is one error naming the limit."""
  from ict_jax.data.prompts import drop_long_prompts

  chars = type("Chars", (), {"encode": staticmethod(list)})()
  src = [{"id": f"t:{i}", "prompt": "x" * n, "answer": "1"} for i, n in enumerate([3, 9, 5, 12, 4])]
  kept, dropped = drop_long_prompts(src, chars, style="plain", max_len=5, dataset="toy train")
  assert [kept[i]["id"] for i in range(len(kept))] == ["t:0", "t:2", "t:4"]
  assert dropped == [{"id": "t:1", "tokens": 9}, {"id": "t:3", "tokens": 12}]
  assert drop_long_prompts(src, chars, style="plain", max_len=12)[0] is src  # nothing left out
  with pytest.raises(ValueError, match=r"toy train: none of the 5 prompts fits data.max_prompt_len=2 tokens"):
    drop_long_prompts(src, chars, style="plain", max_len=2, dataset="toy train")
