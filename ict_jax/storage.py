"""Where a run's files live: a local folder or an object-store URL (gs://), through `etils.epath`.

A workdir may be a bucket: checkpoints (Orbax / tensorstore), the logs, TensorBoard events,
config.json, task_vocab.json, evaluation results, the analysis page and exported models are all
written through epath (fsspec's gcsfs for gs://, installed by requirements.txt). Three things are
local even then:
  * the tfds datasets: tfds writes its ArrayRecord files with local file calls, so with a URL
    workdir `data.data_dir` defaults to tfds's own local default (`$TFDS_DATA_DIR`, else
    `~/tensorflow_datasets`), and a URL `data.data_dir` is an error;
  * files made by a local program (safetensors, Chromium's PNG) are written to a temporary local
    folder and then copied up (`upload`);
  * nothing else: an object store has no folders, so no code here relies on an empty one existing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from etils import epath

TFDS_LOCAL_DEFAULT = "~/tensorflow_datasets"  # tfds's own default data_dir ($TFDS_DATA_DIR overrides it)


def is_url(path: str | os.PathLike) -> bool:
  """gs://, s3://, ...: a path only a file-system library can reach."""
  return "://" in os.fspath(path)


def check_backend(path: str | os.PathLike, what: str) -> None:
  """Raise ConfigError (one line, naming the package to install) when `path` is a URL whose
  file system fsspec cannot load, e.g. gs:// without gcsfs. Cheap: run it before compiling."""
  if not is_url(path):
    return
  import fsspec

  from ict_jax.errors import ConfigError

  protocol = os.fspath(path).split("://", 1)[0]
  try:
    fsspec.get_filesystem_class(protocol)
  except ImportError as e:  # fsspec's text names the package: "Please install gcsfs to access Google Storage"
    raise ConfigError(f"{what} {os.fspath(path)}: {e} (pip install -r requirements.txt installs gcsfs)") from None
  except ValueError:
    raise ConfigError(f"{what} {os.fspath(path)}: no file system for {protocol}:// URLs") from None


def check_data_dir(data_dir: str | None, what: str) -> None:
  """A tfds data_dir must be local: tfds builds ArrayRecord files with local file calls."""
  if data_dir and is_url(data_dir):
    from ict_jax.errors import ConfigError

    raise ConfigError(
        f"{what}={data_dir}: tfds writes its datasets with local file calls and cannot build them in a "
        f"bucket; give a local folder (the default for a gs:// workdir is {local_data_default()})"
    )


def local_data_default() -> str:
  """tfds's local default data_dir: $TFDS_DATA_DIR, else ~/tensorflow_datasets (expanded)."""
  return os.path.expanduser(os.environ.get("TFDS_DATA_DIR") or TFDS_LOCAL_DEFAULT)


def data_dir(configured: str | None, workdir: str | os.PathLike) -> str:
  """The tfds data_dir of a run: `configured` (config.data.data_dir or a flag) when set, else
  `<workdir>/data` for a local workdir and `local_data_default()` for a URL one."""
  if configured:
    return os.path.expanduser(configured)
  if is_url(workdir):
    return local_data_default()
  return os.path.join(os.fspath(workdir), "data")


def upload(local_dir: str | os.PathLike, dest: str | os.PathLike) -> list[str]:
  """Copy every file under `local_dir` to the same relative path under `dest` (a URL or a local
  folder), streaming; returns the destination paths. Objects appear one by one."""
  src_root, dst_root = Path(local_dir), epath.Path(dest)
  written = []
  for src in sorted(p for p in src_root.rglob("*") if p.is_file()):
    dst = dst_root / src.relative_to(src_root).as_posix()
    dst.parent.mkdir(parents=True, exist_ok=True)  # a no-op on object stores
    with open(src, "rb") as r, dst.open("wb") as w:
      shutil.copyfileobj(r, w, 16 << 20)
    written.append(os.fspath(dst))
  return written
