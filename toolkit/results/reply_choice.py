"""The reply_choice evaluation task: a run's held-out conversations as an lm-evaluation-harness multiple-choice task,
each real answer among three answers to other prompts (`toolkit eval`, results/evaluation.py, runs it)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..errors import ConfigError
from .eval_checks import REPLY_CHOICE


def reply_choice_task(conversations: list, tokenizer, folder: Path) -> Path:
    """The held-out conversations as an lm-evaluation-harness multiple-choice task (YAML over a JSON file, in
    `folder`): each prompt rendered by the run's chat template up to the assistant's turn; its real answer among
    three answers to other prompts, in a seeded order (--limit, the harness's, takes the first). Returns the folder
    to include."""
    from ..metrics.samples import held_out_prompts

    prompts = held_out_prompts(conversations, len(conversations))
    answers = list(dict.fromkeys(p.reference for p in prompts))  # distinct answers to draw the others from
    if len(answers) < 4:
        raise ConfigError(f"{REPLY_CHOICE} needs 4 different held-out answers and the run held out {len(answers)}: "
                          "raise eval_fraction, or drop it from --tasks.")  # fmt: skip
    rng = random.Random(0)
    docs = []
    for prompt in prompts:
        others = rng.sample([a for a in answers if a != prompt.reference], 3)
        gold = rng.randrange(4)
        choices = [*others[:gold], prompt.reference, *others[gold:]]
        context = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        docs.append({"context": context, "choices": choices, "gold": gold})
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{REPLY_CHOICE}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{REPLY_CHOICE}.yaml").write_text(f"""\
# Made by `python -m toolkit eval` from the run's held-out conversations (toolkit/results/reply_choice.py).
task: {REPLY_CHOICE}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return folder
