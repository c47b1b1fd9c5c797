"""A run's settings: the toolkit's argument dataclasses beside transformers' TrainingArguments, each setting
with a domain checked where it is declared (`__post_init__`), before anything loads; and what is derived from
them (the global batch, the scaled learning rate; TRL's configs: policy.py). The model's settings are
model_arguments.py's; checks of one value shared by them, values.py's. parser.py fills them from a recipe and its
overrides. The values settings are checked against (tasks, data formats, the `package:` prefix) are declared
here, in the settings' own folder: the data and model code that gives them meaning imports them from here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from ..errors import ConfigError, warn
from ..project import check_local_path
from .compile import asks_for_compile, check_backend_and_mode
from .mesh import data_parallel_replicas
from .model_arguments import ModelArguments
from .policy import DEFAULTS as POLICY_TASKS
from .policy import PolicyArguments
from .tasks import task
from .values import at_least, optional_fields_unset

# SFT row formats (data/formats.py reads each), in the order they are detected from a data set's columns.
DATA_FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")


@dataclass
class DataArguments:
    task: str = field(metadata={"help": "classification, sft, dpo, kto, grpo, rloo, distill, reward or vlm_sft."})
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub id, local file (json/jsonl/csv/parquet), folder of class subfolders, or package: path."},
    )
    dataset_mixture: str | None = field(
        default=None,
        metadata={
            "help": "Several data sets, each with the fraction of its training rows to use (above 1 repeats it): "
            "'name=0.5,other=1' (a recipe may give a dict). Replaces dataset_name; the same splits in each."
        },  # fmt: skip
    )
    data_format: str | None = field(
        default=None,
        metadata={
            "help": "sft: messages, sharegpt, alpaca, prompt_completion or text (continued pre-training). "
            "Default: detected from the columns.",
        },  # fmt: skip
    )
    dataset_config: str | None = None
    train_split: str = "train"
    eval_split: str | None = field(default=None, metadata={"help": "Split to evaluate on; else eval_fraction."})
    eval_fraction: float = field(default=0.0, metadata={"help": "Hold out this fraction of train for evaluation."})
    text_columns: str = field(default="text", metadata={"help": "classification: one column, or two comma-separated."})
    label_column: str = "label"
    messages_column: str = field(default="messages", metadata={"help": "sft: list of {role, content} messages."})
    prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "grpo, rloo: the prompts: text (the user's turn) or a conversation ending on the user's turn."
        },
    )
    chat_template: str | None = field(default=None, metadata={"help": "sft: a named template (llama3) or Jinja."})
    max_seq_length: int = field(
        default=512,
        metadata={
            "help": "Tokens a row may take (sft, classification; dpo, reward: each of a pair); grpo, rloo: the "
            "longest prompt and completion, which the memory plan sizes the training step at."
        },
    )
    packing: bool | None = field(
        default=None,
        metadata={
            "help": "sft: several conversations per row up to max_seq_length, attention kept inside each. "
            "Default: on where the model's attention supports it."
        },  # fmt: skip
    )
    image_max_pixels: int | None = field(
        default=None,
        metadata={
            "help": "vlm_sft: each image scaled down (aspect kept) to at most this many pixels before the processor "
            "(e.g. 401408 = 784 x 512: Qwen2-VL's 512 tokens); fewer image tokens where the processor's count "
            "follows the image's size. Default: as read."
        },  # fmt: skip
    )
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    text_encoding: str = field(default="utf-8", metadata={"help": "Encoding of .txt files in a class folder."})
    skip_bad_rows: bool = field(
        default=False,
        metadata={
            "help": "Leave out unusable rows (no assistant turn, null content, no label), counted, instead "
            "of stopping at the first."
        },  # fmt: skip
    )

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        task(self.task)
        at_least("max_seq_length", self.max_seq_length, 1)
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction is the share of train held out, from 0 to below 1, got "
                              f"{self.eval_fraction}: pass 0.1, say, or --eval_split <name>.")  # fmt: skip
        for name in ("max_train_samples", "max_eval_samples"):
            at_least(name, getattr(self, name), 1, " (leave it unset to use every row)")
        if self.data_format is not None and self.data_format not in DATA_FORMATS:
            raise ConfigError(f"data_format '{self.data_format}' is not one of {', '.join(DATA_FORMATS)}: pick one, or "
                              "leave it unset to detect it from the columns.")  # fmt: skip
        for name in self.sources():
            check_local_path(name, "data set", "--dataset_mixture" if self.dataset_mixture else "--dataset_name")

    def sources(self) -> dict[str, float]:
        """The data sets to train on, each with the fraction of its training rows to use."""
        mixture = self.dataset_mixture
        if not mixture:
            if not self.dataset_name:
                raise ConfigError("No data set: set dataset_name (or dataset_mixture) in the recipe, or pass "
                                  "--dataset_name.")  # fmt: skip
            return {self.dataset_name: 1.0}
        if isinstance(mixture, str):
            pairs = [part.strip().rpartition("=") for part in mixture.split(",") if part.strip()]
            mixture = {name.strip(): weight for name, _, weight in pairs} if all(eq for _, eq, _ in pairs) else {}
        try:
            weights = {str(name): float(weight) for name, weight in mixture.items()}
        except (AttributeError, TypeError, ValueError):
            weights = {}
        if not weights or any(w <= 0 for w in weights.values()):
            raise ConfigError(f"dataset_mixture {self.dataset_mixture!r} must name data sets with positive "
                              "fractions of their rows: 'org/chat=0.5,local.jsonl=1' (or a dict in the "
                              "recipe).")  # fmt: skip
        return weights


@dataclass
class RunArguments:
    tiny: bool = field(default=False, metadata={"help": "Same architecture at toy size, random init, local data."})
    gpu_type: str | None = field(default=None, metadata={"help": "Price-table entry; detected when not given."})
    hourly_usd: float | None = field(default=None, metadata={"help": "Price per device-hour, overrides the table."})
    pricing: str = field(default="on_demand", metadata={"help": "on_demand or spot."})
    cost_overhead: float = field(
        default=1.0, metadata={"help": "Multiplies every dollar figure (e.g. 1.3 for failed runs and tuning)."}
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Dense peak TFLOPS per device for MFU; from the price table when not given (GPUs)."},
    )
    memory_tbs: float | None = field(
        default=None,
        metadata={"help": "Memory bandwidth per device, TB/s, for GRPO's sampling floor; from the price table when "
                          "not given (GPUs)."},
    )  # fmt: skip
    budget_usd: float | None = field(
        default=None,
        metadata={"help": "Stop cleanly, with a checkpoint, before the run's cost (resumes included) passes this."},
    )
    force_budget: bool = field(
        default=False, metadata={"help": "Start even when the planned cost of the whole run exceeds --budget_usd."}
    )
    lr_reference_batch_size: int | None = field(
        default=None,
        metadata={"help": "Linear LR scaling: lr *= global_batch / this (Goyal et al. 2017), with warmup."},
    )
    wandb_project: str = "finetune-recipes"
    wandb_group: str | None = None
    wandb_tags: str | None = field(default=None, metadata={"help": "Extra comma-separated W&B tags."})
    resume: str | None = field(
        default=None,
        metadata={
            "help": "auto: continue from the newest complete checkpoint in output_dir (or start fresh, saying "
            "so); or a checkpoint folder."
        },  # fmt: skip
    )
    record_rank_reports: bool = field(
        default=False,
        metadata={"help": "Write rows trained on and a weight digest per rank to output_dir/rank_reports/."},
    )
    generation_samples: int = field(
        default=0,
        metadata={"help": "sft: at each evaluation, answer this many held-out prompts (OUTPUT/samples.jsonl, W&B)."},
    )
    generation_max_new_tokens: int = field(default=64, metadata={"help": "Length of each generation sample."})
    eval_after_training: bool = field(
        default=False,
        metadata={"help": "At the end: the fine-tuned model against the base on --eval_tasks (`toolkit eval`)."},
    )
    eval_tasks: str | None = field(
        default=None,
        metadata={"help": "Comma-separated: held-out, reply_choice, or lm-evaluation-harness tasks (the task's "
                          "defaults when unset)."},
    )  # fmt: skip
    eval_limit: int | None = field(default=None, metadata={"help": "At most this many examples of each harness task."})
    profile: str | None = field(
        default=None,
        metadata={"help": "Record optimizer steps FIRST-LAST (e.g. 5-8) with torch.profiler: a trace per rank and "
                          "the top operators under OUTPUT/profile/ (docs/profiling.md). Off by default."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        optional_fields_unset(self)
        at_least("eval_limit", self.eval_limit, 1)
        if self.profile is not None:
            first, dash, last = self.profile.partition("-")
            if not (first.isdigit() and (last.isdigit() or not dash) and 1 <= int(first) <= int(last or first)):
                raise ConfigError(f"profile names the optimizer steps to record, FIRST-LAST counted from 1, got "
                                  f"'{self.profile}': pass 5-8, say (after the first steps' warm-up).")  # fmt: skip
        if self.pricing not in ("on_demand", "spot"):
            raise ConfigError(f"pricing must be 'on_demand' or 'spot', got '{self.pricing}'.")
        for name in ("budget_usd", "hourly_usd", "peak_tflops", "memory_tbs"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.cost_overhead < 1:
            raise ConfigError(f"cost_overhead multiplies the cost and is at least 1, got {self.cost_overhead}.")
        at_least("lr_reference_batch_size", self.lr_reference_batch_size, 1)
        at_least("generation_samples", self.generation_samples, 0)
        at_least("generation_max_new_tokens", self.generation_max_new_tokens, 1)


def check_liger() -> None:
    """--use_liger_kernel: a GPU for its Triton kernels, and liger-kernel installed."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():  # else the first forward ends in Triton's "0 active drivers"
        raise ConfigError("--use_liger_kernel: Liger's kernels are Triton kernels for a GPU and this machine "
                          "has none: drop the flag.")  # fmt: skip
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("--use_liger_kernel needs liger-kernel: pip install -e '.[liger]', or drop the flag.")


