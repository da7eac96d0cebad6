"""Megatron-DeepSpeed's own `pretrain_gpt.py` (its public repository, checked out OUTSIDE this project and
never copied into it) launched by a `deepspeed` command: ours (the opt-in alias, compat/deepspeed) or the
real DeepSpeed's, with the same flags. Prints the loss of every iteration and the tokens/s Megatron reports.

    python benchmarks/megatron_client/run_pretrain_gpt.py --mds /path/to/Megatron-DeepSpeed \
        --launcher /path/to/bin/deepspeed --pythonpath DIR[:DIR] --tp 2 --pp 2 --gpus 4 --iters 6
    python benchmarks/megatron_client/run_pretrain_gpt.py --mds ... --alias /tmp/dsc_alias --real /tmp/ds_real ...
        (side by side: each iteration's loss, then tokens/s per GPU and the ratio)

Workarounds for Megatron-DeepSpeed's own assumptions (none is on DeepSpeed's side):
- its CoreAttention `.view`s a strided q/k slice, which fails unless there is one attention head per
  tensor rank (fixed upstream after the snapshot used, deepspeedai/Megatron-DeepSpeed PR 469; the rotary
  path that would avoid it is broken at that snapshot): --heads defaults to the tensor-parallel size;
- on CUDA it imports apex (fused layer norm, FusedAdam) and `fused_layer_norm_cuda`; shims/ holds stand-ins
  in plain torch (put on the path last, so an installed apex wins), used identically for both DeepSpeeds;
  the optimizer is each DeepSpeed's own FusedAdam (`--ds_fused_adam`); torchvision is imported by its
  training.py for vision models only: shims/ has an import-only stand-in when torchvision is missing;
- DeepSpeed 0.19.8 no longer ships deepspeed.compression.compress, which Megatron-DeepSpeed's training.py
  imports at module level (deepspeed_c has it): `--real-compress-stub DIR` copies the real DeepSpeed there
  and adds an import-only stub, so the real one can run the script at all.
The dataset is generated (Megatron's own mmap builder, NullTokenizer ids: arithmetic sequences, so the
loss falls)."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Optional

HERE = pathlib.Path(__file__).resolve().parent
SHIMS = HERE / "shims"
VOCAB = 127

_MAKE_DATA = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from megatron.data import indexed_dataset
prefix, vocab = sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
b = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=vocab + 1)
for _ in range(400):
    start, step, n = int(rng.integers(0, vocab)), int(rng.integers(1, 4)), int(rng.integers(40, 300))
    b.add_item(torch.tensor((start + step * np.arange(n)) % vocab, dtype=torch.int64))
    b.end_document()
b.finalize(prefix + ".idx")
"""


def make_dataset(mds: pathlib.Path, out_dir: pathlib.Path, env: dict) -> str:
    """A Megatron mmap dataset (prefix returned) written by the checkout's own builder."""
    prefix = str(out_dir / "gpt_text_document")
    if not os.path.exists(prefix + ".idx"):
        subprocess.run([sys.executable, "-c", _MAKE_DATA, str(mds), prefix, str(VOCAB)], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return prefix


def ds_config(path: pathlib.Path, micro: int, global_batch: int, stage: int, clip: float, bf16: bool) -> str:
    cfg = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000,
           "gradient_clipping": clip, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
           "wall_clock_breakdown": False}
    path.write_text(json.dumps(cfg))
    return str(path)


def command(args: argparse.Namespace, data: str, cfg: str) -> list[str]:
    heads = args.heads or args.tp
    cmd = [args.launcher, "--num_gpus", str(args.gpus), "--master_port", str(args.port), "pretrain_gpt.py",
           "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
           "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", str(heads),
           "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
           "--micro-batch-size", str(args.micro), "--global-batch-size", str(args.global_batch),
           "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "0", "--weight-decay", "0.01", "--clip-grad", str(args.clip),
           "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.02", "--seed", "1234",
           "--data-path", data, "--split", "98,2,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
           "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0", "--save-interval", "100000",
           "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
           "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--distributed-backend", "nccl" if args.device == "cuda" else "gloo",
           "--deepspeed", "--deepspeed_config", cfg, "--zero-stage", str(args.stage)]
    if args.pp == 1 and not args.pipe_engine:  # else GPTModelPipe on a one-stage PipelineEngine
        cmd.append("--no-pipeline-parallel")
    if args.device == "cuda":  # each DeepSpeed's own FusedAdam (on the host Megatron takes torch's Adam)
        cmd.append("--ds_fused_adam")
    if args.bf16:
        cmd.append("--bf16")
    if args.zbh1:  # its zero-bubble H1 schedule, plugged into the PipelineEngine through _INSTRUCTION_MAP
        cmd.append("--enable-zbh1-pipeline")
    if args.experts > 1:  # MoE layers: the pipeline reports its 'lm loss' / 'moe loss' (get_additional_losses)
        cmd += ["--num-experts", str(args.experts)]
    return cmd


_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+|nan|inf).*?tokens per gpu per second "
                   r"\(tgs\): ([0-9.]+)")


def parse(text: str) -> list[tuple[int, float, float]]:
    """(iteration, lm loss, tokens per GPU per second) of each logged iteration."""
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in _ITER.finditer(text)]


