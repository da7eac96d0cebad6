"""compile.deepcompile's bad input is refused when the config is parsed (before the model is touched, so
before any step), naming the key and the reason: a stage without ZeRO, offloads, optimizers with their
own gradient path, DeepCompile passes deepspeed_c does not build, and a torch without the compiler features
it uses. The compile section takes DeepSpeed 0.19.8's keys with its defaults."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError


def _cfg(stage: int = 3, **extra) -> dict:
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "compile": {"deepcompile": True}}
    for k, v in extra.items():
        if k == "compile":
            cfg["compile"].update(v)
        elif k == "zero":
            cfg["zero_optimization"].update(v)
        else:
            cfg[k] = v
    return cfg


def test_defaults_are_deepspeeds() -> None:
    c = DeepSpeedConfig(_cfg()).compile_config
    assert c.deepcompile is True
    assert (c.free_activation, c.free_activation_threshold, c.offload_activation, c.offload_activation_pin_memory,
            c.offload_opt_states, c.double_buffer, c.symmetric_memory, c.debug_log, c.offload_parameters) == \
        (False, 10 * 1024 * 1024, False, True, False, True, False, False, False)
    assert (c.sync_before_reduce, c.sync_after_reduce, c.sync_before_allgather, c.sync_after_allgather) == (False,) * 4
    assert (c.keep_int_input_tensors, c.keep_all_input_tensors, c.passes) == (True, False, None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_are_accepted(stage: int) -> None:
    assert DeepSpeedConfig(_cfg(stage)).compile_config.deepcompile


def test_unknown_key_names_closest() -> None:
    with pytest.raises(ValueError, match="compile.double_bufer"):
        DeepSpeedConfig(_cfg(compile={"double_bufer": False}))


@pytest.mark.parametrize("cfg, exc, words", [
    (_cfg(0), DeepSpeedConfigError, ["compile.deepcompile", "zero_optimization.stage", "0"]),
    (_cfg(3, zero={"offload_optimizer": {"device": "cpu"}}), DeepSpeedConfigError,
     ["compile.deepcompile", "zero_optimization.offload_optimizer.device", "cpu"]),
    (_cfg(3, zero={"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}), DeepSpeedConfigError,
     ["compile.deepcompile", "zero_optimization.offload_param.device"]),
    (_cfg(1, optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3}}), DeepSpeedConfigError,
     ["compile.deepcompile", "optimizer.type", "OneBitAdam"]),
    (_cfg(3, optimizer={"type": "Muon", "params": {"lr": 1e-3}}), DeepSpeedConfigError,
     ["compile.deepcompile", "optimizer.type", "Muon"]),
    (_cfg(3, zero={"zero_quantized_weights": True}), DeepSpeedConfigError,
     ["compile.deepcompile", "zero_optimization.zero_quantized_weights"]),
    (_cfg(3, zero={"zero_hpz_partition_size": 2}), DeepSpeedConfigError,
     ["compile.deepcompile", "zero_optimization.zero_hpz_partition_size"]),
    (_cfg(3, compile={"offload_parameters": True}), NotImplementedError, ["compile.offload_parameters"]),
    (_cfg(3, compile={"offload_activation": True}), NotImplementedError, ["compile.offload_activation"]),
    (_cfg(3, compile={"symmetric_memory": True}), NotImplementedError, ["compile.symmetric_memory"]),
])
def test_refused_naming_the_key(cfg: dict, exc: type, words: list[str]) -> None:
    with pytest.raises(exc) as info:
        DeepSpeedConfig(cfg)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_torch_without_custom_ops_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.library, "custom_op")
    with pytest.raises(RuntimeError, match="compile.deepcompile.*custom_op"):
        DeepSpeedConfig(_cfg(3))
    DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3}})  # without DeepCompile: fine


def test_torch_without_compile_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(RuntimeError, match="compile.deepcompile.*torch.compile"):
        DeepSpeedConfig(_cfg(3))
