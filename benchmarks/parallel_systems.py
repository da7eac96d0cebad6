"""The systems each mode of benchmarks/parallel_throughput.py compares, behind one interface:
`Runner.step(k) -> loss` trains one global batch (batch k of the mode's fixed list) and `close()`
frees it. A `Mode` names its systems in order (the first is the correctness reference), builds one,
and says how many tokens a step trains and how many FLOPs a token costs.

- pipe: dsc-1f1b, dsc-interleaved (virtual stages 2), dsc-zb_h1 (deepspeed_c.pipe.PipelineModule,
  `"pipeline": {"schedule", "virtual_stages"}`), ds-1f1b (deepspeed.pipe.PipelineModule); train_batch.
- moe: dsc-moe / ds-moe: MoEGPT with each library's MoE layer (ep_size = world), same weights
  (DeepSpeed's model loads ours' state_dict: the names match one to one), initialize() with one config
  and the MoE parameter groups; forward, backward, step. At k=1 with tokens over capacity the first
  losses differ by ~4e-4 relative: DeepSpeed keeps an expert's tokens in torch.topk's order over a 0/1
  mask (ties), deepspeed_c in token order, so different tokens are dropped (no drops: equal).
- tp: dsc-autotp / ds-autotp (`"tensor_parallel": {"autotp_size": world}`) and ddp of the unsharded
  LLaMA, the same global batch (DDP splits it over the ranks).
- sp: dsc-ulysses / ds-ulysses (DistributedAttention, each rank seq/world of the sequence), forward +
  backward of a GPT block stack; the reference `local` computes the whole sequence on every rank.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from parallel_models import (GPTConfig, MoEGPT, expert_param_count, llama, lm_loss, pipe_specs, ulysses_stack)

LR, WD, CLIP = 1e-4, 0.01, 1.0


class Runner:
    def __init__(self, step: Callable[[int], torch.Tensor], keep: Any, model: torch.nn.Module | None = None) -> None:
        self._step, self.keep, self.model = step, keep, model

    def step(self, k: int) -> torch.Tensor:
        return self._step(k)

    def close(self) -> None:
        destroy = getattr(self.keep, "destroy", None)
        if callable(destroy):  # engines hold hooks on their parameters (see throughput_systems.System)
            try:
                destroy()
            except Exception:  # noqa: BLE001 - a library without a working destroy: gc does the rest
                pass
        self._step = self.keep = self.model = None  # type: ignore[assignment]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


@dataclass
class Mode:
    systems: list[str]
    build: Callable[[str], Runner]
    tokens_per_step: int
    flops_per_token: float
    describe: str
    notes: list[str] = field(default_factory=list)
    gpus: dict[str, int] = field(default_factory=dict)  # GPUs a system's tokens/s spreads over (default world)


def real_deepspeed() -> tuple[Any, str]:
    """The real DeepSpeed module, or None and why not."""
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure means: run ours alone
        return None, f"real DeepSpeed not importable ({type(exc).__name__}: {exc})"[:300]
    if "deepspeed_c" in getattr(deepspeed, "__file__", "") or not hasattr(deepspeed, "pipe"):
        return None, "`deepspeed` resolves to deepspeed_c's alias, not the real DeepSpeed"
    return deepspeed, ""


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _precision(args: Any) -> dict[str, Any]:
    return {"bf16": {"enabled": True}} if args.dtype == "bf16" else {}


def _config(args: Any, micro: int, gas: int = 1, **extra: Any) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": args.zero}, "wall_clock_breakdown": False, **_precision(args)}
    cfg.update(extra)
    return cfg


def _tokens(n: int, rows: int, seq: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dev = _dev()
    return [(torch.randint(0, vocab, (rows, seq), generator=g).to(dev),
             torch.randint(0, vocab, (rows, seq), generator=g).to(dev)) for _ in range(n)]


def _gpt_flops(params: int, layers: int, width: int, seq: int) -> float:
    return 6 * params + 12 * layers * width * seq


def _lib(name: str) -> Any:
    if name.startswith("dsc"):
        import deepspeed_c
        return deepspeed_c
    ds, why = real_deepspeed()
    if ds is None:
        raise RuntimeError(why)
    # DeepSpeed's comm layer adopts the process group torch.distributed already has
    ds.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return ds


def _sub(lib: Any, name: str) -> Any:
    """A submodule of `lib` (deepspeed_c or deepspeed), imported (neither imports all eagerly)."""
    import importlib

    return importlib.import_module(f"{lib.__name__}.{name}")


def _engine_runner(engine: Any, batches: list, fwd: Callable[[Any, int], torch.Tensor]) -> Runner:
    def step(k: int) -> torch.Tensor:
        loss = fwd(engine, k)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return Runner(step, engine)


# -- pipe --------------------------------------------------------------------------------------------

def pipe_mode(args: Any, world: int) -> Mode:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    # every rank feeds the same micro-batches (one pipeline, no data parallelism)
    data = _tokens(args.gas, args.micro, args.seq, args.vocab, seed=1000)
    counted = pipe_specs(_sub(_lib("dsc"), 'pipe'), cfg)
    params = sum(sum(p.numel() for p in spec.build().parameters()) for spec in counted)
    scheds = {"dsc-1f1b": ("1f1b", 1), "dsc-interleaved": ("interleaved", 2), "dsc-zb_h1": ("zb_h1", 1)}

    def build(name: str) -> Runner:
        lib = _lib(name)
        # 'type:PipeBlock' balances the blocks; embedding and head ride on the first / last stage
        model = _sub(lib, 'pipe').PipelineModule(pipe_specs(_sub(lib, 'pipe'), cfg), num_stages=world, loss_fn=lm_loss,
                                        partition_method="type:PipeBlock", activation_checkpoint_interval=0)
        extra = {}
        if name in scheds:
            sched, v = scheds[name]
            extra["pipeline"] = {"schedule": sched, "virtual_stages": v}
        conf = _config(args, args.micro, args.gas, **extra)
        engine, *_ = lib.initialize(model=model, config=conf)
        return Runner(lambda k: torch.as_tensor(engine.train_batch(iter(data))), engine)

    return Mode(list(scheds) + ["ds-1f1b"], build, args.micro * args.gas * args.seq,
                _gpt_flops(params, args.layers, args.width, args.seq),
                f"GPT {params / 1e6:.0f}M params ({args.layers} x {args.width}, {args.heads} heads), {world} stages, "
                f"{args.gas} micro-batches of {args.micro} x {args.seq}")


# -- moe ---------------------------------------------------------------------------------------------

def moe_mode(args: Any, world: int) -> Mode:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    experts = args.experts or 2 * world
    data = _tokens(4, args.micro, args.seq, args.vocab, seed=1000 + dist.get_rank())
    state: dict[str, Any] = {}

    def make(lib: Any) -> MoEGPT:
        torch.manual_seed(0)
        return MoEGPT(cfg, _sub(lib, 'moe.layer').MoE, experts, world, args.k, args.capacity_factor)

    def build(name: str) -> Runner:
        lib = _lib(name)
        model = make(lib)
        if name == "dsc-moe":
            state["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        elif "weights" in state:  # the same weights as ours: names must match one to one
            theirs = model.state_dict()
            ours = set(state["weights"])
            if set(theirs) != ours:
                raise RuntimeError(f"MoE state_dict names differ: ours only {sorted(ours - set(theirs))[:4]}, "
                                   f"DeepSpeed's only {sorted(set(theirs) - ours)[:4]}")
            model.load_state_dict(state["weights"])
        groups = _sub(lib, 'moe.utils').split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        engine, *_ = lib.initialize(model=model, model_parameters=groups, config=_config(args, args.micro))
        return _engine_runner(engine, data, lambda e, k: e(*data[k % len(data)]))

    shared, one = expert_param_count(make(_lib("dsc")))
    active = shared + args.k * one  # parameters a token passes through
    return Mode(["dsc-moe", "ds-moe"], build, world * args.micro * args.seq,
                _gpt_flops(active, args.layers, args.width, args.seq),
                f"MoE GPT ({args.layers} x {args.width}, {experts} experts of {4 * args.width} hidden, top-{args.k}, "
                f"capacity factor {args.capacity_factor}), ep_size {world}, {active / 1e6:.0f}M active params, "
                f"micro {args.micro} x {args.seq} per rank, ZeRO {args.zero}",
                ["MFU counts the active parameters (shared + k experts a layer)"])


# -- tp ----------------------------------------------------------------------------------------------

def tp_mode(args: Any, world: int) -> Mode:
    if args.micro % world:
        raise ValueError(f"--micro {args.micro} must divide by the world size {world} (DDP splits the batch)")
    data = _tokens(4, args.micro, args.seq, args.vocab, seed=1000)  # one TP group: every rank the same batch
    rank = dist.get_rank()
    rows = args.micro // world

    def make() -> torch.nn.Module:
        return llama(args.width, args.layers, args.heads, args.kv_heads, args.vocab, args.seq)

    def fwd(module: Callable, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(module(input_ids=ids).logits, y)

    def build(name: str) -> Runner:
        if name == "ddp":
            dev = _dev()
            model = make().to(dev)
            ddp = torch.nn.parallel.DistributedDataParallel(model,
                                                            device_ids=[dev.index] if dev.type == "cuda" else None)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=dev.type == "cuda")

            def step(k: int) -> torch.Tensor:
                x, y = data[k % len(data)]
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                    loss = fwd(ddp, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
                t = loss.detach().clone()
                dist.all_reduce(t)  # the global batch's loss
                return t / world

            return Runner(step, (ddp, opt))
        lib = _lib(name)
        model = make()
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(),
                                    config=_config(args, args.micro, tensor_parallel={"autotp_size": world}))
        runner = _engine_runner(engine, data, lambda e, k: fwd(e, *data[k % len(data)]))
        inner_close = runner.close

        def close() -> None:  # the TP groups are process-global in both libraries
            inner_close()
            if name.startswith("dsc"):
                from deepspeed_c.utils import groups
                groups._reset_tp_groups()

        runner.close = close  # type: ignore[method-assign]
        return runner

    ref = make()
    params = sum(p.numel() for p in ref.parameters())
    del ref
    return Mode(["dsc-autotp", "ds-autotp", "ddp"], build, args.micro * args.seq,
                _gpt_flops(params, args.layers, args.width, args.seq),
                f"LLaMA {params / 1e6:.0f}M params ({args.layers} x {args.width}, {args.heads} heads, {args.kv_heads} "
                f"kv heads), TP {world} (global batch {args.micro} x {args.seq}; DDP: {rows} rows a rank), "
                f"ZeRO {args.zero}")


# -- sp ----------------------------------------------------------------------------------------------

def sp_mode(args: Any, world: int) -> Mode:
    if args.seq % world or args.heads % world:
        raise ValueError(f"--seq {args.seq} and --heads {args.heads} must divide by the world size {world}")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    rank, chunk = dist.get_rank(), args.seq // world
    dev = _dev()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1000)  # the whole sequence, the same on every rank
    full = [torch.randn(args.micro, args.seq, args.width, generator=g).to(dev, dtype) for _ in range(2)]
    mine = [x[:, rank * chunk:(rank + 1) * chunk].contiguous() for x in full]

    group = dist.new_group(list(range(world)))  # one communicator for every build

    def build(name: str) -> Runner:
        if name == "local":
            cls, xs = None, full
        else:
            cls, xs = _sub(_lib(name), 'sequence.layer').DistributedAttention, mine
        model = ulysses_stack(cfg, cls, group).to(dev, dtype)

        def step(k: int) -> torch.Tensor:
            x = xs[k % len(xs)].detach().requires_grad_(True)
            out = model(x)
            out.float().pow(2).mean().backward()
            for p in model.parameters():
                p.grad = None
            # this rank's slice of the output: what the check compares
            return (out if name != "local" else out[:, rank * chunk:(rank + 1) * chunk]).detach()

        return Runner(step, None, model)

    stack = ulysses_stack(cfg, None, None)
    params = sum(p.numel() for p in stack.parameters())
    del stack
    return Mode(["local", "dsc-ulysses", "ds-ulysses"], build, args.micro * args.seq,
                6 * params + 12 * args.layers * args.width * args.seq,
                f"{args.layers} GPT blocks ({args.width} wide, {args.heads} heads, {params / 1e6:.0f}M params), "
                f"batch {args.micro} x {args.seq}, SP {world} ({chunk} tokens a rank), forward + backward",
                ["local: every rank computes the whole sequence (the reference; its tokens/s is one GPU's)",
                 "the check compares outputs (this rank's slice), not losses"], {"local": 1})


MODES = {"pipe": pipe_mode, "moe": moe_mode, "tp": tp_mode, "sp": sp_mode}
