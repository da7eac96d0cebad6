from .builder import CPUOpBuilder

CPU_OPTIM_COMMON = ["py/cpu_optim_args.c"]


class CPUOptimOpBuilder(CPUOpBuilder):
    """The CPU optimizer ops' shared flags: no floating-point contraction, so the AVX-512, AVX2
    and scalar builds compute identical bits (the kernels use no FMA either)."""

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-ffp-contract=off"]

    def shared_sources(self) -> list[str]:
        # compiled once for every CPU optimizer op of one SIMD path
        return [*super().shared_sources(), *CPU_OPTIM_COMMON, "cpu/norm.c"]


class CPUAdamBuilder(CPUOptimOpBuilder):
    """Adam/AdamW for host tensors (DeepSpeedCPUAdam, ZeRO-Offload)."""

    NAME = "cpu_adam"

    def sources(self) -> list[str]:
        return ["cpu/adam.c", "cpu/norm.c", *CPU_OPTIM_COMMON, "py/cpu_adam_binding.c"]
