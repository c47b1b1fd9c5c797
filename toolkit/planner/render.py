"""A plan as a person reads it (`python -m toolkit plan` without --json): the model, the hardware, the workload,
a row per strategy file with its fit, time and cost, and the recommendation."""

from __future__ import annotations

from ..settings.tasks import task as task_table
from .estimate import (
    FP8_SPEEDUP,
)


def online_lines(plan: dict) -> list[str]:
    """How an online-RL plan reads: which phase the memory is, what a step costs in each phase and why the
    sampling figure is a floor."""
    d, w, task = plan["data"], plan["workload"], plan["task"]
    rows = w["micro_batch"] * w["micro_batches"]
    lines = [f"{task:<12}memory of the larger phase: sampling {rows} rows a device at once (their KV cache at "
             f"{w['seq_length']} tokens, the sampling buffers) or the training step"]  # fmt: skip
    if teacher := plan.get("teacher"):
        lines.append(f"{'teacher':<12}{teacher['model']}: {teacher['parameters']:,} parameters ("
                     f"{teacher['active_per_token']:,} a token passes through), frozen, in the table's GiB/GPU; its "
                     f"forward adds {teacher['forward_flops_per_token']:.3g} FLOPs per trained token")  # fmt: skip
    timed = next((r for r in plan["configs"] if "step_seconds" in r), None)
    if not timed:
        lines.append(
            f"{'':<12}time and dollars need the steps (--samples, the prompts, or the recipe's max_steps) "
            "and the device's memory_tbs (toolkit/metrics/hardware.yaml)"
        )
        return lines
    step = timed["step_seconds"]
    lines += [
        f"{'':<12}{d['steps']:,} steps of {d['rows_per_step']} completions (prompts up to {d['prompt_tokens']} tokens, "
        f"completions up to {d['completion_tokens']}); a step on {timed['config']}: sampling at least "
        f"{step['sampling']:.3g} s, training {step['training']:.3g} s at the MFU below",
        f"{'':<12}sampling is the decode roofline (each new token reads the weights and the KV cache once, at the "
        "datasheet bandwidth; every completion full length): no engine beats it and transformers' generate stays "
        "well above it, so GPU-hours and dollars are floors; the run measures the real split (sampling_share)",
    ]  # fmt: skip
    if d.get("turns"):
        lines.append(
            f"{'':<12}an episode: up to {d['turns']} turns (--max_tool_calls + 1) in its {d['completion_tokens']} "
            f"tokens, tool results included (~{d['completion_tokens'] // d['turns']} a turn); each turn waits on the "
            "tools, whose time the run measures (environment/seconds; --profile splits it out of sampling)"
        )  # fmt: skip
    return lines


def notes(plan: dict) -> list[str]:
    """The lines under the table: refusals, pipeline bubbles, expert all-to-alls, FP8's assumption, and the
    recommendation (or, where nothing fits, the least memory and what would make it fit)."""
    p, w = plan["parameters"], plan["workload"]
    costed = "usd" in plan["configs"][0] if plan["configs"] else False
    lines: list[str] = []
    for r in plan["configs"]:
        if r["refused"]:
            lines.append(f"{r['config']}: refused for this model and recipe: {r['refused']}")
    for r in plan["configs"]:
        if r.get("pipeline_stages", 1) > 1 and not r["refused"]:
            lines.append(f"{r['config']}: {r['pipeline_stages']} stages (--parallelism_config_pp_size "
                         f"{r['pipeline_stages']}), {w['micro_batches']} micro-batch(es) a step: bubble "
                         f"(stages - 1) / micro-batches = {r['bubble']:.0%} idle time on top of the step's compute, "
                         "in the MFU; raise --gradient_accumulation_steps to shrink it")  # fmt: skip
    for r in plan["configs"]:
        if r.get("expert_parallel", 1) > 1 and not r["refused"]:
            seconds = (f" ({r['all_to_all_seconds']:.3g} s at the link's datasheet bandwidth)"
                       if "all_to_all_seconds" in r else "")  # fmt: skip
            lines.append(f"{r['config']}: experts split over {r['expert_parallel']} GPUs (--parallelism_config_"
                         f"ep_size {r['expert_parallel']}): each GPU sends {r['all_to_all_gib']:,.3g} GiB a step in "
                         f"all-to-alls{seconds}, and gathers none of the {r['expert_gathers_gib']:,.4g} GiB of "
                         "experts it would under FSDP; both in the assumed MFU")  # fmt: skip
    if costed and any(r["config"] == "fsdp2_fp8" for r in plan["configs"]):
        lines.append(f"fsdp2_fp8: {plan['fp8_speedup']:.3g}x bf16's speed assumed: torchao's {FP8_SPEEDUP:g}x for "
                     f"a dense 8B model, on the {plan['fp8_share']:.0%} of this model's FLOPs its float8 linears run "
                     "(fused experts stay 16-bit), with torch.compile (on by default under FP8); one H100 measured "
                     "1.26x with it, 0.46x without, one H200 1.10x over compiled bf16 at 1B "
                     "(docs/benchmarks.md)")  # fmt: skip
    if plan["recommended"]:
        stages, ep = plan.get("recommended_pipeline_stages", 1), plan.get("recommended_expert_parallel", 1)
        flags = f" --parallelism_config_pp_size {stages} (python -m toolkit launch)" if stages > 1 else ""
        if ep > 1:
            world = plan["hardware"]["gpus_per_node"] * plan["hardware"]["nodes"]
            flags = (f" --parallelism_config_dp_shard_size {world} --parallelism_config_ep_size {ep} (python -m "
                     "toolkit launch)")  # fmt: skip
        lines.append(f"recommended: accelerate_configs/{plan['recommended']}.yaml{flags} with "
                     f"--per_device_train_batch_size {plan['recommended_micro_batch']}")  # fmt: skip
    else:
        least = min([r for r in plan["configs"] if not r["refused"]] or plan["configs"], key=lambda r: r["device_gib"])
        fixes = ["add GPUs or nodes", "shorten the sequence",
                 *([] if w["activation_checkpointing"] else ["turn on activation checkpointing"]),
                 *([] if p["frozen"] else ["train LoRA adapters"])]  # fmt: skip  # frozen weights: LoRA already
        lines.append(f"recommended: nothing fits; the least memory, {least['config']}, needs {least['device_gib']:.1f} "
                     f"GiB per GPU at micro-batch {w['micro_batch']}: {', '.join(fixes[:-1])} or "
                     f"{fixes[-1]}.")  # fmt: skip
    return lines


