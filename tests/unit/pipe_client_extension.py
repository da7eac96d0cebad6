"""Helpers of test_megatron_client_api.py (run in its 2-rank launch): DeepSpeed's PipelineEngine extension
points used the way Megatron-DeepSpeed's `--enable-zbh1-pipeline` uses them (its code is not copied: the
schedule, the instructions and the weight-gradient store below are this test's own). A client assigns
`deepspeed.runtime.pipe.schedule.TrainSchedule` and adds its instruction classes to
`PipelineEngine._INSTRUCTION_MAP`; its methods read `pipe_buffers`, `grad_layer`, `loss`, call the base engine's
backward and write weight gradients into `param.grad` themselves. And the module's `get_additional_losses()`
(an MoE model's auxiliary losses) summed over micro-batches, averaged over data-parallel ranks and reported by
`engine.get_additional_losses()` on every stage.

`body` runs PP 2 (ZeRO 0) and DP 2 (ZeRO 1) with the split-backward schedule and PP 2 with the built-in 1F1B;
`reference` trains the unsplit model in one process in float64 (losses, additional losses, weights after the
SGD steps)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

GAS, MBS, STEPS, LR = 4, 2, 3, 0.1


# -- the model: Linears whose weight gradient a backward-only pass defers (the test's own store) -----------------
class _Store:
    defer = False
    pending: list = []  # (weight, input, output gradient) of the running backward-only pass
    queue: list = []  # one entry per backward-only pass, consumed by the weight passes in order


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        if _Store.defer:
            _Store.pending.append((w, x, gy))
            gw = None
        else:
            gw = gy.t() @ x
        return gy @ w, gw, gy.sum(0)


class _Linear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        lin = torch.nn.Linear(n_in, n_out)
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        return _LinearFn.apply(x, self.weight, self.bias)


_AUX: dict = {}  # what the head saw in its last forward (set on the last stage only)


class _Head(_Linear):
    def forward(self, x):
        out = super().forward(x)
        _AUX["aux"] = (x.detach() ** 2).mean()
        _AUX["aux_max"] = out.detach().abs().max()
        return out


def _layers() -> list:
    torch.manual_seed(0)
    return [_Linear(4, 6), torch.nn.Tanh(), _Linear(6, 6), torch.nn.Tanh(), _Head(6, 1)]


def _pipe_module(num_stages: int):
    from deepspeed_c.pipe import PipelineModule

    class AuxPipe(PipelineModule):  # as Megatron's GPTModelPipe: the names on every stage, values where computed
        def get_additional_losses(self):
            return OrderedDict((k, _AUX.get(k)) for k in ("aux", "aux_max"))

    return AuxPipe(layers=_layers(), num_stages=num_stages, loss_fn=_loss, partition_method="uniform")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def _data(dp: int) -> list:
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(MBS, 4, generator=g), torch.randn(MBS, 1, generator=g)) for _ in range(dp * GAS)]
            for _ in range(STEPS)]


# -- the client's schedule and instructions (registered as Megatron's zbh1 engine registers its own) -------------
def _instructions():
    from deepspeed_c.runtime.pipe import schedule as S

    class InputGradOnly(S.BufferOpInstruction):
        """Backward without the Linear weight gradients (deferred to a WeightOnly)."""

    class WeightOnly(S.PipeInstruction):
        """The oldest deferred weight gradients, into param.grad."""

    class SplitSchedule(S.PipeSchedule):
        """Forwards first; the last stage runs each micro-batch's backward right after its forward (its loss is
        the engine's `loss` then), the others once every forward is out; the weight passes at the end."""

        def steps(self):
            first, last = self.is_first_stage, self.is_last_stage
            for mb in range(self.micro_batches):
                step = [] if first else [S.RecvActivation(mb)]
                step += [S.LoadMicroBatch(mb)] if first or last else []
                step.append(S.ForwardPass(mb))
                step += [InputGradOnly(mb)] if last else [S.SendActivation(mb)]
                step += [S.SendGrad(mb)] if last and not first else []
                yield step
            for mb in range(self.micro_batches if not last else 0):
                yield [S.RecvGrad(mb), InputGradOnly(mb)] + ([] if first else [S.SendGrad(mb)])
            for _ in range(self.micro_batches):
                yield [WeightOnly()]
            yield [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]

    return InputGradOnly, WeightOnly, SplitSchedule


_CALLS = {"B": 0, "W": 0}


def _exec_input_grad_only(self, buffer_id):
    from deepspeed_c.runtime.pipe.engine import PipelineEngine

    # bf16 with fp32 accumulation (DeepSpeed's BF16_Optimizer): fold what this pass leaves in param.grad
    bf16 = self.using_bf16_optimizer and not self.is_last_stage()
    if bf16:
        self.optimizer.clear_lp_grads()
    _Store.defer = True
    try:
        if self.is_last_stage():
            super(PipelineEngine, self).backward(self.loss)
        else:
            outputs, grads = self.pipe_buffers["outputs"][buffer_id], self.grad_layer
            if isinstance(outputs, tuple):
                torch.autograd.backward([t for t in outputs if t.is_floating_point()], grads)
            else:
                torch.autograd.backward((outputs,), (grads,))
            self.pipe_buffers["outputs"][buffer_id] = None
    finally:
        _Store.defer = False
    if bf16:
        self.optimizer.update_hp_grads(clear_lp_grads=False)
    _Store.queue.append(_Store.pending)
    _Store.pending = []
    _CALLS["B"] += 1


