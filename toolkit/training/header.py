"""The lines a run prints before its first step (RunPlan's part): what is really in effect (the strategy accelerate
set up, the mesh, the precision, the attention, the batch) and the plan (memory per device, the price, the cost).
"""

from __future__ import annotations

from ..metrics.cost import dollars, hours, memory_tbs
from ..metrics.memory import human_bytes
from ..models.pipeline import schedule_note
from ..settings.arguments import global_batch_size
from ..settings.mesh import data_parallel_replicas, launch_mesh, pipeline_schedule
from ..settings.mesh import describe as describe_mesh
from ..settings.tasks import task


class RunHeader:
    """The header of a RunPlan (self: the plan)."""

    def header(self, training, counts, base_learning_rate: float, data_note: str = "", master_weights: str = "",
               task_lines: tuple[str, ...] = ()) -> str:  # fmt: skip
        """The lines printed before the first step: what is really in effect, and the plan."""
        s, recipe, cost, plan = self.strategy, self.recipe, self.cost, self.cost_plan
        lr = f"{training.learning_rate:.3g}"
        if recipe.run.lr_reference_batch_size:
            lr += f" (scaled from {base_learning_rate:.3g} at batch {recipe.run.lr_reference_batch_size})"
        price = "unknown (pass --hourly_usd)"
        if cost.usd_per_unit_hour is not None:
            overhead = f", overhead x{cost.overhead:g}" if cost.overhead != 1 else ""
            price = f"${cost.usd_per_unit_hour}/{cost.unit}-hour x {cost.units} ({cost.pricing}{overhead})"
        budget = f", budget ${recipe.run.budget_usd:g}" if recipe.run.budget_usd else ""
        if plan and "sampling_seconds" in plan:
            planned = (f"at least {dollars(plan['usd'])} for {plan['steps']} steps ({hours(plan['seconds'])}): "
                       f"a step samples for at least {plan['sampling_seconds']:.3g} s (the decode roofline; "
                       f"transformers' generate stays well above it) and trains for {plan['training_seconds']:.3g} s "
                       f"at an assumed {100 * plan['mfu']:.0f}% MFU")  # fmt: skip
        elif plan:
            planned = (f"{dollars(plan['usd'])} for {plan['steps']} steps ({hours(plan['seconds'])} at an assumed "
                       f"{100 * plan['mfu']:.0f}% MFU of {self.peak_flops / 1e12:g} TFLOPS per device)")  # fmt: skip
        elif (
            task(recipe.data.task).samples_online
            and self.peak_flops
            and not (recipe.run.memory_tbs or memory_tbs(cost.device))
        ):
            planned = (f"no estimate: no datasheet bandwidth for {cost.device} (pass --memory_tbs for the sampling "
                       "floor); the live cost is tracked")  # fmt: skip
        else:
            planned = f"no estimate: no datasheet peak for {cost.device} (pass --peak_tflops for MFU and a plan)"
        mesh = launch_mesh()
        replicas = data_parallel_replicas(s["num_processes"])
        stages, micro_batches = mesh.get("pp", 1), training.gradient_accumulation_steps
        schedule = schedule_note(pipeline_schedule(), stages, micro_batches) if stages > 1 else ""
        lines = [
            f"recipe        {recipe.recipe_name}",
            f"model         {recipe.model.model_name_or_path}" + ("  [tiny, random init]" if recipe.run.tiny else ""),
            f"parameters    {counts.total:,} total, {counts.trainable:,} trainable "
            f"({100 * counts.trainable / max(counts.total, 1):.2f}%)",
            f"strategy      {s['distributed_type']}, {s['num_processes']} process(es) on {s['num_machines']} "
            f"machine(s), {s['device']}, backend {s['backend']}",
            f"sharding      {s['sharding']}",
            *([f"mesh          {describe_mesh(mesh)}"] if mesh else []),
            *([f"schedule      {schedule}"] if schedule else []),
            f"precision     {s['mixed_precision']}, weights {recipe.model.dtype}"
            + (f", {master_weights}" if master_weights else ""),
            f"attention     {self.attention}" + (f" ({note})" if (note := recipe.model.attention_note) else ""),
            *([f"experts       {self.experts}"] if self.experts else []),
            f"compile       {'on' if training.torch_compile else 'off'}"
            + (f" ({note})" if (note := recipe.compile_note) else ""),
            f"batch         {training.per_device_train_batch_size}{' pairs' if task(recipe.data.task).pairs else ''} "
            f"per device x {training.gradient_accumulation_steps} "
            f"accumulation x {replicas} {'processes' if replicas == s['num_processes'] else 'data-parallel replicas'}"
            f" = {global_batch_size(training)} global",
            *([f"              ({recipe.batch_choice.note()})"] if recipe.batch_choice else []),
            *task_lines,
            f"learning rate {lr}",
            *([f"data          {data_note}"] if data_note else []),
            f"memory plan   {human_bytes(self.memory.device_total)} per device predicted: "
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in self.memory.device.items() if v),
            *[f"              ({caveat})" for caveat in self.caveats],
            f"pricing       {cost.device}: {price}{budget}",
            f"cost plan     {planned}",
        ]
        rule = "-" * 78
        return "\n".join([rule, *lines, rule])
