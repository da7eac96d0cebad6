"""utils/zero_to_fp32.py: fp32 weights recovered from stage-0 checkpoints (fp32 and bf16 with fp32
masters), DeepSpeed-layout ZeRO partitions, conversion to files, and the copy in the checkpoint dir
running with only torch importable."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

import deepspeed_c
from deepspeed_c.utils import zero_to_fp32 as z
from tests.distributed.engine_models import MLP, loss_fn


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def trained(tmp_path, bf16: bool):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=cfg)
    g = torch.Generator().manual_seed(3)
    dt = torch.bfloat16 if bf16 else torch.float32
    for _ in range(3):
        x, y = torch.randn(4, 12, generator=g).to(dt), torch.randn(4, 3, generator=g).to(dt)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    return engine


@pytest.mark.parametrize("bf16", [False, True])
def test_stage0_weights_are_the_fp32_masters(tmp_path, bf16):
    engine = trained(tmp_path, bf16)
    sd = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    if bf16:
        masters = [m for g in engine.optimizer.fp32_groups for m in g]
        names = [n for n, _ in engine.module.named_parameters()]
        expected = dict(zip(names, masters))
    else:
        expected = dict(engine.module.named_parameters())
    assert set(sd) == set(expected)
    for k, v in expected.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.detach().float()), k
    model = z.load_state_dict_from_zero_checkpoint(MLP(), str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k])


def test_deepspeed_layout_partitions_reassemble(tmp_path):
    """A synthetic DeepSpeed ZeRO-2 checkpoint: 2 ranks, one group, flat buffer padded to 2*world."""
    torch.manual_seed(1)
    params = OrderedDict([("a.weight", torch.randn(3, 5)), ("a.bias", torch.randn(3)), ("b", torch.randn(7))])
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    world, align = 2, 4
    total = -(-flat.numel() // align) * align
    padded = torch.cat([flat, torch.zeros(total - flat.numel())])
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    torch.save({"module": {k: v.to(torch.bfloat16) for k, v in params.items()},
                "param_shapes": [OrderedDict((k, v.shape) for k, v in params.items())],
                "buffer_names": [], "shared_params": {}}, tag / "mp_rank_00_model_states.pt")
    for r, part in enumerate(padded.chunk(world)):
        torch.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [part.clone()]}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    sd = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    for k, v in params.items():
        assert torch.equal(sd[k], v), k


def test_convert_and_cli_copy_runs_with_only_torch(tmp_path):
    engine = trained(tmp_path / "ckpt", False)
    copy = tmp_path / "ckpt" / "zero_to_fp32.py"  # DeepSpeed's place: the top-level checkpoint directory
    assert copy.exists() and not (tmp_path / "ckpt" / "global_step3" / "zero_to_fp32.py").exists()
    out = tmp_path / "out"
    # -I (isolated) keeps the repo off sys.path; a stub finder refuses any deepspeed_c import.
    # Both copies' --help first: zero_to_torch.py takes its command line from the zero_to_fp32.py beside it
    # (the script's own directory on sys.path, as `python zero_to_torch.py` has it).
    guard = ("import sys, runpy\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('deepspeed_c', 'deepspeed'): raise ImportError(name)\n"
             "sys.meta_path.insert(0, Block())\n"
             f"sys.path.insert(0, {str(copy.parent)!r})\n"
             "for name in ('zero_to_fp32.py', 'zero_to_torch.py'):\n"
             "    sys.argv = [name, '--help']\n"
             "    try:\n"
             f"        runpy.run_path({str(copy.parent)!r} + '/' + name, run_name='__main__')\n"
             "    except SystemExit as e:\n"
             "        assert e.code == 0, e.code\n"
             f"sys.argv = ['zero_to_fp32.py', {str(tmp_path / 'ckpt')!r}, {str(out)!r}]\n"
             f"runpy.run_path({str(copy)!r}, run_name='__main__')\n")
    helps = subprocess.run([sys.executable, "-I", "-c", guard], check=True, cwd=str(tmp_path), timeout=300,
                           capture_output=True, text=True).stdout
    # DeepSpeed 0.19.8's command lines: the same options, in the same order
    usages = [" ".join(h.split("\n\n")[0].split()) for h in helps.split("usage: ")[1:]]
    common = ("[--max_shard_size MAX_SHARD_SIZE] [--safe_serialization] [-t TAG] [--exclude_frozen_parameters] [-d] "
              "checkpoint_dir output_dir")
    assert usages == [f"zero_to_fp32.py [-h] {common}",
                      f"zero_to_torch.py [-h] --dtype {{bf16,bfloat16,float16,float32,fp16,fp32}} {common}"], helps
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    for k, v in engine.module.named_parameters():
        assert torch.equal(sd[k], v.detach()), k
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "sharded"),
                                                 max_shard_size="1KB", safe_serialization=True)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and len(files) > 2
    from safetensors.torch import load_file

    merged = {}
    for f in files:
        if f.endswith(".safetensors"):
            merged.update(load_file(str(tmp_path / "sharded" / f)))
    assert set(merged) == set(sd) and all(torch.equal(merged[k], sd[k]) for k in sd)


def test_clone_tensors_for_torch_save_drops_the_shared_storage(tmp_path):
    from deepspeed_c.checkpoint.utils import clone_tensors_for_torch_save

    big = torch.arange(10000, dtype=torch.float32)
    item = OrderedDict(a=big[:3], b=[big[5:7], (big[9:10], "s")], n=4)
    out = clone_tensors_for_torch_save(item)
    assert type(out) is OrderedDict and out["n"] == 4 and out["b"][1][1] == "s"
    assert torch.equal(out["a"], big[:3]) and torch.equal(out["b"][0], big[5:7])
    assert out["a"].untyped_storage().nbytes() == 3 * 4
    torch.save(out, tmp_path / "x.pt")
    assert os.path.getsize(tmp_path / "x.pt") < 4000
