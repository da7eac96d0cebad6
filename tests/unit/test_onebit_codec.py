"""The 1-bit compression core (csrc/cpu/onebit.c) against plain torch, for every SIMD build this CPU
runs: sign pack/unpack round-trips exactly over odd sizes and segment tables (+0, -0 and NaN are
+1), the fused error feedback equals compensated - scale * sign bit for bit, sums of squares match
float64; every build compiles warning-free. Then bad input: the core's argument checks, and the
1-bit optimizers' config errors (ZeRO, offload, comm_backend_name, unknown params, static fp16
loss scale for 1-bit LAMB), which name the offending key."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.op_builder import toolchain
from deepspeed_c.ops.op_builder.builder import SIMD_LEVELS
from deepspeed_c.ops.op_builder.onebit import OnebitBuilder

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks

RUNNABLE = [s for s in SIMD_LEVELS if not toolchain.missing_isa(s)]
SIZES = [1, 7, 8, 9, 15, 17, 31, 33, 255, 4097, 12345]


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x < 0, -1.0, 1.0)  # NaN < 0 is False: +1


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    specials = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30, float("inf"), float("-inf")])
    k = min(n, len(specials))
    x[torch.randperm(n, generator=g)[:k]] = specials[:k]
    return x


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_every_build_compiles_without_warnings(simd, tmp_path):
    b = OnebitBuilder(simd=simd)
    log = b.build_dir() / "build.log"
    if simd in RUNNABLE:
        b.load()  # the cached build the other tests use (its log), else a build here
    if not log.exists():
        b.build_into(tmp_path)
        log = tmp_path / "build.log"
    assert "warning:" not in log.read_text()


@pytest.mark.parametrize("simd", RUNNABLE)
def test_pack_unpack_error_feedback_against_torch(simd):
    op = OnebitBuilder(simd=simd).load()
    for n in SIZES:
        y0 = _values(n, n)
        err0 = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
        segs = torch.tensor([[0, n, 0]], dtype=torch.int64)
        y, sumsq = y0.clone(), torch.zeros(1, dtype=torch.float64)
        op.compensate(y, err0, segs, sumsq, n)
        want = y0 + err0
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y[~y.isnan()], want[~want.isnan()]), n
        finite = want.isfinite()
        if bool(finite.all()):
            assert torch.allclose(sumsq, want.double().pow(2).sum(), rtol=1e-12), n
        bits = torch.full(((n + 7) // 8,), 0xAB, dtype=torch.uint8)
        err = torch.empty(n)
        op.pack(y, err, bits, segs, torch.tensor([0.5]), n)
        s = _signs(y)
        assert torch.equal(err[finite], (y - 0.5 * s)[finite]), n
        if n % 8:
            assert int(bits[-1]) >> (n % 8) == 0, "bits past the end must be 0"
        out = torch.full((n,), 3.0)
        op.unpack(bits, out, segs, torch.tensor([2.0]), True, n)
        assert torch.equal(out, 3.0 + 2.0 * s), n
        op.unpack(bits, out, segs, torch.tensor([1.0]), False, n)
        assert torch.equal(out, s), n


@pytest.mark.parametrize("simd", RUNNABLE)
def test_segment_tables(simd):
    """Segments at byte offsets with their own scales, as the chunk-major all-reduce uses them."""
    op = OnebitBuilder(simd=simd).load()
    lens, offs = [5, 16, 1, 9], [0, 8, 24, 32]
    total = 48
    y = _values(total, 3)
    y[torch.isnan(y)] = 0.0
    y[torch.isinf(y)] = 1.0
    segs = torch.tensor([[o, n, k] for k, (o, n) in enumerate(zip(offs, lens))], dtype=torch.int64)
    sumsq = torch.zeros(4, dtype=torch.float64)
    op.compensate(y, None, segs, sumsq, max(lens))
    for k, (o, n) in enumerate(zip(offs, lens)):
        assert torch.allclose(sumsq[k], y[o:o + n].double().pow(2).sum(), rtol=1e-12)
    scales = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bits = torch.zeros(total // 8, dtype=torch.uint8)
    err = torch.zeros(total)
    op.pack(y, err, bits, segs, scales, max(lens))
    out = torch.zeros(total)
    op.unpack(bits, out, segs, scales, False, max(lens))
    for k, (o, n) in enumerate(zip(offs, lens)):
        assert torch.equal(out[o:o + n], scales[k] * _signs(y[o:o + n]))
        assert torch.equal(err[o:o + n], y[o:o + n] - out[o:o + n])
    gaps = torch.ones(total, dtype=torch.bool)
    for o, n in zip(offs, lens):
        gaps[o:o + n] = False
    assert not bool(out[gaps].any()) and not bool(err[gaps].any()), "elements outside the segments are untouched"


def test_builds_agree_bit_for_bit():
    if len(RUNNABLE) < 2:
        pytest.skip("only the scalar build runs on this CPU")
    y = _values(10007, 9)
    outs = []
    for simd in RUNNABLE:
        op = OnebitBuilder(simd=simd).load()
        bits = torch.empty(1251, dtype=torch.uint8)
        err = torch.empty(10007)
        op.pack(y, err, bits, torch.tensor([[0, 10007, 0]]), torch.tensor([0.25]), 10007)
        outs.append((bits, err))
    for bits, err in outs[1:]:
        assert torch.equal(bits, outs[0][0])
        assert torch.equal(err.isnan(), outs[0][1].isnan()) and torch.equal(err[~err.isnan()], outs[0][1][~err.isnan()])


def test_codec_bad_input():
    from deepspeed_c.runtime.comm import sign_codec

    op = OnebitBuilder().load()
    y, bits = torch.zeros(16), torch.zeros(2, dtype=torch.uint8)
    one = torch.ones(1)
    with pytest.raises(TypeError, match="'y'"):
        op.pack(y.double(), None, bits, torch.tensor([[0, 16, 0]]), one, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        op.pack(y, None, bits, torch.tensor([[4, 8, 0]]), one, 16)
    with pytest.raises(ValueError, match="past the end of 'y'"):
        op.pack(y, None, bits, torch.tensor([[8, 16, 0]]), one, 16)
    with pytest.raises(ValueError, match="past the end of 'bits_out'"):
        op.pack(torch.zeros(32), None, bits, torch.tensor([[0, 32, 0]]), one, 32)
    with pytest.raises(ValueError, match="scale index"):
        op.unpack(bits, y, torch.tensor([[0, 16, 1]]), one, False, 16)
    with pytest.raises(ValueError, match="'segs'"):
        op.unpack(bits, y, torch.tensor([0, 16, 0]), one, False, 16)
    with pytest.raises(ValueError, match="'err'"):
        op.pack(y, torch.zeros(15), bits, torch.tensor([[0, 16, 0]]), one, 16)
    with pytest.raises(ValueError, match="needs 3 bytes"):
        sign_codec.unpack_signs(bits, 17)
    with pytest.raises(TypeError, match="uint8"):
        sign_codec.unpack_signs(bits.float(), 8)
    x = _values(37, 4)
    assert torch.equal(sign_codec.unpack_signs(sign_codec.pack_signs(x), 37), _signs(x))


def _cfg(opt_type: str = "OneBitAdam", **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": opt_type, "params": {"lr": 1e-3}}}
    for k, v in extra.items():
        if k == "params":
            cfg["optimizer"]["params"].update(v)
        else:
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("cfg, exc, words", [
    (_cfg(zero_optimization={"stage": 1}), AssertionError, ["1bit-Adam is not compatible with ZeRO",
                                                             "zero_optimization.stage"]),
    (_cfg("ZeroOneAdam", zero_optimization={"stage": 2}), ValueError, ["0/1 Adam is not compatible with ZeRO"]),
    (_cfg("OneBitLamb", zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}), AssertionError,
     ["1bit-Lamb is not compatible with ZeRO"]),
    (_cfg(params={"comm_backend_name": "ncll"}), ValueError, ["optimizer.params.comm_backend_name", "nccl"]),
    (_cfg(params={"comm_backend_name": "mpi"}), ValueError, ["optimizer.params.comm_backend_name", "mpi4py"]),
    (_cfg(params={"comm_backend_name": "hccl"}), NotImplementedError, ["optimizer.params.comm_backend_name"]),
    (_cfg(params={"freeze_stpe": 3}), ValueError, ["optimizer.params.freeze_stpe", "freeze_step"]),
    (_cfg(params={"amsgrad": True}), RuntimeError, ["AMSGrad"]),
    (_cfg("OneBitLamb", fp16={"enabled": True, "loss_scale": 128}), AssertionError,
     ["requires dynamic loss scaling", "fp16.loss_scale"]),
])
def test_optimizer_config_errors(cfg, exc, words):
    import deepspeed_c
    from tests.distributed.engine_models import make_model

    try:
        import mpi4py  # noqa: F401
        if "mpi4py" in words:
            pytest.skip("mpi4py is installed here")
    except ImportError:
        pass
    with pytest.raises(exc) as info:
        deepspeed_c.initialize(model=make_model("mlp", 0), config=cfg)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
