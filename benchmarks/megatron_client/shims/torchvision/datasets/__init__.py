"""Import-only stand-in: VisionDataset is a base class Megatron's image_folder.py derives from at import."""
import torch.utils.data


class VisionDataset(torch.utils.data.Dataset):
    def __init__(self, root, transforms=None, transform=None, target_transform=None) -> None:
        raise NotImplementedError("torchvision.datasets.VisionDataset: the import-only stand-in builds no dataset")
