"""The PipelineEngine's instruction dispatch, with DeepSpeed's extension points (`deepspeed.runtime.pipe.engine`).

`PipelineEngine._INSTRUCTION_MAP` maps each instruction class to the engine method that runs it, called as
`MethodType(fn, engine)(**instruction.kwargs)`; `_exec_forward_pass(buffer_id)` and its siblings carry
DeepSpeed's names. A client adds instructions by updating the map and replaces the training schedule by
assigning `deepspeed.runtime.pipe.schedule.TrainSchedule` (what Megatron-DeepSpeed's
`--enable-zbh1-pipeline` does: its BackwardOnlyPass / WeightPass methods run on this engine unmodified).
Its methods see the engine state DeepSpeed's show them: `pipe_buffers[kind][buffer_id]` (inputs, labels,
outputs, output_tensors; assigning None frees one), `grad_layer` (the last gradients received), `loss` (the
last micro-batch's loss on the last stage), `super(PipelineEngine, self).backward(loss)`, the timers, and
the flags `is_pipe_partitioned` / `is_grad_partitioned` (False: activations and gradients travel whole) and
`using_bf16_optimizer` (True where DeepSpeed's would be a BF16_Optimizer: bf16 at ZeRO stage 0 with fp32
accumulation; the optimizer then has its clear_lp_grads / update_hp_grads, which fold a gradient a client
wrote into `param.grad` into the fp32 accumulators at once. Elsewhere such a gradient is taken at ReduceGrads).

A map entry that is still the engine's own method runs in the executor directly (as DeepSpeed's map, it
holds PipelineEngine's functions: a subclass overriding `_exec_forward_pass` changes nothing unless it
updates the map too)."""
from __future__ import annotations

from types import MethodType
from typing import Any, Optional

from . import instructions as I


class PipeBufferKind:
    """One kind of pipe buffer ('outputs', ...), indexed by buffer id."""

    def __init__(self, executor: Any, name: str) -> None:
        self.executor, self.name = executor, name

    def __getitem__(self, buffer_id: int) -> Any:
        return self.executor.buffer(self.name, buffer_id)

    def __setitem__(self, buffer_id: int, value: Any) -> None:
        self.executor.set_buffer(self.name, buffer_id, value)


class PipeBuffers:
    """DeepSpeed's `engine.pipe_buffers`: `pipe_buffers['outputs'][buffer_id]` reads the executor's buffer,
    assigning stores (None frees it)."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def __getitem__(self, name: str) -> PipeBufferKind:
        if name not in self.executor.BUFFERS:
            raise KeyError(f"pipe_buffers has no {name!r}; it holds {', '.join(self.executor.BUFFERS)}")
        return PipeBufferKind(self.executor, name)

    def keys(self) -> tuple:
        return self.executor.BUFFERS


class InstructionDispatch:
    """PipelineEngine's half that runs instructions; `self.executor` is the stage's PipeExecutor."""

    executor: Any
    _exec_ins: Any = None  # the instruction being dispatched
    _lr_kwargs: Optional[dict] = None  # OptimizerStep(lr_kwargs=...) for the step it runs
    is_pipe_partitioned = False  # activations and gradients travel whole between stages
    is_grad_partitioned = False

    # -- the built-in instructions, under DeepSpeed's method names ----------------------------------------
    def _builtin(self, kind: type, **kwargs: Any) -> None:
        ins = self._exec_ins
        if type(ins) is not kind or ins.kwargs != kwargs:  # called by a client's method, or mapped from its class
            ins = kind(**kwargs)
            ins.place(-1, int(kwargs.get("chunk_id", 0)))
        self.executor.execute(ins)

    def _exec_load_micro_batch(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.LoadMicroBatch, buffer_id=buffer_id, **kwargs)

    def _exec_forward_pass(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.ForwardPass, buffer_id=buffer_id, **kwargs)

    def _exec_backward_pass(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.BackwardPass, buffer_id=buffer_id, **kwargs)

    def _exec_backward_input_pass(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.BackwardInputPass, buffer_id=buffer_id, **kwargs)

    def _exec_backward_weight_pass(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.BackwardWeightPass, buffer_id=buffer_id, **kwargs)

    def _exec_send_activations(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.SendActivation, buffer_id=buffer_id, **kwargs)

    def _exec_recv_activations(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.RecvActivation, buffer_id=buffer_id, **kwargs)

    def _exec_send_grads(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.SendGrad, buffer_id=buffer_id, **kwargs)

    def _exec_recv_grads(self, buffer_id: int, **kwargs: Any) -> None:
        self._builtin(I.RecvGrad, buffer_id=buffer_id, **kwargs)

    def _exec_reduce_tied_grads(self) -> None:
        self._builtin(I.ReduceTiedGrads)

    def _exec_reduce_grads(self) -> None:
        self._builtin(I.ReduceGrads)

    def _exec_optimizer_step(self, lr_kwargs: Optional[dict] = None) -> None:
        self._lr_kwargs = lr_kwargs
        try:
            self._builtin(I.OptimizerStep, **({} if lr_kwargs is None else {"lr_kwargs": lr_kwargs}))
        finally:
            self._lr_kwargs = None

    _OWN_METHODS = {
        I.OptimizerStep: _exec_optimizer_step,
        I.ReduceGrads: _exec_reduce_grads,
        I.ReduceTiedGrads: _exec_reduce_tied_grads,
        I.LoadMicroBatch: _exec_load_micro_batch,
        I.ForwardPass: _exec_forward_pass,
        I.BackwardPass: _exec_backward_pass,
        I.SendActivation: _exec_send_activations,
        I.RecvActivation: _exec_recv_activations,
        I.SendGrad: _exec_send_grads,
        I.RecvGrad: _exec_recv_grads,
        I.BackwardInputPass: _exec_backward_input_pass,
        I.BackwardWeightPass: _exec_backward_weight_pass,
    }
    _INSTRUCTION_MAP = dict(_OWN_METHODS)  # a client's update() adds to this one only

    def _exec_instruction(self, ins: Any) -> None:
        """One instruction of a schedule, through the map (DeepSpeed's error for a class it lacks)."""
        fn = self._INSTRUCTION_MAP.get(type(ins))
        if fn is None:
            raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {ins!r}")
        if self._OWN_METHODS.get(type(ins)) is fn:
            self.executor.execute(ins)  # the engine's own method: straight to the executor
            return
        self._exec_ins = ins
        try:
            self._exec_instr = MethodType(fn, self)
            self._exec_instr(**ins.kwargs)
        finally:
            self._exec_ins = None

    # -- the state a client's instruction method reads ----------------------------------------------------
    @property
    def using_bf16_optimizer(self) -> bool:
        from deepspeed_c.runtime.mixed_precision_optimizer import MixedPrecisionOptimizer

        opt = getattr(self, "optimizer", None)
        return isinstance(opt, MixedPrecisionOptimizer) and opt.accumulate_fp32
    @property
    def pipe_buffers(self) -> PipeBuffers:
        return PipeBuffers(self.executor)

    @property
    def grad_layer(self) -> Any:
        return self.executor.grad_layer

    @property
    def loss(self) -> Any:
        return self.executor.loss

    def mem_status(self, msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
        """Kept for clients that call it (Megatron-DeepSpeed's zero-bubble passes): DeepSpeed's own was a
        disabled debugging print before 0.19.8 dropped it; this one does nothing."""

