import os
import subprocess
import sys

import pytest
import torch

from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.accelerator import real_accelerator
from deepspeed_c.accelerator.cpu_accelerator import CPU_Accelerator


def test_default_matches_torch_and_interface_works():
    acc = get_accelerator()
    assert acc.device_name() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert acc.communication_backend_name() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert torch.float32 in acc.supported_dtypes()
    assert acc.total_memory() >= acc.available_memory() > 0
    t = torch.zeros(4, device=acc.device_name())
    assert acc.on_accelerator(t)
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    (t + 1).sum().item()
    end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0
    assert acc.get_op_builder("UtilsBuilder").NAME == "utils"
    assert acc.create_op_builder("NoSuchBuilder") is None


def test_cpu_accelerator_contract():
    acc = CPU_Accelerator()
    assert acc.device_name(3) == "cpu" and acc.device() == torch.device("cpu")
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    with acc.stream(acc.Stream()):
        pass
    ev = acc.Event()
    with pytest.raises(RuntimeError, match="recorded"):
        ev.elapsed_time(acc.Event())
    # DeepSpeed 0.19.8's queries that inference and pinned-buffer code asks of any accelerator
    assert acc.is_triton_supported() is False and acc.prefer_triton_grouped_mm() is False
    assert acc.is_fp64_supported() is True and acc.is_current_stream_capturing() is False
    assert acc.supports_nvtx_domain is False and acc.pin_memory_alignment() == 1
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        pass
    acc.replay_graph(graph)
    buf = acc.pin_empty(2, 3, dtype=torch.bfloat16)
    assert buf.shape == (2, 3) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    like = acc.pin_empty_like(buf, dtype=torch.float32)
    assert like.shape == (2, 3) and like.dtype == torch.float32
    with pytest.raises(ValueError, match="device"):
        acc.pin_empty((2,), dtype=torch.float32, device="meta")
    assert acc.memory_cached() > 0 and acc.max_memory_cached() > 0
    assert acc.get_rss() > 0 and acc.reset_rss() > 0


@pytest.mark.parametrize("value,ok", [("cpu", True), ("tpu", False)])
def test_ds_accelerator_override(value, ok):
    code = "from deepspeed_c.accelerator import get_accelerator; print(get_accelerator().device_name())"
    env = dict(os.environ, DS_ACCELERATOR=value)
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == value
    else:
        assert proc.returncode != 0 and "DS_ACCELERATOR must be one of ['cpu', 'cuda'], got 'tpu'" in proc.stderr


def test_set_accelerator_replaces_the_choice():
    saved = real_accelerator._accelerator
    try:
        mine = CPU_Accelerator()
        real_accelerator.set_accelerator(mine)
        assert get_accelerator() is mine
    finally:
        real_accelerator._accelerator = saved