def render(plan: dict) -> str:
    p, h, w = plan["parameters"], plan["hardware"], plan["workload"]
    lines = [
        f"model       {plan['model']}"
        + (f"  (recipe {plan['recipe']})" if plan["recipe"] else f"  (task {plan['task']})"),
        f"parameters  {p['total']:,} total, {p['trainable']:,} trainable, {p['frozen']:,} frozen; "
        + (f"{p['active_per_token'] / 1e9:.3g}B active per token ({p['routing']}); " if p.get("routing") else "")
        + f"largest module {p['largest_module']:,}",
        f"hardware    {h['nodes']} node(s) x {h['gpus_per_node']} x {h['gpu']} ({h['memory_gib']} GB), "
        f"{int(h['headroom'] * 100)}% headroom",
        f"workload    {w['precision']}{', fp32 master weights' if w['master_weights'] else ''}, {w['optimizer']}, "
        f"micro-batch {w['micro_batch']}"
        + (f" pairs ({w['micro_batch'] * 2} sequences)" if task_table(plan["task"]).pairs else "")
        + f" x {w['seq_length']} tokens, "
        f"activation checkpointing {'on' if w['activation_checkpointing'] else 'off'}, "
        f"CUDA context {w['cuda_context_gib']} GiB",
        f"activations {plan['activations']}",
        *([f"images      {plan['images']}"] if plan.get("images") else []),
        *([f"upper bound {plan['conservative']}"] if plan.get("conservative") else []),
        *([f"left out    {plan['left_out']}"] if plan.get("left_out") else []),
    ]
    if plan["data"] and not task_table(plan["task"]).samples_online:
        d = plan["data"]
        lines.append(f"data        {d['samples']:,} samples x {d['epochs']:g} epoch(s) x "
                     f"{d['tokens_per_sample']:,.0f} tokens ({d['tokens_source']}); {plan['flops_per_token']:.3g} "
                     "training FLOPs per token"
                     + (f", of the {p['active_per_token'] / 1e9:.3g}B parameters active per token" if p.get("routing")
                        else ""))  # fmt: skip
    if task_table(plan["task"]).samples_online:
        lines.extend(online_lines(plan))
    lines.append("")
    costed = "usd" in plan["configs"][0] if plan["configs"] else False
    fits = f"fits@{w['micro_batch']}"
    header = f"{'config':<20}{'GiB/GPU':>9}{'host GiB/node':>15}{'at load':>9}  {fits:<8}{'max micro-batch':>16}"
    if costed:  # cents and hundredths of an hour only where the amounts are small
        cents = 2 if max(r["usd"] for r in plan["configs"]) < 100 else 0
        hour_digits = 2 if max(r["device_hours"] for r in plan["configs"]) < 10 else 1
        header += f"{'MFU':>6}{'GPU-hours':>11}{'$ on-demand':>13}{'$ spot':>10}"
    lines.append(header)
    for r in plan["configs"]:
        line = (f"{r['config']:<20}{r['device_gib']:>9.1f}{r['host_gib_per_node']:>15.1f}"
                f"{r['host_load_gib_per_node']:>9.1f}  {'refused' if r['refused'] else 'yes' if r['fits'] else 'no':<8}"
                f"{(not r['refused'] and r['micro_batch']) or '-':>16}")  # fmt: skip
        if costed:
            spot = f"{r['usd_spot']:>10,.{cents}f}" if r["usd_spot"] is not None else f"{'-':>10}"
            line += f"{r['mfu']:>6.2f}{r['device_hours']:>11,.{hour_digits}f}{r['usd']:>13,.{cents}f}{spot}"
        lines.append(line)
    lines.append("")
    lines += notes(plan)
    return "\n".join(lines)
