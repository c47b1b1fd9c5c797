"""What makes a run the experiment it is: the settings that decide what its steps compute (data, objective,
adapter, optimizer, schedule, seed). A checkpoint records them, and `--resume auto` into a folder whose run had
others is refused rather than continued: a job file written once (Kubernetes, SkyPilot, Ray all add `--resume
auto`) and submitted again with a new learning rate would otherwise silently continue the old experiment.

Not here: what may change between a run and its resume without changing the experiment (the step count, saving,
logging, the process count and micro-batch at the same global batch, which resume.py checks itself)."""

from __future__ import annotations

from dataclasses import fields

from .arguments import Arguments

DATA = ("task", "dataset_name", "dataset_mixture", "dataset_config", "train_split", "text_columns",
        "label_column", "messages_column", "prompt_column", "chat_template", "max_seq_length", "packing",
        "max_train_samples")  # fmt: skip
MODEL = ("dtype", "dropout", "router_aux_loss_coef", "use_lora", "lora_r", "lora_alpha", "lora_dropout",
         "lora_target_modules", "load_in_4bit", "qat")  # fmt: skip
TRAINING = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "max_grad_norm",
            "lr_scheduler_type", "warmup_ratio", "warmup_steps", "label_smoothing_factor", "seed", "data_seed",
            "neftune_noise_alpha")  # fmt: skip
RUN = ("tiny", "lr_reference_batch_size")
OPERATIONAL_POLICY = ("use_vllm", "vllm_mode", "tool_timeout")  # how completions are made, not what is learnt


def settings(args: Arguments) -> dict[str, object]:
    """The run's experiment-defining settings, by name, as JSON values."""
    found = {}
    for section, names in ((args.data, DATA), (args.model, MODEL), (args.training, TRAINING), (args.run, RUN)):
        found.update({name: getattr(section, name) for name in names if hasattr(section, name)})
    if args.data.task in ("dpo", "kto", "grpo", "rloo", "distill"):
        found.update({f.name: getattr(args.policy, f.name) for f in fields(args.policy)
                      if f.name not in OPERATIONAL_POLICY})  # fmt: skip
    return {name: plain(value) for name, value in found.items()}


def plain(value: object) -> object:
    """A value as JSON keeps it (enums by their value, anything else by its text)."""
    value = getattr(value, "value", value)
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def differences(then: dict[str, object], now: dict[str, object]) -> list[str]:
    """'name then -> now' for each setting both record and that changed."""
    return [f"{name} {then[name]} -> {now[name]}" for name in now if name in then and then[name] != now[name]]
