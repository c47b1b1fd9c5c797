"""A distill run's held-out evaluation: the teacher answers each held-out prompt greedily (once, at the run's
--max_completion_length), and each model is compared with the teacher at every token of those answers: the KL
divergence from the teacher's next-token distribution to the model's (`kl_to_teacher`, nats per token: what
distillation shrinks, whichever divergence it trained on) and the share of tokens where the model's first choice
is the teacher's (`agreement`). The teacher stays loaded for both models, as it was beside the student in
training, and is freed after the second."""

from __future__ import annotations

import sys

from .record import RunRecord

FIGURES = ("kl_to_teacher", "agreement")
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
        answers = []
        with torch.no_grad():
            for prompt in rows["prompt"]:
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)  # fmt: skip
                out = teacher.generate(torch.tensor([ids], device=teacher.device), do_sample=False,
                                       max_new_tokens=record.settings["max_completion_length"],
                                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
                answers.append((out[0].tolist(), len(ids)))
        TEACHERS[key] = teacher, answers
    return TEACHERS[key]


def held_out_teacher(record: RunRecord, model, tokenizer, rows, last: bool = False) -> dict[str, float]:
    """The model's KL from the teacher and top-1 agreement with it over the teacher's held-out answers; `last`
    frees the teacher afterwards."""
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
    return {"kl_to_teacher": kl / max(tokens, 1), "agreement": agreed / max(tokens, 1)}