def _exec_weight_only(self):
    if self.using_bf16_optimizer:
        self.optimizer.clear_lp_grads()
    for w, x, gy in _Store.queue.pop(0):
        g = gy.t() @ x
        w.grad = g if w.grad is None else w.grad + g
    if self.using_bf16_optimizer:
        self.optimizer.update_hp_grads(clear_lp_grads=False)
    _CALLS["W"] += 1


def _train(engine, data: list, rank_slice: slice) -> dict:
    losses, extra = [], []
    for step in data:
        losses.append(float(engine.train_batch(data_iter=iter(step[rank_slice]))))
        add = engine.get_additional_losses()
        extra.append({k: float(v) for k, v in add.items()} if add is not None else None)
    weights = {n: p.detach().double().numpy().copy() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "extra": extra, "weights": weights}


def body(rank: int, world: int) -> dict:
    import deepspeed_c
    from deepspeed_c.runtime.pipe import schedule as S
    from deepspeed_c.runtime.pipe.engine import PipelineEngine

    def config(dp: int, stage: int, bf16: bool) -> dict:
        cfg = {"train_batch_size": MBS * GAS * dp, "train_micro_batch_size_per_gpu": MBS,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
               "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        if bf16:  # DeepSpeed's BF16_Optimizer: fp32 gradient accumulation
            cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
        return cfg

    def build(stages: int, stage: int, bf16: bool = False):
        module = _pipe_module(stages)
        return deepspeed_c.initialize(model=module, model_parameters=module.parameters(),
                                      config=config(world // stages, stage, bf16))[0]

    InputGradOnly, WeightOnly, SplitSchedule = _instructions()
    saved_schedule, saved_map = S.TrainSchedule, dict(PipelineEngine._INSTRUCTION_MAP)
    out: dict = {}
    S.TrainSchedule = SplitSchedule
    PipelineEngine._INSTRUCTION_MAP.update({InputGradOnly: _exec_input_grad_only, WeightOnly: _exec_weight_only})
    try:
        out["pp2_split"] = _train(build(2, 0), _data(1), slice(None))
        out["calls"] = dict(_CALLS)
        out["dp2_split"] = _train(build(1, 1), _data(2), slice(rank * GAS, (rank + 1) * GAS))
        for name, sched in (("split", SplitSchedule), ("1f1b", saved_schedule)):  # bf16: one step each
            S.TrainSchedule = sched
            engine = build(2, 0, bf16=True)
            engine.train_batch(data_iter=iter(_data(1)[0]))
            from deepspeed_c.runtime.bf16_optimizer import BF16_Optimizer  # DeepSpeed's class there

            out[f"bf16_{name}"] = (engine.using_bf16_optimizer and isinstance(engine.optimizer, BF16_Optimizer),
                                   [m.detach().double().numpy().copy() for g in engine.optimizer.fp32_groups for m in g])

        class Unknown(S.PipeInstruction):
            pass

        class BadSchedule(S.PipeSchedule):
            def steps(self):
                yield [Unknown(note=1)]

        S.TrainSchedule = BadSchedule
        try:
            build(1, 0).train_batch(data_iter=iter([]))
        except RuntimeError as exc:
            out["unknown"] = str(exc)
    finally:
        S.TrainSchedule = saved_schedule
        PipelineEngine._INSTRUCTION_MAP.clear()
        PipelineEngine._INSTRUCTION_MAP.update(saved_map)
    out["pp2_1f1b"] = _train(build(2, 0), _data(1)[:1], slice(None))
    return out


def reference(dp: int, steps: int) -> dict:
    """float64, one process: each step's loss (the mean over every replica's micro-batches), its additional
    losses likewise, and the weights after the steps, by `layer.name`."""
    layers = _layers()
    for m in layers:
        m.double()
    params = {f"{i}.{n}": p for i, m in enumerate(layers) for n, p in m.named_parameters()}
    losses, extra = [], []
    for step in _data(dp)[:steps]:
        total, aux = 0.0, {"aux": 0.0, "aux_max": 0.0}
        for p in params.values():
            p.grad = None
        for x, y in step:
            h = x.double()
            for m in layers:
                h = m(h)
            loss = torch.nn.functional.mse_loss(h, y.double()) / len(step)
            loss.backward()
            total += float(loss.detach())
            for k in aux:
                aux[k] += float(_AUX[k]) / len(step)
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
        losses.append(total)
        extra.append(aux)
    return {"losses": losses, "extra": extra, "weights": {n: p.detach().numpy() for n, p in params.items()}}


def check(run: dict, ref: dict, names: set) -> None:
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
    for got, want in zip(run["extra"], ref["extra"]):
        assert got is not None and list(got) == ["aux", "aux_max"]
        np.testing.assert_allclose([got["aux"], got["aux_max"]], [want["aux"], want["aux_max"]], rtol=1e-5)
    for name, w in run["weights"].items():
        np.testing.assert_allclose(w, ref["weights"][name], rtol=1e-5, atol=1e-6, err_msg=name)
    names.update(run["weights"])
