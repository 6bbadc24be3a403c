"""The training configuration: an `ml_collections.ConfigDict` validated into frozen dataclasses.

`configs/*.py` files define `get_config()` returning a ConfigDict (usually `default_config()`
with a few fields changed; the shipped presets are `ict_jax/configs/`). `validate(cd)` turns it
into a `Config`, raising one `ConfigError` that names the key and what was expected for an unknown
key, a wrong type or a bad value. This runs at start-up, before anything is compiled.

Each field carries its rules (`field(default, *rules)`: `choices(...)`, `positive`, `non_negative`,
`fraction`, ...), the choices read from the registries that implement them, so a method added to
`selection.SELECTORS` is a valid `ict.method` with no edit here. A section's checks across its own
fields are its `check()` method; the checks across sections are `_check_across`. `validate` runs
the field rules by kind (every choice, then every `> 0`, `>= 0`, fraction and other field rule,
each kind in field order), then each section's `check()`, then `_check_across`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

import ml_collections

from ict_jax.cpu_paths import KERNELS
from ict_jax.errors import ConfigError  # noqa: F401  (re-exported: config.ConfigError)
from ict_jax.data.files import FILES
from ict_jax.data.prompts import STYLES
from ict_jax.grpo import ADVANTAGE_SCALES, LOSS_TYPES, SELECTED_NORMS
from ict_jax.lora import DEFAULT_MODULES as DEFAULT_LORA_MODULES
from ict_jax.lora import module_pattern as lora_module_pattern
from ict_jax.models.config import ATTENTION, DECODE_ATTENTION, DECODE_WEIGHTS, DTYPES, REMAT_POLICIES
from ict_jax.rewards.functions import parse_list, parse_weights
from ict_jax.rewards.registry import KINDS
from ict_jax.selection import KEEPS, REFERENCES, SCORES, SELECTORS, SEQUENCE_REFERENCE
from ict_jax.task_vocab import VOCABS

# ---- the rules a field carries -------------------------------------------------------------------
_CHOICE, _POSITIVE, _NON_NEGATIVE, _FRACTION, _OTHER = range(5)  # the order validate checks them in


@dataclasses.dataclass(frozen=True)
class Rule:
  """One field's constraint: `holds(value)`, else ConfigError "config.<key>: <message(value)>"."""

  holds: Callable[[Any], bool]
  message: Callable[[Any], str]
  kind: int = _OTHER
  choices: tuple = ()  # a choices() rule's allowed values

  def check(self, key: str, value: Any) -> None:
    if not self.holds(value):
      raise ConfigError(f"config.{key}: {self.message(value)}")


def rule(holds: Callable[[Any], bool], expected: str, kind: int = _OTHER) -> Rule:
  """The rule "expected <expected>, got <value!r>"."""
  return Rule(holds, lambda value: f"expected {expected}, got {value!r}", kind)


def choices(names) -> Rule:
  """One of `names` (a registry: its keys, in their order)."""
  names = tuple(names)
  return Rule(lambda value: value in names, lambda value: f"expected one of {names}, got {value!r}", _CHOICE, names)


positive = rule(lambda value: value > 0, "> 0", _POSITIVE)
non_negative = rule(lambda value: value >= 0, ">= 0", _NON_NEGATIVE)
fraction = rule(lambda value: 0.0 < value <= 1.0, "a value in (0, 1]", _FRACTION)
mesh_size = rule(lambda value: not (value == 0 or value < -1), "a positive size or -1")


def field(default, *rules: Rule):
  """A config field with its default and the rules its value must meet."""
  return dataclasses.field(default=default, metadata={"rules": rules})


def rules_of(section) -> dict[str, tuple[Rule, ...]]:
  """A section dataclass's field name -> its rules."""
  return {f.name: f.metadata.get("rules", ()) for f in dataclasses.fields(section)}


def _profile_ok(text: str) -> bool:
  try:
    profile_range(text)
  except ConfigError:
    return False
  return True


