"""GPU check of the 1-bit compression kernels (csrc/cuda/onebit.cu): correctness against the CPU
core (csrc/cpu/onebit.c, whose scalar build is the reference) first, then throughput at 2^28
elements against torch's device-to-device copy, interleaved reps on one GPU.

Correctness (odd sizes, lengths of every residue mod 8, multi-segment chunk-major tables,
+0/-0/NaN): sign bits, the error buffer (compensated - scale * sign) and decompressed values, both
accumulated and plain, the plain ones into a 16-byte aligned output (float4 path) and one 4 bytes
off (scalar path), bit-equal to the CPU core's; sums of squares within 1e-9 relative (double
atomics, another order). The plain unpack timed at 2^28 (several grid-stride passes) is checked
against the bits unpacked by torch. Then the compressed all-reduce of
runtime/comm/compressed.py on this one GPU with NCCL at world size 1 (a smoke run of the plumbing).

Throughput: bytes each kernel must move per element (compensate: read y and err, write y = 12 B;
pack with error feedback: read y, write err and 1/8 B of bits = 8.125 B; unpack: write 4 B + read
1/8 B; unpack accumulating: 8.125 B), divided by its median time, against the copy's 8 B per element
(read + write). The bar (issue 19): pack and unpack >= 85% of copy bandwidth. torch's fill (4 B per
element, write only) is printed beside them as the write-only ceiling plain unpack can approach.

    python scripts/onebit_gpu_check.py [--log2n 28] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _ops():
    from deepspeed_c.ops.op_builder.onebit import OnebitBuilder, OnebitCUDABuilder

    return OnebitBuilder(simd="scalar").load(), OnebitCUDABuilder().load(verbose=True)


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    specials = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30])
    k = min(n, len(specials))
    x[torch.randperm(n, generator=g)[:k]] = specials[:k]
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]))
    return bool(torch.equal(a, b))


def check_correctness(cpu, gpu) -> None:
    dev = torch.device("cuda")
    # lengths: every residue mod 8 (plain unpack writes whole float4 quads, then len % 4 singly)
    cases = [[(0, n, 0)] for n in (1, 2, 4, 7, 9, 12, 13, 16, 33, 4097, 4100, 65542, 1_000_003)]
    cases.append([(0, 5, 0), (8, 16, 1), (24, 1, 2), (32, 9, 3), (48, 2048, 1)])  # shared scale index 1
    for rows in cases:
        total = max(o + n for o, n, _ in rows)
        total = -(-total // 8) * 8
        nscale = max(i for *_, i in rows) + 1
        max_len = max(n for _, n, _ in rows)
        segs = torch.tensor(rows, dtype=torch.int64)
        y, e = _values(total, total), torch.randn(total, generator=torch.Generator().manual_seed(1))
        scales = torch.rand(nscale, generator=torch.Generator().manual_seed(2)) + 0.5
        out = {}
        for name, op, d in (("cpu", cpu, torch.device("cpu")), ("gpu", gpu, dev)):
            # clones: on the host .to() returns the tensor itself, and the ops write y and e in place
            yy, ee, sc, sg = y.clone().to(d), e.clone().to(d), scales.to(d), segs.to(d)
            sumsq = torch.zeros(nscale, dtype=torch.float64, device=d)
            op.compensate(yy, ee, sg, sumsq, max_len)
            bits = torch.zeros(total // 8, dtype=torch.uint8, device=d)
            op.pack(yy, ee, bits, sg, sc, max_len)
            dec = torch.full((total,), 0.5, device=d)
            op.unpack(bits, dec, sg, sc, True, max_len)
            plain = []
            for shift in (0, 1):  # out 16-byte aligned (float4 stores), then 4 bytes past (scalar path)
                buf = torch.full((total + 1,), 0.5, device=d)
                view = buf[shift:shift + total]
                assert name == "cpu" or view.data_ptr() % 16 == 4 * shift, "output alignment not as meant"
                op.unpack(bits, view, sg, sc, False, max_len)
                plain.append(buf)
            torch.cuda.synchronize()
            out[name] = (yy.cpu(), ee.cpu(), bits.cpu(), dec.cpu(), sumsq.cpu(), *(b.cpu() for b in plain))
        c, g = out["cpu"], out["gpu"]
        assert _same(c[0], g[0]), f"compensated buffer differs ({rows[:2]}...)"
        assert _same(c[1], g[1]), f"error buffer differs ({rows[:2]}...)"
        assert _same(c[2], g[2]), f"sign bits differ ({rows[:2]}...)"
        assert _same(c[3], g[3]), f"decompressed values differ ({rows[:2]}...)"
        assert _same(c[5], g[5]), f"plain decompression (aligned output) differs ({rows[:2]}...)"
        assert _same(c[6], g[6]), f"plain decompression (unaligned output) differs ({rows[:2]}...)"
        finite = torch.isfinite(c[4])
        assert torch.allclose(c[4][finite], g[4][finite], rtol=1e-9), "sums of squares differ"
    print(f"correctness: CUDA bits, error feedback and decompression (accumulated; plain, aligned and not) "
          f"equal the CPU core's ({len(cases)} tables, odd sizes)")


def check_allreduce_plumbing() -> None:
    import torch.distributed as tdist

    from deepspeed_c.runtime.comm.compressed import SignAllreduce

    if not tdist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        tdist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda")
    tensors = [torch.randn(n, device=dev) for n in (5, 1000, 77)]
    plan = SignAllreduce([t.numel() for t in tensors], device=dev)
    want = []
    for t in tensors:  # world 1: one worker compression then one server compression of the same chunk
        x = torch.nn.functional.pad(t.double(), (0, plan.padded[len(want)] - t.numel()))
        s1 = x.norm() / x.numel() ** 0.5
        m = s1 * torch.where(x < 0, -1.0, 1.0).double()
        s2 = m.norm() / m.numel() ** 0.5
        want.append((s2 * torch.where(m < 0, -1.0, 1.0).double())[:t.numel()])
    plan(tensors)
    torch.cuda.synchronize()
    for t, w in zip(tensors, want):
        assert torch.allclose(t.double(), w, rtol=1e-5, atol=1e-6), "compressed all-reduce on the GPU"
    tdist.destroy_process_group()
    print("compressed all-reduce (NCCL, world 1) matches float64")


def _time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def throughput(gpu, log2n: int, reps: int) -> None:
    n = 1 << log2n
    dev = torch.device("cuda")
    y = torch.randn(n, device=dev)
    e = torch.randn(n, device=dev)
    dst = torch.empty(n, device=dev)
    bits = torch.empty(n // 8, dtype=torch.uint8, device=dev)
    segs = torch.tensor([[0, n, 0]], dtype=torch.int64, device=dev)
    scale = torch.ones(1, device=dev)
    sumsq = torch.zeros(1, dtype=torch.float64, device=dev)
    runs = {
        "copy (torch)": (lambda: dst.copy_(y), 8.0),
        "fill (torch, write only)": (lambda: dst.fill_(0.25), 4.0),
        "compensate (y += err, sum y^2)": (lambda: gpu.compensate(dst, e, segs, sumsq, n), 12.0),
        "pack + error feedback": (lambda: gpu.pack(y, e, bits, segs, scale, n), 8.125),
        "pack (signs only)": (lambda: gpu.pack(y, None, bits, segs, scale, n), 4.125),
        "unpack": (lambda: gpu.unpack(bits, dst, segs, scale, False, n), 4.125),
        "unpack + accumulate": (lambda: gpu.unpack(bits, dst, segs, scale, True, n), 8.125),
    }
    for fn, _ in runs.values():  # warm-up
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):  # interleaved
        for k, (fn, _) in runs.items():
            times[k].append(_time(fn))
    gpu.unpack(bits, dst, segs, scale, False, n)
    shifts = torch.arange(8, device=dev, dtype=torch.uint8)
    want = torch.where((bits.unsqueeze(1) >> shifts & 1).bool().flatten(), scale, -scale)
    assert torch.equal(dst, want), f"plain unpack at 2^{log2n} differs from the bits unpacked by torch"
    del want
    copy_bw = 8.0 * n / statistics.median(times["copy (torch)"])
    print(f"\n{torch.cuda.get_device_name()}, n = 2^{log2n} float32, median of {reps} interleaved reps")
    print(f"{'kernel':<34}{'ms':>9}{'GB/s':>10}{'/ copy':>9}")
    for k, (_, per) in runs.items():
        t = statistics.median(times[k])
        bw = per * n / t
        print(f"{k:<34}{t * 1e3:>9.3f}{bw / 1e9:>10.1f}{bw / copy_bw:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cpu, gpu = _ops()
    check_correctness(cpu, gpu)
    check_allreduce_plumbing()
    throughput(gpu, args.log2n, args.reps)


if __name__ == "__main__":
    main()
