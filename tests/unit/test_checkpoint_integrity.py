"""engine.save_checkpoint / load_checkpoint in one process: DeepSpeed's layout and keys, client_state,
exact resume (fp32, bf16), manifest verification (flipped byte, truncated file, missing tensor,
newer format version, no manifest) and bad-input errors."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import deepspeed_c
from deepspeed_c.checkpoint import store
from tests.distributed.engine_models import MLP, loss_fn


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def config(dtype: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def engine_for(dtype: str = "fp32", model: torch.nn.Module | None = None):
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=model or MLP(), config=config(dtype))
    return engine


def batches(n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 12, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)) for _ in range(n)]


def train(engine, data) -> list[float]:
    out = []
    for x, y in data:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_is_bit_exact_and_layout_is_deepspeeds(tmp_path, dtype):
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    data = batches(12, tdt)
    full = engine_for(dtype)
    ref = train(full, data)
    first = engine_for(dtype)
    train(first, data[:6])
    assert first.save_checkpoint(str(tmp_path), client_state={"epoch": 2, "note": "x"})
    tag_dir = tmp_path / "global_step6"
    assert (tmp_path / "latest").read_text() == "global_step6"
    sd = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=True)
    # DeepSpeed 0.19.8's _common_checkpoint_state keys, then the client's
    for key in ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                "ds_config", "ds_version", "epoch", "note"):
        assert key in sd, key
    assert sd["global_steps"] == 6 and sd["global_samples"] == 24 and sd["dp_world_size"] == 1
    assert list(sd["param_shapes"][0]) == [n for n, _ in first.module.named_parameters()]
    assert (tag_dir / store.MANIFEST_NAME).exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "staging leftovers"

    resumed = engine_for(dtype)
    path, client = resumed.load_checkpoint(str(tmp_path))
    assert path == str(tag_dir / "mp_rank_00_model_states.pt")
    assert client == {"epoch": 2, "note": "x"}
    assert resumed.global_steps == 6
    assert train(resumed, data[6:]) == ref[6:]
    for (n, a), b in zip(full.module.state_dict().items(), resumed.module.state_dict().values()):
        assert torch.equal(a, b), n


def test_module_only_and_no_optimizer_states(tmp_path):
    src = engine_for()
    train(src, batches(3, torch.float32))
    src.save_checkpoint(str(tmp_path), tag="t")
    dst = engine_for()
    dst.load_checkpoint(str(tmp_path), tag="t", load_module_only=True)
    assert dst.global_steps == 0
    for a, b in zip(src.module.parameters(), dst.module.parameters()):
        assert torch.equal(a, b)


def saved(tmp_path):
    e = engine_for()
    train(e, batches(2, torch.float32))
    e.save_checkpoint(str(tmp_path))
    return e, tmp_path / "global_step2" / "mp_rank_00_model_states.pt"


def test_flipped_byte_is_detected(tmp_path):
    _, f = saved(tmp_path)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(store.CheckpointIntegrityError, match="mp_rank_00_model_states.pt"):
        engine_for().load_checkpoint(str(tmp_path))


def test_truncated_file_is_detected(tmp_path):
    _, f = saved(tmp_path)
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(store.CheckpointIntegrityError, match="truncated"):
        engine_for().load_checkpoint(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    _, f = saved(tmp_path)
    manifest_path = f.parent / store.MANIFEST_NAME
    sd = torch.load(f, weights_only=True)
    del sd["module"]["net.2.weight"]
    torch.save(sd, f)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][f.name]["size"] = os.path.getsize(f)  # only the tensor check can catch it now
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(store.CheckpointIntegrityError, match=r"module\.net\.2\.weight.*missing"):
        engine_for().load_checkpoint(str(tmp_path))


def test_newer_format_is_refused_and_no_manifest_warns(tmp_path):
    src, f = saved(tmp_path)
    manifest_path = f.parent / store.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = store.FORMAT_VERSION + 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(store.CheckpointIntegrityError, match=f"format_version {store.FORMAT_VERSION + 1}"):
        engine_for().load_checkpoint(str(tmp_path))
    manifest_path.unlink()
    dst = engine_for()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dst.load_checkpoint(str(tmp_path))
    assert any("no dsc_manifest.json" in str(w.message) for w in caught)
    for a, b in zip(src.module.parameters(), dst.module.parameters()):
        assert torch.equal(a, b)


class Wider(MLP):
    def __init__(self) -> None:
        super().__init__(hidden=30)


class Extra(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


def test_mismatched_model_raises_listing_names(tmp_path):
    saved(tmp_path)
    with pytest.raises(RuntimeError, match=r"shape mismatch.*net\.0\.weight"):
        engine_for(model=Wider()).load_checkpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"missing in checkpoint.*extra\.weight"):
        engine_for(model=Extra()).load_checkpoint(str(tmp_path))
    e = engine_for(model=Extra())
    e.load_checkpoint(str(tmp_path), load_module_strict=False, load_optimizer_states=False)


def test_missing_latest_and_tag(tmp_path, caplog):
    saved(tmp_path)
    with pytest.raises(FileNotFoundError, match="global_step2"):
        engine_for().load_checkpoint(str(tmp_path), tag="nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert engine_for().load_checkpoint(str(empty)) == (None, None)


def test_client_state_must_be_plain(tmp_path):
    e = engine_for()
    with pytest.raises(TypeError, match="client_state|object"):
        e.save_checkpoint(str(tmp_path), client_state={"obj": object()})
    with pytest.raises(ValueError, match="module"):
        e.save_checkpoint(str(tmp_path), client_state={"module": 1})
    assert not (tmp_path / "latest").exists()


def test_resave_same_tag_and_interrupted_swap(tmp_path):
    e = engine_for()
    train(e, batches(2, torch.float32))
    e.save_checkpoint(str(tmp_path), tag="t")
    train(e, batches(1, torch.float32))
    e.save_checkpoint(str(tmp_path), tag="t")  # replaces the tag whole
    dst = engine_for()
    dst.load_checkpoint(str(tmp_path))
    assert dst.global_steps == 3
    # a crash between moving the old copy aside and moving the new one in leaves only .t.old
    os.replace(tmp_path / "t", tmp_path / ".t.old")
    dst = engine_for()
    path, _ = dst.load_checkpoint(str(tmp_path))
    assert dst.global_steps == 3 and ".t.old" in path
