"""DeepSpeedTransformerLayer on the host (the torch forms of the fused pieces; the CUDA kernels are
checked against them on a GPU by .devrun/gpu_41.sh): outputs and every gradient equal Hugging Face's
BertLayer with the same weights (post-LN) and a float64 functional pre-LN layer; each memory flag
gives the same numbers; a swapped-in BertModel trains the same; bad input is refused by name."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import BertConfig  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer, BertModel  # noqa: E402

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: E402
from deepspeed_c.ops.transformer.hf_bert import layer_from_bert, replace_hf_bert_layers  # noqa: E402
from deepspeed_c.ops.transformer.transformer_function import WEIGHT_NAMES  # noqa: E402

HID, HEADS, INTER = 32, 4, 64


def bert_config(**kw) -> BertConfig:
    cfg = BertConfig(hidden_size=HID, num_attention_heads=HEADS, intermediate_size=INTER, num_hidden_layers=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=50,
                     max_position_embeddings=64, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def ds_config(pre_ln: bool, **kw) -> DeepSpeedTransformerConfig:
    base = dict(batch_size=3, hidden_size=HID, intermediate_size=INTER, heads=HEADS, attn_dropout_ratio=0.0,
                hidden_dropout_ratio=0.0, num_hidden_layers=2, initializer_range=0.02, pre_layer_norm=pre_ln)
    base.update(kw)
    return DeepSpeedTransformerConfig(**base)


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))


def additive_mask(B: int, S: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, 0] = True
    return (~keep).to(dtype)[:, None, None, :] * torch.finfo(dtype).min


def run(layer, x, mask, d_out):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, mask)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(d_out)
    return out.detach(), x.grad


def ds_grads(layer) -> dict[str, torch.Tensor]:
    return {n: getattr(layer, n).grad for n in WEIGHT_NAMES}


def hf_grads(hf: BertLayer) -> dict[str, torch.Tensor]:
    s, a = hf.attention.self, hf.attention.output
    return {"attn_qkvw": torch.cat([s.query.weight.grad, s.key.weight.grad, s.value.weight.grad]),
            "attn_qkvb": torch.cat([s.query.bias.grad, s.key.bias.grad, s.value.bias.grad]),
            "attn_ow": a.dense.weight.grad, "attn_ob": a.dense.bias.grad, "attn_nw": a.LayerNorm.weight.grad,
            "attn_nb": a.LayerNorm.bias.grad, "inter_w": hf.intermediate.dense.weight.grad,
            "inter_b": hf.intermediate.dense.bias.grad, "output_w": hf.output.dense.weight.grad,
            "output_b": hf.output.dense.bias.grad, "norm_w": hf.output.LayerNorm.weight.grad,
            "norm_b": hf.output.LayerNorm.bias.grad}


@pytest.mark.parametrize("S,masked", [(7, True), (13, False), (16, True)])
def test_post_ln_equals_hf_bert_layer(S, masked):
    torch.manual_seed(0)
    hf = BertLayer(bert_config())
    randomize(hf, S)
    ours = layer_from_bert(hf, ds_config(False))
    B = 3
    x = torch.randn(B, S, HID)
    d_out = torch.randn(B, S, HID)
    mask = additive_mask(B, S, S) if masked else None
    want, want_dx = run(hf, x, mask, d_out)
    got, got_dx = run(ours, x, mask, d_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-5)
    for name, g in hf_grads(hf).items():
        torch.testing.assert_close(ds_grads(ours)[name], g, rtol=1e-4, atol=1e-5, msg=name)


def pre_ln_reference(x, mask, w, heads, eps):
    """The pre-LN layer written out in float64: LN(norm) -> attention -> residual -> LN(attn_n) ->
    FFN -> residual (no final norm), DeepSpeed's pre_layer_norm=True."""
    B, S, H = x.shape
    d = H // heads
    h0 = F.layer_norm(x, (H,), w["norm_w"], w["norm_b"], eps)
    q, k, v = F.linear(h0, w["attn_qkvw"], w["attn_qkvb"]).view(B, S, 3, heads, d).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) / d ** 0.5
    if mask is not None:
        s = s + mask
    ctx = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, S, H)
    r1 = x + F.linear(ctx, w["attn_ow"], w["attn_ob"])
    h1 = F.layer_norm(r1, (H,), w["attn_nw"], w["attn_nb"], eps)
    return r1 + F.linear(F.gelu(F.linear(h1, w["inter_w"], w["inter_b"])), w["output_w"], w["output_b"])


@pytest.mark.parametrize("S,dtype,tol", [(5, torch.float64, 1e-10), (11, torch.float64, 1e-10),
                                         (11, torch.float32, 2e-4)])
