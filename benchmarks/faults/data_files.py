"""Bad GSM8K files in data.manual_dir through the trainer: bad rows (missing fields, non-UTF-8,
huge single lines) skipped and logged with file:row; an empty file is one error naming it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.faults.harness import Run, metrics, quick_flags, row
from benchmarks.faults.registry import Context, scenario


def _write_gsm8k(manual: Path, huge_mb: int) -> dict:
  """train.jsonl with good rows and bad ones; returns {row: reason word} of the bad rows."""
  manual.mkdir(parents=True, exist_ok=True)
  good = [
      json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}).encode()
      for i in range(1, 9)
  ]
  lines = [
      good[0],
      json.dumps({"question": "no answer field"}).encode(),
      good[1],
      json.dumps({"answer": "#### 3"}).encode(),
      good[2],
      b'{"question": "caf\xe9 \xff", "answer": "#### 1"}',
      good[3],
      b'{"question": "' + b"x" * (huge_mb << 20) + b'", "answer": "#### 1"',
      good[4],
      b'{"question": "' + b"y" * (huge_mb << 20) + b'", "answer": "#### 1"}',
      good[5],
  ]
  with open(manual / "train.jsonl", "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  (manual / "test.jsonl").write_bytes(b"\n".join(good[6:]) + b"\n")
  return {2: "'answer'", 4: "'question'", 6: "UTF-8", 8: "invalid JSON", 10: "characters"}


def bad_data(root, *, huge_mb=100) -> dict:
  root = Path(root)
  manual = root / "gsm8k_manual"
  bad_rows = _write_gsm8k(manual, huge_mb)
  flags = [
      "--config.data.name=gsm8k",
      "--config.data.config=",
      f"--config.data.manual_dir={manual}",
      "--config.data.prompt_style=chat",
      "--config.reward.kind=math",
      "--config.data.max_prompt_len=128",
      "--config.rollout.max_new_tokens=4",
      *quick_flags(1, 1, sft=0, prompts=2, group=2),
  ]
  import psutil

  r = Run(root / "w_gsm8k", flags, root / "logs", name="gsm8k_bad_rows")
  peak = 0.0
  while r.proc.poll() is None:
    try:
      peak = max(peak, psutil.Process(r.pid).memory_info().rss / 2**20)
    except psutil.NoSuchProcess:
      break
    time.sleep(0.2)
  rc = r.wait()
  text = r.stderr()
  logged = {n: any(f"train.jsonl:{n}" in l and word in l for l in text.splitlines()) for n, word in bad_rows.items()}
  built = list((root / "w_gsm8k" / "data" / "gsm8k").rglob("metadata.json"))  # builder.info.metadata
  skipped = json.loads(built[0].read_text()).get("skipped_rows", {}).get("train", []) if built else []
  saved = {n: any(e["file"] == "train.jsonl" and e["row"] == n for e in skipped) for n in bad_rows}
  kept = len(metrics(root / "w_gsm8k")) == 1
  # an empty file: one error naming it
  empty = root / "gsm8k_empty"
  empty.mkdir(exist_ok=True)
  (empty / "train.jsonl").write_text("")
  (empty / "test.jsonl").write_bytes(b'{"question": "q", "answer": "#### 1"}\n')
  flags_e = [f if not f.startswith("--config.data.manual_dir") else f"--config.data.manual_dir={empty}" for f in flags]
  e = Run(root / "w_gsm8k_empty", flags_e, root / "logs", name="gsm8k_empty")
  rc_e = e.wait()
  err_lines = [l for l in e.error_lines() if "error:" in l]
  ok_e = (
      rc_e != 0 and len(err_lines) == 1 and str(empty / "train.jsonl") in err_lines[0] and "Traceback" not in e.stderr()
  )
  ok = rc == 0 and kept and all(logged.values()) and all(saved.values()) and ok_e
  return row(
      "bad GSM8K files (trainer CLI)",
      f"train.jsonl: missing 'answer', missing 'question', non-UTF-8, {huge_mb} MB single lines (unterminated JSON; "
      f"a valid row with a {huge_mb} MB question), 6 good rows; and an empty train.jsonl",
      "bad rows skipped, each logged with file:row and saved in the dataset's metadata.json; training runs; empty file -> one "
      "error naming it",
      f"rc {rc}, steps run {len(metrics(root / 'w_gsm8k'))}; logged {sorted(n for n, v in logged.items() if v)} of "
      f"{sorted(bad_rows)}; in metadata.json {sorted(n for n, v in saved.items() if v)}; peak RSS {peak:.0f} MB, "
      f"{r.seconds:.0f} s; empty: rc {rc_e}, `{(err_lines[0].split('error: ')[-1][:100]) if err_lines else 'NO ERROR LINE'}`",
      ok,
      peak_rss_mb=peak,
  )


@scenario("data")
def _run(ctx: Context) -> dict:
  return bad_data(ctx.root, huge_mb=ctx.huge_mb)
