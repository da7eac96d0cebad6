"""ZeRO stage 3 on one GPU, side by side in one process: deepspeed_c stage 3 against the real DeepSpeed's
stage 3, torch FSDP2 and deepspeed_c stage 2, on the same GPT (examples/train_gpt), the same config
(bf16, AdamW lr 1e-4 wd 0.01, gradient clipping 1.0) and the same batches.

Engines (names used in the output and in --partners):
  dsc-z3   deepspeed_c ZeRO stage 3 (the anchor: every ratio is against it)
  ds-z3    DeepSpeed 0.19.x ZeRO stage 3 (needs the real DeepSpeed importable as `deepspeed`)
  fsdp2    torch FSDP2: fully_shard per transformer block + root, MixedPrecisionPolicy(param_dtype=bf16,
           reduce_dtype=fp32): fp32 sharded parameters that the optimizer steps (the fp32 master), bf16
           compute copies gathered per block, fp32 gradients; torch AdamW(fused=True), clip_grad_norm_.
           This is the closest match to DeepSpeed's bf16 mode, which also computes in bf16 from an fp32
           master partition and keeps fp32 Adam states (DeepSpeed holds the bf16 copy as the module's
           parameters and the fp32 master in the optimizer; FSDP2 the other way round).
  dsc-z2   deepspeed_c ZeRO stage 2
  ds-z2    DeepSpeed ZeRO stage 2 (only if named in --partners)

The stage-3 config spells out DeepSpeed 0.19.8's defaults (the same values as leaving the keys out):
  stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold 1e5,
  stage3_model_persistence_threshold sys.maxsize, stage3_max_live_parameters 1e9,
  stage3_max_reuse_distance 1e9, sub_group_size 1e9, reduce_bucket_size 5e8, overlap_comm true,
  contiguous_gradients true.

Correctness first: each engine's losses on the first --check steps (same starting weights, same
batches) are printed and compared with dsc-z3's (relative difference <= 2e-2, bf16 tolerance); an
engine that disagrees is not timed. Then interleaved timed blocks of whole steps (forward + backward
+ optimizer step, synchronised at block ends): tokens/s, ms/step, the device memory each engine
holds once set up and stepped (its parameters, gradients, master and optimizer states: the allocated
memory it added), and the peak of its blocks (torch.cuda.reset_peak_memory_stats before each block;
the raw peak includes every resident engine, so "own peak" = its held memory + its block's peak above
what was allocated when the block began).

Memory: each engine of the 1.3B default holds ~16-20 bytes a parameter (~22-27 GiB). dsc-z3 stays
resident for the whole run; the partners are run in phases of as many as fit beside it (--resident,
default: from the device's memory; on an 80 GiB card one at a time, on a 141 GiB card all three),
each phase building its partners from the same starting weights, interleaving them with dsc-z3 and
destroying them afterwards. Ratios always come from one phase's interleaved blocks.

DeepSpeed's stage 3 replaces torch.nn.functional.linear process-wide when it is built (its
memory-efficient linear, a Python autograd Function) and leaves it so; every engine built or run after
it would then run DeepSpeed's linear. The script keeps DeepSpeed's linear for DeepSpeed's own steps
and torch's for everyone else's.

--offload: offload_param + offload_optimizer to pinned CPU memory (stage 3), ours against DeepSpeed's,
each engine alone (built, --check + blocks x steps steps, destroyed), for a bisect of the largest
model that trains; prints OK/OOM per engine. --zero_init builds the model under each library's
zero.Init(remote_device='cpu') (the weights then differ between libraries: losses are not compared).

--profile: after the timing, where dsc-z3's step goes: forward/backward/step times with syncs between,
host time inside the ZeRO-3 hooks (begin/end of each module step, fetch/wait/release, tensor
wrapping), the same phases for dsc-z2, and a torch.profiler table of one step (trace to $OUT if set).

    python benchmarks/zero3.py [--n_embd 2048] [--n_layer 24] [--n_head 16] [--vocab 32000] [--seq 1024]
                               [--micro 4] [--partners ds-z3,fsdp2,dsc-z2] [--resident N] [--blocks 4]
                               [--steps 5] [--check 3] [--profile] [--offload [--zero_init]]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))

GiB = 2**30
STAGE3_DEFAULTS = {  # DeepSpeed 0.19.8's defaults, written out
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_param_persistence_threshold": int(1e5),
    "stage3_model_persistence_threshold": sys.maxsize,
    "stage3_max_live_parameters": int(1e9),
    "stage3_max_reuse_distance": int(1e9),
    "sub_group_size": int(1e9),
}
REL_TOL = 2e-2


def ds_config(args: argparse.Namespace, stage: int, offload: bool = False) -> dict:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True,
                            "contiguous_gradients": True}
    if stage == 3:
        zero.update(STAGE3_DEFAULTS)
    else:
        zero["allgather_bucket_size"] = int(args.bucket)
    if offload:  # pin_memory spelt out: DeepSpeed 0.19.8 defaults it to true
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": zero}


# -- the engines ----------------------------------------------------------------------------------------
class Runner:
    """One engine behind a common step: forward + backward + optimizer step on a batch."""

    name: str
    engine: Any

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scope(self) -> Any:
        """What must be in force while this engine runs (see DeepSpeedLike)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class DeepSpeedLike(Runner):
    """deepspeed_c or the real DeepSpeed: initialize(), engine(x, y), engine.backward, engine.step."""

    def __init__(self, name: str, lib: Any, model: torch.nn.Module, config: dict) -> None:
        self.name, self.lib = name, lib
        F = torch.nn.functional
        before = F.linear
        self.engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        # DeepSpeed's stage 3 (its zero.Init, memory_efficient_linear) replaces torch.nn.functional.linear
        # for the whole process and leaves it replaced: every other engine's nn.Linear would then run
        # DeepSpeed's Python autograd Function. Keep its linear for its own steps only.
        self.linear = F.linear
        F.linear = before

    @contextlib.contextmanager
    def scope(self) -> Any:
        F = torch.nn.functional
        saved = F.linear
        F.linear = self.linear
        try:
            yield
        finally:
            F.linear = saved

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.scope():
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
        return loss.detach()

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
        self.engine = None


