"""`deepspeed.pipe`: PipelineModule, LayerSpec, TiedLayerSpec and the topologies."""
from deepspeed_c.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed_c.runtime.pipe.topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                               PipeModelDataParallelTopology, ProcessTopology)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid"]
