"""Patches of other libraries are gated: each holds only inside the versions it was tested with and while what
it touches keeps its signature. These tests fail the day an installed version leaves a window, so an upgrade of
accelerate or transformers is a conscious step (re-test, then widen the window or delete the patch)."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from toolkit.distributed.patches import PATCHES, PRIVATE_TRANSFORMERS
from toolkit.distributed.patches.gate import Patch, Target

RELIANCES = [*PATCHES, PRIVATE_TRANSFORMERS]


@pytest.mark.parametrize("reliance", RELIANCES, ids=lambda r: r.name)
def test_installed_version_is_inside_the_tested_window(reliance):
    installed = importlib.metadata.version(reliance.library)
    assert reliance.in_window(), (
        f"{reliance.library} {installed} is outside {reliance.versions} for {reliance.name}: re-test, then widen the "
        "window or delete the patch"
    )


@pytest.mark.parametrize("reliance", RELIANCES, ids=lambda r: r.name)
def test_what_it_touches_has_the_tested_signature(reliance):
    assert reliance.changed() is None
    assert reliance.problem() is None


def test_every_patch_says_when_to_delete_it_and_what_standing_aside_costs():
    for patch in PATCHES:
        assert patch.delete_when and patch.without and patch.targets


def outdated(installed: list, **changes) -> Patch:
    """A patch like fsdp_loading, needed, that records whether it was installed."""
    fields = dict(name="example", library="accelerate", versions=("1.15", "1.16"),
                  targets=(Target("accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict",
                                  ("accelerator", "model", "full_sd", "cpu_offload")),),
                  needed=lambda: True, install=lambda: installed.append(True), without="X happens",
                  delete_when="never")  # fmt: skip
    return Patch(**{**fields, **changes})


def test_a_patch_outside_its_window_warns_once_and_leaves_the_library_alone(capsys):
    installed = []
    patch = outdated(installed, versions=("0.1", "0.2"))
    assert patch.apply() is False and patch.apply() is False
    assert installed == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: accelerate ") and "outside the versions example" in err[0]
    assert "so X happens" in err[0] and "accelerate>=0.1,<0.2" in err[0]


def test_a_changed_signature_is_refused_with_what_changed(capsys):
    installed = []
    target = Target("accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict", ("accelerator", "model", "sd"))
    patch = outdated(installed, name="example2", targets=(target,))
    assert patch.apply() is False and installed == []
    assert "now takes (accelerator, model, full_sd, cpu_offload), tested with (accelerator, model, sd)" in (
        capsys.readouterr().err
    )
    assert Target("accelerate.utils.fsdp_utils:no_such_function").mismatch().endswith("no longer exists")


def test_a_patch_not_needed_is_not_checked_or_installed():
    installed = []
    assert outdated(installed, versions=("0.1", "0.2"), needed=lambda: False).apply() is False
    assert installed == []


def test_a_patch_inside_its_window_installs():
    installed = []
    assert outdated(installed).apply() is True and installed == [True]


@pytest.mark.parametrize("reliance", RELIANCES, ids=lambda r: r.name)
def test_the_install_keeps_each_library_inside_its_window(reliance):
    """`make install` (pip -c constraints.txt) takes no release of a library a patch was not tested with."""
    lines = (Path(__file__).parents[1] / "constraints.txt").read_text().splitlines()
    pins = {r.name: r.specifier for r in map(Requirement, (ln for ln in lines if ln and not ln.startswith("#")))}
    low, high = reliance.versions
    assert pins[reliance.library] == SpecifierSet(f">={low},<{high}")


def test_the_package_requires_the_transformers_it_was_tested_with():
    """The package's own requirement (what `pip install` of it takes, without constraints.txt) is the window the
    toolkit's private-API uses were tested with: it took any transformers 5, though the load-balancing term's
    scaling follows the Trainer's own rules (training/load_balance.py) and those uses, as 5.23 and 5.24 have them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    required = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    low, high = PRIVATE_TRANSFORMERS.versions
    assert required["transformers"] == SpecifierSet(f">={low},<{high}")


