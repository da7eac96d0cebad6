"""The registry of op builders. Each op adds one import line below."""
from __future__ import annotations

from .builder import OpBuilder
from .utils import UtilsBuilder

# --- one import line per op (keep sorted by file) ---
from .async_io import AsyncIOBuilder, GDSBuilder
from .compress_quant import CompressQuantBuilder, CompressQuantCUDABuilder
from .cpu_adagrad import CPUAdagradBuilder
from .cpu_adam import CPUAdamBuilder
from .cpu_lion import CPULionBuilder
from .cpu_multi_tensor import CPUMultiTensorBuilder
from .evoformer_attn import EvoformerAttnBuilder
from .fp_quantizer import FPQuantizerBuilder
from .fused_adam import FusedAdamBuilder
from .fused_lamb import FusedLambBuilder
from .fused_lion import FusedLionBuilder
from .moe_gating import MoEGatingBuilder, MoEGatingCUDABuilder
from .multi_tensor import MultiTensorOpsBuilder
from .onebit import OnebitBuilder, OnebitCUDABuilder
from .quantizer import QuantizerBuilder, QuantizerCUDABuilder
from .sparse_attn import SparseAttnBuilder
from .transformer import TransformerBuilder
from .random_ltd import RandomLTDBuilder, RandomLTDCUDABuilder
from .transformer_inference import InferenceBuilder
from .zenflow_columns import ZenFlowColumnsBuilder

__all__ = [name for name, obj in dict(globals()).items()
           if isinstance(obj, type) and issubclass(obj, OpBuilder) and obj.NAME]

ALL_OPS: dict[str, type[OpBuilder]] = {globals()[name].NAME: globals()[name] for name in __all__}


def get_builder(name: str) -> type[OpBuilder]:
    try:
        return ALL_OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {sorted(ALL_OPS)}") from None
