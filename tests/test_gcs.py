"""A gs:// workdir end to end, against a real Cloud Storage server (tests/gcs_emulator.py).

fake-gcs-server runs on 127.0.0.1; the trainer runs as `python -m ict_jax.train` subprocesses
(the clients read the emulator's address from their environment), the read-side tools in this
process (`gcs_environ` exports the same variables). Three training runs are shared by all checks:
  ref    4 uninterrupted steps, with a profiler trace of step 2 (whose upload fails: the JAX
         profiler's own GCS client has a fixed endpoint), the reference for every comparison;
  term   SIGTERM inside step 2 -> step 2 saved, exit 0; the same command resumes to step 4;
         then the newest checkpoint (4) is truncated in the bucket and the command re-run: it
         falls back to step 3, sets step 4 aside, recomputes it.
Every comparison is against something independent of the code under test: the reference run's
metrics, objects read straight from the server's JSON API, a local export of the same step.
"""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.faults import harness

REPO = Path(__file__).resolve().parent.parent

STEPS, EVERY = 4, 3  # checkpoints at 3 and 4; a SIGTERM in step 2 saves a step no schedule does
FLAGS = harness.quick_flags(STEPS, EVERY, sft=40, extra=["--config.model.vocab=task"])  # no data_dir: the gs:// default
# sft 40: with the per-row draw keys (issue 41) 20 warm-start steps left this run at reward 0, no gradient


def _objects(gcs, prefix: str) -> list[str]:
  return [n[len(prefix) :] for n in gcs.list(prefix)]


def _steps(gcs, run: str, folder: str = "checkpoints") -> list[int]:
  """Committed checkpoint steps, from the server's listing (Orbax's commit marker on object stores)."""
  names = _objects(gcs, f"{run}/{folder}/")
  return sorted(
      int(n.split("/")[0])
      for n in names
      if n.split("/")[0].isdigit() and n.count("/") == 1 and n.endswith("/commit_success.txt")
  )


def _log(gcs, run: str, name: str = "metrics") -> list[dict]:
  """A log read from the raw part objects (not through ict_jax.logs)."""
  parts = sorted(n for n in _objects(gcs, f"{run}/{name}/") if n.endswith(".jsonl"))
  return [json.loads(line) for p in parts for line in gcs.read(f"{run}/{name}/{p}").decode().splitlines() if line]


