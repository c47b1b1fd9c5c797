"""Measurement, cost and reports: memory as measured, throughput and MFU (the RunTracker the trainer feeds), prices
and the budget, health warnings, the generation samples' records, W&B, and `python -m toolkit report`."""
