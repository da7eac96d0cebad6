"""XTC on a tiny BERT: a 4-layer teacher is fine-tuned; the 2-layer student takes the teacher's layers 1 and 3
plus its embeddings and classifier (layer_reduction), its encoder weights become ternary {-a, 0, a} per group
(2-bit weight quantization in the forward), and it is trained with knowledge distillation from the teacher's
logits. Prints the teacher's, the layer-reduced student's before training, and the ternary student's accuracy.

    python examples/compression/xtc_ternary.py [--steps 300] [--kd-steps 200]"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from task import TinyBert, accuracy, ds_config, teacher, train  # noqa: E402

from deepspeed_c.compression import init_compression, redundancy_clean  # noqa: E402

XTC = {
    "layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layer",
                        "teacher_layer": [1, 3], "other_module_name": ["embeddings", "position", "classifier"]},
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantizer_kernel": False, "schedule_offset": 0,
                              "quantize_groups": 4, "quantize_verbose": False, "quantization_type": "symmetric",
                              "quantize_weight_in_forward": True, "rounding": "nearest",
                              "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
        "different_groups": {"wq1": {"params": {"start_bits": 2, "target_bits": 2, "quantization_period": 0},
                                     "modules": ["query", "key", "value", "dense", "intermediate", "output"]}}},
}


def run(steps: int = 300, kd_steps: int = 200, seed: int = 0, temperature: float = 2.0,
        big: Optional[torch.nn.Module] = None) -> dict[str, float]:
    """Accuracies; `big` skips training the teacher (a fine-tuned 4-layer TinyBert)."""
    big = big if big is not None else teacher(steps, layers=4, seed=seed)
    out = {"teacher_4l": accuracy(big)}
    big.eval()
    torch.manual_seed(seed + 1)
    student = TinyBert(2)
    cfg = ds_config(1e-3, XTC)
    init_compression(student, cfg, teacher_model=big)
    out["student_2l_init_ternary"] = accuracy(student)

    def kd(logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = F.softmax(big(ids) / temperature, dim=-1)
        distill = F.kl_div(F.log_softmax(logits / temperature, dim=-1), soft, reduction="batchmean")
        return distill * temperature ** 2 + F.cross_entropy(logits, labels)

    train(student, cfg, kd_steps, seed + 2, loss_fn=kd)
    out["student_2l_ternary_kd"] = accuracy(student)
    redundancy_clean(student, cfg)  # the ternary values folded into the weights
    out["student_2l_ternary_clean"] = accuracy(student)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kd-steps", type=int, default=200)
    args = ap.parse_args()
    print({k: round(v, 4) for k, v in run(args.steps, args.kd_steps).items()})
