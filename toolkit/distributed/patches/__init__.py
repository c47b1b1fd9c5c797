"""Every change the toolkit makes to another library's code, and every private API it builds on, in one place.

PATCHES replace a function of accelerate while a launch needs it: `fsdp_cpu` (FSDP really shards on a machine
without GPUs), `fsdp1_resume` (an FSDP1 resume loads the optimizer's state), `fsdp_loading` (RAM-efficient FSDP
loading holds one copy of the model) and `tp_cpu` (a tensor-parallel mesh is accepted on a machine without GPUs);
`zero_muon` replaces one of DeepSpeed's (ZeRO starts without importing torch's compiler for a Muon check).
Each is gated on the library versions it was tested with and on the signatures of what it touches (gate.py):
outside them it warns once and leaves the library alone. PRIVATE_TRANSFORMERS lists the private
`transformers.Trainer` methods the trainer overrides (training/trainer.py) and the other private names the toolkit
reads: a changed signature is warned about at start-up. tests/test_patches.py fails the day an installed version
leaves a window, so upgrading accelerate, transformers or DeepSpeed is a conscious step: re-test, then widen the
window or delete the patch.
"""

from __future__ import annotations

from .fsdp1_resume import PATCH as FSDP1_RESUME
from .fsdp_cpu import PATCH as FSDP_CPU
from .fsdp_loading import PATCH as FSDP_LOADING
from .gate import Patch, Reliance, Target, warn_once
from .tp_cpu import PATCH as TP_CPU
from .zero_muon import PATCH as ZERO_MUON

# FSDP_CPU first: on CPU FSDP1 is FSDP2
PATCHES: tuple[Patch, ...] = (FSDP_CPU, FSDP1_RESUME, FSDP_LOADING, TP_CPU, ZERO_MUON)

PRIVATE_TRANSFORMERS = Reliance(
    name="the toolkit's uses of private transformers API",
    library="transformers",
    versions=("5.23", "5.25"),
    targets=(
        # the trainer's overrides (training/saving.py, loaders.py), handing over to checkpoints.StagedCheckpoints and
        # order.LengthGroupedOrder
        Target("transformers:Trainer._get_output_dir", ("self", "trial")),
        # models/tiny.py: whether save_pretrained writes on this rank (rank 0 only, once a process group exists)
        Target("transformers:PreTrainedModel.should_save_on_this_rank", ("self", "is_main_process")),
        Target("transformers:Trainer._save_checkpoint", ("self", "model", "trial")),
        Target("transformers:Trainer._save", ("self", "output_dir", "state_dict")),
        Target("transformers.trainer_utils:rotate_checkpoints",
               ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime", "checkpoint_prefix")),
        Target("transformers:Trainer._get_train_sampler", ("self", "train_dataset")),
        Target("transformers:Trainer.get_batch_samples", ("self", "epoch_iterator", "num_batches", "device")),
        Target("transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref"),  # models/meta.py
        Target("transformers:AutoModelForCausalLM._model_mapping"),  # settings/tasks.py's architecture
        Target("transformers.core_model_loading:WeightTransform.was_used", ("self",)),  # models/loading.py
    ),
)  # fmt: skip


def apply() -> list[str]:
    """Install the patches this launch needs (before the Trainer builds its accelerator); the names installed.
    A changed private transformers API the toolkit builds on is one warning line."""
    problem = PRIVATE_TRANSFORMERS.changed()  # a newer version alone is the test's concern, not every run's
    if problem:
        low, high = PRIVATE_TRANSFORMERS.versions
        warn_once(PRIVATE_TRANSFORMERS.name, f"{problem}: the toolkit builds on it, expect errors. Install "
                  f"transformers>={low},<{high}, or report it.")  # fmt: skip
    return [patch.name for patch in PATCHES if patch.apply()]
