"""runtime/zero/stage3_estimators.py: DeepSpeed's ZeRO-3 memory formulas, written out here independently,
the printed table, model_to_params (tied weights, per-module layers, zero.Init-partitioned params),
and, when the real DeepSpeed is importable, the same printed output as DeepSpeed's own functions."""
from __future__ import annotations

import contextlib
import io
import itertools
import os
import subprocess
import sys

import pytest
import torch

from deepspeed_c.runtime.zero import stage3_estimators as est

GiB = 2**30
DS_REAL = os.environ.get("DSC_DEEPSPEED_REAL", "/tmp/ds_real")
DS_DEPS = os.environ.get("DSC_DEEPSPEED_DEPS", "/tmp/ds_deps")


def expected(total, layer, gpn, nodes, offload_opt, offload_param, zero_init, f):
    """The ZeRO-3 formulas, written out: 18 bytes a parameter on the host with params offloaded
    (16 when params stay on the GPU, which then holds their 2 bytes / total_gpus); 4 bytes of the
    largest layer on the GPU; without zero_init each of a node's GPUs' processes builds the model in fp32."""
    gpus = gpn * nodes
    layer_mem = 4 * layer
    if offload_opt and offload_param:
        gpu = layer_mem
        cpu = total * 18 / nodes * f if zero_init else total * max(4 * gpn, 18 / nodes) * f
    elif offload_opt:
        gpu = layer_mem + int(2 * total / gpus)
        cpu = total * 16 / nodes * f if zero_init else total * max(4 * gpn, 16 / nodes) * f
    else:
        gpu = layer_mem + int(18 * total / gpus)
        cpu = (layer if zero_init else total) * 4 * gpn * f
    return int(cpu), int(gpu), layer_mem


SIZES = [(3_000_000_000, 100_000_000, 8, 2), (1_234_567, 45_678, 1, 1), (7_000_000_000, 262_144_000, 4, 1),
         (175_000_000_000, 600_000_000, 8, 16)]


@pytest.mark.parametrize("total,layer,gpn,nodes", SIZES)
@pytest.mark.parametrize("factor", [1.5, 1.0])
def test_formulas(total, layer, gpn, nodes, factor):
    for oo, op, zi in itertools.product([True, False], repeat=3):
        got = est.estimate_zero3_model_states_mem_needs(total, layer, gpn, nodes, cpu_offload=oo,
                                                        cpu_offload_params=op, zero_init=zi,
                                                        additional_buffer_factor=factor)
        want = expected(total, layer, gpn, nodes, oo, op and oo, zi, factor)
        if not oo:  # param offload without optimizer offload is not a configuration: same as neither
            want = expected(total, layer, gpn, nodes, False, False, zi, factor)
        assert got == want, (oo, op, zi)
        assert all(isinstance(v, int) for v in got)


def test_known_figures():
    # 3B params, 100M largest layer, 2 nodes x 8 GPUs: hand-computed
    cpu, gpu, layer = est.estimate_zero3_model_states_mem_needs(3_000_000_000, 100_000_000, 8, 2)
    assert (cpu, gpu, layer) == (int(3e9 * 18 * 0.5 * 1.5), 400_000_000, 400_000_000)
    cpu, gpu, _ = est.estimate_zero3_model_states_mem_needs(3_000_000_000, 100_000_000, 8, 2, cpu_offload=False,
                                                            cpu_offload_params=False)
    assert gpu == 400_000_000 + int(18 * 3e9 / 16) and cpu == int(100_000_000 * 4 * 8 * 1.5)


def table(total, layer, gpn, nodes, f=1.5):
    rows = []
    for oo, op in ((True, True), (True, False), (False, False)):
        for zi in (True, False):
            cpu, gpu, _ = expected(total, layer, gpn, nodes, oo, op, zi, f)
            dev = f"{est.OffloadDeviceEnum.cpu:4}"
            opts = (f"offload_param={dev if op else 'none'}, offload_optimizer={dev if oo else 'none'}, "
                    f"zero_init={int(zi)}")
            rows.append(f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {opts}")
    return rows


def printed(fn, *args, **kw) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert fn(*args, **kw) is None
    return buf.getvalue()


@pytest.mark.parametrize("total,layer,gpn,nodes", SIZES)
def test_all_cold_table(total, layer, gpn, nodes):
    out = printed(est.estimate_zero3_model_states_mem_needs_all_cold, total, layer, gpn, nodes)
    lines = out.splitlines()
    assert lines[0] == "Estimated memory needed for params, optim states and gradients for a:"
    assert lines[1] == (f"HW: Setup with {nodes} node{'s' if nodes > 1 else ''}, "
                        f"{gpn} GPU{'s' if gpn > 1 else ''} per node.")
    assert lines[2] == f"SW: Model with {int(total / 1e6)}M total params, {int(layer / 1e6)}M largest layer params."
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    assert lines[4:] == table(total, layer, gpn, nodes)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)  # 400
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once in the total
        self.scale = torch.nn.Parameter(torch.ones(3))  # the root's own parameter


