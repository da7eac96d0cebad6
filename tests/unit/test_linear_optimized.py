"""deepspeed_c.linear (DeepSpeed's deepspeed.linear): OptimizedLinear's plain, LoRA and quantized layers
against float64 math done by hand, the FP quantizer's codes against torch's float8 casts and its error
bound, bad configs naming the argument, and base-weight sharding on 2 gloo ranks (the shards gather to the
whole weight, deepspeed_c.initialize keeps each rank's shard, and training the adapters matches a
single-process float64 reference)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepspeed_c.linear import (Init, LoRAConfig, LoRAOptimizedLinear, OptimizedLinear, QuantizationConfig,
                                QuantizedLinear, QuantizedParameter, init_lora)
from deepspeed_c.ops.fp_quantizer import FP_Quantize
from tests.harness import run_distributed


def test_plain_path_is_the_linear_class():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4, bias=True, dtype=torch.float64)
    torch.manual_seed(0)
    lin = OptimizedLinear(6, 4, bias=True, dtype=torch.float64)
    assert type(lin) is torch.nn.Linear
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(lin(x), ref(x), rtol=0, atol=0)
    assert OptimizedLinear(6, 4).weight.dtype == torch.bfloat16 and OptimizedLinear(6, 4).bias is None

    class MyLinear(torch.nn.Linear):
        pass

    assert type(OptimizedLinear(6, 4, linear_cls=MyLinear)) is MyLinear


def _lora_ref(x, w, a, b, scale):
    x, w, a, b = (t.detach().double() for t in (x, w, a, b))
    return x @ w.T + scale * (x @ a.T @ b.T)


def test_lora_forward_and_adapter_gradients_match_float64():
    torch.manual_seed(0)
    cfg = LoRAConfig(lora_r=3, lora_alpha=6.0)
    lin = OptimizedLinear(10, 7, lora_config=cfg, dtype=torch.float64, device="cpu")
    assert isinstance(lin, LoRAOptimizedLinear) and lin.lora_scaling_factor == 2.0
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == ["lora_weight_1.weight", "lora_weight_2.weight"]
    assert list(lin.state_dict()) == ["weight", "lora_weight_1.weight", "lora_weight_2.weight"]
    assert lin.weight.shape == (7, 10) and lin.lora_weight_1.weight.shape == (3, 10)
    assert lin.lora_weight_2.weight.shape == (7, 3) and not lin.lora_weight_2.weight.any()  # B starts at zero
    x = torch.randn(2, 4, 10, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-12, atol=1e-12)

    with torch.no_grad():
        lin.lora_weight_2.weight.normal_()
    a, b = lin.lora_weight_1.weight, lin.lora_weight_2.weight
    y = lin(x)
    torch.testing.assert_close(y, _lora_ref(x, lin.weight, a, b, 2.0), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    xf, gf = x.reshape(-1, 10), g.reshape(-1, 7)
    torch.testing.assert_close(b.grad, 2.0 * gf.T @ (xf @ a.detach().T), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, 2.0 * (gf @ b.detach()).T @ xf, rtol=1e-12, atol=1e-12)
    assert lin.weight.grad is None


def _bound(w: torch.Tensor, group: int, man: int, exp: int) -> torch.Tensor:
    """Round-to-nearest error bound of the group-scaled ExMy code, plus bfloat16's own rounding."""
    bias = (1 << (exp - 1)) - 1
    top = (2 - 2.0 ** -man) * 2.0 ** ((1 << exp) - 1 - bias)
    flat = w.double().reshape(-1, group)
    scale = flat.abs().amax(1, keepdim=True) / top
    sub_step = 2.0 ** (1 - bias - man) * scale  # spacing of the subnormal codes
    return (flat.abs() * 2.0 ** -(man + 1) + sub_step / 2 + flat.abs() * 2.0 ** -8).reshape(w.shape)


