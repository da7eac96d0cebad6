"""The training systems benchmarks/train_throughput.py compares, each built from the same initial
weights and driven through one interface: `step(x, y) -> loss` (forward, backward, optimizer step,
gradient clipping 1.0, AdamW lr 1e-4 weight decay 0.01, bf16 compute) and `close()`.

- ``ddp``: torch DDP over fp32 weights under bf16 autocast, torch's fused AdamW, clip_grad_norm_.
- ``fsdp2``: torch FSDP2 (`fully_shard` per block, then the root) with bf16 parameters for compute,
  fp32 sharded masters, bf16 gradient reduction, fused AdamW on the shards, clip_grad_norm_.
- ``dsc<stage>[_off]`` / ``ds<stage>[_off]``: deepspeed_c / the real DeepSpeed with one JSON config
  (bf16, ZeRO stage, overlap_comm, contiguous gradients, DeepSpeed's default bucket sizes; `_off`
  moves the optimizer to the CPU).
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))

from model import GPT, GPTConfig  # noqa: E402

MODELS = {  # GPT-3 table shapes (untied head); sequence 2048
    "tiny": dict(n_embd=64, n_layer=2, n_head=4),
    "125M": dict(n_embd=768, n_layer=12, n_head=12),
    "350M": dict(n_embd=1024, n_layer=24, n_head=16),
    "1.3B": dict(n_embd=2048, n_layer=24, n_head=16),
    "2.7B": dict(n_embd=2560, n_layer=32, n_head=32),
}
LR, WD, CLIP = 1e-4, 0.01, 1.0
ZERO_EXTRA: dict[str, Any] = {}
# `<system>_g`: stage3_module_granularity_threshold making each GPT block one unit (block granularity of the
# 1.3B shape: 50.3M params / 9 counted modules = 5.6M; attention 5.6M and MLP 11.2M stay inside it)
GRANULARITY = int(2e7)  # train_throughput --zero_extra: keys merged into zero_optimization (variants)


def build_model(name: str, vocab: int, seq: int) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, **MODELS[name]))


def ds_config(system: str, micro: int) -> dict[str, Any]:
    stage = zero_stage(system)
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if system.endswith("_off"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage:
        zero.update(ZERO_EXTRA)
    if system.endswith("_g"):  # blocks as ZeRO-3 units (FSDP2's wrapping): DeepSpeed's granularity threshold
        zero["stage3_module_granularity_threshold"] = GRANULARITY
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "gradient_clipping": CLIP, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": zero, "wall_clock_breakdown": False}


class System:
    """One training system under test as three phases (forward -> loss, backward, optimizer step);
    `engine` keeps whatever must be dropped in close()."""

    def __init__(self, fwd: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 bwd: Callable[[torch.Tensor], None], opt: Callable[[], None], engine: Any) -> None:
        self.fwd, self.bwd, self.opt = fwd, bwd, opt
        self.engine = engine

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.fwd(x, y)
        self.bwd(loss)
        self.opt()
        return loss.detach()

    def close(self) -> None:
        # engines hold autograd hooks on their parameters (C++-held references Python's gc cannot
        # see through): without destroy() a freed engine keeps its model and states on the device
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        self.engine = self.fwd = self.bwd = self.opt = None  # type: ignore[assignment]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ddp(model: GPT) -> System:
    dev = _device()
    model = model.to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=dev.type == "cuda")

    def fwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return ddp(x, y)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return System(fwd, torch.Tensor.backward, step, (ddp, opt))


def _fsdp2(model: GPT) -> System:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = _device()
    model = model.to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=dev.type == "cuda")
    except (RuntimeError, TypeError):  # a torch without fused AdamW over DTensor shards
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return System(model, torch.Tensor.backward, step, (model, opt))


def _engine(lib: Any, model: GPT, system: str, micro: int) -> System:
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=ds_config(system, micro))

    return System(engine, engine.backward, engine.step, engine)


def build(system: str, model: GPT, micro: int) -> System:
    if system == "ddp":
        return _ddp(model)
    if system == "fsdp2":
        return _fsdp2(model)
    if system.startswith("dsc"):
        import deepspeed_c
        return _engine(deepspeed_c, model, system, micro)
    if system.startswith("ds"):
        import deepspeed  # the real DeepSpeed, carried to the device as an sdist

        if deepspeed.__name__ != "deepspeed" or "deepspeed_c" in getattr(deepspeed, "__file__", ""):
            raise RuntimeError("`deepspeed` resolves to deepspeed_c's alias, not the real DeepSpeed")
        return _engine(deepspeed, model, system, micro)
    raise ValueError(f"unknown system {system!r}: ddp, fsdp2, dsc<0-3>[_off], ds<0-3>[_off]")


def zero_stage(system: str) -> int | None:
    if system in ("ddp", "fsdp2"):
        return None
    return int(system.lstrip("dsc")[0])
