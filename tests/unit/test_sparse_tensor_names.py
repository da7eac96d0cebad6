"""`engine.sparse_tensor_module_names` (DeepSpeed 0.19.6, which our sparse_gradients follows): with
sparse_gradients on, "<module>.weight" of every Embedding / EmbeddingBag; empty otherwise; the same after a
checkpoint round trip (DeepSpeed's checkpoint tests compare it between the saving and the loading engine)."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c

pytestmark = pytest.mark.usefixtures("world_of_one")


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.inner = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum"))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1) + self.inner[0](ids))


def _engine(sparse: bool):
    torch.manual_seed(0)
    model = _Model()
    config = {"train_micro_batch_size_per_gpu": 2, "sparse_gradients": sparse,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True}
    return deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def test_names_follow_deepspeed_0_19_6_and_survive_a_checkpoint(tmp_path):
    engine = _engine(True)
    assert engine.sparse_tensor_module_names == {"emb.weight", "inner.0.weight"}
    ids = torch.tensor([[1, 2, 3], [4, 5, 1]], device=engine.module.emb.weight.device)
    loss = engine(ids).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    loaded = _engine(True)
    loaded.load_checkpoint(str(tmp_path), tag="t")
    assert loaded.sparse_tensor_module_names == engine.sparse_tensor_module_names
    assert torch.equal(loaded.module.emb.weight, engine.module.emb.weight)
    assert _engine(False).sparse_tensor_module_names == set()


class _Dense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 2)


def _plain(model: torch.nn.Module, sparse: bool):
    config = {"train_micro_batch_size_per_gpu": 2, "sparse_gradients": sparse}
    return deepspeed_c.initialize(model=model, config=config)[0]


@pytest.mark.parametrize("saved_sparse,loaded_sparse", [(True, False), (False, True), (True, True)])
def test_non_strict_load_merges_as_deepspeed_0_19_6(tmp_path, saved_sparse, loaded_sparse):
    """Without strict loading DeepSpeed keeps a name of the loading model unless the saved model had that
    parameter dense, and adds the saved names the loading model has; strict takes the saved set. One
    difference: a checkpoint saved without sparse_gradients holds no names (0.19.8's layout), so the loading
    engine keeps its own where DeepSpeed 0.19.6 would have read an empty set and turned them off."""
    saver = _plain(_Dense(), saved_sparse)
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = _plain(_Dense(), loaded_sparse)
    loader.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False, load_optimizer_states=False,
                           load_lr_scheduler_states=False)
    want = {"emb.weight"} if saved_sparse or loaded_sparse else set()
    assert loader.sparse_tensor_module_names == want
    strict = _plain(_Dense(), loaded_sparse)
    strict.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)
    assert strict.sparse_tensor_module_names == want
