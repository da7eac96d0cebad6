"""A small PPO loop (DeepSpeed-Chat's step 3, shrunk): an actor trained with the hybrid engine, a critic
engine, a frozen reference copy of the actor; each iteration generates -> scores -> trains.

    deepspeed_c --num_gpus 2 examples/rlhf/ppo.py [--iterations 30] [--zero_stage 3] [--lora_dim 8]

On a machine without GPUs, --num_gpus N starts N CPU processes over gloo. The actor is a tiny LLaMA built
from a config (or --model_name_or_path, any Hugging Face causal LM). The reward is a rule, so the example
needs no reward model: the fraction of generated tokens whose id is even. PPO should push it up from about
0.5. Rank 0 prints one line an iteration (reward, losses, generation tokens/s, iteration time) and, with
--out_dir, writes metrics.csv there."""
from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_c as deepspeed  # noqa: E402
from lora import convert_to_lora  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PPO with deepspeed_c's hybrid engine")
    p.add_argument("--model_name_or_path", default=None, help="a HF causal LM; default: a tiny LLaMA from a config")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--batch", type=int, default=4, help="prompts per rank per iteration")
    p.add_argument("--prompt_len", type=int, default=8)
    p.add_argument("--gen_len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--zero_stage", type=int, default=3)
    p.add_argument("--lora_dim", type=int, default=0, help="> 0: LoRA on the actor's decoder layers")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--actor_lr", type=float, default=3e-3)
    p.add_argument("--critic_lr", type=float, default=5e-4)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--ppo_epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out_dir", default=None)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return p.parse_args()


def build_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers as tf

    torch.manual_seed(args.seed)
    if args.model_name_or_path:
        actor = tf.AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        cfg = tf.LlamaConfig(vocab_size=256, hidden_size=args.hidden, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        actor = tf.LlamaForCausalLM(cfg)
    body = copy.deepcopy(actor.base_model)
    critic = Critic(body, actor.config.hidden_size)
    if args.lora_dim > 0:
        convert_to_lora(actor, args.lora_dim)
    return actor, critic


class Critic(torch.nn.Module):
    """A value per token: the actor's transformer body with a scalar head (DeepSpeed-Chat's RewardModel shape)."""

    def __init__(self, body: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.body = body
        self.v_head = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.v_head(h).squeeze(-1).float()


def ds_config(args: argparse.Namespace, lr: float, hybrid: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
           "zero_optimization": {"stage": args.zero_stage}}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": args.prompt_len + args.gen_len,
                                "release_inference_cache": False, "pin_parameters": True}
    return cfg


def token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """log p(seq[t+1] | seq[:t+1]) for every position."""
    return torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2, seq[:, 1:, None]).squeeze(-1)


def score(seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The rule reward: the share of generated tokens with an even id."""
    return (seq[:, prompt_len:] % 2 == 0).float().mean(dim=1)


def advantages(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the generated positions; returns (advantages, returns)."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        nxt = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    return adv, adv + values


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    actor_model, critic_model = build_models(args)
    ref = copy.deepcopy(actor_model).eval().requires_grad_(False)
    actor, *_ = deepspeed.initialize(model=actor_model, config=ds_config(args, args.actor_lr, hybrid=True))
    critic, *_ = deepspeed.initialize(model=critic_model, config=ds_config(args, args.critic_lr, hybrid=False))
    dev = actor.device
    ref.to(dev, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(args.seed + rank)
    rows = []
    p_len = args.prompt_len
    for it in range(1, args.iterations + 1):
        t0 = time.time()
        prompts = torch.randint(3, actor.module.config.vocab_size, (args.batch, p_len), generator=gen).to(dev)
        # -- experience: generate with the hybrid engine, score, log-probs and values -----------------------
        actor.eval()
        critic.eval()
        tg = time.time()
        seq = actor.generate(prompts, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, do_sample=True,
                             top_k=0, top_p=1.0, pad_token_id=0)
        gen_s = time.time() - tg
        with torch.no_grad():
            old_logp = token_logprobs(actor(input_ids=seq).logits, seq)[:, p_len - 1:]
            ref_logp = token_logprobs(ref(input_ids=seq).logits, seq)[:, p_len - 1:]
            old_values = critic(seq)[:, p_len - 1:-1]
            reward = score(seq, p_len)
            per_token = -args.kl_coef * (old_logp - ref_logp)
            per_token[:, -1] += reward
            adv, returns = advantages(per_token, old_values)
            adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        # -- training: PPO's clipped objectives for the actor and the critic ---------------------------------
        actor.train()
        critic.train()
        for _ in range(args.ppo_epochs):
            logp = token_logprobs(actor(input_ids=seq).logits, seq)[:, p_len - 1:]
            ratio = torch.exp(logp - old_logp)
            actor_loss = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv).mean()
            actor.backward(actor_loss)
            actor.step()
            values = critic(seq)[:, p_len - 1:-1]
            clipped = old_values + (values - old_values).clamp(-args.clip, args.clip)
            critic_loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()
            critic.backward(critic_loss)
            critic.step()
        stats = torch.tensor([reward.mean().item(), actor_loss.item(), critic_loss.item()], device=dev)
        torch.distributed.all_reduce(stats)
        stats /= torch.distributed.get_world_size()
        it_s = time.time() - t0
        row = (it, *[round(v, 5) for v in stats.tolist()], round(args.batch * args.gen_len / gen_s, 1), round(it_s, 4))
        rows.append(row)
        if rank == 0:
            print(f"iter {it:3d} | reward {row[1]:.3f} | actor loss {row[2]:+.4f} | critic loss {row[3]:.4f} | "
                  f"generate {row[4]:.0f} tokens/s | iteration {it_s:.3f} s", flush=True)
    if rank == 0 and args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["iteration", "reward", "actor_loss", "critic_loss", "gen_tokens_per_s", "iteration_s"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