def test_model_to_params():
    m = Tied()
    # total: 400 + (8*16+16) + (16*8+8) + 3; layers: emb 400, head 400 (its own tied weight), root 3
    assert est.model_to_params(m) == (400 + 144 + 136 + 3, 400)
    # distinct Parameter objects over one storage count once too
    m2 = torch.nn.Module()
    m2.a = torch.nn.Linear(4, 4, bias=False)
    m2.b = torch.nn.Linear(4, 4, bias=False)
    m2.b.weight = torch.nn.Parameter(m2.a.weight.data)
    assert est.model_to_params(m2) == (16, 16)


def test_model_to_params_partitioned():
    """Under zero.Init a parameter's local tensor is empty and ds_numel holds the full size."""
    m = torch.nn.Module()
    m.a = torch.nn.Linear(10, 10)
    m.b = torch.nn.Linear(10, 30)
    for p in m.parameters():
        full = p.numel()
        p.data = torch.empty(0)
        p.ds_numel = full
    assert est.model_to_params(m) == (110 + 330, 330)
    out = printed(est.estimate_zero3_model_states_mem_needs_all_live, m, 2, 1)
    assert out.splitlines()[4:] == table(440, 330, 2, 1)


def test_all_live_matches_cold():
    m = Tied()
    live = printed(est.estimate_zero3_model_states_mem_needs_all_live, m, 4, 2, 1.25)
    assert live == printed(est.estimate_zero3_model_states_mem_needs_all_cold, 683, 400, 4, 2, 1.25)


def _deepspeed_importable() -> bool:
    if not os.path.isdir(os.path.join(DS_REAL, "deepspeed")):
        return False
    probe = subprocess.run([sys.executable, "-c", "import deepspeed.runtime.zero.stage3"], env=_ds_env(),
                           capture_output=True, timeout=300)
    return probe.returncode == 0


def _ds_env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([DS_REAL, DS_DEPS]), DS_ACCELERATOR="cpu",
                OMP_NUM_THREADS="1")


DS_SCRIPT = r"""
import torch, deepspeed.runtime.zero.stage3 as s
class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight
        self.scale = torch.nn.Parameter(torch.ones(3))
print("@@", s.model_to_params(Tied()))
for args in SIZES:
    s.estimate_zero3_model_states_mem_needs_all_cold(*args)
    s.estimate_zero3_model_states_mem_needs_all_cold(*args, additional_buffer_factor=1.0)
s.estimate_zero3_model_states_mem_needs_all_live(Tied(), 4, 2, 1.25)
"""


def test_same_output_as_deepspeed():
    if not os.environ.get("DSC_DEEPSPEED_REAL") or not _deepspeed_importable():
        pytest.skip("runs the real DeepSpeed 0.19.8 when DSC_DEEPSPEED_REAL names a directory it is installed in "
                    "(pip --target; not a project dependency) -- the formula tests above check every figure")
    res = subprocess.run([sys.executable, "-c", f"SIZES = {SIZES!r}\n" + DS_SCRIPT], env=_ds_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = [ln for ln in res.stdout.splitlines() if not ln.startswith("[")]  # drop DeepSpeed's log lines
    ours = [f"@@ {est.model_to_params(Tied())}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for args in SIZES:
            est.estimate_zero3_model_states_mem_needs_all_cold(*args)
            est.estimate_zero3_model_states_mem_needs_all_cold(*args, additional_buffer_factor=1.0)
        est.estimate_zero3_model_states_mem_needs_all_live(Tied(), 4, 2, 1.25)
    ours += buf.getvalue().splitlines()
    assert theirs == ours
