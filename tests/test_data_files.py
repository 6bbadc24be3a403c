"""data.name="files": the user's JSONL / JSON / Parquet files and hf: datasets (ict_jax/data/files.py),
their chat-message prompts, the config keys' errors, and a run and an evaluation on them."""

import json
import logging
import os
import subprocess
import sys

import pytest

from ict_jax import config as config_lib
from ict_jax import configs
from ict_jax.config import ConfigError
from ict_jax.data.files import FileExample, FileSplit, load_files
from ict_jax.data.prompts import MATH_INSTRUCTION, PromptError, build_prompt, encode_prompts
from ict_jax.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
  """`datasets` writes its Arrow copies under tmp_path, not the user's cache."""
  import datasets

  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def _lines(path, lines):
  path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
  return str(path)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
AWKWARD = [  # (line, kept?) of a TRL-style JSONL with every kind of bad row
    json.dumps({"prompt": "Ünïcødé: 数学 🙂 1+1=", "solution": "2", "level": 3}, ensure_ascii=False),  # 1
    json.dumps({"solution": "5"}),  # 2: no prompt
    json.dumps({"prompt": "3+4=", "solution": None}),  # 3: null answer
    json.dumps({"prompt": 7, "solution": "7"}),  # 4: a number as the prompt
    "",  # 5: blank
    "{not json",  # 6
    json.dumps({"prompt": CHAT, "solution": 4, "meta": {"src": "x"}}),  # 7: chat messages, a numeric answer
    json.dumps({"prompt": [{"role": "user"}], "solution": "1"}),  # 8: a message without content
    json.dumps({"prompt": "5+5=", "solution": ["10"]}),  # 9: a list as the answer
    json.dumps({"prompt": "   ", "solution": "0"}),  # 10: a blank prompt
    json.dumps(["a list"]),  # 11: not an object
    b'{"prompt": "caf\xe9", "solution": "1"}',  # 12: not UTF-8
    json.dumps({"prompt": "6+1=", "solution": "7", "id": "mine-9", "question": "other"}),  # 13
]


