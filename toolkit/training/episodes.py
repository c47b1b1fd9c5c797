"""Trainer part: what a GRPO run in an environment (--environment) shows of its episodes. Each step logs the
episodes' turns (the assistant's, mean over every rank's: `environment/turns`) and the seconds the environment
took (reset, tools and get_reward, summed over the ranks: `environment/seconds`; a profile's split shows it as its
own phase, apart from sampling); rank 0 appends its first episode of each step, its turns and rewards, to
OUTPUT/episodes.jsonl and a W&B table; the header names the environment, its tools and its limits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..metrics.samples import EPISODES_FILE
from .environments import report_unscored


class EpisodesMixin:
    """On RecipeGRPOTrainer, before the toolkit's OnlineRLMixin (rl.py); inert without an environment."""

    episode_rows: list | None = None

    def train(self, *args, **kwargs):
        """TRL's, then the episodes' processes stopped (TRL keeps its pool of environments, each holding its last
        episode's process, for the next batch: there is none), the spawners with them, and the episodes a stop
        left unscored said."""
        try:
            return super().train(*args, **kwargs)
        finally:
            for pool in (getattr(self, "_environment_pool", None) or {}).values():
                for handle in pool:
                    handle._close()
            factories = getattr(self, "environment_factories", None) or {}
            for factory in factories.values():
                factory.close()
            report_unscored(factories)

    def _generate(self, prompts):
        factories = list((getattr(self, "environment_factories", None) or {}).values())
        if not factories or not self.model.training:
            return super()._generate(prompts)
        for factory in factories:  # its calls are a phase of a profiled step
            factory.phase = self.phase
        before = sum(f.seconds for f in factories)
        sampled = super()._generate(prompts)
        completions = sampled[3]
        turns = torch.tensor([sum(m.get("role") == "assistant" for m in c) for c in completions], dtype=torch.float)
        seconds = torch.tensor([sum(f.seconds for f in factories) - before])
        self._metrics["train"]["environment/turns"].append(self.accelerator.gather(turns).mean().item())
        self._metrics["train"]["environment/seconds"].append(self.accelerator.gather(seconds).sum().item())
        self.last_episode = (prompts[0], completions[0])
        return sampled

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if getattr(self, "last_episode", None) is not None and self.is_world_process_zero():
            prompt, turns = self.last_episode  # rank 0's first rollout: the gathered rewards' first row
            values = {name: None if torch.isnan(v) else v.item()
                      for name, v in zip(self.reward_func_names, rewards[0], strict=True)}  # fmt: skip
            self.record_episode({"step": self.state.global_step + 1, "prompt": prompt[-1]["content"],
                                 "turns": turns, "rewards": values})  # fmt: skip
        self.last_episode = None
        return rewards

    def record_episode(self, row: dict) -> None:
        with open(Path(self.args.output_dir) / EPISODES_FILE, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            self.episode_rows = [*(self.episode_rows or []), [row["step"], row["prompt"], transcript(row["turns"]),
                                                              json.dumps(row["rewards"])]]  # fmt: skip
            table = wandb.Table(columns=["step", "prompt", "turns", "rewards"], data=self.episode_rows)
            wandb.run.log({"train/episodes": table, "train/global_step": row["step"]})

    def environment_rewards(self) -> list[str]:
        """The environment classes whose get_reward TRL adds to the rewards (weight 1, named after the class)."""
        factories = (getattr(self, "environment_factories", None) or {}).values()
        return list(dict.fromkeys(f.cls.__name__ for f in factories if hasattr(f.handle, "get_reward")))

    def environment_lines(self) -> tuple[str, ...]:
        """The header's environment line: the class, its tools, its reward and an episode's limits."""
        factories = getattr(self, "environment_factories", None)
        if not factories:
            return ()
        from .environments import tool_names

        policy = self.recipe.policy
        tokens = policy.max_completion_length
        rounds = (f"at most {policy.max_tool_calls + 1} turns ({tokens} tokens in all, tool results included: "
                  f"~{tokens // (policy.max_tool_calls + 1)} a turn)" if policy.max_tool_calls else
                  f"turns without a limit ({tokens} tokens in all, tool results included)")  # fmt: skip
        named = "; ".join(f"{(name + ': ') if name else ''}{f.spec}, tools {', '.join(tool_names(f.cls)) or 'none'}"
                          f"{', scored by its get_reward' if hasattr(f.handle, 'get_reward') else ''}"
                          for name, f in factories.items())  # fmt: skip
        return (f"environment   {named} (TRL's environment_factory, experimental)",
                f"              an episode: {rounds}, each call at most {policy.tool_timeout:g} s, in a process of "
                "its own; each step logs its turns (environment/turns), the environment's time (environment/seconds) "
                "and the sampling share")  # fmt: skip


def transcript(turns: list[dict]) -> str:
    """An episode's turns as text, one message a line (the W&B table's cell)."""
    lines = []
    for message in turns:
        calls = [f"{c['function']['name']}({json.dumps(c['function'].get('arguments'))})"
                 for c in message.get("tool_calls") or []]  # fmt: skip
        lines.append(f"{message.get('role')}: {message.get('content') or ''}{' '.join(calls)}".strip())
    return "\n".join(lines)
