"""ZeRO stage 2 + CPU optimizer offload (deepspeed_c) against torch DDP on the same ranks: the same
GPT model and batches, correctness checked first (fp32: weights after 4 steps; --bf16: losses), then interleaved timed
blocks. Prints tokens/s, peak memory per rank (GPU: max_memory_allocated; CPU: peak RSS), the
ratio, and the offload pipeline's own timers per step: how long the host waited for the gradients'
device-to-host copies at the step against how long those copies took (the rest overlapped
backward), the CPU optimizer's time (the host-to-device copies and all-gathers run meanwhile), and
the tail after it. DDP steps torch's AdamW(fused=True) and has no comm hook; with --bf16 both sides
hold bf16 weights and reduce bf16 gradients (deepspeed_c keeps fp32 masters on the host, DDP
steps the bf16 weights).

    python benchmarks/zero_offload.py [--world 2] [--steps 15] [--n_embd 256] [--n_layer 4] [--bucket 2e7]
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))


def body(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    import deepspeed_c
    from model import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=128, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    base = GPT(cfg)
    micro = args.micro
    ds_config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
                 "zero_optimization": {"stage": 2, "reduce_bucket_size": int(args.bucket),
                                       "allgather_bucket_size": int(args.bucket),
                                       "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}}
    if args.bf16:  # bf16 weights and gradients on both sides; deepspeed_c's masters stay fp32 on the host
        ds_config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=copy.deepcopy(base), config=ds_config)
    ddp_model = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randint(0, 96, (micro, 128), generator=g), torch.randint(0, 96, (micro, 128), generator=g))
               for _ in range(args.steps)]

    def ds_step(x, y):
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        return loss

    def ddp_step(x, y):
        loss = ddp(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = []
    for x, y in batches[:4]:  # correctness before timing
        losses.append((float(ds_step(x, y).detach()), float(ddp_step(x, y).detach())))
    if args.bf16:  # fp32 masters vs bf16 weights stepped in place round differently: compare the losses
        worst = max(abs(a - b) / abs(b) for a, b in losses)
        assert worst < 2e-2, f"ZeRO-2 + offload (bf16) diverged from bf16 DDP: {losses}"
    else:
        worst = max(((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm()).item()
                    for a, b in zip(engine.module.parameters(), ddp_model.parameters()))
        assert worst < 1e-4, f"ZeRO-2 + offload diverged from DDP: {worst:.2e}"
    stats0 = dict(engine.optimizer.offload_stats())
    times = {"zero2_offload": 0.0, "ddp": 0.0}
    peak: dict[str, int] = {}
    for rep in range(2):  # interleaved blocks
        for name, fn in (("zero2_offload", ds_step), ("ddp", ddp_step)):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            start = time.perf_counter()
            for x, y in batches[4:]:
                fn(x, y)
            if cuda:
                torch.cuda.synchronize()
            times[name] += time.perf_counter() - start
            if cuda:  # device memory while this run's block ran (both models stay resident)
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated(device))
    peak["process_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = 2 * (args.steps - 4) * micro * 128 * world
    stats = engine.optimizer.offload_stats()
    timed = {k: stats[k] - stats0[k] for k in stats}  # the timed blocks only
    return {"worst_rel": worst, "tps": {k: tokens / v for k, v in times.items()}, "peak": peak,
            "params": sum(p.numel() for p in base.parameters()), "device": str(device), "offload": timed,
            "buckets": engine.optimizer.partition_plans[0].num_buckets}


def main() -> None:
    from tests.harness import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--n_embd", type=int, default=256)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--bf16", action="store_true", help="bf16 weights and gradients on both sides")
    ap.add_argument("--bucket", type=float, default=2e7, help="reduce_bucket_size = allgather_bucket_size")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2),
                    help="OpenMP/torch threads per rank (the CPU optimizer's cores); default cores / world")
    args = ap.parse_args()
    threads = max(1, min(args.threads, (os.cpu_count() or 1) // args.world))
    res = run_distributed(body, args.world, args=(args,), timeout=1200, env={"OMP_NUM_THREADS": str(threads)})
    r0 = res[0]
    print(f"GPT {r0['params'] / 1e6:.1f}M params, {args.world} ranks on {r0['device'].split(':')[0]}, "
          f"micro-batch {args.micro} x 128 tokens, {threads} CPU threads/rank; {'bf16' if args.bf16 else 'fp32'}; "
          f"{'losses' if args.bf16 else 'weights'} over 4 steps vs DDP: rel {r0['worst_rel']:.1e}")
    tps_z = sum(r["tps"]["zero2_offload"] for r in res) / len(res)
    tps_d = sum(r["tps"]["ddp"] for r in res) / len(res)
    print(f"{'':<26}{'tokens/s':>12}")
    print(f"{'ZeRO-2 + CPU offload':<26}{tps_z:>12,.0f}")
    print(f"{'torch DDP + fused AdamW':<26}{tps_d:>12,.0f}")
    print(f"ratio ZeRO-2+offload / DDP: {tps_z / tps_d:.2f}x")
    for rank, r in enumerate(res):
        mem = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in r["peak"].items())
        print(f"rank {rank} peak memory: {mem} (device peaks per run; RSS covers both runs)")
    print(f"offload pipeline, ms per step (rank 0, {r0['buckets']} gradient buckets, timed blocks):")
    st = r0["offload"]
    n = max(1, int(st["steps"]))
    print(f"  gradients to host: copies {st['d2h_copy_ms'] / n:8.2f} ms on the side stream, host waited "
          f"{1e3 * st['d2h_wait_s'] / n:8.2f} ms at step ({st['d2h_bytes'] / n / 2**20:,.1f} MiB)")
    print(f"  CPU optimizer:     {1e3 * st['cpu_step_s'] / n:8.2f} ms (weights to device meanwhile: copies "
          f"{st['h2d_copy_ms'] / n:.2f} ms, {st['h2d_bytes'] / n / 2**20:,.1f} MiB)")
    print(f"  tail after it:     {1e3 * st['tail_s'] / n:8.2f} ms (last copies + all-gathers)")
    if st["d2h_copy_ms"] > 0:
        hidden = max(0.0, 1.0 - 1e3 * st["d2h_wait_s"] / st["d2h_copy_ms"])
        print(f"  device-to-host copy time hidden behind backward: {100 * hidden:.0f}%")


if __name__ == "__main__":
    main()
