"""Tiny models and a tokenizer for the init_inference tests (built from configs / an in-memory vocabulary,
no downloads)."""
from __future__ import annotations

import torch

from tests.distributed import tp_models

VOCAB = tp_models.VOCAB


def make(kind: str, seed: int = 0, kv_heads: int = 2, heads: int = 4, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny model whose weights are spread wider than the configs' 0.02 init, so greedy decoding picks
    varied tokens (not one token repeated) and a wrong shard would change them."""
    model = _build(kind, seed, kv_heads, heads, vocab)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.15)
    return model


def _build(kind: str, seed: int, kv_heads: int, heads: int, vocab: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, attn_implementation="eager")
        return transformers.BertForMaskedLM(cfg).eval()
    if kind == "gpt2" and (heads != 4 or vocab != VOCAB):  # one block; `vocab` not a multiple of the TP size
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=heads, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if kind == "t5":
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                                    dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return transformers.T5ForConditionalGeneration(cfg).eval()
    if kind == "llama":
        return tp_models.make_model("llama", seed=seed, kv_heads=kv_heads).eval()
    return tp_models.make_model(kind, seed=seed).eval()


def tokenizer() -> object:
    """A word-level tokenizer over the words w0..w63 (id i is "wi"), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", pad_token="w0", eos_token="w0")


def dequantized_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The model with each block Linear/Conv1D weight rounded to int8 levels per output channel (float64
    math), then run in fp16: what weight-only int8 must compute."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if module is head:
                continue
            conv1d = type(module).__name__ == "Conv1D"
            if not (isinstance(module, torch.nn.Linear) or conv1d):
                continue
            w = module.weight.double()
            absmax = w.abs().amax(dim=0 if conv1d else 1, keepdim=True)
            scale = absmax / 127
            module.weight.copy_((torch.round(w / scale).clamp(-127, 127) * scale).float())
    return model.half()


class Attn(torch.nn.Module):
    """An attention AutoTP does not know by name: q, k, v, out_proj; 4 heads of 4 read off the shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out_proj = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(*t.shape[:-1], -1, 4).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        o = (torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v).transpose(1, 2)
        return self.out_proj(o.reshape(*o.shape[:2], -1))


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


class Block(torch.nn.Module):
    """The README's unknown block: injection_policy={Block: ('attn.out_proj', 'mlp.down_proj')}."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attn(), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class MoENet(torch.nn.Module):
    """Embedding -> one deepspeed.moe.layer.MoE (all experts local, no token dropping) -> head; the experts'
    weights spread so that each differs from the others."""

    def __init__(self, experts: int, residual: bool = False, seed: int = 1) -> None:
        from deepspeed_c.moe.layer import MoE

        super().__init__()
        torch.manual_seed(seed)
        expert = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16))
        self.emb = torch.nn.Embedding(23, 16)
        self.moe = MoE(16, expert, num_experts=experts, k=1, use_residual=residual, drop_tokens=False, use_rts=False)
        self.head = torch.nn.Linear(16, 23)
        with torch.no_grad():
            for p in self.moe.parameters():
                p.add_(torch.randn(p.shape) * 0.3)
        self.eval()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(x + self.moe(x)[0])
