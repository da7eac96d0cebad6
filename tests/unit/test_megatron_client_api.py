"""The DeepSpeed names Megatron-DeepSpeed (pretrain_gpt.py and megatron/) imports or calls, each
resolving under deepspeed_c with DeepSpeed 0.19.8's behaviour: the module-level imports its training
script needs before it runs a step, the accelerator's typed-tensor constructors and default generator
(its model-parallel RNG tracker swaps that generator's state), OpBuilder.is_rocm_pytorch (read at import
of megatron/initialize.py) and runtime.utils.PartitionedTensor (its zero-bubble pipeline engine), the
last on 2 gloo ranks against the unsplit tensor, in the same launch as a PipelineEngine whose second tensor rank has
no data iterator (Megatron's get_batch_pipe broadcasts tensor rank 0's batch), and as the PipelineEngine extension
points its zero-bubble engine and MoE path use (a client's schedule and instructions through `_INSTRUCTION_MAP`,
`get_additional_losses` aggregation: pipe_client_extension.py) against the unsplit model trained in float64."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.unit import pipe_client_extension as ext

# (module, name) pairs Megatron-DeepSpeed imports at module level or calls; from its source (megatron/,
# pretrain_gpt.py), the list in README "Megatron-DeepSpeed as a client".
MEGATRON_IMPORTS = [
    ("", "initialize"), ("", "init_distributed"), ("", "add_config_arguments"), ("", "PipelineEngine"),
    ("", "get_accelerator"), ("comm", "get_rank"), ("comm", "all_reduce"), ("comm", "barrier"),
    ("accelerator", "get_accelerator"), ("accelerator.real_accelerator", "get_accelerator"),
    ("checkpointing", "configure"), ("checkpointing", "is_configured"), ("checkpointing", "checkpoint"),
    ("checkpointing", "get_cuda_rng_tracker"), ("checkpointing", "model_parallel_cuda_manual_seed"),
    ("checkpointing", "model_parallel_reconfigure_tp_seed"),
    ("runtime.activation_checkpointing.checkpointing", "checkpoint"),
    ("checkpoint", "ORIGINAL_VOCAB_SIZE"), ("checkpoint", "PADDED_VOCAB_SIZE"),
    ("checkpoint", "UNIVERSAL_CHECKPOINT_INFO"), ("checkpoint", "UNIVERSAL_CHECKPOINT_VERSION_KEY"),
    ("checkpoint", "UNIVERSAL_CHECKPOINT_VERSION_VALUE"), ("checkpoint", "VOCABULARY_PARAMETER_PATTERNS"),
    ("checkpoint", "PIPELINE_REPLICATED_PARAMETER_PATTERNS"), ("checkpoint", "TP_REPLICATED_PARAMETER_PATTERNS"),
    ("checkpoint", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"), ("checkpoint", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"),
    ("compression.compress", "init_compression"), ("compression.compress", "redundancy_clean"),
    ("env_report", "main"), ("moe.layer", "MoE"), ("moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
    ("ops.adam", "DeepSpeedCPUAdam"), ("ops.adam", "FusedAdam"), ("ops.op_builder.builder", "OpBuilder"),
    ("pipe", "PipelineModule"), ("pipe", "LayerSpec"), ("pipe", "TiedLayerSpec"),
    ("runtime.data_pipeline.curriculum_scheduler", "CurriculumScheduler"),
    ("runtime.data_pipeline.data_routing.helper", "convert_to_random_ltd"),
    ("runtime.data_pipeline.data_routing.helper", "remove_random_ltd_state_dict"),
    ("runtime.dataloader", "RepeatingLoader"), ("runtime.pipe.engine", "PipelineEngine"),
    *[("runtime.pipe.schedule", n) for n in ("PipeSchedule", "PipeInstruction", "BufferOpInstruction", "LoadMicroBatch",
                                               "RecvActivation", "SendActivation", "RecvGrad", "SendGrad", "ForwardPass",
                                               "BackwardPass", "ReduceGrads", "ReduceTiedGrads", "OptimizerStep",
                                               "TrainSchedule")],
    ("runtime.pipe.topology", "PipeModelDataParallelTopology"), ("runtime.utils", "PartitionedTensor"),
    ("runtime.utils", "see_memory_usage"), ("runtime.zero", "GatheredParameters"), ("zero", "Init"),
    ("zero", "TiledLinear"), ("sequence.fpdt_layer", "FPDT_InputConstruct"), ("sequence.fpdt_layer", "FPDT_FFN"),
    ("sequence.fpdt_layer", "FPDT_Attention"), ("sequence.fpdt_layer", "FPDT_LogitsLoss"),
    ("sequence.layer", "DistributedAttention"), ("utils", "safe_get_full_fp32_param"),
    *[("utils.timer", n) for n in ("BACKWARD_MICRO_TIMER", "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
                                    "BACKWARD_INNER_GLOBAL_TIMER")],
]


def test_every_name_megatron_deepspeed_imports_resolves():
    missing = []
    for mod, name in MEGATRON_IMPORTS:
        module, path = importlib.import_module("deepspeed_c"), "deepspeed_c"
        for part in mod.split(".") if mod else []:  # `deepspeed.checkpointing` is an attribute, not a module
            path += "." + part
            module = getattr(module, part) if hasattr(module, part) else importlib.import_module(path)
        if not hasattr(module, name):
            missing.append(f"deepspeed.{mod + '.' if mod else ''}{name}")
    assert not missing, missing


def test_accelerator_typed_tensors_and_default_generator():
    from deepspeed_c.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed_c.accelerator.cuda_accelerator import CUDA_Accelerator

    cpu = CPU_Accelerator()
    # DeepSpeed's host accelerator hands out torch's legacy types: data or sizes
    assert cpu.LongTensor([1, 2]).dtype == torch.int64 and cpu.LongTensor([1, 2]).tolist() == [1, 2]
    assert cpu.FloatTensor(3).shape == (3,) and cpu.FloatTensor(3).dtype == torch.float32
    for prop, dtype in [("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("DoubleTensor", torch.float64),
                        ("HalfTensor", torch.float16), ("IntTensor", torch.int32)]:
        assert getattr(cpu, prop)([1]).dtype == dtype, prop
    # Megatron's RNG tracker: get_state/set_state on the default generator moves torch's host stream
    gen = cpu.default_generator(0)
    state = gen.get_state()
    a = torch.rand(4)
    gen.set_state(state)
    assert torch.equal(torch.rand(4), a)
    # the device accelerator builds torch.tensor(data) on its device (not called here: no GPU needed)
    ctor = CUDA_Accelerator().FloatTensor
    assert ctor.keywords == {"dtype": torch.float32, "device": "cuda"}


def test_set_random_seed_reseeds_random_numpy_and_torch():
    import random

    import numpy

    from deepspeed_c.runtime.utils import set_random_seed

    def draw() -> tuple:
        return random.random(), float(numpy.random.rand()), torch.rand(3).tolist()

    set_random_seed(1138)  # DeepSpeedExamples' pipeline script seeds this way before building its model
    first = draw()
    random.seed(1138), numpy.random.seed(1138), torch.manual_seed(1138)
    assert draw() == first
    set_random_seed(2**70 + 5)  # wider than numpy's and torch's seeds: wrapped, as DeepSpeed does
    big = draw()
    random.seed(2**70 + 5), numpy.random.seed((2**70 + 5) % 2**32), torch.manual_seed((2**70 + 5) % 2**63)
    assert draw() == big
    with pytest.raises(TypeError, match="seed"):
        set_random_seed("1138")


def test_op_builder_is_rocm_pytorch():
    from deepspeed_c.ops.op_builder.builder import OpBuilder

    assert OpBuilder.is_rocm_pytorch() is (getattr(torch.version, "hip", None) is not None)
    assert OpBuilder.is_sycl_enabled() is False


def _partitioned_body(rank: int, world_size: int) -> list:
    import torch.distributed as dist

    import deepspeed_c.comm as dc
    from deepspeed_c.runtime.utils import PartitionedTensor

    dc.configure(enabled=True, prof_all=True)  # full()'s collectives are deepspeed_c.comm's, counted by its logger
    out = []
    for shape in [(4, 6), (3, 5)]:  # 24 elements split evenly, 15 unevenly (8 + 7)
        full = torch.arange(float(np.prod(shape))).reshape(shape) * 0.5 + 1
        part = PartitionedTensor(full, group=dist.group.WORLD)
        meta, local = part.to_meta(), part.data()
        # a receiver rebuilds it from the meta and its own slice, then gathers the whole tensor
        again = PartitionedTensor.from_meta(meta, local, group=dist.group.WORLD, device="cpu")
        out.append((meta.tolist(), local.numpy().copy(), again.full().numpy(), part.full_size(), tuple(part.local_size())))
    logged = {name: sum(v[0] for v in by_size.values()) for name, by_size in dc.comms_logger.get_raw_data().items()}
    dc.configure(enabled=False, prof_all=False)
    dc.reset_log()
    other = part.to_meta().clone()
    other[1 + 2 + 1] = 1 - rank  # the meta another rank wrote: its slice is not ours
    errors = []
    for bad in (other, other.float()):
        try:
            PartitionedTensor.from_meta(bad, part.data(), group=dist.group.WORLD)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    out.append(errors)
    out.append(_pipe_batch_fn_without_iterator(rank))
    out.append(ext.body(rank, world_size))
    out.append(logged)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """The module's one 2-rank launch: every rank's results of _partitioned_body."""
    return run_distributed(_partitioned_body, world_size=2)


def _pipe_layers() -> list:
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)]


_PIPE_X = torch.linspace(-1, 1, 16).reshape(4, 4)
_PIPE_Y = torch.linspace(0, 1, 4).reshape(4, 1)


def _pipe_batch_fn_without_iterator(rank: int) -> float:
    """Megatron's layout: tensor rank 0 reads the data, its batch_fn broadcasts over the tensor (slice) group,
    so the other tensor rank has no iterator and its batch_fn gets None (DeepSpeed's engine allows that)."""
    import torch.distributed as dist

    import deepspeed_c
    from deepspeed_c.pipe import PipelineModule
    from deepspeed_c.runtime.pipe.topology import PipeModelDataParallelTopology

    module = PipelineModule(layers=_pipe_layers(), loss_fn=torch.nn.functional.mse_loss,
                            topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed_c.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    group = engine.grid.get_slice_parallel_group()

    def batch_fn(batch):
        x, y = (torch.empty(2, 4), torch.empty(2, 1)) if batch is None else batch
        dist.broadcast(x, 0, group=group)
        dist.broadcast(y, 0, group=group)
        return x, y

    engine.set_batch_fn(batch_fn)
    data = iter([(_PIPE_X[:2].clone(), _PIPE_Y[:2].clone()), (_PIPE_X[2:].clone(), _PIPE_Y[2:].clone())])
    return float(engine.train_batch(data_iter=data if rank == 0 else None))


def test_two_ranks_partitioned_tensor_and_pipeline_batch_fn_without_iterator(two_ranks):
    results = two_ranks
    for idx, shape in enumerate([(4, 6), (3, 5)]):
        full = (np.arange(float(np.prod(shape))).reshape(shape) * 0.5 + 1).astype(np.float32)
        n = full.size
        bounds = [0, (n + 1) // 2, n]  # the first part takes the remainder
        for rank in range(2):
            meta, local, gathered, size, local_size = results[rank][idx]
            assert meta == [2, *shape, 2, rank, *bounds]
            np.testing.assert_array_equal(local, full.reshape(-1)[bounds[rank]:bounds[rank + 1]])
            np.testing.assert_array_equal(gathered, full)
            assert list(size) == list(shape) and local_size == (bounds[rank + 1] - bounds[rank],)
    model = torch.nn.Sequential(*_pipe_layers())
    with torch.no_grad():  # the first batch's loss, before the step: mean over its 2 micro-batches
        ref = 0.5 * sum(float(torch.nn.functional.mse_loss(model(_PIPE_X[i:i + 2]), _PIPE_Y[i:i + 2])) for i in (0, 2))
    for rank in range(2):
        np.testing.assert_allclose(results[rank][3], ref, rtol=1e-6)
    for rank in range(2):
        wrong_rank, wrong_dtype = results[rank][2]
        assert wrong_rank.startswith("ValueError") and f"part {1 - rank} of 2" in wrong_rank
        assert wrong_dtype.startswith("TypeError") and "torch.long" in wrong_dtype
        # the even split's full() is one all_gather_into_tensor, the uneven one's a broadcast per part
        assert results[rank][5] == {"all_gather_into_tensor": 1, "broadcast": 2}, results[rank][5]


def test_client_schedule_and_instructions_train_as_the_unsplit_model(two_ranks):
    """PP 2, ZeRO 0: a split-backward schedule of the client's own instructions (as --enable-zbh1-pipeline)."""
    ref = ext.reference(1, ext.STEPS)
    names: set = set()
    for rank in range(2):  # stage 0 and stage 1: the loss and the additional losses reach both
        run = two_ranks[rank][4]
        ext.check(run["pp2_split"], ref, names)
        # every micro-batch's backward went through the client's method, and every deferred weight pass ran
        assert run["calls"] == {"B": ext.GAS * ext.STEPS, "W": ext.GAS * ext.STEPS}
    assert names == set(ref["weights"])  # the two stages together hold the whole model


def test_client_schedule_at_zero_1_data_parallel(two_ranks):
    ref = ext.reference(2, ext.STEPS)
    for rank in range(2):
        names: set = set()
        ext.check(two_ranks[rank][4]["dp2_split"], ref, names)
        assert names == set(ref["weights"])


def test_client_schedule_at_bf16_with_fp32_accumulation(two_ranks):
    """DeepSpeed's BF16_Optimizer case: the client's passes see using_bf16_optimizer and fold the gradients they
    write through clear_lp_grads / update_hp_grads; the fp32 masters after one step equal 1F1B's."""
    for rank in range(2):
        (flag, split), (flag_1f1b, ref) = two_ranks[rank][4]["bf16_split"], two_ranks[rank][4]["bf16_1f1b"]
        assert flag and flag_1f1b
        assert len(split) == len(ref) > 0
        for a, b in zip(split, ref):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_additional_losses_on_the_builtin_schedule(two_ranks):
    ref = ext.reference(1, 1)
    for rank in range(2):
        run = two_ranks[rank][4]["pp2_1f1b"]
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
        np.testing.assert_allclose([run["extra"][0]["aux"], run["extra"][0]["aux_max"]],
                                   [ref["extra"][0]["aux"], ref["extra"][0]["aux_max"]], rtol=1e-5)


def test_an_instruction_missing_from_the_map_is_refused(two_ranks):
    for rank in range(2):
        assert two_ranks[rank][4]["unknown"] == "PipelineEngine does not understand instruction Unknown(note=1)"


def test_deepspeed_names_of_the_pipeline_dispatch():
    from deepspeed_c.runtime.pipe import schedule as S
    from deepspeed_c.runtime.pipe.engine import PipelineEngine

    m = PipelineEngine._INSTRUCTION_MAP
    for cls, name in [(S.ForwardPass, "_exec_forward_pass"), (S.BackwardPass, "_exec_backward_pass"),
                      (S.LoadMicroBatch, "_exec_load_micro_batch"), (S.SendActivation, "_exec_send_activations"),
                      (S.RecvActivation, "_exec_recv_activations"), (S.SendGrad, "_exec_send_grads"),
                      (S.RecvGrad, "_exec_recv_grads"), (S.ReduceGrads, "_exec_reduce_grads"),
                      (S.ReduceTiedGrads, "_exec_reduce_tied_grads"), (S.OptimizerStep, "_exec_optimizer_step")]:
        assert m[cls] is getattr(PipelineEngine, name), name


class _MegatronMpu:
    """Megatron's parallel_state spellings: model-parallel rank 3 counts stages, tensor rank 1 does not."""

    def get_tensor_model_parallel_rank(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 3


def test_model_parallel_seeds_follow_the_tensor_rank_and_reconfigure_reseeds_only_the_tracker():
    from deepspeed_c.runtime.activation_checkpointing import checkpointing as ckpt

    # the tracker forks the accelerator's RNG where there is one, else the host's
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seed_ref = torch.cuda.manual_seed if dev == "cuda" else torch.manual_seed
    state_ref = torch.cuda.get_rng_state if dev == "cuda" else torch.get_rng_state

    saved = ckpt.mpu
    ckpt.mpu = _MegatronMpu()
    try:
        ckpt.model_parallel_cuda_manual_seed(100)
        default_next = torch.rand(3, device=dev)
        seed_ref(100)
        assert torch.equal(default_next, torch.rand(3, device=dev))  # default RNG: the seed itself
        with ckpt.get_cuda_rng_tracker().fork():
            tracked = torch.rand(3, device=dev)
        seed_ref(100 + 2718 + 1)  # the tensor rank, not the model-parallel rank 3
        assert torch.equal(tracked, torch.rand(3, device=dev))

        seed_ref(5)
        before = state_ref()
        ckpt.model_parallel_reconfigure_tp_seed(40)
        assert torch.equal(state_ref(), before)  # the default stream is untouched
        with ckpt.get_cuda_rng_tracker().fork():
            tracked = torch.rand(3, device=dev)
        seed_ref(40 + 2718 + 1)
        assert torch.equal(tracked, torch.rand(3, device=dev))
    finally:
        ckpt.mpu = saved
        ckpt.get_cuda_rng_tracker().reset()


def test_set_data_post_process_func_reaches_the_training_loader(world_of_one):
    import deepspeed_c

    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(8, 1))
    engine, _, loader, _ = deepspeed_c.initialize(model=torch.nn.Linear(1, 1), config=cfg, training_data=data)

    def fn(batch, sampler_state):
        return batch

    engine.set_data_post_process_func(fn)
    assert loader is engine.training_dataloader and loader.post_process_func is fn
    bare, *_ = deepspeed_c.initialize(model=torch.nn.Linear(1, 1), config=cfg)
    bare.set_data_post_process_func(fn)  # no training loader: nothing to set, as DeepSpeed
    assert bare.training_dataloader is None
