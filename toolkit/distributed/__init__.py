"""Distributed training: what the launch asked for, the layout in effect, refusals of silently degraded launches,
`python -m toolkit check`, and every patch of another library (patches/)."""
