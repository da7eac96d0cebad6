"""The whole training step of deepspeed_c against the real DeepSpeed, side by side in one process
on one GPU: the same GPT, the same config (bf16, ZeRO stage 0/1/2, AdamW, clipping), the same
batches. A third engine is deepspeed_c with its one-pass optimizer epilogue turned off
(DSC_FUSED_EPILOGUE=0: separate up-cast, clip, Adam and cast passes, the engine before the epilogue
went on the training path). Correctness first (losses of the first steps agree within bf16
tolerance), then interleaved timed blocks of whole engine steps (forward + backward + step,
synchronised at block ends). Prints tokens/s, the step time, the time of `engine.step()` alone
(CUDA events around it), peak device memory of each engine's block and the ratios.

Needs the real DeepSpeed importable as `deepspeed` (never installed into the project: see
scripts/device_deepspeed.sh for how the device run installs it from a carried sdist).

    python benchmarks/engine_vs_deepspeed.py [--n_embd 2048] [--n_layer 16] [--seq 1024] [--micro 4]
                                             [--stage 2] [--blocks 4] [--steps 5]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))


def ds_config(args: argparse.Namespace) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": args.stage, "reduce_bucket_size": int(args.bucket),
                                  "allgather_bucket_size": int(args.bucket), "overlap_comm": True,
                                  "contiguous_gradients": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=2048)
    ap.add_argument("--n_layer", type=int, default=16)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--bucket", type=float, default=5e8)
    ap.add_argument("--blocks", type=int, default=4, help="timed blocks per engine, interleaved")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import deepspeed  # the real one
    import deepspeed_c
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    base = GPT(cfg)
    nparams = sum(p.numel() for p in base.parameters())
    print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  DeepSpeed {deepspeed.__version__}  "
          f"deepspeed_c {deepspeed_c.__version__}", flush=True)
    print(f"GPT {nparams / 1e6:.1f}M params (d {args.n_embd}, {args.n_layer} layers, seq {args.seq}, micro "
          f"{args.micro}), bf16, ZeRO stage {args.stage}, AdamW, clipping 1.0", flush=True)
    engines = {}
    for name, lib in (("deepspeed_c", deepspeed_c), ("dsc-separate", deepspeed_c), ("DeepSpeed", deepspeed)):
        model = copy.deepcopy(base)
        os.environ["DSC_FUSED_EPILOGUE"] = "0" if name == "dsc-separate" else "1"
        engines[name], *_ = lib.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args))
        os.environ.pop("DSC_FUSED_EPILOGUE")
        torch.cuda.synchronize()
        print(f"{name:12s} initialised: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated in all",
              flush=True)
    del base
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).cuda(),
                torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).cuda()) for _ in range(8)]

    step_events: list = []

    def step(engine, k: int) -> torch.Tensor:
        x, y = batches[k % len(batches)]
        loss = engine(x, y)
        engine.backward(loss)
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
        engine.step()
        ev[1].record()
        step_events.append(ev)
        return loss.detach()

    losses = {name: [step(e, k).item() for k in range(args.check)] for name, e in engines.items()}
    for k in range(args.check):
        a, s_, b = losses["deepspeed_c"][k], losses["dsc-separate"][k], losses["DeepSpeed"][k]
        print(f"check step {k}: loss deepspeed_c {a:.5f}  separate passes {s_:.5f}  DeepSpeed {b:.5f}  "
              f"rel diff {abs(a - b) / abs(b):.2e}", flush=True)
        assert abs(a - b) <= 2e-2 * abs(b), "losses disagree beyond bf16 tolerance: not timing"
        assert abs(a - s_) <= 2e-2 * abs(s_), "the epilogue changes the losses beyond bf16 tolerance: not timing"
    times: dict[str, list[float]] = {n: [] for n in engines}
    opt_ms: dict[str, list[float]] = {n: [] for n in engines}
    peaks: dict[str, int] = {n: 0 for n in engines}
    k = args.check
    for _ in range(args.blocks):
        for name, e in engines.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step_events.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(e, k)
                k += 1
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.steps)
            opt_ms[name] += [a.elapsed_time(b) for a, b in step_events]
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    tokens = args.micro * args.seq
    med = {n: statistics.median(v) for n, v in times.items()}
    for name in engines:
        print(f"{name:12s} step {med[name] * 1e3:8.1f} ms  {tokens / med[name]:9.0f} tokens/s  "
              f"engine.step() {statistics.median(opt_ms[name]):7.2f} ms  "
              f"peak {peaks[name] / 2**30:6.2f} GiB (all engines resident)  blocks "
              f"{', '.join(f'{t * 1e3:.1f}' for t in times[name])} ms", flush=True)
    print(f"ratio deepspeed_c / DeepSpeed tokens/s: {med['DeepSpeed'] / med['deepspeed_c']:.3f}x", flush=True)
    print(f"ratio deepspeed_c / deepspeed_c with separate passes tokens/s: "
          f"{med['dsc-separate'] / med['deepspeed_c']:.3f}x; engine.step() "
          f"{statistics.median(opt_ms['dsc-separate']) / statistics.median(opt_ms['deepspeed_c']):.2f}x", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