@pytest.fixture(scope="module")
def runs(gcs, gcs_environ, tmp_path_factory):
  root = tmp_path_factory.mktemp("gcs")
  env = {**gcs.client_env(), "TFDS_DATA_DIR": str(root / "tfds")}
  logs = root / "logs"
  ref = harness.run_to_end(gcs.url("ref"), FLAGS + ["--config.train.profile_steps=2,2"], logs, "ref", extra_env=env)

  term = harness.Run(
      gcs.url("term"),
      FLAGS + ["--config.train.sigterm_grace_s=60"],
      logs,
      name="term",
      markers=True,
      sleep="step=4",  # each step holds 4 s after its start marker: the signal lands inside step 2 on any box
      extra_env=env,
  )
  assert term.wait_event("step_end", 1), term.stderr()[-3000:]
  assert term.wait_event("step_start", 2), term.stderr()[-3000:]
  term.proc.send_signal(signal.SIGTERM)
  term_rc = term.wait()
  after_term = {"rc": term_rc, "steps": _steps(gcs, "term"), "metrics": _log(gcs, "term"), "err": term.stderr()}
  resume = harness.run_to_end(gcs.url("term"), FLAGS, logs, "resume", extra_env=env)
  after_resume = {"steps": _steps(gcs, "term"), "metrics": _log(gcs, "term")}

  # truncate the biggest data object of the newest step, in the bucket
  prefix = "term/checkpoints/4/state/"
  data = [n for n in gcs.list(prefix) if "/d/" in n]
  bad = max(data, key=lambda n: len(gcs.read(n)))
  from etils import epath

  blob = gcs.read(bad)
  epath.Path(f"gs://{gcs.bucket}/{bad}").write_bytes(blob[: len(blob) // 2])
  corrupt = harness.run_to_end(gcs.url("term"), FLAGS, logs, "corrupt", extra_env=env)
  return {
      "root": root,
      "ref": ref,
      "ref_rows": _log(gcs, "ref"),
      "after_term": after_term,
      "resume": resume,
      "after_resume": after_resume,
      "bad": bad,
      "corrupt": corrupt,
  }


def test_train_writes_every_file_to_the_bucket(gcs, runs):
  rows = runs["ref_rows"]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert any(r["grad_norm"] > 0 for r in rows)  # it learned: equal metrics below mean equal parameters
  names = set(_objects(gcs, "ref/"))
  assert {"config.json", "task_vocab.json", "tokens/00000003.jsonl", "tokens/00000004.jsonl"} <= names, names
  assert json.loads(gcs.read("ref/config.json"))["train"]["steps"] == STEPS
  assert json.loads(gcs.read("ref/task_vocab.json"))["qwen_ids"]
  assert [s["step"] for s in _log(gcs, "ref", "samples")][-1] == STEPS
  assert _steps(gcs, "ref") == [3, 4]
  # the tfds data went to the local default ($TFDS_DATA_DIR here), not to the bucket
  assert (runs["root"] / "tfds" / "synthetic_arith").is_dir()
  assert not any(n.startswith("data/") for n in names)
  assert "tfds data in " + str(runs["root"] / "tfds") in runs["ref"].stderr()


def test_tensorboard_events_in_the_bucket_hold_the_metrics(gcs, runs):
  from tensorboardX.proto import event_pb2

  (events,) = [n for n in gcs.list("ref/tb/") if "tfevents" in n]
  blob, pos, loss = gcs.read(events), 0, {}
  while pos < len(blob):  # TFRecord: u64 length, u32 crc, payload, u32 crc
    (n,) = struct.unpack("<Q", blob[pos : pos + 8])
    e = event_pb2.Event.FromString(blob[pos + 12 : pos + 12 + n])
    pos += 16 + n
    loss.update({e.step: v.simple_value for v in e.summary.value if v.tag == "loss"})
  assert loss == pytest.approx({r["step"]: r["loss"] for r in runs["ref_rows"]}, rel=1e-6)


def test_profiler_failure_is_a_warning(runs):
  err = runs["ref"].error_lines()
  warned = [l for l in err if "train.profile_steps: jax.profiler.stop_trace failed" in l]
  assert len(warned) == 1, err[-20:]  # once: not again from the loop's `finally`
  assert not [l for l in err if "Traceback" in l]


def test_sigterm_saves_the_step_in_flight_and_resume_equals_the_uninterrupted_run(runs):
  t = runs["after_term"]
  assert t["rc"] == 0, t["err"][-3000:]
  assert [r["step"] for r in t["metrics"]] == [1, 2] and t["steps"] == [2]
  assert "resumed from step 2" in runs["resume"].stderr()
  assert runs["after_resume"]["steps"] == [2, 3, 4]
  cmp = harness.compare(runs["ref_rows"], runs["after_resume"]["metrics"])
  assert cmp["ok"] and cmp["steps"] == STEPS, cmp


def test_corrupt_newest_checkpoint_falls_back_and_is_set_aside(gcs, runs):
  err = runs["corrupt"].stderr()
  assert f"checkpoint gs://{gcs.bucket}/term/checkpoints/4 is unreadable" in err, err[-3000:]
  assert "resumed from step 3" in err
  assert "moved unreadable checkpoint step 4 to gs://" in err
  aside = _objects(gcs, "term/checkpoints_unreadable/")
  assert "README.txt" in aside and runs["bad"].replace("term/checkpoints/", "") in aside
  assert _steps(gcs, "term") == [2, 3, 4]  # step 4 saved again
  cmp = harness.compare(runs["ref_rows"], _log(gcs, "term"))
  assert cmp["ok"] and cmp["steps"] == STEPS, cmp


def test_read_log_matches_the_objects(gcs, gcs_environ, runs):
  from ict_jax.logs import read_log

  assert read_log(gcs.url("ref")) == runs["ref_rows"]
  assert read_log(gcs.url("ref"), "samples") == _log(gcs, "ref", "samples")


def test_eval_restores_the_rewritten_step_and_writes_results(gcs, gcs_environ, runs, monkeypatch):
  from ict_jax.eval.__main__ import main

  monkeypatch.setenv("TFDS_DATA_DIR", str(runs["root"] / "tfds"))
  results = main(
      [
          *("--workdir", gcs.url("term"), "--benchmarks", "synthetic", "--k", "1", "--n", "2", "--mesh=-1,1,1"),
          *("--temperature", "1.0", "--reward_workers", "0", "--batch_size", "4", "--limit", "4", "--no_progress"),
      ]
  )
  assert results["step"] == 4
  assert json.loads(gcs.read("term/eval/step_4/results.json")) == json.loads(json.dumps(results))
  samples = [json.loads(l) for l in gcs.read("term/eval/step_4/samples_synthetic.jsonl").decode().splitlines()]
  assert len(samples) == 4 and all(len(p["completions"]) == 2 for p in samples)


def test_analyze_writes_the_page_to_the_bucket(gcs, gcs_environ, runs, tmp_path, monkeypatch):
  from ict_jax import analyze

  monkeypatch.chdir(tmp_path)
  res = analyze.analyze(gcs.url("ref"), png=False)
  assert res["step"] == 4 and res["html"] == gcs.url("ref/analysis/step_4.html")
  rows = [json.loads(l) for l in gcs.read("ref/tokens/00000004.jsonl").decode().splitlines() if l.strip()]
  assert json.loads(gcs.read("ref/analysis/step_4.json")) == json.loads(json.dumps(analyze.selection_stats(rows)))
  assert "ICT token view, step 4" in gcs.read("ref/analysis/step_4.html").decode()
  assert list(tmp_path.iterdir()) == []  # nothing under ./gs:/...


def test_export_to_the_bucket_equals_a_local_export(gcs, gcs_environ, runs, tmp_path):
  from ict_jax.export import main

  assert main(["--workdir", gcs.url("ref"), "--out", str(tmp_path / "hf")]) == 0
  assert main(["--workdir", gcs.url("ref"), "--out", gcs.url("ref/hf")]) == 0
  local = sorted(p.name for p in (tmp_path / "hf").iterdir())
  assert {"config.json", "model.safetensors", "task_vocab.json"} <= set(local)
  assert _objects(gcs, "ref/hf/") == local
  for name in local:
    assert gcs.read(f"ref/hf/{name}") == (tmp_path / "hf" / name).read_bytes(), name


def test_gs_data_dir_is_one_error_before_compiling(gcs, gcs_environ):
  from ict_jax.config import ConfigError
  from ict_jax.configs import tiny_config
  from ict_jax.train import train

  c = tiny_config()
  c.data.data_dir = gcs.url("data")
  with pytest.raises(ConfigError, match=r"config.data.data_dir=gs://.*tfds .*local folder"):
    train(c, gcs.url("bad_data_dir"), progress=False)
  assert gcs.list("bad_data_dir") == []


def test_missing_gcs_backend_is_one_line_naming_the_package(gcs, tmp_path):
  """Without gcsfs, each entry point fails with one line naming it, before JAX compiles anything."""
  script = textwrap.dedent(f"""
      import sys
      sys.modules["gcsfs"] = None  # as if not installed
      import jax.monitoring
      compiles = []
      jax.monitoring.register_event_duration_secs_listener(
          lambda name, *a, **k: compiles.append(name) if "compile" in name else None)
      url = {gcs.url("nogcsfs")!r}
      from ict_jax.config import ConfigError
      from ict_jax.logs import read_log
      try:
        read_log(url)
      except ConfigError as e:
        print("read_log:", e, file=sys.stderr)
      from ict_jax import analyze, export, train
      from ict_jax.eval import __main__ as ev
      print("export rc", export.main(["--workdir", url, "--out", "/tmp/x"]), file=sys.stderr)
      for name, fn, argv in [
          ("train", train.main, ["train", "--workdir", url, "--config", {str(REPO / "configs" / "tiny_arith.py")!r}]),
          ("eval", ev.main, ["--workdir", url, "--benchmarks", "synthetic"]),
          ("analyze", analyze.main, ["--workdir", url]),
      ]:
        try:
          fn(argv)
        except SystemExit as e:
          print(name, "exit", e.code, file=sys.stderr)
      print("compile events", len(compiles), file=sys.stderr)
      """)
  p = subprocess.run(
      [sys.executable, "-c", script],
      cwd=REPO,
      env=harness.env(**gcs.client_env()),
      capture_output=True,
      text=True,
      timeout=300,
  )
  err = p.stderr
  assert p.returncode == 0 and "Traceback" not in err, err
  lines = [l for l in err.splitlines() if "gcsfs" in l]
  assert len(lines) == 5, err  # read_log, export, train, eval, analyze: one line each
  assert all("Please install gcsfs" in l and "nogcsfs" in l for l in lines), lines
  for name in ("train", "eval", "analyze"):
    assert f"{name} exit 2" in err, err
  assert "export rc 2" in err and "compile events 0" in err
  assert gcs.list("nogcsfs") == []


def test_tfds_data_dir_defaults(tmp_path, monkeypatch):
  from ict_jax import storage
  from ict_jax.config import ConfigError

  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
  assert storage.data_dir("", "runs/a") == "runs/a/data"  # a local workdir keeps its data next to it
  assert storage.data_dir("", "gs://b/run") == str(tmp_path / "tfds")  # a bucket: tfds's local default
  assert storage.data_dir("~/d", "gs://b/run") == os.path.expanduser("~/d")
  monkeypatch.delenv("TFDS_DATA_DIR")
  assert storage.data_dir(None, "gs://b/run") == os.path.expanduser("~/tensorflow_datasets")
  with pytest.raises(ConfigError, match=r"^--data_dir=gs://b/d: tfds"):
    storage.check_data_dir("gs://b/d", "--data_dir")
  storage.check_data_dir(str(tmp_path), "--data_dir")  # local: fine