@pytest.mark.parametrize("q_bits,mantissa,exp", [(8, 3, 4), (8, 2, 5), (6, 2, 3), (12, 4, 7), (4, 1, 2)])
def test_quantized_weight_dequantizes_within_the_code_bound(q_bits, mantissa, exp):
    torch.manual_seed(1)
    w = (torch.randn(12, 32) * torch.logspace(-3, 1, 32)).to(torch.bfloat16)  # a wide range in every group
    cfg = QuantizationConfig(q_bits=q_bits, mantissa_bits=mantissa if q_bits == 8 else 3, group_size=64)
    qp = QuantizedParameter(w.clone(), quantization_config=cfg)
    assert qp.dtype == torch.uint8 and qp.shape == (6, 64 * q_bits // 8 + 4) and not qp.requires_grad
    scales = qp.data[:, -4:].contiguous().view(torch.float32).reshape(-1).double()
    top = (2 - 2.0 ** -mantissa) * 2.0 ** ((1 << exp) - 1 - ((1 << (exp - 1)) - 1))
    torch.testing.assert_close(scales, w.double().reshape(6, 64).abs().amax(1) / top, rtol=1e-6, atol=0)
    d = qp.dequantized()
    assert d.dtype == torch.bfloat16 and d.shape == w.shape
    assert ((d.double() - w.double()).abs() <= _bound(w, 64, mantissa, exp)).all()
    # the largest magnitude of each group is a code exactly
    for row_w, row_d in zip(w.double().reshape(6, 64), d.double().reshape(6, 64)):
        i = row_w.abs().argmax()
        assert abs(row_d[i] - row_w[i]) <= abs(row_w[i]) * 2.0 ** -8


@pytest.mark.parametrize("mantissa,fp8", [(3, torch.float8_e4m3fn), (2, torch.float8_e5m2)])
def test_fp8_codes_equal_torch_float8_casts(mantissa, fp8):
    torch.manual_seed(2)
    w = torch.randn(4, 128, dtype=torch.bfloat16)
    q = FP_Quantize(QuantizationConfig(q_bits=8, mantissa_bits=mantissa, group_size=128))
    packed = q.quantize(w, q_bits=8, q_mantisa_bits=mantissa)
    scale = packed[:, -4:].contiguous().view(torch.float32)
    y = w.float() / scale
    ref = y.to(fp8).float() * scale
    got = q.dequantize(packed, q_bits=8, q_mantisa_bits=mantissa).float()
    inside = y.abs() < torch.finfo(fp8).max  # torch's formats stop below ours (they keep NaN / inf codes)
    torch.testing.assert_close(got[inside], ref[inside].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert inside.float().mean() > 0.75


def test_quantized_layers_forward_with_the_dequantized_weight():
    torch.manual_seed(3)
    qcfg = QuantizationConfig(q_bits=6, group_size=32)
    ql = OptimizedLinear(16, 8, bias=True, quantization_config=qcfg)
    assert isinstance(ql, QuantizedLinear) and isinstance(ql.weight, QuantizedParameter)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(ql(x), F.linear(x, ql.weight.dequantized(), ql.bias), rtol=0, atol=0)

    lora = OptimizedLinear(16, 8, lora_config=LoRAConfig(lora_r=2, lora_alpha=4), quantization_config=qcfg)
    assert isinstance(lora.weight, QuantizedParameter) and lora.weight.dtype == torch.uint8
    with torch.no_grad():
        lora.lora_weight_2.weight.normal_()
    want = _lora_ref(x, lora.weight.dequantized(), lora.lora_weight_1.weight, lora.lora_weight_2.weight, 2.0)
    torch.testing.assert_close(lora(x).double(), want, rtol=2e-2, atol=2e-2)  # bfloat16 matmuls
    # a float state dict is quantized on load (a module named in target_mods keeps LoRA)
    full = torch.randn(8, 16, dtype=torch.bfloat16)
    holder = torch.nn.ModuleDict({"q_proj": lora})
    holder.load_state_dict({**holder.state_dict(), "q_proj.weight": full})
    assert not lora.disabled
    expect = FP_Quantize(qcfg).quantize(full, q_bits=6)
    assert torch.equal(lora.weight.data, expect)
    clone = QuantizedParameter(lora.weight.data, **lora.weight.__dict__)  # the Hugging Face clone
    assert torch.equal(clone.dequantized(), lora.weight.dequantized()) and clone.ds_optim_param


def test_bad_configs_name_the_argument():
    for kwargs, exc, name in [({"lora_r": 0}, ValueError, "lora_r"), ({"lora_r": 2.5}, ValueError, "lora_r"),
                              ({"target_mods": "q_proj"}, TypeError, "target_mods"),
                              ({"offload_ratio": 1.5}, ValueError, "offload_ratio"),
                              ({"base_weight_sharding": 0}, ValueError, "base_weight_sharding"),
                              ({"lora_alpha": "16"}, TypeError, "lora_alpha")]:
        with pytest.raises(exc, match=name):
            LoRAConfig(**kwargs)
    for kwargs, name in [({"q_bits": 5}, "q_bits"), ({"q_bits": 8, "mantissa_bits": 7}, "mantissa_bits"),
                         ({"q_bits": 6, "group_size": 6}, "group_size"), ({"group_size": 0}, "group_size"),
                         ({"q_dtype": torch.float8_e4m3fn}, "q_dtype")]:
        with pytest.raises(ValueError, match=name):
            QuantizationConfig(**kwargs)
    with pytest.raises(ValueError, match="lora_config"):
        OptimizedLinear(4, 4, lora_config={"lora_r": 2})
    with pytest.raises(ValueError, match="bias"):
        OptimizedLinear(4, 4, bias=True, lora_config=LoRAConfig(lora_r=2))
    with pytest.raises(ValueError, match="dtype"):
        OptimizedLinear(4, 4, lora_config=LoRAConfig(lora_r=2), quantization_config=QuantizationConfig(),
                        dtype=torch.float32)
    with pytest.raises(ValueError, match="input_dim"):
        OptimizedLinear(0, 4, lora_config=LoRAConfig(lora_r=2))
    with pytest.raises(RuntimeError, match="base_weight_sharding=2"):
        OptimizedLinear(4, 4, lora_config=LoRAConfig(lora_r=2, base_weight_sharding=2))
    with pytest.raises(ValueError, match="requires_grad"):
        QuantizedParameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=True)
    with pytest.raises(TypeError, match="bfloat16"):
        QuantizedParameter(torch.zeros(4, dtype=torch.float16))
    cfg = LoRAConfig(lora_r=2)
    cfg.lora_r = -1  # set after construction: checked again when used
    with pytest.raises(ValueError, match="lora_r"):
        OptimizedLinear(4, 4, lora_config=cfg)


def test_init_context_delays_lora_and_target_mods_choose_on_load():
    cfg = LoRAConfig(lora_r=2, lora_alpha=2, target_mods=["q_proj"])
    with Init(lora_config=cfg):
        model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(6, 6, dtype=torch.float64),
                                     "other": torch.nn.Linear(6, 6, dtype=torch.float64)})
    assert torch.nn.Linear is torch.nn.modules.linear.Linear and cfg.delay_lora_init
    assert all(isinstance(m, LoRAOptimizedLinear) for m in model.values())
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="init_lora"):
        model["q_proj"](x)
    w = {k: torch.randn(6, 6, dtype=torch.float64) for k in model}
    model.load_state_dict({f"{k}.weight": v for k, v in w.items()})
    init_lora(model)
    assert model["other"].disabled and not hasattr(model["other"], "lora_weight_1")
    assert [n for n, p in model.named_parameters() if p.requires_grad] == \
        ["q_proj.lora_weight_1.weight", "q_proj.lora_weight_2.weight"]
    torch.testing.assert_close(model["other"](x), x @ w["other"].T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model["q_proj"](x), x @ w["q_proj"].T, rtol=1e-12, atol=1e-12)


