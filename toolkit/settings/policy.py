"""The settings of the tasks that train a policy on TRL's trainers: dpo (DPOTrainer), kto (KTOTrainer), grpo
(GRPOTrainer) and rloo (RLOOTrainer).

They name the KL coefficient `beta` and the objective `loss_type`, as TRL does, so one class holds them, their
defaults the task's own (TRL's): dpo beta 0.1 and the sigmoid loss, kto beta 0.1 and its own loss, grpo beta 0 (no
reference model) and DAPO's token-level loss (its ratio level, GSPO's sequence one, and both checked against TRL's
lists: objectives.py), rloo beta 0.05 and its one objective. What online RL adds (rewards, completions per prompt,
sampling) is grpo's and rloo's alone; KTO's weights of the two labels, kto's: `READ_BY` says which task reads each
setting, and any other refuses it given a value. `trl_config` turns them and the run's
TrainingArguments into TRL's config for the trainer (and a reward model's TrainingArguments into TRL's
RewardConfig: that task names nothing of these).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path

from transformers import TrainingArguments

from ..errors import ConfigError
from .objectives import check_objective
from .tasks import task as task_of

# TRL's DPO losses (DPOConfig.loss_type): several, comma-separated, are summed (with TRL's loss_weights).
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
BUILT_IN = ("accuracy", "format", "length")  # the rewards named by a word (training/rewards.py's built_in)
DEFAULTS = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}, "kto": {"beta": 0.1, "loss_type": "kto"},
            "grpo": {"beta": 0.0, "loss_type": "dapo"}, "rloo": {"beta": 0.05}, "distill": {"beta": 1.0}}  # fmt: skip
KTO_WEIGHTS = ("desirable_weight", "undesirable_weight")
VLLM_MODES = ("colocate", "server")
# How grpo and rloo sample their completions: transformers' generate on the left-padded generation batch (TRL's
# default), transformers' continuous batching with a paged KV cache (TRL's use_transformers_continuous_batching), or
# vLLM.
SAMPLERS = ("generate", "continuous", "vllm")
PAGE_TOKENS = 64  # tokens a page of the paged cache holds: a short row wastes at most one page
ONLINE, SAMPLED = ("grpo", "rloo"), ("grpo", "rloo", "distill")
# Which tasks read each setting: given any other value than its default under another task (sft, classification and
# reward read none), it is refused in one line (PolicyArguments.resolve), not accepted and dropped. distill samples
# and keeps answer_pattern (its held-out accuracy: results/held_out_teacher.py), and takes no rewards or groups;
# tools are GRPO's here (TRL's DistillationTrainer could run them; the toolkit neither passes them nor evaluates a
# distilled model with them: docs/rl.md).
READ_BY: dict[str, tuple[str, ...]] = {
    "beta": ("dpo", "kto", *SAMPLED), "loss_type": ("dpo", "kto", "grpo"), "importance_sampling_level": ("grpo",),
    "reward_funcs": ONLINE, "reward_weights": ONLINE, "num_generations": ONLINE, "format_pattern": ONLINE,
    "answer_pattern": SAMPLED, "max_completion_length": SAMPLED, "temperature": SAMPLED, "rollout_func": SAMPLED,
    "use_vllm": SAMPLED, "vllm_mode": SAMPLED, "sampler": SAMPLED,
    "desirable_weight": ("kto",), "undesirable_weight": ("kto",),
    "tools": ("grpo",), "max_tool_calls": ("grpo",), "tool_timeout": ("grpo",), "environment": ("grpo",),
}  # fmt: skip


@cache
def kto_losses() -> tuple[str, ...]:
    """KTOConfig.loss_type's values, TRL's own list (the field's choices)."""
    from trl import KTOConfig

    return tuple(next(f for f in fields(KTOConfig) if f.name == "loss_type").metadata["choices"])


def paged_cache(rows: int, max_length: int) -> dict:
    """transformers' ContinuousBatchingConfig for one generation batch: pages for every row at its longest (prompt
    and completion), all rows in flight at once. Its default sizes the cache by a share of the device's free memory
    (TRL's: half), which on a CPU is half the host's RAM, per process."""
    pages = -(-max_length // PAGE_TOKENS)
    return {"page_size": PAGE_TOKENS, "num_blocks": rows * pages, "max_requests_per_batch": rows,
            "max_batch_tokens": rows * max_length}  # fmt: skip


@dataclass
class PolicyArguments:
    """task dpo, kto, grpo and rloo: TRL's settings a recipe names (the rest of their configs is TrainingArguments')."""

    beta: float | None = field(
        default=None,
        metadata={
            "help": "dpo, kto, grpo, rloo: how far the policy may move from the reference (dpo, kto 0.1; grpo "
            "0: none; rloo 0.05)."
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={
            "help": f"dpo: {', '.join(DPO_LOSSES)} (comma-separated; sigmoid); kto: kto, apo_zero_unpaired; grpo: "
            "TRL's GRPO losses (dapo); rloo has one."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "grpo: token or sequence (GSPO, LUSPO: one importance ratio a completion); TRL's."},
    )
    reward_funcs: str | None = field(
        default=None,
        metadata={
            "help": "grpo, rloo: comma-separated rewards: built-in names (accuracy, format, length), module:function, "
            "path/file.py:function, or a reward model's folder (docs/rl.md)."
        },
    )
    reward_weights: str | None = field(
        default=None, metadata={"help": "grpo, rloo: a weight per reward, comma-separated (default 1 each)."}
    )
    num_generations: int = field(default=8, metadata={"help": "grpo, rloo: completions sampled per prompt (a group)."})
    max_completion_length: int = field(default=256, metadata={"help": "grpo, rloo: tokens a completion may take."})
    temperature: float = field(default=1.0, metadata={"help": "grpo, rloo: sampling temperature of the completions."})
    answer_pattern: str = field(
        default=r"-?\d[\d,]*(?:\.\d+)?",
        metadata={
            "help": "grpo, rloo: the regular expression the accuracy reward reads a completion's answer with (its last "
            "match; a group, if it has one)."
        },
    )
    format_pattern: str | None = field(
        default=None,
        metadata={"help": "grpo, rloo: the regular expression the format reward asks a whole completion to match."},
    )
    rollout_func: str | None = field(
        default=None,
        metadata={
            "help": "grpo, rloo: module:function or path/file.py:function that produces the completions in place of "
            "sampling (TRL's rollout_func: agents, environments, an engine of your own)."
        },
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "grpo, rloo: generate with vLLM (GPU, `pip install -e '.[vllm]'`) instead of transformers' "
            "generate."
        },
    )
    desirable_weight: float = field(
        default=1.0, metadata={"help": "kto: the loss weight of desirable completions (TRL's; docs/preference.md)."}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "kto: the loss weight of undesirable completions (TRL's)."}
    )
    tools: str | None = field(
        default=None,
        metadata={"help": "grpo: comma-separated tools completions may call: calculator, module:function or "
                  "path/file.py:function (typed arguments, an Args: docstring; docs/rl.md)."},
    )  # fmt: skip
    max_tool_calls: int | None = field(
        default=None, metadata={"help": "grpo with tools: tool-calling rounds a completion may take (no limit)."}
    )
    tool_timeout: float = field(
        default=10.0, metadata={"help": "grpo, tools or an environment: seconds a call may run (then an error)."}
    )
    environment: str | None = field(
        default=None,
        metadata={"help": "grpo: the environment episodes play in, module:Class or path/file.py:Class (its methods "
                  "the tools, reset, get_reward: TRL's), or an OpenEnv server's URL (http://host:port); several as "
                  "name=module:Class,..., each row's `environment` column naming its own (docs/rl.md)."},
    )  # fmt: skip
    vllm_mode: str = field(default="colocate", metadata={"help": f"grpo, rloo with vLLM: {', '.join(VLLM_MODES)}."})
    sampler: str = field(
        default="generate",
        metadata={
            "help": "grpo, rloo: how completions are sampled: generate (transformers' generate, a padded batch), "
            "continuous (transformers' continuous batching, a paged KV cache sized to the generation batch), "
            "vllm (a GPU; the same as --use_vllm). docs/rl.md has their speeds."
        },
    )

    def resolve(self, task: str) -> None:
        """The settings the task does not read refused (READ_BY), the task's defaults for what the recipe left
        unset, and each value checked against TRL's domain."""
        check_read(self, task)
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
        if task == "kto":
            if self.beta <= 0 or min(self.desirable_weight, self.undesirable_weight) <= 0:
                raise ConfigError(f"beta ({self.beta:g}), desirable_weight ({self.desirable_weight:g}) and "
                                  f"undesirable_weight ({self.undesirable_weight:g}) must be positive: TRL's KTO "
                                  "defaults are 0.1, 1 and 1.")  # fmt: skip
            if self.loss_type not in kto_losses():
                raise ConfigError(f"loss_type {self.loss_type!r} is not among TRL's KTO losses ("
                                  f"{', '.join(kto_losses())}): pass --loss_type kto.")  # fmt: skip
        if task_of(task).samples_online:
            check_online(self, task)

    def recorded(self, task: str) -> dict:
        """The settings a run of `task` records (a DPO run's record leaves online RL's and KTO's out)."""
        own = (*DEFAULTS["dpo"], *(KTO_WEIGHTS if task == "kto" else ()))
        return {k: v for k, v in vars(self).items() if task_of(task).samples_online or k in own}

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


def check_read(policy: PolicyArguments, task: str) -> None:
    """The first setting given a value (other than its default, or empty) that `task` does not read (READ_BY), in
    one line."""
    for f in fields(PolicyArguments):
        value, readers = getattr(policy, f.name), READ_BY[f.name]
        if task not in readers and value not in (f.default, ""):
            named = ("tasks " if len(readers) > 1 else "task ") + " and ".join(", ".join(readers).rsplit(", ", 1))
            other = next((r for r in readers if r in SAMPLED), readers[0]) if task in SAMPLED else readers[0]
            raise ConfigError(f"{f.name} {value!r} is read only by {named}, and this run's task is {task}: drop it, "
                              f"or train with --task {other}.")  # fmt: skip


def check_online(policy: PolicyArguments, task: str) -> None:
    """grpo's, rloo's and distill's settings (PolicyArguments.resolve's), each against TRL's domain."""
    check_sampler(policy)
    if task_of(task).teacher:
        check_distill(policy)
        return
    if policy.beta < 0:
        raise ConfigError(f"beta must be 0 or more, got {policy.beta:g}: 0 trains without a reference model, "
                          "0.04 is DeepSeekMath's GRPO, 0.05 TRL's RLOO.")  # fmt: skip
    if task == "grpo":
        check_objective(policy.loss_type, policy.importance_sampling_level)
    if policy.num_generations < 2:
        raise ConfigError(f"num_generations must be at least 2, got {policy.num_generations}: the "
                          f"{task.upper()} advantage compares one prompt's completions with each other (8 is "
                          "TRL's default).")  # fmt: skip
    if policy.tool_timeout <= 0 or (policy.max_tool_calls is not None and policy.max_tool_calls < 1):
        raise ConfigError(f"tool_timeout ({policy.tool_timeout:g}) must be positive and max_tool_calls "
                          f"({policy.max_tool_calls}) at least 1.")  # fmt: skip
    if not policy.rewards() and not policy.environment:  # an environment's get_reward may be the reward
        raise ConfigError(f"a {task} recipe needs rewards: set reward_funcs, e.g. --reward_funcs accuracy,format "
                          "(docs/rl.md lists the built-in ones).")  # fmt: skip
    weights = policy.weights()
    if len(weights) != len(policy.rewards()):
        raise ConfigError(f"reward_weights {policy.reward_weights!r} gives {len(weights)} weights for "
                          f"{len(policy.rewards())} rewards ({', '.join(policy.rewards())}): one each, "
                          "comma-separated.")  # fmt: skip
    for pattern in (policy.answer_pattern, policy.format_pattern):
        try:
            re.compile(pattern or "")
        except re.error as error:
            raise ConfigError(f"the pattern {pattern!r} is not a regular expression ({error}).") from None


def check_sampler(policy: PolicyArguments) -> None:
    """How the online tasks sample: the engine and vLLM's mode."""
    if policy.max_completion_length < 1 or policy.temperature <= 0:
        raise ConfigError(f"max_completion_length ({policy.max_completion_length}) and temperature "
                          f"({policy.temperature:g}) must be positive.")  # fmt: skip
    if policy.vllm_mode not in VLLM_MODES:
        raise ConfigError(f"vllm_mode must be one of {', '.join(VLLM_MODES)}, got {policy.vllm_mode!r}.")
    if policy.sampler not in SAMPLERS:
        raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, got {policy.sampler!r} (docs/rl.md).")
    if policy.use_vllm and policy.sampler not in ("generate", "vllm"):
        raise ConfigError(f"use_vllm true and sampler {policy.sampler} name two samplers: pass one, --sampler "
                          f"vllm or --sampler {policy.sampler}.")  # fmt: skip
    if policy.sampler == "vllm":
        policy.use_vllm = True


def check_distill(policy: PolicyArguments) -> None:
    """distill: the divergence (TRL's beta) and its sampler (what it does not read at all: READ_BY)."""
    if not 0 <= policy.beta <= 1:
        raise ConfigError(f"beta must be in [0, 1] for distill, got {policy.beta:g}: it picks the divergence (0 "
                          "forward KL, 0.5 Jensen-Shannon, 1 reverse KL: TRL's default).")  # fmt: skip
    if policy.sampler == "continuous":
        raise ConfigError("--sampler continuous: TRL's distillation trainer samples with generate or vLLM only: "
                          "pass --sampler generate.")  # fmt: skip


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
    if task == "kto":  # its KL rows are neighbours in a fixed order (training/kto.py): TRL's sequential sampler
        from trl import KTOConfig

        if policy.loss_type == "kto" and values["per_device_train_batch_size"] < 2:
            raise ConfigError("kto: per_device_train_batch_size 1: KTO's KL estimate pairs each prompt with another "
                              "row's completion of the micro-batch, and TRL's KTOTrainer takes 2 or more rows a "
                              "device for it: raise it (lowering --gradient_accumulation_steps keeps the global "
                              "batch), or --loss_type apo_zero_unpaired, which has no KL term.")  # fmt: skip
        values["train_sampling_strategy"] = "sequential"
        return KTOConfig(**values, beta=policy.beta, loss_type=policy.loss_type, max_length=max_length,
                         desirable_weight=policy.desirable_weight, undesirable_weight=policy.undesirable_weight,
                         trust_remote_code=trust_remote_code)  # fmt: skip
    if task_of(task).samples_online:
        return online_config(policy, task, values, max_length, trust_remote_code)
    return training


def online_config(policy: PolicyArguments, task: str, values: dict, max_length: int, trust_remote_code: bool):
    """TRL's GRPOConfig, RLOOConfig or DistillationConfig: the TrainingArguments' `values` and the online settings;
    the paged cache of the continuous sampler sized to this process's generation batch."""
    import trl

    values.pop("remove_unused_columns")  # TRL's own default (False): the rewards read the data's columns
    if task_of(task).teacher:
        return trl.DistillationConfig(**values, beta=policy.beta, temperature=policy.temperature,
                                      max_completion_length=policy.max_completion_length, use_vllm=policy.use_vllm,
                                      vllm_mode=policy.vllm_mode, trust_remote_code=trust_remote_code,
                                      log_completions=False, remove_unused_columns=False)  # fmt: skip
    continuous = policy.sampler == "continuous"
    grpo = {"loss_type": policy.loss_type, "importance_sampling_level": policy.importance_sampling_level,
            "max_tool_calling_iterations": policy.max_tool_calls}  # fmt: skip
    config_class, own = (trl.GRPOConfig, grpo) if task == "grpo" else (trl.RLOOConfig, {})
    try:
        config = config_class(
            **values, **own, beta=policy.beta, reward_weights=policy.weights(), num_generations=policy.num_generations,
            temperature=policy.temperature, max_completion_length=policy.max_completion_length,
            use_vllm=policy.use_vllm, vllm_mode=policy.vllm_mode, trust_remote_code=trust_remote_code,
            log_completions=False, remove_unused_columns=False, use_transformers_continuous_batching=continuous,
        )  # fmt: skip
    except ValueError as error:  # its batch arithmetic: say it with the settings' own names
        raise ConfigError(f"{task}: {' '.join(str(error).split())}") from None
    if continuous:
        rows = config.generation_batch_size // max(config.world_size, 1)  # this process's prompts' rows
        config.transformers_continuous_batching_config = paged_cache(rows, max_length)
    return config
