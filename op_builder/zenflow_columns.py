from .cpu_adam import CPU_OPTIM_COMMON, CPUOptimOpBuilder


class ZenFlowColumnsBuilder(CPUOptimOpBuilder):
    """ZenFlow's host-side gather/scatter of selected matrix columns in a flat ZeRO partition."""

    NAME = "zenflow_columns"

    def sources(self) -> list[str]:
        return ["cpu/columns.c", "cpu/norm.c", *CPU_OPTIM_COMMON, "py/zenflow_columns_binding.c"]