def test_jsonl_with_awkward_rows_keeps_the_good_ones_and_counts_the_rest(tmp_path, caplog):
  path = _lines(tmp_path / "train.jsonl", AWKWARD)
  with caplog.at_level(logging.WARNING, logger="ict_jax.data"):
    src = load_files(path, answer_field="solution")
  # every column kept as it is; "prompt" / "answer" from the fields; "id" file:line where absent
  expected = [
      {"prompt": "Ünïcødé: 数学 🙂 1+1=", "solution": "2", "level": 3, "answer": "2", "id": f"{path}:1"},
      {"prompt": CHAT, "solution": 4, "meta": {"src": "x"}, "answer": "4", "id": f"{path}:7"},
      {"prompt": "6+1=", "solution": "7", "id": "mine-9", "question": "other", "answer": "7"},
  ]
  assert [src[i] for i in range(len(src))] == expected and len(src) == 3
  assert all(type(src[i]) is FileExample for i in range(3))
  skipped = [(e["file"], e["row"], e["reason"]) for e in src.skipped.entries]
  assert skipped == [
      (path, 2, "missing field 'prompt' (row has ['solution'])"),
      (path, 3, "field 'solution' is null"),
      (path, 4, "field 'prompt' is int, expected a string or a list of chat messages"),
      (path, 6, "invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
      (path, 8, "field 'prompt'[0] is not a chat message {'role': str, 'content': str} (got \"{'role': 'user'}\")"),
      (path, 9, "field 'solution' is list, expected a string or a number"),
      (path, 10, "field 'prompt' is empty"),
      (path, 11, "line is a JSON list, not an object"),
      (path, 12, f"not valid UTF-8 (invalid continuation byte at byte {AWKWARD[11].index(bytes([0xE9]))})"),
  ]
  for file, line, reason in skipped:  # each logged with its file and line, as the tfds builders' rows
    assert f"files train: skipping {file}:{line}: {reason}" in caplog.text
  assert f"files train: {path}: kept 3 rows, skipped 9" in caplog.text
  src[0]["prompt"] = "edited"  # a consumer's copy
  assert src[0]["prompt"] == expected[0]["prompt"]


def test_parquet_written_by_pyarrow(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  table = pa.table(
      {
          "question": ["1+1=", None, "2+2=", "3+3="],
          "final": ["2", "3", None, "6"],
          "tags": [["a"], [], ["b", "c"], None],
          "score": [0.5, 1.0, 2.0, 3.5],
      }
  )
  path = str(tmp_path / "train-00000-of-00001.parquet")
  pq.write_table(table, path)
  src = load_files(path, prompt_field="question", answer_field="final")
  rows = table.to_pylist()  # the reference: pyarrow's own reading
  assert [src[i] for i in range(len(src))] == [
      {**rows[0], "prompt": "1+1=", "answer": "2", "id": f"{path}:1"},
      {**rows[3], "prompt": "3+3=", "answer": "6", "id": f"{path}:4"},
  ]
  assert [(e["row"], e["reason"]) for e in src.skipped.entries] == [
      (2, "field 'question' is null"),
      (3, "field 'final' is null"),
  ]


def test_globs_and_comma_separated_files_are_read_in_order_each_once(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  data = tmp_path / "data"
  data.mkdir()
  for k in range(3):
    _lines(data / f"part-{k}.jsonl", [json.dumps({"prompt": f"p{k}{j}", "answer": str(j)}) for j in range(2)])
  (data / "part-3.json").write_text(json.dumps([{"prompt": "p30", "answer": "0"}, 5]))  # a JSON array
  pq.write_table(pa.table({"prompt": ["q0"], "answer": ["9"]}), str(data / "extra.parquet"))
  (data / "notes.txt").write_text("not data")
  src = load_files(f"{data}/part-*.js*,{data}/part-1.jsonl, {data}/extra.parquet")
  assert [src[i]["prompt"] for i in range(len(src))] == ["p00", "p01", "p10", "p11", "p20", "p21", "p30", "q0"]
  assert src.files == [f"{data}/part-{k}.{'jsonl' if k < 3 else 'json'}" for k in range(4)] + [f"{data}/extra.parquet"]
  assert src[6]["id"] == f"{data}/part-3.json:1"
  assert [(e["row"], e["reason"]) for e in src.skipped.entries] == [(2, "element is int, not a JSON object")]


def test_hf_prefix_loads_a_local_folder_through_datasets(tmp_path):
  """`hf:NAME[:SPLIT]` is `datasets.load_dataset(NAME, split=SPLIT)`; a local folder of data files
  stands in for a hub id (nothing downloads). SPLIT defaults to the split being read."""
  folder = tmp_path / "my_dataset"
  folder.mkdir()
  _lines(folder / "train.jsonl", [json.dumps({"problem": "a", "solution": "1"})])
  _lines(folder / "test.jsonl", [json.dumps({"problem": f"t{k}", "solution": str(k)}) for k in range(3)])
  fields = dict(prompt_field="problem", answer_field="solution")
  test = load_files(f"hf:{folder}:test", **fields)
  assert [(e["prompt"], e["answer"], e["id"]) for e in test.examples] == [
      (f"t{k}", str(k), f"hf:{folder}:test:{k + 1}") for k in range(3)
  ]
  assert [e["prompt"] for e in load_files(f"hf:{folder}", default_split="train", **fields).examples] == ["a"]
  assert len(FileSplit(f"hf:{folder}", "problem", "solution", split="test").load()) == 3
  with pytest.raises(ConfigError) as e:
    load_files(f"hf:{folder}:validation", **fields)
  assert str(e.value).startswith(f"config.data.train_files: hf:{folder}:validation: cannot load (ValueError: ")
  assert "validation" in str(e.value) and "\n" not in str(e.value)


def _messages_text(messages):
  """Qwen2.5's template by hand (the reference): a default system turn unless the first is one."""
  head = "" if messages[0]["role"] == "system" else QWEN_SYSTEM
  turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
  return head + turns + "<|im_start|>assistant\n"


def test_conversational_prompts_go_through_the_chat_template_in_either_style():
  tok = Tokenizer()
  user_only = [{"role": "user", "content": "Solve x+1=3."}]
  rows = [
      FileExample(prompt=CHAT, answer="4", id="a"),
      FileExample(prompt=user_only, answer="2", id="b"),
      FileExample(prompt="1+2=", answer="3", id="c", question="a column, not the prompt"),
  ]
  for style in ("plain", "chat"):
    kept, texts, ids = encode_prompts(rows, tok, style=style)
    assert kept == rows
    assert texts[:2] == [_messages_text(CHAT), _messages_text(user_only)]  # no instruction added
    string_prompt = {
        "plain": "1+2=",
        "chat": QWEN_SYSTEM + f"<|im_start|>user\n1+2=\n{MATH_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n",
    }[style]
    assert texts[2] == string_prompt  # a file's string prompt is its prompt field in either style
    assert ids == [tok.encode(t) for t in texts]
  # a tfds example keeps its chat prompt from "question"
  assert "What is 1 plus 2?" in build_prompt({"prompt": "1+2=", "question": "What is 1 plus 2?"}, tok, style="chat")

  class Recording:
    """Any tokenizer with apply_chat_template (a checkpoint's own template): called as HF's."""

    calls = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
      self.calls.append((messages, add_generation_prompt, tokenize))
      return "|".join(m["content"] for m in messages) + "<gen>"

    def encode(self, text):
      return [ord(c) for c in text]

  kept, texts, ids = encode_prompts(rows[:1], Recording(), style="plain", max_len=100)
  assert Recording.calls == [(CHAT, True, False)] and texts == ["Be brief.|What is 2+2?<gen>"]
  assert ids == [[ord(c) for c in texts[0]]]
  with pytest.raises(PromptError, match=r"^x: the chat template refuses its messages \(messages\[0\]: role 'tool'"):
    encode_prompts([FileExample(prompt=[{"role": "tool", "content": "1"}], answer="1", id="x")], tok, style="plain")


def _files_config(**data):
  c = configs.tiny_config()
  c.data.name, c.train.eval_every = "files", 0
  for key, value in data.items():
    setattr(c.data, key, value)
  return c


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {},
            "config.data.train_files: data.name='files' reads its train split from data.train_files; give paths or "
            "globs of .jsonl / .json / .parquet files, or hf:NAME[:SPLIT]",
        ),
        (
            {"name": "gsm8k", "train_files": "a.jsonl"},
            "config.data.train_files: read with data.name='files' only; "
            "data.name is 'gsm8k' (set --config.data.name=files)",
        ),
        (
            {"name": "gsm8k", "answer_field": "solution"},
            "config.data.answer_field: read with data.name='files' "
            "only; data.name is 'gsm8k' (set --config.data.name=files)",
        ),
        (
            {"train_files": "a.jsonl,,b.jsonl"},
            "config.data.train_files: expected comma-separated paths, globs or "
            "hf:NAME[:SPLIT], none empty, got 'a.jsonl,,b.jsonl'",
        ),
        ({"train_files": "a.jsonl", "prompt_field": " "}, "config.data.prompt_field: expected a column name, got ' '"),
        (
            {"train_files": "a.jsonl", "prompt_field": "x", "answer_field": "x"},
            "config.data.answer_field: 'x' is data.prompt_field too",
        ),
    ],
)
def test_config_errors(data, message):
  c = _files_config(**data)
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == message


