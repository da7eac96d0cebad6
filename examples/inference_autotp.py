"""AutoTP inference with init_inference: a tiny GPT-2 and LLaMA (random weights, built from configs) served
over `--num_gpus N` ranks; every rank prints whether its greedy tokens equal the unsharded model's.

    deepspeed_c --num_gpus 2 examples/inference_autotp.py
"""
from __future__ import annotations

import copy
import os

import torch
import transformers

import deepspeed_c


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed_c.init_distributed()
    torch.manual_seed(0)
    models = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=127, n_embd=64, n_layer=2, n_head=4,
                                                                             bos_token_id=0, eos_token_id=0)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=world if 4 % world == 0 else 4, bos_token_id=0, eos_token_id=0)),
    }
    ids = torch.randint(0, 127, (1, 8))  # GPT-2's vocabulary here is odd (as its real 50257): padded shards
    for name, model in models.items():
        model.eval()
        ref = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        engine = deepspeed_c.init_inference(copy.deepcopy(model), tensor_parallel={"tp_size": world},
                                            dtype=torch.float32)
        device = next(engine.module.parameters()).device  # the accelerator's (a GPU under NCCL)
        out = engine.generate(input_ids=ids.to(device), max_new_tokens=8, do_sample=False, pad_token_id=0)
        print(f"rank {int(os.environ.get('RANK', '0'))} {name} tp={world}: tokens equal the unsharded model's: "
              f"{torch.equal(out.cpu(), ref)}", flush=True)


if __name__ == "__main__":
    main()
