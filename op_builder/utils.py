from .builder import CPUOpBuilder


class UtilsBuilder(CPUOpBuilder):
    """Flatten a tensor list into one contiguous buffer and back (DeepSpeed's `utils` op)."""

    NAME = "utils"

    def sources(self) -> list[str]:
        return ["cpu/flatten.c", "py/utils_binding.c"]
