"""The training room: the trainer every recipe runs on and its parts, in one order (trainer.py says which part
does what, and when), with the run's own plan (run_plan.py), checkpoints published whole (checkpoints.py),
stopping on signals, NaN and the budget (stopping.py), evaluation metrics (evaluation.py), SFT's fused loss
(fused_loss.py), TRL's DPO trainer with the same parts (preference.py), and TRL's GRPO trainer with them (rl.py)
and its rewards (rewards.py)."""
