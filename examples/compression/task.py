"""A tiny BERT-style classifier and a synthetic task for the compression examples (CPU, seconds).

Task: sequences of SEQ tokens from VOCAB; three classes: token 3 occurs less often than, as often as, or more
often than token 5. The
model: token + position embeddings, `layers` post-LN transformer blocks (query / key / value / dense attention,
intermediate / output feed-forward), classifier on the first position. Module names follow HF BERT's leaves
(`layer.<i>.query`, ...), so compression configs written for BERT read the same way."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

import deepspeed_c

VOCAB, SEQ, HIDDEN, HEADS, INTER = 16, 12, 32, 4, 64


class Block(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.intermediate, self.output = nn.Linear(HIDDEN, INTER), nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, HEADS, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
        x = self.ln1(x + self.dense((att @ v).transpose(1, 2).reshape(b, s, -1)))
        return self.ln2(x + self.output(torch.nn.functional.gelu(self.intermediate(x))))


class TinyBert(nn.Module):

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ, HIDDEN)
        self.layer = nn.ModuleList(Block() for _ in range(layers))
        self.classifier = nn.Linear(HIDDEN, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids) + self.position.weight[: ids.size(1)]
        for block in self.layer:
            x = block(x)
        return self.classifier(x[:, 0])


def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return ids, torch.sign((ids == 3).sum(1) - (ids == 5).sum(1)).long() + 1


def accuracy(model: nn.Module, n: int = 2000, seed: int = 123) -> float:
    ids, labels = batch(n, torch.Generator().manual_seed(seed))
    was = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(ids).argmax(-1) == labels).float().mean().item()
    model.train(was)
    return acc


def ds_config(lr: float, compression: Optional[dict] = None, batch_size: int = 64) -> dict:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": batch_size, "gradient_clipping": 1.0,
                           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
                           "steps_per_print": 10 ** 9}
    if compression:
        cfg["compression_training"] = compression
    return cfg


def train(model: nn.Module, config: dict, steps: int, seed: int,
          loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> nn.Module:
    """`steps` engine steps on fresh batches; loss_fn(logits, labels, ids) defaults to cross entropy."""
    engine, *_ = deepspeed_c.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(seed)
    try:
        for _ in range(steps):
            ids, labels = batch(config["train_micro_batch_size_per_gpu"], g)
            logits = engine(ids)
            loss = loss_fn(logits, labels, ids) if loss_fn else torch.nn.functional.cross_entropy(logits, labels)
            engine.backward(loss)
            engine.step()
    finally:
        engine.destroy()
    return model


def teacher(steps: int = 300, layers: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return train(TinyBert(layers), ds_config(3e-3), steps, seed)
