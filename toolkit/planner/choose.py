"""`python -m toolkit plan MODEL --choose`: the hardware to rent, picked from the plan's own rows. Every GPU type
of the price table that can be planned (memory, datasheet peak and a price), at 1, 2, 4 and 8 GPUs on one node and
8 a node on 2 and 4 nodes, is planned as `toolkit plan` plans it; of the configs that fit (and are not refused),
within --budget_usd and --deadline_hours where given, the cheapest on-demand wins (fewer GPU-hours, then fewer
GPUs, break a tie). Its row is the plan's: `toolkit plan MODEL --gpu TYPE --gpus N --nodes M` prints the same.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass

from ..errors import ConfigError
from ..metrics.cost import device_spec, price_table
from ..project import is_recipe
from ..settings.tasks import task as task_table
from .assembly import build_plan

SIZES = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 4))  # (GPUs a node, nodes)


@dataclass(frozen=True)
class Candidate:
    gpu: str
    gpus: int
    nodes: int
    row: dict  # the plan's row for the config (planner/assembly.py's config_row)

    @property
    def devices(self) -> int:
        return self.gpus * self.nodes

    @property
    def wall_hours(self) -> float:
        return self.row["device_hours"] / self.devices

    def key(self) -> tuple:
        return (self.row["usd"], self.row["device_hours"], self.devices)


def plannable_gpus(named: str | None) -> list[str]:
    """The GPU types to try: the named ones (each checked against the price table), else every type the table
    gives memory, a datasheet peak and an on-demand price."""
    if named:
        gpus = [name.strip() for name in named.split(",") if name.strip()]
        for name in gpus:
            spec = device_spec(name, "or leave --gpu_types out to try them all")
            if not (spec.get("memory_gb") and spec.get("peak_tflops") and spec.get("on_demand")):
                raise ConfigError(f"--gpu_types {name}: the price table gives it no device memory, datasheet peak or "
                                  "price to plan with (toolkit/metrics/hardware.yaml).")  # fmt: skip
        return gpus
    devices = price_table()["devices"]
    return [name for name, d in devices.items() if d.get("memory_gb") and d.get("peak_tflops") and d.get("on_demand")]


def candidates(args: Namespace) -> list[Candidate]:
    """Every fitting, priced (GPU type, size, config) the plan gives, cheapest first; only `args.config`'s rows
    where it names one (a launch's strategy file)."""
    from tqdm.auto import tqdm

    found, sizes = [], [(gpu, *size) for gpu in plannable_gpus(args.gpu_types) for size in SIZES]
    bar = tqdm(sizes, desc="planning each GPU type and size", unit="plan", leave=False, disable=None)  # a TTY's
    for gpu, gpus, nodes in bar:
        plan = build_plan(Namespace(**{**vars(args), "gpu": gpu, "gpus": gpus, "nodes": nodes}))
        if task_table(plan["task"]).samples_online:  # known from the first plan
            raise ConfigError(f"--choose compares the same work on every size, and {args.model}'s steps sample "
                              "completions per device (its global batch grows with the GPUs): plan it at the "
                              "size you mean, python -m toolkit plan MODEL --gpu TYPE --gpus N.")  # fmt: skip
        found += [Candidate(gpu, gpus, nodes, row) for row in plan["configs"]
                  if row["micro_batch"] and not row["refused"] and row.get("usd") is not None
                  and getattr(args, "config", None) in (None, row["config"])]  # fmt: skip
    return sorted(found, key=Candidate.key)


def choose(args: Namespace) -> dict:
    """The cheapest candidate within the budget and the deadline, and what was weighed; one line where none is."""
    if any(limit is not None and limit <= 0 for limit in (args.budget_usd, args.deadline_hours)):
        raise ConfigError("--budget_usd and --deadline_hours must be positive.")
    every = candidates(args)
    if not every:
        raise ConfigError(f"{args.model} fits no config of any GPU type tried at up to 4 nodes of 8, or its time "
                          "cannot be priced (pass --samples): python -m toolkit plan shows why.")  # fmt: skip
    kept = [c for c in every if (args.budget_usd is None or c.row["usd"] <= args.budget_usd)
            and (args.deadline_hours is None or c.wall_hours <= args.deadline_hours)]  # fmt: skip
    if not kept:
        fastest = min(every, key=lambda c: c.wall_hours)
        raise ConfigError(f"nothing fits within{f' --budget_usd {args.budget_usd:g}' if args.budget_usd else ''}"
                          f"{f' --deadline_hours {args.deadline_hours:g}' if args.deadline_hours else ''}: the "
                          f"cheapest is {describe(every[0])}; the fastest {describe(fastest)}.")  # fmt: skip
    best = kept[0]
    return {"gpu": best.gpu, "gpus": best.gpus, "nodes": best.nodes, "config": best.row["config"],
            "micro_batch": best.row["micro_batch"], "wall_hours": best.wall_hours, "row": best.row,
            "weighed": len(every), "within": len(kept),
            "runner_up": describe(kept[1]) if len(kept) > 1 else None}  # fmt: skip


def describe(c: Candidate) -> str:
    spot = f", ${c.row['usd_spot']:,.2f} spot" if c.row.get("usd_spot") is not None else ""
    where = f"{c.gpus} x {c.gpu}" + (f" on {c.nodes} nodes" if c.nodes > 1 else "")
    return (f"{where}, {c.row['config']}.yaml at micro-batch {c.row['micro_batch']}: {c.row['device_hours']:,.1f} "
            f"GPU-hours ({c.wall_hours:,.1f} h wall), ${c.row['usd']:,.2f} on-demand{spot}")  # fmt: skip


def render_choice(choice: dict, model: str) -> str:
    """The choice as `toolkit plan --choose` prints it: the row, the command that launches it, the plan that
    prints the same row, and what was weighed."""
    row, nodes = choice["row"], f" --nodes {choice['nodes']}" if choice["nodes"] > 1 else ""
    script = f"recipes/{model}.py" if is_recipe(model) else "YOUR_RECIPE.py"
    weighed = f"weighed {choice['weighed']} fitting (GPU type, size, config) rows, {choice['within']} within the " \
        "budget and deadline" + (f"; next: {choice['runner_up']}" if choice["runner_up"] else "")  # fmt: skip
    return "\n".join([
        f"choose      {describe(Candidate(choice['gpu'], choice['gpus'], choice['nodes'], row))}",
        f"            launch: accelerate launch --config_file accelerate_configs/{row['config']}.yaml {script} "
        f"--per_device_train_batch_size {choice['micro_batch']}",
        f"            its row: python -m toolkit plan {model} --gpu {choice['gpu']} --gpus {choice['gpus']}{nodes}",
        f"            {weighed}",
    ])  # fmt: skip
