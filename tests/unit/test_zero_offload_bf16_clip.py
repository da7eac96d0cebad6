"""ZeRO-Offload (offload_optimizer cpu, stages 2 and 3) with bf16 and gradient clipping that clips every step,
through deepspeed_c.initialize in one process, against an independent single-process reference (issue 52: the
clip coefficient reaches the C CPU Adam as its grad_scale, so nothing else may scale the bf16 gradients). The model,
the run and the reference are tests/distributed/bf16_clip_models.py's (two summed head losses, a frozen submodule,
gradient accumulation 2, AdamW with eps near the clipped gradients so the clip shows in the weights);
tests/distributed/test_zero_offload_bf16_clip.py runs the same on two gloo ranks (the norm across partitions).

Compared each step: the engine's global gradient norm (the reference's, within 1e-4, and over 10x CLIP: clipping
is active), and every trainable tensor's fp32 master, norm-wise relative, below TOL. Measured here: the two
implementations of the same math differ by at most 3e-8 (fp32 Adam in C against torch's, the norm's summation
order). Breaking the step in process (the C Adam's grad_scale forced to 1, i.e. the clip skipped, or to coef**2,
the clip applied twice) moves every trainable tensor's master by at least 2e-3 (skipped) and 3e-2 (twice) within
the three steps, trunk.weight's by 2.4e-2 and 3.1e-2 after the first. TOL = 1e-4 keeps 3000x over the noise (a master
crossing a bf16 rounding boundary, say on another SIMD path, would raise it) and 20x under the smallest failure."""
from __future__ import annotations

import pytest

from tests.distributed.bf16_clip_models import check_against_reference, reference, train

pytestmark = pytest.mark.usefixtures("world_of_one")

TOL = 1e-4


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_offload_clipping_matches_reference(stage: int) -> None:
    check_against_reference(train(0, 1, stage), reference(1), TOL, f"stage {stage}")