# Adam moments, gradient sums and the weights the updates land on follow the parameters' dtype. In
# bfloat16 (8 significant bits) an update below 2**-9 of a weight rounds away: at lr 1e-6 nearly
# every update of a weight of magnitude >= 1e-3 is lost, and bf16 moments and micro-batch gradient
# sums lose more. A float32 master copy next to bfloat16 weights would cost more memory than
# float32 weights alone (6 vs 4 bytes a parameter), so there is nothing to gain: compute runs in
# model.dtype (bfloat16) from the float32 weights.
float32_weights = Rule(
    lambda value: value == "float32",
    lambda value: (
        f"training keeps float32 weights, Adam moments and gradient sums (a {value} weight loses updates "
        f"below 2**-9 of its size, e.g. every lr 1e-6 step); got {value!r}. For bfloat16 compute set "
        f"model.dtype=bfloat16 and keep model.param_dtype=float32"
    ),
)
decode_rows = rule(
    lambda value: value in ("auto", "all") or (value.isdigit() and int(value) != 0),
    "'auto', 'all' or a positive int (as a string)",
)
a_group = Rule(lambda value: value >= 2, lambda value: "expected >= 2 (group advantages need a group)")
file_specs = rule(
    lambda text: not text or all(part.strip() for part in text.split(",")),
    "comma-separated paths, globs or hf:NAME[:SPLIT], none empty",
)
column = rule(lambda text: bool(text.strip()), "a column name")
profile_steps = rule(lambda text: not text or _profile_ok(text), '"a,b" with 1 <= a <= b (steps to trace)')
SCHEDULES = ("constant", "cosine", "linear")  # train_step.learning_rate_schedule's


def _lora_modules_error(value) -> str:
  try:
    lora_module_pattern(value)
  except ValueError as e:
    return str(e)
  return ""


lora_modules_rule = Rule(lambda value: not _lora_modules_error(value), _lora_modules_error)


