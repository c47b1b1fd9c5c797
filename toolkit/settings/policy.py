"""The settings of the tasks that train a policy on TRL's trainers: dpo (DPOTrainer) and grpo (GRPOTrainer).

Both name the KL coefficient `beta` and the objective `loss_type`, as TRL does, so one class holds them, their
defaults the task's own (TRL's): dpo beta 0.1 and the sigmoid loss, grpo beta 0 (no reference model) and DAPO's
token-level loss. What GRPO adds (rewards, completions per prompt, sampling) is grpo's alone. `trl_config` turns
them and the run's TrainingArguments into TRL's config for the trainer (and a reward model's TrainingArguments
into TRL's RewardConfig: that task names nothing of these).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path

from transformers import TrainingArguments

from ..errors import ConfigError

# TRL's DPO losses (DPOConfig.loss_type): several, comma-separated, are summed (with TRL's loss_weights).
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
BUILT_IN = ("accuracy", "format", "length")  # the rewards named by a word (training/rewards.py's built_in)
DEFAULTS = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}, "grpo": {"beta": 0.0, "loss_type": "dapo"}}
VLLM_MODES = ("colocate", "server")
# How grpo samples its completions: transformers' generate on the left-padded generation batch (TRL's default),
# transformers' continuous batching with a paged KV cache (TRL's use_transformers_continuous_batching), or vLLM.
SAMPLERS = ("generate", "continuous", "vllm")
PAGE_TOKENS = 64  # tokens a page of the paged cache holds: a short row wastes at most one page


@cache
def grpo_losses() -> tuple[str, ...]:
    """GRPOConfig.loss_type's values, as TRL's own help for the field lists them (it keeps no constant)."""
    from trl import GRPOConfig

    help_text = next(f for f in fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    return tuple(re.findall(r"'(\w+)'", help_text.partition("Supported values are")[2].partition(".")[0]))


def paged_cache(rows: int, max_length: int) -> dict:
    """transformers' ContinuousBatchingConfig for one generation batch: pages for every row at its longest (prompt
    and completion), all rows in flight at once. Its default sizes the cache by a share of the device's free memory
    (TRL's: half), which on a CPU is half the host's RAM, per process."""
    pages = -(-max_length // PAGE_TOKENS)
    return {"page_size": PAGE_TOKENS, "num_blocks": rows * pages, "max_requests_per_batch": rows,
            "max_batch_tokens": rows * max_length}  # fmt: skip


@dataclass
class PolicyArguments:
    """task dpo and grpo: TRL's settings a recipe names (the rest of their configs is TrainingArguments')."""

    beta: float | None = field(
        default=None,
        metadata={"help": "dpo, grpo: how far the policy may move from the reference (dpo 0.1; grpo 0: no reference)."},
    )
    loss_type: str | None = field(
        default=None,
        metadata={"help": f"dpo: {', '.join(DPO_LOSSES)} (comma-separated; sigmoid); grpo: TRL's GRPO losses (dapo)."},
    )
    reward_funcs: str | None = field(
        default=None,
        metadata={
            "help": "grpo: comma-separated rewards: built-in names (accuracy, format, length), module:function, "
            "path/file.py:function, or a reward model's folder (docs/rl.md)."
        },
    )
    reward_weights: str | None = field(
        default=None, metadata={"help": "grpo: a weight per reward, comma-separated (default 1 each)."}
    )
    num_generations: int = field(default=8, metadata={"help": "grpo: completions sampled per prompt (a group)."})
    max_completion_length: int = field(default=256, metadata={"help": "grpo: tokens a completion may take."})
    temperature: float = field(default=1.0, metadata={"help": "grpo: sampling temperature of the completions."})
    answer_pattern: str = field(
        default=r"-?\d[\d,]*(?:\.\d+)?",
        metadata={
            "help": "grpo: the regular expression the accuracy reward reads a completion's answer with (its last "
            "match; a group, if it has one)."
        },
    )
    format_pattern: str | None = field(
        default=None,
        metadata={"help": "grpo: the regular expression the format reward asks a whole completion to match."},
    )
    rollout_func: str | None = field(
        default=None,
        metadata={
            "help": "grpo: module:function or path/file.py:function that produces the completions in place of "
            "sampling (TRL's rollout_func: agents, environments, an engine of your own)."
        },
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "grpo: generate with vLLM (GPU, `pip install -e '.[vllm]'`) instead of transformers' generate."
        },
    )
    vllm_mode: str = field(default="colocate", metadata={"help": f"grpo with vLLM: {', '.join(VLLM_MODES)}."})
    sampler: str = field(
        default="generate",
        metadata={
            "help": "grpo: how completions are sampled: generate (transformers' generate, a padded batch), "
            "continuous (transformers' continuous batching, a paged KV cache sized to the generation batch), "
            "vllm (a GPU; the same as --use_vllm). docs/rl.md has their speeds."
        },
    )

    def resolve(self, task: str) -> None:
        """The task's defaults for what the recipe left unset, and each value checked against TRL's domain."""
        for name, value in DEFAULTS.get(task, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if task == "dpo":
            if self.beta <= 0:
                raise ConfigError(f"beta must be positive, got {self.beta:g}: 0.1 is TRL's default, 0.01 Zephyr's.")
            unknown = [name for name in self.losses() if name not in DPO_LOSSES]
            if unknown or not self.losses():
                raise ConfigError(f"loss_type {self.loss_type!r} is not among TRL's DPO losses ("
                                  f"{', '.join(DPO_LOSSES)}): pass --loss_type sigmoid for DPO itself.")  # fmt: skip
        if task == "grpo":
            self.check_grpo()

    def check_grpo(self) -> None:
        if self.beta < 0:
            raise ConfigError(f"beta must be 0 or more, got {self.beta:g}: 0 trains without a reference model, "
                              "0.04 is DeepSeekMath's GRPO.")  # fmt: skip
        if self.loss_type not in grpo_losses():
            raise ConfigError(f"loss_type {self.loss_type!r} is not among TRL's GRPO losses ("
                              f"{', '.join(grpo_losses())}): pass --loss_type dapo (TRL's default).")  # fmt: skip
        if self.num_generations < 2:
            raise ConfigError(f"num_generations must be at least 2, got {self.num_generations}: GRPO's "
                              "advantage compares one prompt's completions with each other (8 is TRL's "
                              "default).")  # fmt: skip
        if self.max_completion_length < 1 or self.temperature <= 0:
            raise ConfigError(f"max_completion_length ({self.max_completion_length}) and temperature "
                              f"({self.temperature:g}) must be positive.")  # fmt: skip
        if self.vllm_mode not in VLLM_MODES:
            raise ConfigError(f"vllm_mode must be one of {', '.join(VLLM_MODES)}, got {self.vllm_mode!r}.")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r} (docs/rl.md).")
        if self.use_vllm and self.sampler not in ("generate", "vllm"):
            raise ConfigError(f"use_vllm true and sampler {self.sampler} name two samplers: pass one, --sampler "
                              f"vllm or --sampler {self.sampler}.")  # fmt: skip
        if self.sampler == "vllm":
            self.use_vllm = True
        if not self.rewards():
            raise ConfigError("a grpo recipe needs rewards: set reward_funcs, e.g. --reward_funcs accuracy,format "
                              "(docs/rl.md lists the built-in ones).")  # fmt: skip
        weights = self.weights()
        if len(weights) != len(self.rewards()):
            raise ConfigError(f"reward_weights {self.reward_weights!r} gives {len(weights)} weights for "
                              f"{len(self.rewards())} rewards ({', '.join(self.rewards())}): one each, "
                              "comma-separated.")  # fmt: skip
        for pattern in (self.answer_pattern, self.format_pattern):
            try:
                re.compile(pattern or "")
            except re.error as error:
                raise ConfigError(f"the pattern {pattern!r} is not a regular expression ({error}).") from None

    def recorded(self, task: str) -> dict:
        """The settings a run of `task` records (a DPO run's record leaves GRPO's out)."""
        return {k: v for k, v in vars(self).items() if task == "grpo" or k in DEFAULTS["dpo"]}

    def losses(self) -> list[str]:
        return [name.strip() for name in (self.loss_type or "").split(",") if name.strip()]

    def rewards(self) -> list[str]:
        names = self.reward_funcs or ""  # a recipe may give a list
        names = names.split(",") if isinstance(names, str) else names
        return [str(name).strip() for name in names if str(name).strip()]

    def reward_models(self) -> list[Path]:
        """The rewards that name a model's folder (one holding a config.json; not a built-in name nor a
        module:function): TRL loads each beside the policy (training/rewards.py checks them, the planner counts
        them)."""
        folders = [Path(name).expanduser() for name in self.rewards() if ":" not in name and name not in BUILT_IN]
        return [folder for folder in folders if (folder / "config.json").is_file()]

    def weights(self) -> list[float]:
        if not self.reward_weights:
            return [1.0] * len(self.rewards())
        weights = self.reward_weights  # a recipe's list, or a recorded run's (GRPOConfig's, under the same name)
        try:
            return [float(w) for w in (weights.split(",") if isinstance(weights, str) else list(weights))]
        except (TypeError, ValueError):
            raise ConfigError(f"reward_weights {self.reward_weights!r} must be numbers, comma-separated.") from None

    def trl_config(self, task: str, training: TrainingArguments, max_length: int, trust_remote_code: bool):
        """TRL's DPOConfig, GRPOConfig or RewardConfig from the run's TrainingArguments (every field as resolved)
        and these settings; other tasks keep their TrainingArguments."""
        return trl_config(self, task, training, max_length, trust_remote_code)


def trl_config(
    policy: PolicyArguments, task: str, training: TrainingArguments, max_length: int, trust_remote_code: bool
):
    """PolicyArguments.trl_config's body: TRL's config for `task` from the run's TrainingArguments and `policy`."""
    values = {f.name: getattr(training, f.name) for f in fields(TrainingArguments) if f.init}
    if task == "reward":  # TRL's Bradley-Terry loss as it is (no margin column, no centring term)
        from trl import RewardConfig

        return RewardConfig(**values, max_length=max_length, trust_remote_code=trust_remote_code)
    if task == "dpo":
        from trl import DPOConfig

        return DPOConfig(**values, beta=policy.beta, loss_type=policy.losses(), max_length=max_length,
                         trust_remote_code=trust_remote_code)  # fmt: skip
    if task == "grpo":
        from trl import GRPOConfig

        values.pop("remove_unused_columns")  # TRL's own default (False): the rewards read the data's columns
        continuous = policy.sampler == "continuous"
        try:
            config = GRPOConfig(**values, beta=policy.beta, loss_type=policy.loss_type, reward_weights=policy.weights(),
                                num_generations=policy.num_generations, temperature=policy.temperature,
                                max_completion_length=policy.max_completion_length, use_vllm=policy.use_vllm,
                                vllm_mode=policy.vllm_mode, trust_remote_code=trust_remote_code,
                                log_completions=False, remove_unused_columns=False,
                                use_transformers_continuous_batching=continuous)  # fmt: skip
        except ValueError as error:  # its batch arithmetic: say it with the settings' own names
            raise ConfigError(f"grpo: {' '.join(str(error).split())}") from None
        if continuous:
            rows = config.generation_batch_size // max(config.world_size, 1)  # this process's prompts' rows
            config.transformers_continuous_batching_config = paged_cache(rows, max_length)
        return config
    return training
