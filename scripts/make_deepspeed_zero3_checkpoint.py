"""Writes a real DeepSpeed ZeRO stage-3 checkpoint (gloo ranks on CPU) and what DeepSpeed's own
zero_to_fp32 recovers from it. Run only where the real DeepSpeed is importable, e.g.

    PYTHONPATH=/tmp/ds_real:/tmp/ds_deps DS_ACCELERATOR=cpu \
        python scripts/make_deepspeed_zero3_checkpoint.py OUT [--world 2] [--bf16]

OUT/ckpt/ gets the checkpoint (tag "step2"); OUT/deepspeed_fp32.pt the state_dict from DeepSpeed's
get_fp32_state_dict_from_zero_checkpoint, OUT/gathered.pt the model's weights gathered on rank 0
(GatheredParameters) right after the save. The model has a frozen parameter, a tied weight, a
persistent and a non-persistent buffer, parameters whose sizes do not divide by the world size, and two
optimizer param groups; sub_group_size is small so each group splits into several sub-groups."""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.fc1 = torch.nn.Linear(6, 7)  # 42 + 7: neither divides by 2, 3 or 4
        self.fc2 = torch.nn.Linear(7, 5)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.proj = torch.nn.Linear(5, 6)
        self.frozen = torch.nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.long))
        self.register_buffer("running", torch.linspace(0, 1, 5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.proj(self.fc2(torch.relu(self.fc1(h)))) + self.frozen(self.fc2(torch.relu(self.fc1(h)))).sum()
        return self.head(h).float().pow(2).mean()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, bf16: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=0.05)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "sub_group_size": 40, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        loss = engine(torch.randint(0, 11, (2, 3), generator=g))
        engine.backward(loss)
        engine.step()
    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt, tag="step2")
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        gathered = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    torch.distributed.barrier()
    if rank == 0:
        torch.save(gathered, os.path.join(out, "gathered.pt"))
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(out, "deepspeed_fp32.pt"))
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's code, not test data
            path = os.path.join(ckpt, script)
            if os.path.exists(path):
                os.remove(path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.start_processes(_rank_main, args=(args.world, _free_port(), args.out, args.bf16), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
