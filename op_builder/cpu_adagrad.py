from .cpu_adam import CPU_OPTIM_COMMON, CPUOptimOpBuilder


class CPUAdagradBuilder(CPUOptimOpBuilder):
    """Adagrad for host tensors (DeepSpeedCPUAdagrad)."""

    NAME = "cpu_adagrad"

    def sources(self) -> list[str]:
        return ["cpu/adagrad.c", "cpu/norm.c", *CPU_OPTIM_COMMON, "py/cpu_adagrad_binding.c"]
