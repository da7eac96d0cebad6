"""Where deepspeed_c's ZeRO-3 memory goes, in bytes per model parameter, next to what FSDP2 holds.

Runs a small GPT (examples/train_gpt) through deepspeed_c ZeRO-3 on `--world` gloo ranks on the CPU, with
the JSON benchmarks/throughput_systems.py gives `dsc3` (bf16, AdamW, clipping, DeepSpeed's default
buckets and prefetch; built under zero.Init as the GPU benchmark builds it), and lists every tensor the
engine and its optimizer can reach (object graph walk from the engine: attributes, lists, dicts, the
optimizer's state; one storage counted once) at three moments of a step:

- `bwd start`: the forward has returned the loss (activation peak: what is held beside the activations);
- `mid bwd`: half of the parameters' gradient hooks have run (buckets filling and in flight);
- `bwd end`: every gradient hook has run, before the partitioner finishes its round (gradient peak);
- `after step`: what stays between steps.

Each storage gets a category from the path it was first reached by (store shards, fp32 masters,
optimizer states, gradient partitions, reduce buckets, gathered units, step scratch, ...). Bytes are per
rank, divided by the model's parameter count (so a state sharded over W ranks at b bytes an element shows
b / W); the `xW` column multiplies back. Gathered (unsharded) units are also reported at their peak
(store.peak_live_numel).

FSDP2's expected figures (per-block fully_shard + root, MixedPrecisionPolicy(bf16 params, bf16
reduce), fused AdamW, as throughput_systems.py builds it): sharded fp32 parameters 4/W, Adam m and v
8/W, sharded fp32 gradients 4/W from the backward to zero_grad; unsharded bf16: the root's parameters
(embeddings, final norm, head: kept from forward to backward) plus about two blocks (the running one and
the prefetched one), and in the backward one block's bf16 gradients and its reduce-scatter output.

    python benchmarks/zero3_memory_breakdown.py [--world 2] [--n_layer 4] [--n_embd 256] [--vocab 512]
        [--seq 32] [--micro 2] [--steps 2] [--like 2.7B]

`--like 2.7B` (the default) scales stage3_prefetch_bucket_size, stage3_max_live_parameters and
stage3_max_reuse_distance (DeepSpeed's defaults) by this model's size over the 2.7B benchmark GPT's, so the
small model keeps gathered the share of itself the large one does; `--like ''` keeps the defaults.
Environment variables set for the run reach the engine (e.g. an A/B switch of a memory change).
"""
from __future__ import annotations

import argparse
import collections
import os
import socket
import sys
import types
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (substring of the first path a storage is reached by, category); the first match wins
CATEGORIES = [
    ("lp_out", "step scratch (16-bit copy of the partition)"),
    ("store.shards", "16-bit parameter shards"),
    ("store.secondary", "ZeRO++ hpZ secondary shards"),
    ("store.frozen_codes", "ZeRO++ frozen int8 codes"),
    ("store.full", "gathered units"),
    ("fp32_partitions", "fp32 master partitions"),
    ("param_groups", "fp32 master partitions"),
    (".state[", "optimizer states"),
    ("grad_partitions", "gradient partitions"),
    ("._bufs", "reduce buckets (filling)"),
    ("._in_flight", "reduce buckets (sent, not finished)"),
    ("._finished", "reduce buckets (sent, not finished)"),
    ("._late", "reduce buckets (late contributions)"),
    ("epilogue", "fused step counters"),
]
_ATOMS = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device)


def reachable_tensors(root: Any, name: str) -> dict[int, tuple[str, int, torch.dtype]]:
    """storage address -> (first path, storage bytes, dtype) of every tensor reachable from `root`
    (breadth first, so each storage is named by a shortest path)."""
    found: dict[int, tuple[str, int, torch.dtype]] = {}
    seen: set[int] = set()
    queue = collections.deque([(root, name)])
    while queue:
        obj, path = queue.popleft()
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                if storage.nbytes() > 0:
                    found.setdefault(storage.data_ptr(), (path, storage.nbytes(), obj.dtype))
            if obj.grad is not None:
                queue.append((obj.grad, path + ".grad"))
            continue
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                label = k if isinstance(k, (str, int)) else type(k).__name__
                queue.append((v, f"{path}[{label!r}]"))
            continue
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            for i, v in enumerate(obj):
                queue.append((v, f"{path}[{i}]"))
            continue
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in attrs.items():
                queue.append((v, f"{path}.{k}"))
        for k in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, k):
                queue.append((getattr(obj, k), f"{path}.{k}"))
    return found


def categorise(found: dict[int, tuple[str, int, torch.dtype]], store: Any) -> dict[str, int]:
    # a gathered unit is reached first through the module's parameters (views of it): named by the store
    units = {store.full[u].untyped_storage().data_ptr(): store.persistent[u] for u in range(len(store.full))
             if store.full[u] is not None}
    early = {store.full[u].untyped_storage().data_ptr() for u in getattr(store, "early", ())
             if store.full[u] is not None}
    out: dict[str, int] = collections.Counter()
    for ptr, (path, nbytes, dtype) in found.items():
        cat = next((c for key, c in CATEGORIES if key in path), None)
        if ptr in units or cat == "gathered units":
            cat = "gathered units (persistent)" if units.get(ptr) else "gathered units (live)"
            if ptr in early:
                cat = "gathered ahead by the step (next forward's first)"
        if cat is None:
            cat = f"other: {path} ({str(dtype).replace('torch.', '')})"
        out[cat] += nbytes
    return out