# ---- the sections ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  preset: str = "tiny"  # Qwen2Config preset when `path` is empty
  path: str = ""  # Hugging Face folder (config.json + *.safetensors) or hub id (org/name: its snapshot)
  dtype: str = field("float32", choices(DTYPES))  # compute dtype
  param_dtype: str = field("float32", choices(DTYPES), float32_weights)  # master weights: float32 only
  remat_policy: str = field("none", choices(REMAT_POLICIES))  # the scanned layer's remat in the train step
  attention: str = field("auto", choices(("auto",) + ATTENTION))  # train-step attention: auto (TPU splash,
  # GPU cudnn (a float32 model: dot_product), CPU einsum), or one of models/attention.py's
  kernels: str = field("auto", choices(("auto",) + KERNELS))  # the kernels' formulation (ict_jax/cpu_paths.py):
  # auto (cpu on a single CPU device, else portable) | portable (TPU/GPU, any mesh) | cpu (XLA:CPU-tuned, same values)
  decode_attention: str = field("auto", choices(("auto",) + DECODE_ATTENTION))  # the sampler's attention
  # over the KV cache: auto (TPU pallas, else xla) | xla (einsums) | pallas (fused Pallas TPU kernel,
  # models/decode_kernel.py) | pallas_interpret (that kernel in the Pallas interpreter: slow, any backend)
  vocab: str = field("qwen", choices(VOCABS))  # qwen (Qwen2.5's 151,936 rows) | task (only the tokens of
  # the task's data, for a model trained from scratch; ict_jax/task_vocab.py)
  lora_rank: int = field(0, non_negative)  # LoRA adapters' rank (qwix, ict_jax/lora.py): 0 full fine-tuning;
  # > 0 trains only the adapters, the base frozen in the rollout dtype (no optimizer state for it)
  lora_alpha: float = field(16.0, positive)  # the adapters' scale is lora_alpha / lora_rank
  lora_modules: str = field(DEFAULT_LORA_MODULES, lora_modules_rule)  # the projections adapted: a comma
  # list of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or a regex over their paths (layers/attn/q_proj)

  def check(self) -> None:
    if self.attention == "cudnn" and self.dtype == "float32":
      raise ConfigError(
          "config.model.attention: 'cudnn' (cuDNN flash attention) computes in float16/bfloat16 "
          "only; with model.dtype=float32 use 'dot_product' or 'auto' (which picks it)"
      )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = field(1, mesh_size)
  fsdp: int = field(-1, mesh_size)  # -1: the rest of the devices
  tensor: int = field(1, mesh_size)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  name: str = "synthetic_arith"  # a builder in ict_jax.data.BUILDERS; "gsm8k+math" mixes; "files": the
  # user's files (train_files / eval_files, ict_jax/data/files.py)
  config: str = "level1"  # builder config (e.g. synthetic level), "" for the default
  data_dir: str = ""  # local tfds data_dir; "": <workdir>/data, or ~/tensorflow_datasets for a gs:// workdir
  manual_dir: str = ""  # where the downloaded GSM8K / MATH files are
  prompt_style: str = field("plain", choices(STYLES))  # "plain" (bare prompt, tiny models) or "chat" (Qwen template)
  train_split: str = "train"
  eval_split: str = "test"
  max_prompt_len: int = field(512, positive)  # longer prompts are skipped and counted
  # data.name="files": comma-separated paths or globs of .jsonl / .json / .parquet files, or hf:NAME[:SPLIT]
  # (hf:NAME:CONFIG:SPLIT; datasets.load_dataset; SPLIT defaults to train_split / eval_split)
  train_files: str = field("", file_specs)  # the train split
  eval_files: str = field("", file_specs)  # the eval split (periodic eval, `ict_jax.eval --benchmarks files`)
  prompt_field: str = field("prompt", column)  # the prompt's column: a string (data.prompt_style applies)
  # or a list of chat messages [{"role", "content"}] (TRL's conversational format: the chat template)
  answer_field: str = field("answer", column)  # the column the built-in rewards and pass@k compare against

  def check(self) -> None:
    names = self.name.split("+")
    if FILES in names and not self.train_files:
      raise ConfigError(
          "config.data.train_files: data.name='files' reads its train split from data.train_files; give "
          "paths or globs of .jsonl / .json / .parquet files, or hf:NAME[:SPLIT]"
      )
    if FILES not in names:
      for key, default in (
          ("train_files", ""),
          ("eval_files", ""),
          ("prompt_field", "prompt"),
          ("answer_field", "answer"),
      ):
        if getattr(self, key) != default:
          raise ConfigError(
              f"config.data.{key}: read with data.name='files' only; data.name is {self.name!r} "
              f"(set --config.data.name=files)"
          )
    if self.prompt_field == self.answer_field:
      raise ConfigError(f"config.data.answer_field: {self.answer_field!r} is data.prompt_field too")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_step: int = field(8, positive)  # prompts in one step's batch (all hosts)
  group_size: int = field(8, positive, a_group)  # G completions per prompt
  max_new_tokens: int = field(8, positive)
  temperature: float = field(1.0, non_negative)
  top_p: float = field(1.0, fraction)
  top_k: int = field(0, non_negative)
  dtype: str = field("auto", choices(("auto",) + DTYPES))  # rollout copy of the policy: auto (bfloat16 on
  # TPU/GPU, else model.dtype) | float32 | bfloat16 | float16
  decode_batch_size: str = field("auto", decode_rows)  # rows decoded at once: "auto" (sized from free
  # device memory; all rows on CPU) | "all" | a number dividing the step's rows
  decode_weights: str = field("tensor", choices(DECODE_WEIGHTS))  # the rollout copy's layout
  # (`sampling.policy`): "tensor" (each weight split over every chip: a decode step reads 1/chips of
  # the weights a chip, and gathers / scatters the rows around the split matmuls) | "mlp" (the MLP
  # and the head split so, the attention whole on every chip: fewer rows gathered, half the
  # collective bytes; 1.5B's recipes) | "replicated" (nothing over fsdp: every chip reads all the
  # weights a step, no collective)
  compact_rows: bool = True  # drop finished rows from the decode batch between stretches of the
  # length-bounded phases (sampling/compact.py; same tokens); False: every row decoded to the end
  compaction_units: int = field(8, positive)  # a compacted batch keeps a multiple of 1/units of a
  # chip's rows (`sampling.compacted_rows`; a unit finer than an eighth holds at least 8 rows): up
  # to `units` decode programs a phase; 16 (the 0.5B/1.5B recipes: 8 rows of 128 a chip on v5e-8)
  # drops finished rows sooner, for twice the programs to compile

  @property
  def rows(self) -> int:
    """The sequences of a step: prompts_per_step x group_size."""
    return self.prompts_per_step * self.group_size

  def check(self) -> None:
    dbs = self.decode_batch_size
    if dbs not in ("auto", "all") and self.rows % int(dbs):
      raise ConfigError(
          f"config.rollout.decode_batch_size: {dbs} does not divide the {self.rows} "
          "rows of a step (prompts_per_step x group_size)"
      )


