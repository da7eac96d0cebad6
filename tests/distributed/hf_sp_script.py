"""A Hugging Face Trainer script with ALST/Ulysses sequence parallelism the way accelerate documents it (run by
test_hf_trainer.py): `--sp_size N` sets TrainingArguments.parallelism_config = ParallelismConfig(sp_backend=
"deepspeed", sp_size=N, ...), so accelerate wraps the data loader in UlyssesSPDataLoaderAdapter, registers
UlyssesSPAttentionHF and passes its mpu to deepspeed.initialize; the Trainer aggregates the loss over the
sequence-parallel ranks. A small LLaMA from a config, fixed random tokens with position_ids (Ulysses needs them).
Writes <output_dir>/losses.json (rank 0) and the final model."""
import faulthandler
import json
import os
import sys

import torch
import transformers as tf
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

faulthandler.enable()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i], "position_ids": torch.arange(len(self.x[i]))}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 (HF's callback signature)
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def main() -> None:
    sp = 1
    if "--sp_size" in sys.argv:
        i = sys.argv.index("--sp_size")
        sp = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    if sp > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        args.parallelism_config = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=64, intermediate_size=64)
    losses = Losses()
    trainer = Trainer(model=tf.LlamaForCausalLM(cfg), args=args, train_dataset=RandomTokens(), callbacks=[losses])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(losses.losses, f)


if __name__ == "__main__":
    main()
