"""The planner: parameters, per-device memory, a fit verdict, time and cost, before anything is launched.

Everything is computed from a meta-device model (no weights, no Hub call for the recipes' models) and from the
strategy files themselves (`accelerate_configs/*.yaml` and the DeepSpeed JSON they name):
  layout.py    what a strategy does to memory, read from a strategy file or from a running job
  shape.py     parameter accounting of the model (meta device: models/meta.py)
  activations.py  the bytes autograd saves, measured on scaled-down instances of the model and extrapolated
  memory.py    bytes per device and per node, by component, for a shape x layout x workload (workload.py);
               a step's own terms step_memory.py's, expert parallelism's all-to-alls traffic.py's
  estimate.py  which strategies fit with which micro-batch; FLOPs, time and cost at an assumed MFU
  assembly.py  a plan's assembly: the workload, the data, a row per strategy file, the recommendation
  render.py    a plan as a person reads it
  cli.py       `python -m toolkit plan`: its flags, checked
The run's own plan (training/run_plan.py) uses the same formulas on the strategy accelerate really set up.
"""

from ..models.meta import meta_model
from .estimate import (
    ASSUMED_MFU,
    assumed_mfu,
    cost_from_throughput,
    not_fitting_warning,
    samples_per_second_at_mfu,
    training_flops_per_token,
    verdicts,
    workload_for,
)
from .layout import Layout
from .memory import Memory, plan_memory
from .shape import Shape
from .step_memory import activation_bytes, layer_activation_bytes, logits_bytes
from .workload import Workload

__all__ = [
    "ASSUMED_MFU",
    "Layout",
    "Memory",
    "Shape",
    "Workload",
    "activation_bytes",
    "assumed_mfu",
    "cost_from_throughput",
    "layer_activation_bytes",
    "logits_bytes",
    "meta_model",
    "not_fitting_warning",
    "plan_memory",
    "samples_per_second_at_mfu",
    "training_flops_per_token",
    "verdicts",
    "workload_for",
]
