"""Issue 39: where the host time of a batch-1 generate() token goes (injected LLaMA, CUDA graphs), bf16 and int8.
Prints ms/token through generate, the captured step's GPU ms, and cProfile's top functions for one generate."""
import cProfile
import copy
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import inference_rest as R  # noqa: E402

import deepspeed_c  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
base = R.llama(4096, layers, "cuda", torch.bfloat16)
ids = torch.randint(3, 32000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
gen = dict(do_sample=False, pad_token_id=0)
for name, extra in (("bf16", {}), ("int8", {"quant": {"weight": {"num_bits": 8, "group_size": 128}}})):
    e = deepspeed_c.init_inference(copy.deepcopy(base), dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                   max_out_tokens=200, enable_cuda_graph=True, **extra)
    for _ in range(2):
        e.generate(input_ids=ids, max_new_tokens=65, min_new_tokens=65, **gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.generate(input_ids=ids, max_new_tokens=129, min_new_tokens=129, **gen)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    e.generate(input_ids=ids, max_new_tokens=1, **gen)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    per = ((t1 - t0) - (t2 - t1)) / 128 * 1e3
    print(f"{name}: {per:.3f} ms/token through generate; captured step {R._replay_ms(e):.3f} ms")
    if name == "bf16" or layers <= 8:
        pr = cProfile.Profile()
        pr.enable()
        e.generate(input_ids=ids, max_new_tokens=65, min_new_tokens=65, **gen)
        torch.cuda.synchronize()
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(22)
        st.sort_stats("cumtime").print_stats(30)
    del e
    torch.cuda.empty_cache()
