"""Domino (issue 53): deepspeed_c's Domino against our plain tensor parallelism (AutoTP's LinearLayer /
LinearAllreduce, synchronous all-reduces over the whole micro-batch) on the same GPT and the same
Parameter objects, and the real DeepSpeed 0.19.8's Domino side by side (its DominoTransformer loaded
with our weights) when `import deepspeed` is the real one (e.g. PYTHONPATH=/tmp/ds_real).

One process per rank, spawned here (NCCL, one GPU each; gloo on the host with --device cpu). Rank 0 prints:
1. correctness first: a small fp32 GPT (TF32 off): loss and every gradient of Domino against plain TP
   and against DeepSpeed's Domino (norm of the difference relative to the tensor's, 1e-5; a system
   that fails here is reported and not timed), then the benchmarked model in its dtype (bf16: 2**-5);
2. tokens/s of forward + backward (no optimizer: the systems differ only there), --reps interleaved
   blocks of --iters steps, medians, ratios Domino (inter- and intra-layer schedules) / plain TP and
   / DeepSpeed's Domino (its default, inter-layer schedule, or --intra);
3. with CUDA, a torch.profiler trace of --profile_iters steps per system: the time NCCL kernels run and
   the part of it no compute kernel overlaps (exposed communication), per step.

    python benchmarks/domino.py --tp 2 --size 1.3B --seq 1024 --micro 16
    python benchmarks/domino.py --device cpu --size tiny --seq 32 --micro 4   (gloo smoke)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "domino"))
import gpt  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--size", choices=sorted(gpt.SIZES), default="1.3B")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=16, help="micro-batch (even: Domino splits it in two)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile_iters", type=int, default=2)
    ap.add_argument("--intra", action="store_true", help="Domino's intra-layer overlap (default: inter-layer)")
    ap.add_argument("--tp_max_ctas", type=int, default=0,
                    help="NCCL: at most this many CTAs (SMs) per collective of the tensor-parallel group, for every "
                         "system (fewer SMs taken from the overlapped compute); 0: NCCL's default")
    ap.add_argument("--no_deepspeed", action="store_true", help="leave out the real DeepSpeed's Domino")
    return ap.parse_args()


def real_deepspeed() -> Any:
    """The real DeepSpeed module, or None (absent, broken, or deepspeed_c's compat alias)."""
    try:
        import deepspeed
    except Exception:  # noqa: BLE001  (any failure to import means: not available here)
        return None
    if "deepspeed_c" in getattr(deepspeed, "__file__", "") or hasattr(deepspeed, "_dsc_alias"):
        return None
    return deepspeed if getattr(deepspeed, "initialize", None) is not None else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()


class _OwnTPGroup:
    """The grid's mpu with its tensor-parallel group rebuilt with NCCL options (max CTAs)."""

    def __init__(self, grid: Any, max_ctas: int) -> None:
        self._grid = grid
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        ranks = sorted(torch.distributed.get_process_group_ranks(grid.get_tensor_model_parallel_group()))
        self._group = torch.distributed.new_group(ranks, pg_options=opts)

    def get_tensor_model_parallel_group(self) -> Any:
        return self._group

    get_model_parallel_group = get_slice_parallel_group = get_tensor_model_parallel_group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class _Intra(torch.nn.Module):
    """The same DominoTransformer run with the intra-layer schedule."""

    def __init__(self, domino: torch.nn.Module) -> None:
        super().__init__()
        self.domino = domino

    def forward(self, hidden: torch.Tensor, mask: Any, rotary_pos_emb: Any = None) -> torch.Tensor:
        return self.domino.intra_layer_overlap_forward(hidden, mask, rotary_pos_emb)


class Bench:
    """One GPT whose transformer is swapped between the systems."""

    def __init__(self, args: argparse.Namespace, size: str, dtype: torch.dtype, mpu: Any, real: Any,
                 device: torch.device, seq: int, micro: int, vocab: int) -> None:
        self.device, self.seq, self.micro, self.vocab = device, seq, micro, vocab
        torch.manual_seed(0)  # every rank the same replicated weights
        config = gpt.domino_config(size, dtype, domino_intra_layer_overlap=args.intra)
        self.model = gpt.GPT(config, mpu, vocab, seq)
        domino = self.model.transformer
        self.systems: dict[str, torch.nn.Module] = {"domino": domino, "domino-intra": _Intra(domino),
                                                    "plain-tp": gpt.PlainTPTransformer(domino)}
        self.problems: dict[str, str] = {}
        if real is not None:
            try:
                self.systems["ds-domino"] = self._deepspeed_domino(real, config, mpu, domino)
            except Exception as e:  # noqa: BLE001  (reported, then left out)
                self.problems["ds-domino"] = f"could not be built: {type(e).__name__}: {e}"
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (micro, seq + 1), generator=g).to(device)

    @staticmethod
    def _deepspeed_domino(real: Any, config: Any, mpu: Any, ours: torch.nn.Module) -> torch.nn.Module:
        from deepspeed.runtime.domino.transformer import DominoTransformer, ModelType

        ds_config = dataclasses.replace(config, perform_initialization=False)
        model = DominoTransformer(ds_config, mpu, None, ModelType.encoder_or_decoder)
        ref = next(ours.parameters())
        model.to(device=ref.device, dtype=ref.dtype)  # its LayerNorms are built on the host in fp32
        model.load_state_dict(ours.state_dict())
        return model

    def step(self, name: str) -> torch.Tensor:
        self.model.transformer = self.systems[name]
        self.model.zero_grad(set_to_none=True)
        for m in self.systems.values():
            m.zero_grad(set_to_none=True)
        loss = self.model(self.ids[:, :-1], self.ids[:, 1:])
        loss.backward()
        return loss.detach()

    def grads(self, name: str) -> dict[str, torch.Tensor]:
        """The loss's gradients after step(name): the embeddings' and each transformer parameter's (by
        DominoTransformer's names; plain TP shares Domino's parameters)."""
        out = {k: p.grad.float().clone() for k, p in self.model.named_parameters(recurse=False)}
        out.update({f"embed.{k}": p.grad.float().clone() for k, p in self.model.embed.named_parameters()})
        module = self.systems["domino"] if name in ("plain-tp", "domino-intra") else self.systems[name]
        out.update({k: p.grad.float().clone() for k, p in module.named_parameters()})
        return out

    def check(self, tol: float, drop: bool) -> list[str]:
        """Each system's loss and gradients against Domino's (relative norm of the difference, per tensor);
        with `drop`, a system that fails or disagrees is left out of the timing."""
        ref_loss = self.step("domino").float()
        ref = self.grads("domino")
        lines = []
        for name in [n for n in self.systems if n != "domino"]:
            try:
                loss = self.step(name).float()
                grads = self.grads(name)
            except Exception as e:  # noqa: BLE001
                self.problems[name] = f"failed: {type(e).__name__}: {e}"
                del self.systems[name]
                continue
            worst = max((torch.linalg.vector_norm(grads[k] - g) / torch.linalg.vector_norm(g).clamp_min(1e-30)).item()
                        for k, g in ref.items())
            loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            ok = loss_err <= tol and worst <= tol
            lines.append(f"{name:12s} vs domino: loss rel {loss_err:.2e}, worst gradient rel {worst:.2e} "
                         f"(tolerance {tol:g}) {'OK' if ok else 'MISMATCH'}")
            if not ok and drop:
                self.problems[name] = "mismatch against Domino (not timed)"
                del self.systems[name]
        return lines


