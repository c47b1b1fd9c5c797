"""The tasks a recipe can name, and the model classes each one loads, in one place.

The classes are named, not imported, so that reading the table costs nothing (`python -m toolkit plan` imports
it); `model_class` and friends import on use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Task:
    auto_class: str  # transformers' Auto class for the model
    peft_task_type: str  # peft's TaskType member for a LoRA adapter on it
    peft_auto_class: str  # peft's Auto class that loads base + adapter
    # Whether the model's loss is a sum over tokens divided by the Trainer's `num_items_in_batch`. A
    # classification head takes **kwargs but ignores it and returns a per-example mean; left on, the Trainer treats
    # that mean as token-normalised and multiplies loss and gradients by the number of processes, and skips the
    # division by gradient-accumulation steps.
    token_normalised_loss: bool
    # Whether the loss is scored by TRL's fused log-prob head (trl.trainer.utils.add_fused_lm_head), in tiles,
    # without the full logits: "always" (DPOTrainer's own), "gpu" (by default where TRL's Triton kernels run;
    # --fused_loss decides) or "never" (no vocabulary-wide head). The planner and the activation fit follow it.
    fused_head: str = "never"
    # Whether the run ends with the Trainer's evaluate on the held-out split: GRPO's would sample completions for a
    # loss that means nothing there; its held-out figure is the rewards of greedy answers (`toolkit eval`).
    evaluates_at_end: bool = True
    # Whether each step first samples its own completions (GRPO): the planner times that phase at the decode
    # roofline beside the training FLOPs (planner/sampling.py), a floor rather than an estimate.
    samples_online: bool = False
    # Whether a sample is a preference pair, chosen and rejected, each a sequence the step runs (dpo, reward).
    pairs: bool = False
    # Whether each step also scores the pair with a frozen reference model (DPO's; with LoRA, the adapter off).
    reference: bool = False
    # Forward passes a step runs without gradients per trained sequence, each over as many tokens: DPO's reference
    # (1); KTO's reference on the row and, for its KL estimate, the row's prompt with another row's completion
    # through the policy and the reference (3). The planner's FLOPs count them.
    scoring_passes: int = 0
    # Whether a sample is a completion labelled desirable or not (KTO's unpaired layout: prompt, completion, label).
    labelled: bool = False
    # Whether a frozen teacher scores each step's completions, in place of rewards (distill): its weights and
    # forward are in the plan (--teacher_model_name_or_path).
    teacher: bool = False
    # Whether TRL's trainer applies the chat template and tokenizes (the data room checks the rows, keeps them).
    tokenized_by_trainer: bool = False
    # Whether rows reach the collator as read (images and messages): it runs the model's processor on each batch,
    # so the Trainer keeps the columns its model does not name (remove_unused_columns off).
    images: bool = False
    # The model's outputs where the data does not say (a classifier's labels do): a reward model's one score.
    num_labels: int | None = None
    # What its evaluation reports, that --metric_for_best_model may name (besides the loss).
    metrics: tuple[str, ...] = ()
    pipeline_tag: str = "text-generation"  # the Hub's, for the model card


TASKS = {
    "classification": Task(
        "AutoModelForSequenceClassification",
        "SEQ_CLS",
        "AutoPeftModelForSequenceClassification",
        token_normalised_loss=False,
        metrics=("accuracy",),
        pipeline_tag="text-classification",
    ),
    "sft": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=True,
        fused_head="gpu",
        metrics=("perplexity", "token_accuracy"),
    ),
    # Preference tuning (DPO) on TRL's DPOTrainer: a mean over pairs, not over tokens (training/preference.py).
    "dpo": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=False,
        fused_head="always",
        pairs=True,
        reference=True,
        scoring_passes=1,
        tokenized_by_trainer=True,
        metrics=("rewards/accuracies", "rewards/margins"),
    ),
    # Preference tuning from unpaired, labelled completions (KTO) on TRL's KTOTrainer: each completion's log-ratio
    # to the reference pushed above (desirable) or below (undesirable) the batch's KL estimate (training/kto.py).
    "kto": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=False,
        fused_head="always",
        reference=True,
        scoring_passes=3,
        labelled=True,
        tokenized_by_trainer=True,
        metrics=("rewards/margins", "kl"),
    ),
    # Online RL (GRPO) on TRL's GRPOTrainer: completions sampled, scored by rewards, their advantages trained on
    # (training/rl.py); its loss is TRL's own normalisation (DAPO's by default), not the Trainer's token count, and
    # its log-probabilities come from TRL's fused head (GRPOTrainer patches it in, always).
    "grpo": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=False,
        fused_head="always",
        evaluates_at_end=False,
        samples_online=True,
        tokenized_by_trainer=True,
        metrics=("reward",),
    ),
    # Image-and-text conversations (data/vision.py): the model's own processor expands each image into its tokens
    # at batch time; the loss is the language model's next-token loss on the assistant's tokens, as sft's.
    "vlm_sft": Task(
        "AutoModelForImageTextToText",
        "CAUSAL_LM",
        "",  # peft has no Auto class for these: the base loads by auto_class, the adapter on it (models/lora.py)
        token_normalised_loss=True,
        images=True,
        metrics=("perplexity", "token_accuracy"),
        pipeline_tag="image-text-to-text",
    ),
    # Online RL with RLOO's leave-one-out baseline (TRL's RLOOTrainer): GRPO's sampling and rewards, each
    # completion's advantage its reward less its siblings' mean, a clipped objective per sequence (a mean over the
    # micro-batch's completions) and the KL to the reference as a penalty on the reward (training/rl.py).
    "rloo": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=False,
        fused_head="always",
        evaluates_at_end=False,
        samples_online=True,
        tokenized_by_trainer=True,
        metrics=("reward",),
    ),
    # On-policy distillation (TRL's DistillationTrainer): the student samples a completion to each prompt and learns
    # the teacher's next-token distribution on it (a generalised Jensen-Shannon divergence, beta 1: reverse KL), a
    # sum over the completion tokens divided by their count over the whole generation batch (training/distill.py).
    "distill": Task(
        "AutoModelForCausalLM",
        "CAUSAL_LM",
        "AutoPeftModelForCausalLM",
        token_normalised_loss=False,
        fused_head="always",
        evaluates_at_end=False,
        samples_online=True,
        teacher=True,
        tokenized_by_trainer=True,
    ),
    # A reward model (TRL's RewardTrainer): a sequence classifier with one output, trained on preference pairs to
    # score the chosen answer above the rejected one (Bradley-Terry); a GRPO recipe names its folder as a reward.
    "reward": Task(
        "AutoModelForSequenceClassification",
        "SEQ_CLS",
        "AutoPeftModelForSequenceClassification",
        token_normalised_loss=False,
        pairs=True,
        tokenized_by_trainer=True,
        num_labels=1,
        metrics=("accuracy", "margin", "mean_reward", "min_reward", "max_reward"),
        pipeline_tag="text-classification",
    ),
}

GENERATIVE = ("sft", "dpo", "kto", "grpo", "rloo", "distill", "vlm_sft")  # tasks that train a decoder's next-token head


def task(name: str) -> Task:
    """The task a recipe names; an unknown one is an error listing the known ones."""
    if name not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(repr(t) for t in TASKS)}, got '{name}'.")
    return TASKS[name]


def fused_head(name: str, setting: bool | None, on_gpu: bool) -> bool:
    """Whether the task's loss runs on TRL's fused head: `setting` is --fused_loss (None: the task's default).
    On a GPU, Triton's kernels score each tile in place; on a CPU TRL's fallback makes several fp32 copies of a
    4,096 x 32,768 tile, which saves memory only for a large vocabulary (one step of a 4-layer Llama, 2,048 tokens:
    4.2 -> 1.4 GiB at 128k, 1.7 -> 1.9 GiB at 49k), so there it is on request."""
    mode = task(name).fused_head
    if mode == "never" and setting:
        raise ConfigError(f"--fused_loss scores a language model's next-token loss; task {name} has no such head: "
                          "drop --fused_loss.")  # fmt: skip
    if mode == "always" and setting is False:
        raise ConfigError(f"task {name} always scores with TRL's fused head (its trainer's own): drop --fused_loss.")
    if mode in ("always", "never"):
        return mode == "always"
    return on_gpu if setting is None else setting


def kind_of_model(config) -> str:
    """ "encoder-decoder" (T5, BART), "encoder" (BERT-like: transformers has a masked-LM head for it) or "decoder",
    from the config alone: no family names to keep up to date."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    masked_lm = importlib.import_module("transformers").AutoModelForMaskedLM._model_mapping
    return "encoder" if type(config) in masked_lm else "decoder"


def infer_task(config) -> str:
    """The task of a model given without a recipe: classification for an encoder, sft for a decoder."""
    check_task(config, None)
    return "classification" if kind_of_model(config) == "encoder" else "sft"


def check_task(config, name: str | None) -> None:
    """Refuse, in one line naming what works, a model the task cannot train: encoder-decoders for any task (the
    toolkit trains decoders with sft and encoders with classification), and encoders for sft (transformers'
    `...ForCausalLM` of an encoder is a decoder bolted on, not the model's pretraining)."""
    if name is not None and task(name).images and architecture(config, name) is None and not config_has_code(config):
        raise ConfigError(f"{config.model_type} is not an image-text model (transformers' {task(name).auto_class} "
                          f"has no class for it): task {name} trains models such as Qwen2.5-VL, Gemma 3, SmolVLM "
                          "and LLaVA; train this one on text with --task sft.")  # fmt: skip
    kind = kind_of_model(config)
    if kind == "encoder-decoder":
        raise ConfigError(f"{config.model_type} is an encoder-decoder (sequence-to-sequence) model, which the toolkit "
                          "does not train: it fine-tunes decoders (task sft: Llama, Qwen, Gemma, ...) and encoders "
                          "(task classification: BERT, RoBERTa, DeBERTa, ...). Pick one of those.")  # fmt: skip
    if kind == "encoder" and name in GENERATIVE:
        raise ConfigError(f"{config.model_type} is an encoder (masked LM), not a chat model: fine-tune it with --task "
                          "classification (as recipes/bert.py --model_name_or_path ... does), or bring a decoder "
                          "for sft.")  # fmt: skip


def config_has_code(config) -> bool:
    """Whether the model brings its own classes (trust_remote_code): transformers' tables do not list them."""
    return bool(getattr(config, "auto_map", None))


def model_class(name: str):
    """transformers' Auto class for a task: AutoModelForCausalLM, AutoModelForSequenceClassification."""
    return getattr(importlib.import_module("transformers"), task(name).auto_class)


def peft_task_type(name: str):
    from peft import TaskType

    return TaskType[task(name).peft_task_type]


def peft_model_class(name: str):
    """peft's Auto class that loads a saved adapter on its base model."""
    return getattr(importlib.import_module("peft"), task(name).peft_auto_class)


def architecture(config, task_name: str):
    """The class transformers builds for this config and task; None for models with their own code."""
    try:
        return model_class(task_name)._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None
