"""The flops profiler (deepspeed_c.profiling.flops_profiler) against counts worked out from the
layer shapes in tests/unit/flops_profiler_models.py, and, when DSC_DEEPSPEED_REAL is set,
against the real DeepSpeed profiler run on the same models in a subprocess."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_c.profiling.flops_profiler import FlopsProfiler, get_model_profile
from tests.unit import flops_profiler_models as fm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _profile(model: nn.Module, shape: tuple) -> tuple[int, int, int]:
    torch.manual_seed(0)
    return get_model_profile(model, input_shape=shape, print_profile=False, as_string=False, warm_up=0)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _cases() -> dict:
    torch.manual_seed(0)
    b, t, d, h = 2, 5, 16, 4
    gpt, bert = fm.GPTBlock(d, h), fm.BERTBlock(d, h)
    return {"linear": fm.linear_case(), "conv2d": fm.conv_case(),
            "gpt_block": (gpt, (b, t, d), *fm.gpt_block_counts(b, t, d, h)),
            "bert_block": (bert, (b, t, d), *fm.bert_block_counts(b, t, d, h)),
            "resnet18": (fm.ResNet18(width=8), (1, 3, 32, 32), *fm.resnet18_counts(1, 32, width=8))}


@pytest.mark.parametrize("name", ["linear", "conv2d", "gpt_block", "bert_block", "resnet18"])
def test_counts_equal_analytic(name):
    model, shape, flops, macs = _cases()[name]
    got = _profile(model, shape)
    assert got == (flops, macs, _params(model))



def test_lstm_counts_from_weights():
    model = nn.LSTM(7, 5, batch_first=True)
    assert _profile(model, (3, 4, 7)) == (fm.lstm_counts(3, 4, 7, 5), 0, _params(model))


def test_torch_compile_counts_as_eager():
    """A torch.compile'd MLP (aot_eager: no C++ toolchain needed) counts as the eager one. (Counting
    happens when Dynamo traces the ops, as in DeepSpeed's profiler; a model whose frames Dynamo
    traces more than once, e.g. around scaled_dot_product_attention, is over-counted by both.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    macs = 2 * 8 * 16 + 2 * 16 * 4
    compiled = torch.compile(model, backend="aot_eager")
    assert get_model_profile(compiled, input_shape=(2, 8), print_profile=False, as_string=False) == \
        (2 * macs + 2 * 16, macs, _params(model))


def _snapshot() -> dict:
    names = {"F": (F, ["linear", "conv2d", "conv_transpose2d", "relu", "gelu", "silu", "layer_norm", "batch_norm",
                       "softmax", "embedding", "scaled_dot_product_attention", "max_pool2d", "interpolate"]),
             "torch": (torch, ["matmul", "mm", "bmm", "addmm", "baddbmm", "mul", "add", "einsum"]),
             "Tensor": (torch.Tensor, ["matmul", "__matmul__", "mm", "bmm", "addmm", "mul", "add"])}
    return {(k, n): (getattr(owner, n), n in vars(owner)) for k, (owner, ns) in names.items() for n in ns}


def test_patches_removed_after_end_profile_even_when_forward_raises():
    before = _snapshot()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prof = FlopsProfiler(model)
    prof.start_profile()
    assert F.linear is not before[("F", "linear")][0] and torch.Tensor.matmul is not before[("Tensor", "matmul")][0]
    with pytest.raises(RuntimeError):
        model(torch.ones(2, 5))  # wrong width: the forward raises inside the profile
    from deepspeed_c.profiling.flops_profiler import patches

    assert patches.frames == []  # the raised forward closed its frames
    model(torch.ones(2, 4))
    # the op that raised was counted before it ran (as DeepSpeed's), then the good call
    assert prof.get_total_macs() == 2 * 5 * 4 + 2 * 4 * 4
    prof.end_profile()
    assert _snapshot() == before
    assert not any(hasattr(m, "__flops__") or m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # stop_profile alone restores torch too, and a second start/end cycle still counts
    prof.start_profile()
    prof.stop_profile()
    assert _snapshot() == before
    prof.end_profile()
    x = torch.randn(3, 4)
    assert torch.equal(model(x), torch.relu(x @ model[0].weight.T + model[0].bias))


def test_profiler_lifecycle_and_strings():
    model = nn.Sequential(nn.Linear(10, 20), nn.GELU(), nn.Linear(20, 3))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(4, 10))
    macs = 4 * 10 * 20 + 4 * 20 * 3
    flops = 2 * macs + 4 * 20
    assert (prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()) == (flops, macs, _params(model))
    assert prof.get_total_flops(as_string=True) == f"{round(flops / 1e3, 2):g} K"
    assert prof.get_total_macs(as_string=True) == f"{round(macs / 1e3, 2):g} KMACs"
    assert prof.get_total_params(as_string=True) == f"{_params(model)}"
    assert prof.get_total_duration() > 0 and prof.get_total_duration(as_string=True).endswith("s")
    model(torch.randn(4, 10))  # a second forward accumulates
    assert prof.get_total_macs() == 2 * macs
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.end_profile()
    assert get_model_profile(model, input_shape=(4, 10), print_profile=False) == \
        (f"{round(flops / 1e3, 2):g} K", f"{round(macs / 1e3, 2):g} KMACs", f"{_params(model)}")