def check_training(training: TrainingArguments) -> None:
    """The TrainingArguments fields with a domain transformers leaves to fail later (in the optimizer, the data
    loader, or the first save): checked before anything loads."""
    if training.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be positive, got {training.learning_rate:g}: pass 2e-5, say.")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        at_least(name, getattr(training, name), 1)
    if training.max_steps <= 0 and training.num_train_epochs <= 0:
        raise ConfigError(f"Nothing to train: num_train_epochs is {training.num_train_epochs:g} and max_steps is "
                          "unset: pass --num_train_epochs 1 or --max_steps N.")  # fmt: skip
    if training.use_liger_kernel:
        check_liger()
    if str(training.include_num_input_tokens_seen) not in ("no", "False"):
        raise ConfigError("include_num_input_tokens_seen: the toolkit counts every rank's real tokens itself, without "
                          "the Trainer's gather and read of every micro-batch (num_input_tokens_seen is on every log "
                          "line): drop the setting.")  # fmt: skip
    if training.warmup_steps < 0 or training.weight_decay < 0:
        raise ConfigError("warmup_steps and weight_decay cannot be negative: pass 0 to turn them off.")
    if Path(training.output_dir).exists() and not Path(training.output_dir).is_dir():
        raise ConfigError(f"output_dir {training.output_dir} is a file: pass a folder with --output_dir.")
    if str(training.save_strategy) in ("steps", "SaveStrategy.STEPS") and training.save_steps <= 0:
        raise ConfigError(f"save_strategy steps with save_steps {training.save_steps:g} never saves: pass "
                          "--save_steps N.")  # fmt: skip
    check_backend_and_mode(training.torch_compile_backend, training.torch_compile_mode)


