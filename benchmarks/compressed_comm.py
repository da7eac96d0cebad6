"""Communication compression: bytes per step and step time with and without it, side by side in
one run (issue 19). Each section is one function registered in SECTIONS; pick them with
`--sections` (comma-separated, all by default).

    onebit  1-bit Adam against Adam on the same ranks (gloo on CPU, NCCL on GPUs): bytes handed to
            collectives per step after the warm-up (the comms logger's counts) and ms per step,
            correctness first (1-bit Adam's warm-up steps equal Adam-without-bias-correction's).
    zeropp  ZeRO++ (qwZ, qgZ, hpZ) against plain ZeRO-3 on the same ranks: bytes per step by op and
            ms per step, correctness first (benchmarks/zeropp_section.py).

    python benchmarks/compressed_comm.py [--sections onebit,zeropp] [--world 2]

The GPU kernel throughput of sign pack/unpack against copy bandwidth is scripts/onebit_gpu_check.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# --- section: onebit ----------------------------------------------------------------------------


def _onebit_engine(opt: str, hidden: int, layers: int, freeze: int, logger: bool) -> Any:
    import torch

    import deepspeed_c

    torch.manual_seed(0)
    dims = [hidden] * (layers + 1)
    model = torch.nn.Sequential(*[m for a, b in zip(dims, dims[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())])
    params = {"lr": 1e-3} if opt == "Adam" else {"lr": 1e-3, "freeze_step": freeze}
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "optimizer": {"type": opt, "params": params},
           "comms_logger": {"enabled": logger, "prof_all": True}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    return engine


def _onebit_steps(engine: Any, rank: int, steps: int, hidden: int, grads: Any = None) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(8, hidden, generator=g).to(engine.device)
        loss = engine(x).square().mean()
        engine.backward(loss)
        if grads is not None:
            grads.append([p.grad.detach().double().cpu() for p in engine.module.parameters()])
        engine.step()


def _onebit_body(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import time

    import torch

    import deepspeed_c.comm as dc

    h, n_layers, freeze = args.onebit_hidden, args.onebit_layers, 5
    # correctness first: 1-bit Adam's warm-up (set-up step, then Adam without bias correction on the
    # all-reduced gradients) against float64 from the same start and gradients
    engine = _onebit_engine("OneBitAdam", h, n_layers, freeze, logger=False)
    start = [p.detach().double().cpu() for p in engine.module.parameters()]
    grads: list = []
    _onebit_steps(engine, rank, freeze, h, grads)
    m = [torch.zeros_like(p) for p in start]
    v = [torch.zeros_like(p) for p in start]
    want = [p.clone() for p in start]
    for gs in grads[1:]:
        for i, g in enumerate(gs):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            want[i] -= 1e-3 * m[i] / (v[i].sqrt() + 1e-8)
    worst = max(float((p.detach().double().cpu() - w).abs().max() / w.abs().max())
                for p, w in zip(engine.module.parameters(), want))
    # bytes handed to collectives per step, counted by the comms logger in a separate pass
    counted = {}
    for opt in ("Adam", "OneBitAdam"):
        engine = _onebit_engine(opt, h, n_layers, freeze, logger=True)
        _onebit_steps(engine, rank, freeze + 1, h)
        dc.comms_logger.reset_data()
        _onebit_steps(engine, rank, 4, h)
        raw = dc.comms_logger.get_raw_data()
        counted[opt] = {k: sum(size * rec[0] for size, rec in by.items()) / 4 for k, by in raw.items()}
        dc.configure(enabled=False)
    # time per step after the warm-up, interleaved reps, logger off
    engines = {opt: _onebit_engine(opt, h, n_layers, freeze, logger=False) for opt in ("Adam", "OneBitAdam")}
    for e in engines.values():
        _onebit_steps(e, rank, freeze + 2, h)
    ms: dict[str, list[float]] = {k: [] for k in engines}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        for opt, e in engines.items():
            sync()
            t0 = time.perf_counter()
            _onebit_steps(e, rank, args.steps, h)
            sync()
            ms[opt].append((time.perf_counter() - t0) * 1e3 / args.steps)
    params = sum(p.numel() for p in engines["Adam"].module.parameters())
    return {"worst": worst, "counted": counted, "ms": {k: min(v) for k, v in ms.items()}, "params": params,
            "device": str(engines["Adam"].device)}


def onebit_section(args: argparse.Namespace) -> None:
    """1-bit Adam against Adam (the engine's FusedAdam) on the same ranks: an MLP of --onebit_layers
    square layers of --onebit_hidden, micro-batch 8, freeze_step 5."""
    from tests.harness import run_distributed

    res = run_distributed(_onebit_body, args.world, args=(args,), timeout=1200)
    r0 = res[0]
    print(f"MLP {r0['params'] / 1e6:.2f}M params, {args.world} ranks on {r0['device'].split(':')[0]}; "
          f"1-bit Adam warm-up vs float64: rel {max(r['worst'] for r in res):.1e}")
    print("bytes handed to collectives per step after the warm-up (comms logger, separate pass); ms/step from "
          "runs without the logger, best of 3 interleaved reps")
    # "ring" bytes each rank sends: 2(W-1)/W x an all-reduce's tensor, (W-1)/W x an all-to-all's, (W-1) x an
    # all-gather's input (what the logger counts)
    w = args.world

    def ring(counted: dict[str, float]) -> float:
        f = {"all_reduce": 2 * (w - 1) / w, "onebit_all_to_all": (w - 1) / w}
        return sum(v * f.get(k, w - 1 if "all_gather" in k else 0.0) for k, v in counted.items())

    adam_ring = ring(r0["counted"]["Adam"])
    for opt in ("Adam", "OneBitAdam"):
        b = sum(r0["counted"][opt].values())
        ops = ", ".join(f"{k} {v:,.0f}" for k, v in r0["counted"][opt].items() if v)
        print(f"  {opt:<11} {b:>12,.0f} B/step handed, ring {ring(r0['counted'][opt]) / adam_ring:.4f} of Adam's; "
              f"{r0['ms'][opt]:>8.2f} ms/step ({r0['ms']['Adam'] / r0['ms'][opt]:.2f}x Adam's speed)   [{ops}]")


# --- section: zeropp (benchmarks/zeropp_section.py) ----------------------------------------------
def zeropp_section(args: argparse.Namespace) -> None:
    from benchmarks.zeropp_section import run

    run(args)


# --- section registry (one line per section) ----------------------------------------------------
SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "onebit": onebit_section,
    "zeropp": zeropp_section,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--world", type=int, default=2, help="ranks (gloo on CPU, one GPU each with NCCL)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--onebit_hidden", type=int, default=1024, help="onebit: width of the MLP's square layers")
    ap.add_argument("--onebit_layers", type=int, default=4, help="onebit: number of layers")
    args = ap.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    for name in chosen:
        print(f"== {name} ==")
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
