"""Executes a pipeline schedule's instructions for one stage: buffers, loads, forward and backward
passes, transfers (runtime/pipe/p2p.py), tied and data-parallel gradient reduction and the step.

Every micro-batch's backward is a non-boundary round of the engine's reducer (gradients only
accumulate); ReduceTiedGrads sums the tied weights' gradients over their stages; ReduceGrads then
runs one boundary round (a zero-valued backward through every trainable parameter), so the
engine's own reducer / ZeRO-1 partitioner reduces the accumulated gradients exactly as after a
plain engine's last micro-batch.

Instructions reach it one by one through the engine's dispatch (PipelineEngine._INSTRUCTION_MAP, as
DeepSpeed's): `execute(ins)` runs a built-in one; a client's own instruction methods (Megatron-DeepSpeed's
zero-bubble passes) read the state they need through `buffer()` / `set_buffer()`, `grad_layer` and `loss`.

The executor gets what it uses, never the engine: the module, the grid and the stage's place in it, the
precision policy, the engine's backward (runtime/backward_phase.py), the optimizer seam (stepper), the
options below, and callables for what the engine does (the accumulation boundary, the step). The engine
reads back what it reports: run() returns the batch's summed loss (training) or its losses and logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..grad_norm import global_norm
from ..model_parallel.tp_norm import counted_in_norm
from . import deferred_wgrad
from . import instructions as I
from .loss_aggregation import add_to_total
from .p2p import PipeLink


def _tup(x: Any) -> tuple:
    return x if isinstance(x, tuple) else tuple(x) if isinstance(x, list) else (x,)


def _untup(xs: tuple) -> Any:
    return xs[0] if len(xs) == 1 else xs


@dataclass(frozen=True)
class PipeOptions:
    """The stage's place in the pipeline and the config values the executor uses, fixed at init."""
    stage_id: int
    num_stages: int
    virtual_stages: int  # model chunks per rank (the interleaved schedule)
    dynamic_shape: bool  # p2p links resend shapes with every transfer
    clip_norm: float  # > 0: clip with the norm over every stage's gradients before each step; 0: no clipping
    zero_stage: int  # > 0: the norm also sums over the stage's data-parallel group (partitioned gradients)


