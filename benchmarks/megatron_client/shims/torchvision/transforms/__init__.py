"""Import-only stand-in (names are resolved only when vision data is built)."""


def __getattr__(name: str):
    raise AttributeError(f"torchvision.transforms.{name}: the import-only stand-in has no transforms")
