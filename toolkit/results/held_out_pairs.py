"""A reward run's held-out evaluation: each model scores the held-out preference pairs as the run's own evaluation
did (TRL's RewardTrainer: its chat template, tokenization, cut at max_length and collator, the pairs in order),
so the tuned model's figures equal the run's last evaluation and the base model's its --eval_on_start one:
how often the chosen answer scores above the rejected one (`accuracy`) and by how much on average (`margin`)."""

from __future__ import annotations

import tempfile

from .record import RunRecord

FIGURES = ("accuracy", "margin")


def held_out_pairs(record: RunRecord, model, tokenizer, rows) -> dict[str, float]:
    """The model's accuracy and margin on the held-out pairs, averaged over the run's evaluation batches."""
    import torch
    from trl import RewardConfig, RewardTrainer

    from ..settings.parser import computes_bf16

    settings = record.settings
    with tempfile.TemporaryDirectory() as scratch:
        args = RewardConfig(output_dir=scratch, per_device_eval_batch_size=settings["per_device_eval_batch_size"],
                            max_length=settings["max_seq_length"], bf16=bool(settings.get("bf16")) and computes_bf16(),
                            fp16=bool(settings.get("fp16")), pad_to_multiple_of=settings.get("pad_to_multiple_of"),
                            report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=False)  # fmt: skip
        # RewardTrainer wants a training set: the first held-out pair stands in (nothing trains on it)
        trainer = RewardTrainer(model=model, args=args, train_dataset=rows.select(range(1)), eval_dataset=rows,
                                processing_class=tokenizer)  # fmt: skip
        metrics = trainer.evaluate()
    return {name: float(metrics[f"eval_{name}"]) for name in FIGURES}
