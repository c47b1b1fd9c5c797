"""Is the export the model: the GGUF's greedy answers against transformers', token for token, on the same prompts.

Both sides start from the same token ids (the run's tokenizer and chat template render each prompt), so what is
compared is the model, not the tokenizers; whether llama.cpp's own tokenizer gives those ids from the rendered
text (what a llama.cpp server or Ollama does) is counted beside. transformers runs the trained model in fp32; a
16-bit GGUF then differs from it by the rounding of its weights alone, so where two answers part, the step's top two
logits on the transformers side say why: a near tie (a margin of a few hundredths) that rounding can flip, or a
real difference. Each answer stops at the run's stop tokens (stop_token_ids) or at max_new_tokens.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Reference:
    """transformers' greedy answer to one prompt: the prompt's ids, the answer's, and each step's top-two margin."""

    prompt: str  # the rendered text
    ids: list[int]
    answer: list[int]
    margins: list[float]


@dataclass
class Agreement:
    prompts: int = 0
    identical: int = 0  # answers equal token for token
    tokens: int = 0  # transformers' answer tokens, all prompts
    agreeing: int = 0  # of those, the ones before the first difference
    tokenized_alike: int = 0  # prompts llama.cpp's tokenizer turns into the same ids as the run's
    partings: list[dict] = field(default_factory=list)  # where an answer parts: prompt, step, the margin there
    tokens_per_s: float = 0.0  # llama.cpp's greedy decoding after the prompt, every core of this machine

    def line(self) -> str:
        ties = [p["margin"] for p in self.partings]
        why = f"; they part where transformers' top two logits are {max(ties):.3g} apart or less" if ties else ""
        return (f"{self.identical}/{self.prompts} answers identical, {self.agreeing}/{self.tokens} tokens before the "
                f"first difference{why}; llama.cpp tokenizes {self.tokenized_alike}/{self.prompts} prompts "
                "as the run does")  # fmt: skip

    def as_dict(self) -> dict:
        return asdict(self)


def references(model, tokenizer, prompts: list, max_new_tokens: int) -> list[Reference]:
    """transformers' greedy answers to `prompts` (conversations) with each step's margin between its top two
    logits."""
    import torch

    from ..data.conversations import stop_token_ids

    stops, out = stop_token_ids(tokenizer), []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=stops,
                                       pad_token_id=tokenizer.pad_token_id or stops[0], output_logits=True,
                                       return_dict_in_generate=True)  # fmt: skip
        top = [step[0].float().topk(2).values for step in generated.logits]
        out.append(Reference(text, ids[0].tolist(), generated.sequences[0, ids.shape[1] :].tolist(),
                             [float(t[0] - t[1]) for t in top]))  # fmt: skip
    return out


def compare(gguf: Path, refs: list[Reference], stops: list[int], n_ctx: int) -> Agreement:
    """The GGUF's greedy answers, by llama.cpp, to the references' prompt ids, against theirs."""
    from ..models.gguf_model import greedy, opened_llama

    llama = opened_llama(gguf, n_ctx)
    result, decoding, decoded = Agreement(prompts=len(refs)), 0.0, 0
    try:
        for k, ref in enumerate(refs):
            result.tokenized_alike += llama.tokenize(ref.prompt.encode(), add_bos=False, special=True) == ref.ids
            answer, seconds = greedy(llama, ref.ids, max(len(ref.answer), 1), stops)
            decoding += seconds
            decoded += len(answer) - 1  # the first came with the prompt
            same = next((i for i, (a, b) in enumerate(zip(answer, ref.answer, strict=False)) if a != b),
                        min(len(answer), len(ref.answer)))  # fmt: skip
            result.tokens += len(ref.answer)
            result.agreeing += same
            if answer == ref.answer:
                result.identical += 1
            elif same < len(ref.margins):
                result.partings.append({"prompt": k, "step": same, "margin": round(ref.margins[same], 5)})
            print(f"  {k + 1}/{len(refs)} prompts compared ({gguf.name})", file=sys.stderr, flush=True)
    finally:
        llama.close()
    result.tokens_per_s = round(decoded / decoding, 1) if decoding else 0.0
    return result
