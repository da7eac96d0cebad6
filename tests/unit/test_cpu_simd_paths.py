"""The CPU optimizer builds per SIMD path: every path compiles warning-free (also paths this
CPU cannot run), the paths this CPU runs produce identical bits for every dtype combination the
kernels accept (they use only correctly rounded operations and no FMA), and the in-register
conversions match torch's: exhaustively for 16-bit -> fp32, on special and random bit
patterns for fp32 -> 16-bit (round to nearest even, overflow to inf, subnormals, NaN)."""
from __future__ import annotations

import itertools

import pytest
import torch

from deepspeed_c.ops.op_builder import (CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder, CPUMultiTensorBuilder,
                                        toolchain)
from deepspeed_c.ops.op_builder.builder import SIMD_LEVELS

RUNNABLE = [s for s in SIMD_LEVELS if not toolchain.missing_isa(s)]
BUILDERS = [CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, CPUMultiTensorBuilder]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.NAME)
def test_every_path_compiles_without_warnings(builder, simd, tmp_path):
    b = builder(simd=simd)
    b.build_into(tmp_path)
    log = (tmp_path / "build.log").read_text()
    assert "warning:" not in log, log
    if simd not in RUNNABLE:  # is_compatible says why
        assert not b.is_compatible() and "lacks" in b.incompatible_reason()


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit equality; NaN lanes only need to be NaN in both (which NaN payload an operation with
    two NaN operands keeps depends on operand order, which the compiler may swap)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    an, bn = a.isnan(), b.isnan()
    assert torch.equal(an, bn), f"{what}: NaN positions differ"
    ints = torch.int32 if a.dtype == F32 else torch.int16
    diff = a[~an].view(ints) != b[~bn].view(ints)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {a.numel()} elements differ in bits"


def special_values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (n,), generator=gen).float())
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-39, 65504.0, 65520.0,
                             6e-8, 3e38])
    k = min(n, len(specials))
    idx = torch.randperm(n, generator=gen)[:k]
    x[idx] = specials[:k]
    return x.to(dtype)


def state_dtypes(pd):
    return (F32, BF16) if pd == F32 else (F32, pd)


def combos():
    """Every (param, grad, state, copy) combination the kernels accept."""
    for pd, gd in itertools.product((F32, BF16, F16), repeat=2):
        for sd in state_dtypes(pd):
            for cd in (None, F32, BF16, F16):
                yield pd, gd, sd, cd


def run_all_paths(builder, call, make_inputs):
    """Run `call(op, *inputs)` on fresh identical inputs for every runnable path."""
    outs = {}
    for simd in RUNNABLE:
        inputs = make_inputs()
        call(builder(simd=simd).load(), *inputs)
        outs[simd] = inputs
    return outs


def compare_paths(outs, what):
    first = RUNNABLE[0]
    for simd in RUNNABLE[1:]:
        for name, a_list, b_list in zip(("params", "grads", "s0", "s1", "copies"), outs[first], outs[simd]):
            for i, (a, b) in enumerate(zip(a_list or [], b_list or [])):
                same_bits(a, b, f"{what}: {first} vs {simd} {name}[{i}]")


needs_two = pytest.mark.skipif(len(RUNNABLE) < 2, reason="this CPU runs only the scalar path: nothing to compare")


@needs_two
@pytest.mark.parametrize("opname", ["adam", "adagrad", "lion"])
def test_paths_agree_bit_for_bit(opname):
    cs = list(combos())
    gen = torch.Generator().manual_seed(11)
    sizes = [int(n) for n in torch.randint(1, 700, (len(cs),), generator=gen)]
    sizes[0], sizes[1] = 4096 * 2 + 17, 1  # crosses chunks, and a lone element
    seeds = [int(s) for s in torch.randint(0, 2**31, (len(cs),), generator=gen)]

    def make():
        ps, gs, s0, s1, cs_ = [], [], [], [], []
        for (pd, gd, sd, cd), n, seed in zip(cs, sizes, seeds):
            g = torch.Generator().manual_seed(seed)
            ps.append(special_values(n, pd, g))
            gs.append(special_values(n, gd, g))
            s0.append(torch.randn(n, generator=g).to(sd))
            s1.append(torch.rand(n, generator=g).to(sd))
            cs_.append(torch.zeros(n, dtype=cd or F32))
        return ps, gs, s0, s1, cs_

    if opname == "adam":
        outs = run_all_paths(CPUAdamBuilder, lambda op, p, g, m, v, c: [
            op.adam_step(p, g, m, v, c, 1e-2, 0.9, 0.999, 1e-8, wd, step, 1, mode)
            for step, (wd, mode) in enumerate([(0.1, 1), (0.1, 0), (0.0, 1)], start=1)], make)
    elif opname == "adagrad":
        outs = run_all_paths(CPUAdagradBuilder, lambda op, p, g, s, _, c: [
            op.adagrad_step(p, g, s, c, 1e-2, 1e-10, wd) for wd in (0.0, 0.1)], make)
    else:
        outs = run_all_paths(CPULionBuilder, lambda op, p, g, m, _, c: [
            op.lion_step(p, g, m, c, 1e-3, 0.9, 0.99, wd) for wd in (0.0, 0.1)], make)
    compare_paths(outs, opname)


