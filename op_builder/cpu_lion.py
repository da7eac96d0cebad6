from .cpu_adam import CPU_OPTIM_COMMON, CPUOptimOpBuilder


class CPULionBuilder(CPUOptimOpBuilder):
    """Lion for host tensors (DeepSpeedCPULion)."""

    NAME = "cpu_lion"

    def sources(self) -> list[str]:
        return ["cpu/lion.c", "cpu/norm.c", *CPU_OPTIM_COMMON, "py/cpu_lion_binding.c"]