def real_with_compress_stub(real: str, dest: Optional[pathlib.Path]) -> str:
    """The real DeepSpeed with an import-only deepspeed.compression.compress: in place when `dest` is None
    or the stub is already there, else in a copy at `dest` (leaving a shared install untouched)."""
    if not (pathlib.Path(real) / "deepspeed" / "compression" / "compress.py").exists() and dest is not None:
        if not (dest / "deepspeed").exists():
            shutil.copytree(real, dest, symlinks=True)
        real = str(dest)
    stub = pathlib.Path(real) / "deepspeed" / "compression" / "compress.py"
    if not stub.exists():
        stub.write_text("# import-only stub (not DeepSpeed's): 0.19.8 ships no compression.compress\n"
                        "def init_compression(*args, **kwargs):\n"
                        "    raise NotImplementedError('deepspeed.compression.compress is not in DeepSpeed 0.19.8')\n\n\n"
                        "redundancy_clean = init_compression\n")
    return real


def run(args: argparse.Namespace, work: pathlib.Path, timeout: Optional[float] = None) -> tuple[list, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [args.pythonpath, str(SHIMS), env.get("PYTHONPATH", "")] if p)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # `python3` for its make
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    work.mkdir(parents=True, exist_ok=True)
    data = make_dataset(pathlib.Path(args.mds), work, env)
    cfg = ds_config(work / f"ds_{args.tag}.json", args.micro, args.global_batch, args.stage, args.clip, args.bf16)
    proc = subprocess.run(command(args, data, cfg), cwd=args.mds, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    (work / f"log_{args.tag}.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py ({args.tag}) exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return parse(proc.stdout), proc.stdout


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mds", required=True, help="the Megatron-DeepSpeed checkout (outside this project)")
    p.add_argument("--launcher", default="", help="the `deepspeed` command to launch with (one run)")
    p.add_argument("--pythonpath", default="", help="prepended to PYTHONPATH (the alias or the real DeepSpeed, deps)")
    p.add_argument("--tag", default="run")
    p.add_argument("--work", default="/tmp/mds_work")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gpus", type=int, default=2, help="ranks (CPU processes without GPUs)")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--heads", type=int, default=0, help="attention heads (default: one per tensor rank)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--zbh1", action="store_true", help="--enable-zbh1-pipeline (Megatron's zero-bubble H1 schedule)")
    p.add_argument("--experts", type=int, default=1, help="--num-experts (MoE layers, every --expert-interval)")
    p.add_argument("--pipe-engine", action="store_true", help="at --pp 1 too: Megatron's GPTModelPipe and the "
                   "PipelineEngine (its default without --no-pipeline-parallel) instead of its mpu through initialize")
    return p


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def side_by_side(args: argparse.Namespace) -> None:
    """Ours (the alias at --alias) then the real DeepSpeed (--real) on the same command: every iteration's
    loss side by side first, then tokens/s per GPU (median over the iterations after the first two)."""
    work = pathlib.Path(args.work)
    base = args.pythonpath
    results = {}
    for tag, root in (("dsc", args.alias), ("real", real_with_compress_stub(args.real, work / "ds_real_stub"))):
        args.tag, args.launcher = f"{tag}_tp{args.tp}_pp{args.pp}", os.path.join(root, "bin", "deepspeed")
        args.pythonpath = os.pathsep.join(p for p in [root, base] if p)
        try:
            results[tag] = run(args, work)[0]
        except RuntimeError as exc:
            print(f"{tag}: FAILED {str(exc)[-1500:]}")
            results[tag] = []
    ours, theirs = results["dsc"], results["real"]
    print(f"pretrain_gpt.py TP {args.tp} x PP {args.pp} on {args.gpus} {args.device} ranks, layers {args.layers} "
          f"hidden {args.hidden} seq {args.seq} micro {args.micro} global {args.global_batch} "
          f"{'bf16' if args.bf16 else 'fp32'} zero {args.stage} clip {args.clip}")
    print(f"{'iter':>4} {'loss dsc':>12} {'loss ds':>12} {'rel diff':>9} | {'tgs dsc':>10} {'tgs ds':>10}")
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else (i + 1, float("nan"), float("nan"))
        b = theirs[i] if i < len(theirs) else (i + 1, float("nan"), float("nan"))
        rel = abs(a[1] - b[1]) / max(abs(b[1]), 1e-12)
        print(f"{a[0]:>4} {a[1]:>12.6f} {b[1]:>12.6f} {rel:>9.2e} | {a[2]:>10.1f} {b[2]:>10.1f}")
    ta, tb = _median([r[2] for r in ours[2:]]), _median([r[2] for r in theirs[2:]])
    print(f"tokens/s per GPU (median, iterations 3+): deepspeed_c {ta:.1f}  DeepSpeed {tb:.1f}  ratio {ta / tb:.3f}"
          if tb == tb and tb > 0 else f"tokens/s per GPU: deepspeed_c {ta:.1f}  DeepSpeed n/a")


def main() -> None:
    p = parser()
    p.add_argument("--alias", default="", help="side by side: the alias install dir (pip --target)")
    p.add_argument("--real", default="", help="side by side: where DeepSpeed 0.19.8 is installed")
    args = p.parse_args()
    if args.alias and args.real:
        side_by_side(args)
        return
    rows, _ = run(args, pathlib.Path(args.work))
    if not rows:
        raise SystemExit("no iteration lines in the log")
    for it, loss, tgs in rows:
        print(f"{args.tag} iter {it:3d} loss {loss:.6f} tgs {tgs:.1f}")
    ok = all(math.isfinite(l) for _, l, _ in rows)
    print(f"{args.tag} finite={ok} first={rows[0][1]:.6f} last={rows[-1][1]:.6f}")


if __name__ == "__main__":
    main()
