"""The capture spec grammar: parse ``"inputs[a|b]|outputs[c]"`` and resolve names and globs.

Grammar (whitespace is allowed around every token)::

    spec    := section ( ["|"] section )*
    section := ("inputs" | "outputs" | "grad_inputs" | "grad_outputs") "[" item ( "|" item )* "]"

``grad_outputs[m]`` and ``grad_inputs[m]`` ask for the gradient of a loss with respect to
``m``'s outputs or inputs, captured when a backward reaches them (see
:mod:`~lightning_iocatch.capture.gradients`). Each section may appear at most once, in any
order, and may be empty (``inputs[]``).
Items are stripped and empty items are dropped. An item is a dotted module name as
listed by ``model.named_modules()``, possibly with globs: ``*`` matches within one
dotted component (``layers.*``, ``h.1*``), ``**`` matches any number of components,
none included (``encoder.**.mlp``). Names are written without the components that
wrappers insert (:data:`WRAPPER_COMPONENTS`: ``torch.compile``, FSDP, activation
checkpointing); a name that keeps them is accepted too.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from lightning_iocatch.errors import SpecError, UnknownModuleError
from lightning_iocatch.suggest import NUMBER, close_names, numbers

__all__ = [
    "WRAPPER_COMPONENTS",
    "CaptureSpec",
    "canonical_name",
    "format_io_spec",
    "parse_io_spec",
    "parse_sections",
    "resolve_names",
    "unknown_name_message",
]

SECTIONS = ("inputs", "outputs", "grad_inputs", "grad_outputs")
LIST_NAMES_HINT = (
    "list valid names with `lightning-iocatch modules` or `[n for n, _ in model.named_modules()]`"
)
_EXPECTED = "'inputs[...]', 'outputs[...]', 'grad_inputs[...]' or 'grad_outputs[...]'"
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""Name components that wrappers insert between a module and its parent, dropped from names.

``_orig_mod``: ``torch.compile`` (``OptimizedModule``); ``_fsdp_wrapped_module``:
``FullyShardedDataParallel`` (Lightning's ``FSDPStrategy``); ``_checkpoint_wrapped_module``:
``checkpoint_wrapper`` and ``offload_wrapper`` (FSDP's activation checkpointing).
"""


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture: module names (or globs) whose inputs and outputs are wanted.

    Examples:
        >>> CaptureSpec.parse("inputs[model.h.0]|outputs[model.h.*]")
        CaptureSpec(inputs=('model.h.0',), outputs=('model.h.*',), grad_inputs=(), grad_outputs=())
        >>> CaptureSpec(outputs=("a", "b"), grad_outputs=("a",)).to_string()
        'outputs[a|b]|grad_outputs[a]'
    """

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    grad_inputs: tuple[str, ...] = ()
    grad_outputs: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> CaptureSpec:
        """Parse a spec string; raises :class:`SpecError` if it is malformed."""
        sections = parse_sections(spec)
        return cls(*(tuple(sections[kind]) for kind in SECTIONS))

    @property
    def is_empty(self) -> bool:
        """True when the spec selects no module at all."""
        return not (self.inputs or self.outputs or self.grad_inputs or self.grad_outputs)

    @property
    def has_gradients(self) -> bool:
        """True when the spec asks for a gradient (``grad_inputs`` or ``grad_outputs``)."""
        return bool(self.grad_inputs or self.grad_outputs)

    def to_string(self) -> str:
        """The canonical spec string; ``CaptureSpec.parse(s.to_string()) == s``."""
        return format_io_spec(self.inputs, self.outputs, self.grad_inputs, self.grad_outputs)


def _error(spec: str, pos: int, problem: str) -> SpecError:
    pointer = " " * pos + "^"
    return SpecError(f"invalid capture spec {spec!r}: {problem}\n  {spec}\n  {pointer}")


def _skip_space(spec: str, pos: int) -> int:
    while pos < len(spec) and spec[pos].isspace():
        pos += 1
    return pos


def _section_word_problem(word: str) -> str:
    if word.lower() in SECTIONS:
        return f"section words are lower case: write {word.lower()!r}, not {word!r}"
    close = difflib.get_close_matches(word.lower(), SECTIONS, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown section {word!r}, expected {_EXPECTED}{hint}"


def parse_io_spec(spec: str) -> tuple[list[str], list[str]]:
    """Parse a capture spec into ``(inputs, outputs)`` lists of module names or globs.

    A spec with gradient sections is refused here (it has more than two lists): use
    :meth:`CaptureSpec.parse` or :func:`parse_sections`. Every section is optional; ``|``
    separates items inside brackets and, optionally, the sections. Whitespace and empty items are dropped. Anything else, such as a
    misspelled or mis-cased section word, a section given twice, unbalanced or nested
    brackets, stray text or an empty spec, raises :class:`SpecError` with a pointer to
    the offending position.

    Examples:
        >>> parse_io_spec("inputs[model.layers.0]|outputs[model.layers.0|model.layers.5]")
        (['model.layers.0'], ['model.layers.0', 'model.layers.5'])
        >>> parse_io_spec("outputs[ encoder.**.mlp | ]")
        ([], ['encoder.**.mlp'])
        >>> parse_io_spec("output[a]")
        Traceback (most recent call last):
        ...
        lightning_iocatch.errors.SpecError: invalid capture spec 'output[a]': unknown section 'output', expected 'inputs[...]', 'outputs[...]', 'grad_inputs[...]' or 'grad_outputs[...]'; did you mean 'outputs'?
          output[a]
          ^
    """  # noqa: E501
    sections = parse_sections(spec)
    if sections["grad_inputs"] or sections["grad_outputs"]:
        raise SpecError(
            f"capture spec {spec!r} asks for gradients, which `parse_io_spec` (inputs and "
            "outputs) cannot return: use CaptureSpec.parse(spec) or parse_sections(spec)"
        )
    return sections["inputs"], sections["outputs"]


def parse_sections(spec: str) -> dict[str, list[str]]:
    """Parse a capture spec into its four sections' lists of module names or globs.

    Examples:
        >>> parse_sections("outputs[h.0]|grad_outputs[h.0|h.1]")
        {'inputs': [], 'outputs': ['h.0'], 'grad_inputs': [], 'grad_outputs': ['h.0', 'h.1']}
    """
    if not isinstance(spec, str):
        raise SpecError(f"a capture spec must be a string, got {type(spec).__name__}: {spec!r}")
    sections: dict[str, list[str]] = {}
    pos = _skip_space(spec, 0)
    if pos == len(spec):
        raise _error(spec, 0, "the spec is empty; write e.g. 'outputs[model.layers.0]'")
    while pos < len(spec):
        if sections and spec[pos] == "|":
            pos = _skip_space(spec, pos + 1)
            if pos == len(spec):
                raise _error(spec, pos - 1, "expected a section after '|'")
        word = _WORD.match(spec, pos)
        if word is None:
            problem = (
                f"unbalanced {spec[pos]!r}"
                if spec[pos] in "[]"
                else f"unexpected text {spec[pos:]!r}"
            )
            raise _error(spec, pos, f"{problem}, expected {_EXPECTED}")
        name = word.group()
        if name not in SECTIONS:
            raise _error(spec, pos, _section_word_problem(name))
        if name in sections:
            raise _error(
                spec, pos, f"section {name!r} given twice; list all its names in one: {name}[a|b]"
            )
        open_at = word.end()
        if open_at == len(spec) or spec[open_at] != "[":
            raise _error(spec, open_at, f"expected '[' right after {name!r}")
        close_at = _find_closing(spec, open_at)
        body = spec[open_at + 1 : close_at]
        sections[name] = [item.strip() for item in body.split("|") if item.strip()]
        pos = _skip_space(spec, close_at + 1)
    return {kind: sections.get(kind, []) for kind in SECTIONS}


def _find_closing(spec: str, open_at: int) -> int:
    for pos in range(open_at + 1, len(spec)):
        if spec[pos] == "]":
            return pos
        if spec[pos] == "[":
            raise _error(spec, pos, "nested '[' inside a section; module names contain no brackets")
    raise _error(spec, open_at, "unbalanced '[': the section is never closed with ']'")


def format_io_spec(
    inputs: Iterable[str] = (),
    outputs: Iterable[str] = (),
    grad_inputs: Iterable[str] = (),
    grad_outputs: Iterable[str] = (),
) -> str:
    """Write names back as a spec string (the inverse of :func:`parse_sections`).

    Examples:
        >>> format_io_spec(["a"], ["b", "c"])
        'inputs[a]|outputs[b|c]'
        >>> format_io_spec(outputs=["a"], grad_outputs=["a"])
        'outputs[a]|grad_outputs[a]'
    """
    lists = (list(inputs), list(outputs), list(grad_inputs), list(grad_outputs))
    sections = zip(SECTIONS, lists, strict=True)
    return "|".join(f"{kind}[{'|'.join(names)}]" for kind, names in sections if names)


def _glob_matches(pattern: Sequence[str], name: Sequence[str]) -> bool:
    """Whether dotted ``name`` matches ``pattern`` (``*`` in a component, ``**`` for any
    number of components), in ``len(pattern) * len(name)`` steps whatever the ``**``s.
    """
    reachable = [True] + [False] * len(name)  # name[:i] matched by the pattern so far
    for head in pattern:
        if head == "**":  # from the first reachable position on, everything is reachable
            first = reachable.index(True) if True in reachable else len(reachable)
            reachable = [i >= first for i in range(len(reachable))]
        else:
            reachable = [False] + [
                reachable[i] and fnmatchcase(name[i], head) for i in range(len(name))
            ]
        if not any(reachable):
            return False
    return reachable[-1]


def _is_glob(item: str) -> bool:
    return "*" in item


def canonical_name(name: str) -> str:
    """Drop the wrapper components (:data:`WRAPPER_COMPONENTS`) from a module name.

    ``torch.compile`` inserts ``_orig_mod``, FSDP ``_fsdp_wrapped_module`` and activation
    checkpointing ``_checkpoint_wrapped_module``; the plain name the user wrote for the
    layer is what is left.

    Examples:
        >>> canonical_name("model._orig_mod.layers.0")
        'model.layers.0'
        >>> canonical_name("_fsdp_wrapped_module.layers.3._checkpoint_wrapped_module.mlp")
        'layers.3.mlp'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def _split(name: str) -> list[str]:
    return name.split(".") if name else []


