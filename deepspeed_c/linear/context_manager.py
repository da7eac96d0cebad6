"""deepspeed.linear.Init: build a model with every nn.Linear made by OptimizedLinear (LoRA adapters created
later by init_lora, after the weights are loaded), and init_lora itself."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from deepspeed_c.utils import logger
from .config import LoRAConfig, QuantizationConfig
from .optimized_linear import LoRAOptimizedLinear, OptimizedLinear


def init_lora(model: torch.nn.Module) -> None:
    """Freeze the whole model, then build the adapters of every LoRAOptimizedLinear in it (trainable)."""
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRAOptimizedLinear):
            module.init_lora()


def _loaded_transformers() -> Any:
    # only a transformers the caller already imported can be the one building the model; importing it here
    # would cost seconds for every user of Init
    return sys.modules.get("transformers")


class Init:
    """Context manager: inside it, `torch.nn.Linear(...)` builds OptimizedLinear(..., lora_config,
    quant_config) with LoRA initialisation delayed (the config's delay_lora_init is set). Models made by
    transformers' AutoModelForCausalLM.from_pretrained / from_config inside it get init_lora applied;
    others need `init_lora(model)` afterwards.

        with deepspeed.linear.Init(lora_config=LoRAConfig(...), quant_config=QuantizationConfig(...)):
            model = AutoModelForCausalLM.from_pretrained(name)
    """

    def __init__(self, lora_config: Optional[LoRAConfig] = None,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        self.lora_config, self.quant_config = lora_config, quant_config
        self._orig_nn_linear = torch.nn.Linear
        self._patched_auto: Optional[tuple[Any, Any, Any]] = None
        self._post_init_complete = False

    def _linear_factory(self) -> type:
        orig, lora, quant = self._orig_nn_linear, self.lora_config, self.quant_config

        class OptLinearWrapper:
            _orig_nn_linear = orig

            def __new__(cls, *args: Any, **kwargs: Any) -> torch.nn.Module:
                if lora is not None:
                    lora.delay_lora_init = True
                kwargs.update(lora_config=lora, quantization_config=quant, linear_cls=orig)
                return OptimizedLinear(*args, **kwargs)

        return OptLinearWrapper

    def _model_init(self, model: Any) -> Any:
        if self.lora_config is not None:
            init_lora(model)
        self._post_init_complete = True
        return model

    def __enter__(self) -> "Init":
        torch.nn.Linear = self._linear_factory()
        transformers = _loaded_transformers()
        if transformers is not None and hasattr(transformers, "AutoModelForCausalLM"):
            auto = transformers.AutoModelForCausalLM
            orig_pretrained, orig_config = auto.from_pretrained, auto.from_config
            self._patched_auto = (auto, orig_pretrained, orig_config)
            auto.from_pretrained = lambda *a, **k: self._model_init(orig_pretrained(*a, **k))
            auto.from_config = lambda *a, **k: self._model_init(orig_config(*a, **k))
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.nn.Linear = self._orig_nn_linear
        if self._patched_auto is not None:
            auto, orig_pretrained, orig_config = self._patched_auto
            auto.from_pretrained, auto.from_config = orig_pretrained, orig_config
            self._patched_auto = None
        if not self._post_init_complete and self.lora_config is not None:
            logger.warning("deepspeed.linear.Init: LoRA adapters were not initialised (done automatically only for "
                           "transformers' AutoModelForCausalLM.from_pretrained/from_config); call "
                           "deepspeed.linear.init_lora(model) before training")
