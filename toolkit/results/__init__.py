"""After training: what a run produced, judged and shipped. `evaluation` (did it help: the fine-tuned model against
the one it started from, on the recipe's held-out split and lm-evaluation-harness tasks), `card` (the model card
with the run's own figures), `push` (the export to the Hugging Face Hub)."""