@dataclasses.dataclass(frozen=True)
class IctConfig:
  method: str = field("ict", choices(SELECTORS))  # grpo | entropy | stapo | ict (selection.SELECTORS)
  top_fraction: float = field(0.1, fraction)  # ICT: share of each response's tokens kept (by JS)
  warmup_steps: int = field(10, non_negative)  # ICT: dense GRPO for the first steps
  entropy_top_fraction: float = field(0.2, fraction)  # 20-Entropy: share of the batch's tokens kept
  stapo_tau_p: float = 0.002
  stapo_tau_h_quantile: float = field(0.8, fraction)
  chunk_size: int = field(128, positive)  # sequence chunk of the fused LM-head / statistics pass
  sparse_backward: bool = True  # LM-head backward on the selected rows only (exact; faster)
  # ICT ablations (selection.SCORES / KEEPS / REFERENCES); top_fraction is the fourth
  score: str = field("js", choices(SCORES))  # js | kl | entropy | random: what ranks a response's tokens
  keep: str = field("unique", choices(KEEPS))  # unique (the top top_fraction) | frequent (the bottom)
  reference: str = field("active_mean", choices(REFERENCES))  # P of the JS / KL score: active_mean |
  # others_mean | sequence_mean


@dataclasses.dataclass(frozen=True)
class LossConfig:
  loss_type: str = field("grpo", choices(LOSS_TYPES))  # grpo | bnpo | dr_grpo | dapo (for method=grpo)
  selected_norm: str = field("selected", choices(SELECTED_NORMS))  # a selection's loss is normalised by
  # the selected tokens (selected: A / k_i per token) or by all valid tokens (response: A / L_i, as GRPO)
  advantage_scale: str = field("group", choices(ADVANTAGE_SCALES))  # group | batch | none
  beta: float = field(0.0, non_negative)  # k3 KL coefficient; a frozen reference is loaded when > 0
  epsilon_low: float = field(0.2, non_negative)
  epsilon_high: float = field(0.2, non_negative)
  mask_truncated_completions: bool = False  # TRL's option: completions that reach
  # rollout.max_new_tokens without a stop token get no loss (their reward still counts in the group)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = field(1e-6, positive)
  schedule: str = field("constant", choices(SCHEDULES))  # constant | cosine | linear
  warmup_steps: int = field(0, non_negative)
  weight_decay: float = field(0.0, non_negative)
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = field(1.0, non_negative)


def _weights_ok(text: str) -> bool:
  try:
    parse_weights(text)
  except ValueError:
    return False
  return True


