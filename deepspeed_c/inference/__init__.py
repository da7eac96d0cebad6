"""deepspeed.inference: init_inference's engine and config (AutoTP inference, kernel injection)."""
from deepspeed_c._lazy import lazy_exports

__all__ = ["InferenceEngine", "DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "init_inference"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "InferenceEngine": "deepspeed_c.inference.engine:InferenceEngine",
    "DeepSpeedInferenceConfig": "deepspeed_c.inference.config:DeepSpeedInferenceConfig",
    "DeepSpeedTPConfig": "deepspeed_c.inference.config:DeepSpeedTPConfig",
    "init_inference": "deepspeed_c.inference.api:init_inference",
    "config": "deepspeed_c.inference.config",
    "engine": "deepspeed_c.inference.engine",
})
