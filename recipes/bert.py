"""BERT-base (cased) fine-tuned for sentiment on GLUE SST-2.

accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/bert.py
python recipes/bert.py --tiny          # offline, CPU, seconds
"""

from toolkit import run

RECIPE = dict(
    model_name_or_path="google-bert/bert-base-cased",
    task="classification",
    dataset_name="nyu-mll/glue",
    dataset_config="sst2",
    text_columns="sentence",
    label_column="label",
    eval_split="validation",
    max_seq_length=128,
    learning_rate=2e-5,
    per_device_train_batch_size=32,
    per_device_eval_batch_size=64,
    num_train_epochs=3,
    warmup_steps=0.1,
    weight_decay=0.01,
)

if __name__ == "__main__":
    run(RECIPE)
