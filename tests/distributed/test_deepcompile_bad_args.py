"""engine.compile's bad arguments under compile.deepcompile (issue 50), refused before the first step with
the argument named: a backend other than DeepSpeed's two ('inductor', 'eager'), and a custom pass schedule
(not built). One rank: initialize brings up torch.distributed, which must stay out of the test process."""
from __future__ import annotations

from tests.harness import run_distributed


def _body(rank: int, world: int) -> dict:
    import torch

    import deepspeed_c

    out = {}
    for name, kwargs in (("backend", {"backend": "aot_eager"}), ("schedule", {"backend": "eager",
                                                                                  "schedule": [(0, ["zero3_compile"])]})):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "compile": {"deepcompile": True}}
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
        try:
            engine.compile(**kwargs)
            out[name] = ("accepted", "", engine.global_steps)
        except (ValueError, NotImplementedError) as e:
            out[name] = (type(e).__name__, str(e), engine.global_steps)
    return out


def test_compile_bad_arguments_name_the_argument():
    r = run_distributed(_body, 1, timeout=180)[0]
    kind, msg, steps = r["backend"]
    assert kind == "ValueError" and "'aot_eager'" in msg and "backend" in msg and "'inductor'" in msg, msg
    assert steps == 0
    kind, msg, steps = r["schedule"]
    assert kind == "NotImplementedError" and "schedule" in msg, msg
    assert steps == 0
