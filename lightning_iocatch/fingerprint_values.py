"""The parts :mod:`lightning_iocatch.fingerprint` reads values with: what is plain, what
is an installed library's (its code and classes are recorded by name and version), names,
tensors' bytes, and the globals a code object reads."""

from __future__ import annotations

import dataclasses
import dis
import functools
import site
import sys
import sysconfig
import types
from typing import Any

import torch

_PLAIN = (type(None), bool, int, float, complex, str, bytes, range, slice)
_PLAIN_VALUES = (Ellipsis, NotImplemented)
_SENTINELS = (dataclasses.MISSING, getattr(dataclasses, "_HAS_DEFAULT_FACTORY", None))  # in
# the closures of a dataclass's generated methods: by their type (their repr has an address)
_TORCH_PLAIN = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_BUILTIN = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
)
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time, not in C


class _Undecidable(Exception):
    """A part of a function whose behaviour cannot be read from it."""


def _given(value: Any) -> str | None:
    """A ``__fingerprint__`` of the user's (a str), if ``value`` has one."""
    try:
        given = getattr(value, "__fingerprint__", None)
    except Exception:  # an object whose attributes raise: it has none
        return None
    if isinstance(value, type) and not isinstance(given, str):
        return None  # a class whose instances have one (a property, say)
    if given is not None and not isinstance(given, str):
        raise TypeError(
            f"`__fingerprint__` of {_name(value)} must be a str that changes when what it "
            f"computes does, got {type(given).__name__}"
        )
    return given


def _name(value: Any) -> str:
    """A readable qualified name: the function's, a partial's function's, a type's."""
    if isinstance(value, functools.partial):
        return f"functools.partial({_name(value.func)})"
    named = value if hasattr(value, "__qualname__") else type(value)
    module = getattr(named, "__module__", None) or type(named).__module__
    return f"{module}.{getattr(named, '__qualname__', type(named).__qualname__)}"


def _tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    data = tensor.detach()
    if data.layout != torch.strided:
        data = data.to_dense()
    if data.device.type == "meta":
        raise _Undecidable("a tensor on the meta device (it holds no values)")
    data = data.cpu().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return list(data.shape), str(data.dtype), raw


def _config(value: Any) -> bool:
    """A dataclass instance (not the class) or a ``SimpleNamespace``."""
    dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
    return dataclass or isinstance(value, types.SimpleNamespace)


def _all_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_all_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def _globals_read(code: types.CodeType) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _LOADS_GLOBAL}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _globals_read(constant)
    return names


def _names_read(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_read(constant)
    return names


def _version(module: str) -> str:
    top = sys.modules.get(module.split(".")[0])
    version = getattr(top, "__version__", "")
    return version if isinstance(version, str) else str(version)


@functools.lru_cache(maxsize=1)
def _library_places() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    places = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    places.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    places.add(site.getusersitepackages())
    return tuple(sorted(place.rstrip("/") + "/" for place in places if place))


def _library_code(code: types.CodeType) -> bool:
    """Code of an installed library (or frozen into the interpreter), not of your own."""
    filename = code.co_filename
    return filename.startswith("<frozen") or filename.startswith(_library_places())


def _library(module: types.ModuleType | None) -> bool:
    filename = getattr(module, "__file__", None)
    if module is not None and module.__name__ == "__main__":
        return False  # a script's, or a notebook's
    if module is None or not isinstance(filename, str):
        return True  # built into the interpreter
    return filename.startswith(_library_places())


def _library_class(cls: type) -> bool:
    """A class of an installed library or built in, not one of your own: defined in C,
    or found under its name in a library's module (a class made by ``exec`` in a cell
    or a script says ``builtins``, one made in a function is found nowhere)."""
    if not cls.__flags__ & _HEAP_TYPE:
        return True
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    if module is None or not _library(module):
        return False
    found: Any = module
    for part in cls.__qualname__.split("."):
        try:
            found = getattr(found, part)
        except Exception:  # not there, or a lazy module that cannot give it
            return False
    return found is cls
