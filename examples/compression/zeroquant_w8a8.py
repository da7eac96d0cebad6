"""ZeroQuant-style W8A8 on a tiny BERT: fine-tune a model, then quantization-aware fine-tune it with 8-bit
symmetric per-group weights (fake-quantized in the forward) and 8-bit token-wise dynamic asymmetric activations
on every Linear of the encoder, fold the weights with redundancy_clean, and compare accuracies.

    python examples/compression/zeroquant_w8a8.py [--steps 300] [--qat-steps 60]"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from task import accuracy, ds_config, teacher, train  # noqa: E402

from deepspeed_c.compression import init_compression, redundancy_clean  # noqa: E402

ENCODER = ["query", "key", "value", "dense", "intermediate", "output"]
W8A8 = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantizer_kernel": False, "schedule_offset": 0,
                              "quantize_groups": 8, "quantize_verbose": False, "quantization_type": "symmetric",
                              "quantize_weight_in_forward": True, "rounding": "nearest",
                              "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                                     "modules": ENCODER}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "asymmetric", "range_calibration": "dynamic",
                              "schedule_offset": 0},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ENCODER}}},
}


def run(steps: int = 300, qat_steps: int = 60, seed: int = 0,
        base: Optional[torch.nn.Module] = None) -> dict[str, float]:
    """Accuracies; `base` skips training the fp32 model (a fine-tuned TinyBert to start from)."""
    base = base if base is not None else teacher(steps, layers=2, seed=seed)
    out = {"fp32": accuracy(base)}
    student = copy.deepcopy(base)
    cfg = ds_config(5e-4, W8A8)
    init_compression(student, cfg)
    train(student, cfg, qat_steps, seed + 1)
    out["w8a8_qat"] = accuracy(student)
    redundancy_clean(student, cfg)
    out["w8a8_clean"] = accuracy(student)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--qat-steps", type=int, default=60)
    args = ap.parse_args()
    print({k: round(v, 4) for k, v in run(args.steps, args.qat_steps).items()})
