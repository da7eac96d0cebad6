"""The compression scheduler: switches each technique on in its groups' layers once the training step
reaches the technique's schedule_offset (sparse pruning: within [schedule_offset, schedule_offset_end]).
The engine calls step() after every applied optimizer step and step(step_zero_check=True) before the
first forward (DeepSpeed's `compression_scheduler`, same name)."""
from __future__ import annotations

from typing import Any

import torch

from deepspeed_c.compression import constants as C
from deepspeed_c.compression.compress import get_module_name
from deepspeed_c.compression.helper import recursive_getattr
from deepspeed_c.utils.logging import logger

# technique -> the layer flag it sets
_FLAGS = {C.WEIGHT_QUANTIZATION: "weight_quantization_enabled",
          C.ACTIVATION_QUANTIZATION: "activation_quantization_enabled",
          C.SPARSE_PRUNING: "sparse_pruning_enabled", C.HEAD_PRUNING: "head_pruning_enabled",
          C.ROW_PRUNING: "row_pruning_enabled", C.CHANNEL_PRUNING: "channel_pruning_enabled"}


class compression_scheduler:  # noqa: N801 - DeepSpeed's name

    def __init__(self, model: torch.nn.Module, compression_config: dict) -> None:
        self.model = model
        self.compression_config = compression_config
        self.make_init()
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.verbose = {t: False for t in _FLAGS}

    def make_init(self) -> None:
        self.different_compression_methods: dict[str, dict[str, Any]] = {}
        for method, content in self.compression_config.items():
            if method == C.LAYER_REDUCTION:
                continue
            shared = content[C.SHARED_PARAMETERS]
            groups, taken = [], set()
            for group_name, params in content[C.DIFFERENT_GROUPS].items():
                names: list[str] = []
                for key_word in params[C.DIFFERENT_GROUPS_MODULE_SCOPE]:
                    found, taken = get_module_name(group_name, self.model, key_word, taken, verbose=False)
                    names.extend(found)
                if names:
                    groups.append([group_name, names, dict(params[C.DIFFERENT_GROUPS_PARAMETERS])])
            self.different_compression_methods[method] = {C.TECHNIQUE_ENABLED: shared[C.TECHNIQUE_ENABLED],
                                                          C.SHARED_PARAMETERS: shared, C.DIFFERENT_GROUPS: groups}

    def _due(self, method: str) -> bool:
        shared = self.different_compression_methods[method][C.SHARED_PARAMETERS]
        start = shared[C.TECHNIQUE_SCHEDULE_OFFSET]
        if method == C.SPARSE_PRUNING:
            return start <= self.training_steps <= shared[C.TECHNIQUE_SCHEDULE_OFFSET_END]
        return self.training_steps >= start

    def _check(self, method: str) -> None:
        entry = self.different_compression_methods[method]
        if not entry[C.TECHNIQUE_ENABLED] or not self._due(method):
            return
        for _, names, _ in entry[C.DIFFERENT_GROUPS]:
            for name in names:
                setattr(recursive_getattr(self.model, name), _FLAGS[method], True)
        if not self.verbose[method]:
            logger.info(f"{method.replace('_', ' ').capitalize()} is enabled at step {self.training_steps}")
            self.verbose[method] = True
            if method == C.WEIGHT_QUANTIZATION:
                self.weight_quantization_enabled = True

    def check_weight_quantization(self) -> None:
        self._check(C.WEIGHT_QUANTIZATION)

    def check_activation_quantization(self) -> None:
        self._check(C.ACTIVATION_QUANTIZATION)

    def check_sparse_pruning(self) -> None:
        self._check(C.SPARSE_PRUNING)

    def check_head_pruning(self) -> None:
        self._check(C.HEAD_PRUNING)

    def check_row_pruning(self) -> None:
        self._check(C.ROW_PRUNING)

    def check_channel_pruning(self) -> None:
        self._check(C.CHANNEL_PRUNING)

    def check_all_modules(self) -> None:
        for method in _FLAGS:
            self._check(method)

    def step(self, step_zero_check: bool = False) -> None:
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()
