"""AutoEP checkpoints at expert_parallel.autoep_size 2 (2 gloo ranks), in DeepSpeed's MoE layout.

Reference: the same engine run on without a break. Two ranks train a tiny Mixtral (2 MoE layers, 4 experts) with
AdamW two steps, save, take a third step; a second pair of engines (zeroed weights, same config) loads the tag and
takes the same third step: its loss and every weight (experts gathered over the expert-parallel group) and Adam's
moments must equal the first run's, at ZeRO 0 and 2. The files are checked against DeepSpeed 0.19.8's layout: one
`layer_{L}_expert_{E}_mp_rank_00_model_states.pt` per global expert with keys `<experts>.w1|w2|w3.E` (gate rows,
down, up rows of the Hugging Face fused tensors, compared with the gathered weights) and `ds_autoep_layers` in the
model-states file, whose module holds no expert tensor; zero_to_fp32 and save_16bit_model give the whole fused
tensors (the latter loads strictly into Hugging Face's class). Then, in
one process at autoep_size 1, the 2-rank checkpoint's weights load (the expert files hold each expert once) and
its optimizer state is refused naming the key. (Adam's moments are compared directly at ZeRO 0; at ZeRO 2 the
resumed step's weights, which differ without them, are the check.)"""
from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from tests.distributed.test_autoep import MICRO, batches, gathered_weights, make_model
from tests.harness import run_distributed

LR = 0.05