class PipeExecutor:
    def __init__(self, *, module: Any, grid: Any, device: Any, options: PipeOptions, precision: Any,
                 backward_state: Any, stepper: Any, deferred_wgrad: Any,
                 gas: Callable[[], int], set_boundary: Callable[[bool], None],
                 step: Callable[[Optional[float]], None],
                 grad_partitions: Optional[Callable[[], Sequence[Optional[torch.Tensor]]]] = None) -> None:
        """`gas` returns the current gradient_accumulation_steps; `set_boundary(b)` marks the accumulation
        boundary; `step(norm)` runs the engine's optimizer step (norm: the pipeline-wide gradient norm the
        executor clipped with, or None); `grad_partitions` (ZeRO-1) returns the stage's reduced flat
        gradient partitions the optimizer steps from (None: each parameter's reduction slot)."""
        self.module, self.grid, self.device, self.options = module, grid, device, options
        self.precision, self.backward_state, self.stepper = precision, backward_state, stepper
        self.deferred_wgrad = deferred_wgrad
        self.gas, self.set_boundary, self.engine_step = gas, set_boundary, step
        self.grad_partitions = grad_partitions
        self.stage_id = options.stage_id
        s, dev, dyn = options.stage_id, device, options.dynamic_shape
        S, V = options.num_stages, options.virtual_stages
        self.S, self.V = S, V
        self.total_loss: Optional[torch.Tensor] = None  # the training batch's summed micro-batch losses
        # the module's get_additional_losses() summed over the batch's micro-batches (last stage, training)
        self.total_additional_losses: Optional[OrderedDict] = None
        self.loss: Any = torch.tensor(0.0, device=device)  # the last micro-batch's loss (last stage): DeepSpeed's engine.loss
        self.grad_layer: Any = None  # the last gradients received (DeepSpeed's engine.grad_layer)
        self.inputs: dict = {}
        self.labels: dict = {}
        self.outputs: dict = {}
        self.output_tensors: dict = {}
        self.out_grads: dict = {}
        self.buffer_losses: dict = {}  # last stage, training: each buffer's loss until its backward
        self._norm_ranges: dict[int, list[tuple[int, int]]] = {}  # ZeRO-1: see _counted_ranges
        # 3D: the tensor-slicing axis the norm also sums over (replicated parameters counted on its rank 0)
        self._tp_rank, self._tp_size = grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()
        # with model chunks the last rank feeds the first rank's next chunk: neighbours wrap around
        has_next, has_prev = (S > 1, S > 1) if V > 1 else (s < S - 1, s > 0)
        nxt, prv = (s + 1) % S, (s - 1) % S
        self.act_out = PipeLink(grid.stage_to_global(nxt), nxt, s, "activations", dev, dyn) if has_next else None
        self.grad_in = PipeLink(grid.stage_to_global(nxt), nxt, s, "gradients", dev, dyn) if has_next else None
        self.act_in = PipeLink(grid.stage_to_global(prv), prv, s, "activations", dev, dyn) if has_prev else None
        self.grad_out = PipeLink(grid.stage_to_global(prv), prv, s, "gradients", dev, dyn) if has_prev else None
        self.handlers = {
            I.LoadMicroBatch: self._load, I.ForwardPass: self._forward, I.BackwardPass: self._backward,
            I.SendActivation: self._send_act, I.RecvActivation: self._recv_act, I.SendGrad: self._send_grad,
            I.RecvGrad: self._recv_grad, I.ReduceTiedGrads: self._reduce_tied, I.ReduceGrads: self._reduce_grads,
            I.OptimizerStep: self._step, I.BackwardInputPass: self._backward_input,
            I.BackwardWeightPass: self._backward_weight,
        }

    def links(self) -> list[PipeLink]:
        return [l for l in (self.act_out, self.grad_in, self.act_in, self.grad_out) if l is not None]

    def reset_links(self) -> None:
        for l in self.links():
            l.reset()

    # virtual stage of an instruction: chunk c of stage s is c * stages + s
    def _vs(self, ins: Any) -> int:
        return getattr(ins, "chunk", 0) * self.S + self.stage_id

    def _first(self, ins: Any) -> bool:
        return self._vs(ins) == 0

    def _last(self, ins: Any) -> bool:
        return self._vs(ins) == self.S * self.V - 1

    # -- driver ---------------------------------------------------------------------------------
    def run(self, sched: Any, training: bool, compute_loss: bool = True, data_iter: Any = None,
            batch_fn: Any = None, dispatch: Optional[Callable[[Any], None]] = None) -> dict:
        """Executes the schedule reading micro-batches from `data_iter` (through `batch_fn` if given), each
        instruction through `dispatch` (default: execute). Returns {"losses", "logits"} (evaluation, last
        stage), "total_loss": the training batch's summed micro-batch losses on the last stage (None
        elsewhere) and "total_additional_losses" (the module's get_additional_losses() summed likewise)."""
        self.training, self.compute_loss = training, compute_loss
        self.data_iter, self.batch_fn = data_iter, batch_fn
        self.n_micro, self.loaded = sched.micro_batches, 0
        self.inputs: dict = {}
        self.labels: dict = {}
        self.outputs: dict = {}
        self.out_grads: dict = {}
        self.buffer_losses: dict = {}  # last stage, training: each buffer's loss until its backward
        self.losses: list = []
        self.logits: list = []
        self.peak_in_flight = 0  # micro-batches whose activations are held for their backward
        self.batches: dict = {}  # micro-batch id -> its (inputs, labels), read from the iterator once
        self.in_grads: dict = {}  # split backward: input gradients computed by BackwardInputPass
        self.weight_pending: dict = {}  # split backward: what BackwardWeightPass finishes (see _backward_input)
        self.output_tensors: dict = {}  # DeepSpeed's pipe_buffers['output_tensors'] (kept for client passes)
        self.grad_layer = None
        if training:
            self.total_loss = None
            self.total_additional_losses = None
            self.set_boundary(False)
        run_one = dispatch or self.execute
        for step in sched.steps():
            for ins in step:
                run_one(ins)
        for l in self.links():
            l.wait_sends()
        return {"losses": self.losses, "logits": self.logits, "total_loss": self.total_loss,
                "total_additional_losses": self.total_additional_losses}

    def execute(self, ins: Any) -> None:
        """Runs one built-in instruction (instructions.py)."""
        handler = self.handlers.get(type(ins))
        if handler is None:
            raise NotImplementedError(f"the PipelineEngine cannot execute {ins!r}")
        handler(ins)

    # -- the per-buffer state, for a client's own instruction methods (DeepSpeed's pipe_buffers) -------------
    BUFFERS = ("inputs", "labels", "outputs", "output_tensors")

    def _buffers(self, name: str) -> dict:
        if name not in self.BUFFERS:
            raise KeyError(f"pipe_buffers has no {name!r}; it holds {', '.join(self.BUFFERS)}")
        return getattr(self, name)

    def buffer(self, name: str, buffer_id: int) -> Any:
        """What pipe buffer `buffer_id` of kind `name` holds now (None when empty)."""
        return self._buffers(name).get(buffer_id)

    def set_buffer(self, name: str, buffer_id: int, value: Any) -> None:
        """Stores `value` in the buffer; None frees it (freeing outputs frees the gradient received for them)."""
        held = self._buffers(name)
        if value is None:
            held.pop(buffer_id, None)
            if name == "outputs":
                self.out_grads.pop(buffer_id, None)
        else:
            held[buffer_id] = value

    # -- data -----------------------------------------------------------------------------------
    def _to_device(self, x: Any, cast: bool) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to(self.device)
            if cast and x.is_floating_point():
                x = x.to(self.precision.model_dtype)
            return x
        if isinstance(x, (tuple, list)):
            return tuple(self._to_device(t, cast) for t in x)
        return x

    def _next_batch(self) -> Any:
        it, fn = self.data_iter, self.batch_fn
        if it is None and not fn:
            raise RuntimeError(f"stage {self.stage_id} has no data iterator: pass train_batch(data_iter=...) "
                               "or call set_dataiterator() on the first and last stages")
        # With a batch_fn a rank may have no iterator (as in DeepSpeed): Megatron reads data on tensor rank 0
        # only and its batch_fn(None) receives that rank's broadcast
        batch = None
        if it is not None:
            try:
                batch = next(it)
            except StopIteration:
                raise RuntimeError(f"the data iterator ran out after {self.loaded} of {self.n_micro} micro-batches "
                                   f"(gradient_accumulation_steps={self.n_micro}) on stage {self.stage_id}") from None
        self.loaded += 1
        if fn:
            batch = fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"a pipeline micro-batch must be an (inputs, labels) pair, got {type(batch).__name__}"
                            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        return batch

    def _load(self, ins: Any) -> None:
        mb = ins.micro_batch_id
        if mb < 0:  # a user schedule's instruction: one micro-batch per load
            batch = self._next_batch()
        else:  # one rank may load a micro-batch twice (inputs for its first chunk, labels for its last)
            if mb not in self.batches:
                self.batches[mb] = self._next_batch()
            batch = self.batches[mb]
        b = ins.buffer_id
        if self._first(ins):
            x = self._to_device(batch[0], cast=True)
            if self.training and self.module.activation_checkpoint_interval > 0:
                # a reentrant checkpoint passes gradients to its parameters only when an input needs one
                x = _untup(tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tup(x)))
            self.inputs[b] = x
        if self._last(ins):
            self.labels[b] = self._to_device(batch[1], cast=False)

    # -- compute --------------------------------------------------------------------------------
    def _forward(self, ins: Any) -> None:
        b = ins.buffer_id
        module = self.module
        x = self.inputs[b]
        chunk = getattr(ins, "chunk", 0)
        if self.training:
            out = module.forward_chunk(x, chunk)
        else:
            with torch.no_grad():
                out = module.forward_chunk(x, chunk)
        if self._last(ins):
            if self.compute_loss and module.loss_fn is not None:
                loss = module.loss_fn(out, self.labels.pop(b))
            else:
                loss = out
            self.loss = loss
            if self.training:
                self.outputs[b] = out  # the module's outputs, as DeepSpeed's pipe_buffers['outputs'] on the last stage
                self.buffer_losses[b] = loss
                self.total_loss = add_to_total(self.total_loss, loss)
                extra = module.get_additional_losses()
                if extra is not None:  # summed per name over the batch's micro-batches, as DeepSpeed's
                    totals = self.total_additional_losses if self.total_additional_losses is not None else OrderedDict()
                    for name, value in extra.items():
                        totals[name] = add_to_total(totals.get(name), value)
                    self.total_additional_losses = totals
            else:
                self.losses.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)
                self.logits.append(out.detach() if isinstance(out, torch.Tensor) else out)
            if not self.training:
                self.inputs.pop(b, None)
        else:
            self.outputs[b] = out
        if self.training:
            self.peak_in_flight = max(self.peak_in_flight, len(self.outputs))

    def _backward_round(self, run: Any) -> None:
        """One non-boundary backward of the engine's reducer (see the module docstring)."""
        self.backward_state.run_round(run)

    def _backward_targets(self, ins: Any) -> tuple[list, list]:
        """(tensors, their gradients) a micro-batch's backward starts from: the scaled loss on the
        last virtual stage, else the outputs that need grads with the received gradients."""
        b = ins.buffer_id
        if self._last(ins):
            self.outputs.pop(b, None)
            loss = self.buffer_losses.pop(b)
            return [self.precision.scale_loss(loss / self.gas())], [None]
        outs = _tup(self.outputs.pop(b))
        received = iter(self.out_grads.pop(b))  # one per floating-point output, in order (see _send_grad)
        pairs = []
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                g = next(received)
                if o.requires_grad:
                    pairs.append((o, g))
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, ins: Any) -> None:
        outs, grads = self._backward_targets(ins)
        self._backward_round(lambda: torch.autograd.backward(outs, grads))

    def _backward_input(self, ins: Any) -> None:
        """Zero bubble, B: the gradients of the stage's inputs (sent upstream next). One traversal: Linear
        weight gradients are deferred (runtime/pipe/deferred_wgrad.py), the other parameters' computed and
        kept for W. A stage whose parameters carry tensor hooks keeps the graph and traverses it again in W."""
        b = ins.buffer_id
        outs, grads = self._backward_targets(ins)
        ins_req = [t for t in _tup(self.inputs.get(b, ())) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins_req = ins_req if not self._first(ins) else []
        params = [p for p in self.module.parameters() if p.requires_grad]
        store = self.deferred_wgrad
        if store is None or any(p._backward_hooks for p in params):
            if ins_req:
                self.in_grads[b] = torch.autograd.grad(outs, ins_req, grads, retain_graph=True, allow_unused=True)
            self.weight_pending[b] = ("graph", (outs, grads))
            return
        deferred: list = []
        with store.collect(deferred):
            got = torch.autograd.grad(outs, ins_req + params, grads, allow_unused=True)
        if ins_req:
            self.in_grads[b] = got[:len(ins_req)]
        self.weight_pending[b] = ("deferred", deferred_wgrad.weight_totals(params, got[len(ins_req):], deferred))

    def _backward_weight(self, ins: Any) -> None:
        """Zero bubble, W: the weight gradients of a micro-batch whose input gradients went upstream, into
        the parameters through autograd (the reducer's hooks see them as after any backward)."""
        kind, pending = self.weight_pending.pop(ins.buffer_id)
        if kind == "graph":  # (outputs, their gradients): traverse the kept graph again
            outs, grads = pending
            params = [p for p in self.module.parameters() if p.requires_grad]
            self._backward_round(lambda: torch.autograd.backward(outs, grads, inputs=params))
            return
        # (parameter, gradient) pairs
        self._backward_round(lambda: torch.autograd.backward([p for p, _ in pending], [g for _, g in pending])
                             if pending else None)

    # -- transfers ------------------------------------------------------------------------------
    # a boundary between virtual stages v and v + 1 is named v on both sides
    def _send_act(self, ins: Any) -> None:
        out = self.outputs[ins.buffer_id]
        self.act_out.send(out, self._vs(ins))
        if not self.training:
            self.outputs.pop(ins.buffer_id)

    def _recv_act(self, ins: Any) -> None:
        xs = self.act_in.recv(self._vs(ins) - 1)
        if self.training:
            xs = tuple(t.requires_grad_() if t.is_floating_point() else t for t in xs)
        self.inputs[ins.buffer_id] = _untup(xs)

    def _send_grad(self, ins: Any) -> None:
        b = ins.buffer_id
        xs = [t for t in _tup(self.inputs.pop(b)) if t.is_floating_point()]
        if b in self.in_grads:  # split backward: computed by BackwardInputPass
            got = iter(self.in_grads.pop(b))
            grads = tuple((next(got) if t.requires_grad else None) for t in xs)
            grads = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, xs))
        else:
            grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in xs)
        self.grad_out.send(grads, self._vs(ins) - 1)

    def _recv_grad(self, ins: Any) -> None:
        got = self.grad_in.recv(self._vs(ins))
        self.out_grads[ins.buffer_id] = got
        # DeepSpeed's grad_layer: one tensor for a tensor output, else one per floating-point output
        self.grad_layer = got[0] if isinstance(self.outputs.get(ins.buffer_id), torch.Tensor) else got

    # -- reductions and step --------------------------------------------------------------------
    def _reduce_tied(self, ins: Any) -> None:
        slots = self.stepper.reduction_slots() if self.stepper is not None else None
        for weight, group in self.module.get_tied_weights_and_groups():
            g = slots.read(weight) if slots is not None else weight.grad
            if g is None:  # every stage of the group must join the collective
                weight.grad = torch.zeros_like(weight)
                g = slots.read(weight) if slots is not None else weight.grad
            dist.all_reduce(g, group=group)

    def _reduce_grads(self, ins: Any) -> None:
        self.set_boundary(True)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        zero = sum((p.reshape(-1)[:1].float() * 0.0).sum() for p in params)
        # engine.backward's body (the PipelineEngine refuses engine.backward itself), with its precondition
        # (the stepper is None exactly when the engine has no optimizer)
        assert self.stepper is not None, "must provide optimizer during init in order to use backward"
        self.backward_state.backward(zero * self.gas())

    def _step(self, ins: Any) -> None:
        if self.precision.needs_scaler and self.S > 1:
            self._agree_on_overflow()
        clip = self.options.clip_norm
        norm = self._clip_across_stages(clip) if clip > 0 else None
        self.engine_step(norm)

    def _agree_on_overflow(self) -> None:
        """fp16: a step skipped for overflow on one stage is skipped on all (each stage's loss scaler
        then moves the same way, so the scale the last stage multiplies the loss by is the one every
        stage divides by). A stage that saw no inf/nan gets one planted in its gradients."""
        _, scaled = self._step_gradients()
        local = any(not bool(torch.isfinite(g).all()) for g in scaled)
        flag = torch.tensor([1.0 if local else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank steps once per batch: the world agrees
        if flag.item() > 0 and not local and scaled:
            scaled[0].view(-1)[0] = float("inf")

    def _step_gradients(self) -> tuple[list, list]:
        """(tensors counted in the norm, tensors to scale): where the optimizer will read this
        stage's reduced gradients from. ZeRO-1: this rank's flat partitions (the norm then also
        sums over the data-parallel group), counted without the elements of tied copies on later
        stages; else each parameter's slot (param.grad or its fp32 accumulator), tied copies on
        later stages scaled but not counted."""
        parts = self.grad_partitions() if self.grad_partitions is not None else None
        if parts is not None:
            counted, scaled = [], []
            for g, t in enumerate(parts):
                if t is None:
                    continue
                scaled.append(t)
                counted += [t[a:b] for a, b in self._counted_ranges(g, t.numel())]
            return counted, scaled
        slots = self.stepper.reduction_slots() if self.stepper is not None else None
        counted, scaled = [], []
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            g = slots.read(p) if slots is not None else p.grad
            if g is None:
                continue
            scaled.append(g)
            if counted_in_norm(p, self._tp_rank):
                counted.append(g)
        return counted, scaled

    def _counted_ranges(self, g: int, numel: int) -> list[tuple[int, int]]:
        """[start, end) ranges of this rank's group-g gradient partition that count in the norm:
        all but the slices of tied weights a later stage holds (the first stage of the tie counts
        them once). The partition plan is fixed, so the ranges are worked out once."""
        cache = self._norm_ranges
        if g not in cache:
            opt = self.stepper
            dup = sorted((local, local + n) for i, p in enumerate(opt.bit16_groups[g])
                         if not counted_in_norm(p, self._tp_rank) for _, local, n in opt.param_slices(g, i))
            out, pos = [], 0
            for a, b in dup:
                if a > pos:
                    out.append((pos, a))
                pos = max(pos, b)
            if pos < numel:
                out.append((pos, numel))
            cache[g] = out
        return cache[g]

    def _clip_across_stages(self, max_norm: float) -> float:
        """Clip with the L2 norm of every stage's gradients (the optimizers were built without
        clipping); returns that norm."""
        grid = self.grid
        counted, scaled = self._step_gradients()
        # the multi-tensor norm (fp32 accumulation, as DeepSpeed's): a float64 copy of every gradient was
        # ~9 GB of memory traffic at 355M parameters a stage, on the pipeline's critical path
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        if counted:
            sq += global_norm(counted).double().pow(2)
        if self.options.zero_stage > 0 and grid.get_data_parallel_world_size() > 1:
            dist.all_reduce(sq, group=grid.get_data_parallel_group())
        dist.all_reduce(sq, group=grid.get_pipe_parallel_group())
        if self._tp_size > 1:
            dist.all_reduce(sq, group=grid.get_slice_parallel_group())
        norm = float(sq.sqrt())
        if self.precision.needs_scaler:
            norm /= float(self.precision.loss_scale())
        if not torch.isfinite(torch.tensor(norm)):
            return norm  # an overflow: the optimizer skips the step
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(scaled, coef)
        return norm
