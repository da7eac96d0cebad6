"""The largest GPT (examples/train_gpt) that trains with ZeRO stage 3 on one GPU when parameters and
optimizer state are offloaded to NVMe (ZeRO-Infinity) against offloaded to host memory (ZeRO-Offload),
and tokens/s of each.

Each trial runs in its own process (a host out-of-memory kill or a CUDA OOM ends that trial only):
deepspeed_c.zero.Init from the config (the weights never whole on the GPU), bf16, AdamW (the C CPU
Adam), `offload_param` and `offload_optimizer` both on `--device` (cpu: pinned host memory; nvme: swap
files under --nvme_path, the `aio` section from --aio or dsc_nvme_tune's output), micro-batch
--micro x --seq tokens, 1 warm-up step then --steps timed steps. Per device the model grows by
--layers (ascending) until a trial fails; the last one that trained is the largest.

Correctness first: a small model (2 layers) trains 3 steps with `device: cpu` and with `device: nvme`
from the same weights and batches; their losses must agree bit for bit (the NVMe path runs the same
kernels on the same bytes) before any search starts.

    python benchmarks/nvme_largest.py --nvme_path /local_nvme/dsc_swap [--n_embd 4096 --n_head 32]
        [--layers 4,8,12,16,24,32,40,48] [--seq 1024] [--micro 1] [--steps 2] [--devices cpu,nvme]
        [--aio '{"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 8}']

Prints one JSON line per trial and a summary table (largest model per device, its parameters,
tokens/s, step time, peak host RSS and peak GPU memory). Disk space: an NVMe trial needs about 14
bytes a parameter under --nvme_path (bf16 parameters + fp32 master and two Adam moments); the run
checks this at initialize and fails that trial with the bytes needed."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nparams(n_embd: int, n_layer: int, vocab: int, seq: int) -> int:
    return (vocab * 2 + seq) * n_embd + n_layer * (12 * n_embd ** 2 + 13 * n_embd)


def config(args: argparse.Namespace, device: str) -> dict:
    offload_p = {"device": device, "pin_memory": True}
    offload_o = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload_p["nvme_path"] = offload_o["nvme_path"] = args.nvme_path
        # every parameter on NVMe (DeepSpeed's default max_in_cpu keeps the first 1e9 elements on the host);
        # swap-in buffers large enough for the embedding, the largest module (one GPU: its whole weight)
        offload_p.update(max_in_cpu=0, buffer_size=max(int(1e8), args.vocab * args.n_embd))
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "offload_param": offload_p, "offload_optimizer": offload_o,
                                 "sub_group_size": int(args.sub_group_size),
                                 "stage3_param_persistence_threshold": 0}}
    if device == "nvme":
        cfg["aio"] = json.loads(args.aio)
    return cfg


def child(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))
    sys.path.insert(0, ROOT)
    import deepspeed_c
    from model import GPT, GPTConfig

    deepspeed_c.init_distributed()
    cfg = config(args, args.device)
    mcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)
    torch.manual_seed(0)
    with deepspeed_c.zero.Init(config_dict_or_path=cfg):
        model = GPT(mcfg)
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1)
    dev = engine.device
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a CPU run only smoke-tests the script
    losses, times = [], []
    for step in range(args.steps + 1):
        idx = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
        sync()
        t = time.perf_counter()
        loss = engine(idx[:, :-1].to(dev), idx[:, 1:].to(dev))
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    timed = times[1:] or times
    step_s = sorted(timed)[len(timed) // 2]
    print("RESULT " + json.dumps({
        "device": args.device, "n_layer": args.n_layer, "params": nparams(args.n_embd, args.n_layer, args.vocab,
                                                                         args.seq),
        "ok": all(l == l and abs(l) < 1e4 for l in losses), "losses": losses, "step_s": step_s,
        "tokens_per_s": args.micro * args.seq / step_s,
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}), flush=True)


def trial(args: argparse.Namespace, device: str, n_layer: int, steps: int, n_embd: int, n_head: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", device, "--n_layer", str(n_layer),
           "--steps", str(steps), "--n_embd", str(n_embd), "--n_head", str(n_head), "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--micro", str(args.micro), "--sub_group_size", str(args.sub_group_size),
           "--aio", args.aio, "--nvme_path", args.nvme_path]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + n_layer % 400))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall_s"] = time.perf_counter() - t
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"device": device, "n_layer": n_layer, "ok": False, "rc": proc.returncode, "error": " | ".join(tail),
            "params": nparams(n_embd, n_layer, args.vocab, args.seq)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme_path", required=True)
    ap.add_argument("--devices", default="cpu,nvme")
    ap.add_argument("--layers", default="4,8,12,16,24,32,40,48")
    ap.add_argument("--n_embd", type=int, default=4096)
    ap.add_argument("--n_head", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sub_group_size", type=float, default=1e8)
    ap.add_argument("--aio", default='{"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 8}')
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--n_layer", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    os.makedirs(args.nvme_path, exist_ok=True)
    # correctness first: the same small run on both devices, losses bit-equal
    small = {d: trial(args, d, 2, 3, 256, 4) for d in ("cpu", "nvme")}
    print("check " + json.dumps(small), flush=True)
    if not (small["cpu"].get("ok") and small["nvme"].get("ok") and small["cpu"]["losses"] == small["nvme"]["losses"]):
        sys.exit("correctness check failed: cpu and nvme offload disagree on the small model (see above)")
    print("check: cpu and nvme offload losses equal bit for bit on the small model", flush=True)
    best: dict[str, dict] = {}
    for device in args.devices.split(","):
        for n_layer in (int(x) for x in args.layers.split(",")):
            res = trial(args, device, n_layer, args.steps, args.n_embd, args.n_head)
            print(json.dumps(res), flush=True)
            if not res.get("ok"):
                break
            best[device] = res
    print("\n| offload | largest n_layer | parameters | tokens/s | s/step | peak host RSS GiB | peak GPU GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for device, r in best.items():
        print(f"| {device} | {r['n_layer']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_s']:.0f} | {r['step_s']:.1f} | "
              f"{r['peak_host_rss_gib']:.1f} | {r['peak_gpu_gib']:.1f} |")


if __name__ == "__main__":
    main()
