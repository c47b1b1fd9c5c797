"""A kto run's held-out evaluation: each model scores the held-out labelled completions by their mean log-probability
per token given the prompt (rendered with the run's chat template, as TRL's KTOTrainer renders them), averaged over
the desirable ones and over the undesirable ones; `gap` is the difference, what KTO widens. A model's own
likelihoods, with no reference model, so base and tuned compare on the same rows."""

from __future__ import annotations

import sys

FIGURES = ("desirable_logp", "undesirable_logp", "gap")


def completion_ids(tokenizer, prompt, completion) -> tuple[list[int], int]:
    """The row's tokens and where its completion starts: a conversation rendered with the chat template (the
    prompt with the generation prompt, then the whole), text as it is."""
    if isinstance(prompt, str):
        start = tokenizer(prompt)["input_ids"]
        return start + tokenizer(completion, add_special_tokens=False)["input_ids"], len(start)
    start = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=False)
    return whole, len(start)


def held_out_labelled(model, tokenizer, rows) -> dict[str, float]:
    """The mean per-token log-probability of the held-out desirable and undesirable completions, and their gap."""
    import torch
    from tqdm.auto import tqdm

    sums = {True: [], False: []}
    with torch.no_grad():
        for row in tqdm(rows, desc="held-out completions", file=sys.stderr):
            ids, start = completion_ids(tokenizer, row["prompt"], row["completion"])
            tokens = torch.tensor([ids], device=model.device)
            logps = torch.log_softmax(model(input_ids=tokens).logits[0, start - 1 : -1].float(), dim=-1)
            picked = logps.gather(1, tokens[0, start:, None]).squeeze(1)
            sums[bool(row["label"])].append(float(picked.mean()))
    desirable, undesirable = (sum(v) / len(v) if v else float("nan") for v in (sums[True], sums[False]))
    return {"desirable_logp": desirable, "undesirable_logp": undesirable, "gap": desirable - undesirable}
