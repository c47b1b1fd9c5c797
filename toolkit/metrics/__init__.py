"""Measurement, cost and reports: memory as measured, throughput and MFU, prices and the budget, health warnings,
rank reports, W&B, and `python -m toolkit report`."""
