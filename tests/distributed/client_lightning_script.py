"""A PyTorch Lightning training script as users write it, run with the `deepspeed` alias installed (by
test_client_lightning.py, and by benchmarks/gpu_clients.py on the GPU machine). One script start trains
several times in a row (Lightning starts the other ranks on the first fit and reuses them after):

  ddp              strategy="ddp": the reference
  stage_1 ...      strategy="deepspeed_stage_1" | "deepspeed_stage_2" | "deepspeed_stage_2_offload" |
                   "deepspeed_stage_3" (names: stage_1, stage_2, stage_2_offload, stage_3)
  config           strategy=DeepSpeedStrategy(config={...}): stage 2 with the optimizer in the config
  resume_<name>    <name> again, resumed with trainer.fit(ckpt_path=...) from the checkpoint <name> saved at step 6
  param_offload_2  DeepSpeedStrategy(stage=2, offload_parameters=True): parameter offload below stage 3, which
                   DeepSpeed ignores (it offloads parameters at stage 3 only): trains as stage 2

Lightning refuses its DeepSpeed strategy unless the accelerator is CUDA ("The DeepSpeed strategy is only
supported on CUDA GPUs", with DeepSpeed itself too). With --cpu-gate-lifted the strategies are a
DeepSpeedStrategy subclass that skips only that check and the one that device indices are local ranks
(both about CUDA devices), built with the same arguments
Lightning's registry gives each name, so every other Lightning code path runs unchanged on CPU ranks.

Each run trains a small MLP for 10 optimizer steps (gradient_clip_val=1.0, AdamW; DeepSpeedCPUAdam under
optimizer offload), one step an epoch, and saves a checkpoint at the end of step 6 (epoch 6) with
trainer.save_checkpoint. No gradient accumulation: Lightning divides the loss by accumulate_grad_batches
before engine.backward divides it by gradient_accumulation_steps again (DeepSpeed's engine does too), so
its DeepSpeed gradients are 1/accumulate_grad_batches of DDP's, which clipping would tell apart. Rank
r writes <out>/<run>/rank<r>.json: its micro-batch losses and what ran; rank 0 also writes live6.pt (the
weights at the checkpoint, gathered under ZeRO-3) and, for DeepSpeed runs, converts the checkpoint with
Lightning's convert_zero_checkpoint_to_fp32_state_dict into fp32.pt.
Usage: client_lightning_script.py OUT RUN[,RUN...] [--accelerator cpu|gpu] [--devices N] [--precision P]
       [--cpu-gate-lifted]"""
import argparse
import json
import os

import torch

STEPS, BATCH, SAVE_AT = 10, 8, 6
DS_CONFIG = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 400, "allgather_bucket_size": 400},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
             "zero_allow_untested_optimizer": True}


def lightning_module():
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = None
            self.losses: list = []

        def configure_model(self) -> None:
            # built in Lightning's model_sharded_context: under ZeRO-3 inside deepspeed.zero.Init (partitioned
            # as constructed); the other strategies build it plainly
            if self.body is None:
                torch.manual_seed(0)
                self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                                torch.nn.Tanh(), torch.nn.Linear(32, 4))
                self.built_partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in self.body.parameters())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            config = getattr(self.trainer.strategy, "config", None) or {}
            if config.get("zero_optimization", {}).get("offload_optimizer"):
                # ZeRO-Offload wants DeepSpeed's CPU Adam (Lightning's documentation says so; DeepSpeed refuses
                # a torch optimizer there unless zero_force_ds_cpu_optimizer is false)
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-2, weight_decay=0.01, adamw_mode=True)
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    return Regressor


def loader(world: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    # one batch a rank, so one optimizer step an epoch: Lightning resumes a checkpoint saved at an epoch's end
    # with a fresh data iterator but the batch index going on (as with DDP), so with several batches an epoch
    # the resumed steps would see other batches than the straight run's
    x = torch.randn(BATCH * world, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, 0.5 * (x @ w)), batch_size=BATCH)


def strategy(name: str, gate_lifted: bool):
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    if name == "ddp":
        return "ddp"
    if name == "config":
        kwargs = {"config": json.loads(json.dumps(DS_CONFIG))}
    elif name == "param_offload_2":
        kwargs = {"stage": 2, "offload_parameters": True}
    else:
        kwargs = dict(StrategyRegistry[f"deepspeed_{name}"]["init_params"])
    if not gate_lifted:
        return DeepSpeedStrategy(**kwargs) if name in ("config", "param_offload_2") else f"deepspeed_{name}"

    import lightning.pytorch.strategies.deepspeed as ds_strategy

    class CPUGateLifted(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # DeepSpeedStrategy's own only adds the CUDA check
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self) -> None:  # Lightning's, less the check that device indices are local ranks
            check = ds_strategy._validate_device_index_selection
            ds_strategy._validate_device_index_selection = lambda devices: None
            try:
                super().setup_distributed()
            finally:
                ds_strategy._validate_device_index_selection = check

    return CPUGateLifted(**kwargs)


def live_weights(trainer, module) -> dict:
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def fit(run: str, out: str, args) -> None:
    import lightning.pytorch as pl

    resume = run.startswith("resume_")
    name = run[len("resume_"):] if resume else run
    state = {"saved": False}

    class SaveAtStep(pl.Callback):
        def on_train_end(self, trainer, module) -> None:  # what ran, before the strategy's teardown
            engine = trainer.strategy.model
            state["engine"] = type(engine).__module__
            state["zero_stage"] = getattr(engine, "zero_optimization_stage", lambda: None)()
            state["offload"] = bool(getattr(engine, "zero_cpu_offload", lambda: False)())
            state["optimizer"] = type(getattr(getattr(engine, "optimizer", None), "optimizer", None)).__name__

        def on_train_epoch_end(self, trainer, module) -> None:
            if trainer.global_step == SAVE_AT and not resume:
                trainer.save_checkpoint(os.path.join(out, "ckpt"))
                live = live_weights(trainer, module)
                if trainer.is_global_zero:
                    torch.save(live, os.path.join(out, "live6.pt"))
                state["saved"] = True

    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy(name, args.gate_lifted),
                         precision=args.precision, max_steps=STEPS, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=True,
                         callbacks=[SaveAtStep()], use_distributed_sampler=True)
    module = lightning_module()()
    ckpt = os.path.join(os.path.dirname(out), name, "ckpt") if resume else None
    trainer.fit(module, loader(trainer.world_size), ckpt_path=ckpt)
    os.makedirs(out, exist_ok=True)
    record = {"losses": module.losses, "world": trainer.world_size, "global_step": trainer.global_step,
              "strategy": type(trainer.strategy).__name__, "saved": state["saved"],
              "built_partitioned": module.built_partitioned,
              **{k: state.get(k) for k in ("engine", "zero_stage", "offload", "optimizer")}}
    if name != "ddp" and state["saved"] and trainer.is_global_zero:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        converted = convert_zero_checkpoint_to_fp32_state_dict(os.path.join(out, "ckpt"), os.path.join(out, "fp32.pt"))
        record["converted_keys"] = sorted(k for k in converted if k != "state_dict")
    final = live_weights(trainer, module)
    if trainer.is_global_zero:
        torch.save(final, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--cpu-gate-lifted", dest="gate_lifted", action="store_true")
    args = ap.parse_args()
    for run in args.runs.split(","):
        out = os.path.join(args.out, run)
        os.makedirs(out, exist_ok=True)
        fit(run, out, args)


if __name__ == "__main__":
    main()
