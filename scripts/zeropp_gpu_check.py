"""GPU check of the ZeRO++ quantization kernels (csrc/cuda/quantize.cu): correctness against the CPU
core (csrc/cpu/quantize.c, scalar build: the reference) first, then throughput at 2^28 elements
against torch's device-to-device copy, interleaved reps on one GPU.

Correctness (fp32/bf16/fp16 inputs, int8 and int4): codes, scales, dequantized values (fp32 and the
input dtype) and the segment sums (qgZ's reduction) bit-equal to the CPU core's (a NaN equals any NaN:
the device writes the canonical NaN). Layouts cover every quantize kernel: odd sizes, odd or
non-multiple-of-8 blocks and a misaligned input take the scalar kernel; aligned multiples of 8 take
the warp kernel with 1, 2, 4, 8 or 16 vectors a lane (blocks of 8 .. 4096 elements, several blocks a
warp below 32 vectors, short last blocks of a segment) and blocks beyond the register budget the
two-pass warp loop kernel. Data: randn with an all-zero block; "ties" (scale exactly 1, every value a
half-integer: round-half-even decided by the exact division); "specials" (inf and NaN blocks, blocks
whose scale is subnormal or 0). Which quantize kernel ran is read from the profiler and checked
against the launcher's rule (mirrored in _expected_variant).

Throughput: bytes each kernel must move per element, divided by its median time, against the copy's
(read + write of the input dtype). quantize int8 from bf16: read 2 B, write 1 B (+ 4 B per block of
scales); dequantize int8 to bf16: read 1 B, write 2 B; int4 halves the code bytes. The bar
(issue 19): at least 85% of the copy's bandwidth.

    python scripts/zeropp_gpu_check.py [--log2n 28] [--reps 20] [--block 2048]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_VEC_PER_LANE = 16  # kMaxVecPerLane in quantize.cu: 16-byte vectors a lane holds


def _ops():
    from deepspeed_c.ops.op_builder import QuantizerBuilder, QuantizerCUDABuilder

    return QuantizerBuilder(simd="scalar").load(), QuantizerCUDABuilder().load(verbose=True)


def _sizes(seg: int, bits: int, block: int, segments: int) -> tuple[int, int]:
    seg_bytes = (seg + 1) // 2 if bits == 4 else seg
    return segments * seg_bytes, segments * (-(-seg // block))


def _expected_variant(dtype: torch.dtype, seg: int, block: int, x_ptr: int) -> str:
    """The quantize kernel dsc_quantize_cuda picks (q from torch.empty is aligned)."""
    if seg % 8 or block % 8 or x_ptr % 16:
        return "scalar"
    nvec = block // (16 // torch.empty((), dtype=dtype).element_size())
    if nvec > 32 * MAX_VEC_PER_LANE:
        return "warp_loop"
    vpl = 1
    while 32 * vpl < nvec:
        vpl *= 2
    return f"warp V={vpl}"


_KERNEL = re.compile(r"(?<![A-Za-z_])(quantize_warp_loop_kernel|quantize_warp_kernel|quantize_kernel)\s*<([^>]*)>")
_MANGLED = re.compile(r"\d+(quantize_warp_loop_kernel|quantize_warp_kernel|quantize_kernel)I(\w*?)EE")


def _variant_of(names: list[str]) -> str:
    """The quantize kernel among the profiled kernel names: 'scalar', 'warp V=<n>', 'warp_loop' or '?'."""
    for name in names:
        m = _KERNEL.search(name)
        if m:
            args = re.findall(r"\d+", m.group(2).replace("bfloat16", ""))
        else:  # a mangled name: ...20quantize_warp_kernelI13__nv_bfloat16Li8EEEv...
            m = _MANGLED.search(name)
            if not m:
                continue
            args = re.findall(r"Li(\d+)E", m.group(2) + "E")
        if m.group(1) == "quantize_kernel":
            return "scalar"
        if m.group(1) == "quantize_warp_loop_kernel":
            return "warp_loop"
        return f"warp V={args[-1]}" if args else "warp V=?"
    return "?"


def _profiled_variant(fn) -> str:
    """Runs fn once under the profiler and names the quantize kernel it launched ('?' if none seen)."""
    if _PROFILER_BROKEN:
        return "?"
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return _variant_of([e.name for e in prof.events()])
    except Exception as exc:  # a profiler that cannot start must not hide the correctness result
        print(f"(profiler unavailable, kernels not named: {exc})")
        _PROFILER_BROKEN.append(True)
        return "?"


_PROFILER_BROKEN: list[bool] = []


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that a NaN matches any NaN (payloads differ between host and device)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    same = a.view(ints) == b.view(ints)
    return bool((same | (torch.isnan(a) & torch.isnan(b))).all())


def _data(kind: str, n: int, block: int, bits: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    qmax = 7 if bits == 4 else 127
    if kind == "randn":
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        if n >= 2 * block:
            x[:block] = 0  # an all-zero block
        return x
    if kind == "ties":  # every block's largest magnitude is qmax: scale 1, codes of exact half-integers
        x = torch.randint(-2 * qmax, 2 * qmax + 1, (n,), generator=g).float() / 2
        x[::block] = qmax
        return x.to(dtype)
    x = torch.randn(n, generator=g)  # specials
    nb = -(-n // block)
    for k in range(1, nb, 3):
        x[k * block] = float("inf")
    for k in range(2, nb, 5):
        x[k * block + (block - 1 if k * block + block - 1 < n else 0)] = float("nan")
    tiny = 1e-38 if dtype == torch.float32 else 1e-6  # subnormal scales (fp32) / small ones (16-bit)
    for k in range(0, nb, 4):
        x[k * block:(k + 1) * block] *= tiny
    if nb > 3:
        x[3 * block:4 * block] = 0
    return x.to(dtype)


# (segments, seg, block, misalign): misalign 1 offsets the input by one element (scalar kernel)
CASES = [
    # scalar kernel: odd sizes, odd or non-multiple-of-8 blocks, a misaligned input
    (1, 1, 8, 0), (1, 7, 4, 0), (3, 1001, 200, 0), (4, 2049, 2048, 0), (5, 333, 64, 0), (2, 4096, 63, 0),
    (2, 4160, 65, 0), (1, 20_000, 8191, 0), (2, 6000, 2050, 0), (1, 1_000_003, 2048, 0), (2, 8192, 2048, 1),
    # warp kernel, several blocks a warp (blocks of 8 .. 128 16-bit elements)
    (3, 24, 8, 0), (1, 4096, 16, 0), (5, 4104, 40, 0), (8, 4096, 64, 0), (8, 4096, 128, 0),
    # warp kernel, a warp a block: 1, 2, 4, 8, 16 vectors a lane, short last blocks
    (3, 1000, 200, 0), (2, 8192, 256, 0), (1, 5000, 512, 0), (3, 4104, 1024, 0), (4, 8192, 2048, 0),
    (2, 1 << 20, 2048, 0), (3, 8200, 2048, 0), (2, 12_296, 4096, 0),
    # beyond the register budget: the two-pass warp loop kernel (fp32 from 4096, 16-bit from 8192)
    (1, 65536, 8192, 0), (2, 20_000, 8192, 0), (2, 40_000, 16_384, 0), (1, 20_000, 4096, 0),
]
KINDS = ("randn", "ties", "specials")


def check_correctness(cpu, gpu, device: str = "cuda") -> None:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    failures, runs = 0, 0
    seen: Counter[tuple[str, str]] = Counter()
    for bits in (8, 4):
        for dtype in DTYPES:
            for segments, seg, block, misalign in CASES:
                if bits == 4 and block % 2:
                    continue
                n = segments * seg
                for kind in KINDS:
                    x = _data(kind, n, block, bits, dtype, g)
                    if kind == "specials" and dtype == torch.float32 and -(-n // block) > 5:
                        x[5 * block:6 * block] = torch.sign(x[5 * block:6 * block]) * 1e-44  # scale underflows to 0
                    nq, ns = _sizes(seg, bits, block, segments)
                    outs = {}
                    variant = "?"
                    for name, op, d in (("cpu", cpu, torch.device("cpu")), ("gpu", gpu, dev)):
                        xd = torch.empty(n + misalign, dtype=dtype, device=d)[misalign:]
                        xd.copy_(x)
                        q = torch.empty(nq, dtype=torch.uint8, device=d)
                        s = torch.empty(ns, dtype=torch.float32, device=d)
                        op.quantize(xd, segments, block, bits, q, s)
                        if name == "gpu" and kind == KINDS[0]:
                            variant = _profiled_variant(lambda: op.quantize(xd, segments, block, bits, q, s))
                            want = _expected_variant(dtype, seg, block, xd.data_ptr())
                            seen[(str(dtype).replace("torch.", ""), variant)] += 1
                            if variant != "?" and variant != want:
                                failures += 1
                                print(f"DISPATCH bits={bits} {dtype} segments={segments} seg={seg} block={block} "
                                      f"misalign={misalign}: ran {variant}, the launcher's rule says {want}")
                        back = torch.empty(n, dtype=torch.float32, device=d)
                        op.dequantize(q, s, segments, block, bits, back)
                        back_t = torch.empty(n, dtype=dtype, device=d)
                        op.dequantize(q, s, segments, block, bits, back_t)
                        total = torch.empty(seg, dtype=torch.float32, device=d)
                        op.dequantize_sum(q, s, segments, block, bits, total)
                        outs[name] = [t.cpu() for t in (q, s, back, back_t, total)]
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    runs += 1
                    same = [_bits_equal(a, b) for a, b in zip(outs["cpu"], outs["gpu"])]
                    if not all(same):
                        failures += 1
                        print(f"MISMATCH bits={bits} {dtype} {kind} segments={segments} seg={seg} block={block} "
                              f"misalign={misalign}: codes/scales/back/back_dtype/sum equal = {same}")
    print("quantize kernels run (dtype, kernel: layouts x bits):")
    for (dt, variant), count in sorted(seen.items()):
        print(f"  {dt:<9} {variant:<11} {count}")
    if all(v == "?" for _dt, v in seen):
        print("  (the profiler named no kernel: the dispatch was not checked)")
    else:
        want = {"scalar", "warp_loop"} | {f"warp V={v}" for v in (1, 2, 4, 8, MAX_VEC_PER_LANE)}
        for dtype in DTYPES:
            dt = str(dtype).replace("torch.", "")
            missing = want - {v for d, v in seen if d == dt}
            if missing:
                failures += 1
                print(f"COVERAGE {dt}: no case ran {sorted(missing)}")
    if failures:
        raise SystemExit(f"{failures} correctness case(s) differ from the CPU reference or the dispatch rule")
    print(f"correctness: codes, scales, dequantized values and segment sums bit-equal to the CPU core "
          f"({runs} runs: {len(CASES)} layouts x {len(KINDS)} data kinds x {len(DTYPES)} dtypes x int8/int4)")


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


def throughput(gpu, log2n: int, reps: int, block: int = 2048) -> None:
    dev = torch.device("cuda")
    n = 1 << log2n
    print(f"\nthroughput at n = 2^{log2n} elements, block {block}, median of {reps} interleaved reps "
          f"({torch.cuda.get_device_name()})")
    print(f"{'kernel':<34}{'ms':>9}{'GB/s':>10}{'copy GB/s':>11}{'ratio':>8}  quantize kernel")
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
            variant = _profiled_variant(rows["quantize"][0])
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
                note = f"  {variant}" if name == "quantize" else ""
                print(f"{label:<34}{ms:>9.3f}{bw:>10.1f}{copy_bw:>11.1f}{bw / copy_bw:>8.2f}{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cpu, gpu = _ops()
    check_correctness(cpu, gpu)
    throughput(gpu, args.log2n, args.reps, args.block)


if __name__ == "__main__":
    main()
