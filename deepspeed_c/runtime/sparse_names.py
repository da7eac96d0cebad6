"""DeepSpeed 0.19.6's `engine.sparse_tensor_module_names` (sparse_gradients, kept by our version policy): the
"<module>.weight" names whose gradients it exchanged as sparse rows, saved in the model-states file and, on
load, taken from the checkpoint (strict) or merged with this model's (load_module_strict=False)."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["SparseTensorNames", "KEY"]

KEY = "sparse_tensor_module_names"


class SparseTensorNames:
    """enabled: the config's sparse_gradients. With it, every Embedding / EmbeddingBag weight is named, as
    DeepSpeed's engine named them at initialize."""

    def __init__(self, module: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        self.names: set[str] = set()
        if enabled:
            self.names = {f"{n}.weight" for n, m in module.named_modules()
                          if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    def replace(self, names: Iterable[str]) -> None:
        self.names = set(names)

    def save_into(self, state: dict) -> None:
        """Written only when sparse_gradients is on: DeepSpeed up to 0.19.6 wrote it always, 0.19.8 (the layout
        the files follow otherwise) never. A sorted list, which the checkpoint store's plain-data check accepts
        where a set is not."""
        if self.enabled:
            state[KEY] = sorted(self.names)

    def restore(self, state: dict, module: torch.nn.Module, strict: bool) -> None:
        """From a model-states file holding the key (ours, or DeepSpeed 0.19.6's set; its older
        `csr_tensor_module_names` too): strict takes the saved names; otherwise a name of this model stays
        unless the saved model had that parameter dense, and a saved sparse name this model has is added."""
        saved: Optional[Iterable[str]] = state.get(KEY, state.get("csr_tensor_module_names"))
        if saved is None:
            return
        saved = set(saved)
        if strict:
            self.names = saved
            return
        saved_params = state.get("module") or {}
        own_params = dict(module.named_parameters())
        kept = {n for n in self.names if not (n in saved_params and n not in saved)}
        self.names = kept | {n for n in saved if n in own_params}
