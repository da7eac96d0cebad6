"""Versions. Policy (README, "Version policy"): deepspeed_c follows the newest DeepSpeed release
named here (its defaults and config keys), keeping what the 0.19.2 documents describe that later
releases dropped. `__version__` says both: the DeepSpeed release matched, then deepspeed_c's own
release after `+dsc.` (Hugging Face and accelerate gate on DeepSpeed versions)."""
DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose public API and defaults this package mirrors
DSC_RELEASE = "0.1.0"  # deepspeed_c's own release
__version__ = f"{DEEPSPEED_API_VERSION}+dsc.{DSC_RELEASE}"
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_API_VERSION.split("."))
# DeepSpeed's names for the source revision; "[none]" outside a release build, as in DeepSpeed's checkouts
__git_hash__ = "[none]"
__git_branch__ = "[none]"
