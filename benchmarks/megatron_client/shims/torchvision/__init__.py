"""Import-only torchvision stand-in (see ../README.md): Megatron-DeepSpeed's training.py imports its vision
data code at module level; GPT pretraining never calls it."""
from . import datasets, transforms  # noqa: F401


def get_image_backend() -> str:
    return "PIL"