ZERO_MUON_PROBE = """
import sys, torch
from toolkit.distributed.patches.zero_muon import MUON, install
from deepspeed.runtime import engine
from deepspeed.runtime.zero import utils
utils.dist.get_rank = lambda: 1  # DeepSpeed's check logs on rank 0 of a process group this probe has not made
p = [torch.nn.Parameter(torch.zeros(2))]
optimizers = (torch.optim.AdamW(p), torch.optim.SGD(p))
install()
install()  # once: a second launch in the process keeps one wrapper
patched = [engine.is_zero_supported_optimizer(o) for o in optimizers], MUON in sys.modules
own = [utils.is_zero_supported_optimizer(o) for o in optimizers], MUON in sys.modules  # DeepSpeed's, unpatched
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
muon = engine.is_zero_supported_optimizer(MuonWithAuxAdam.__new__(MuonWithAuxAdam))
print(patched, own, muon)
"""


def test_zero_checks_its_optimizer_without_importing_muon():
    """zero_muon: AdamW supported and SGD not, as DeepSpeed answers, without importing its Muon optimizer (and with
    it torch's compiler: ~3.5 of a 2-rank ZeRO-3 launch's 24 CPU-s); DeepSpeed's own check, asked next in the same
    process, imports it; once imported, a Muon optimizer is supported, by DeepSpeed's own check. One process: a
    DeepSpeed import is most of the test."""
    result = subprocess.run([sys.executable, "-c", ZERO_MUON_PROBE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "([True, False], False) ([True, False], True) True"


def test_fsdp1_sharded_resume_loads_weights_and_optimizer_state(monkeypatch, tmp_path):
    """FSDP1 itself on CPU (gloo, one process): accelerate's own save and load of a SHARDED_STATE_DICT model and
    optimizer, the loads given a fresh model and optimizer as a resuming Trainer gives them. Without fsdp1_resume
    no moments load and the fp32 weights come back rounded to bf16; with it, a step after the resume is the
    uninterrupted run's step, bit for bit (an earlier version of the patch dropped the loaded weights instead)."""
    from types import SimpleNamespace

    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from conftest import free_port
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    from toolkit.distributed.patches import fsdp1_resume

    originals = {name: getattr(fsdp_utils, name) for name in ("load_fsdp_model", "load_fsdp_optimizer")}
    monkeypatch.setattr(fsdp1_resume, "_originals", originals)
    monkeypatch.setattr(fsdp_utils, "logger", logging.getLogger(__name__))  # accelerate's needs an Accelerator
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
        accelerator = SimpleNamespace(process_index=0, wait_for_everyone=lambda: None)

        def model_and_optimizer():
            """A bf16 model in bf16 mixed precision as accelerate prepares it: its flat parameters upcast to fp32
            after wrapping (Accelerator.prepare_model's two lines), which its parameters see at the first forward."""
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).to(torch.bfloat16)
            bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True, mixed_precision=bf16)
            for module in FSDP.fsdp_modules(model):
                module._flat_param.data = module._flat_param.data.to(torch.float32)
                module._handle._orig_param_dtype = torch.float32
            return model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # the Trainer's on a GPU

        def step(model, optimizer, seed):
            torch.manual_seed(seed)
            loss = model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        def flat(model):
            return [module._flat_param.detach().clone() for module in FSDP.fsdp_modules(model)]

        model, optimizer = model_and_optimizer()
        for seed in range(3):
            step(model, optimizer, seed)
        fsdp_utils.save_fsdp_model(plugin, accelerator, model, str(tmp_path))
        fsdp_utils.save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(tmp_path))
        saved_weights = flat(model)
        saved_state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
        assert all(w.dtype == torch.float32 for w in saved_weights)
        next_loss, next_weights = step(model, optimizer, 3), flat(model)

        for loads, patched in ((originals, False), (vars(fsdp1_resume), True)):
            model, optimizer = model_and_optimizer()
            loads["load_fsdp_model"](plugin, accelerator, model, str(tmp_path))
            loads["load_fsdp_optimizer"](plugin, accelerator, optimizer, model, str(tmp_path))
            assert bool(optimizer.state) == patched
            exact = all(torch.equal(a, b) for a, b in zip(flat(model), saved_weights, strict=True))
            assert exact == patched  # accelerate's own load rounds the fp32 weights through bf16 parameters
        for parameter, before in zip(model.parameters(), saved_state, strict=True):
            after = optimizer.state[parameter]
            assert float(after["step"]) == float(before["step"]) == 3
            for key in ("exp_avg", "exp_avg_sq"):
                assert after[key].dtype == torch.float32 and torch.equal(after[key], before[key])
        assert step(model, optimizer, 3) == next_loss  # the fused step takes the moments in the parameters' dtype
        assert all(torch.equal(a, b) for a, b in zip(flat(model), next_weights, strict=True))
    finally:
        dist.destroy_process_group()
