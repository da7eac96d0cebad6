from .builder import CPUOpBuilder
from .cpu_adam import CPU_OPTIM_COMMON


class CPUAdagradBuilder(CPUOpBuilder):
    NAME = "cpu_adagrad"

    def sources(self) -> list[str]:
        return ["cpu/adagrad.c", *CPU_OPTIM_COMMON, "py/cpu_adagrad_binding.c"]
