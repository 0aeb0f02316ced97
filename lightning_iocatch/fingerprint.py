"""Functions recorded by what they compute: a store's record of an edit's function (or a
token selection's) changes when what the function can compute does.

:func:`describe_function` gives ``{"function": name, "blake2b": digest}``, the digest over
everything the function's result can depend on, read without calling it:

- a Python function: its code (bytecode, constants, nested code, names; not its file or
  line numbers), its default arguments, the values its closure holds, and the values of
  the globals it reads (a function it calls is described the same way, recursively);
- ``functools.partial``: its function and arguments; a bound method: its function and
  the object it is bound to;
- a dataclass instance (a config) or a ``SimpleNamespace``: its class and fields;
- values: tensors and NumPy arrays by shape, dtype and bytes; numbers, strings and other
  plain values by their repr; containers by their items; an ``nn.Module`` by its class
  (and its code, for a class of your own), its weights and buffers, and its plain
  attributes (``training``, ``k``, ``eps``...); an imported module by its name;
- code of an installed library (site-packages, the standard library, builtins such as
  ``torch.relu``) by its qualified name and the library's version.

Not seen: a change reached through an attribute of an installed library's module, or
inside a module's own non-plain attributes. Where the description cannot be decided (a
callable object of a type of your own, a closure over an arbitrary object, a global
logger), the record is ``{"function": name, "undecidable": why}``: such a dump cannot be
resumed. Give the function (or object) a ``__fingerprint__`` string that changes when
what it computes does; it is recorded instead, as ``{"function": name, "fingerprint":
...}``. The record is the same in every process and run (no addresses, no line numbers).

Examples:
    >>> import torch
    >>> scale = torch.tensor(2.0)
    >>> one = describe_function(lambda h: h * scale)
    >>> one == describe_function(lambda h: h * scale), one == describe_function(lambda h: h * 3)
    (True, False)
    >>> class Opaque:
    ...     def __call__(self, h):
    ...         return h
    >>> describe_function(Opaque())["undecidable"]
    'a Opaque object (give it a `__fingerprint__` string)'
    >>> named = Opaque()
    >>> named.__fingerprint__ = "identity-v1"
    >>> describe_function(named)["fingerprint"]
    'identity-v1'
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import enum
import functools
import hashlib
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["describe_function", "describe_tensor", "undecidable_functions"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, range, slice)
_PLAIN_VALUES = (Ellipsis, NotImplemented)
_TORCH_PLAIN = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_BUILTIN = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
)
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def describe_function(fn: Callable[..., Any]) -> dict[str, Any]:
    """How a store records ``fn``: by name and a digest of what it computes, by its own
    ``__fingerprint__``, or as undecidable (see the module docstring)."""
    name = _name(fn)
    given = _given(fn)
    if given is not None:
        return {"function": name, "fingerprint": given}
    walk = _Walk()
    try:
        walk.value(fn)
    except _Undecidable as error:
        return {"function": name, "undecidable": str(error)}
    except RecursionError:
        return {"function": name, "undecidable": "too deeply nested to describe"}
    return {"function": name, "blake2b": walk.digest()}


def describe_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """How a store records a tensor: its shape, dtype and a digest of its bytes."""
    shape, dtype, raw = _tensor(tensor)
    return {
        "shape": shape,
        "dtype": dtype.removeprefix("torch."),
        "blake2b": hashlib.blake2b(raw, digest_size=16).hexdigest(),
    }


def undecidable_functions(record: Any) -> Iterator[str]:
    """Each function of a JSON ``record`` (a store's edits or token settings) whose
    description could not be decided, as ``"name (why)"``."""
    if isinstance(record, dict):
        if "undecidable" in record and "function" in record:
            yield f"{record['function']} ({record['undecidable']})"
        for value in record.values():
            yield from undecidable_functions(value)
    elif isinstance(record, list):
        for value in record:
            yield from undecidable_functions(value)


class _Undecidable(Exception):
    """A part of a function whose behaviour cannot be read from it."""


class _Walk:
    """One description: the parts fed to a digest in a fixed order; an object met twice
    is referred to by the place it was first met (cycles end, no address is recorded)."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self._seen: dict[int, int] = {}
        self._alive: list[Any] = []  # keeps every object seen alive, so no id is reused

    def digest(self) -> str:
        return self._hash.hexdigest()

    def put(self, *parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            self._hash.update(len(data).to_bytes(8, "little") + data)

    def value(self, value: Any) -> None:
        if isinstance(value, _PLAIN) or any(value is v for v in _PLAIN_VALUES):
            self.put(type(value).__name__, repr(value))
            return
        if isinstance(value, _TORCH_PLAIN):
            self.put("torch", repr(value))
            return
        if id(value) in self._seen:
            self.put("seen", self._seen[id(value)])
            return
        self._seen[id(value)] = len(self._seen)
        self._alive.append(value)
        given = _given(value)
        if given is not None:
            self.put("fingerprint", given)
        elif isinstance(value, enum.Enum):
            self.put("enum", _name(type(value)), value.name)
        elif isinstance(value, torch.Tensor):
            self.put("tensor", *_tensor(value))
        elif type(value).__module__ == "numpy":
            self._numpy(value)
        elif isinstance(value, (tuple, list)):
            self.put(type(value).__name__, len(value))
            for item in value:
                self.value(item)
        elif isinstance(value, dict):
            self.put("dict", len(value))
            for key, item in value.items():
                self.value(key)
                self.value(item)
        elif isinstance(value, (set, frozenset)):
            self.put("set", *sorted(_digest_of(item) for item in value))
        elif _config(value):
            self.put("object", _name(type(value)))  # a config: its fields
            fields = (
                [f.name for f in dataclasses.fields(value)]
                if not isinstance(value, types.SimpleNamespace)
                else sorted(vars(value))
            )
            for field in fields:
                self.put(field)
                self.value(getattr(value, field))
        elif isinstance(value, types.ModuleType):
            self.put("module", value.__name__, _version(value.__name__))
        elif isinstance(value, type):
            self._class(value)
        elif isinstance(value, torch.nn.Module):
            self._module(value)
        elif isinstance(value, functools.partial):
            self.put("partial")
            self.value(value.func)
            self.value(value.args)
            self.value(value.keywords)
        elif isinstance(value, types.MethodType):
            self.put("method")
            self.value(value.__func__)
            self.value(value.__self__)
        elif isinstance(value, types.FunctionType):
            self._function(value)
        elif isinstance(value, _BUILTIN):
            self._builtin(value)
        elif isinstance(value, types.CodeType):
            self._code(value)
        else:
            raise _Undecidable(
                f"a {type(value).__qualname__} object (give it a `__fingerprint__` string)"
            )

    def _numpy(self, value: Any) -> None:
        if getattr(value, "dtype", None) is None or value.dtype.hasobject:
            raise _Undecidable(f"a NumPy {type(value).__name__} of objects")
        self.put("numpy", value.dtype.str, value.shape, value.tobytes())

    def _class(self, cls: type) -> None:
        self.put("class", _name(cls), _version(cls.__module__))
        if _library(sys.modules.get(cls.__module__)):
            return
        for base in cls.__mro__:  # a class of your own: the code of its own methods
            if base.__module__ in ("builtins", "torch.nn.modules.module"):
                continue
            for attribute, member in sorted(vars(base).items()):
                function = getattr(member, "__func__", member)
                if isinstance(function, types.FunctionType):
                    self.put(attribute)
                    self._code(function.__code__)
                    self.value(function.__defaults__)

    def _module(self, module: torch.nn.Module) -> None:
        self._class(type(module))
        for name, tensor in module.state_dict(keep_vars=True).items():
            self.put(name, *_tensor(tensor))
        for name, sub in module.named_modules():
            plain = [(k, v) for k, v in vars(sub).items() if not k.startswith("_")]
            for attribute, value in sorted(plain, key=lambda item: item[0]):
                if isinstance(value, (*_PLAIN, tuple)) and _all_plain(value):
                    self.put(name, attribute, repr(value))

    def _function(self, fn: types.FunctionType) -> None:
        self.put("function", _name(fn))
        if _library_code(fn.__code__):
            self.put(_version(fn.__module__))
            return
        self._code(fn.__code__)
        self.value(fn.__defaults__)
        self.value(fn.__kwdefaults__)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled
                self.put("empty cell")
                continue
            self.value(contents)
        namespace = fn.__globals__
        for name in sorted(_globals_read(fn.__code__)):
            if name in namespace:
                self.put("global", name)
                found = namespace[name]
                self.value(found)
                if isinstance(found, types.ModuleType) and not _library(found):
                    self._attributes_read(found, fn.__code__)
            elif hasattr(builtins, name):
                self.put("builtin", name)
            else:
                self.put("missing global", name)

    def _attributes_read(self, module: types.ModuleType, code: types.CodeType) -> None:
        """A module of your own: the values of the names the code reads that it holds."""
        for name in sorted(_names_read(code)):
            if name in vars(module):
                self.put("attribute", name)
                self.value(vars(module)[name])

    def _builtin(self, fn: Any) -> None:
        self.put("builtin", _name(fn), _version(getattr(fn, "__module__", None) or ""))
        bound = getattr(fn, "__self__", None)
        if bound is not None and not isinstance(bound, (types.ModuleType, type)):
            self.value(bound)

    def _code(self, code: types.CodeType) -> None:
        self.put(
            "code",
            code.co_name,
            code.co_code,
            getattr(code, "co_exceptiontable", b""),
            code.co_argcount,
            code.co_posonlyargcount,
            code.co_kwonlyargcount,
            code.co_flags,
            code.co_names,
            code.co_varnames,
            code.co_freevars,
            code.co_cellvars,
        )
        self.put("constants", len(code.co_consts))
        for constant in code.co_consts:
            self.value(constant)


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


def _digest_of(value: Any) -> str:
    walk = _Walk()
    walk.value(value)
    return walk.digest()


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
