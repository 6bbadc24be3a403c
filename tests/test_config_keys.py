"""Every config key is read by the code: a short training run records which keys it reads; a key
that nothing reads (a dead setting) fails here, naming it."""

import dataclasses
import sys

from ict_jax import config as config_lib
from ict_jax import configs
from ict_jax.train import train


def _all_keys() -> set[str]:
  return {
      f"{s.name}.{f.name}"
      for s in dataclasses.fields(config_lib.Config)
      for f in dataclasses.fields(s.type if isinstance(s.type, type) else getattr(config_lib, s.type))
  }


def _recording(cfg: config_lib.Config, read: set[str]) -> config_lib.Config:
  """`cfg` whose sections note each key the code reads (not the whole-config copies that
  `dataclasses.asdict` makes for config.json and the checkpoint meta)."""
  sections = {}
  for section in dataclasses.fields(cfg):
    value = getattr(cfg, section.name)
    names = frozenset(f.name for f in dataclasses.fields(value))

    def getattribute(self, name, _section=section.name, _names=names):
      if name in _names and not sys._getframe(1).f_code.co_filename.endswith("dataclasses.py"):
        read.add(f"{_section}.{name}")
      return object.__getattribute__(self, name)

    cls = type(f"Recording{type(value).__name__}", (type(value),), {"__getattribute__": getattribute})
    sections[section.name] = cls(**{n: object.__getattribute__(value, n) for n in names})
  return config_lib.Config(**sections)


def test_the_recorder_sees_reads_not_whole_config_copies():
  read: set[str] = set()
  cfg = _recording(config_lib.validate(config_lib.default_config()), read)
  assert config_lib.to_dict(cfg) == config_lib.to_dict(config_lib.validate(config_lib.default_config()))
  assert read == set()  # config.json / checkpoint meta copies are not reads
  assert cfg.train.steps == 100 and cfg.optim.b1 == 0.9
  assert read == {"train.steps", "optim.b1"}


def _select_with_every_method(ict: config_lib.IctConfig, dense_loss_type: str) -> None:
  """The token selection of each method on a few rows, with the run's `ict` section (the step holds
  the section and reads a method's settings only where that method selects)."""
  import jax.numpy as jnp
  import numpy as np

  from ict_jax import selection

  rows = np.random.default_rng(0).random((4, 6)).astype(np.float32)
  arrays = dict(u=rows, entropy=rows, token_prob=rows, advantages=rows[:, 0], kl=rows, noise=rows)
  for method in selection.SELECTORS:
    selection.select_tokens(
        dataclasses.replace(ict, method=method),
        dense_loss_type,
        mask=jnp.ones((4, 6)),
        **{k: jnp.asarray(v) for k, v in arrays.items()},
    )


def test_every_config_key_is_read_by_a_training_run(tmp_path, monkeypatch):
  read: set[str] = set()
  validate = config_lib.validate
  runs = []
  monkeypatch.setattr(config_lib, "validate", lambda cd: runs.append(_recording(validate(cd), read)) or runs[-1])
  c = configs.tiny_config()
  c.warm_start.sft_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 2  # 8 rows: one per simulated device
  c.train.steps = c.train.checkpoint_every = 1
  c.train.async_checkpointing = False
  c.train.token_budget = 20  # data.max_prompt_len 16 + max_new_tokens 4: the loop's packed path runs too
  c.model.lora_rank = 2  # LoRA (qwix): lora_alpha and lora_modules are read where the adapters are made
  train(c, str(tmp_path / "run"), progress=False)
  _select_with_every_method(runs[-1].ict, runs[-1].loss.loss_type)  # the run trains with ict's only
  # a run on the user's files (data.name="files") reads its files and columns
  (tmp_path / "rows.jsonl").write_text("".join(f'{{"q": "{a}+1=", "a": "{a + 1}"}}\n' for a in range(8)))
  c.data.name, c.data.train_files = "files", str(tmp_path / "rows.jsonl")
  c.data.eval_files, c.data.prompt_field, c.data.answer_field = c.data.train_files, "q", "a"
  c.train.token_budget = 0
  train(c, str(tmp_path / "files_run"), progress=False)
  unread = sorted(_all_keys() - read)
  assert not unread, f"config keys that nothing reads (wire them or remove them): {unread}"