@needs_two
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_scale_paths_agree_and_norm_paths_agree_closely(dtype):
    gen = torch.Generator().manual_seed(12)
    base = [special_values(n, dtype, gen) for n in (1, 33, 4097, 9000)]
    finite = [torch.randn(n, generator=gen).to(dtype) for n in (1, 33, 4097, 9000)]
    outs = run_all_paths(CPUMultiTensorBuilder, lambda op, ts: op.scale_(ts, 0.37), lambda: ([t.clone() for t in base],))
    for simd in RUNNABLE[1:]:
        for i, (a, b) in enumerate(zip(outs[RUNNABLE[0]][0], outs[simd][0])):
            same_bits(a, b, f"scale_ {RUNNABLE[0]} vs {simd} [{i}]")
    sums = [CPUMultiTensorBuilder(simd=s).load().sumsq(finite) for s in RUNNABLE]
    want = sum(float((t.double() ** 2).sum()) for t in finite)
    for (total, bad), simd in zip(sums, RUNNABLE):
        assert not bad and abs(total - want) <= 1e-12 * want, simd
    for simd in RUNNABLE:
        assert CPUMultiTensorBuilder(simd=simd).load().sumsq(base)[1], f"{simd} missed an inf/nan"


@pytest.mark.parametrize("simd", RUNNABLE)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_widening_is_exact_for_every_16_bit_pattern(simd, dtype):
    """An Adam step with lr = 0 and zero gradients leaves the parameter as it is, and its fp32
    copy is then the in-register widening of every one of the 65,536 bit patterns."""
    p = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)[:-1].clone()  # odd length
    before = p.clone()
    copy = torch.empty(p.numel(), dtype=F32)
    z = torch.zeros(p.numel(), dtype=F32)
    CPUAdamBuilder(simd=simd).load().adam_step([p], [torch.zeros_like(p)], [z], [z.clone()], [copy], 0.0, 0.9, 0.999,
                                                1e-8, 0.0, 1, 1, 1)
    same_bits(p, before, "parameter after an lr=0 step")
    same_bits(copy, before.float(), f"{dtype} -> float32")


@pytest.mark.parametrize("simd", RUNNABLE)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_narrowing_rounds_like_torch(simd, dtype):
    gen = torch.Generator().manual_seed(13)
    bits = torch.randint(-2**31, 2**31 - 1, (200_003,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**16, (20_000,), generator=gen, dtype=torch.int32) << 16) | 0x8000  # bf16 halfway
    fp16_ties = ((torch.randint(0x3880, 0x4780, (20_000,), generator=gen, dtype=torch.int32) << 16)
                 & ~0x1fff) | 0x1000  # fp16 halfway (normal range)
    p = torch.cat([bits, ties, fp16_ties]).view(F32)
    p = torch.cat([p, special_values(5001, F32, gen), torch.logspace(-45, -4, 3000, base=2.0)])
    copy = torch.empty(p.numel(), dtype=dtype)
    z = torch.zeros(p.numel())
    CPUAdamBuilder(simd=simd).load().adam_step([p], [z], [z.clone()], [z.clone()], [copy], 0.0, 0.9, 0.999, 1e-8,
                                                0.0, 1, 1, 1)
    same_bits(copy, p.to(dtype), f"float32 -> {dtype}")
