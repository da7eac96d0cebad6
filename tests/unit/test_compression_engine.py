"""Compression and MoQ through the engine, one process: the engine steps the compression scheduler and the MoQ
quantizer exactly as DeepSpeed 0.19.6's engine does (checked against a plain torch loop driving the same library
objects by hand: same losses, same weights), the `quantize_training` section schedules every 2-D weight, and bad
`compression_training` input fails at init_compression / initialize naming the key, pattern or width."""
from __future__ import annotations

import copy

import pytest
import torch

import deepspeed_c
from deepspeed_c.compression import init_compression
from deepspeed_c.compression.config import CompressionConfigError, get_compression_config
from deepspeed_c.compression.scheduler import compression_scheduler
from deepspeed_c.runtime.quantize import Quantizer
from tests.fixtures.compression import cases

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def _cfg(compression: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": cases.BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "gradient_clipping": 0.0,
            "compression_training": compression, **extra}


WQ_MOQ = cases._wq(8, 4, ["query", "key", "value", "intermediate"], groups=2, period=2, in_forward=False)
COMPRESSION = {"weight_quantization": cases._wq(8, 8, ["dense"], groups=2),
               "sparse_pruning": cases._prune("l1", 0.5, ["intermediate"], offset=2),
               "activation_quantization": cases._aq(8, "symmetric", "dynamic", offset=3)}