def test_offload_ratio_parks_base_weights_in_module_order():
    from deepspeed_c.linear.placement import place_base_weights

    torch.manual_seed(4)
    cfg = LoRAConfig(lora_r=2, offload_ratio=0.4)
    layers = torch.nn.Sequential(*(OptimizedLinear(6, 6, lora_config=cfg, dtype=torch.float64, device="cpu")
                                   for _ in range(3)))
    assert place_base_weights(layers) == (True, False)
    assert [m.weight.ds_offload for m in layers] == [True, True, False]  # 2 of 3 to reach 40%
    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(layers[0](x), x @ layers[0].weight.T, rtol=1e-12, atol=1e-12)
    assert place_base_weights(torch.nn.Linear(2, 2)) == (False, False)
    other = OptimizedLinear(6, 6, lora_config=LoRAConfig(lora_r=2, offload_ratio=0.5), dtype=torch.float64)
    with pytest.raises(ValueError, match="offload_ratio"):
        place_base_weights(torch.nn.Sequential(layers[0], other))


# -- base-weight sharding on 2 gloo ranks --------------------------------------------------------------------
IN, OUT, R, STEPS, LR = 8, 6, 2, 2, 0.1


def _full_weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(5))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, IN, generator=g), torch.randn(3, OUT, generator=g)


