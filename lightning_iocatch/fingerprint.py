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
- a class of your own (a module's, a config's, one a function reads): its bases and what
  its own dict holds: methods, static and class methods, properties and cached
  properties described as functions are (so the helpers they call, the globals they
  read), and its data (``k = 2.0``) by value; a library's class by name and version;
- values: tensors and NumPy arrays by shape, dtype and bytes; numbers, strings and other
  plain values by their repr; containers by their items; an ``nn.Module`` by its class,
  its weights and every buffer (non-persistent ones too, as a rotary ``inv_freq``), and
  its tensor and plain attributes (``training``, ``k``, ``eps``...); an imported module
  by its name;
- code of an installed library (site-packages, the standard library, builtins such as
  ``torch.relu``) by its qualified name and the library's version; a function of yours
  it wraps (``@torch.no_grad()``, ``functools.wraps``) as a function of yours.

Not seen: a change reached through an attribute of an installed library's module, inside
a module's attributes other than tensors and plain values, or in a class's data that
cannot be read (ABC's ``_abc_impl``, a lock: by its type). Where the description cannot
be decided (a callable object of a type of your own, a closure over an arbitrary object,
a global logger, read by the function or by a method of a class it reads), the record is
``{"function": name, "undecidable": why}``: such a dump cannot be resumed. Give the
function (or object) a ``__fingerprint__`` string that changes when what it computes
does; it is recorded instead, as ``{"function": name, "fingerprint": ...}``. The record
is the same in every process and run (no addresses, no line numbers).

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
import enum
import functools
import hashlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_iocatch.fingerprint_values import (
    _BUILTIN,
    _PLAIN,
    _PLAIN_VALUES,
    _SENTINELS,
    _TORCH_PLAIN,
    _all_plain,
    _config,
    _given,
    _globals_read,
    _library,
    _library_class,
    _library_code,
    _name,
    _names_read,
    _tensor,
    _Undecidable,
    _version,
)

__all__ = ["describe_function", "describe_tensor", "undecidable_functions"]


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
        if any(value is v for v in _SENTINELS):
            self.put("sentinel", type(value).__qualname__)
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
            self.put("object")  # a config: its class (its code, if your own) and fields
            self.value(type(value))
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
        if _library_class(cls):
            return
        for base in cls.__mro__[1:]:  # a class of your own: its bases, then its own dict
            self.value(base)
        for attribute, member in sorted(vars(cls).items()):
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                self.put(attribute, "property")
                for accessor in (member.fget, member.fset, member.fdel):
                    self.value(accessor)
            elif isinstance(member, functools.cached_property):
                self.put(attribute, "cached property")
                self.value(member.func)
            elif isinstance(member, (types.FunctionType, type, functools.partial, *_BUILTIN)):
                self.put(attribute)
                self.value(member)  # a method: as any function (its globals, closure...)
            elif not (attribute.startswith("__") and attribute.endswith("__")):
                self._data(attribute, member)  # not Python's (`__doc__`, `__module__`...)

    def _data(self, attribute: str, value: Any) -> None:
        """A class's data: by its value, or by its type where that cannot be decided (a
        class's machinery, such as ABC's `_abc_impl`)."""
        hashed, alive = self._hash.copy(), len(self._alive)
        try:
            self.put(attribute)
            self.value(value)
        except _Undecidable:  # forget what was fed and met since
            self._hash = hashed
            for gone in self._alive[alive:]:
                del self._seen[id(gone)]
            del self._alive[alive:]
            self.put(attribute, "opaque", type(value).__qualname__)

    def _module(self, module: torch.nn.Module) -> None:
        self.value(type(module))
        for prefix, sub in module.named_modules(remove_duplicate=False):
            place = f"{prefix}." if prefix else ""  # as state_dict, with every buffer
            for name, tensor in (*sub._parameters.items(), *sub._buffers.items()):
                if tensor is not None:
                    self.put(place + name, *_tensor(tensor))
            if type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
                self.put(place + "_extra_state")
                self.value(sub.get_extra_state())
        for name, sub in module.named_modules():
            for attribute, value in sorted(vars(sub).items(), key=lambda item: item[0]):
                if isinstance(value, torch.Tensor) and not attribute.startswith("__"):
                    self.put(name, attribute, *_tensor(value))  # not a weight or buffer
                elif attribute.startswith("_"):
                    continue
                elif isinstance(value, (*_PLAIN, tuple)) and _all_plain(value):
                    self.put(name, attribute, repr(value))

    def _function(self, fn: types.FunctionType) -> None:
        self.put("function", _name(fn))
        if _library_code(fn.__code__):
            self.put(_version(fn.__module__))
            wrapped = vars(fn).get("__wrapped__")  # a library's decorator on yours
            if wrapped is not None:
                self.value(wrapped)
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


def _digest_of(value: Any) -> str:
    walk = _Walk()
    walk.value(value)
    return walk.digest()