def resolve_names(items: Iterable[str], available: Sequence[str]) -> list[str]:
    """Expand names and globs against ``available`` module names, keeping order, no repeats.

    ``available`` holds canonical names (see :func:`canonical_name`); items are made
    canonical first, so a name written with the wrapper components that ``torch.compile``,
    FSDP or activation checkpointing insert resolves like the plain one. An exact name
    must be in ``available``; a glob must match at least one name. Otherwise
    :class:`UnknownModuleError` says what is close and how to list valid names.

    Examples:
        >>> names = ["", "h", "h.0", "h.0.mlp", "h.1", "h.1.mlp", "ln_f"]
        >>> resolve_names(["h.*"], names)
        ['h.0', 'h.1']
        >>> resolve_names(["**.mlp", "ln_f"], names)
        ['h.0.mlp', 'h.1.mlp', 'ln_f']
    """
    known = set(available)
    resolved: dict[str, None] = {}
    for item in map(canonical_name, items):
        if _is_glob(item):
            pattern = _split(item)
            matches = [n for n in available if _glob_matches(pattern, _split(n))]
            if not matches:
                raise UnknownModuleError(f"glob {item!r} matches no module. {LIST_NAMES_HINT}")
            resolved.update(dict.fromkeys(matches))
        elif item in known:
            resolved[item] = None
        else:
            raise UnknownModuleError(unknown_name_message(item, available))
    return list(resolved)