def check_together(data: DataArguments, run: RunArguments, training: TrainingArguments) -> None:
    """Settings that are each fine but fail together, after training has started."""
    evaluates = str(getattr(training.eval_strategy, "value", training.eval_strategy)) != "no"
    if evaluates and data.eval_split is None and not data.eval_fraction:
        raise ConfigError(f"eval_strategy {training.eval_strategy.value} has nothing to evaluate on: pass "
                          "--eval_split <split> or --eval_fraction 0.1, or --eval_strategy no.")  # fmt: skip
    if run.generation_samples and (data.task != "sft" or (data.eval_split is None and not data.eval_fraction)):
        raise ConfigError("generation_samples answers held-out prompts of an sft run: give it evaluation data "
                          "(--eval_split <split> or --eval_fraction 0.1), or drop it.")  # fmt: skip
    metric = training.metric_for_best_model
    known = ["loss", *task(data.task).metrics]
    if metric is not None and metric.removeprefix("eval_") not in known:
        close = difflib.get_close_matches(metric.removeprefix("eval_"), known, n=1) or known[1:2] or known
        raise ConfigError(f"metric_for_best_model '{metric}' is not a metric this {data.task} run reports (it "
                          f"reports {', '.join(known)}): pass --metric_for_best_model {close[0]}.")  # fmt: skip
    if training.hub_model_id and not training.push_to_hub:
        warn(f"hub_model_id {training.hub_model_id} without push_to_hub: the model will not be pushed. Add "
             f"--push_to_hub true to push it at the end, or push the finished run with `python -m toolkit push "
             f"{training.output_dir} --repo_id {training.hub_model_id}`.")  # fmt: skip


