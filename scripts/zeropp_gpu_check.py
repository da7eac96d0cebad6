"""GPU check of the ZeRO++ quantization kernels (csrc/cuda/quantize.cu): correctness against the CPU
core (csrc/cpu/quantize.c, scalar build: the reference) first, then throughput at 2^28 elements
against torch's device-to-device copy, interleaved reps on one GPU.

Correctness (fp32/bf16/fp16 inputs, int8 and int4, odd sizes and segment tables that take the scalar
kernels, aligned multiples of 8 that take the vector kernels, all-zero blocks): codes, scales,
dequantized values (fp32 and the input dtype) and the segment sums (qgZ's reduction) bit-equal to the
CPU core's.

Throughput: bytes each kernel must move per element, divided by its median time, against the copy's
(read + write of the input dtype). quantize int8 from bf16: read 2 B, write 1 B (+ 4 B per block of
scales); dequantize int8 to bf16: read 1 B, write 2 B; int4 halves the code bytes. The bar
(issue 19): at least 85% of the copy's bandwidth.

    python scripts/zeropp_gpu_check.py [--log2n 28] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops():
    from deepspeed_c.ops.op_builder import QuantizerBuilder, QuantizerCUDABuilder

    return QuantizerBuilder(simd="scalar").load(), QuantizerCUDABuilder().load(verbose=True)


def _sizes(seg: int, bits: int, block: int, segments: int) -> tuple[int, int]:
    seg_bytes = (seg + 1) // 2 if bits == 4 else seg
    return segments * seg_bytes, segments * (-(-seg // block))


def check_correctness(cpu, gpu, device: str = "cuda") -> None:
    dev = torch.device(device)
    # (segments, seg, block): odd ones take the scalar kernels, multiples of 8 the vector ones
    cases = [(1, 1, 8), (1, 7, 4), (3, 1001, 200), (4, 2049, 2048), (5, 333, 64), (1, 1_000_003, 2048),
             (1, 4096, 2048), (4, 8192, 2048), (2, 1 << 20, 2048), (8, 4096, 128), (1, 65536, 8192), (3, 24, 8)]
    g = torch.Generator().manual_seed(0)
    failures = 0
    for bits in (8, 4):
        for dtype in DTYPES:
            for segments, seg, block in cases:
                if bits == 4 and block % 2:
                    continue
                x = (torch.randn(segments * seg, generator=g) * 3).to(dtype)
                if seg >= 2 * block:
                    x[:block] = 0  # an all-zero block
                nq, ns = _sizes(seg, bits, block, segments)
                outs = {}
                for name, op, d in (("cpu", cpu, torch.device("cpu")), ("gpu", gpu, dev)):
                    xd = x.to(d)
                    q = torch.empty(nq, dtype=torch.uint8, device=d)
                    s = torch.empty(ns, dtype=torch.float32, device=d)
                    op.quantize(xd, segments, block, bits, q, s)
                    back = torch.empty(segments * seg, dtype=torch.float32, device=d)
                    op.dequantize(q, s, segments, block, bits, back)
                    back_t = torch.empty(segments * seg, dtype=dtype, device=d)
                    op.dequantize(q, s, segments, block, bits, back_t)
                    total = torch.empty(seg, dtype=torch.float32, device=d)
                    op.dequantize_sum(q, s, segments, block, bits, total)
                    outs[name] = [t.cpu() for t in (q, s, back, back_t, total)]
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                same = [torch.equal(a, b) for a, b in zip(outs["cpu"], outs["gpu"])]
                if not all(same):
                    failures += 1
                    print(f"MISMATCH bits={bits} {dtype} segments={segments} seg={seg} block={block}: "
                          f"codes/scales/back/back_dtype/sum equal = {same}")
    if failures:
        raise SystemExit(f"{failures} correctness case(s) differ from the CPU reference")
    print("correctness: codes, scales, dequantized values and segment sums bit-equal to the CPU core "
          f"({len(cases)} layouts x {len(DTYPES)} dtypes x int8/int4)")


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def throughput(gpu, log2n: int, reps: int) -> None:
    dev = torch.device("cuda")
    n = 1 << log2n
    block = 2048
    print(f"\nthroughput at n = 2^{log2n} elements, block {block}, median of {reps} interleaved reps "
          f"({torch.cuda.get_device_name()})")
    print(f"{'kernel':<34}{'ms':>9}{'GB/s':>10}{'copy GB/s':>11}{'ratio':>8}")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, device=dev).to(dtype)
        y = torch.empty_like(x)
        es = x.element_size()
        for bits in (8, 4):
            nq, ns = _sizes(n, bits, block, 1)
            q = torch.empty(nq, dtype=torch.uint8, device=dev)
            s = torch.empty(ns, dtype=torch.float32, device=dev)
            code_bytes = nq / n
            rows = {
                "quantize": (lambda: gpu.quantize(x, 1, block, bits, q, s), es + code_bytes + 4 / block),
                "dequantize": (lambda: gpu.dequantize(q, s, 1, block, bits, y), code_bytes + es + 4 / block),
            }
            for _ in range(3):  # warm-up
                for fn, _b in rows.values():
                    fn()
                y.copy_(x)
            torch.cuda.synchronize()
            timed = {name: [] for name in rows}
            copy_times = []
            for _ in range(reps):  # interleaved: copy, then each kernel, rep after rep
                copy_times.append(_median_ms(lambda: y.copy_(x), 1))
                for name, (fn, _b) in rows.items():
                    timed[name].append(_median_ms(fn, 1))
            copy_ms = statistics.median(copy_times)
            copy_bw = 2 * es * n / copy_ms / 1e6
            for name, (fn, per_elem) in rows.items():
                ms = statistics.median(timed[name])
                bw = per_elem * n / ms / 1e6
                label = f"{name} int{bits} {str(dtype).replace('torch.', '')}"
                print(f"{label:<34}{ms:>9.3f}{bw:>10.1f}{copy_bw:>11.1f}{bw / copy_bw:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cpu, gpu = _ops()
    check_correctness(cpu, gpu)
    throughput(gpu, args.log2n, args.reps)


if __name__ == "__main__":
    main()
