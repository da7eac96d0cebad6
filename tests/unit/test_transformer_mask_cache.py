"""The attention-mask conversion a DeepSpeedTransformerLayer stack shares (ops/transformer/mask_cache.py):
reused for the same unchanged mask, converted again after an in-place change or for another mask, never for a
mask that needs a gradient; and a layer's output follows the mask it is given."""
import gc

import torch

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from deepspeed_c.ops.transformer.mask_cache import ConvertedMask


def test_reuse_and_invalidation():
    cache, calls = ConvertedMask(), []

    def build(m):
        calls.append(1)
        return m * 2

    m = torch.zeros(2, 3)
    a = cache.get(m, "k", lambda: build(m))
    assert cache.get(m, "k", lambda: build(m)) is a and len(calls) == 1
    assert cache.get(m, "other key", lambda: build(m)) is not a and len(calls) == 2
    m.add_(1.0)  # in place: the version moves, the conversion runs again and sees the new values
    b = cache.get(m, "other key", lambda: build(m))
    assert len(calls) == 3 and torch.equal(b, torch.full((2, 3), 2.0))
    n = torch.zeros(2, 3)  # another tensor, same key
    assert cache.get(n, "other key", lambda: build(n)) is not b and len(calls) == 4
    g = torch.zeros(2, 3, requires_grad=True)
    cache.get(g, "k", lambda: build(g))
    cache.get(g, "k", lambda: build(g))
    assert len(calls) == 6  # a mask that needs a gradient is never cached


def test_entry_goes_with_its_source():
    cache = ConvertedMask()
    m = torch.zeros(4)
    cache.get(m, 0, lambda: m + 1)
    del m
    gc.collect()
    assert cache._entry is None


def _layer(seed):
    torch.manual_seed(seed)
    cfg = DeepSpeedTransformerConfig(batch_size=2, hidden_size=32, intermediate_size=64, heads=4,
                                     attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, num_hidden_layers=2,
                                     initializer_range=0.02)
    return DeepSpeedTransformerLayer(cfg).eval()


def test_layers_follow_an_in_place_mask_change():
    layers = [_layer(0), _layer(1)]
    x = torch.randn(2, 6, 32)
    mask = torch.zeros(2, 1, 1, 6)

    def run():
        h = x
        for layer in layers:
            h = layer(h, mask)
        return h

    open_out = run()
    mask[:, :, :, 3:] = torch.finfo(torch.float32).min  # pad the last three positions, in place
    padded_out = run()
    fresh = [_layer(0), _layer(1)]
    h = x
    for layer in fresh:
        h = layer(h, mask.clone())  # a new mask object with the same values: no cache involved
    assert not torch.allclose(open_out, padded_out)
    torch.testing.assert_close(padded_out, h, rtol=0, atol=0)