class FSDP2(Runner):
    def __init__(self, name: str, model: torch.nn.Module, device: torch.device) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.name = name
        model.to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.engine = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.engine.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> None:
        self.engine = self.opt = None


# -- measurement helpers ----------------------------------------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).to(self.device),
                         torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).to(self.device))
                        for _ in range(8)]
        self.k = 0
        self.held: dict[str, int] = {}
        self.check_losses: dict[str, list[float]] = {}

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[k % len(self.batches)]

    def build(self, name: str, factory: Callable[[], Runner]) -> Runner:
        """Builds an engine, runs its check steps, records the memory it holds and its losses."""
        collect()
        before = allocated()
        t0 = time.perf_counter()
        r = factory()
        sync()
        t_init = time.perf_counter() - t0
        at_init = allocated() - before
        losses = [r.step(*self.batch(k)).item() for k in range(self.args.check)]
        sync()
        gc.collect()
        self.held[name] = allocated() - before
        self.check_losses[name] = losses
        print(f"{name:7s} built in {t_init:5.1f} s: holds {at_init / GiB:6.2f} GiB after initialize, "
              f"{self.held[name] / GiB:6.2f} GiB after {self.args.check} steps (optimizer states made); "
              f"{allocated() / GiB:6.2f} GiB allocated in all", flush=True)
        return r

    def agrees(self, name: str, ref: str) -> bool:
        ok = True
        for k, (a, b) in enumerate(zip(self.check_losses[ref], self.check_losses[name])):
            rel = abs(a - b) / abs(a)
            ok &= rel <= REL_TOL
            print(f"check step {k}: loss {ref} {a:.5f}  {name} {b:.5f}  rel diff {rel:.2e}", flush=True)
        if not ok:
            print(f"!! {name}: losses disagree with {ref} beyond bf16 tolerance ({REL_TOL}): not timed"
                  + (" (--force: timed anyway)" if self.args.force else ""), flush=True)
        return ok or self.args.force

    def timed_blocks(self, runners: list[Runner]) -> dict[str, dict[str, Any]]:
        """Interleaved blocks of whole steps; per engine: ms/step of each block and its block peaks."""
        out = {r.name: {"times": [], "peak": 0, "above": 0} for r in runners}
        for _ in range(self.args.blocks):
            for r in runners:
                sync()
                reset_peak()
                base = allocated()
                t0 = time.perf_counter()
                for _ in range(self.args.steps):
                    r.step(*self.batch(self.k))
                    self.k += 1
                sync()
                dt = (time.perf_counter() - t0) / self.args.steps
                o = out[r.name]
                o["times"].append(dt)
                o["peak"] = max(o["peak"], peak())
                o["above"] = max(o["above"], peak() - base)
        return out


