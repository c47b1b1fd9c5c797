"""Online RL (task grpo, rloo): TRL's GRPOTrainer and RLOOTrainer with the toolkit's parts in front, as for SFT and
DPO.

Each step TRL samples --num_generations completions for each prompt of the generation batch (transformers'
generate, or vLLM on a GPU), scores them with the rewards (rewards.py), and trains on each completion's advantage:
GRPO's over its group's mean, RLOO's over the mean of its siblings (leave one out). `per_device_train_batch_size`
counts completions: a step's prompts are the global batch divided by num_generations. The reference model
(beta > 0) is TRL's: a frozen copy for a full fine-tune; under LoRA the base with a frozen copy of the starting
adapter (TRL's "ref", left out of the export). Imported only by these runs: TRL takes a second to import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

import torch
from trl import GRPOTrainer, RLOOTrainer

from ..errors import ConfigError
from ..settings.arguments import Arguments
from ..settings.objectives import RLOO, objective
from ..settings.tasks import task
from .episodes import EpisodesMixin
from .precision import fp32_kept
from .rewards import check_rewards, reward_functions, user_function
from .trainer import ToolkitTrainerMixin


def online_parts(args: Arguments, train_rows, tokenizer) -> dict:
    """What RecipeGRPOTrainer and RecipeRLOOTrainer take beside the toolkit's parts: the rewards, each called once
    on the first prompts (a broken one fails now, in one line, before any step is paid for); distillation's, the
    rollout alone (its teacher loads with the weights: runner.build_trainer)."""
    if args.policy.use_vllm:
        if not torch.cuda.is_available():
            raise ConfigError("--use_vllm true generates with vLLM, which runs on CUDA GPUs only: drop it here "
                              "(transformers' generate samples on any device).")  # fmt: skip
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--use_vllm true needs vLLM: pip install -e '.[vllm]' (on a GPU machine), or drop "
                              "it for transformers' generate.")  # fmt: skip
    rollout = user_function(args.policy.rollout_func, "rollout_func") if args.policy.rollout_func else None
    if task(args.data.task).teacher:
        return {"rollout_func": rollout}
    functions = reward_functions(args.policy)
    check_rewards(functions, [train_rows[k] for k in range(min(2, len(train_rows)))])
    parts = {"reward_funcs": functions, "rollout_func": rollout}
    if args.policy.tools or args.policy.environment:
        from .environment_checks import environment_factories
        from .tools import check_tool_template, tool_functions

        tools = [t.strip() for t in (args.policy.tools or "").split(",") if t.strip()]
        parts["tools"] = tool_functions(tools, args.policy.tool_timeout)
        check_tool_template(tokenizer, "--tools" if tools else "--environment")
        offered = [tool.__name__ for tool in parts["tools"]]
        parts["environment_factory"] = environment_factories(args.policy, train_rows, offered)
        if parts["environment_factory"] is not None:  # the header says it is TRL's experimental API, in its line
            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return parts


def trainer_class(name: str) -> type:
    """The task's trainer: RecipeGRPOTrainer or RecipeRLOOTrainer (distill's is distill.py's)."""
    return {"grpo": RecipeGRPOTrainer, "rloo": RecipeRLOOTrainer}[name]


def trainers_own(trainer, name: str):
    """The method `name` of the Trainer class under the toolkit's mixins (TRL's), past all of them: `super()` from
    one of them would start at the next, the toolkit's Loaders among them."""
    mro = type(trainer).__mro__
    last = max(k for k, cls in enumerate(mro) if cls in ToolkitTrainerMixin.__mro__ and cls is not object)
    return getattr(super(mro[last], trainer), name)


# TRL's loggers, where each warns of a completion no reward judged
TRL_LOGGERS = {name: logging.getLogger(f"trl.trainer.{name}_trainer") for name in ("grpo", "rloo")}
ALL_NONE = "All reward functions returned None"  # TRL's warning of a completion no reward judged (after its rank)


