"""Shared pieces of the ALST tests: a tiny LLaMA built from a transformers config (no downloads), each
rank's deterministic batches, and the single-process reference (eager attention, whole sequences)."""
from __future__ import annotations

import types

import torch

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, BATCH = 32, 16, 32, 2, 4, 2, 2
PROMPT = 3  # the first tokens of every sample are prompt: label -100 (the loss weights good tokens only)


def llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.get_default_dtype())


def batch(rank: int, j: int) -> dict:
    """Rank `rank`'s j-th batch: lengths alternate 16 / 8 (variable lengths, multiples of 4)."""
    g = torch.Generator().manual_seed(1000 * rank + j)
    seq = 16 if j % 2 == 0 else 8
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(BATCH, seq).clone(), "labels": labels}


def replica_batch(step: int, replica: int, sp: int) -> dict:
    """What data-parallel replica `replica` trains on at `step` through UlyssesSPDataLoaderAdapter: the
    adapter gives the group the batch of its sp-rank (step % sp), whose DataLoader is at step // sp."""
    return batch(replica * sp + step % sp, step // sp)


def reference(steps: int, dp: int, sp: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """One process, whole sequences, eager attention: each step's loss is the mean over the replicas of
    their mean loss over good (non -100, shifted) tokens; plain SGD, so gradient scale shows in the weights."""
    model = llama("eager")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t in range(steps):
        total = 0.0
        for d in range(dp):
            b = replica_batch(t, d, sp)
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            target = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # float64 throughout
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
            (loss / dp).backward()
            total += loss.item() / dp
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()]


def tile_mlps(model: torch.nn.Module, shards: int) -> None:
    """ALST's TiledMLP on every LlamaMLP instance of `model` (per instance, not the class)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from deepspeed_c.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled(self, x):
        return TiledMLP.apply(mlp_forward, self, x, shards, [p for p in self.parameters()])

    for m in model.modules():
        if isinstance(m, LlamaMLP):
            m.forward = types.MethodType(tiled, m)
