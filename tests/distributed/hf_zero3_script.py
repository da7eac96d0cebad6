"""Hugging Face's ZeRO-3 paths as users write them (run by test_hf_zero3.py through the alias's `deepspeed`
command, or in one plain process for the reference runs). Three commands:

  make DIR [COMMAND ...]        a small GPT-2 built from a config (no download), save_pretrained to DIR; then
                                COMMAND, if given, in the same process
  load DIR OUT CFG [COMMAND ...] HfDeepSpeedConfig(CFG) kept alive, from_pretrained(DIR) under zero.Init,
                                then resize_token_embeddings; writes what it saw per rank to OUT (rank r
                                writes OUT.rank<r>.json); then COMMAND, if given, in the same processes (the
                                HfDeepSpeedConfig gone with load's frame, as when a user's script moves on)
  train DIR <TrainingArguments> the Trainer on from_pretrained(DIR) (under zero.Init when --deepspeed names a
                                stage-3 config, TrainingArguments being created first); writes
                                <output_dir>/final (trainer.save_model), <output_dir>/losses.json and
                                <output_dir>/live.pt (every parameter gathered from the live model, rank 0)
"""
import json
import os
import sys

import torch

VOCAB = 100


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make(model_dir: str) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config()).save_pretrained(model_dir)


def _drop_local_rank(argv: list) -> list:
    # the deepspeed launcher appends --local_rank=N
    return [a for a in argv if not a.startswith("--local_rank")]


def load(model_dir: str, out: str, ds_config_path: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # the plain load first (no DeepSpeed config alive yet): the reference values
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    ref = {n: p.detach().clone() for n, p in plain.named_parameters()}
    assert not is_deepspeed_zero3_enabled()

    with open(ds_config_path) as f:
        ds_config = json.load(f)
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841  (kept alive: is_deepspeed_zero3_enabled() reads it)
    assert is_deepspeed_zero3_enabled()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

    report = {"rank": rank, "world": world, "params": {}, "resize": {}}
    shard_total, full_total = 0, 0
    for name, p in model.named_parameters():
        info = {"numel": p.numel(), "ds_numel": getattr(p, "ds_numel", None),
                "ds_shape": list(getattr(p, "ds_shape", [])), "has_ds_id": hasattr(p, "ds_id"),
                "status": getattr(getattr(p, "ds_status", None), "name", None),
                "ds_tensor_numel": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None}
        shard_total += info["ds_tensor_numel"] or 0
        full_total += info["ds_numel"] or 0
        with deepspeed.zero.GatheredParameters([p]):
            info["gathered_status"] = p.ds_status.name
            info["gathered_shape"] = list(p.shape)
            info["equal_to_plain"] = bool(torch.equal(p.detach().cpu(), ref[name]))
        info["status_after"] = p.ds_status.name
        report["params"][name] = info
    report["shard_total"], report["full_total"] = shard_total, full_total
    report["plain_total"] = sum(v.numel() for v in ref.values())
    report["not_available"] = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    # every parameter at once too
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        report["all_equal_at_once"] = all(torch.equal(p.detach().cpu(), ref[n]) for n, p in model.named_parameters())

    # from_config under ZeRO-3: built under zero.Init, then initialize_weights_zero3 initializes each module on
    # rank 0 inside GatheredParameters(modifier_rank=0)
    fresh = AutoModelForCausalLM.from_config(gpt2_config())
    init = {"partitioned": all(p.numel() == 0 and hasattr(p, "ds_id") for p in fresh.parameters())}
    with deepspeed.zero.GatheredParameters(list(fresh.parameters())):
        sd = {n: p.detach().cpu().clone() for n, p in fresh.named_parameters()}
    init["checksum"] = float(sum(v.double().sum() for v in sd.values()))
    init["ln_weights_one"] = all(bool((v == 1).all()) for n, v in sd.items() if ".ln_" in n and n.endswith("weight"))
    init["biases_zero"] = all(bool((v == 0).all()) for n, v in sd.items() if n.endswith("bias"))
    init["wte_std"] = float(sd["transformer.wte.weight"].std())
    report["from_config"] = init
    del fresh

    # resize_token_embeddings gathers the old embeddings and copies their rows into a new one
    new_size = VOCAB + 28
    model.resize_token_embeddings(new_size)
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    with deepspeed.zero.GatheredParameters([emb.weight, head.weight]):
        w = emb.weight.detach().cpu().clone()
        report["resize"] = {
            "shape": list(w.shape), "num_embeddings": emb.num_embeddings, "config_vocab": model.config.vocab_size,
            "old_rows_equal": bool(torch.equal(w[:VOCAB], ref["transformer.wte.weight"])),
            "new_rows_finite": bool(torch.isfinite(w[VOCAB:]).all()),
            "head_tied": head.weight is emb.weight, "head_shape": list(head.weight.shape),
            "checksum_before_initialize": float(w.double().sum()),
        }
    # the resized model runs a forward on every rank (a partitioned model runs inside an engine: initialize one),
    # its MLPs as ZeRO-3 leaf modules (as accelerate's set_moe_leaf_modules flags MoE layers)
    from deepspeed.utils import set_z3_leaf_modules

    report["resize"]["leaf_modules"] = len(set_z3_leaf_modules(model, [type(model.transformer.h[0].mlp)]))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    ids = torch.randint(0, new_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    report["resize"]["logits_shape"] = list(logits.shape)
    for n, p in engine.module.named_parameters():
        if n == "transformer.wte.weight":
            report["resize"]["partitioned_after_initialize"] = p.numel() == 0 and p.ds_numel == new_size * 64
            with deepspeed.zero.GatheredParameters([p]):
                # the added rows were drawn on each rank; initialize made rank 0's values everyone's
                report["resize"]["checksum_after_initialize"] = float(p.detach().double().sum())
                report["resize"]["old_rows_equal_after_initialize"] = bool(
                    torch.equal(p.detach().cpu()[:VOCAB], ref["transformer.wte.weight"]))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f, indent=1)


def train(model_dir: str, argv: list) -> None:
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    # TrainingArguments(deepspeed=...) exists before the model: from_pretrained sees ZeRO-3 and uses zero.Init
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    partitioned = any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), eval_dataset=RandomTokens(16, seed=1))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(args.output_dir + "/final")
    live = {}
    if partitioned:
        import deepspeed

        for n, p in trainer.model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                live[n] = p.detach().cpu().clone()
    else:
        live = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    if args.process_index == 0:
        torch.save(live, args.output_dir + "/live.pt")
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(args.output_dir + "/losses.json", "w") as f:
            json.dump({"losses": losses, "eval_loss": eval_loss, "partitioned_at_load": partitioned}, f)


def main(argv: list) -> None:
    cmd, rest = argv[0], argv[1:]
    if cmd == "make":
        make(rest[0])
        if rest[1:]:  # a command after it runs in the same process (the reference run on the model just made)
            main(rest[1:])
    elif cmd == "load":
        load(rest[0], rest[1], rest[2])
        if rest[3:]:  # a command after it runs in the same processes (the ZeRO-3 Trainer run: a launch less)
            import gc

            gc.collect()  # load's HfDeepSpeedConfig and engine are garbage now: nothing of them is alive
            main(rest[3:])
    elif cmd == "train":
        train(rest[0], rest[1:])
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(_drop_local_rank(sys.argv[1:]))
