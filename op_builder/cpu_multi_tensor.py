from .cpu_adam import CPU_OPTIM_COMMON, CPUOptimOpBuilder


class CPUMultiTensorBuilder(CPUOptimOpBuilder):
    """Global L2 norm with inf/nan detection and in-place scale over host tensor lists."""

    NAME = "cpu_multi_tensor"

    def sources(self) -> list[str]:
        return ["cpu/norm.c", *CPU_OPTIM_COMMON, "py/cpu_multi_tensor_binding.c"]
