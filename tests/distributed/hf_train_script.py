"""A Hugging Face Trainer script as users write it (run by test_hf_trainer.py): a small GPT-2 built
from a config (no download), a fixed random dataset, `TrainingArguments` from the command line, so
`--deepspeed ds_config.json` switches DeepSpeed on. Writes the final weights to <output_dir>/final."""
import faulthandler
import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments

# a rank that aborts (SIGABRT at exit has been seen once in CI) prints every thread's Python stack
faulthandler.enable()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 100, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    trainer = Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir + "/final")


if __name__ == "__main__":
    main()
