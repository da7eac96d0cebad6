"""Activation memory per rank under Ulysses sequence parallelism (ALST for Hugging Face models).

A LLaMA-style transformers model (from a config, no download) runs one forward + loss on a sequence of
--seq tokens at each SP degree in --sp; degree P is a real run of P processes (NCCL, one GPU each, on a
GPU host; gloo on the host otherwise) with UlyssesSPAttentionHF registered in transformers and every
rank holding seq / P tokens (its slice, as UlyssesSPDataLoaderAdapter cuts it).

Measured per rank:
  saved MiB    bytes of the distinct tensor storages autograd saves for backward during the forward
               (parameters excluded): the activation memory that lives until backward
  peak MiB     (GPU only) torch.cuda.max_memory_allocated over the forward minus what was allocated
               before it: saved activations plus the forward's transient buffers
and the ratio of each to SP 1's (1/P is the ideal; attention's q/k/v all-to-all buffers and the
gathered position_ids do not shrink with P).

Correctness first: each degree's loss (the whole sequence's mean-token loss, combined over the ranks)
must equal SP 1's within the dtype's tolerance; a degree that disagrees is reported and not counted.

    python benchmarks/sp_activation_memory.py [--device cuda] [--seq 16384] [--sp 1 2 4] [--dtype bf16]
                                              [--hidden 1024] [--layers 4] [--heads 16] [--kv-heads 4]
--device cpu (the default without a GPU) runs gloo ranks with a short sequence: the same measurement."""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if on_gpu else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--seq", type=int, default=16384 if on_gpu else 1024)
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--hidden", type=int, default=1024 if on_gpu else 256)
    ap.add_argument("--layers", type=int, default=4 if on_gpu else 2)
    ap.add_argument("--heads", type=int, default=16 if on_gpu else 8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000 if on_gpu else 4096)
    return ap.parse_args()


def _model(a: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75) // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(a.seq, 2048), attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


class SavedBytes:
    """Counts the distinct non-parameter storages autograd saves (saved_tensors_hooks)."""

    def __init__(self, params: list) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.bytes += s.nbytes()
        return t

    def __enter__(self) -> "SavedBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: "torch.multiprocessing.Queue") -> None:
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    device = torch.device(f"cuda:{rank}" if a.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = _model(a, device, dtype)
    group = None
    if world > 1:
        from deepspeed_c.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1)
        group = mpu.get_sequence_parallel_group()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (1, a.seq), generator=g)
    target = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    chunk = a.seq // world
    lo = rank * chunk
    ids_l, pos_l = ids[:, lo:lo + chunk].to(device), torch.arange(lo, lo + chunk, device=device)[None]
    target_l = target[:, lo:lo + chunk].to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with SavedBytes(list(model.parameters())) as saved:
        logits = model(input_ids=ids_l, position_ids=pos_l).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab), target_l.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
    peak = (torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else 0
    total = loss_sum.detach().reshape(1).to(torch.float64)
    count = (target_l != -100).sum().reshape(1).to(torch.float64)
    if group is not None:
        tdist.all_reduce(total, group=group)
        tdist.all_reduce(count, group=group)
    if device.type == "cuda":  # the backward runs on a GPU (its memory is not the subject; on the host it only costs time)
        loss_sum.backward()
    row = torch.tensor([saved.bytes, peak], dtype=torch.float64, device=device)
    rows = [torch.zeros_like(row) for _ in range(world)]
    tdist.all_gather(rows, row)
    if rank == 0:
        out.put({"loss": (total / count).item(), "saved": [r[0].item() for r in rows],
                 "peak": [r[1].item() for r in rows]})
    tdist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_degree(a: argparse.Namespace, world: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, a.port, a, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=1800)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"SP {world}: a rank exited with {p.exitcode}")
    return result


def main() -> None:
    a = parse()
    if a.device == "cuda" and torch.cuda.device_count() < max(a.sp):
        sys.exit(f"--sp {max(a.sp)} needs {max(a.sp)} GPUs (one rank each, NCCL); {torch.cuda.device_count()} "
                 "visible")
    for p in a.sp:
        if a.seq % p or a.heads % p:
            sys.exit(f"--seq {a.seq} and --heads {a.heads} must divide by every --sp degree ({p})")
    tol = 2e-2 if a.dtype == "bf16" else 1e-4
    print(f"# device={a.device} dtype={a.dtype} seq={a.seq} hidden={a.hidden} layers={a.layers} heads={a.heads} "
          f"kv_heads={a.kv_heads} vocab={a.vocab}")
    print(f"{'SP':>3} {'loss':>10} {'ok':>3} {'saved MiB/rank':>15} {'x SP1':>7} {'peak MiB/rank':>14} {'x SP1':>7}")
    base = None
    for p in a.sp:
        a.port = _free_port()
        r = run_degree(a, p)
        saved, peak = max(r["saved"]), max(r["peak"])
        if base is None:
            base = (r["loss"], saved, peak)
        ok = abs(r["loss"] - base[0]) <= tol * max(1.0, abs(base[0]))
        if not ok:
            print(f"{p:>3} {r['loss']:>10.5f}  NO (SP 1 loss {base[0]:.5f}): not counted")
            continue
        peak_cols = (f"{peak / 2**20:>14.1f} {peak / base[2]:>7.3f}" if base[2] > 0 else f"{'-':>14} {'-':>7}")
        print(f"{p:>3} {r['loss']:>10.5f} {'yes':>3} {saved / 2**20:>15.1f} {saved / base[1]:>7.3f} {peak_cols}")


if __name__ == "__main__":
    main()
