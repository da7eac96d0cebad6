__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
# The DeepSpeed release whose public API this package mirrors (Hugging Face gates on versions).
DEEPSPEED_API_VERSION = "0.19.2"
