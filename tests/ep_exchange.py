"""Run by tests/test_expert_parallel.py under torchrun (2 processes): one forward and backward of a mixture of
experts loaded expert-parallel by transformers (DistributedConfig(ep_size=2, fsdp_size=2)), every all-to-all's
rows counted as torch dispatches it (forward and backward), summed over the ranks: what planner/traffic.py's
all_to_all_bytes plans.

    torchrun --nproc_per_node 2 tests/ep_exchange.py MODEL_DIR BATCH SEQ OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


class Exchanges(TorchDispatchMode):
    """Every all-to-all's rows: those sent to the other ranks, and all of them."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.rows, self.off_rank, self.calls = rank, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all_single" in str(func) and args[0].dim() == 2:  # tokens x hidden (not the split counts)
            tensor, sizes = args[0], args[2] if len(args) > 2 else None
            self.calls += 1
            self.rows += tensor.shape[0]
            self.off_rank += tensor.shape[0] - (sizes[self.rank] if sizes else 0)
        return func(*args, **(kwargs or {}))


def main(folder: str, batch: int, seq: int, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(ep_size=2, fsdp_size=2)
    )
    ids = torch.randint(1, 400, (batch, seq), generator=torch.Generator().manual_seed(rank))
    with Exchanges(rank) as counted:
        model(input_ids=ids, labels=ids).loss.backward()
    totals = torch.tensor([counted.calls, counted.rows, counted.off_rank])
    dist.all_reduce(totals)  # every rank's, summed
    if rank == 0:
        calls, rows, off_rank = totals.tolist()
        json.dump({"calls": calls, "rows": rows, "off_rank": off_rank}, open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
