"""Train a small GPT on a text file with deepspeed_c: a plain DeepSpeed training script.

    deepspeed_c --num_gpus 2 examples/train_gpt/train.py \
        --deepspeed_config examples/train_gpt/ds_config.json [--text my.txt] [--steps 300]

On a machine without GPUs, --num_gpus N starts N CPU processes that train over gloo. Rank 0
shows a progress bar (loss, tokens/s) and at the end writes <out_dir>/loss.csv and
<out_dir>/loss.png.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_c as deepspeed  # noqa: E402
from data import CharDataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="train a small GPT with deepspeed_c")
    parser.add_argument("--text", default=os.path.join(HERE, "corpus.txt"), help="a UTF-8 text file to learn")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out_dir", default="outputs/train_gpt", help="where loss.csv and loss.png go")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(HERE, "ds_config.json")
    return args


def write_outputs(rows: list[tuple[int, float, float, float]], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "loss.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "lr", "tokens_per_s"])
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("train_gpt with deepspeed_c")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.text, encoding="utf-8") as f:
        dataset = CharDataset(f.read(), args.block_size)
    cfg = GPTConfig(vocab_size=dataset.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_embd=args.n_embd)
    model = GPT(cfg)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    rank, world = engine.global_rank, engine.world_size
    tokens_per_step = engine.train_batch_size() * args.block_size
    bar = None
    if rank == 0:
        from tqdm import tqdm

        n_params = sum(p.numel() for p in model.parameters())
        print(f"training a {n_params / 1e6:.2f}M-parameter GPT on {len(dataset.data):,} characters of "
              f"{os.path.basename(args.text)} with {world} rank(s) on {engine.device}", flush=True)
        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    rows: list[tuple[int, float, float, float]] = []
    data_iter = iter(deepspeed.utils.RepeatingLoader(loader))
    step_start = time.perf_counter()
    while engine.global_steps < args.steps:
        x, y = next(data_iter)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if not engine.is_gradient_accumulation_boundary() and engine.gradient_accumulation_steps() > 1:
            continue
        mean_loss = loss.detach().float().clone()
        deepspeed.comm.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world
        now = time.perf_counter()
        tps = tokens_per_step / max(now - step_start, 1e-9)
        step_start = now
        rows.append((engine.global_steps, mean_loss, engine.get_lr()[0], tps))
        if bar is not None:
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
    if rank == 0:
        bar.close()
        write_outputs(rows, args.out_dir)
        head = sum(r[1] for r in rows[:10]) / min(10, len(rows))
        tail = sum(r[1] for r in rows[-10:]) / min(10, len(rows))
        print(f"loss {head:.3f} -> {tail:.3f} over {len(rows)} steps; wrote "
              f"{os.path.join(args.out_dir, 'loss.csv')} and {os.path.join(args.out_dir, 'loss.png')}", flush=True)


if __name__ == "__main__":
    main()