def test_periodic_eval_needs_eval_files():
  c = _files_config(train_files="a.jsonl")
  c.train.eval_every = 5
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == (
      "config.data.eval_files: train.eval_every runs pass@k on the eval split, which data.name='files' reads "
      "from data.eval_files; give its files, or set train.eval_every=0"
  )
  c.data.eval_files = "b.jsonl"
  assert config_lib.validate(c).data.eval_files == "b.jsonl"


def test_file_errors_are_one_line_naming_the_file(tmp_path):
  good = _lines(tmp_path / "good.jsonl", [json.dumps({"prompt": "p", "answer": "a"})])
  bad = _lines(tmp_path / "bad.jsonl", [json.dumps({"question": "q", "answer": "a"}), "{", json.dumps({"prompt": 1})])
  (tmp_path / "empty.jsonl").write_text("")
  (tmp_path / "rows.csv").write_text("prompt,answer\n")
  (tmp_path / "sub").mkdir()
  cases = {
      f"{tmp_path}/nope/*.jsonl": f"no file matches '{tmp_path}/nope/*.jsonl'",
      f"{good},{tmp_path}/missing.jsonl": f"{tmp_path}/missing.jsonl: no such file",
      f"{tmp_path}/rows.csv": f"{tmp_path}/rows.csv: unsupported file type '.csv'; expected .jsonl, .json or "
      ".parquet (or hf:NAME[:SPLIT] for a Hugging Face dataset)",
      f"{tmp_path}/sub": f"{tmp_path}/sub is a folder; name its files (e.g. {tmp_path}/sub/*.jsonl) or hf:{tmp_path}/sub",
      f"{tmp_path}/empty.jsonl": f"{tmp_path}/empty.jsonl is empty: expected one JSON object per line",
      f"{good},{bad}": f"{bad} has no usable row (3 skipped; line 1: missing field 'prompt' (row has ['answer', "
      "'question'])); each row needs 'prompt' (data.prompt_field) and 'answer' (data.answer_field)",
      "hf:a:b:c:d": "hf:a:b:c:d: cannot load (ValueError: 'hf:a:b:c:d': expected hf:NAME, hf:NAME:SPLIT or "
      "hf:NAME:CONFIG:SPLIT)",
  }
  for spec, message in cases.items():
    with pytest.raises(ConfigError) as e:
      FileSplit(spec, split="test", what="config.data.eval_files").load()
    assert str(e.value) == f"config.data.eval_files: {message}", spec


