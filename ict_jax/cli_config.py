"""The `--config FILE --config.a.b=value` flags the commands share (`ict_jax.train`, `ict_jax.aot`):
parsed by ml_collections' config_flags, every mistake in them one line (`ConfigError`), not a
traceback."""

from __future__ import annotations

import ml_collections

from ict_jax.config import ConfigError
from ict_jax.configs import tiny as default_preset


def unknown_key_message(error: BaseException, argv) -> str:
  """ml_collections' error for an override of a key the config lacks (a KeyError, sometimes wrapped
  in an AttributeError, text "'stepz'\\nDid you mean "steps" instead of "stepz"?") as one line that
  names the override: "unknown config key 'stepz' in --config.train.stepz=3: did you mean ..."."""
  inner = error
  while isinstance(inner, BaseException) and inner.args:
    inner = inner.args[0]
  key, _, hint = str(inner).partition("\n")
  if not key.startswith("'"):  # a key under a leaf ("train.steps.x"): ml_collections' sentence
    return "unknown config key: " + " ".join(str(inner).split())
  name = key.strip("'")
  given = [a for a in argv if a.startswith("--config.") and name in a.split("=")[0].split(".")]
  where = f" in {given[0]}" if given else ""
  hint = " ".join(hint.split())
  return f"unknown config key {key}{where}" + (f": {hint[0].lower()}{hint[1:]}" if hint else "")


def parse(flag_values, argv) -> ml_collections.ConfigDict:
  """Defines `--config` (default: the embedded default, `ict_jax/configs/tiny.py`'s `get_config()`) on
  `flag_values`, parses argv with it and returns the config dict (overrides applied, locked).
  Raises ConfigError with one line for an unknown key, a value of the wrong type, a bad flag or a
  config file that does not load."""
  from absl import flags
  from ml_collections import config_flags

  try:
    config_flags.DEFINE_config_file(
        "config", default_preset.__file__, "An ml_collections config file.", flag_values=flag_values, lock_config=True
    )
    flag_values(argv)
    cd = flag_values.config
  except (AttributeError, KeyError) as e:  # an override of a key the config does not have
    raise ConfigError(unknown_key_message(e, argv)) from None
  except (flags.Error, TypeError, ValueError) as e:
    raise ConfigError(" ".join(str(e).split())) from None
  if type(cd).__name__ == "_ErrorConfig":  # ml_collections' stand-in for a file that failed to load
    raise ConfigError(
        f"--config {flag_values['config'].config_filename}: could not be loaded: "
        + " ".join(str(object.__getattribute__(cd, "_error")).split())
    )
  return cd
