from .builder import CPUOpBuilder

CPU_OPTIM_COMMON = ["py/cpu_optim_args.c"]


class CPUAdamBuilder(CPUOpBuilder):
    """Adam/AdamW for host tensors (DeepSpeedCPUAdam, ZeRO-Offload)."""

    NAME = "cpu_adam"

    def sources(self) -> list[str]:
        return ["cpu/adam.c", "cpu/norm.c", *CPU_OPTIM_COMMON, "py/cpu_adam_binding.c"]
