from .builder import CPUOpBuilder
from .cpu_adam import CPU_OPTIM_COMMON


class CPULionBuilder(CPUOpBuilder):
    NAME = "cpu_lion"

    def sources(self) -> list[str]:
        return ["cpu/lion.c", *CPU_OPTIM_COMMON, "py/cpu_lion_binding.c"]
