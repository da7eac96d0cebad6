"""ZeRO-Offload with bf16 and gradient clipping on two gloo ranks, stages 2 and 3 in one launch: each rank steps
its own partition of the fp32 masters, so the clip coefficient must come from the norm of the whole reduced
gradient (an all-reduce of the partitions' squares) and reach both ranks' C CPU Adam. The model, the run and the
reference (which sums the two ranks' bf16 gradients and averages them in bf16, as the reduce-scatter does) are
tests/distributed/bf16_clip_models.py's; tests/unit/test_zero_offload_bf16_clip.py has the one-process case and
the tolerance's figures. Here too the two implementations differ by 3e-8 at most; broken in process, the clip
skipped or applied twice moves every master by at least 1e-2, and a coefficient from each rank's own partition's
norm (no all-reduce) by at least 1.7e-3, its norm failing first."""
from __future__ import annotations

from typing import Any

from tests.distributed.bf16_clip_models import check_against_reference, reference, train
from tests.harness import run_distributed

TOL = 1e-4


def _body(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: train(rank, world, stage) for stage in (2, 3)}


def test_bf16_offload_clipping_two_ranks_matches_reference() -> None:
    want = reference(2)
    # gloo named: the bf16 model stays in host memory, where the reference's bf16 arithmetic is the engine's
    for rank, by_stage in enumerate(run_distributed(_body, 2, timeout=240, backend="gloo")):
        for stage, got in by_stage.items():
            check_against_reference(got, want, TOL, f"rank {rank} stage {stage}")
