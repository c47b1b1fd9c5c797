"""Distributed training: what the launch asked for (launch.py), refusals of silently degraded launches and the
strategy in effect (strategy.py), stale build locks (op_builds.py), every patch of another library (patches/),
and the commands `python -m toolkit check` (launch_check.py) and `launch` (launcher.py)."""
