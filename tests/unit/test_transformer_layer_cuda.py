"""DeepSpeedTransformerLayer's attention core on a GPU (ops/transformer/sdpa_core.py): the direct cuDNN form equals
torch's public SDPA under autograd (dropout 0, bf16: outputs and every gradient, norm-wise), it is the form taken,
and with dropout on the memory flags still give the same numbers for the same seed. Needs a CUDA GPU with cuDNN
attention (sm80+); skipped elsewhere, with the reason."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from deepspeed_c.ops.transformer import sdpa_core
from deepspeed_c.ops.transformer.transformer_function import WEIGHT_NAMES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, HEADS, INTER, B, S = 256, 4, 1024, 4, 128
FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


def _layer(dropout: float, **flags) -> DeepSpeedTransformerLayer:
    torch.manual_seed(0)
    cfg = DeepSpeedTransformerConfig(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS,
                                     attn_dropout_ratio=dropout, hidden_dropout_ratio=dropout, num_hidden_layers=2,
                                     initializer_range=0.02, **flags)
    return DeepSpeedTransformerLayer(cfg).cuda().to(torch.bfloat16)


def _run(layer, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(B, S, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    keep = torch.arange(S, device="cuda")[None] < torch.tensor([S, S - 5, S // 2, 17], device="cuda")[:, None]
    mask = ((~keep).to(torch.bfloat16) * -1e4)[:, None, None, :]
    torch.manual_seed(seed)
    out = layer(x, mask)
    out.float().pow(2).sum().backward()
    return [out.float(), x.grad.float()] + [getattr(layer, n).grad.float() for n in WEIGHT_NAMES]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_direct_cudnn_core_equals_public_sdpa(monkeypatch):
    if not sdpa_core._ENABLED:
        pytest.skip("this torch has no cuDNN attention ops with the expected arguments")
    direct = _run(_layer(0.0))
    if sdpa_core._REFUSED:
        pytest.skip(f"cuDNN attention refused {sorted(sdpa_core._REFUSED)} here (the layer fell back to SDPA)")
    monkeypatch.setattr(sdpa_core, "_ENABLED", False)
    public = _run(_layer(0.0))
    for name, a, b in zip(["out", "dx", *WEIGHT_NAMES], direct, public):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


def test_direct_core_is_the_one_taken():
    if not sdpa_core._ENABLED:
        pytest.skip("this torch has no cuDNN attention ops with the expected arguments")
    layer = _layer(0.0)
    taken = []
    real = sdpa_core.attention_core

    def spy(*args, **kwargs):
        core = real(*args, **kwargs)
        taken.append(type(core).__name__)
        return core

    from deepspeed_c.ops.transformer import transformer_function
    transformer_function.attention_core, saved = spy, transformer_function.attention_core
    try:
        _run(layer)
    finally:
        transformer_function.attention_core = saved
    assert taken == ["_CudnnCore"]


def test_memory_flags_same_numbers_with_dropout():
    base = _run(_layer(0.1), seed=3)
    flagged = _run(_layer(0.1, **dict.fromkeys(FLAGS, True)), seed=3)
    for name, a, b in zip(["out", "dx", *WEIGHT_NAMES], flagged, base):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))
    other = _run(_layer(0.1), seed=4)  # another seed: other dropout masks, other numbers
    assert _rel(other[0], base[0]) > 1e-3


def test_a_refused_shape_does_not_switch_the_others_off():
    """Odd lengths (13: a mask row cuDNN may not take) fall back to SDPA for that shape only; 128 keeps cuDNN."""
    if not sdpa_core._ENABLED:
        pytest.skip("this torch has no cuDNN attention ops with the expected arguments")
    from deepspeed_c.ops.transformer import transformer_function
    real, taken = transformer_function.attention_core, []

    def spy(*args, **kwargs):
        core = real(*args, **kwargs)
        taken.append((args[0].shape[-2], type(core).__name__))
        return core

    layer = _layer(0.0)
    transformer_function.attention_core = spy
    try:
        for s in (13, 128):
            x = torch.randn(2, s, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            mask = torch.zeros(2, 1, 1, s, device="cuda", dtype=torch.bfloat16)
            mask[1, ..., s // 2:] = -1e4
            out = layer(x, mask)
            out.float().sum().backward()
            assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    finally:
        transformer_function.attention_core = real
    assert taken[-1] == (128, "_CudnnCore"), taken
