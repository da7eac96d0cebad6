"""save_file's manifest entry: the file's sha256 taken from the bytes as torch.save writes them equals a
fresh read of the file, and the per-tensor digests computed on threads equal hashlib's, in the state's order."""
import hashlib

import torch

from deepspeed_c.checkpoint import store


def test_inline_file_sha_and_threaded_digests(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"module": {f"w{i}": torch.randn(257, 33, generator=g) for i in range(12)},
             "opt": [torch.randn(70001, generator=g, dtype=torch.float64), torch.empty(0), torch.tensor(3)],
             "bf16": torch.randn(1000, generator=g).to(torch.bfloat16), "meta": {"step": 7, "name": "x"}}
    path = str(tmp_path / "f.pt")
    entry = store.save_file(state, path)
    with open(path, "rb") as f:
        assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest()
    names = list(entry["tensors"])
    assert names == [f"module.w{i}" for i in range(12)] + ["opt.0", "opt.1", "opt.2", "bf16"]
    w3 = state["module"]["w3"].contiguous().view(-1).view(torch.uint8).numpy()
    assert entry["tensors"]["module.w3"]["sha256"] == hashlib.sha256(w3).hexdigest()
    assert entry["tensors"]["opt.1"]["sha256"] == hashlib.sha256(b"").hexdigest()
    assert entry["tensors"]["bf16"]["dtype"] == "bfloat16" and entry["tensors"]["module.w0"]["shape"] == [257, 33]
    loaded = store.load_file(str(tmp_path), "f.pt", {"files": {"f.pt": entry}})
    torch.testing.assert_close(loaded["opt"][0], state["opt"][0], rtol=0, atol=0)
