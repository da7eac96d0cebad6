"""DeepSpeed's `deepspeed.git_version_info`: the release, source revision, which ops were prebuilt
and the torch/CUDA/NCCL versions, as module attributes. Nothing is prebuilt at install time here
(ops are JIT-built on first use), so every `installed_ops` entry is False, as in a DeepSpeed wheel
installed without DS_BUILD_OPS."""
import torch

from deepspeed_c.version import DEEPSPEED_API_VERSION, __git_branch__, __git_hash__

version: str = DEEPSPEED_API_VERSION
git_hash: str = __git_hash__
git_branch: str = __git_branch__


def _major_minor(text: "str | None") -> str:
    # "0.0" is the value DeepSpeed's readers take to mean "not built for this runtime"
    return ".".join(str(text).split(".")[:2]) if text else "0.0"


def _nccl_version() -> str:
    try:
        ver = torch.cuda.nccl.version()
    except Exception:  # torch built without NCCL
        return "0.0"
    return f"{ver[0]}.{ver[1]}" if isinstance(ver, tuple) else "0.0"


def _installed_ops() -> "dict[str, bool]":
    from deepspeed_c.ops.op_builder import ALL_OPS
    return dict.fromkeys(ALL_OPS, False)


installed_ops: "dict[str, bool]" = _installed_ops()
accelerator_name: str = "cuda" if torch.cuda.is_available() else "cpu"
torch_info: "dict[str, object]" = {
    "version": _major_minor(torch.__version__.split("+")[0]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version() if torch.version.cuda else "0.0",
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}
