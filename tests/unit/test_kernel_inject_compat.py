"""Kernel injection across transformers releases (module_inject/hf_compat.py and the cache handle's
legacy face): a 4.3x rope_scaling whose tables depend on the length is refused; the handle read
as legacy (key, value) tuples (how transformers 4.x's prepare_inputs_for_generation finds the past
length) gives HF eager's cached keys and values; a legacy tuple cache passed back raises. Runs under
the installed transformers (5.x) and 4.35 (there test_kernel_inject.py's greedy tests cover the 4.3x
rotary tables)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.inference_models import VOCAB, injected_pair


@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_a_length_dependent_4x_rope_scaling_is_refused(kind):
    from deepspeed_c.module_inject.hf_compat import static_rope_kind
    assert static_rope_kind(SimpleNamespace(rope_scaling=None)) == "default"
    assert static_rope_kind(SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0})) == "linear"
    with pytest.raises(NotImplementedError, match=f"'{kind}'"):
        static_rope_kind(SimpleNamespace(rope_scaling={"type": kind, "factor": 2.0}))


def test_attention_scale():
    from deepspeed_c.module_inject.hf_compat import attention_scale
    assert attention_scale(SimpleNamespace(scaling=0.3), 16) == 0.3
    assert attention_scale(SimpleNamespace(), 16) == 0.25


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cache, (tuple, list)):  # transformers 4.x legacy cache
        return cache[layer][0], cache[layer][1]
    return cache.layers[layer].keys, cache.layers[layer].values


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cache_handle_reads_as_legacy_tuples_equal_to_hf_cache(kind):
    ref, inj = injected_pair(kind)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids, use_cache=True).past_key_values
        handle = inj(ids, use_cache=True).past_key_values
        layers = list(handle)
        assert len(handle) == len(layers) == ref.config.num_hidden_layers
        assert handle[0][0].shape[2] == 7
        for i, (k, v) in enumerate(layers):
            wk, wv = _layer_kv(want, i)
            torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, wv, rtol=1e-5, atol=1e-5)
        inj(ids[:, :1], past_key_values=handle)  # the live handle continues the sequence; then it is stale
        with pytest.raises(ValueError, match="earlier sequence"):
            handle[0]
        with pytest.raises(ValueError, match="legacy tuple"):
            inj(ids[:, :1], past_key_values=tuple((k.clone(), v.clone()) for k, v in layers))
