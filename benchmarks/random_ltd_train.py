"""random-LTD against dense training of the same GPT (benchmarks/data_efficiency.py `train`, or run this file).

A GPT of n_layer pre-LN blocks (causal SDPA + 4x MLP, bf16); the random-LTD copy wraps all but the first and
last block in RandomLayerTokenDrop. Both start from the same weights and see the same batches of a learnable
synthetic sequence task, steps interleaved (dense step i, random-LTD step i, dense step i + 1, ...).

Schedule: the kept length ramps from seq * min_frac to seq over the first ramp_frac of the run (DeepSpeed's
recipe ramps over most of training: its GPT-3 350M example keeps 128 -> 2048 tokens in steps of 16 over
200k steps; a short run gets the same shape of schedule sized to its length), then full length. Every kept
length is a new attention shape; cuDNN's SDPA (torch's pick on sm_90) builds a plan for each (~0.1 s), the
flash backend has none. A real run meets a new length every ~1,700 steps; here one comes every few steps,
so those steps are reported on their own row (a one-time cost) and in the total.

Printed, correctness first: the wrapped block on the kept tokens equals the bare block on the same tokens
(dropped tokens unchanged), the sampler equals torch.multinomial's draw, and the eval loss of both after the
same tokens (bar: random-LTD within 1%); then one table of ms/step per phase, dense and random-LTD side by
side with the ratio; then one active (mid-ramp, not timed) step of each under the profiler: device-busy ms
(the kernels' time) against the step's wall ms, and the host syncs it makes. Busy far below wall means the
step waits on the host (Python, launches, syncs), not on the GPU."""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from the checkout

import deepspeed_c  # noqa: E402
from deepspeed_c.ops.random_ltd import gpt_sample_tokens, token_gather  # noqa: E402
from deepspeed_c.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd  # noqa: E402

SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
_BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "math": "MATH"}


class Block(torch.nn.Module):

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # random-LTD keeps tokens in order, so causal attention over the kept ones is their causal attention
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):

    def __init__(self, layers: int, d: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[:tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x[:, :-1])).float()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def batch(micro: int, seq: int, vocab: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Arithmetic sequences mod vocab (a start and a stride per sample) with 10% of tokens replaced by noise:
    the stride is inferred from the context, so the loss falls well below log(vocab)."""
    start = torch.randint(0, vocab, (micro, 1), generator=gen)
    stride = torch.randint(1, 16, (micro, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq)) % vocab
    noise = torch.rand(micro, seq, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, (micro, seq), generator=gen), tokens)
    return tokens.to(device)


def engine_for(model: torch.nn.Module, layers: int, seq: int, micro: int, ltd: Optional[dict] = None) -> Any:
    """A bf16 Adam engine; `ltd` = {"min_value", "require_steps", "seq_per_step"} turns random-LTD on for the
    middle layers."""
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
                           "steps_per_print": 10**9, "bf16": {"enabled": True},
                           "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}
    if ltd:
        cfg["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": layers - 2,
            "random_ltd_layer_id": list(range(1, layers - 1)), "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": ltd["min_value"], "max_value": seq, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": ltd["require_steps"],
                                                        "seq_per_step": ltd["seq_per_step"]}}}}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    return convert_to_random_ltd(engine, Block) if ltd else engine


def sdpa_context(name: str) -> contextlib.AbstractContextManager:
    """The model's attention backend, the same for both systems ('auto': torch's own pick)."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"--sdpa must be one of {', '.join(SDPA_BACKENDS)}, got {name!r}")
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, _BACKEND_NAMES[name]))


def train_step(engine: Any, tokens: torch.Tensor, sdpa: str) -> torch.Tensor:
    with sdpa_context(sdpa):  # the forward picks the kernel; its backward follows the pick
        loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss


def check_kept_tokens(ltd_engine: Any, micro: int, seq: int, d: int, sdpa: str, device: torch.device) -> str:
    """The first wrapped block (it draws the kept positions) on a random input: kept positions hold the bare
    block's output on the gathered tokens, the others the input. Run before training; 'OK' when bit-equal."""
    wrapped = ltd_engine.module.blocks[1]
    dtype = next(wrapped.parameters()).dtype
    x = torch.randn(micro, seq, d, device=device, dtype=dtype)
    with torch.no_grad(), sdpa_context(sdpa):
        out = wrapped(x)
        idx = ltd_engine.random_ltd_scheduler.get_sample()[0][0]
        err = (token_gather(out, idx, True).float() - wrapped.random_ltd_layer(token_gather(x, idx, True)).float())
    dropped = torch.ones(micro, seq, dtype=torch.bool, device=device)
    dropped.scatter_(1, idx.long(), False)
    if idx.shape[1] >= seq or not torch.equal(out[dropped], x[dropped]):
        return "MISMATCH (dropped tokens changed or none dropped)"
    worst = float(err.abs().max())
    return "OK" if worst == 0 else f"max|diff| {worst:.2e}"


