"""`import deepspeed` is deepspeed_c: this module replaces itself with the deepspeed_c package and
maps every `deepspeed.X` submodule to `deepspeed_c.X` (the same module objects, so classes such as
DeepSpeedEngine are identical under both names)."""
import importlib
import importlib.abc
import importlib.machinery
import sys

_ALIAS, _TARGET = "deepspeed", "deepspeed_c"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):  # the real module, registered under the alias name too
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass  # already executed under its real name


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real = _TARGET + fullname[len(_ALIAS):]
        try:
            real_spec = importlib.util.find_spec(real)
        except (ImportError, ValueError):
            return None
        if real_spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real),
                                              is_package=real_spec.submodule_search_locations is not None)


import importlib.util  # noqa: E402

if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
sys.modules[_ALIAS] = importlib.import_module(_TARGET)
