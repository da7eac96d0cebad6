"""ZenFlow at ZeRO stage 3 (DeepSpeed's `deepspeed.runtime.zenflow.engine_stage3`): the stage 3 optimizer with
ZenFlowStep. Stage 3 cuts its partitions by module units, so a matrix's slices on a rank are whole stretches
of it as on stages 1/2 and the same column selection applies; the updated partition goes into this rank's
shard instead of an all-gather (the next forward gathers what it uses)."""
from __future__ import annotations

from deepspeed_c.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowMixin
from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3


class ZenFlowZeroOptimizer_Stage3(ZenFlowMixin, DeepSpeedZeroOptimizer_Stage3):  # noqa: N801
    """ZeRO stage 3 with ZenFlow."""