def test_a_bad_file_stops_the_trainer_before_anything_compiles(tmp_path):
  """`python -m ict_jax.train` on a glob that matches nothing: exit 2, one line, no checkpoint."""
  cmd = [
      sys.executable,
      "-m",
      "ict_jax.train",
      f"--workdir={tmp_path}/w",
      "--config.data.name=files",
      f"--config.data.train_files={tmp_path}/data/*.jsonl",
      "--config.train.eval_every=0",
  ]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"ict_jax.train: error: config.data.train_files: no file matches '{tmp_path}/data/*.jsonl'" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(f"{tmp_path}/w/checkpoints") or not os.listdir(f"{tmp_path}/w/checkpoints")


def _arith_rows(pairs, chat_every=3):
  """TRL-style rows ("problem", "solution", an extra column): every `chat_every`-th problem is a
  conversation with a short system turn (the tiny run's prompts stay within max_prompt_len)."""
  rows = []
  for k, (a, b) in enumerate(pairs):
    text = f"{a}+{b}="
    problem = (
        [{"role": "system", "content": "Add."}, {"role": "user", "content": text}] if k % chat_every == 0 else text
    )
    rows.append({"problem": problem, "solution": str(a + b), "source": f"row{k}"})
  return rows


def _rendered(problem):
  return _messages_text(problem) if isinstance(problem, list) else problem


