"""The partitioned-parameter contract Hugging Face, PEFT and accelerate rely on, written from their side,
plus zero.Init / GatheredParameters behaviour and bad input, in one process (a process group of one).

What those libraries read: a ZeRO-3 parameter is still the same nn.Parameter (isinstance, identity in
named_parameters, requires_grad_ works), its data is an empty placeholder (numel() == 0), and it
carries ds_id (unique), ds_numel / ds_shape (the whole size, which HF uses for resize and loading),
ds_status (ZeroParamStatus), ds_tensor (this rank's shard), ds_persist and all_gather()/partition();
it accepts new attributes (PEFT tags parameters). The values are those the same module has when
built without zero.Init under the same seed on the accelerator's device (where zero.Init builds, as
DeepSpeed's does)."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.zero.partition_parameters import ZeroParamStatus


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 6)
        self.inner = torch.nn.Sequential(torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.fc1(x))) * self.scale


def _reference() -> Net:
    """Built where zero.Init builds (the accelerator's device, as DeepSpeed's Init), so the same seed
    draws the same values; kept on the host."""
    from deepspeed_c.accelerator import get_accelerator

    torch.manual_seed(0)
    with torch.device(get_accelerator().current_device_name()):
        return Net().cpu()


def _built_under_init(**kwargs) -> Net:
    torch.manual_seed(0)
    with deepspeed_c.zero.Init(**kwargs):
        return Net()


def test_placeholder_contract_from_the_library_side() -> None:
    ref = _reference()
    model = _built_under_init(config_dict_or_path={"zero_optimization": {"stage": 3}})
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    ids = set()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, torch.nn.Parameter)
        assert p.numel() == 0, name
        assert p.ds_numel == r.numel() and tuple(p.ds_shape) == tuple(r.shape), name
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert isinstance(p.ds_persist, bool)
        assert p.ds_tensor.numel() >= r.numel()  # one rank holds everything (padding allowed)
        ids.add(p.ds_id)
        p.peft_tag = name  # libraries set their own attributes on parameters
    assert len(ids) == len(names)
    # buffers are not partitioned
    assert torch.equal(model.scale.cpu(), ref.scale)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        p.all_gather()
        assert p.ds_status is ZeroParamStatus.AVAILABLE
        assert torch.equal(p.data.cpu(), r.data), name
        p.partition()
        assert p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert p.peft_tag == name
    # DeepSpeed's coalesced form: called on one parameter, gathers the list it is given; the handle waits
    params = list(model.parameters())
    handle = params[0].all_gather_coalesced(params)
    handle.wait()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.ds_status is ZeroParamStatus.AVAILABLE and torch.equal(p.data.cpu(), r.data), name
    params[0].partition(params)
    assert all(p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    model.fc1.weight.requires_grad_(False)  # freezing a placeholder works (PEFT)
    assert not model.fc1.weight.requires_grad


def test_gathered_parameters_modifier_edits_stick_and_others_pass_through() -> None:
    model = _built_under_init(config_dict_or_path={"zero_optimization": {"stage": 3}})
    plain = torch.ones(3)
    with deepspeed_c.zero.GatheredParameters([model.fc1.weight, plain], modifier_rank=0):
        assert model.fc1.weight.shape == (6, 8)
        model.fc1.weight.data.fill_(0.5)
        plain.mul_(3)  # not a ZeRO parameter: left as it is
    assert model.fc1.weight.numel() == 0
    assert torch.equal(plain, torch.full((3,), 3.0))
    # a generator is accepted too, and the edit is in the shard
    with deepspeed_c.zero.GatheredParameters(p for p in [model.fc1.weight]):
        assert torch.equal(model.fc1.weight.cpu(), torch.full((6, 8), 0.5))
    # without modifier_rank, edits are dropped (as in DeepSpeed)
    with deepspeed_c.zero.GatheredParameters(model.fc1.bias):
        before = model.fc1.bias.detach().cpu().clone()
        model.fc1.bias.data.zero_()
    with deepspeed_c.zero.GatheredParameters(model.fc1.bias):
        assert torch.equal(model.fc1.bias.cpu(), before)
    # a single tensor, and enabled=False
    with deepspeed_c.zero.GatheredParameters(model.fc1.bias, enabled=False):
        assert model.fc1.bias.numel() == 0


def test_nested_init_and_init_of_an_existing_module_and_auto_config() -> None:
    cfg = {"train_batch_size": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    with deepspeed_c.zero.Init(config_dict_or_path=cfg):
        with deepspeed_c.zero.Init(config_dict_or_path=cfg):
            inner = torch.nn.Linear(4, 4)
        outer = torch.nn.Linear(4, 2)
    for p in list(inner.parameters()) + list(outer.parameters()):
        assert p.numel() == 0 and p.dtype == torch.float32  # "auto" precision is not decided yet: fp32
    after = torch.nn.Linear(3, 3)  # outside the context: untouched
    assert after.weight.numel() == 9 and not hasattr(after.weight, "ds_id")
    existing = torch.nn.Linear(5, 2)
    value = existing.weight.detach().clone()
    deepspeed_c.zero.Init(module=existing, config_dict_or_path={"bf16": {"enabled": True}})
    assert existing.weight.numel() == 0 and existing.weight.dtype == torch.bfloat16
    with deepspeed_c.zero.GatheredParameters(existing.weight):
        assert torch.equal(existing.weight.cpu(), value.to(torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu", "enum"])
def test_remote_device_cpu_keeps_shards_on_the_host(device: str) -> None:
    from deepspeed_c.runtime.zero.offload_config import OffloadDeviceEnum

    remote = OffloadDeviceEnum.cpu if device == "enum" else device  # DeepSpeed's tests pass the enum
    model = _built_under_init(remote_device=remote, config_dict_or_path={"zero_optimization": {"stage": 3}})
    assert all(p.ds_tensor.device.type == "cpu" for p in model.parameters())


def test_init_disabled_builds_a_plain_module() -> None:
    with deepspeed_c.zero.Init(enabled=False):
        m = torch.nn.Linear(2, 2)
    assert m.weight.numel() == 4


def test_forward_before_initialize_names_the_parameter() -> None:
    model = _built_under_init(config_dict_or_path={"zero_optimization": {"stage": 3}})
    with pytest.raises(RuntimeError, match=r"Linear\.weight.*ZeRO-3 partitioned.*initialize"):
        model(torch.randn(2, 8, device=model.fc1.weight.device))
    with deepspeed_c.zero.GatheredParameters(list(model.parameters())):
        out = model(torch.randn(2, 8, device=model.fc1.weight.device))  # inside GatheredParameters it runs
    assert out.shape == (2, 3)


def test_bad_input() -> None:
    model = _built_under_init(config_dict_or_path={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="modifier_rank=3"):
        deepspeed_c.zero.GatheredParameters(model.fc1.weight, modifier_rank=3)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        deepspeed_c.zero.register_external_parameter(model, torch.ones(2))
    with pytest.raises(TypeError, match="config_dict_or_path"):
        deepspeed_c.zero.Init(config_dict_or_path=42)
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="stage3_prefetch_bucket_size"):
        deepspeed_c.initialize(model=torch.nn.Linear(2, 2), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sz": 10}})


def test_engine_trains_and_gathered_edits_reach_the_masters() -> None:
    """One rank: stage 3 equals plain training; an edit through GatheredParameters(modifier_rank=0)
    after initialize is kept by the next step (the fp32 masters take it)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    model = _built_under_init(config_dict_or_path=cfg)
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    ref = _reference().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 8, generator=g)
        loss = engine(x.to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ref(x.double()).pow(2).mean().backward()
        opt.step()
    for (name, p), (_, r) in zip(engine.module.named_parameters(), ref.named_parameters()):
        with deepspeed_c.zero.GatheredParameters(p):
            assert float((p.detach().double().cpu() - r.detach()).norm() / r.detach().norm()) < 1e-5, name
    with deepspeed_c.zero.GatheredParameters(engine.module.fc1.bias, modifier_rank=0):
        engine.module.fc1.bias.data.fill_(7.0)
    x = torch.zeros(2, 8, device=engine.device)
    engine.backward(engine(x).sum() * 0.0)  # a zero gradient: SGD leaves the edited value
    engine.step()
    with deepspeed_c.zero.GatheredParameters(engine.module.fc1.bias):
        assert torch.equal(engine.module.fc1.bias.cpu(), torch.full((6,), 7.0))
    engine.destroy()


@pytest.mark.parametrize("how", ["set_z3_leaf_modules", "config"])
def test_leaf_modules_are_gathered_whole(how: str) -> None:
    """A z3 leaf module's parameters (its children's too) are one step: gathered before its forward and
    its children get no hooks of their own (MoE layers, whose experts run data-dependently)."""
    from deepspeed_c.utils import set_z3_leaf_modules

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    model = _reference()
    if how == "config":
        cfg["zero_optimization"]["leaf_module"] = {"names": ["inner"]}
    else:
        set_z3_leaf_modules(model, [torch.nn.Sequential])
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    coord = engine.optimizer.coordinator
    hooked = dict(zip(map(id, coord.modules), coord.units))
    inner_units = {getattr(p, "_dsc_z3")[1] for p in model.inner.parameters()}
    assert set(hooked[id(model.inner)]) == inner_units
    assert all(id(c) not in hooked for c in model.inner.children())
    ref = _reference().double()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(2, 8)
    engine.backward(engine(x.to(engine.device)).pow(2).mean())
    engine.step()
    ref(x.double()).pow(2).mean().backward()
    opt.step()
    for (name, p), (_, r) in zip(engine.module.named_parameters(), ref.named_parameters()):
        with deepspeed_c.zero.GatheredParameters(p):
            assert float((p.detach().double().cpu() - r.detach()).norm() / r.detach().norm()) < 1e-5, name
    engine.destroy()
