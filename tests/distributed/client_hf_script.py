"""PEFT and TRL on top of the Hugging Face Trainer, as users write them (run by test_client_peft_trl.py through
the alias's `deepspeed` command on 2 CPU ranks). Several trainings run one after the other in the same
processes, each with its own TrainingArguments (which resets accelerate's state, as a new script would):

  lora        Trainer on a LoRA model (peft.get_peft_model) of a small GPT-2 built from a config, no DeepSpeed
              (plain DDP over the 2 ranks): the reference
  lora_z2     the same with --deepspeed (ZeRO stage 2), a checkpoint at step 6
  lora_z2r    the same resumed from lora_z2/checkpoint-6
  lora_z3     the same with ZeRO stage 3, a checkpoint at step 6
  lora_z3r    the same resumed from lora_z3/checkpoint-6
  sft         TRL's SFTTrainer on a small causal LM, a small in-memory text dataset, no DeepSpeed
  sft_z2      the same with --deepspeed (ZeRO stage 2)

Each writes <out>/<name>/result.json on rank 0: the logged losses, and for the LoRA runs whether the adapter
that trainer.save_model wrote loads back (PeftModel.from_pretrained on a fresh base model) equal to the live
adapter weights (gathered under ZeRO-3); the live adapter weights go to <out>/<name>/adapter.pt.
Usage: client_hf_script.py OUT_DIR NAME[,NAME...]"""
import faulthandler
import json
import os
import sys

import torch

# a rank that aborts (SIGABRT at exit has been seen once in CI) prints every thread's Python stack
faulthandler.enable()

VOCAB, SEQ, STEPS = 64, 16, 10
Z2 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                "weight_decay": "auto"}},
      "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": "auto"},
      "steps_per_print": 2000}
Z3 = dict(Z2, zero_optimization={"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_gather_16bit_weights_on_model_save": True})


def gpt2(vocab: int = VOCAB):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=SEQ + 4, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


class Counting(torch.utils.data.Dataset):
    """Token t+1 follows t (mod VOCAB) from a random start: a pattern the adapters learn within ten steps."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.x = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def training_args(cls, out: str, ds: dict | None, resume: bool, **extra):
    save = {"save_strategy": "steps", "save_steps": 6} if ds is not None and not resume else {"save_strategy": "no"}
    import copy

    return cls(output_dir=out, deepspeed=copy.deepcopy(ds), use_cpu=True, per_device_train_batch_size=4,
               gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=5e-3, weight_decay=0.0,
               max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, seed=42, report_to="none",
               logging_steps=1, disable_tqdm=True, bf16=False, **save, **extra)  # TRL defaults to bf16


def lora_model():
    from peft import LoraConfig, get_peft_model

    model = gpt2()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                     fan_in_fan_out=True, task_type="CAUSAL_LM")
    torch.manual_seed(1)  # the adapters' A matrices
    return get_peft_model(model, cfg)


def adapter_weights(model, zero3: bool) -> dict:
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: p.detach().cpu().clone() for n, p in named}


def run_lora(out: str, ds: dict | None, resume_from: str | None) -> dict:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import Trainer, TrainingArguments

    args = training_args(TrainingArguments, out, ds, resume_from is not None)
    model = lora_model()
    trainer = Trainer(model=model, args=args, train_dataset=Counting(2 * 4 * 2 * STEPS))
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(out + "/final")
    zero3 = ds is not None and ds["zero_optimization"]["stage"] == 3
    live = adapter_weights(trainer.model, zero3)
    result = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
              "trainable": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                               for p in trainer.model.parameters() if p.requires_grad),
              "engine": type(trainer.model_wrapped).__module__}
    if args.process_index == 0:
        loaded = PeftModel.from_pretrained(gpt2(), out + "/final")
        saved = get_peft_model_state_dict(loaded)
        live_named = {k.replace(".default", ""): v for k, v in live.items()}
        result["adapter_keys_equal"] = set(saved) == set(live_named)
        result["adapter_load_equal"] = result["adapter_keys_equal"] and all(
            torch.equal(saved[k], live_named[k]) for k in saved)
        torch.save(live, out + "/adapter.pt")
    return result


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def run_sft(out: str, ds: dict | None) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    n = VOCAB - 3
    texts = [" ".join(f"w{(s + k) % n}" for k in range(SEQ - 2)) for s in range(2 * 4 * 2 * STEPS)]
    args = training_args(SFTConfig, out, ds, False, max_length=SEQ, packing=False, dataset_text_field="text")
    trainer = SFTTrainer(model=gpt2(VOCAB), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer())
    trainer.train()
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "engine": type(trainer.model_wrapped).__module__}


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher appends it
    out_dir, names = argv[0], argv[1].split(",")
    for name in names:
        out = os.path.join(out_dir, name)
        ds = {"z2": Z2, "z3": Z3}.get(name.split("_")[-1].rstrip("r")) if "_" in name else None
        if name.startswith("lora"):
            resume = os.path.join(out_dir, name[:-1], "checkpoint-6") if name.endswith("r") else None
            result = run_lora(out, ds, resume)
        else:
            result = run_sft(out, ds)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
