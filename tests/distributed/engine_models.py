"""Small models and data shared by the engine tests (importable by spawned ranks)."""
from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 24, d_out: int = 3) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.Tanh(), torch.nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 17, d_model: int = 16, seq: int = 6, d_out: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq, d_model) * 0.1)
        self.block = torch.nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0,
                                                      batch_first=True)
        # The key part of this bias has an exactly-zero gradient in exact arithmetic (softmax ignores a
        # constant added to every key); Adam would turn rounding noise there into full-size steps that
        # no two implementations share. Frozen, it also puts a frozen parameter in the parity runs.
        self.block.self_attn.in_proj_bias.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, d_out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(tokens) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


def make_model(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = MLP() if kind == "mlp" else TinyTransformer()
    return model.to(dtype)


def make_batches(kind: str, steps: int, micro_global: int, seed: int, dtype: torch.dtype = torch.float32):
    """steps lists of (x, y) global micro-batches of micro_global samples, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "mlp":
            x = torch.randn(micro_global, 12, generator=g, dtype=torch.float64).to(dtype)
        else:
            x = torch.randint(0, 17, (micro_global, 6), generator=g)
        y = torch.randn(micro_global, 3, generator=g, dtype=torch.float64).to(dtype)
        out.append((x, y))
    return out


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)
