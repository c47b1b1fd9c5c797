"""Which clouds can run a `toolkit launch --on skypilot` task. SkyPilot rents a GPU type on the clouds its catalog
lists (`skypilot_clouds:` in toolkit/metrics/hardware.yaml); a cloud that lacks a feature the task needs is
filtered out by SkyPilot's optimizer (sky/execution.py adds `Task.get_required_cloud_features()`, sky/task.py:
a MOUNT or MOUNT_CACHED file mount needs STORAGE_MOUNTING, num_nodes > 1 MULTI_NODE; `use_spot` adds SPOT_INSTANCE,
sky/resources.py), so a type rented only on such clouds is one no launch of the task can find. The task names
the clouds left (`resources.any_of`), and the plan chooses among the types that have one.

LACKS is each cloud's `_CLOUD_UNSUPPORTED_FEATURES` (or `_unsupported_features_for_resources`) in SkyPilot
0.14.1's sky/clouds/<cloud>.py, for the three features the task can need; tests/test_skypilot.py checks it against
SkyPilot's own `check_features_are_supported`.
"""

from __future__ import annotations

from ..metrics.cost import price_table

MOUNT, NODES, SPOT = "storage_mounting", "multi-node", "spot_instance"  # CloudImplementationFeatures' values
WHY = {MOUNT: "mount the bucket", NODES: "run several nodes", SPOT: "rent spot instances"}

LACKS = {  # the cloud's `infra:` name: what it lacks (sky/clouds/<file>.py: line)
    "aws": (),  # aws.py:323, only STOP of spot instances and controller features
    "azure": (),  # azure.py:91
    "gcp": (),  # gcp.py:242 (MULTI_NODE only for TPU nodes)
    "oci": (),  # oci.py:72
    "nebius": (),  # nebius.py:94
    "lambda": (SPOT,),  # lambda_cloud.py:44
    "cudo": (SPOT,),  # cudo.py:60
    "do": (SPOT,),  # do.py:31
    "paperspace": (SPOT,),  # paperspace.py:36
    "scp": (SPOT,),  # scp.py:53
    "primeintellect": (NODES,),  # primeintellect.py:33
    "runpod": (NODES, MOUNT),  # runpod.py:30, 37
    "vast": (NODES, MOUNT),  # vast.py:29, 37
    "seeweb": (NODES, MOUNT, SPOT),  # seeweb.py:45, 51, 57
    "hyperbolic": (NODES, MOUNT, SPOT),  # hyperbolic.py:30, 34, 38
}


def needs(nodes: int, spot: bool) -> list[str]:
    """The features a task with a mounted bucket asks of its cloud."""
    return [MOUNT] + [NODES] * (nodes > 1) + [SPOT] * spot


def offered(gpu: str) -> list[str]:
    """The clouds SkyPilot rents the price table's GPU type on."""
    return list(price_table()["devices"][gpu].get("skypilot_clouds") or [])


def able(gpu: str, nodes: int = 1, spot: bool = True) -> list[str]:
    """The clouds renting `gpu` that have every feature the task needs (a cloud the table does not know: none)."""
    return [c for c in offered(gpu) if c in LACKS and not set(LACKS[c]) & set(needs(nodes, spot))]


def why_not(gpu: str, nodes: int, spot: bool) -> str:
    """Why no cloud renting `gpu` can run the task."""
    missing = [f for f in needs(nodes, spot) if not any(c in LACKS and f not in LACKS[c] for c in offered(gpu))]
    lack = " or ".join(WHY[f] for f in missing) or "do all of " + ", ".join(WHY[f] for f in needs(nodes, spot))
    return f"SkyPilot rents {gpu} on {', '.join(offered(gpu)) or 'no cloud'}, none of which can {lack}"


def fixes(gpu: str, nodes: int, spot: bool) -> list[str]:
    """Which of --nodes 1, --on_demand alone would let a cloud renting `gpu` run the task."""
    return [fix for fix, fits in (("--nodes 1", nodes > 1 and able(gpu, 1, spot)),
                                  ("--on_demand", spot and able(gpu, nodes, False))) if fits]  # fmt: skip