def test_print_model_profile_lists_modules_at_depth(tmp_path, capsys):
    model = fm.ResNet18(width=4)
    get_model_profile(model, input_shape=(1, 3, 16, 16), module_depth=2, top_modules=10, warm_up=0)
    out = capsys.readouterr().out
    for line in ("-------------------------- DeepSpeed Flops Profiler --------------------------",
                 "Profile Summary at step 0:", "Aggregated Profile per GPU", "Detailed Profile per GPU",
                 "Top 10 modules in terms of params, MACs or fwd latency at different model depths:",
                 "depth 0:", "depth 1:"):
        assert line in out
    assert "depth 2:" not in out  # depths 0 .. module_depth-1, as DeepSpeed prints them
    depth1 = out.split("depth 1:")[1].split("MACs        -")[0]
    for child in model.children():  # every module class at depth 1 (top_modules exceeds their number)
        assert f"'{type(child).__name__}'" in depth1
    tree = out.split("Detailed Profile per GPU")[1]
    for name, _ in model.named_modules():
        if name:
            assert f"({name.split('.')[-1]}): " in tree
    assert "(conv1): Conv2d(" in tree and "% Params" in tree and "% MACs" in tree and "% latency" in tree
    # the extra_repr overrides are gone again
    assert repr(model.fc) == "Linear(in_features=32, out_features=10, bias=True)"
    path = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, input_shape=(1, 3, 16, 16), detailed=False, output_file=str(path))
    text = path.read_text()
    assert "fwd MACs per GPU:" in text and "Detailed Profile per GPU" not in text
    assert "DeepSpeed Flops Profiler" not in capsys.readouterr().out
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.ones(1, 3, 16, 16))
    buf = io.StringIO()
    prof.print_model_aggregated_profile(module_depth=1, top_modules=1, out=buf)
    assert "depth 0:\n    params      - {'ResNet18'" in buf.getvalue()
    prof.end_profile()


def test_print_model_profile_none_dp_world_size(capsys):
    # an engine under Ulysses sequence parallelism reports dp_world_size None; DeepSpeed prints the
    # sequence-data-parallel size in its place instead of failing on the format
    from types import SimpleNamespace

    model = nn.Linear(4, 4)
    prof = FlopsProfiler(model)
    prof.ds_engine = SimpleNamespace(world_size=8, dp_world_size=None, seq_dp_world_size=4, mp_world_size=1,
                                     has_moe_layers=False, train_micro_batch_size_per_gpu=lambda: 1,
                                     wall_clock_breakdown=lambda: False)
    prof.start_profile()
    model(torch.randn(2, 4))
    prof.print_model_profile(profile_step=1, detailed=False)
    prof.end_profile()
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("data parallel size:"))
    assert line.split()[-1] == "4"


def test_bad_input_messages():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model)
    with pytest.raises(TypeError, match="input_shape"):
        get_model_profile(model, input_shape=[1, 2])
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, input_shape=(1, 2), mode="backward")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        get_model_profile(lambda x: x, input_shape=(1, 2))


_REAL_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from deepspeed.profiling.flops_profiler import get_model_profile
    from tests.unit import test_flops_profiler as t
    from tests.unit import flops_profiler_models as fm
    out = {{}}
    for name, (model, shape, _, _) in t._cases().items():
        torch.manual_seed(0)
        out[name] = list(get_model_profile(model, input_shape=shape, print_profile=False, as_string=False,
                                           warm_up=0))
    torch.manual_seed(0)
    zoo = fm.OpZoo()
    out["zoo"] = list(get_model_profile(zoo, args=list(fm.zoo_inputs()), print_profile=False, as_string=False,
                                        warm_up=0))
    torch.manual_seed(0)
    out["rnn"] = list(get_model_profile(fm.RNNZoo(), input_shape=(2, 3, 8), print_profile=False, as_string=False,
                                        warm_up=0))
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.skipif(not os.environ.get("DSC_DEEPSPEED_REAL"), reason="set DSC_DEEPSPEED_REAL=1 to run the real "
                    "DeepSpeed (at /tmp/ds_real) on the same models")
def test_counts_equal_real_deepspeed():
    env = dict(os.environ, PYTHONPATH="/tmp/ds_real:/tmp/ds_deps", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _REAL_SCRIPT.format(root=ROOT)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    real = json.loads(proc.stdout.split("RESULT", 1)[1])
    ours = {name: list(_profile(model, shape)) for name, (model, shape, _, _) in _cases().items()}
    torch.manual_seed(0)
    zoo = fm.OpZoo()
    ours["zoo"] = list(get_model_profile(zoo, args=list(fm.zoo_inputs()), print_profile=False, as_string=False,
                                         warm_up=0))
    torch.manual_seed(0)
    ours["rnn"] = list(get_model_profile(fm.RNNZoo(), input_shape=(2, 3, 8), print_profile=False, as_string=False,
                                         warm_up=0))
    assert ours == real