def _adapters() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(R, IN, generator=g), torch.randn(OUT, R, generator=g)


def _sharded_body(rank: int, world: int) -> dict:
    import deepspeed_c

    lin = OptimizedLinear(IN, OUT, lora_config=LoRAConfig(lora_r=R, lora_alpha=4, base_weight_sharding=world),
                          dtype=torch.float32, device="cpu")
    holder = torch.nn.ModuleDict({"q_proj": lin})  # target_mods name the modules that keep LoRA on load
    holder.load_state_dict({**holder.state_dict(), "q_proj.weight": _full_weight()})
    with torch.no_grad():
        a0, b0 = _adapters()
        lin.lora_weight_1.weight.copy_(a0)
        lin.lora_weight_2.weight.copy_(b0)
    shard = lin.weight.detach().clone()
    gathered = lin.full_weight()
    qlin = OptimizedLinear(IN, OUT, lora_config=LoRAConfig(lora_r=R, base_weight_sharding=world),
                           quantization_config=QuantizationConfig(group_size=8))
    qholder = torch.nn.ModuleDict({"v_proj": qlin})
    qholder.load_state_dict({**qholder.state_dict(), "v_proj.weight": _full_weight().to(torch.bfloat16)})
    cfg = {"train_micro_batch_size_per_gpu": 3, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, *_ = deepspeed_c.initialize(model=lin, config=cfg, model_parameters=[p for p in lin.parameters()
                                                                                 if p.requires_grad])
    kept = torch.equal(engine.module.weight.detach(), shard)
    assert engine.optimized_linear_lora_enabled and engine.optimized_linear_base_weight_sharding
    for s in range(STEPS):
        x, y = _batch(s, rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    out = {"shard": shard, "gathered": gathered, "qfull": qlin.full_weight().float(),
           "a": lin.lora_weight_1.weight.detach(), "b": lin.lora_weight_2.weight.detach()}
    return {"kept": kept, **{k: v.numpy().copy() for k, v in out.items()}}  # numpy: tensors need a live sender


def test_base_weight_sharding_on_two_ranks():
    world = 2
    got = [{k: v if k == "kept" else torch.from_numpy(v) for k, v in res.items()}
           for res in run_distributed(_sharded_body, world, timeout=120)]
    full = _full_weight()
    n = OUT * IN // world
    for r, res in enumerate(got):
        torch.testing.assert_close(res["shard"], full.reshape(-1)[r * n:(r + 1) * n], rtol=0, atol=0)
        torch.testing.assert_close(res["gathered"], full, rtol=0, atol=0)
        assert res["kept"], f"rank {r}: initialize overwrote this rank's base-weight shard"
        # each rank quantized its own slice; the gather is those slices dequantized
        parts = [FP_Quantize(QuantizationConfig(group_size=8)) for _ in range(world)]
        want = torch.cat([q.dequantize(q.quantize(full.to(torch.bfloat16).reshape(-1)[i * n:(i + 1) * n]))
                          for i, q in enumerate(parts)]).reshape(OUT, IN).float()
        torch.testing.assert_close(res["qfull"], want, rtol=0, atol=0)
    # float64 reference: the whole weight in one process, SGD on the rank-averaged loss
    a, b = (t.double().requires_grad_(True) for t in _adapters())
    for s in range(STEPS):
        losses = [F.mse_loss(x.double() @ full.double().T + 2.0 * (x.double() @ a.T @ b.T), y.double())
                  for x, y in (_batch(s, r) for r in range(world))]
        ga, gb = torch.autograd.grad(sum(losses) / world, (a, b))
        with torch.no_grad():
            a -= LR * ga
            b -= LR * gb
    for res in got:
        torch.testing.assert_close(res["a"].double(), a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["b"].double(), b.detach(), rtol=1e-5, atol=1e-6)
