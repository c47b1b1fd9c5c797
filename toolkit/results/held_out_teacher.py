"""A distill run's held-out evaluation: the teacher answers each held-out prompt greedily (once, at the run's
--max_completion_length), and each model is compared with the teacher at every token of those answers: the KL
divergence from the teacher's next-token distribution to the model's (`kl_to_teacher`, nats per token: what
distillation shrinks, whichever divergence it trained on) and the share of tokens where the model's first choice
is the teacher's (`agreement`). Where the data brings gold answers (a reasoning-gym problem, an `answer` column),
each model's own greedy answers are also scored by GRPO's accuracy reward (`accuracy`, `finished`), and the
teacher's once, for the ceiling: closeness to the teacher is the means, the task is the end. The teacher stays
loaded for both models, as it was beside the student in training, and is freed after the second."""

from __future__ import annotations

import sys

from .held_out_tools import end_ids
from .record import RunRecord

FIGURES = ("kl_to_teacher", "agreement")
GOLD = ("reasoning_gym", "answer")  # the columns the accuracy reward scores against (training/rewards.py)
TEACHERS: dict[str, tuple] = {}  # a run's teacher and its answers: (model, [(prompt and answer ids, answer start)])


def teacher_and_answers(record: RunRecord, tokenizer, rows) -> tuple:
    """The run's teacher (loaded as load() loads the student) and its greedy answers to the held-out prompts."""
    import torch

    from ..models.loading import load_model
    from ..settings.model_arguments import ModelArguments
    from ..settings.parser import computes_bf16

    key = str(record.folder)
    if key not in TEACHERS:
        settings = record.arguments(ModelArguments)
        name = settings.teacher_model_name_or_path
        print(f"eval: the teacher ({name}) answers the held-out prompts", file=sys.stderr, flush=True)
        teacher = load_model(ModelArguments(model_name_or_path=name, trust_remote_code=settings.trust_remote_code,
                                            dtype=settings.dtype if computes_bf16() else "float32"),
                             "distill", tokenizer, None).eval()  # fmt: skip
        answers, ends = [], end_ids(teacher, tokenizer)  # where the students' answers end too
        with torch.no_grad():
            for prompt in rows["prompt"]:
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)  # fmt: skip
                out = teacher.generate(torch.tensor([ids], device=teacher.device), do_sample=False,
                                       max_new_tokens=record.settings["max_completion_length"],
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=ends)  # fmt: skip
                answers.append((out[0].tolist(), len(ids)))
        TEACHERS[key] = teacher, answers
    return TEACHERS[key]


def held_out_teacher(record: RunRecord, model, tokenizer, rows, last: bool = False,
                     batch_size: int = 16) -> dict[str, float]:  # fmt: skip
    """The model's KL from the teacher and top-1 agreement with it over the teacher's held-out answers, and its
    own answers' accuracy where the data can score them; `last` frees the teacher afterwards."""
    import torch

    teacher, answers = teacher_and_answers(record, tokenizer, rows)
    kl, agreed, tokens = 0.0, 0, 0
    with torch.no_grad():
        for ids, start in answers:
            sequence = torch.tensor([ids], device=model.device)
            ours = torch.log_softmax(model(input_ids=sequence).logits[0, start - 1 : -1].float(), -1)
            theirs = torch.log_softmax(teacher(input_ids=sequence.to(teacher.device)).logits[0, start - 1 : -1]
                                       .float().to(ours.device), -1)  # fmt: skip
            kl += float((theirs.exp() * (theirs - ours)).sum())
            agreed += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
            tokens += len(ours)
    if last:
        TEACHERS.pop(str(record.folder), None)
    figures = {"kl_to_teacher": kl / max(tokens, 1), "agreement": agreed / max(tokens, 1)}
    if any(column in rows.column_names for column in GOLD):
        from .held_out_rewards import held_out_rewards

        if not last:  # once, before the first model's
            teachers = teacher_accuracy(record, tokenizer, rows, [ids[start:] for ids, start in answers])
            print(f"eval: the teacher's own held-out accuracy {teachers:.4g}", file=sys.stderr, flush=True)
        scored = held_out_rewards(record, model, tokenizer, rows, batch_size, rewards="accuracy")
        figures.update(accuracy=scored["accuracy"], finished=scored["finished"])
    return figures


def teacher_accuracy(record: RunRecord, tokenizer, rows, answers: list[list[int]]) -> float:
    """The accuracy reward of the teacher's greedy answers (ids, ending on its end of sequence where it ended)."""
    from .held_out_rewards import as_completions, scored, scoring_policy

    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
    return scored(scoring_policy(record, "accuracy"), rows, as_completions(texts, rows["prompt"]), answers)["accuracy"]
