"""Shared machinery of the typed config: the pydantic base class, "auto" handling, and error
messages that name the key path, the value and what is allowed (public path as DeepSpeed's
`deepspeed.runtime.config_utils`)."""
from __future__ import annotations

import difflib
import types
import typing
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from deepspeed_c.utils.logging import logger

if TYPE_CHECKING:
    import torch

AUTO = "auto"
M = TypeVar("M", bound=BaseModel)


class DeepSpeedConfigError(ValueError):
    """An invalid config: wrong type, bad value, unknown key, inconsistent settings."""


class DeepSpeedConfigWarning(UserWarning):
    """Something in the config was ignored or reinterpreted (unknown top-level key, "auto")."""


def config_warning(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, DeepSpeedConfigWarning, stacklevel=3)


def unbuilt(path: str, what: str) -> NotImplementedError:
    """The error for a capability deepspeed_c has not built yet: raised, never warned past."""
    return NotImplementedError(
        f"deepspeed_c: config key '{path}' asks for {what}, which deepspeed_c does not implement yet. "
        f"Remove '{path}' (or disable it) to run without it.")


class DeepSpeedConfigModel(BaseModel):
    """Base of every typed section: unknown keys are errors, assignments are validated, and a
    field may be given by its DeepSpeed alias or its name."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True,
                              populate_by_name=True, use_enum_values=True, arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        # DeepSpeed's base drops top-level "auto" values (left by Hugging Face for keys it did not fill)
        # unless strict; replace_method is the one field whose own value may be "auto"
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO) or k == "replace_method"}
        super().__init__(**data)
        self._migrate_deprecated_fields()

    def _migrate_deprecated_fields(self) -> None:
        """DeepSpeed's deprecated-field convention, for config classes written against its base:
        `Field(..., json_schema_extra={"deprecated": True, "new_param": "a.b", "new_param_fn": f,
        "set_new_param": True, "deprecated_msg": "..."})`. A deprecated field that was given is warned
        about and its (converted) value moves to new_param; giving both is an AssertionError."""
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if not isinstance(extra, dict) or not extra.get("deprecated", False) or name not in self.model_fields_set:
                continue
            new_param = str(extra.get("new_param", "") or "")
            msg = str(extra.get("deprecated_msg", "") or "")
            logger.warning(f"Config parameter {name} is deprecated" + (f" use {new_param} instead" if new_param else "")
                           + (f". {msg}" if msg else ""))
            if not new_param or not extra.get("set_new_param", True):
                continue
            convert = extra.get("new_param_fn", lambda x: x)
            owner: Any = self
            *parents, leaf = new_param.split(".")
            for part in parents:
                owner = getattr(owner, part)
            assert leaf not in owner.model_fields_set, (
                f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_param}' together")
            setattr(owner, leaf, convert(getattr(self, name)))


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def closest(key: str, valid: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(str(key), sorted(set(valid)), n=1, cutoff=0.5)
    return found[0] if found else None


def unknown_key_error(path: str, key: str, valid: Iterable[str]) -> DeepSpeedConfigError:
    valid = sorted(set(valid))
    near = closest(key, valid)
    hint = f" Did you mean '{near}'?" if near else ""
    return DeepSpeedConfigError(
        f"Unknown config key '{join(path, key)}'.{hint} Valid keys in '{path or '<top level>'}': {', '.join(valid)}")


def strip_auto(data: Any, path: str) -> Any:
    """Drops every "auto" value (Hugging Face leaves them for keys it did not fill): the key then
    takes its default, and a warning names it."""
    if isinstance(data, Mapping):
        out = {}
        for k, v in data.items():
            if isinstance(v, str) and v == AUTO:
                config_warning(f"DeepSpeed config key '{join(path, k)}' is \"auto\"; treating it as unset "
                               f"(its default applies)")
                continue
            out[k] = strip_auto(v, join(path, k))
        return out
    return data


def model_keys(cls: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for name, field in cls.model_fields.items():
        keys.append(name)
        if field.alias:
            keys.append(field.alias)
    return keys


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _field_named(cls: type[BaseModel], key: str) -> Any:
    for name, field in cls.model_fields.items():
        if key == name or key == field.alias:
            return field
    return None


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for key in loc:
        field = _field_named(cls, str(key))
        sub = _model_in(field.annotation) if field is not None else None
        if sub is None:
            return None
        cls = sub
    return cls


def _describe(cls: type[BaseModel], path: str, err: Mapping[str, Any]) -> str:
    loc = tuple(str(p) for p in err.get("loc", ()))
    where = path
    for p in loc:
        where = join(where, p)
    if err.get("type") == "extra_forbidden" and loc:
        owner = _model_at(cls, loc[:-1])
        if owner is not None:
            owner_path = path
            for p in loc[:-1]:
                owner_path = join(owner_path, p)
            return str(unknown_key_error(owner_path, loc[-1], model_keys(owner)))
    value = err.get("input")
    msg = err.get("msg", "invalid value")
    return f"Invalid value {value!r} for config key '{where}': {msg}"


def parse_section(cls: type[M], raw: Any, path: str) -> M:
    """Validates one section: a JSON object whose keys are cls's fields (or aliases)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise DeepSpeedConfigError(
            f"Config key '{path}' must be a JSON object (dict), got {type(raw).__name__} {raw!r}")
    data = strip_auto(raw, path)
    valid = model_keys(cls)
    for key in data:
        if key not in valid:
            raise unknown_key_error(path, str(key), valid)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        raise DeepSpeedConfigError("; ".join(_describe(cls, path, err) for err in errors)) from None


def scalar(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, *,
           path: str = "", allow_none: bool = False, check: Any = None, allowed: str = "") -> Any:
    """A validated top-level scalar: type checked (bool is not an int here), then check(value)."""
    if key not in data:
        return default
    value = data[key]
    where = join(path, key)
    if value is None and allow_none:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if ok and check is not None and not check(value):
        ok = False
    if not ok:
        want = allowed or " or ".join(k.__name__ for k in kinds)
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{where}': expected {want}")
    return value


def _dtype_names() -> dict[str, torch.dtype]:
    import torch  # here, not at module level: the launcher's autotuner parses configs without loading torch

    return {
        "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
        "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
        "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
        "int8": torch.int8, "torch.int8": torch.int8,
    }


def parse_dtype(value: Any, path: str, allowed: Iterable[torch.dtype] | None = None) -> torch.dtype | None:
    """DeepSpeed's dtype spellings ("fp16", "bfloat16", "torch.float32", ...) or a torch.dtype."""
    import torch

    if value is None:
        return None
    names_map = _dtype_names()
    dtype = value if isinstance(value, torch.dtype) else names_map.get(str(value).lower())
    allowed = list(allowed) if allowed is not None else [torch.float16, torch.bfloat16, torch.float32]
    if dtype is None or dtype not in allowed:
        names = sorted(k for k, v in names_map.items() if v in allowed and not k.startswith("torch."))
        raise DeepSpeedConfigError(
            f"Invalid value {value!r} for config key '{path}': expected one of {', '.join(names)}")
    return dtype


def get_scalar_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """DeepSpeed's helper, kept for code that imports it."""
    return param_dict.get(param_name, param_default_value)
