"""Patches of other libraries are gated: each holds only inside the versions it was tested with and while what
it touches keeps its signature. These tests fail the day an installed version leaves a window, so an upgrade of
accelerate or transformers is a conscious step (re-test, then widen the window or delete the patch)."""

from __future__ import annotations

import importlib.metadata
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
