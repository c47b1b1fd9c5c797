"""On-policy distillation (task distill): TRL's DistillationTrainer with the toolkit's parts in front, as for GRPO
(rl.py's OnlineRLMixin: sampling timed and counted, the prompts' order, the checkpoints) and the recipe's
rollout_func (rl.py's RolloutReplay).

Each step the student samples one completion to each prompt of the generation batch (the global batch: TRL
samples once per optimizer step), and learns the teacher's next-token distribution at every completion token: a
generalised Jensen-Shannon divergence (`beta` 0 forward KL, 0.5 JSD, 1 reverse KL), summed over the tokens and
divided by their count over the whole generation batch, all ranks (so N processes train as one). `temperature`
samples the completions and softens both distributions of the divergence too (TRL divides both models' logits by
it): the header says so. The teacher is frozen, loaded by the toolkit as the student is (its dtype and attention;
never in 4-bit, as `toolkit eval` loads it), and placed by TRL as a reference is: whole on every device under DDP,
partitioned under ZeRO-3, sharded under FSDP. Imported only by distill runs.
"""

from __future__ import annotations

from dataclasses import replace

from trl import DistillationTrainer

from ..models.loading import load_model
from .rl import OnlineRLMixin, RolloutReplay


def teacher_model(args, tokenizer):
    """The frozen teacher: the student's load settings, the teacher's weights, no adapter, and never 4-bit (a QLoRA
    student's base is): in the weights' dtype, as the plan counts it and `toolkit eval` loads it to measure the
    students against (results/held_out_teacher.py)."""
    settings = replace(args.model, model_name_or_path=args.model.teacher_model_name_or_path, use_lora=False,
                       load_in_4bit=False)  # fmt: skip
    model = load_model(settings, args.data.task, tokenizer, None)
    model.requires_grad_(False)
    return model.eval()


class RecipeDistillationTrainer(RolloutReplay, OnlineRLMixin, DistillationTrainer):
    """The toolkit's parts on TRL's `DistillationTrainer`."""

    def task_lines(self) -> tuple[str, ...]:
        """The batch arithmetic (one completion a prompt, sampled once a step) and the teacher."""
        args, policy, model = self.args, self.recipe.policy, self.recipe.model
        prompts = args.per_device_train_batch_size * args.gradient_accumulation_steps
        divergence = {0.0: "forward KL", 0.5: "Jensen-Shannon", 1.0: "reverse KL"}.get(policy.beta, "generalised JSD")
        teacher = self.teacher_model
        teacher = getattr(teacher, "module", teacher)
        parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in teacher.parameters())
        dtype = str(next(teacher.parameters()).dtype).removeprefix("torch.")
        unquantized = ", not quantized with the 4-bit student: as toolkit eval loads it" if model.load_in_4bit else ""
        return (f"generation    {prompts} prompts a device x 1 completion each step, at most "
                f"{policy.max_completion_length} tokens, temperature {policy.temperature:g}",
                f"teacher       {model.teacher_model_name_or_path} ({parameters:,} parameters, frozen, {dtype}"
                f"{unquantized}; its forward and weights are in the plans below)",
                f"loss          {divergence} (beta {policy.beta:g}) to the teacher's next-token distribution, over "
                "the completion tokens (TRL's distillation),",
                f"              both distributions at temperature {policy.temperature:g} (TRL divides both models' "
                "logits by it), the one it samples at")  # fmt: skip
