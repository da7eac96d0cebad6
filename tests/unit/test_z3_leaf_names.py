"""ZeRO-3 leaf-module flagging as DeepSpeed 0.19.8 does it: classes match their subclasses, names and name
suffixes flag through set_z3_leaf_modules_by_name / _by_suffix, and `zero_optimization.leaf_module` defaults to
Hugging Face's sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE), which a ZeRO-3 engine then gathers whole."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                               set_z3_leaf_modules_by_suffix, z3_leaf_module)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(4, 4)
        self.w2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class SubBlock(Block):
    pass


# a class that names itself as transformers' Mixtral MoE block, so the default config matches it
FakeMixtralBlock = type("MixtralSparseMoeBlock", (Block,), {"__module__": "transformers.models.mixtral.modeling_mixtral"})


def _model(block: type) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), block(), torch.nn.Linear(4, 4))


def test_class_matches_subclasses_and_names_and_suffixes_flag():
    m = _model(SubBlock)
    assert set_z3_leaf_modules(m, [Block]) == [m[1]]
    m = _model(Block)
    hits, missing = set_z3_leaf_modules_by_name(m, ["1", "nope"], raise_if_not_found=False)
    assert hits == [m[1]] and missing == ["nope"] and get_z3_leaf_modules(m) == [m[1]]
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(m, ["nope"])
    hits, missing = set_z3_leaf_modules_by_suffix(m, ["w1", "1.w2", "zz"], raise_if_not_found=False)
    assert hits == [m[1].w1, m[1].w2] and missing == ["zz"]
    hits, _ = set_z3_leaf_modules_by_suffix(m, ["w1"], flag=False)
    assert not z3_leaf_module(m[1].w1) and z3_leaf_module(m[1].w2)


def test_default_leaf_classes_are_gathered_whole_at_stage3():
    from deepspeed_c.runtime.zero.config import DeepSpeedZeroConfig

    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in \
        DeepSpeedZeroConfig().leaf_module.classes
    model = _model(FakeMixtralBlock)
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    try:
        assert z3_leaf_module(model[1]) and not z3_leaf_module(model[0])
    finally:
        engine.destroy()