def _config(ep: int, stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": ep}}


def _engine(stage: int, ep: int, zeroed: bool) -> Any:
    import deepspeed_c

    model = make_model("mixtral")
    if zeroed:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = deepspeed_c.initialize(model=model, config=_config(ep, stage))
    return engine


def _step(engine: Any, batch: torch.Tensor) -> float:
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _full(engine: Any, ep: int) -> dict[str, torch.Tensor]:
    return gathered_weights(engine.module, ep)


def _moments(engine: Any) -> list[torch.Tensor]:
    """Adam's moments in this rank's optimizer, in its parameter order (the local experts' own)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    return [st[k].detach().clone().reshape(-1) for st in inner.state.values() for k in ("exp_avg", "exp_avg_sq")
            if k in st]


def _layout(path: str, tag: str, full: dict[str, torch.Tensor]) -> str:
    """"" when the tag holds DeepSpeed's AutoEP layout with the gathered weights' values, else what is wrong."""
    d = os.path.join(path, tag)
    model = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    layers = model.get("ds_autoep_layers")
    if not isinstance(layers, list) or [e["ep_size"] for e in layers] != [2, 2]:
        return f"ds_autoep_layers: {layers}"
    if [e["moe_layer_id"] for e in layers] != [0, 1] or [e["expert_key_prefix"] for e in layers] != \
            [f"model.layers.{i}.mlp.experts" for i in range(2)]:
        return f"ds_autoep_layers ids/prefixes: {layers}"
    leaked = [k for k in model["module"] if ".experts." in k]
    if leaked or "model.layers.0.mlp.gate.weight" not in model["module"]:
        return f"model-states module: expert keys {leaked}, keys {sorted(model['module'])[:5]}"
    for layer in range(2):
        gate_up, down = full[f"model.layers.{layer}.mlp.experts.gate_up_proj"], full[
            f"model.layers.{layer}.mlp.experts.down_proj"]
        ffn = down.shape[2]
        for e in range(4):
            sd = torch.load(os.path.join(d, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"), map_location="cpu")
            prefix = f"model.layers.{layer}.mlp.experts"
            want = {f"{prefix}.w1.{e}": gate_up[e, :ffn], f"{prefix}.w2.{e}": down[e],
                    f"{prefix}.w3.{e}": gate_up[e, ffn:]}
            if set(sd) != set(want):
                return f"layer {layer} expert {e}: keys {sorted(sd)}"
            bad = [k for k in want if not torch.equal(sd[k], want[k])]
            if bad:
                return f"layer {layer} expert {e}: values differ for {bad}"
    return ""


def _rank_body(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    data = batches(world) + batches(world)[:1]  # three steps
    for stage in (0, 2):
        tag = f"z{stage}"
        first = _engine(stage, 2, zeroed=False)
        for step in data[:2]:
            _step(first, step[rank])
        first.save_checkpoint(path, tag=tag)
        first.save_16bit_model(os.path.join(path, f"hf_{tag}"), "model.bin")  # every expert, gathered
        at_save = _full(first, 2)
        dist.barrier()
        layout = _layout(path, tag, at_save) if rank == 0 else ""
        loss = _step(first, data[2][rank])
        second = _engine(stage, 2, zeroed=True)
        second.load_checkpoint(path, tag=tag)
        loaded = _full(second, 2)
        loss2 = _step(second, data[2][rank])
        after, after2 = _full(first, 2), _full(second, 2)
        m1, m2 = _moments(first), _moments(second)
        out[tag] = {
            "layout": layout,
            "loaded_equal": [n for n in at_save if not torch.equal(loaded[n], at_save[n])],
            "loss": (loss, loss2),
            "weights_differ": [n for n in after if not torch.allclose(after[n], after2[n], rtol=0, atol=1e-6)],
            "moments": (len(m1), len(m2), all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(m1, m2))),
            "full": {n: w.numpy() for n, w in at_save.items()} if rank == 0 else None,  # fp32 (the masters)
        }
    return out


@pytest.fixture
def world_of_one_autoep(world_of_one):
    yield
    from deepspeed_c.utils import groups

    groups._reset_expert_groups()


def test_autoep_checkpoint_two_ranks_resume_and_reshard(tmp_path, world_of_one_autoep) -> None:
    path = str(tmp_path / "ckpt")
    results = run_distributed(_rank_body, 2, args=(path,), timeout=300)
    for tag in ("z0", "z2"):
        for rank, res in enumerate(results):
            r = res[tag]
            assert r["layout"] == "", f"{tag} rank {rank}: {r['layout']}"
            assert r["loaded_equal"] == [], f"{tag} rank {rank}: weights differ after load: {r['loaded_equal']}"
            assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6, abs=0), f"{tag} rank {rank}: {r['loss']}"
            assert r["weights_differ"] == [], f"{tag} rank {rank}: after the resumed step: {r['weights_differ']}"
            n1, n2, same = r["moments"]
            assert n1 == n2 and (n1 > 0 or tag == "z2") and same, f"{tag} rank {rank}: Adam moments {r['moments']}"

    # zero_to_fp32 consolidates every expert into the Hugging Face fused tensors
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for tag in ("z0", "z2"):
        want = {n: torch.from_numpy(w) for n, w in results[0][tag]["full"].items()}
        sd = get_fp32_state_dict_from_zero_checkpoint(path, tag=tag)
        assert set(sd) == set(want), f"{tag}: {sorted(set(sd) ^ set(want))}"
        bad = [n for n in want if sd[n].shape != want[n].shape or not torch.equal(sd[n], want[n].float())]
        assert bad == [], f"{tag}: zero_to_fp32 differs from the trained weights for {bad}"

        # save_16bit_model wrote the unsplit model: Hugging Face's own class loads it strictly
        exported = torch.load(os.path.join(path, f"hf_{tag}", "model.bin"), map_location="cpu")
        hf = make_model("mixtral")
        hf.load_state_dict(exported, strict=True)
        bad = [n for n, p in hf.named_parameters() if not torch.equal(p.detach(), want[n])]
        assert bad == [], f"{tag}: save_16bit_model differs from the trained weights for {bad}"

    # the 2-rank checkpoint at autoep_size 1 in one process: weights load, the optimizer state is refused
    full = {n: torch.from_numpy(w) for n, w in results[0]["z0"]["full"].items()}
    one = _engine(0, 1, zeroed=True)
    with pytest.raises(NotImplementedError, match="autoep_size=2"):
        one.load_checkpoint(path, tag="z0")
    one.load_checkpoint(path, tag="z0", load_optimizer_states=False)
    got = dict(one.module.named_parameters())
    assert set(got) == set(full)
    bad = [n for n in full if not torch.equal(got[n].detach(), full[n])]
    assert bad == [], f"weights differ after loading the autoep_size 2 checkpoint at 1: {bad}"