def report(results: dict[str, dict[str, Any]], held: dict[str, int], tokens: int, phase: str) -> dict[str, float]:
    med = {}
    print(f"-- {phase}", flush=True)
    for name, o in results.items():
        m = statistics.median(o["times"])
        med[name] = m
        own = held.get(name, 0) + o["above"]
        print(f"{name:7s} step {m * 1e3:8.1f} ms  {tokens / m:9.0f} tokens/s  held {held.get(name, 0) / GiB:6.2f} GiB  "
              f"own peak {own / GiB:6.2f} GiB  raw peak {o['peak'] / GiB:6.2f} GiB (resident engines included)  "
              f"blocks {', '.join(f'{t * 1e3:.1f}' for t in o['times'])} ms", flush=True)
    return med


# -- profile of dsc-z3 ---------------------------------------------------------------------------------------
class HostTimers:
    """Wraps instance methods (and module functions) with perf_counter accumulators; inclusive times."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.undo: list[Callable[[], None]] = []

    def wrap_attr(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[label] = self.t.get(label, 0.0) + time.perf_counter() - t0
                self.n[label] = self.n.get(label, 0) + 1

        had = attr in getattr(obj, "__dict__", {})
        old = obj.__dict__.get(attr) if had else None
        setattr(obj, attr, timed)

        def restore() -> None:
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

        self.undo.append(restore)

    def restore(self) -> None:
        for u in reversed(self.undo):
            u()
        self.undo.clear()

    def reset(self) -> None:
        self.t.clear()
        self.n.clear()


def phase_times(bench: Bench, r: Runner, n: int) -> dict[str, float]:
    """Forward, backward and step times (ms, medians) with a sync after each, plus the host time of a whole
    step issued without syncs (how long the Python side takes to issue it)."""
    fw, fw_host, bw, st, whole = [], [], [], [], []
    for _ in range(n):
        x, y = bench.batch(bench.k)
        bench.k += 1
        sync()
        t0 = time.perf_counter()
        with r.scope():
            loss = r.engine(x, y)
        fw_host.append(time.perf_counter() - t0)
        sync()
        t1 = time.perf_counter()
        if isinstance(r, DeepSpeedLike):
            with r.scope():
                r.engine.backward(loss)
        else:
            loss.backward()
        sync()
        t2 = time.perf_counter()
        if isinstance(r, DeepSpeedLike):
            with r.scope():
                r.engine.step()
        else:
            torch.nn.utils.clip_grad_norm_(r.engine.parameters(), 1.0)
            r.opt.step()
            r.opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        fw.append(t1 - t0)
        bw.append(t2 - t1)
        st.append(t3 - t2)
        whole.append(t3 - t0)
    med = statistics.median
    return {"forward": med(fw) * 1e3, "forward_host": med(fw_host) * 1e3, "backward": med(bw) * 1e3, "step": med(st) * 1e3, "sum": med(whole) * 1e3}


def profile(bench: Bench, runners: dict[str, Runner]) -> None:
    from deepspeed_c.runtime.zero import param_hooks

    print("== profile", flush=True)
    for name in ("dsc-z3", "dsc-z2", "fsdp2", "ds-z3"):
        if name in runners:
            p = phase_times(bench, runners[name], 4)
            print(f"{name:7s} synced phases (median of 4): forward {p['forward']:7.1f} ms (host returns after "
                  f"{p['forward_host']:5.1f} ms)  backward "
                  f"{p['backward']:7.1f} ms  step {p['step']:7.1f} ms  sum {p['sum']:7.1f} ms", flush=True)
    r = runners["dsc-z3"]
    opt = r.engine.optimizer
    coord, store = opt.coordinator, opt.store
    timers = HostTimers()
    for attr in ("begin_step", "end_step", "end_iteration", "fetch_on_access"):
        timers.wrap_attr(coord, attr, f"coordinator.{attr}")
    for attr in ("fetch", "wait", "release", "release_all"):
        timers.wrap_attr(store, attr, f"store.{attr}")
    timers.wrap_attr(param_hooks, "_wrap_tensors", "_wrap_tensors (autograd identity nodes)")
    n = 4
    gathers0 = store.gathers
    for _ in range(2):  # warm
        r.step(*bench.batch(bench.k))
        bench.k += 1
    sync()
    timers.reset()
    gathers0 = store.gathers
    t_host = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        r.step(*bench.batch(bench.k))
        t_host.append(time.perf_counter() - t0)
        bench.k += 1
    sync()
    timers.restore()
    print(f"dsc-z3 host time of a step (returns before the GPU finishes): {statistics.median(t_host) * 1e3:.1f} ms; "
          f"{(store.gathers - gathers0) / n:.0f} unit gathers a step over {len(store.unit_numel)} units "
          f"({sum(store.persistent)} persistent), {len(coord.modules)} hooked modules, plans built "
          f"{coord.plans_built}, peak live {store.peak_live_numel / 1e6:.1f}M elements", flush=True)
    for label in sorted(timers.t, key=lambda k: -timers.t[k]):
        print(f"  {label:42s} {timers.t[label] / n * 1e3:8.2f} ms/step  {timers.n[label] / n:7.0f} calls/step  "
              f"{timers.t[label] / max(timers.n[label], 1) * 1e6:8.1f} us/call", flush=True)
    # torch.profiler over one step each of dsc-z3 and dsc-z2
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name in ("dsc-z3", "dsc-z2"):
        if name not in runners:
            continue
        with tprofile(activities=acts) as prof:
            runners[name].step(*bench.batch(bench.k))
            bench.k += 1
            sync()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(f"-- torch.profiler, one {name} step, by self device time", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60), flush=True)
        print(f"-- torch.profiler, one {name} step, by self CPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60),
              flush=True)
        out = os.environ.get("OUT")
        if out:
            path = os.path.join(out, f"trace_{name}.json")
            prof.export_chrome_trace(path)
            os.system(f"gzip -f {path}")


# -- modes --------------------------------------------------------------------------------------------------
def estimate_resident(args: argparse.Namespace, nparams: int, n_partners: int) -> int:
    if args.resident:
        return args.resident
    if not torch.cuda.is_available():
        return n_partners
    total = torch.cuda.get_device_properties(0).total_memory
    per_engine = 20 * nparams  # bf16 params + grads, fp32 master + Adam, some slack (DeepSpeed's buffers)
    acts = args.micro * args.seq * (args.n_embd * args.n_layer * 40 + args.vocab * 16)
    for r in range(n_partners, 0, -1):
        if (1 + r) * per_engine + acts + 6 * GiB <= total:
            return r
    return 1


def run_side_by_side(args: argparse.Namespace, libs: dict[str, Any], base: torch.nn.Module, nparams: int) -> None:
    bench = Bench(args)
    tokens = args.micro * args.seq

    def factory(name: str) -> Callable[[], Runner]:
        model = copy.deepcopy(base)
        if name == "fsdp2":
            return lambda: FSDP2(name, model, bench.device)
        lib = libs["deepspeed_c" if name.startswith("dsc") else "deepspeed"]
        stage = 3 if name.endswith("z3") else 2
        return lambda: DeepSpeedLike(name, lib, model, ds_config(args, stage))

    partners = [p for p in args.partners.split(",") if p]
    if "deepspeed" not in libs:
        dropped = [p for p in partners if p.startswith("ds-")]
        partners = [p for p in partners if not p.startswith("ds-")]
        if dropped:
            print(f"!! the real DeepSpeed is not importable: {', '.join(dropped)} left out", flush=True)
    anchor = bench.build("dsc-z3", factory("dsc-z3"))
    resident = estimate_resident(args, nparams, len(partners))
    phases = [partners[i:i + resident] for i in range(0, len(partners), resident)]
    print(f"dsc-z3 stays resident; partners in {len(phases)} phase(s) of up to {resident}: "
          f"{' | '.join(','.join(p) for p in phases)}", flush=True)
    ratios: dict[str, tuple[float, float, float]] = {}
    summary: dict[str, tuple[float, float, int]] = {}
    for phase in phases:
        runners = [anchor]
        for name in phase:
            try:
                r = bench.build(name, factory(name))
            except torch.cuda.OutOfMemoryError as e:
                print(f"!! {name}: out of memory while building or checking ({str(e).splitlines()[0]})", flush=True)
                collect()
                continue
            if bench.agrees(name, "dsc-z3"):
                runners.append(r)
            else:
                r.close()
        if len(runners) == 1:
            continue
        res = bench.timed_blocks(runners)
        med = report(res, bench.held, tokens, f"phase: {', '.join(r.name for r in runners)} "
                     f"({args.blocks} interleaved blocks of {args.steps} steps)")
        for r in runners[1:]:
            ratios[r.name] = (med[r.name] / med["dsc-z3"], med["dsc-z3"], med[r.name])
            own = bench.held[r.name] + res[r.name]["above"]
            summary[r.name] = (med[r.name], tokens / med[r.name], own)
        own = bench.held["dsc-z3"] + res["dsc-z3"]["above"]
        summary.setdefault("dsc-z3", (med["dsc-z3"], tokens / med["dsc-z3"], own))
        if args.profile and phase is phases[-1]:
            profile(bench, {r.name: r for r in runners})
        for r in runners[1:]:
            r.close()
        runners = [anchor]
        collect()
        print(f"phase done: {allocated() / GiB:.2f} GiB still allocated (dsc-z3 holds "
              f"{bench.held['dsc-z3'] / GiB:.2f})", flush=True)
    print("== summary (each ratio from its own phase's interleaved blocks)", flush=True)
    for name, (m, tps, own) in summary.items():
        print(f"{name:7s} {m * 1e3:8.1f} ms/step  {tps:9.0f} tokens/s  held {bench.held[name] / GiB:6.2f} GiB  "
              f"own peak {own / GiB:6.2f} GiB", flush=True)
    for name, (ratio, a, b) in ratios.items():
        print(f"ratio dsc-z3 / {name} tokens/s: {ratio:.3f}x (same phase: dsc-z3 {a * 1e3:.1f} ms/step, {name} "
              f"{b * 1e3:.1f} ms/step)", flush=True)
    anchor.close()


def run_offload(args: argparse.Namespace, libs: dict[str, Any], make_model: Callable[[], torch.nn.Module],
                nparams: int) -> None:
    bench = Bench(args)
    tokens = args.micro * args.seq
    names = [n for n in args.engines.split(",") if n.startswith("dsc") or "deepspeed" in libs]
    torch_linear = torch.nn.functional.linear
    for name in names:
        lib = libs["deepspeed_c" if name.startswith("dsc") else "deepspeed"]
        cfg = ds_config(args, 3, offload=True)
        collect()
        reset_peak()
        try:
            def factory() -> Runner:
                ctx = (lib.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=cfg)
                       if args.zero_init else contextlib.nullcontext())
                with ctx:
                    model = make_model()
                return DeepSpeedLike(name, lib, model, cfg)

            r = bench.build(name, factory)
            res = bench.timed_blocks([r])
            m = statistics.median(res[name]["times"])
            print(f"OK  {name:7s} offload, {nparams / 1e6:.1f}M params: {m * 1e3:8.1f} ms/step  "
                  f"{tokens / m:8.0f} tokens/s  device held {bench.held[name] / GiB:6.2f} GiB  device peak "
                  f"{peak() / GiB:6.2f} GiB (from before initialize)  blocks "
                  f"{', '.join(f'{t * 1e3:.1f}' for t in res[name]['times'])} ms  losses {', '.join(f'{v:.4f}' for v in bench.check_losses[name])}",
                  flush=True)
            r.close()
        except torch.cuda.OutOfMemoryError as e:
            print(f"OOM {name:7s} offload, {nparams / 1e6:.1f}M params: {str(e).splitlines()[0]}", flush=True)
        r = None  # noqa: F841
        torch.nn.functional.linear = torch_linear  # DeepSpeed's zero.Init may have replaced it
        collect()
    if not args.zero_init and len(bench.check_losses) == 2:
        bench.agrees("ds-z3", "dsc-z3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=2048)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--bucket", type=float, default=5e8, help="reduce (and stage-2 allgather) bucket size")
    ap.add_argument("--partners", default="ds-z3,fsdp2,dsc-z2",
                    help="engines compared with dsc-z3: any of ds-z3, fsdp2, dsc-z2, ds-z2")
    ap.add_argument("--resident", type=int, default=0, help="partners resident at once (0: from device memory)")
    ap.add_argument("--blocks", type=int, default=4, help="timed blocks per engine, interleaved")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared first")
    ap.add_argument("--force", action="store_true", help="time engines whose losses disagree too")
    ap.add_argument("--profile", action="store_true", help="where dsc-z3's step goes (after the timing)")
    ap.add_argument("--offload", action="store_true", help="stage 3 with param + optimizer offload: ours vs DeepSpeed")
    ap.add_argument("--zero_init", action="store_true", help="--offload: build the model under zero.Init")
    ap.add_argument("--engines", default="dsc-z3,ds-z3", help="--offload: which engines run, in order")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29535")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    else:
        print("!! no CUDA GPU: a CPU run (gloo) for trying the script out; figures mean nothing", flush=True)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    import deepspeed_c

    libs: dict[str, Any] = {"deepspeed_c": deepspeed_c}
    try:
        import deepspeed  # the real one

        if deepspeed.__file__ and "deepspeed_c" not in deepspeed.__file__:
            libs["deepspeed"] = deepspeed
    except ImportError:
        pass
    from model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    ds = libs.get("deepspeed")
    print(f"{'GPU ' + torch.cuda.get_device_name() if cuda else 'CPU'}  torch {torch.__version__}  DeepSpeed "
          f"{ds.__version__ if ds else '(not importable)'}  deepspeed_c {deepspeed_c.__version__}", flush=True)
    if args.offload:
        nparams = (args.vocab * 2 + args.seq) * args.n_embd + args.n_layer * (12 * args.n_embd**2 + 13 * args.n_embd) \
            + 2 * args.n_embd
        print(f"GPT {nparams / 1e6:.1f}M params (d {args.n_embd}, {args.n_layer} layers, {args.n_head} heads, vocab "
              f"{args.vocab}, seq {args.seq}, micro {args.micro}), bf16, ZeRO stage 3 + offload_param/offload_optimizer "
              f"to pinned CPU memory, AdamW, clipping 1.0{', zero.Init' if args.zero_init else ''}", flush=True)
        run_offload(args, libs, make_model, nparams)
    else:
        base = make_model()
        nparams = sum(p.numel() for p in base.parameters())
        print(f"GPT {nparams / 1e6:.1f}M params (d {args.n_embd}, {args.n_layer} layers, {args.n_head} heads, vocab "
              f"{args.vocab}, seq {args.seq}, micro {args.micro}), bf16, AdamW lr 1e-4 wd 0.01, clipping 1.0; "
              f"stage-3 keys {STAGE3_DEFAULTS}", flush=True)
        run_side_by_side(args, libs, base, nparams)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
