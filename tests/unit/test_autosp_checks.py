"""AutoSP's refusals, each naming what to change: the config (compile.passes ["autosp"] needs
compile.deepcompile and ZeRO stage 0; other passes are not built), prepare_autosp_inputs' arguments, and the
passes on a captured graph (heads not divisible by the sequence-parallel size, no SDPA, a graph break,
untagged inputs, no cross entropy against the labels); labels shifted inside the model are taken. The passes run here in one process on dynamo's graph with a registered group of 2 that
never communicates: a test backend applies them and then runs the untransformed graph."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from deepspeed_c.compile import sp_ops
from deepspeed_c.compile.passes import sp_compile
from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from tests.distributed.autosp_model import TinySdpaLM, batch


def _cfg(stage: int, passes: Any = ("autosp",), deepcompile: bool = True) -> dict:
    return {"train_batch_size": 2, "zero_optimization": {"stage": stage},
            "compile": {"deepcompile": deepcompile, "passes": list(passes)}}


def test_config_accepts_stage0_and_refuses_the_rest() -> None:
    assert DeepSpeedConfig(_cfg(0)).compile_config.passes == ["autosp"]
    for cfg, exc, words in [
        (_cfg(1), DeepSpeedConfigError, ["compile.passes", "zero_optimization.stage", "1"]),
        (_cfg(3), DeepSpeedConfigError, ["compile.passes", "zero_optimization.stage", "3"]),
        (_cfg(0, deepcompile=False), DeepSpeedConfigError, ["compile.passes", "compile.deepcompile"]),
        (_cfg(3, passes=["z3"]), NotImplementedError, ["compile.passes", "z3"]),
    ]:
        with pytest.raises(exc) as info:
            DeepSpeedConfig(cfg)
        assert all(w in str(info.value) for w in words), (words, str(info.value))


@pytest.fixture
def group_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp_ops, "_GROUP", sp_ops.SequenceGroup(None, 2, 0))


def test_prepare_autosp_inputs_refusals(group_of_two: None) -> None:
    ids, labels, pos = batch(0, s=8)
    with pytest.raises(ValueError, match="'label_id'.*sequence length 8"):
        sp_compile.prepare_autosp_inputs(ids, labels[:, :4], pos)
    with pytest.raises(ValueError, match="'seq_dim' 2"):
        sp_compile.prepare_autosp_inputs(ids, labels, pos, seq_dim=2)
    with pytest.raises(ValueError, match="sequence length 7.*'sequence_parallel_size' 2"):
        sp_compile.prepare_autosp_inputs(ids[:, :7], labels[:, :7], pos[:, :7])
    with pytest.raises(ValueError, match="'label_id' is required"):
        sp_compile.prepare_autosp_inputs(ids, None)
    out = sp_compile.prepare_autosp_inputs(ids, labels, pos)
    assert out[0] is ids and ids.tag == ("autosp_input_id", 1) and pos.tag == ("autosp_position_id", 1)


def _capture(model: torch.nn.Module, tag: bool = True) -> list[dict]:
    """Compiles and runs model with the AutoSP passes applied to each graph (the original graph runs)."""
    done: list[dict] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        original = copy.deepcopy(gm)
        done.append(sp_compile.apply_autosp(gm, 2, 0))
        return original.forward

    ids, labels, pos = batch(0, s=8)
    if tag:
        sp_compile.prepare_autosp_inputs(ids, labels, pos)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(ids, labels, pos)
    return done


def test_passes_transform_and_refuse(group_of_two: None) -> None:
    assert _capture(TinySdpaLM()) == [{"attention": 1, "losses": 1}]
    assert _capture(TinySdpaLM(loss="shifted")) == [{"attention": 1, "losses": 1}]  # shifted whole, then cut
    for model, tag, exc, words in [
        (TinySdpaLM(heads=1), True, ValueError, ["query has 1 heads", "'sequence_parallel_size' 2"]),
        (TinySdpaLM(attention=False), True, RuntimeError, ["compile.passes", "scaled_dot_product_attention"]),
        (TinySdpaLM(graph_break=True), True, RuntimeError, ["graph break"]),
        (TinySdpaLM(), False, RuntimeError, ["prepare_autosp_inputs"]),
        (TinySdpaLM(loss="mse"), True, NotImplementedError, ["cross_entropy", "compile.passes"]),
    ]:
        with pytest.raises(Exception) as info:
            _capture(model, tag)
        assert isinstance(info.value, exc) or isinstance(info.value.__cause__, exc) or exc.__name__ in str(info.value)
        assert all(w in str(info.value) for w in words), (words, str(info.value))