class HeldWarnings(logging.Filter):
    """Holds back a logger's records that contain `text` (in `records`), to be handled or dropped later."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.records = text, []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text in str(record.msg):
            self.records.append(record)
            return False
        return True


class OnlineRLMixin(ToolkitTrainerMixin):
    """The toolkit's parts on TRL's `GRPOTrainer` and `RLOOTrainer`, which share their hooks."""

    objective = ""  # the header's loss line
    logger = TRL_LOGGERS["grpo"]

    def environment_rewards(self) -> list[str]:  # GRPO's in an environment (episodes.py); RLOO plays none
        return []

    def environment_lines(self) -> tuple[str, ...]:
        return ()

    def _prepare_inputs(self, generation_batch):
        """TRL's: the generation batch's completions sampled and scored (once per generation), this micro-batch's
        slice returned; the tracker counts the tokens trained on (prompt and completion), known only now. A profile's
        split counts it as sampling (with the rewards and the reference's log-probabilities)."""
        with self.phase("sampling") if self.model.training else contextlib.nullcontext():
            inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            sequences = {
                "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            }
            if self.rank_reports is not None:
                self.rank_reports.record(sequences)
            self.tracker.count_batch(len(sequences["input_ids"]), sequences["attention_mask"].sum())
        return inputs

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's: every reward on the sampled completions, None as NaN, gathered over the ranks. A training step
        whose every value is None is counted (stopping.py's SafeStop.note_rewards warns once, then stops the run)
        and TRL's warning of it, a few lines with the row's columns at every such step, is left out; where only
        some completions went unjudged, TRL's warning is the notice, and stays."""
        unjudged = HeldWarnings(ALL_NONE)
        self.logger.addFilter(unjudged)
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.logger.removeFilter(unjudged)
        judged = not bool(torch.isnan(rewards).all())
        if self.model.training:
            self.safe_stop.note_rewards(judged, self.state.global_step + 1, len(rewards))
        if judged or not self.model.training:
            for record in unjudged.records:
                self.logger.handle(record)
        return rewards

    def _get_train_sampler(self, dataset=None):
        """TRL's RepeatSampler always: a prompt's group of completions must stay together, which length-grouped
        order (the toolkit's default for data with lengths: loaders.py) would break, feeding each prompt once."""
        return trainers_own(self, "_get_train_sampler")(dataset)

    def _generate(self, prompts):
        """TRL's sampling (or the recipe's rollout_func), timed apart: the step's sampling share, and tokens/s and
        MFU of its training part, in every log line (metrics/tracking.py). The continuous sampler's cast of the
        model to bf16 leaves the fp32 adapter as it was (precision.py's fp32_kept)."""
        with fp32_kept(self.model, getattr(self.args, "use_transformers_continuous_batching", False)):
            if not self.model.training:  # an evaluation's: inside its own paused clock already
                return super()._generate(prompts)
            with self.tracker.sampling():
                sampled = super()._generate(prompts)
        self.tracker.count_sampled(sum(len(ids) for ids in sampled[1]))  # (prompt ids, completion ids, ...)
        return sampled

    def task_lines(self) -> tuple[str, ...]:
        """The batch arithmetic (completions are the batch's samples: prompts x completions each) and the engine."""
        args, policy = self.args, self.recipe.policy
        completions, steps = args.generation_batch_size, args.steps_per_generation
        engine = (f"vLLM ({policy.vllm_mode})" if policy.use_vllm else "transformers' continuous batching"
                  if policy.sampler == "continuous" else "transformers' generate")  # fmt: skip
        return (f"generation    {completions // policy.num_generations} prompts x {policy.num_generations} "
                f"completions = {completions} completions every {steps} micro-batch(es), at most "
                f"{policy.max_completion_length} tokens each, temperature {policy.temperature:g}, {engine}",
                "rewards       " + ", ".join([f"{name} x {weight:g}" for name, weight in
                                              zip(policy.rewards(), policy.weights(), strict=True)]
                                             + [f"{name}'s get_reward x 1" for name in self.environment_rewards()])
                + (f"; KL to the reference, beta {policy.beta:g}" if policy.beta else "; no reference model (beta 0)"),
                *([f"tools         {policy.tools}: each call at most {policy.tool_timeout:g} s, "
                   f"{policy.max_tool_calls or 'unlimited'} round(s) a completion"] if policy.tools else []),
                *self.environment_lines(),
                f"loss          {self.objective}",
                f"              (the memory plan below is the larger phase's: sampling "
                f"{completions // self.accelerator.num_processes} rows a device at once, their KV cache at "
                f"max_seq_length {self.recipe.data.max_seq_length}, or the training step)")  # fmt: skip

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The export holds the trained adapter alone: TRL's frozen copy of the starting one ("ref", the reference
        of a LoRA run with beta > 0) served training only, and peft would save it beside it."""
        if not _internal_call and "ref" in getattr(self.model, "peft_config", {}):
            self.model.delete_adapter("ref")
        super().save_model(output_dir, _internal_call)

    def create_model_card(self, *args, **kwargs) -> None:
        """TRL writes a draft card into the output folder at each checkpoint; the toolkit writes the run's own at
        the end (results/card.py), and a checkpoint never touches the run's files."""


class RecipeGRPOTrainer(EpisodesMixin, OnlineRLMixin, GRPOTrainer):
    """The toolkit's parts on TRL's `GRPOTrainer`, and what a run in an environment shows of its episodes."""

    logger = TRL_LOGGERS["grpo"]

    def __init__(self, *args, **kwargs) -> None:
        """TRL's warnings of a loss and ratio level its papers do not pair are held back: the settings said it in
        one line, with the fix (settings/objectives.py)."""
        said = HeldWarnings("importance_sampling_level")
        self.logger.addFilter(said)
        try:
            super().__init__(*args, **kwargs)
        finally:
            self.logger.removeFilter(said)

    @property
    def objective(self) -> str:
        policy = self.recipe.policy
        return objective(policy.loss_type, policy.importance_sampling_level)


class RolloutReplay:
    """The recipe's rollout_func for trainers of TRL's that take none (RLOO's, distillation's): it produces the
    completion ids in place of sampling, the prompts tokenized as TRL's GRPO passes them to it."""

    def __init__(self, *args, rollout_func=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout_func, self.rolled = rollout_func, None

    def _generate(self, prompts):
        if self.rollout_func is None:
            return super()._generate(prompts)
        self.rolled = self.rollout_func(prompts, self)
        try:
            return super()._generate(prompts)
        finally:
            self.rolled = None

    def _tokenize_prompts(self, prompts):
        if self.rolled is None:
            return super()._tokenize_prompts(prompts)
        return self.rolled["prompt_ids"], None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        if self.rolled is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        return self.rolled["completion_ids"]


class RecipeRLOOTrainer(RolloutReplay, OnlineRLMixin, RLOOTrainer):
    """The toolkit's parts on TRL's `RLOOTrainer`, with the recipe's rollout_func (RolloutReplay)."""

    objective = RLOO
    logger = TRL_LOGGERS["rloo"]
