"""`make demo-qat`'s last step: each run's saved weights on its held-out split, plain and quantized by torchao's int4
(symmetric, groups of 32: the grid `--qat int4` trains under, applied by the same fake quantizers, whose forward is
torchao's int4 quantizer's, tests/test_qat.py), through the run's own metrics (toolkit eval's held-out).

    python bench/qat_ptq.py runs/smollm2_chat_full runs/smollm2_chat_qat
"""

from __future__ import annotations

import argparse


def main() -> None:
    from toolkit.models.loading import load_config
    from toolkit.models.qat import prepare
    from toolkit.results.evaluation import held_out_data, held_out_metrics, load
    from toolkit.results.record import RunRecord
    from toolkit.settings.model_arguments import ModelArguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="runs' output folders")
    print("| run | held-out | trained weights | torchao int4 |\n|---|---|---:|---:|")
    for run in parser.parse_args().runs:
        record = RunRecord.read(run)
        model, tokenizer = load(record, "tuned")
        prepared, _ = held_out_data(record, tokenizer, load_config(record.arguments(ModelArguments)))
        plain = held_out_metrics(record, model, tokenizer, prepared)
        prepare(model, "int4")
        quantized = held_out_metrics(record, model, tokenizer, prepared)
        for metric in ("perplexity", "token_accuracy"):
            print(f"| {run} | {metric} | {plain[metric]:.4g} | {quantized[metric]:.4g} |", flush=True)


if __name__ == "__main__":
    main()