def exposed_comm(trace_path: str) -> tuple[float, float]:
    """(NCCL kernel time, the part of it overlapped by no compute kernel), in ms, from a chrome trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    comm, compute = [], []
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            (comm if "nccl" in e.get("name", "").lower() else compute).append(span)

    def union(spans: list) -> list:
        merged: list = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    comm_u, comp_u = union(comm), union(compute)
    total = sum(b - a for a, b in comm_u)
    covered, j = 0.0, 0
    for a, b in comm_u:
        while j < len(comp_u) and comp_u[j][1] <= a:
            j += 1
        k = j
        while k < len(comp_u) and comp_u[k][0] < b:
            covered += min(b, comp_u[k][1]) - max(a, comp_u[k][0])
            k += 1
    return total / 1e3, (total - covered) / 1e3


def profile(bench: Bench, name: str, iters: int, rank: int) -> tuple[float, float]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    _sync(bench.device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            bench.step(name)
        _sync(bench.device)
    if rank != 0:
        return 0.0, 0.0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        total, exposed = exposed_comm(path)
    return total / iters, exposed / iters


def timed(bench: Bench, args: argparse.Namespace) -> dict[str, float]:
    names = list(bench.systems)
    for name in names:
        for _ in range(args.warmup):
            bench.step(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.reps):
        for name in names:  # interleaved blocks
            _sync(bench.device)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                bench.step(name)
            _sync(bench.device)
            times[name].append((time.perf_counter() - t0) / args.iters)
    return {n: statistics.median(t) for n, t in times.items()}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    import deepspeed_c
    from deepspeed_c.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed_c.init_distributed(dist_backend=backend)
    real = None if args.no_deepspeed else real_deepspeed()
    if real is not None:
        real.init_distributed(dist_backend=backend)  # its comm layer's state
    mpu = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=world, num_dp=1))
    if args.tp_max_ctas > 0 and backend == "nccl":
        mpu = _OwnTPGroup(mpu, args.tp_max_ctas)
    say: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"Domino benchmark: tp={world} device={args.device} size={args.size} seq={args.seq} micro={args.micro} "
        f"vocab={args.vocab} DeepSpeed's schedule={'intra' if args.intra else 'inter'}-layer "
        f"tp_max_ctas={args.tp_max_ctas or 'default'}; DeepSpeed's Domino: "
        f"{'real DeepSpeed ' + real.__version__ if real is not None else 'not importable (left out)'}")
    small = Bench(args, "tiny", torch.float32, mpu, real, device, 32, 4, 128)
    say("-- correctness, fp32 tiny GPT (loss and every gradient; a system that fails here is not timed)")
    for line in small.check(1e-5, drop=True):
        say("  " + line)
    failed = dict(small.problems)
    del small
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = Bench(args, args.size, dtype, mpu, real, device, args.seq, args.micro, args.vocab)
    n_params = sum(p.numel() for p in bench.model.parameters()) * world  # sharded: about the whole model
    say(f"-- correctness, {args.size} GPT ({n_params / 1e9:.2f}B parameters, {str(dtype)[6:]})")
    for name in failed:
        bench.systems.pop(name, None)
    for line in bench.check(2.0**-5 if dtype != torch.float32 else 1e-5, drop=False):
        say("  " + line)
    for name, why in {**failed, **bench.problems}.items():
        say(f"  {name}: {why}")
    med = timed(bench, args)
    tokens = args.micro * args.seq
    say(f"-- forward+backward, median of {args.reps} interleaved blocks of {args.iters} steps")
    for name, t in med.items():
        say(f"  {name:12s} {t * 1e3:9.2f} ms/step  {tokens / t:12.0f} tokens/s")
    for ours in ("domino", "domino-intra"):
        for other, label in (("plain-tp", "our plain TP"), ("ds-domino", "DeepSpeed's Domino")):
            if ours in med and other in med:
                say(f"  {ours} / {label} tokens/s: {med[other] / med[ours]:.3f}x")
    if device.type == "cuda" and args.profile_iters > 0:
        say(f"-- communication per step from a torch.profiler trace of {args.profile_iters} steps (rank 0)")
        for name in bench.systems:
            total, exposed = profile(bench, name, args.profile_iters, rank)
            say(f"  {name:12s} NCCL kernels {total:8.2f} ms, exposed (no compute kernel running) {exposed:8.2f} ms")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    args = parse()
    if args.micro % 2:
        sys.exit(f"--micro must be even (Domino splits the micro-batch in two), got {args.micro}")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        sys.exit(f"needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args.tp, port, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
