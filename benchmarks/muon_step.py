"""The Muon optimizer step over a GPT's weight matrices: deepspeed_c's MuonWithAuxAdam against DeepSpeed's
(deepspeed.runtime.zero.muon.original_muon.SingleDeviceMuonWithAuxAdam, when the real DeepSpeed is
importable), side by side in one process.

The default is a 1.3B GPT (24 layers, d 2048, MLP 4x): per layer the fused qkv (6144 x 2048), the attention
output (2048 x 2048), the MLP up (8192 x 2048) and down (2048 x 8192) weights, 96 matrices, 1.21B elements,
fp32 parameters, gradients and momentum on the GPU (embeddings, gains and biases take the auxiliary Adam and
are left out: the step's cost is Newton-Schulz). Each side gets its own copy of the parameters.

Correctness first: from the same parameters, gradients and zero momentum, one step of each; the updates
(parameter deltas) must agree per matrix within 16-bit Newton-Schulz rounding (5e-2 norm-wise relative),
and one matrix of each shape is checked against the float64 host iteration. Then --reps timed steps of each,
interleaved (ours, DeepSpeed's, ours, ...), each between device synchronisations; prints the medians and
the ratio DeepSpeed / deepspeed_c (above 1: ours is faster).

    python benchmarks/muon_step.py [--n_layer 24] [--d 2048] [--ns_method gram|standard] [--reps 10]
    python benchmarks/muon_step.py --tiny     # a CPU smoke run: 2 layers, d 64, 2 reps"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from the checkout

from deepspeed_c.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # noqa: E402
from deepspeed_c.runtime.zero.muon.newton_schulz import aspect_scale, newton_schulz_reference  # noqa: E402

TOL_VS_DEEPSPEED = 5e-2  # both sides orthogonalise in 16 bits on a GPU (bf16 standard / fp16 gram)


def gpt_matrix_shapes(n_layer: int, d: int) -> list[tuple[int, int]]:
    return [s for _ in range(n_layer) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def deepspeed_muon() -> Optional[type]:
    """DeepSpeed's single-device MuonWithAuxAdam, or None when only deepspeed_c (or its alias) is there."""
    try:
        from deepspeed.runtime.zero.muon import original_muon
    except Exception as e:  # not installed, or it fails to import on this machine
        print(f"DeepSpeed's Muon is not importable ({type(e).__name__}: {e}); timing deepspeed_c alone")
        return None
    if "deepspeed_c" in (getattr(original_muon, "__file__", "") or ""):
        print("`deepspeed` is deepspeed_c's compat alias, not DeepSpeed; timing deepspeed_c alone")
        return None
    return original_muon.SingleDeviceMuonWithAuxAdam


def make_side(cls: type, params0: list[torch.Tensor], grads: list[torch.Tensor], lr: float,
              ns_method: str) -> tuple[Any, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = cls([dict(params=params, use_muon=True, lr=lr, momentum=0.95, weight_decay=0.0, ns_method=ns_method)])
    return opt, params


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def check(params0: list[torch.Tensor], grads: list[torch.Tensor], lr: float, ns_method: str,
          ds_cls: Optional[type]) -> None:
    ours, ours_p = make_side(MuonWithAuxAdam, params0, grads, lr, ns_method)
    ours.step()
    deltas = [(p0 - p.detach()) / lr for p0, p in zip(params0, ours_p)]
    refs: dict[tuple[int, ...], torch.Tensor] = {}
    for d, g in zip(deltas, grads):
        shape = tuple(g.shape)
        if shape in refs:
            continue
        # first step from zero momentum: the blend is (1 - beta^2) g, orthogonalised and scaled
        want = refs[shape] = newton_schulz_reference(g * (1 - 0.95 ** 2)) * aspect_scale(shape)
        err = rel(d.cpu(), want)
        tol = 1e-4 if d.device.type == "cpu" else TOL_VS_DEEPSPEED
        print(f"  deepspeed_c vs float64 reference {shape}: {err:.2e}")
        assert err < tol, f"deepspeed_c's update of a {shape} matrix is off the float64 reference by {err:.2e}"
    del ours, ours_p
    if ds_cls is None:
        return
    theirs, theirs_p = make_side(ds_cls, params0, grads, lr, ns_method)
    theirs.step()
    ds_deltas = [(p0 - p.detach()) / lr for p0, p in zip(params0, theirs_p)]
    for shape, want in refs.items():
        k = next(i for i, g in enumerate(grads) if tuple(g.shape) == shape)
        print(f"  DeepSpeed   vs float64 reference {shape}: {rel(ds_deltas[k].cpu(), want):.2e}")
    worst = max(rel(d, e) for d, e in zip(deltas, ds_deltas))
    print(f"  deepspeed_c vs DeepSpeed, worst matrix update: {worst:.2e}")
    assert worst < TOL_VS_DEEPSPEED, f"updates differ from DeepSpeed's by {worst:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ns_method", choices=("gram", "standard"), default="gram")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 layers, d 64, 2 reps")
    args = ap.parse_args()
    if args.tiny:
        args.n_layer, args.d, args.reps = 2, 64, 2
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --tiny for a CPU smoke run)")
        device = torch.device("cuda")
    lr = 0.02
    shapes = gpt_matrix_shapes(args.n_layer, args.d)
    numel = sum(r * c for r, c in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    params0 = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device) * 1e-2 for s in shapes]
    print(f"{device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}  torch {torch.__version__}  "
          f"{len(shapes)} matrices, {numel / 1e6:.2f}M elements (GPT {args.n_layer} layers, d {args.d}), "
          f"ns_method {args.ns_method}")
    ds_cls = deepspeed_muon()
    print("correctness (one step from the same state):")
    check(params0, grads, lr, args.ns_method, ds_cls)
    sides = {"deepspeed_c": make_side(MuonWithAuxAdam, params0, grads, lr, args.ns_method)[0]}
    if ds_cls is not None:
        sides["DeepSpeed"] = make_side(ds_cls, params0, grads, lr, args.ns_method)[0]
    del params0
    for opt in sides.values():  # warm-up: allocator, cuBLAS handles, DeepSpeed's torch.compile
        timed(opt.step, device)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.reps):
        for name, opt in sides.items():
            times[name].append(timed(opt.step, device))
    for name, ts in times.items():
        print(f"{name:12s} step median {statistics.median(ts) * 1e3:9.2f} ms  (min {min(ts) * 1e3:.2f}, "
              f"{len(ts)} reps)")
    if "DeepSpeed" in times:
        ratio = statistics.median(times["DeepSpeed"]) / statistics.median(times["deepspeed_c"])
        print(f"ratio DeepSpeed / deepspeed_c: {ratio:.2f}x")


if __name__ == "__main__":
    main()
