"""An accelerate training script as users write it (run by test_client_accelerate.py). The same loop runs
with or without DeepSpeed; which one is decided outside the loop:

  --mode plain    Accelerator(gradient_accumulation_steps=2): plain DDP (the reference)
  --mode plugin   Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2,
                  offload_optimizer_device="cpu")) built in the script
  --mode launch   Accelerator(): `accelerate launch --use_deepspeed ...` (or --deepspeed_config_file) decides

A small MLP regression, a fixed dataset sharded by the prepared DataLoader, torch AdamW (accelerate swaps
it for DeepSpeedCPUAdam under CPU offload), accelerator.accumulate / backward / clip_grad_norm_. After 6
optimizer steps it save_state()s, trains to step 10, then load_state()s and trains steps 7-10 again.
Rank 0 writes <out>/result.json: the micro-batch losses (mean over ranks), those after the reload,
get_state_dict()'s weights against the live ones, and what the Accelerator ran with."""
import faulthandler
import argparse
import json
import os

import torch

# a rank that aborts (SIGABRT at exit has been seen once in CI) prints every thread's Python stack
faulthandler.enable()

STEPS, GAS, BATCH, SAVE_AT = 10, 2, 4, 6


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                        torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def dataset(samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    x = torch.randn(samples, 16, generator=g)
    return torch.utils.data.TensorDataset(x, 0.5 * (x @ w))  # a target the MLP learns within ten steps


def build_accelerator(mode: str):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    if not torch.cuda.is_available():
        # accelerate's rule (with DeepSpeed itself too): without GPUs it forms a process group only when the
        # state is made with cpu=True first, as the HF Trainer does for --use_cpu; the Accelerator made next
        # (cpu=False) still selects DeepSpeed. On a GPU machine this line is skipped.
        PartialState(cpu=True)
    if mode == "plain":
        return Accelerator(gradient_accumulation_steps=GAS)
    if mode == "plugin":
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=GAS, offload_optimizer_device="cpu")
        return Accelerator(deepspeed_plugin=plugin)
    return Accelerator(gradient_accumulation_steps=GAS)


def train_steps(accelerator, model, optimizer, batches, first: int, last: int, norms: list | None = None) -> list:
    losses = []
    dtype = next(accelerator.unwrap_model(model).parameters()).dtype  # bf16 under DeepSpeed's bf16 mode
    for x, y in batches[first * GAS:last * GAS]:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y.float())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                # the pre-clipping norm: torch's here, the engine's get_global_grad_norm() under DeepSpeed
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                if norms is not None:
                    norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()[None]).double().mean()))
    return losses


def run(mode: str, out: str, batch: int) -> None:
    accelerator = build_accelerator(mode)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    samples = STEPS * GAS * batch * accelerator.num_processes
    loader = torch.utils.data.DataLoader(dataset(samples), batch_size=batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)
    assert len(batches) == STEPS * GAS, len(batches)

    norms: list = []
    losses = train_steps(accelerator, model, optimizer, batches, 0, SAVE_AT, norms)
    ckpt = os.path.join(out, "state")
    accelerator.save_state(ckpt)
    if accelerator.is_main_process:  # the weights the checkpoint holds, for zero_to_fp32 to recover
        at_save = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.detach().cpu().clone() for k, v in at_save.items()}, os.path.join(out, "at_save.pt"))
    losses += train_steps(accelerator, model, optimizer, batches, SAVE_AT, STEPS)
    # consolidated weights against the live module's
    full = accelerator.get_state_dict(model)
    live = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    consolidated_equal = set(full) == set(live) and all(torch.equal(full[k].cpu(), live[k]) for k in live)
    accelerator.load_state(ckpt)
    resumed = train_steps(accelerator, model, optimizer, batches, SAVE_AT, STEPS)

    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    ds_config = getattr(accelerator, "deepspeed_config", None) if engine is not None else None
    if accelerator.is_main_process:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({
                "losses": losses, "resumed": resumed, "consolidated_equal": consolidated_equal, "grad_norms": norms,
                "num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
                "zero_stage": ds_config["zero_optimization"]["stage"] if ds_config else None,
                "offload_optimizer": (ds_config["zero_optimization"].get("offload_optimizer", {}).get("device")
                                      if ds_config else None),
                "gradient_accumulation_steps": ds_config["gradient_accumulation_steps"] if ds_config else None,
                "optimizer": type(engine.engine.optimizer.optimizer).__name__ if engine is not None else None,
                "engine": type(engine.engine).__module__ if engine is not None else None,
            }, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, help="plain, plugin or launch; several comma-separated run one after "
                    "the other in this process (accelerate's state reset between them, as TrainingArguments does)")
    ap.add_argument("--out", required=True, help="each mode writes <out>/<mode>/result.json")
    ap.add_argument("--batch", type=int, default=BATCH, help="per process (one process with the global batch "
                    "computes what two with half of it do)")
    args = ap.parse_args()
    for i, mode in enumerate(args.mode.split(",")):
        if mode not in ("plain", "plugin", "launch"):
            raise SystemExit(f"unknown mode {mode!r}")
        if i:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        out = os.path.join(args.out, mode)
        os.makedirs(out, exist_ok=True)
        run(mode, out, args.batch)
    import torch.distributed as dist

    if dist.is_initialized():  # a rank leaving with its gloo group alive can abort at exit while its peer closes
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