def test_pre_ln_equals_float64_reference(S, dtype, tol):
    torch.manual_seed(1)
    ours = DeepSpeedTransformerLayer(ds_config(True))
    randomize(ours, 10 + S)
    ours.to(dtype)
    B = 2
    x, d_out = torch.randn(B, S, HID, dtype=dtype), torch.randn(B, S, HID, dtype=dtype)
    mask = additive_mask(B, S, S, dtype)
    got, got_dx = run(ours, x, mask, d_out)
    w = {n: getattr(ours, n).detach().double().requires_grad_(True) for n in WEIGHT_NAMES}
    x64 = x.double().requires_grad_(True)
    want = pre_ln_reference(x64, mask.double(), w, HEADS, 1e-12)
    want.backward(d_out.double())
    scale = want.detach().abs().max()  # tolerances relative to each tensor's size
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol * scale)
    torch.testing.assert_close(got_dx.double(), x64.grad, rtol=tol, atol=tol * x64.grad.abs().max())
    for name in WEIGHT_NAMES:
        ref = w[name].grad
        torch.testing.assert_close(getattr(ours, name).grad.double(), ref, rtol=tol, atol=tol * ref.abs().max(),
                                   msg=name)


FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


@pytest.mark.parametrize("pre_ln", [False, True])
def test_memory_flags_give_the_same_numbers(pre_ln):
    """Every combination of the flags, with dropout on (same seed: same masks), equals the plain run."""
    B, S = 2, 9
    x, d_out = torch.randn(B, S, HID), torch.randn(B, S, HID)
    mask = additive_mask(B, S, 3)
    results = {}
    for combo in itertools.product([False, True], repeat=3):
        torch.manual_seed(5)
        layer = DeepSpeedTransformerLayer(ds_config(pre_ln, attn_dropout_ratio=0.2, hidden_dropout_ratio=0.1, seed=7,
                                                    **dict(zip(FLAGS, combo))))
        layer.config.layer_id = 0  # the dropout generator is seeded with seed + layer_id
        randomize(layer, 4)
        out, dx = run(layer, x, mask, d_out)
        results[combo] = (out, dx, ds_grads(layer))
    base = results[(False, False, False)]

    def close(a, b, msg):  # float32 rounding relative to the tensor's size (invertible divides by gamma)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=msg)

    for combo, (out, dx, grads) in results.items():
        close(out, base[0], str(combo))
        close(dx, base[1], str(combo))
        for name in WEIGHT_NAMES:
            close(grads[name], base[2][name], f"{combo} {name}")
    # dropout was on: the same layer in eval mode gives other numbers
    layer.eval()
    assert not torch.allclose(layer(x, mask), base[0])