weight_list = rule(_weights_ok, 'comma-separated finite numbers ("1.0,0.2")')


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  kind: str = field("math", choices(KINDS))  # math (last \\boxed{}) | choice (letter) | answer (bare
  # answer) | chain_steps (synthetic_chain: every worked step and the box, ict_jax/rewards/chain.py)
  format_weight: float = field(0.0, non_negative)  # added weight of the format reward
  num_workers: int = field(2, non_negative)  # verifier processes (0: in-process)
  timeout_s: float = field(5.0, positive)
  score_truncated: bool = True  # a completion that reaches rollout.max_new_tokens without a stop
  # token is scored by the verifier like any other; False: it gets `truncated_reward` instead
  # (DAPO's overlong punishment with a negative value), so running on past the answer never pays
  truncated_reward: float = 0.0
  funcs: str = ""  # "pkg.module:fn,path/to/file.py:fn2": reward functions with TRL's signature
  # fn(prompts, completions, **columns) -> list[float | None] (ict_jax/rewards/functions.py), run in
  # the reward workers; the reward is their weighted sum and replaces reward.kind (as TRL: only the
  # given functions); each one that cannot be imported is a ConfigError at start-up
  weights: str = field("", weight_list)  # "1.0,0.2": one weight per function (default: all 1)

  def check(self) -> None:
    funcs, weights = parse_list(self.funcs), parse_list(self.weights)
    if funcs and weights and len(weights) != len(funcs):
      raise ConfigError(
          f"config.reward.weights: {len(weights)} weights for the {len(funcs)} functions of reward.funcs "
          f"({', '.join(funcs)}); give one weight per function"
      )
    if funcs and self.format_weight:
      raise ConfigError(
          f"config.reward.format_weight: {self.format_weight} adds the format reward to reward.kind, which "
          f"reward.funcs replaces; set it to 0 and give a format function in reward.funcs"
      )


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """Brief supervised warm-start of a randomly initialised model (the CPU default), so that
  RL starts from a policy that sometimes succeeds. Ignored when model.path is set."""

  sft_steps: int = field(0, non_negative)
  sft_batch_size: int = field(32, positive)
  sft_learning_rate: float = 3e-3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = field(100, positive)
  num_iterations: int = field(1, positive)  # passes over each rollout batch (old log-probs kept)
  micro_batch_size: int = field(0, non_negative)  # sequences per micro-batch (0: the whole batch)
  token_budget: int = field(0, non_negative)  # > 0: the decoder runs on packed rows of this many tokens
  # (ict_jax/packing.py; at least data.max_prompt_len + rollout.max_new_tokens; cudnn attention: Hopper
  # or later); 0: padded rows
  micro_batch_tokens: int = field(0, non_negative)  # > 0 (with token_budget): micro-batches formed by
  # decoder tokens, not rows (verl's dynamic batch size): each this many tokens of packed rows, as many
  # whole groups as fit
  seed: int = 0
  checkpoint_every: int = field(50, positive)
  keep_checkpoints: int = field(3, positive)
  async_checkpointing: bool = True
  eval_every: int = field(0, non_negative)  # 0: no periodic eval
  eval_samples: int = field(4, positive)  # samples per held-out prompt for pass@k at eval time
  eval_prompts: int = field(64, positive)
  sigterm_grace_s: float = field(30.0, non_negative)
  # several processes: the coordination service declares a process dead after this long without
  # its heartbeat and ends every other one (jax.distributed.initialize's heartbeat_timeout_seconds)
  heartbeat_timeout_s: int = field(100, positive)
  profile_steps: str = field("", profile_steps)  # "a,b": a jax.profiler trace of steps a..b in <workdir>/profile

  def check(self) -> None:
    per_micro, budget = self.micro_batch_tokens, self.token_budget
    if per_micro and not budget:
      raise ConfigError(
          "config.train.micro_batch_tokens: token-budget micro-batches need packed rows; set train.token_budget"
      )
    if per_micro and per_micro < budget:
      raise ConfigError(
          f"config.train.micro_batch_tokens: {per_micro} tokens is less than one packed row "
          f"(train.token_budget = {budget}); use >= {budget}, or 0 for micro-batches of train.micro_batch_size rows"
      )
    if per_micro and self.micro_batch_size:
      raise ConfigError(
          f"config.train.micro_batch_tokens: micro-batches are formed by tokens, so train.micro_batch_size "
          f"({self.micro_batch_size}) must be 0"
      )


@dataclasses.dataclass(frozen=True)
class LogConfig:
  # also log to this Weights & Biases project from process 0 (needs `pip install wandb`); the W&B run's
  # id is kept in <workdir>/wandb_run_id.txt, so a restart continues the same W&B run
  wandb_project: str = ""


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  rollout: RolloutConfig = RolloutConfig()
  ict: IctConfig = IctConfig()
  loss: LossConfig = LossConfig()
  optim: OptimConfig = OptimConfig()
  reward: RewardConfig = RewardConfig()
  warm_start: WarmStartConfig = WarmStartConfig()
  train: TrainConfig = TrainConfig()
  log: LogConfig = LogConfig()


def default_config() -> ml_collections.ConfigDict:
  """The full default configuration as a ConfigDict (what `configs/*.py` start from).

  The defaults are the embedded CPU run: the tiny model, the synthetic task, a brief
  supervised warm-start, then ICT."""
  return ml_collections.ConfigDict(dataclasses.asdict(Config()))


def _check_type(key: str, value: Any, typ) -> Any:
  if typ is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"config.{key}: expected a bool, got {type(value).__name__} {value!r}")
    return value
  if typ is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"config.{key}: expected an int, got {type(value).__name__} {value!r}")
    return value
  if typ is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config.{key}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)
  if typ is str:
    if not isinstance(value, str):
      raise ConfigError(f"config.{key}: expected a string, got {type(value).__name__} {value!r}")
    return value
  raise TypeError(typ)