def _by_hand(compression: dict, steps: int) -> tuple[list[float], dict]:
    """DeepSpeed 0.19.6's engine order, written out: at step 0 a step_zero_check (and MoQ on the weights), then
    per step: forward, backward, optimizer step, MoQ requantization, scheduler step."""
    torch.manual_seed(0)
    model = cases.TinyBert(2)
    cfg = _cfg(compression)
    init_compression(model, copy.deepcopy(cfg))
    sched = compression_scheduler(model, get_compression_config(cfg))
    wq = get_compression_config(cfg)["weight_quantization"]["shared_parameters"]
    quantizer = None
    if wq["enabled"] and not wq["quantize_weight_in_forward"]:
        quantizer = Quantizer(wq["quantize_groups"], False, 0.001, wq["quantization_type"], wq["rounding"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = cases._inputs("bert")
    losses = []
    for step in range(steps):
        if step == 0:
            sched.step(step_zero_check=True)
            if quantizer and sched.weight_quantization_enabled:
                quantizer.quantize([list(model.parameters())], False, False, None)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if quantizer and sched.weight_quantization_enabled:
            quantizer.quantize([list(model.parameters())], False, False, None)
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(compression: dict, steps: int, **extra) -> tuple[list[float], dict, object]:
    torch.manual_seed(0)
    model = cases.TinyBert(2)
    cfg = _cfg(compression, **extra)
    if compression:
        init_compression(model, copy.deepcopy(cfg))
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    x, y = cases._inputs("bert")
    losses = []
    try:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, engine
    finally:
        engine.destroy()


@pytest.mark.parametrize("compression", [COMPRESSION, {"weight_quantization": WQ_MOQ}], ids=["schedule", "moq"])
def test_engine_steps_compression_as_deepspeed(compression):
    steps = 5
    ref_losses, ref_state = _by_hand(compression, steps)
    losses, state, engine = _engine(compression, steps)
    assert losses == ref_losses
    assert list(state) == list(ref_state)
    for k in state:
        assert torch.equal(state[k], ref_state[k]), k
    assert engine.compression_scheduler.training_steps == steps
    if "sparse_pruning" in compression:  # switched on at step 2, activation quantization at 3
        assert engine.module.layer[0].intermediate.sparse_pruning_enabled
        assert engine.module.layer[0].dense.activation_quantization_enabled
    else:  # MoQ: 8 -> 4 bits, the period doubling: 2, 4, 8 ...; the weights sit on their grid
        q = engine.module.layer[0].query.weight
        assert (q.start_bits, q.q_period) == (6, 8)
        flat = q.detach().reshape(2, -1)
        scale = 2 * flat.abs().amax(dim=1, keepdim=True) / 2 ** 6
        assert torch.equal((flat / scale).round() * scale, flat)


def test_quantize_training_section_schedules_every_weight():
    moq = {"enabled": True, "quantize-algo": {"q_type": "asymmetric"}, "quantize_bits": {"start_bits": 8,
           "target_bits": 6}, "quantize_schedule": {"quantize_period": 1, "schedule_offset": 2}, "quantize_groups": 1}
    _, state, engine = _engine({}, 4, quantize_training=moq)
    weights = [p for p in engine.module.parameters() if p.dim() > 1]
    assert weights and all(p.target_bits == 6 for p in weights)
    # quantized at steps 2 and 3 (qsteps 1, 2): one bit dropped at qsteps 1 (period 1 -> 2), another at 2
    assert all(p.start_bits == 6 and p.q_period == 4 for p in weights)
    for p in weights:  # the last requantization put each weight on a 6-bit asymmetric grid: <= 64 levels
        assert len(torch.unique(p.detach())) <= 64
    assert len(torch.unique(engine.module.layer[1].intermediate.weight.detach())) > 32
    assert all(not hasattr(p, "start_bits") for p in engine.module.parameters() if p.dim() == 1)


def _bert():
    torch.manual_seed(0)
    return cases.TinyBert(2)


def test_bad_input_named():
    with pytest.raises(CompressionConfigError, match="'weight_quantisation'.*did you mean 'weight_quantization'"):
        init_compression(_bert(), _cfg({"weight_quantisation": {}}))
    with pytest.raises(CompressionConfigError, match="'quantise_groups'.*did you mean 'quantize_groups'"):
        bad = cases._wq(8, 4, ["query"])
        bad["shared_parameters"]["quantise_groups"] = 2
        init_compression(_bert(), _cfg({"weight_quantization": bad}))
    with pytest.raises(CompressionConfigError, match=r"target_bits \(8\) > start_bits \(4\)"):
        init_compression(_bert(), _cfg({"weight_quantization": cases._wq(4, 8, ["query"])}))
    with pytest.raises(CompressionConfigError, match="pattern 'attention.self' matches no compressible module"):
        init_compression(_bert(), _cfg({"row_pruning": cases._prune("l1", 0.5, ["attention.self"])}))
    with pytest.raises(CompressionConfigError, match="related_modules: pattern 'ffn_out' matches no"):
        init_compression(_bert(), _cfg({"row_pruning": cases._prune("l1", 0.5, ["intermediate"],
                                                                     related=[["ffn_out"]])}))
    with pytest.raises(CompressionConfigError, match="num_heads=3 does not divide the width 8"):
        init_compression(_bert(), _cfg({"head_pruning": cases._prune("topk", 0.5, ["dense"], num_heads=3)}))
    with pytest.raises(CompressionConfigError, match="bits = 6: activations quantize to 4 or 8 bits"):
        init_compression(_bert(), _cfg({"activation_quantization": {
            "shared_parameters": {"enabled": True}, "different_groups": {"a": {"params": {"bits": 6},
                                                                                "modules": ["dense"]}}}}))
    with pytest.raises(ValueError, match="needs teacher_model"):
        init_compression(_bert(), _cfg({"layer_reduction": cases.LAYER_REDUCTION}))
    # the engine's config parse fails the same way, before any model work
    with pytest.raises(CompressionConfigError, match="did you mean 'head_pruning'"):
        deepspeed_c.initialize(model=_bert(), config=_cfg({"head_prunning": {}}))
    with pytest.raises(CompressionConfigError,
                       match=r"quantize_training.quantize_bits: target_bits \(8\) > start_bits"):
        deepspeed_c.initialize(model=_bert(), config=_cfg({}, quantize_training={
            "enabled": True, "quantize_bits": {"start_bits": 4, "target_bits": 8}}))


def test_moq_eigenvalue_stretches_each_blocks_period():
    """runtime/eigenvalue.py's block eigenvalues (normalised to [0, 1]) time MoQ: at a block's bit drop its period
    becomes (period << 1) * (1 + floor(4 * eigenvalue)), DeepSpeed's rule (whose 0.19.6 code path is broken)."""
    import math

    from deepspeed_c.runtime.eigenvalue import Eigenvalue

    torch.manual_seed(0)
    model = cases.TinyBert(2)
    x, y = cases._inputs("bert")
    loss = torch.nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    block_eigenvalue = Eigenvalue(max_iter=20, tol=1e-3, layer_name="layer", layer_num=2).compute_eigenvalue(model)
    assert {b for _, b in block_eigenvalue.values()} == {0, 1}
    weights = [p for p in model.layer.parameters() if p.dim() > 1]
    for p in weights:
        p.start_bits, p.target_bits, p.q_period = 8, 4, 1
    q = Quantizer(q_groups=1, q_type="symmetric", q_rounding="nearest", q_eigenvalue=True, layer_num=2)
    q.quantize([weights], False, True, block_eigenvalue)
    for p in weights:
        ev, _ = block_eigenvalue[id(p)]
        assert (p.start_bits, p.q_period) == (7, 2 * (1 + math.floor(ev * 4)))
    assert max(ev for ev, _ in block_eigenvalue.values()) == 1.0  # the sharpest block waits 5x longer
    assert q.any_precision_switch()


def test_moq_under_fp16_quantizes_the_half_weights():
    """DeepSpeed's MoQ setting (fp16 engine): the model's half weights are requantized after each step."""
    torch.manual_seed(0)
    model = cases.TinyBert(2)
    cfg = _cfg({"weight_quantization": WQ_MOQ}, fp16={"enabled": True, "initial_scale_power": 4})
    init_compression(model, copy.deepcopy(cfg))
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    x, y = cases._inputs("bert")
    try:
        for _ in range(4):
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
        q = engine.module.layer[0].query.weight
        assert q.dtype == torch.float16 and (q.start_bits, q.q_period) == (6, 8)
        assert len(torch.unique(q.detach())) <= 2 * 2 ** 6  # two groups on a 6-bit grid
        assert len(torch.unique(engine.module.layer[0].dense.weight.detach())) > 56  # not in the groups: untouched
    finally:
        engine.destroy()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.parametrize("where", ["nested", "top-level"])
def test_engine_moq_eigenvalue_timed_periods(where: str):
    """quantize_training.eigenvalue (or the documented top-level `eigenvalue` section): the engine computes the
    blocks' eigenvalues before the optimizer step (from a create_graph backward) and each block's period at its
    bit drop is multiplied by 1 + floor(4 * eigenvalue)."""
    import math

    torch.manual_seed(0)
    model = cases.TinyBert(2)
    eigen = {"enabled": True, "max_iter": 10, "tol": 1e-2, "layer_name": "layer", "layer_num": 2}
    moq = {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 4},
           "quantize_schedule": {"quantize_period": 1, "schedule_offset": 0}}
    extra = {"quantize_training": {**moq, "eigenvalue": eigen}} if where == "nested" else \
        {"quantize_training": moq, "eigenvalue": eigen}
    engine, *_ = deepspeed_c.initialize(model=model, config=_cfg({}, **extra))
    x, y = cases._inputs("bert")
    try:
        engine.scale(torch.nn.functional.mse_loss(engine(x), y)).backward(create_graph=True)
        engine.step()
        eig = engine.compression_hooks.block_eigenvalue
        assert {b for _, b in eig.values()} == {0, 1} and max(v for v, _ in eig.values()) == 1.0
        # the forward at step 0 quantized once (DeepSpeed's engine does): 8 -> 7 bits, period 1 -> 2; the step
        # drops to 6 bits with the period 2 -> 4, times the block's factor
        for p in model.layer.parameters():
            if p.dim() > 1:
                assert (p.start_bits, p.q_period) == (6, 4 * (1 + math.floor(4 * eig[id(p)][0])))
        assert model.classifier.weight.q_period == 4  # outside the blocks: no eigenvalue, plain doubling
    finally:
        engine.destroy()
