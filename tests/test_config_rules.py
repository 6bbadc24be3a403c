"""Each config field carries its rule (`config.field(default, *rules)`), the choices read from the
registries that implement them; one line per bad value, the same text as ever; the presets ship in
the package (`ict_jax/configs/`)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from ict_jax import config as config_lib
from ict_jax import configs, cpu_paths, grpo, selection
from ict_jax.data.prompts import STYLES
from ict_jax.models import config as model_config
from ict_jax.rewards.registry import KINDS, REWARDS
from ict_jax.task_vocab import VOCABS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float32", "bfloat16", "float16")
# key -> the registry its choices come from
REGISTRIES = {
    "model.dtype": model_config.DTYPES,
    "model.param_dtype": model_config.DTYPES,
    "model.remat_policy": model_config.REMAT_POLICIES,
    "model.attention": ("auto",) + model_config.ATTENTION,
    "model.kernels": ("auto",) + cpu_paths.KERNELS,
    "model.decode_attention": ("auto",) + model_config.DECODE_ATTENTION,
    "model.vocab": VOCABS,
    "data.prompt_style": STYLES,
    "rollout.dtype": ("auto",) + model_config.DTYPES,
    "rollout.decode_weights": model_config.DECODE_WEIGHTS,
    "ict.method": tuple(selection.SELECTORS),
    "ict.score": tuple(selection.SCORES),
    "ict.keep": tuple(selection.KEEPS),
    "ict.reference": tuple(selection.REFERENCES),
    "loss.loss_type": tuple(grpo.LOSS_TYPES),
    "loss.selected_norm": tuple(grpo.SELECTED_NORMS),
    "loss.advantage_scale": grpo.ADVANTAGE_SCALES,
    "optim.schedule": config_lib.SCHEDULES,
    "reward.kind": KINDS,
}
# the choices as they were spelled out before the fields carried them (the messages list them in this order)
CHOICES = {
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.remat_policy": ("none", "full", "minimal"),
    "model.vocab": ("qwen", "task"),
    "model.attention": ("auto", "einsum", "dot_product", "cudnn", "splash"),
    "model.kernels": ("auto", "portable", "cpu"),
    "model.decode_attention": ("auto", "xla", "pallas", "pallas_interpret"),
    "data.prompt_style": ("plain", "chat"),
    "ict.method": ("grpo", "entropy", "stapo", "ict"),
    "ict.score": ("js", "kl", "entropy", "random"),
    "ict.keep": ("unique", "frequent"),
    "ict.reference": ("active_mean", "others_mean", "sequence_mean"),
    "loss.loss_type": ("grpo", "bnpo", "dr_grpo", "dapo"),
    "loss.selected_norm": ("selected", "response"),
    "loss.advantage_scale": ("group", "batch", "none"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "reward.kind": ("math", "choice", "answer", "chain_steps"),
    "rollout.dtype": ("auto",) + DTYPES,
    "rollout.decode_weights": ("replicated", "tensor", "mlp"),
}
POSITIVE = {
    "rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens", "train.steps",
    "train.num_iterations", "train.checkpoint_every", "train.keep_checkpoints", "ict.chunk_size",
    "data.max_prompt_len", "warm_start.sft_batch_size", "optim.learning_rate", "reward.timeout_s",
    "train.eval_samples", "train.eval_prompts", "train.heartbeat_timeout_s", "model.lora_alpha",
    "rollout.compaction_units",
}  # fmt: skip
NON_NEGATIVE = {
    "ict.warmup_steps", "train.micro_batch_size", "train.token_budget", "train.micro_batch_tokens",
    "train.eval_every", "warm_start.sft_steps", "optim.warmup_steps", "optim.weight_decay",
    "optim.max_grad_norm", "rollout.temperature", "rollout.top_k", "loss.beta", "loss.epsilon_low",
    "loss.epsilon_high", "reward.num_workers", "reward.format_weight", "train.sigterm_grace_s",
    "model.lora_rank",
}  # fmt: skip
FRACTIONS = {"ict.top_fraction", "ict.entropy_top_fraction", "ict.stapo_tau_h_quantile", "rollout.top_p"}


def _rules() -> dict[str, tuple[config_lib.Rule, ...]]:
  """ "section.key" -> the rules declared on that field."""
  return {
      f"{s.name}.{name}": rules
      for s in dataclasses.fields(config_lib.Config)
      for name, rules in config_lib.rules_of(s.default).items()
  }


def _bad(key: str, value) -> str:
  c = config_lib.default_config()
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  return str(e.value)


def test_every_choice_field_reads_its_registry():
  declared = {key: r.choices for key, rules in _rules().items() for r in rules if r.choices}
  assert declared == {key: tuple(names) for key, names in REGISTRIES.items()}
  assert declared == CHOICES
  assert set(KINDS) == set(REWARDS) - {"format"}  # "format" is added on top (reward.format_weight)


def test_the_rules_are_those_of_the_old_tables():
  kinds = lambda rule: {key for key, rules in _rules().items() if rule in rules}
  assert kinds(config_lib.positive) == POSITIVE
  assert kinds(config_lib.non_negative) == NON_NEGATIVE
  assert kinds(config_lib.fraction) == FRACTIONS
  assert kinds(config_lib.mesh_size) == {"mesh.data", "mesh.fsdp", "mesh.tensor"}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_bad_choice_is_one_line_naming_the_choices(key):
  assert _bad(key, "zz") == f"config.{key}: expected one of {CHOICES[key]}, got 'zz'"


def test_bad_values_keep_their_messages():
  assert _bad("train.steps", -5) == "config.train.steps: expected > 0, got -5"
  assert _bad("optim.learning_rate", 0) == "config.optim.learning_rate: expected > 0, got 0.0"
  assert _bad("loss.beta", -1.0) == "config.loss.beta: expected >= 0, got -1.0"
  assert _bad("ict.top_fraction", 1.5) == "config.ict.top_fraction: expected a value in (0, 1], got 1.5"
  assert _bad("rollout.top_p", 0) == "config.rollout.top_p: expected a value in (0, 1], got 0.0"
  assert _bad("mesh.fsdp", 0) == "config.mesh.fsdp: expected a positive size or -1, got 0"
  assert _bad("mesh.tensor", -2) == "config.mesh.tensor: expected a positive size or -1, got -2"
  assert _bad("rollout.group_size", 1) == "config.rollout.group_size: expected >= 2 (group advantages need a group)"
  assert _bad("rollout.group_size", 0) == "config.rollout.group_size: expected > 0, got 0"
  assert _bad("train.profile_steps", "3,1") == (
      "config.train.profile_steps: expected \"a,b\" with 1 <= a <= b (steps to trace), got '3,1'"
  )
  assert _bad("rollout.decode_batch_size", "0") == (
      "config.rollout.decode_batch_size: expected 'auto', 'all' or a positive int (as a string), got '0'"
  )
  assert _bad("rollout.decode_batch_size", "3") == (
      "config.rollout.decode_batch_size: 3 does not divide the 64 rows of a step (prompts_per_step x group_size)"
  )
  assert _bad("model.param_dtype", "bfloat16").startswith(
      "config.model.param_dtype: training keeps float32 weights, Adam moments and gradient sums (a bfloat16 weight"
  )
  assert _bad("train.micro_batch_size", 3) == (
      "config.train.micro_batch_size: 3 does not divide the 64 sequences of a step (prompts_per_step x group_size)"
  )
  assert _bad("reward.kind", "chain_steps").startswith("config.reward.kind: 'chain_steps' checks synthetic_chain's")


def test_the_first_bad_rule_is_reported_choices_first_then_sections_then_across():
  c = config_lib.default_config()
  c.train.steps, c.ict.method = 0, "zz"  # a "> 0" before a choice in field order
  with pytest.raises(config_lib.ConfigError, match="config.ict.method: expected one of"):
    config_lib.validate(c)
  c = config_lib.default_config()
  c.train.micro_batch_size, c.model.attention = 3, "cudnn"  # across sections; model's own check
  with pytest.raises(config_lib.ConfigError, match="config.model.attention: 'cudnn'"):
    config_lib.validate(c)


def test_a_method_added_to_the_registry_is_a_valid_config_value():
  code = (
      "from ict_jax import selection; "
      "selection.SELECTORS['every_other'] = selection.SELECTORS['grpo']; "
      "from ict_jax import config; c = config.default_config(); c.ict.method = 'every_other'; "
      "assert config.validate(c).ict.method == 'every_other'"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


def test_the_presets_have_one_source():
  for name, preset in (("tiny", configs.chain_config), ("tiny_arith", configs.tiny_config)):
    spec = importlib.util.spec_from_file_location(f"ict_cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert config_lib.validate(module.get_config()) == config_lib.validate(preset())
  assert configs.chain_config().data.name == "synthetic_chain"


def test_no_config_flag_runs_the_chain_preset():
  from absl import flags

  from ict_jax import cli_config

  cd = cli_config.parse(flags.FlagValues(), ["ict_jax.train"])
  assert config_lib.validate(cd) == config_lib.validate(configs.chain_config())