def _build(cls, values: Any, prefix: str):
  if isinstance(values, ml_collections.ConfigDict):
    values = values.to_dict()
  if not isinstance(values, dict):
    raise ConfigError(f"config.{prefix}: expected a section (dict), got {type(values).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(values) - set(fields))
  if unknown:
    where = f"config.{prefix}." if prefix else "config."
    raise ConfigError(f"{where}{unknown[0]}: unknown key; known keys are {sorted(fields)}")
  kwargs = {}
  for name, value in values.items():
    key = f"{prefix}.{name}" if prefix else name
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      kwargs[name] = _build(typ, value, key)
    else:
      kwargs[name] = _check_type(key, value, typ)
  return cls(**kwargs)


def _sections(cfg: Config) -> list[tuple[str, Any]]:
  return [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]


def validate(cd: ml_collections.ConfigDict | dict) -> Config:
  """ConfigDict -> frozen `Config`; one `ConfigError` naming the first bad key."""
  cfg = _build(Config, cd, "")
  for kind in (_CHOICE, _POSITIVE, _NON_NEGATIVE, _FRACTION, _OTHER):
    for name, section in _sections(cfg):
      for field_name, rules in rules_of(section).items():
        for r in rules:
          if r.kind == kind:
            r.check(f"{name}.{field_name}", getattr(section, field_name))
  for _, section in _sections(cfg):
    if hasattr(section, "check"):
      section.check()
  _check_across(cfg)
  return cfg


def _check_across(cfg: Config) -> None:
  """The checks that read more than one section."""
  mb, rows = cfg.train.micro_batch_size, cfg.rollout.rows
  if mb and rows % mb:
    raise ConfigError(
        f"config.train.micro_batch_size: {mb} does not divide the "
        f"{rows} sequences of a step (prompts_per_step x group_size)"
    )
  budget, longest = cfg.train.token_budget, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  if budget and budget < longest:
    raise ConfigError(
        f"config.train.token_budget: {budget} tokens a packed row is shorter than one sequence "
        f"(data.max_prompt_len + rollout.max_new_tokens = {longest}); use >= {longest}, or 0 for padded rows"
    )
  if budget:
    check_packing_attention(cfg.model.attention)
  if budget and cfg.ict.reference == SEQUENCE_REFERENCE:
    raise ConfigError(
        "config.ict.reference: 'sequence_mean' averages each response over its own positions, and "
        "the packed LM head (train.token_budget) lays several responses' column blocks side by side "
        "in one row; use train.token_budget=0 with it, or reference active_mean / others_mean"
    )
  if FILES in cfg.data.name.split("+") and cfg.train.eval_every and not cfg.data.eval_files:
    raise ConfigError(
        "config.data.eval_files: train.eval_every runs pass@k on the eval split, which data.name='files' "
        "reads from data.eval_files; give its files, or set train.eval_every=0"
    )
  if cfg.reward.kind == "chain_steps" and cfg.data.name != "synthetic_chain":
    raise ConfigError(
        f"config.reward.kind: 'chain_steps' checks synthetic_chain's worked steps; "
        f"config.data.name is {cfg.data.name!r} (use 'answer' or 'math')"
    )


def check_packing_attention(attention: str, devices=()) -> None:
  """Packed rows (train.token_budget): every implementation takes them, the cuDNN attention by
  cuDNN's sequence packing, which runs on Hopper or later GPUs; `devices` (the mesh's) are checked
  where they say their compute capability."""
  from ict_jax.models.attention import CUDNN_PACKING_CAPABILITY, compute_capability

  if attention != "cudnn":
    return
  need = ".".join(map(str, CUDNN_PACKING_CAPABILITY))
  for device in devices:
    have = getattr(device, "compute_capability", "")
    if have and compute_capability(have) < CUDNN_PACKING_CAPABILITY:
      raise ConfigError(
          f"config.train.token_budget: packed rows with model.attention 'cudnn' take cuDNN's sequence "
          f"packing, which needs compute capability >= {need} (Hopper); {device.device_kind} has {have}. "
          f"Run the padded update (--config.train.token_budget=0 --config.train.micro_batch_tokens=0 "
          f"--config.train.micro_batch_size=N), or pack with model.attention=dot_product (XLA's "
          f"attention: [T, T] masks in memory)"
      )


def profile_range(text: str) -> tuple[int, int]:
  """`train.profile_steps` "a,b" -> (a, b), steps 1-based and inclusive; ConfigError otherwise."""
  try:
    steps = [int(p) for p in text.split(",")]
  except ValueError:
    steps = []
  if len(steps) == 1:
    steps *= 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
    raise ConfigError(f'config.train.profile_steps: expected "a,b" with 1 <= a <= b (steps to trace), ' f"got {text!r}")
  return steps[0], steps[1]


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
  return validate(d)
