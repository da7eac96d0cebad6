"""random-LTD's token sampling and gather/scatter (DeepSpeed's deepspeed.ops.random_ltd)."""
from deepspeed_c.ops.random_ltd.dropping_utils import (GatherTokens, ScatterTokens, bert_sample_tokens,
                                                       gpt_sample_tokens, token_gather, token_scatter)

__all__ = ["gpt_sample_tokens", "bert_sample_tokens", "GatherTokens", "ScatterTokens", "token_gather",
           "token_scatter"]
