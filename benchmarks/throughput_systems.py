"""The training systems benchmarks/train_throughput.py compares, each built from the same initial
weights and driven through one interface: `step(x, y) -> loss` (forward, backward, optimizer step,
gradient clipping 1.0, AdamW lr 1e-4 weight decay 0.01, bf16 compute) and `close()`.

- ``ddp``: torch DDP over fp32 weights under bf16 autocast, torch's fused AdamW, clip_grad_norm_.
- ``fsdp2``: torch FSDP2 (`fully_shard` per block, then the root) with bf16 parameters for compute,
  fp32 sharded masters, bf16 gradient reduction, fused AdamW on the shards, clip_grad_norm_.
- ``dsc<stage>[_off]`` / ``ds<stage>[_off]``: deepspeed_c / the real DeepSpeed with one JSON config
  (bf16, ZeRO stage, overlap_comm, contiguous gradients, DeepSpeed's default bucket sizes; `_off`
  moves the optimizer to the CPU, `_offp` the parameters too, stage 3).

`build_lean(system, name, vocab, seq, micro)` builds a system without one rank ever holding the whole
fp32 model (6.7B is 27 GB, 13B 52 GB a copy): the model is declared on the meta device and each
system materialises only what it keeps (DDP its replica on the GPU, FSDP2 its shards, deepspeed_c /
DeepSpeed stages 0-2 a bf16 replica, stage 3 one module at a time under `zero.Init`, partitioned as
each constructor returns). Every system then gets the same values: `init_value(name, shape)`, a
normal(0, 0.02) per parameter from a generator seeded by its name (LayerNorm weights 1, biases 0),
computed one parameter at a time on the compute device.
"""
from __future__ import annotations

import gc
import os
import sys
import zlib
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
    "6.7B": dict(n_embd=4096, n_layer=32, n_head=32),
    "13B": dict(n_embd=5120, n_layer=40, n_head=40),
}
LR, WD, CLIP = 1e-4, 0.01, 1.0
ZERO_EXTRA: dict[str, Any] = {}
# `<system>_g`: stage3_module_granularity_threshold making each GPT block one unit (block granularity of the
# 1.3B shape: 50.3M params / 9 counted modules = 5.6M; attention 5.6M and MLP 11.2M stay inside it)
GRANULARITY = int(2e7)  # train_throughput --zero_extra: keys merged into zero_optimization (variants)


def build_model(name: str, vocab: int, seq: int, device: str | torch.device | None = None) -> GPT:
    """The GPT of shape `name`; `device="meta"` declares it without storage (no memory, no init)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {sorted(MODELS)}")
    if device is None:
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, **MODELS[name]))
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, **MODELS[name]))


def ds_config(system: str, micro: int) -> dict[str, Any]:
    stage = zero_stage(system)
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if system.endswith(("_off", "_offp")):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if system.endswith("_offp"):
        if stage != 3:
            raise ValueError(f"system {system!r}: `_offp` (offload_param) needs ZeRO stage 3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
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


def _fsdp2(model: GPT, materialise: bool = False) -> System:
    """materialise: `model` is on meta; its shards are allocated after wrapping and filled."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = _device()
    if not materialise:
        model = model.to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if materialise:
        model.to_empty(device=dev)
        _fill_dtensor(model)
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


# -- lean builds: no rank holds the whole fp32 model --------------------------------------------------
def init_value(name: str, shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The fp32 initial value of parameter `name` (the same on every rank and for every system)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if leaf == "weight" and len(shape) == 1:  # LayerNorm
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def _fill_plain(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        p.copy_(init_value(name, p.shape, p.device))


@torch.no_grad()
def _fill_dtensor(model: torch.nn.Module) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        # every rank computes the same whole value: each keeps its own chunk, no collective
        full = init_value(name, p.shape, p.to_local().device)
        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


@torch.no_grad()
def _fill_zero3(lib: Any, model: torch.nn.Module) -> None:
    """One parameter gathered at a time: written on rank 0, broadcast and re-partitioned on exit."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, p in model.named_parameters():
        with lib.zero.GatheredParameters([p], modifier_rank=0):
            if rank == 0:
                p.data.copy_(init_value(name, p.data.shape, p.data.device))


def _lib(system: str) -> Any:
    if system.startswith("dsc"):
        import deepspeed_c
        return deepspeed_c
    import deepspeed  # the real DeepSpeed, carried to the device as an sdist

    if deepspeed.__name__ != "deepspeed" or "deepspeed_c" in getattr(deepspeed, "__file__", ""):
        raise RuntimeError("`deepspeed` resolves to deepspeed_c's alias, not the real DeepSpeed")
    return deepspeed


def build_lean(system: str, name: str, vocab: int, seq: int, micro: int) -> System:
    """`system` over the GPT `name`, materialised as the system keeps it (see the module docstring)."""
    dev = _device()
    if system == "ddp":
        model = build_model(name, vocab, seq, "meta").to_empty(device=dev)
        _fill_plain(model)
        return _ddp(model)
    if system == "fsdp2":
        model = build_model(name, vocab, seq, "meta")
        sysm = _fsdp2(model, materialise=True)
        return sysm
    if not system.startswith("ds"):
        raise ValueError(f"unknown system {system!r}: ddp, fsdp2, dsc<0-3>[_off|_offp|_g], ds<0-3>[...]")
    lib = _lib(system)
    cfg = ds_config(system, micro)
    if zero_stage(system) == 3:
        with lib.zero.Init(config_dict_or_path=cfg):
            model = build_model(name, vocab, seq)
        _fill_zero3(lib, model)
    else:  # the bf16 replica the engine would cast to, made directly (never fp32 on the device)
        model = build_model(name, vocab, seq, "meta").to(torch.bfloat16).to_empty(device=dev)
        _fill_plain(model)
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return System(engine, engine.backward, engine.step, engine)


def build(system: str, model: GPT, micro: int) -> System:
    if system == "ddp":
        return _ddp(model)
    if system == "fsdp2":
        return _fsdp2(model)
    if system.startswith("ds"):
        return _engine(_lib(system), model, system, micro)
    raise ValueError(f"unknown system {system!r}: ddp, fsdp2, dsc<0-3>[_off|_offp|_g], ds<0-3>[...]")


def zero_stage(system: str) -> int | None:
    if system in ("ddp", "fsdp2"):
        return None
    return int(system.lstrip("dsc")[0])
