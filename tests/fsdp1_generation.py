"""Run by tests/test_precision.py under torchrun (2 processes, gloo): greedy generation from a tiny Llama wrapped
in FSDP1 (FULL_SHARD, one unit per decoder layer), with and without the root unit's own parameters gathered
(training/generation_samples.py's root_unsharded), against the same model unwrapped. Rank 0 writes the outcome."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from toolkit.training.generation_samples import root_unsharded

checkpoint, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
prompt = torch.tensor([[5, 17, 42, 8, 99, 3]])


def greedy(model) -> list[int]:
    with torch.no_grad():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=8, pad_token_id=0, synced_gpus=True)[0].tolist()  # fmt: skip


reference = greedy(AutoModelForCausalLM.from_pretrained(checkpoint).eval())
wrapped = FullyShardedDataParallel(AutoModelForCausalLM.from_pretrained(checkpoint).eval(),
                                   sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
                                   auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                   sync_module_states=False)  # fmt: skip
with root_unsharded(wrapped):
    gathered = greedy(wrapped)
try:
    bypassed = greedy(wrapped)
except Exception as error:  # noqa: BLE001 - what the bypass does is the outcome
    bypassed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"reference": reference, "gathered": gathered, "bypassed": bypassed}, f)
# As the runner leaves (runner.run): both ranks past every collective, the group gone, then no interpreter teardown,
# where gloo aborted rank 0 once under load ("terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