ARGUMENT_CLASSES = (ModelArguments, DataArguments, PolicyArguments, RunArguments, TrainingArguments)


def global_batch_size(training: TrainingArguments) -> int:
    """Samples per optimizer step over the whole job: the ranks of a tensor-parallel group share their batch."""
    replicas = data_parallel_replicas(training.world_size)
    return training.per_device_train_batch_size * training.gradient_accumulation_steps * replicas


def scaled_learning_rate(base_lr: float, global_batch: int, reference_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr grows with the batch."""
    return base_lr * global_batch / reference_batch


def scale_learning_rate(training: TrainingArguments, reference_batch: int | None) -> float:
    """--lr_reference_batch_size: scale the learning rate to this job's global batch, in place, with a warmup;
    returns the recipe's own learning rate. Before the Trainer copies lr into DeepSpeed's "auto" values."""
    base = training.learning_rate
    if reference_batch:
        training.learning_rate = scaled_learning_rate(base, global_batch_size(training), reference_batch)
        if not training.warmup_steps:  # a large scaled lr needs a gradual start
            training.warmup_steps = 0.05
    return base


@dataclass
class Arguments:
    model: ModelArguments
    data: DataArguments
    run: RunArguments
    training: TrainingArguments  # TRL's DPOConfig, GRPOConfig, RLOOConfig or RewardConfig for their tasks
    recipe_name: str
    policy: PolicyArguments = field(default_factory=PolicyArguments)
    torch_compile: bool | str = "auto"  # as asked: True, False or auto (resolved into training by the runner)
    compile_note: str = ""  # why auto chose, for the header
    # --per_device_train_batch_size auto: the rows per device and optimizer step to keep (the batch finder picks
    # the micro-batch, training/batch_finder.py), and its choice (a BatchChoice: its note goes in the header)
    batch_rows: int | None = None
    batch_choice: Any = None
    # --push_to_hub: (repo id, private, revision), pushed once at the end (the Trainer's own pushes left off)
    hub_push: tuple[str, bool, str | None] | None = None

    def __post_init__(self) -> None:
        self.torch_compile = asks_for_compile(self.torch_compile, self.training.torch_compile_backend,
                                              self.training.torch_compile_mode)  # fmt: skip

    def resolved(self) -> dict[str, Any]:
        """Everything that defines the run, JSON-serialisable, secrets masked (TrainingArguments masks *_token).
        TRL's configs repeat some of the toolkit's settings under the same names (beta, loss_type, the teacher, the
        router's loss coefficient), some as TRL holds them or left at TRL's default: the toolkit's are recorded."""
        out = {"recipe": self.recipe_name, **self.training.to_dict()}
        for part in (self.model, self.data, self.run):
            out.update(vars(part))
        if self.data.task in POLICY_TASKS:
            out.update(self.policy.recorded(self.data.task))
        out["torch_compile_setting"] = self.torch_compile
        return out
