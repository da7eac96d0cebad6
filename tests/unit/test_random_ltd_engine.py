"""random-LTD through the engine (data_efficiency.data_routing.random_ltd): convert_to_random_ltd wraps the
configured layers, each training forward moves the scheduler to global_steps and the wrapped layers run on
its kept length; eval runs every token; the scheduler's state is saved under DeepSpeed's `random_ltd` key and
restored; bad sections fail at initialize naming the key."""
from __future__ import annotations

import copy

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
from deepspeed_c.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks

S, H, MICRO = 16, 8, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)
        self.lens: list[int] = []

    def forward(self, x):
        self.lens.append(x.shape[1])
        return x + torch.tanh(self.lin(x)).cumsum(dim=1) / x.shape[1]  # tokens interact (causally)


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, H)
        self.layers = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(H, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


RANDOM_LTD = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
              "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
              "random_ltd_schedule": {"min_value": 4, "max_value": S, "schedule_type": "fixed_linear",
                                      "schedule_config": {"seq_per_step": 2, "require_steps": 6}}}


def _cfg(ltd=None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True,
                                                                   "random_ltd": ltd or copy.deepcopy(RANDOM_LTD)}},
            **extra}


def _engine():
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=TinyGPT(), config=_cfg())
    return convert_to_random_ltd(engine, Block)


def _train(engine, steps):
    for step in range(steps):
        tokens = (torch.randint(0, 32, (MICRO, 1)) + torch.arange(S)) % 32
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()


def test_engine_runs_the_wrapped_layers_on_the_scheduled_length(tmp_path):
    engine = _engine()
    assert engine.random_ltd_enabled() and engine.data_efficiency_enabled()
    ref = RandomLTDScheduler({**RANDOM_LTD, "global_batch_size": MICRO})
    expected = []
    for g in range(8):
        ref.update_seq(g)
        expected.append(ref.get_current_seq())
    _train(engine, 8)
    layers = engine.module.layers
    # every Block is wrapped; only those random_ltd_layer_id names get the scheduler, the others run every token
    assert layers[0].random_ltd_layer.lens == [S] * 8 and layers[3].random_ltd_layer.lens == [S] * 8
    for i in (1, 2):
        assert layers[i].random_ltd_layer.lens == expected, (i, layers[i].random_ltd_layer.lens, expected)
    assert expected[0] < S and expected[-1] == S  # the window covers dropping and the full length
    assert engine.random_ltd_scheduler.state_dict() == ref.state_dict()
    engine.random_ltd_scheduler.set_current_seq(4)
    engine.eval()
    with torch.no_grad():
        engine((torch.arange(S)[None] % 32).repeat(MICRO, 1))
    assert layers[1].random_ltd_layer.lens[-1] == S  # eval runs every token
    engine.random_ltd_scheduler.load_state_dict(ref.state_dict())
    engine.save_checkpoint(str(tmp_path), tag="t")
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["random_ltd"] == ref.state_dict()
    engine.destroy()
    fresh = _engine()
    fresh.load_checkpoint(str(tmp_path), tag="t")
    assert fresh.random_ltd_scheduler.state_dict() == ref.state_dict()
    fresh.destroy()


def test_mid_schedule_length_reaches_the_layer():
    engine = _engine()
    _train(engine, 1)
    assert engine.module.layers[1].random_ltd_layer.lens == [4]
    assert engine.module.layers[2].random_ltd_layer.lens == [4]
    engine.destroy()


class Other(torch.nn.Module):
    pass


def test_layer_class_not_found_and_id_mismatch():
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=TinyGPT(), config=_cfg())
    with pytest.raises(ValueError, match="no Other layer"):
        convert_to_random_ltd(engine, Other)
    engine.destroy()
    ltd = copy.deepcopy(RANDOM_LTD)
    ltd["random_ltd_layer_id"] = [1, 7]
    engine, *_ = deepspeed_c.initialize(model=TinyGPT(), config=_cfg(ltd))
    with pytest.raises(ValueError, match="random_ltd.random_ltd_layer_id"):
        convert_to_random_ltd(engine, Block)
    engine.destroy()


def _bad(**over):
    ltd = copy.deepcopy(RANDOM_LTD)
    ltd.update(over)
    return ltd


@pytest.mark.parametrize("cfg, err, key", [
    (_cfg(_bad(model_type="seq2seq")), ValueError, "random_ltd.model_type"),
    (_cfg(_bad(hidden_state_order="hbs")), ValueError, "random_ltd.hidden_state_order"),
    (_cfg(_bad(random_ltd_layer_id=[1])), ValueError, "random_ltd.random_ltd_layer_id"),
    (_cfg(_bad(random_ltd_schedule={"min_value": 4, "max_value": S, "schedule_type": "fixed_root",
                                    "schedule_config": {"seq_per_step": 2, "require_steps": 6}})),
     ValueError, "random_ltd_schedule.schedule_type"),
    ({"train_micro_batch_size_per_gpu": 1, "data_efficiency": {"enabled": True, "data_sampling": {
        "enabled": True, "curriculum_learning": {"enabled": True}}}}, ValueError,
     "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"),
    ({"train_micro_batch_size_per_gpu": 1, "data_efficiency": {"enabled": True, "data_sampling": {
        "enabled": True, "dynamic_batching": {"enabled": True}}}}, ValueError,
     "data_efficiency.data_sampling.dynamic_batching.max_tokens"),
    ({"train_micro_batch_size_per_gpu": 1, "data_efficiency": {"enabled": True, "data_sampling": {
        "enabled": True, "dynamic_batching": {"enabled": True, "max_tokens": 8, "lr_scaling_method": "cubic"}}}},
     ValueError, "data_efficiency.data_sampling.dynamic_batching.lr_scaling_method"),
])
def test_bad_random_ltd_fails_at_initialize_naming_the_key(cfg, err, key):
    with pytest.raises(err, match=key.replace(".", r"\.")):
        deepspeed_c.initialize(model=TinyGPT(), config=cfg)
