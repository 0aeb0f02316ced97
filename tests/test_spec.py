"""spec.py: the capture spec grammar, against the reference parser and by property."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_iocatch import CaptureSpec, SpecError, format_io_spec, parse_io_spec
from lightning_iocatch.errors import UnknownModuleError
from lightning_iocatch.spec import canonical_name, resolve_names

_REFERENCE_RE = re.compile(r"(inputs|outputs)\[([^\]]*)\]")


def reference_parse(spec: str) -> tuple[list[str], list[str]]:
    """The seed's parser, verbatim in behaviour: the oracle for well-formed specs."""
    sections: dict[str, list[str]] = {"inputs": [], "outputs": []}
    for kind, body in _REFERENCE_RE.findall(spec):
        sections[kind] = [s.strip() for s in body.split("|") if s.strip()]
    return sections["inputs"], sections["outputs"]


@pytest.mark.parametrize(
    "spec",
    [
        "inputs[model.layers.0]|outputs[model.layers.0]",
        "inputs[]|outputs[model.layers.0|model.layers.5]",
        "outputs[model.layers.0]",
        "inputs[a]",
        "outputs[a]|inputs[b]",
        "  outputs[ a |  | b ]  ",
        "inputs[]",
        "outputs[a] | inputs[b]",
        "inputs[a]outputs[b]",
        "outputs[encoder.**.mlp|h.*]",
    ],
)
def test_well_formed_specs_parse_like_the_reference(spec: str) -> None:
    assert parse_io_spec(spec) == reference_parse(spec)


@pytest.mark.parametrize(
    ("spec", "message", "column"),
    [
        ("inputs[a]|output[b]", "unknown section 'output'.*did you mean 'outputs'", 10),
        ("Outputs[a]", "lower case: write 'outputs'", 0),
        ("outputs[a]]", "unbalanced ']'", 10),
        ("outputs[[a]]", "nested '\\['", 8),
        ("outputs[a]|outputs[b]", "section 'outputs' given twice", 11),
        ("xinputs[a]", "unknown section 'xinputs'", 0),
        ("outputs[a] garbage", "unknown section 'garbage'", 11),
        ("outputs[a", "never closed", 7),
        ("", "the spec is empty", 0),
        ("   ", "the spec is empty", 0),
        ("outputs [a]", "expected '\\[' right after 'outputs'", 7),
        ("outputs[a]|", "expected a section after '\\|'", 10),
        ("|outputs[a]", "unexpected text", 0),
        ("a.b.c", "unknown section 'a'", 0),
    ],
)
def test_malformed_specs_raise_spec_error_pointing_at_the_problem(
    spec: str, message: str, column: int
) -> None:
    with pytest.raises(SpecError, match=message) as info:
        parse_io_spec(spec)
    text = str(info.value)
    assert repr(spec) in text
    assert text.splitlines()[-1] == "  " + " " * column + "^"


def test_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_io_spec("outputs[")


def test_non_string_spec_is_refused() -> None:
    with pytest.raises(SpecError, match="must be a string"):
        parse_io_spec(["outputs[a]"])  # type: ignore[arg-type]


_component = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}|[0-9]{1,2}|\*|\*\*", fullmatch=True)
_name = st.lists(_component, min_size=1, max_size=4).map(".".join)
_names = st.lists(_name, max_size=4)
_space = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def well_formed_specs(draw: st.DrawFn) -> str:
    kinds = draw(
        st.sampled_from([["inputs"], ["outputs"], ["inputs", "outputs"], ["outputs", "inputs"]])
    )
    parts = []
    for kind in kinds:
        items = [draw(_space) + name + draw(_space) for name in draw(_names)]
        if draw(st.booleans()):
            items.insert(draw(st.integers(0, len(items))), draw(_space))  # an empty item
        parts.append(f"{draw(_space)}{kind}[{'|'.join(items)}]{draw(_space)}")
    separator = draw(st.sampled_from(["|", " | ", "", " "]))
    return separator.join(parts)


@given(well_formed_specs())
def test_every_well_formed_spec_parses_exactly_like_the_reference(spec: str) -> None:
    assert parse_io_spec(spec) == reference_parse(spec)


@given(_names, _names)
def test_format_then_parse_round_trips(inputs: list[str], outputs: list[str]) -> None:
    if not inputs and not outputs:
        return
    assert parse_io_spec(format_io_spec(inputs, outputs)) == (inputs, outputs)
    spec = CaptureSpec(tuple(inputs), tuple(outputs))
    assert CaptureSpec.parse(spec.to_string()) == spec


@given(st.text(alphabet="inputsoa[]|. *\t_0123", max_size=40) | st.text(max_size=30))
def test_parsing_never_raises_anything_but_spec_error(spec: str) -> None:
    try:
        inputs, outputs = parse_io_spec(spec)
    except SpecError:
        return
    assert all(isinstance(name, str) and name for name in [*inputs, *outputs])


NAMES = ["", "encoder", "encoder.0", "encoder.0.mlp", "encoder.0.mlp.fc", "encoder.1"]
NAMES += ["encoder.1.mlp", "encoder.1.mlp.fc", "head", "h.10", "h.11", "h.2"]


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["encoder.*"], ["encoder.0", "encoder.1"]),
        (["encoder.**.mlp"], ["encoder.0.mlp", "encoder.1.mlp"]),
        (["**.fc"], ["encoder.0.mlp.fc", "encoder.1.mlp.fc"]),
        (["encoder.**"], [n for n in NAMES if n.startswith("encoder")]),
        (["h.1*"], ["h.10", "h.11"]),
        (["head", "encoder.0", "head"], ["head", "encoder.0"]),
        (["encoder._orig_mod.0"], ["encoder.0"]),
    ],
)
def test_globs_resolve_against_module_names(items: list[str], expected: list[str]) -> None:
    assert resolve_names(items, NAMES) == expected


def test_unknown_name_suggests_close_names_and_how_to_list() -> None:
    with pytest.raises(UnknownModuleError, match="did you mean 'encoder.1'.*named_modules"):
        resolve_names(["encodr.1"], NAMES)
    with pytest.raises(KeyError, match="glob 'decoder.\\*' matches no module"):
        resolve_names(["decoder.*"], NAMES)


def test_canonical_name_strips_compile_wrappers() -> None:
    assert canonical_name("_orig_mod") == ""
    assert canonical_name("a._orig_mod.b") == "a.b"
