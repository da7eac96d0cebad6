"""deepspeed.ops.sparse_attention: block-sparse self-attention (DeepSpeed 0.19.6's API) on our own
fused CUDA kernels, with the dense masked torch path on CPU."""
from .sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                              FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparsityConfig,
                              VariableSparsityConfig)
from .sparse_self_attention import SparseSelfAttention
from .bert_sparse_self_attention import BertSparseSelfAttention
from .sparse_attention_utils import SparseAttentionUtils
from .config import sparsity_config_from_dict

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
           "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils", "sparsity_config_from_dict"]
from .matmul import MatMul  # noqa: E402  (DeepSpeed's building blocks, by their module paths too)
from .softmax import Softmax  # noqa: E402

__all__ += ["MatMul", "Softmax"]