def check_sampler(device: torch.device) -> bool:
    """gpt_sample_tokens draws what torch.multinomial over ones draws from the same generator state."""
    layers, b, s, k = 22, 4, 2048, 768
    state = torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()
    ours = gpt_sample_tokens(k, s, b, layers, device)[0]
    (torch.cuda.set_rng_state if device.type == "cuda" else torch.set_rng_state)(state)
    ref = torch.multinomial(torch.ones(layers * b, s, device=device), k).sort(-1).values
    return torch.equal(ours, ref.reshape(layers, b, k).to(torch.int32))


@contextlib.contextmanager
def _count_syncs(on: bool) -> Iterator[list]:
    """Records the warnings of torch's sync debug mode: one per host sync (CUDA only)."""
    if not on:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def diagnose_step(engine: Any, tokens: torch.Tensor, sdpa: str, show_profile: bool) -> dict[str, float]:
    """One step under the profiler: device-busy ms (the kernels' own time), wall ms, host syncs (loss read
    excluded)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = tokens.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        with _count_syncs(cuda) as caught:
            loss = train_step(engine, tokens, sdpa)
        loss.item()
        wall = (time.perf_counter() - t) * 1e3
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # the kernels' (and copies') own time, as the profiler table's total counts it
    busy = (sum(e.self_device_time_total for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e3
            if cuda else float("nan"))
    if show_profile:
        print(events.table(sort_by=attr, row_limit=10, max_name_column_width=48))
    return {"busy": busy, "wall": wall, "syncs": float(syncs) if cuda else float("nan")}


def _flop_ratio(kept: int, seq: int, d: int, layers: int) -> float:
    """random-LTD's block FLOPs over dense's at this kept length (per block: the linears' 24 d^2 per token,
    causal attention's 2 d per token pair kept; the first and last block at full length): the ideal ratio."""
    def block(k: int) -> float:
        return 24 * d * d * k + 2 * d * k * k
    return (2 * block(seq) + (layers - 2) * block(kept)) / (layers * block(seq))


def _rows(kept: list[int], new: list[bool], seq: int) -> list[tuple[str, Callable[[int], bool]]]:
    return [("ramp, seen kept length", lambda i: kept[i] < seq and not new[i]),
            ("ramp, new kept length *", lambda i: kept[i] < seq and new[i]),
            ("full length", lambda i: kept[i] >= seq),
            ("all timed (the bar)", lambda i: True)]


def bench_train(layers: int, seq: int, d: int, micro: int, steps: int, warmup: int, vocab: int = 1024,
                seq_per_step: int = 256, ramp_frac: float = 0.8, min_frac: float = 0.25, sdpa: str = "auto",
                profile: bool = False) -> dict[str, float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not 0 < ramp_frac <= 1 or not 0 < min_frac <= 1:
        raise ValueError(f"--ramp_frac and --min_frac must be in (0, 1], got {ramp_frac}, {min_frac}")
    sdpa_context(sdpa)  # a bad name fails before the models are built
    torch.manual_seed(0)
    with device:  # initialized and copied where it trains (a 24 x 1024 GPT's host init and copies take seconds)
        base = GPT(layers, d, seq, vocab)
    ramp = max(1, round(steps * ramp_frac))
    ltd = {"min_value": max(1, int(seq * min_frac)), "require_steps": ramp, "seq_per_step": seq_per_step}
    engines = {"dense": engine_for(copy.deepcopy(base), layers, seq, micro),
               "random-LTD": engine_for(copy.deepcopy(base), layers, seq, micro, ltd)}
    del base
    sched = engines["random-LTD"].random_ltd_scheduler
    plan = [min(sched.get_value(i), seq) for i in range(steps)]  # the kept length of each step
    kept_ok, sampler_ok = check_kept_tokens(engines["random-LTD"], micro, seq, d, sdpa, device), check_sampler(device)
    gen = torch.Generator().manual_seed(1)
    batches = [batch(micro, seq, vocab, gen, device) for _ in range(steps)]
    held_out = [batch(micro, seq, vocab, gen, device) for _ in range(4)]
    # one mid-ramp step at an already-seen length is profiled (both systems) and left out of the timing
    candidates = [i for i in range(max(warmup, 1), steps) if plan[i] < seq and plan[i] == plan[i - 1]]
    diag_step = candidates[len(candidates) // 2] if candidates else -1
    ms: dict[str, list[float]] = {k: [] for k in engines}
    losses: dict[str, list[float]] = {k: [] for k in engines}
    diag: dict[str, dict[str, float]] = {}
    timed: list[int] = []
    for i, tokens in enumerate(batches):
        for name, engine in engines.items():  # interleaved: both systems see step i before either sees i + 1
            if i == diag_step:
                diag[name] = diagnose_step(engine, tokens, sdpa, profile)
                continue
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = train_step(engine, tokens, sdpa)
            losses[name].append(loss.item())  # syncs
            ms[name].append((time.perf_counter() - t) * 1e3)
        if i >= warmup and i != diag_step:
            timed.append(i)
        if sched.get_current_seq() != plan[i]:
            raise AssertionError(f"step {i}: the scheduler kept {sched.get_current_seq()} tokens, planned {plan[i]}")
    evals = {}
    for name, engine in engines.items():
        engine.eval()
        with torch.no_grad(), sdpa_context(sdpa):
            evals[name] = statistics.mean(engine(t).item() for t in held_out)
    for e in engines.values():
        e.destroy()
    # per step i: its ms (the diagnosed step has none), whether its kept length is new to random-LTD
    index = {i: j for j, i in enumerate(k for k in range(steps) if k != diag_step)}
    new = [plan[i] < seq and plan[i] not in plan[:i] for i in range(steps)]
    diff = (evals["random-LTD"] - evals["dense"]) / evals["dense"]
    last = max(1, steps // 8)
    print(f"# GPT {layers} layers, d {d}, seq {seq}, micro-batch {micro}, bf16, SDPA {sdpa} (both), {steps} steps "
          f"(timed after {warmup}); random-LTD on {layers - 2} layers: kept {ltd['min_value']} -> {seq} in steps "
          f"of {seq_per_step} over steps 0..{ramp} ({ramp_frac:.0%} of the run), full length after; {device.type}")
    print(f"correctness: kept tokens = bare block, dropped unchanged: {kept_ok}; sampler = "
          f"torch.multinomial: {'OK' if sampler_ok else 'MISMATCH'}; eval loss dense {evals['dense']:.4f} "
          f"random-LTD {evals['random-LTD']:.4f} ({diff:+.2%}, bar within 1%: {'OK' if abs(diff) <= 0.01 else 'FAIL'})"
          f"; train loss (last {last}) {statistics.mean(losses['dense'][-last:]):.4f} / "
          f"{statistics.mean(losses['random-LTD'][-last:]):.4f}")
    print(f"{'phase':25s} {'steps':>5s} {'kept':>6s} {'dense ms':>9s} {'rLTD ms':>9s} {'ratio':>6s} "
          f"{'FLOP ratio':>10s}")
    out: dict[str, float] = {"eval_diff": diff}
    for label, pick in _rows(plan, new, seq):
        sel = [i for i in timed if pick(i)]
        if not sel:
            continue
        dense = sum(ms["dense"][index[i]] for i in sel)
        rltd = sum(ms["random-LTD"][index[i]] for i in sel)
        flops = statistics.mean(_flop_ratio(plan[i], seq, d, layers) for i in sel)
        print(f"{label:25s} {len(sel):5d} {statistics.mean(plan[i] for i in sel):6.0f} {dense / len(sel):9.1f} "
              f"{rltd / len(sel):9.1f} {rltd / dense:6.3f} {flops:10.3f}")
        out[label] = rltd / dense
    print("* the step that meets a kept length first (cuDNN plan build, allocator growth): one-time costs. FLOP "
          "ratio: the blocks' FLOPs, random-LTD / dense (the ideal ratio; head and optimizer left out)")
    if diag:
        print(f"active step {diag_step} (kept {plan[diag_step]}), profiled, not timed: "
              + "; ".join(f"{k} device-busy {v['busy']:.1f} ms / wall {v['wall']:.1f} ms, {v['syncs']:.0f} host syncs"
                          for k, v in diag.items()))
    return out


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=1024)
    add_schedule_args(ap)
    a = ap.parse_args()
    bench_train(a.layers, a.seq, a.d, a.micro, a.steps, a.warmup, a.vocab, a.seq_per_step, a.ramp_frac, a.min_frac,
                a.sdpa, a.profile)


def add_schedule_args(ap: Any) -> None:
    ap.add_argument("--seq_per_step", type=int, default=256, help="random-LTD's kept-length granularity")
    ap.add_argument("--ramp_frac", type=float, default=0.8, help="the ramp's share of the run (require_steps)")
    ap.add_argument("--min_frac", type=float, default=0.25, help="the first kept length, as a share of seq")
    ap.add_argument("--sdpa", choices=SDPA_BACKENDS, default="auto", help="attention backend of both systems")
    ap.add_argument("--profile", action="store_true", help="print the op table of the profiled active step")


if __name__ == "__main__":
    main()