def test_a_run_and_its_evaluation_on_jsonl_files(tmp_path):
  """`train()` on a JSONL train file (string and chat-message prompts, other column names), with
  the periodic eval on a JSONL eval file, then `python -m ict_jax.eval --workdir W --benchmarks
  files` on the run: the logged samples are the file's prompts with the file's answers as the gold,
  and pass@k checks the answer column."""
  from ict_jax.eval.__main__ import main as eval_main
  from ict_jax.logs import read_log
  from ict_jax.train import train

  train_rows = _arith_rows([(a, b) for a in range(1, 5) for b in range(1, 4)])
  test_rows = _arith_rows([(5, 1), (2, 6), (3, 3), (4, 4)])
  _lines(tmp_path / "train.jsonl", [json.dumps(r) for r in train_rows] + ["", "{broken"])
  _lines(tmp_path / "test.jsonl", [json.dumps(r) for r in test_rows])
  c = _files_config(
      train_files=str(tmp_path / "train.jsonl"),
      eval_files=str(tmp_path / "test.jsonl"),
      prompt_field="problem",
      answer_field="solution",
      max_prompt_len=32,
  )
  c.warm_start.sft_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
  c.train.steps, c.train.checkpoint_every, c.train.async_checkpointing = 2, 2, False
  c.train.eval_every, c.train.eval_samples, c.train.eval_prompts = 2, 2, 4
  workdir = str(tmp_path / "run")
  out = train(c, workdir, progress=False)

  assert [r["step"] for r in out] == [1, 2] and 0.0 <= out[-1]["eval_pass_at_1"] <= out[-1]["eval_pass_at_2"] <= 1
  gold_of = {_rendered(r["problem"]): r["solution"] for r in train_rows}
  samples = read_log(workdir, "samples")
  assert {s["step"] for s in samples} == {1, 2} and len(samples) == 2 * 16
  assert {s["prompt"] for s in samples} <= set(gold_of)  # the file's prompts, rendered
  assert {s["prompt"].startswith("<|im_start|>system\nAdd.<|im_end|>") for s in samples} == {True, False}  # both kinds
  for s in samples:
    assert s["gold"] == gold_of[s["prompt"]]  # the answer column reaches the reward
    if s["completion"].strip() == s["gold"]:
      assert s["reward"] == 1.0
    elif not any(ch.isdigit() for ch in s["completion"]):
      assert s["reward"] == 0.0

  report = eval_main(
      ["--workdir", workdir, "--benchmarks", "files", "--n", "2", "--k", "1,2", "--max_new_tokens", "4"]
      + ["--batch_size", "4", "--reward_workers", "0", "--no_progress", "--out", str(tmp_path / "eval")]
  )
  files = report["benchmarks"]["files"]
  assert files["num_problems"] == len(test_rows) and files["num_skipped"] == 0
  assert (
      report["settings"]["files"] == str(tmp_path / "test.jsonl") and report["settings"]["answer_field"] == "solution"
  )
  problems = [json.loads(line) for line in (tmp_path / "eval" / "samples_files.jsonl").read_text().splitlines()]
  assert [(p["prompt"], p["gold"]) for p in problems] == [(_rendered(r["problem"]), r["solution"]) for r in test_rows]
  for p in problems:
    for completion, correct in zip(p["completions"], p["correct"]):
      if completion.strip() == p["gold"]:
        assert correct
      elif not any(ch.isdigit() for ch in completion):
        assert not correct
  counts = [p["num_correct"] for p in problems]  # pass@1 = mean c/n (the unbiased estimator at k=1)
  assert files["pass@1"] == pytest.approx(sum(counts) / (2 * len(problems)))


def test_eval_cli_file_errors_are_one_line(tmp_path, capsys):
  """`python -m ict_jax.eval`: the files are read before any model is loaded (exit 2, one line)."""
  from ict_jax.eval.__main__ import main as eval_main

  hf = str(tmp_path / "no_model_needed")
  cases = [
      (["--files", f"{tmp_path}/nope.jsonl"], f"ict_jax.eval: error: --files: {tmp_path}/nope.jsonl: no such file"),
      (
          ["--benchmarks", "files"],
          "ict_jax.eval: error: benchmark files: no files given (--files PATHS, or a --workdir whose run has "
          "data.eval_files)",
      ),
      (
          ["--benchmarks", "gsm8k", "--files", "x.jsonl"],
          "error: --files / --prompt_field / --answer_field / --answer_type: the files benchmark is not in --benchmarks",
      ),
  ]
  for args, message in cases:
    with pytest.raises(SystemExit) as e:
      eval_main(["--hf", hf, "--no_progress", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
