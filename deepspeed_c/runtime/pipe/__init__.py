"""Pipeline parallelism (`deepspeed.runtime.pipe`)."""
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
