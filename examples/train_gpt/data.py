"""Character-level data: a vocabulary built from the text, and fixed-length windows of it."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int) -> None:
        if len(text) <= block_size + 1:
            raise ValueError(f"the text has {len(text)} characters; it needs more than block_size + 1 = "
                             f"{block_size + 1}")
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i:i + self.block_size + 1]
        return chunk[:-1], chunk[1:]
