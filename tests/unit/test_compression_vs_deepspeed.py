"""deepspeed_c's compression library against DeepSpeed 0.19.6, pinned in tests/fixtures/compression/ds0196.pt
(made by make_fixtures.py from the real library on CPU): for every technique and a combined config, the
state-dict keys and shapes, pruning masks / scores and static ranges after init_compression, the outputs of two
SGD steps and of eval, the trained state (quantized weights included) and redundancy_clean's shapes and outputs.
Set DSC_DEEPSPEED_196=/path/to/deepspeed-0.19.6 to regenerate the fixture live and compare against that too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.compression import cases

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests/fixtures/compression/ds0196.pt"
OURS = cases.library("deepspeed_c")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def pinned() -> dict:
    return _load(FIXTURE)


def _same_state(ours: dict[str, torch.Tensor], ref: dict, what: str, exact: bool) -> None:
    ref_state = cases.unpack(ref)
    assert list(ours) == list(ref_state), f"{what}: keys differ"
    for k, v in ours.items():
        assert tuple(v.shape) == tuple(ref_state[k].shape), f"{what}: {k} shape"
        if exact:
            assert torch.equal(v.float(), ref_state[k]), f"{what}: {k} differs"
        else:
            torch.testing.assert_close(v.float(), ref_state[k], atol=1e-6, rtol=1e-5, msg=f"{what}: {k}")


def check_case(name: str, ref: dict) -> None:
    rec = cases.run_case(OURS, name)
    init = rec["init_state"]
    assert {k: tuple(v.shape) for k, v in init.items()} == ref["init_keys"]
    assert list(init) == list(ref["init_keys"])  # the order too
    masks = {k: v for k, v in init.items() if "mask" in k or "scores" in k or "x_min_max" in k}
    _same_state(masks, ref["init_masks"], f"{name} init masks", exact=True)
    for key in ("train_out0", "train_out1", "eval_out", "clean_out"):
        torch.testing.assert_close(rec[key], ref[key], atol=1e-6, rtol=1e-6, msg=f"{name} {key}")
    _same_state(rec["trained_state"], ref["trained_state"], f"{name} trained", exact=False)
    _same_state(rec["clean_state"], ref["clean_state"], f"{name} clean", exact=False)


@pytest.mark.parametrize("name", list(cases.CASES))
def test_case_matches_deepspeed(pinned: dict, name: str) -> None:
    check_case(name, pinned["cases"][name])


def test_quantizers_bit_equal(pinned: dict) -> None:
    for dtype, key in ((torch.float32, "quant"), (torch.float16, "quant_f16")):
        ours = cases.run_quant(OURS, dtype)
        for case, ref in pinned[key].items():
            if case.startswith(("Sym", "Asym")):  # max / min reductions and elementwise: bit-equal anywhere
                assert torch.equal(ours[case], ref), f"{key} {case}"
            else:  # ternary / binary scale by a float sum whose order may differ between CPUs by an ulp
                torch.testing.assert_close(ours[case], ref, atol=0, rtol=2e-3 if dtype == torch.float16 else 2e-7,
                                           msg=f"{key} {case}")
                assert torch.equal(ours[case] > 0, ref > 0) and torch.equal(ours[case] < 0, ref < 0)


def test_moq_schedule_matches_deepspeed(pinned: dict) -> None:
    for case, ref in pinned["moq"].items():
        ours = cases.run_moq(OURS, case)
        assert torch.equal(ours["bits"], ref["bits"]), case
        assert torch.equal(ours["periods"], ref["periods"]), case
        torch.testing.assert_close(ours["values"], ref["values"], atol=1e-6, rtol=1e-6, msg=case)


@pytest.mark.skipif(not os.environ.get("DSC_DEEPSPEED_196"), reason="set DSC_DEEPSPEED_196 to a DeepSpeed 0.19.6 "
                    "install to compare live")
def test_live_against_deepspeed_0196(tmp_path: Path) -> None:
    out = tmp_path / "live.pt"
    env = {**os.environ, "PYTHONPATH": os.environ["DSC_DEEPSPEED_196"]}
    subprocess.run([sys.executable, str(ROOT / "tests/fixtures/compression/make_fixtures.py"), "--out", str(out)],
                   check=True, env=env, cwd=tmp_path, timeout=600)
    live = _load(out)
    for name in cases.CASES:
        check_case(name, live["cases"][name])
    for case, ref in live["quant"].items():  # same machine: bit-equal, ternary and binary too
        assert torch.equal(cases.run_quant(OURS)[case], ref), case
