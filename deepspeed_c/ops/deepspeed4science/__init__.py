"""deepspeed.ops.deepspeed4science: DS4Sci EvoformerAttention."""
from deepspeed_c.ops.deepspeed4science.evoformer_attn import (  # noqa: F401
    DS4Sci_EvoformerAttention, EvoformerFusedAttention)

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerFusedAttention"]
