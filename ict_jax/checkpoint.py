"""Train-state checkpoints with Orbax: async save, keep the last N, resume, restore onto another mesh.

Layout: ``<workdir>/checkpoints/<step>/`` holding two items,
  ``state``  a pytree of jax arrays (params, optimizer state, step, PRNG key data, counters),
             saved with ``StandardSave`` (OCDBT/zarr, every host writes its own shards);
  ``meta``   a small JSON dict (data-iterator position, config, ...).

Atomicity is Orbax's: a step is written under a temporary name and only appears as
``<step>/`` once complete (a rename locally, a commit marker on object stores), so a save killed
half-way leaves the previous checkpoints intact; leftover temporary directories are removed the next
time a ``Checkpointer`` opens the directory. Paths go through ``etils.epath``, so local folders and
``gs://`` buckets are handled by the same code.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)


def resolve_path(path: str | os.PathLike) -> epath.Path:
  """A local path made absolute (Orbax refuses relative ones: "Checkpoint path should be
  absolute", and the default --workdir is ./runs/default); gs:// and other URLs unchanged."""
  path = os.fspath(path)
  return epath.Path(path if "://" in path else os.path.abspath(path))


_UNREADABLE_README = (
    "Checkpoint steps that a restore could not read, moved here by ict_jax (Checkpointer.set_aside) so that\n"
    "the run could fall back to the previous step and save these steps again. Nothing here is read.\n"
)


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot be written, or no checkpoint that can be read."""


def abstract_like(tree: Any, shardings: Any) -> Any:
  """Arrays (or anything with .shape/.dtype) -> `jax.ShapeDtypeStruct`s carrying `shardings`.

  `shardings` is either one `jax.sharding.Sharding` for every leaf or a pytree of shardings with
  the structure of `tree`. The result is the `abstract_state` that `Checkpointer.restore` takes."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _check_state(step: int, state: Any) -> None:
  """Typed PRNG keys cannot go through `StandardSave`: ask for their uint32 key data instead."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      raise TypeError(
          f"checkpoint step {step}: state leaf {jax.tree_util.keystr(path)} is a typed PRNG "
          f"key ({dtype}); store jax.random.key_data(key) and rebuild it with "
          f"jax.random.wrap_key_data after restoring"
      )


class Checkpointer:
  """`<workdir>/checkpoints/<step>/{state,meta}` through one `ocp.CheckpointManager`.

  Call every method on every host (Orbax synchronises the hosts internally)."""

  def __init__(self, workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
    if int(keep) < 1:
      raise ValueError(f"Checkpointer: keep={keep} must be >= 1")
    self.workdir = resolve_path(workdir)
    self.directory = self.workdir / "checkpoints"
    self._check_writable()
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        preservation_policy=ocp.checkpoint_managers.LatestN(n=int(keep)),
        cleanup_tmp_directories=True,  # drop what killed saves left behind
        create=True,
    )
    self._mngr = ocp.CheckpointManager(self.directory, options=options)
    self._closed = False

  def _check_writable(self) -> None:
    """Create the directory and write/delete a probe file, so a bad workdir fails here, not at step N."""
    probe = self.directory / f".write-probe-{jax.process_index()}-{uuid.uuid4().hex}"
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      probe.write_text("ok")
      probe.unlink()
    except Exception as e:  # OSError locally; the gs:// backends raise their own types
      raise CheckpointError(
          f"checkpoint workdir {os.fspath(self.workdir)!r} is not writable: creating and "
          f"writing {os.fspath(self.directory)!r} failed with {type(e).__name__}: {e}"
      ) from e

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(int(step))

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    """Start saving `state` (pytree of arrays) and `meta` (JSON dict) as `step`; returns whether it started.

    Returns once the arrays are copied off the devices (the caller may then donate or delete them);
    the write continues in the background (see `wait`). A step that already exists is never
    overwritten (returns False). Without `force`, a step not newer than `latest_step()` is skipped
    too (returns False), e.g. after `restore` fell back past an unreadable newer step."""
    step = int(step)
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint step {step}: meta is not JSON-serialisable: {e}") from e
    _check_state(step, state)
    if step in self.all_steps():
      log.warning("checkpoint %s already exists; not overwriting it", os.fspath(self.step_dir(step)))
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    return bool(self._mngr.save(step, args=args, force=force))

  def wait(self) -> None:
    """Block until every pending async save is committed (re-raises a failed background save)."""
    self._mngr.wait_until_finished()

  def all_steps(self) -> list[int]:
    """Steps present, oldest first (including a save this process has started but not committed)."""
    return sorted(int(s) for s in self._mngr.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _restore_step(self, abstract_state: Any, step: int) -> tuple[Any, dict]:
    restored = _restore_items(self._mngr, step, state=ocp.args.StandardRestore(abstract_state), meta=True)
    return restored.state, dict(restored.meta)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict]:
    """-> (step, state, meta), the state placed as `abstract_state` says.

    `abstract_state`: pytree of `jax.ShapeDtypeStruct` with `.sharding` (see `abstract_like`); the
    mesh may differ from the one used at save time. `step=None` takes the newest step and, if that
    one cannot be read (truncated file, missing item, ...), warns naming its directory and falls
    back to the next older one. An explicit `step` is restored or raises `CheckpointError`."""
    self.wait()
    steps = self.all_steps()
    if step is not None:
      step = int(step)
      if step not in steps:
        raise CheckpointError(
            f"no checkpoint for step {step} in {os.fspath(self.directory)!r}; " f"available steps: {steps}"
        )
      try:
        return (step, *self._restore_step(abstract_state, step))
      except Exception as e:
        raise CheckpointError(
            f"checkpoint {os.fspath(self.step_dir(step))!r} could not be restored: " f"{type(e).__name__}: {e}"
        ) from e
    if not steps:
      raise CheckpointError(f"no checkpoints in {os.fspath(self.directory)!r}")
    failures = []
    for s in reversed(steps):
      try:
        return (s, *self._restore_step(abstract_state, s))
      except Exception as e:
        path = os.fspath(self.step_dir(s))
        log.warning(
            "checkpoint %s is unreadable (%s: %s); trying the previous step", path, type(e).__name__, str(e)[:500]
        )
        failures.append(f"{path}: {type(e).__name__}: {str(e)[:300]}")
    raise CheckpointError(
        f"no usable checkpoint in {os.fspath(self.directory)!r}; every step failed:\n  " + "\n  ".join(failures)
    )

  def set_aside(self, step: int) -> epath.Path:
    """Move step `step` (one `restore` found unreadable) out of the managed directory, to
    ``<workdir>/checkpoints_unreadable/<step>[.n]``, so that the step can be saved again; nothing
    is deleted. Returns the folder it went to (the parent folder on hosts other than 0)."""
    self.wait()
    src = self.step_dir(step)
    root = self.workdir / "checkpoints_unreadable"
    dst = root
    if jax.process_index() == 0:
      root.mkdir(parents=True, exist_ok=True)  # a no-op on object stores, which have no empty folders:
      (root / "README.txt").write_text(_UNREADABLE_README)  # this object makes the folder exist there
      dst, n = root / str(int(step)), 0
      while dst.exists():
        n += 1
        dst = root / f"{int(step)}.{n}"
      src.rename(dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"ict_jax.checkpoint.set_aside.{int(step)}")
    self._mngr.reload()
    return dst

  def close(self) -> None:
    """Wait for pending saves, then release Orbax's threads. Safe to call twice."""
    if self._closed:
      return
    self._closed = True
    # Orbax's close() does not wait for the tmp-directory cleanup it starts when opening; left
    # running, that thread dies in interpreter shutdown with a traceback (e.g. after an error).
    await_cleanup = getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _restore_items(mngr: ocp.CheckpointManager, step: int, *, state: Any = None, meta: bool = False):
  """The one Orbax restore call: the `state` item with these restore args (None: skip it) and/or
  the `meta` JSON item of `step`."""
  items = {}
  if state is not None:
    items["state"] = state
  if meta:
    items["meta"] = ocp.args.JsonRestore()
  return mngr.restore(int(step), args=ocp.args.Composite(**items))


class CheckpointReader:
  """Read-only `<workdir>/checkpoints/`: steps, meta, metadata and partial restores of the state.

  What evaluation (`eval/loading.py`) and notebooks (`inspect/reader.py`) read through; nothing is
  written (no temp-dir clean-up, no save)."""

  def __init__(self, directory: str | os.PathLike):
    self.directory = resolve_path(directory)
    if not self.directory.exists():
      raise CheckpointError(f"{os.fspath(self.directory)!r} does not exist: no checkpoints there")
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)  # read_only=True warns about the options it overrides
    try:
      self._mngr = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0),
          item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
      )
    finally:
      absl_log.setLevel(level)

  @classmethod
  def of_workdir(cls, workdir: str | os.PathLike) -> "CheckpointReader":
    """The reader of a training workdir's `checkpoints/` (a `CheckpointError` naming the workdir
    when it has none)."""
    directory = resolve_path(workdir) / "checkpoints"
    if not directory.exists():
      raise CheckpointError(
          f"{os.fspath(directory)!r} does not exist: no checkpoints in workdir {os.fspath(workdir)!r}"
      )
    return cls(directory)

  @property
  def steps(self) -> list[int]:
    """Every committed step, oldest first (re-read from the directory on each call)."""
    self._mngr.reload()
    return sorted(int(s) for s in self._mngr.all_steps())

  def pick_step(self, step: int | None = None) -> int:
    """`step` if it exists (else `CheckpointError` listing the steps); None: the latest."""
    steps = self.steps
    if not steps:
      raise CheckpointError(f"no checkpoints in {os.fspath(self.directory)!r}")
    if step is None:
      return steps[-1]
    if int(step) not in steps:
      raise CheckpointError(
          f"no checkpoint for step {step} in {os.fspath(self.directory)!r}; " f"available steps: {steps}"
      )
    return int(step)

  def meta(self, step: int) -> dict:
    """The step's JSON item (data_position, step, seed, config)."""
    return dict(_restore_items(self._mngr, step, meta=True).meta)

  def state_metadata(self, step: int) -> Any:
    """Orbax's metadata tree of the `state` item (shapes, dtypes, shardings; no array read)."""
    md = self._mngr.item_metadata(step)["state"]
    return getattr(md, "tree", md)

  def restore_state(self, step: int, target: Any, restore_args: Any = None) -> Any:
    """Only the leaves of `target` (a sub-tree of the saved state, `jax.ShapeDtypeStruct`s with
    shardings) read from `step`, each straight into its sharding (Orbax partial restore)."""
    if restore_args is None:
      restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    try:
      return _restore_items(self._mngr, step, state=args).state
    except Exception as e:
      leaves = [
          "/".join(str(getattr(k, "key", k)) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(target)
      ]
      raise CheckpointError(
          f"{os.fspath(self.directory / str(int(step)))}/state: cannot restore "
          f"{leaves[:4]} ({type(e).__name__}: {str(e)[:400]})"
      ) from e

  def close(self) -> None:
    self._mngr.close()

  def __enter__(self) -> "CheckpointReader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
