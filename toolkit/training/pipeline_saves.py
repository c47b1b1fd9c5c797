"""Pipeline stages' checkpoints and export (training/pipeline.py's part): each stage's weights one safetensors file of
a sharded Hugging Face folder, a LoRA adapter gathered whole; each stage's optimizer state; a stage's weights read
back from such a folder or any checkpoint of the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..metrics.memory import plain_tensor
from .checkpoint_damage import stage_optimizer


class PipelineSaves:
    """The stage's saves and loads (self: the Pipeline)."""

    def save(self, output_dir: str) -> None:
        """The model as one Hugging Face folder: each stage's weights one safetensors file of a sharded checkpoint
        (written by the stage's first replica), rank 0 the index, config, tokenizer and training arguments; a LoRA
        adapter (small) gathered to rank 0 and written whole into peft's folder."""
        import json
        import os

        from safetensors.torch import save_file

        trainer, folder = self.trainer, Path(output_dir)
        if trainer.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
        if self.replica == 0:
            dist.barrier(group=self.pp_group)  # the folder exists before the stages write into it
            peft = hasattr(trainer.model, "peft_config")
            if peft:  # the adapter's part of this stage, as peft names it in its file
                from peft import get_peft_model_state_dict

                weights = get_peft_model_state_dict(trainer.model)
            else:
                weights = plain(trainer.model.state_dict())
            own = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
            name = f"model-{self.stage + 1:05d}-of-{self.stages:05d}.safetensors"
            if not peft:
                save_file(own, folder / name, metadata={"format": "pt"})
            parts = [None] * self.stages
            dist.all_gather_object(
                parts, own if peft else (name, {k: v.nbytes for k, v in own.items()}), group=self.pp_group
            )
            if trainer.args.should_save:
                if peft:  # peft's folder (its config, its card) with the whole adapter
                    trainer.model.save_pretrained(folder)
                    adapter = {k: v for part in parts for k, v in part.items()}
                    save_file(adapter, folder / "adapter_model.safetensors", metadata={"format": "pt"})
                else:
                    weight_map = {k: file for file, sizes in parts for k in sizes}
                    total = sum(size for _, sizes in parts for size in sizes.values())
                    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
                    self.decoder.config.architectures = [type(self.decoder).__name__]
                    self.decoder.config.save_pretrained(folder)
                    if self.decoder.can_generate():
                        self.decoder.generation_config.save_pretrained(folder)
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(folder)
                torch.save(trainer.args, os.path.join(folder, "training_args.bin"))
        dist.barrier()

    def save_optimizer(self, output_dir: str) -> None:
        """Each stage's optimizer state (its first replica's: the replicas' are equal), the scheduler once."""
        trainer = self.trainer
        if self.replica == 0:
            torch.save(trainer.optimizer.state_dict(), stage_optimizer(output_dir, self.stage))
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")

    def load_optimizer(self, checkpoint: str) -> None:
        trainer = self.trainer
        trainer.optimizer.load_state_dict(torch.load(stage_optimizer(checkpoint, self.stage), weights_only=True,
                                                     map_location="cpu"))  # fmt: skip
        trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))

    def load_weights(self, folder: str | Path) -> None:
        """This stage's weights from a folder `save` wrote (or any Hugging Face checkpoint of the whole model)."""
        from safetensors import safe_open

        from ..errors import ConfigError

        folder, model = Path(folder), self.trainer.model
        if hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict, set_peft_model_state_dict
            from safetensors.torch import load_file

            saved = load_file(folder / "adapter_model.safetensors", device=self.device.type)
            own = get_peft_model_state_dict(model)
            set_peft_model_state_dict(model, {k: v for k, v in saved.items() if k in own})
            return
        index = folder / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        wanted, found = set(model.state_dict()), {}
        for file in files:
            with safe_open(folder / file, framework="pt") as f:
                found.update({k: f.get_tensor(k) for k in f.keys() if k in wanted})
        if missing := wanted - set(found):
            raise ConfigError(f"{folder} lacks {len(missing)} of stage {self.stage}'s weights ({sorted(missing)[0]}, "
                              "...): resume from a checkpoint of this model.")  # fmt: skip
        model.load_state_dict(found, strict=False)


def plain(state_dict: dict) -> dict:
    """Weight wrappers (FP8's) unwrapped, as every save writes them (metrics/memory.py's plain_tensor)."""
    return {name: plain_tensor(t) for name, t in state_dict.items()}