def test_hf_bert_model_swapped_trains_the_same():
    torch.manual_seed(2)
    hf = BertModel(bert_config(), add_pooling_layer=False)
    randomize(hf.encoder, 3)
    ours = replace_hf_bert_layers(copy.deepcopy(hf), gelu_checkpoint=True)
    assert all(isinstance(layer, DeepSpeedTransformerLayer) for layer in ours.encoder.layer)
    assert all(layer.config.gelu_checkpoint for layer in ours.encoder.layer)
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, 6:] = 0  # padding: BertModel hands the layers its extended mask
    want = hf(input_ids=ids, attention_mask=am).last_hidden_state
    got = ours(input_ids=ids, attention_mask=am).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    for a, b in ((ours.embeddings.word_embeddings.weight.grad, hf.embeddings.word_embeddings.weight.grad),
                 (ours.encoder.layer[0].attn_qkvw.grad, hf_grads(hf.encoder.layer[0])["attn_qkvw"])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_state_dict_is_deepspeeds():
    layer = DeepSpeedTransformerLayer(ds_config(True, intermediate_size=-1))
    sd = layer.state_dict()
    assert list(sd) == ["attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b",
                        "output_w", "output_b", "norm_w", "norm_b"]
    assert sd["attn_qkvw"].shape == (3 * HID, HID) and sd["inter_w"].shape == (4 * HID, HID)
    assert sd["output_w"].shape == (HID, 4 * HID)
    other = DeepSpeedTransformerLayer(ds_config(True, intermediate_size=-1))
    other.load_state_dict(sd)
    assert torch.equal(other.attn_qkvw, layer.attn_qkvw)
    assert torch.equal(sd["norm_w"], torch.ones(HID)) and torch.equal(sd["attn_qkvb"], torch.zeros(3 * HID))


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by heads \(4\)"):
        DeepSpeedTransformerLayer(ds_config(True, hidden_size=30))
    layer = DeepSpeedTransformerLayer(ds_config(True, max_seq_length=8, return_tuple=True))
    with pytest.raises(ValueError, match=r"sequence length 9 is longer than the config's max_seq_length \(8\)"):
        layer(torch.randn(1, 9, HID))
    with pytest.raises(ValueError, match=rf"hidden_states must be \[batch, seq, {HID}\]"):
        layer(torch.randn(1, 4, HID + 1))
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        layer(torch.zeros(1, 4, HID, dtype=torch.int32))
    with pytest.raises(TypeError, match="parameter attn_qkvw is torch.float32"):
        layer(torch.zeros(1, 4, HID, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"attention_mask must be an additive mask of shape \[1, 1, 1, 4\]"):
        layer(torch.randn(1, 4, HID), torch.zeros(1, 4, 1, 4))
    with pytest.raises(NotImplementedError, match="encoder_hidden_states"):
        layer(torch.randn(1, 4, HID), None, None, None, torch.randn(1, 4, HID))
    out = layer(torch.randn(1, 4, HID))
    assert isinstance(out, tuple) and out[0].shape == (1, 4, HID)


def saved_bytes(layer, x, mask) -> int:
    """Bytes the layer's autograd node keeps for backward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.requires_grad_(True), mask)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_memory_flags_store_less(pre_ln):
    B, S = 2, 16
    x, mask = torch.randn(B, S, HID), additive_mask(B, S, 1)
    sizes = {}
    for flag in (None, *FLAGS):
        kw = {flag: True} if flag else {}
        layer = DeepSpeedTransformerLayer(ds_config(pre_ln, attn_dropout_ratio=0.1, **kw))
        sizes[flag] = saved_bytes(layer, x.clone(), mask)
    T = B * S
    assert sizes["gelu_checkpoint"] == sizes[None] - T * INTER * 4  # the GELU output
    assert sizes["attn_dropout_checkpoint"] == sizes[None] - B * HEADS * S * S * 4  # the dropped-out probabilities
    assert sizes["normalize_invertible"] <= sizes[None] - T * HID * 4  # at least one LayerNorm input


@pytest.mark.parametrize("pre_ln", [False, True])
def test_sdpa_attention_core_equals_the_softmax_path(pre_ln):
    """attention_impl="sdpa" (the GPU default) against the explicit masked-softmax path, with the
    memory flags on: same output and gradients (dropout 0)."""
    B, S = 2, 11
    x, d_out = torch.randn(B, S, HID), torch.randn(B, S, HID)
    mask = additive_mask(B, S, 9)
    res = []
    for impl in ("softmax", "sdpa"):
        torch.manual_seed(3)
        layer = DeepSpeedTransformerLayer(ds_config(pre_ln, **dict.fromkeys(FLAGS, True)))
        randomize(layer, 8)
        layer.attention_impl = impl
        res.append((*run(layer, x, mask, d_out), ds_grads(layer)))
    (o0, dx0, g0), (o1, dx1, g1) = res
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-4, atol=1e-5 * float(dx0.abs().max()))
    for name in WEIGHT_NAMES:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5 * float(g0[name].abs().max()), msg=name)
    with pytest.raises(ValueError, match="attention_impl must be"):
        layer.attention_impl = "flash"
        layer(x, mask)


class _PreLNBertLayer(torch.nn.Module):
    """The layout of NVIDIA's / DeepSpeed's pre-LN BERT example layer (names module_inject reads)."""

    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.attention = torch.nn.Module()
        self.attention.self = torch.nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, lin(HID, HID))
        self.attention.output = torch.nn.Module()
        self.attention.output.dense = lin(HID, HID)
        self.intermediate = torch.nn.Module()
        self.intermediate.dense_act = lin(HID, INTER)
        self.output = torch.nn.Module()
        self.output.dense = lin(INTER, HID)
        self.PreAttentionLayerNorm = torch.nn.LayerNorm(HID, eps=1e-12)
        self.PostAttentionLayerNorm = torch.nn.LayerNorm(HID, eps=1e-12)


def test_module_inject_maps_a_pre_ln_bert_layer_as_deepspeed_does():
    from deepspeed_c.ops.transformer.hf_bert import module_inject

    torch.manual_seed(4)
    model = torch.nn.Sequential(_PreLNBertLayer())
    randomize(model, 6)
    src = model[0]
    cfg = bert_config()
    module_inject(_PreLNBertLayer, model, cfg, micro_batch_size=2, max_seq_length=16, seed=1, preln=True, fp16=False)
    layer = model[0]
    assert isinstance(layer, DeepSpeedTransformerLayer) and layer.config.pre_layer_norm
    assert layer.config.max_seq_length == 16 and layer.config.return_tuple is False
    assert torch.equal(layer.norm_w, src.PreAttentionLayerNorm.weight)
    assert torch.equal(layer.attn_nw, src.PostAttentionLayerNorm.weight)
    assert torch.equal(layer.inter_w, src.intermediate.dense_act.weight)
    assert torch.equal(layer.attn_qkvw[HID:2 * HID], src.attention.self.key.weight)