def fsdp2_expected(model: torch.nn.Module, world: int) -> dict[str, dict[str, float]]:
    """FSDP2's bytes per rank at the same three moments (see the module docstring)."""
    n = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = n - sum(p.numel() for b in model.blocks for p in b.parameters())
    sharded_params, adam, grads = 4 * n / world, 8 * n / world, 4 * n / world
    return {
        "bwd start": {"fp32 parameter shards": sharded_params, "optimizer states": adam,
                      "unsharded bf16 (root + 2 blocks)": 2 * root + 2 * 2 * block},
        "mid bwd": {"fp32 parameter shards": sharded_params, "optimizer states": adam, "fp32 gradient shards": grads / 2,
                    "unsharded bf16 (root + 1 block, 1 block grads, RS out)":
                        2 * root + 2 * block + 2 * block + 2 * block / world},
        "bwd end": {"fp32 parameter shards": sharded_params, "optimizer states": adam, "fp32 gradient shards": grads,
                    "unsharded bf16 (root + 1 block, 1 block grads, RS out)":
                        2 * root + 2 * block + 2 * block + 2 * block / world},
        "after step": {"fp32 parameter shards": sharded_params, "optimizer states": adam},
    }


# DeepSpeed 0.19.8's defaults of the element-count limits that decide what stays gathered
LIMITS = {"stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}


def scaled_limits(n_params: int, like: str) -> dict[str, int]:
    """The default limits scaled by n_params / params of the benchmark GPT `like`, so the small model keeps
    gathered the share of itself the large one keeps under the defaults."""
    from throughput_systems import MODELS, build_model

    if like not in MODELS:
        raise ValueError(f"--like: unknown model {like!r}, choose from {sorted(MODELS)}")
    big = sum(p.numel() for p in build_model(like, 50304, 2048, "meta").parameters())
    return {k: max(1, int(v * n_params / big)) for k, v in LIMITS.items()}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed_c

    from throughput_systems import ds_config
    sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = ds_config("dsc3", args.micro)
    gcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)
    if args.like:
        cfg["zero_optimization"].update(scaled_limits(sum(p.numel() for p in GPT(gcfg).parameters()), args.like))
    with deepspeed_c.zero.Init(config_dict_or_path=cfg):
        model = GPT(gcfg)
    n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = engine.optimizer
    store = opt.store
    snaps: dict[str, dict[str, int]] = {}
    reducer = opt.reducer
    finish = reducer._finish_round

    def finish_round() -> None:  # the end of backward: every hook has run, the round is not finished
        snaps["bwd end"] = categorise(reachable_tensors(engine, "engine"), store)
        finish()

    reducer._finish_round = finish_round
    on_grad, arrived = reducer._on_grad, [0]
    half = len(reducer.reduced_params) // 2

    def counted(k: int) -> None:  # half way through the backward: activations and gradients side by side
        on_grad(k)
        arrived[0] += 1
        if arrived[0] % len(reducer.reduced_params) == half:
            snaps["mid bwd"] = categorise(reachable_tensors(engine, "engine"), store)

    reducer._on_grad = counted
    gen = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen)
        y = torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen)
        loss = engine(x, y)
        snaps["bwd start"] = categorise(reachable_tensors(engine, "engine"), store)
        engine.backward(loss)
        engine.step()
        snaps["after step"] = categorise(reachable_tensors(engine, "engine"), store)
    peak_live = store.peak_live_numel * store.dtype.itemsize if hasattr(store.dtype, "itemsize") else 0
    if rank == 0:
        plain = GPT(gcfg)  # on the CPU, for FSDP2's expected shape-dependent terms
        out.put((n_params, snaps, peak_live, fsdp2_expected(plain, world), loss.item()))
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(n: int, world: int, snaps: dict[str, dict[str, int]], peak_live: int,
                fsdp2: dict[str, dict[str, float]]) -> None:
    print(f"model parameters: {n:,}   world: {world}   bytes per parameter per rank (xW: times the world size)")
    for moment in ("bwd start", "mid bwd", "bwd end", "after step"):
        ours, theirs = snaps.get(moment, {}), fsdp2[moment]
        print(f"\n-- {moment} " + "-" * (70 - len(moment)))
        print(f"{'deepspeed_c ZeRO-3':<58} {'B/param':>8} {'xW':>7}")
        for cat, b in sorted(ours.items(), key=lambda kv: -kv[1]):
            print(f"  {cat[:56]:<56} {b / n:8.3f} {b * world / n:7.2f}")
        total = sum(ours.values())
        print(f"  {'total':<56} {total / n:8.3f} {total * world / n:7.2f}")
        print(f"{'FSDP2 (expected)':<58}")
        for cat, b in theirs.items():
            print(f"  {cat[:56]:<56} {b / n:8.3f} {b * world / n:7.2f}")
        ftotal = sum(theirs.values())
        print(f"  {'total':<56} {ftotal / n:8.3f} {ftotal * world / n:7.2f}   ours/FSDP2 {total / ftotal:.3f}")
    print(f"\npeak gathered (non-persistent) units during the steps: {peak_live / n:.3f} B/param "
          f"({peak_live:,} bytes)")
    print("not on the CPU: the fused CUDA step (Adam/AdamW, fp32 masters on the device) writes its 16-bit output "
          "straight into the shards; it kept a partition-sized 16-bit scratch before (2/W B/param, held between steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=256)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--like", default="2.7B", help="scale the default prefetch/live/reuse limits to this benchmark "
                    "GPT's size ('' keeps DeepSpeed's defaults as they are)")
    args = ap.parse_args()
    if args.world < 1:
        raise ValueError(f"--world must be >= 1, got {args.world}")
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    n, snaps, peak_live, fsdp2, loss = out.get(timeout=600)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    print_table(n, args.world, snaps, peak_live, fsdp2)
    print(f"last loss {loss:.4f}")


if __name__ == "__main__":
    main()
