"""Config keys that used to be accepted and silently ignored (issue 12 item 7): each now does what
DeepSpeed does, or `initialize` warns once naming it and why it has no effect.

Built, with DeepSpeed's behaviour:
- zero_optimization.overlap_comm=false at stage 2: each bucket's reduction completes before
  backward goes on (same results as the overlapped default);
- load_from_fp32_weights=false: on load, masters come from the saved 16-bit weights, not the saved
  fp32 partitions (DeepSpeed: "load fp32 master weights from the 16-bit model weights");
- ignore_unused_parameters=false: DeepSpeed asserts "your module has parameters that were not used
  in producing loss";
- cpu_offload_use_pin_memory: the pin_memory of the offload sections;
- offload_optimizer.cpuadam_cores_perc: that share of the rank's cores as the host optimizer's
  OpenMP threads."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.config import no_effect as config_no_effect
from deepspeed_c.runtime.config import DeepSpeedConfig
from tests.distributed.engine_models import MLP

BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


pytestmark = pytest.mark.usefixtures("world_of_one")


def _init(cfg: dict, model: torch.nn.Module | None = None):
    torch.manual_seed(0)
    model = model or MLP()
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _train(engine, steps: int = 2) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2, 12, generator=g), torch.randn(2, 3, generator=g)
        dt = next(engine.module.parameters()).dtype
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device, dt)).float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("entry", config_no_effect.NO_EFFECT, ids=lambda e: ".".join(e.path))
def test_each_key_without_effect_warns_once(entry, caplog):
    config_no_effect._WARNED.discard(entry.path)
    value = {True: False, False: True, None: {"type": "fast"}}[entry.default]
    params: dict = {}
    node = params
    for key in entry.path[:-1]:
        node = node.setdefault(key, {})
    node[entry.path[-1]] = value
    with caplog.at_level(logging.WARNING):
        assert config_no_effect.warn_keys_without_effect(params) == [".".join(entry.path)]
        assert config_no_effect.warn_keys_without_effect(params) == []
    msgs = [r.getMessage() for r in caplog.records if ".".join(entry.path) in r.getMessage()]
    assert len(msgs) == 1 and "no effect" in msgs[0]


def test_initialize_warns_for_a_set_key(caplog):
    config_no_effect._WARNED.discard(("graph_harvesting",))
    with caplog.at_level(logging.WARNING):
        _init(dict(BASE, graph_harvesting=True))
    assert any("'graph_harvesting'" in r.getMessage() and "no effect" in r.getMessage() for r in caplog.records)


def test_overlap_comm_false_at_stage2_awaits_each_bucket_and_trains_the_same():
    zero = {"stage": 2, "reduce_bucket_size": 64}
    a = _init(dict(BASE, zero_optimization=dict(zero, overlap_comm=False)))
    b = _init(dict(BASE, zero_optimization=zero))
    assert a.optimizer.reducer.wait_each_bucket and not b.optimizer.reducer.wait_each_bucket
    assert _train(a, 3) == _train(b, 3)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("from_fp32", [True, False])
def test_load_from_fp32_weights(tmp_path, from_fp32):
    from deepspeed_c.utils import safe_get_full_fp32_param

    cfg = dict(BASE, bf16={"enabled": True}, zero_optimization={"stage": 2})
    e = _init(cfg)
    _train(e, 3)
    saved_masters = [safe_get_full_fp32_param(p).clone() for p in e.module.parameters()]
    e.save_checkpoint(str(tmp_path))
    cfg2 = dict(cfg, zero_optimization={"stage": 2, "load_from_fp32_weights": from_fp32})
    f = _init(cfg2)
    f.load_checkpoint(str(tmp_path))
    for p, saved in zip(f.module.parameters(), saved_masters):
        master = safe_get_full_fp32_param(p)
        want = saved if from_fp32 else p.detach().float()
        assert torch.equal(master, want)
    if not from_fp32:  # the 16-bit weights round the masters: the two sources really differ
        assert any(not torch.equal(safe_get_full_fp32_param(p), s) for p, s in zip(f.module.parameters(),
                                                                                   saved_masters))


class _WithUnused(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(3, 3)


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters_false_asserts(stage):
    cfg = dict(BASE, zero_optimization={"stage": stage, "ignore_unused_parameters": False})
    with pytest.raises(AssertionError, match="not used in producing the loss"):
        _train(_init(cfg, _WithUnused()), 1)
    _train(_init(dict(BASE, zero_optimization={"stage": stage}), _WithUnused()), 1)  # the default ignores it


def test_cpu_offload_use_pin_memory_applies():
    cfg = DeepSpeedConfig({**BASE, "train_batch_size": 2, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_config.offload_optimizer.pin_memory is True


def test_cpuadam_cores_perc_sets_the_host_optimizer_threads():
    cores = len(os.sched_getaffinity(0))
    e = _init(dict(BASE, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                              "cpuadam_cores_perc": 0.5}}))
    try:
        assert e.optimizer.optimizer.ds_opt_op.num_threads() == max(1, int(cores * 0.5))
    finally:
        e.optimizer.optimizer.ds_opt_op.num_threads(cores)


def test_use_node_local_storage_is_built_and_no_longer_warns(caplog):
    """checkpoint.use_node_local_storage is honoured (tests/distributed/test_checkpoint_node_local.py)."""
    path = ("checkpoint", "use_node_local_storage")
    assert path not in {e.path for e in config_no_effect.NO_EFFECT}
    config_no_effect._WARNED.discard(path)
    with caplog.at_level(logging.WARNING):
        assert config_no_effect.warn_keys_without_effect({"checkpoint": {"use_node_local_storage": True}}) == []
        engine = _init(dict(BASE, checkpoint={"use_node_local_storage": True}))
    assert engine.use_node_local_storage() is True
    assert not any("use_node_local_storage" in r.getMessage() for r in caplog.records)


def test_use_node_local_storage_on_one_rank_saves_and_resumes(tmp_path):
    cfg = dict(BASE, zero_optimization={"stage": 2}, checkpoint={"use_node_local_storage": True})
    a = _init(cfg)
    _train(a, 2)
    a.save_checkpoint(str(tmp_path))
    want = _train(a, 2)
    b = _init(cfg)
    b.load_checkpoint(str(tmp_path))
    assert _train(b, 2) == want
