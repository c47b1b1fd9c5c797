"""Trainer part: pipeline parallelism's step, on torch.distributed.pipelining's schedules (GPipe, 1F1B).

The ranks form a (pp, dp) mesh, stages outermost, so that a job's stages sit on different nodes and only
activations cross between them, while each stage's replicas reduce their gradients inside a node. Each rank
holds one stage (models/pipeline.py cut it at load). A pipeline's ranks train on the same rows: the loader is
sharded over the replicas only.

One optimizer step is one schedule step. The Trainer hands its `training_step` the gradient accumulation's
micro-batches one at a time: they are kept until the last of the window, then the schedule runs all of them
through the stages at once (the accumulation steps are the schedule's micro-batches, so the bubble is
(stages - 1) / micro-batches). The loss, on the last stage, is each micro-batch's summed token losses over the
window's tokens on every replica (what one process accumulating the same rows computes), so each replica's
gradients are parts of the whole batch's and are summed over the replicas. Every batch is padded to
max_seq_length (runner.py's padding_multiple): a schedule's stages exchange tensors of the shapes its first step
had; a window or an evaluation batch of another shape gets its own schedule.

A mixture of experts' load-balancing loss spans every stage's routers: each stage passes on the routing sums of
the layers so far beside its hidden states (models/balance.py), and the last stage adds c x the whole model's
loss to each micro-batch's, at 1 / (the window's micro-batches x replicas) of it, a micro-batch's share of the
global batch (training/load_balance.py).

The stages' saves and loads are pipeline_saves.py's; what they exchange beside the schedule (gradients, the
loader's shards, evaluation's gather, generation) pipeline_exchange.py's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.balance import balance_loss
from ..models.parallel import routed_expert_count
from ..models.pipeline import StageModule, decoder_of, layer_list, window_schedule
from ..settings.mesh import launch_mesh, pipeline_schedule
from .pipeline_exchange import PipelineExchange
from .pipeline_saves import PipelineSaves


class Pipeline(PipelineExchange, PipelineSaves):
    def __init__(self, trainer):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = launch_mesh()
        self.stages, self.replicas = mesh["pp"], mesh.get("dp_replicate", 1)
        device = trainer.args.device
        grid = init_device_mesh(device.type, (self.stages, self.replicas), mesh_dim_names=("pp", "dp"))
        self.pp_group, self.dp_group = grid["pp"].get_group(), grid["dp"].get_group()
        self.stage, self.replica = grid["pp"].get_local_rank(), grid["dp"].get_local_rank()
        self.last_rank = dist.get_global_rank(self.pp_group, self.stages - 1)  # this pipeline's last stage
        self.trainer, self.device = trainer, device
        self.decoder = decoder_of(trainer.model)
        balance = trainer.balance  # the stages' routing sums, for its term (load_balance.py)
        routing = (balance.experts, balance.top_k) if balance is not None else None
        self.module = StageModule(trainer.model, self.stage, self.stages, routing)
        self.schedule_name = pipeline_schedule()
        self.schedules: dict[tuple, object] = {}
        self.window: list[dict] = []
        self.preprocess = trainer.preprocess_logits_for_metrics  # run here, on the last stage (eval_step)
        trainer.preprocess_logits_for_metrics = None
        self.items = torch.ones((), device=device)  # the window's loss tokens, all replicas
        self.micro_batches = 1  # in the window the schedule runs
        self.aux: list[torch.Tensor] = []  # the last stage's load-balancing losses of a window, for the log

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    # ------------------------------------------------------------------------------------------ the step
    def train_step(self, inputs: dict, window_ends: bool) -> torch.Tensor:
        """Keep a micro-batch; at the window's end, run them all and return the window's loss (0 before)."""
        self.window.append(inputs)
        if not window_ends:
            return torch.zeros((), device=self.device)
        batches, self.window = self.window, []
        labels = torch.cat([b["labels"] for b in batches])
        self.items = (labels[..., 1:] != -100).sum().to(self.device, torch.float32)
        if self.replicas > 1:
            dist.all_reduce(self.items, group=self.dp_group)
        losses = self.run(batches, labels, training=True)
        if self.replicas > 1:
            self.reduce_gradients()
        # The Trainer logs the mean over every rank of what this returns; one process would have logged the sum
        # of the replicas' parts: each replica's part, times the replicas, on each of its stages.
        return losses * self.replicas

    def eval_step(self, inputs: dict, loss_only: bool) -> tuple:
        """One evaluation batch through the stages, forward only, as the Trainer's prediction_step returns it on
        every stage: its mean token loss, and unless `loss_only` the last stage's predictions and the labels. The
        predictions are the logits through the Trainer's preprocess_logits_for_metrics (self.preprocess, taken from
        the Trainer: their token scores, not a vocabulary-wide tensor, go to the other stages)."""
        labels = inputs["labels"]
        self.items = (labels[..., 1:] != -100).sum().clamp(min=1).to(self.device, torch.float32)
        with torch.no_grad():
            loss = self.run([inputs], labels, training=False)
        if loss_only:
            return loss, None, None
        from accelerate.utils import recursively_apply

        predictions = [None]
        if self.last:
            logits = self.outputs[0] if isinstance(self.outputs, tuple) else self.outputs
            scores = self.preprocess(logits, labels) if self.preprocess else logits
            predictions = [recursively_apply(torch.Tensor.cpu, scores)]
        dist.broadcast_object_list(predictions, src=self.last_rank, group=self.pp_group)
        return loss, recursively_apply(lambda t: t.to(self.device), predictions[0]), labels

    def run(self, batches: list[dict], labels: torch.Tensor, training: bool) -> torch.Tensor:
        """The schedule over `batches` (one micro-batch each): the summed loss, sent from the last stage to all;
        the last stage keeps an evaluation's logits (self.outputs)."""
        inputs = {k: torch.cat([b[k] for b in batches]) if torch.is_tensor(v) else v
                  for k, v in batches[0].items() if k not in ("input_ids", "labels")}  # fmt: skip
        ids = torch.cat([b["input_ids"] for b in batches])
        self.micro_batches = len(batches)
        first = (len(batches), tuple(ids.shape), training) not in self.schedules
        schedule = self.schedule_for(len(batches), tuple(ids.shape), training)
        args = (ids,) if self.first else ()
        target = {"target": labels, "losses": (losses := [])} if self.last else {}
        with self.trainer.accelerator.autocast():
            if training:
                schedule.step(*args, **target, **inputs)
            else:
                self.outputs = schedule.eval(*args, **target, **inputs)
        if training and first and self.trainer.routing is not None:  # a new schedule's step also ran torch's shape
            self.trainer.routing.clear()  # inference, a forward of stand-in inputs: its routing is not counted
        if training and self.trainer.balance is not None:  # the window's own micro-batches: torch's first step
            for aux in self.aux[-len(batches) :] if self.aux else ():  # also scores a stand-in, sizing its buffers
                self.trainer.balance.record(aux)
        self.aux = []
        total = torch.stack(losses).sum().detach().float() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(total, src=self.last_rank, group=self.pp_group)
        return total

    def loss(self, output: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of a micro-batch: its token losses summed, over the window's tokens (self.items),
        by the model's own loss function (shifted labels, -100 ignored); with the routing sums of every stage
        (`output`: logits and sums), c x the load-balancing loss at the micro-batch's share of the batch."""
        logits, sums = output if isinstance(output, tuple) else (output, None)
        loss = self.decoder.loss_function(logits=logits, labels=labels, vocab_size=self.decoder.config.vocab_size,
                                          num_items_in_batch=self.items)  # fmt: skip
        balance = self.trainer.balance
        if sums is None or balance is None:
            return loss
        aux = balance_loss(sums)
        self.aux.append(aux.detach())
        if torch.is_grad_enabled():  # training: the share of one micro-batch of the global batch
            return loss + balance.coef * aux / (self.micro_batches * self.replicas)
        return loss + balance.coef * aux  # an evaluation batch's mean loss, as one process computes it

    def router_layers(self) -> tuple[list, int | None]:
        """Every block of the whole model as this stage sees it (its own, the others' pass-throughs), and the
        model's routed experts: the router statistics count one row per block on every stage."""
        return list(layer_list(self.trainer.model)), routed_expert_count(self.decoder.config.get_text_config())

    def schedule_for(self, micro_batches: int, shape: tuple, training: bool):
        """A schedule for windows of this many micro-batches and this shape (its stage's buffers are sized by the
        first step), made once."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        key = (micro_batches, shape, training)
        if key not in self.schedules:
            stage = PipelineStage(self.module, self.stage, self.stages, self.device, group=self.pp_group)
            name = window_schedule(self.schedule_name, self.stages, micro_batches) if training else "GPipe"
            kind = get_schedule_class(name)
            self.schedules[key] = kind(stage, micro_batches, loss_fn=self.loss, scale_grads=False)
        return self.schedules[key]

    # ------------------------------------------------------------------------------------- the gradients

    # --------------------------------------------------------------------------------------- the data

    # ------------------------------------------------------------------------------------- generation

    # ----------------------------------------------------------------------------------- checkpoints
