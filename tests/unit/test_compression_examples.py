"""The compression examples end to end on their synthetic task (examples/compression/): one 4-layer fp32
fine-tune, then ZeroQuant W8A8 quantization-aware fine-tuning of it and XTC (layer reduction 4 -> 2 from the
teacher, ternary weights, knowledge distillation). Tolerances: W8A8 within 2 points of the fp32 model, the
ternary 2-layer student within 5 points of its 4-layer teacher (both before and after redundancy_clean); the
layer-reduced ternary student before training must be clearly worse, or the test would prove nothing.
Measured on this task: full-length runs of the scripts fp32 1.000 -> W8A8 1.000, teacher 0.995 -> XTC 0.9995;
this test's short runs (100 / 20 / 60 steps) fp32 0.9985 -> W8A8 0.998, ternary student 0.639 before KD -> 0.9905."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "examples" / "compression"


def _load(name: str):
    import sys

    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(f"compression_example_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zeroquant_and_xtc_recover_the_fp32_accuracy():
    task, zq, xtc = _load("task"), _load("zeroquant_w8a8"), _load("xtc_ternary")
    big = task.teacher(steps=100, layers=4, seed=0)
    base = task.accuracy(big)
    assert base > 0.9, base
    w8a8 = zq.run(qat_steps=20, base=copy.deepcopy(big))
    assert w8a8["fp32"] == base
    assert w8a8["w8a8_qat"] >= base - 0.02 and w8a8["w8a8_clean"] >= base - 0.02, w8a8
    ternary = xtc.run(kd_steps=60, big=big)
    assert ternary["student_2l_init_ternary"] < base - 0.15, ternary
    assert ternary["student_2l_ternary_kd"] >= base - 0.05, ternary
    assert ternary["student_2l_ternary_clean"] >= base - 0.05, ternary
