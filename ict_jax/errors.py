"""The errors a bad setting raises, below every module that checks one (`ict_jax.config` re-exports
`ConfigError`, whose schema sits above the registries it reads its choices from)."""


class ConfigError(ValueError):
  """A bad configuration value; the message names the key (`config.a.b`)."""