def unknown_name_message(name: str, available: Sequence[str]) -> str:
    """Say that ``name`` is unknown, which names are close, and how to list them all.

    A suggestion keeps every number of the request (``layers.12`` is never "close" to
    ``layers.1``: it is another layer); only the words may differ. When no name with the
    same numbers is close, the message says which indices the container has instead.

    Examples:
        >>> names = ["model", "model.layers", "model.layers.0", "model.layers.1"]
        >>> unknown_name_message("model.layer.1", names).split(" list")[0]
        "unknown module name 'model.layer.1'; did you mean 'model.layers.1'?"
        >>> unknown_name_message("model.layers.12", names).split(" list")[0]
        "unknown module name 'model.layers.12'; 'model.layers' has 0..1, not 12."
    """
    request = canonical_name(name)
    names = [n for n in available if n]
    close = close_names(request, names)
    if close:
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?"
    else:
        hint = _index_hint(request, names)
    return f"unknown module name {name!r}{hint} {LIST_NAMES_HINT}"


def _index_hint(request: str, names: Sequence[str]) -> str:
    """``"; 'model.layers' has 0..11, not 12."`` for the first index of ``request`` out of range.

    A misspelled container (``model.layer.12``) is matched to the closest one that has
    numbered children and the same numbers in its own name.
    """
    children: dict[str, set[int]] = {}
    for full in names:
        parent, _, last = full.rpartition(".")
        if last.isdigit():
            children.setdefault(parent, set()).add(int(last))
    parts = _split(request)
    position = 0
    while position < len(parts):
        part = parts[position]
        if NUMBER.fullmatch(part):
            parent = ".".join(parts[:position])
            if parent not in children:
                alike = [c for c in children if c and numbers(c) == numbers(parent)]
                fixes = difflib.get_close_matches(parent, alike, n=1, cutoff=0.6)
                if not fixes:
                    return ""
                parent = fixes[0]
            if int(part) not in children[parent]:
                where = repr(parent) if parent else "the model"
                return f"; {where} has {_ranges(sorted(children[parent]))}, not {part}."
            parts[:position] = _split(parent)
            position = len(_split(parent))
        position += 1
    return ""


def _ranges(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2, 5, 7..8"``."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
