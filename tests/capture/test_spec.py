"""spec.py: the capture spec grammar, against the reference parser and by property."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_iocatch import CaptureSpec, SpecError, format_io_spec, parse_io_spec
from lightning_iocatch.capture.spec import canonical_name, resolve_names
from lightning_iocatch.errors import UnknownModuleError

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


def test_canonical_name_strips_every_wrapper_component() -> None:
    assert canonical_name("_fsdp_wrapped_module") == ""
    raw = "_fsdp_wrapped_module.encoder.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp"
    assert canonical_name(raw) == "encoder.0.mlp"
    assert canonical_name("h._orig_mod.10") == "h.10"
    assert canonical_name("encoder.orig_mod.fsdp_wrapped_module") == (
        "encoder.orig_mod.fsdp_wrapped_module"
    )  # only the exact components are wrapper components


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["_fsdp_wrapped_module.encoder.1._checkpoint_wrapped_module.mlp"], ["encoder.1.mlp"]),
        (["encoder.0._checkpoint_wrapped_module"], ["encoder.0"]),
        (["encoder.*._fsdp_wrapped_module.mlp"], ["encoder.0.mlp", "encoder.1.mlp"]),
        (["_orig_mod.**._checkpoint_wrapped_module.fc"], ["encoder.0.mlp.fc", "encoder.1.mlp.fc"]),
    ],
)
def test_wrapped_spellings_resolve_to_the_plain_names(
    items: list[str], expected: list[str]
) -> None:
    assert resolve_names(items, NAMES) == expected


DECODER = ["", "model", "model.embed", "model.layers", "model.norm"]
DECODER += [f"model.layers.{i}{part}" for i in range(12) for part in ("", ".mlp", ".attn")]
DECODER += [f"model.layers.3.experts.{e}" for e in range(8)]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ("model.layer.3", r"did you mean 'model\.layers\.3'"),
        ("layers.1", r"did you mean 'model\.layers\.1'\?"),
        ("layers.11", r"did you mean 'model\.layers\.11'\?"),
        ("model.layers.1.mpl", r"did you mean 'model\.layers\.1\.mlp'"),
        ("model._orig_mod.layer.7", r"did you mean 'model\.layers\.7'"),
        ("model.layers.12", r"; 'model\.layers' has 0\.\.11, not 12\. list valid names"),
        ("model.layer.12.mlp", r"; 'model\.layers' has 0\.\.11, not 12\."),
        ("model.layers.3.experts.9", r"; 'model\.layers\.3\.experts' has 0\.\.7, not 9\."),
        ("model.layers.3.expert.8", r"; 'model\.layers\.3\.experts' has 0\.\.7, not 8\."),
    ],
)
def test_did_you_mean_never_points_at_another_index(request_: str, message: str) -> None:
    with pytest.raises(UnknownModuleError, match=message) as info:
        resolve_names([request_], DECODER)
    suggested = _suggestions(str(info.value))
    assert all(name in DECODER and _numbers(name) == _numbers(request_) for name in suggested)
    assert bool(suggested) == ("did you mean" in message)


def _numbers(name: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", name)]


def _suggestions(message: str) -> list[str]:
    if "did you mean" not in message:
        return []
    return re.findall(r"'([^']*)'", message.split("did you mean")[1].split("?")[0])


def _listed_indices(message: str) -> set[int]:
    listed = message.split(" has ")[1].split(", not")[0]
    indices: set[int] = set()
    for span in listed.split(", "):
        first, _, last = span.partition("..")
        indices.update(range(int(first), int(last or first) + 1))
    return indices


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True),
    st.integers(0, 40),
    st.sampled_from(["model.layers.{}", "layers.{}", "model.layer.{}.mlp", "h.{}", "{}"]),
)
def test_suggestions_keep_the_requested_indices(
    present: list[int], index: int, template: str
) -> None:
    names = ["", "model", "model.layers", "h"]
    names += [f"model.layers.{i}{s}" for i in present for s in ("", ".mlp")]
    names += [f"h.{i}" for i in present] + [str(i) for i in present]
    request_ = template.format(index)
    if request_ in names:
        return
    with pytest.raises(UnknownModuleError) as info:
        resolve_names([request_], names)
    text = str(info.value)
    for name in _suggestions(text):
        assert name in names and _numbers(name) == _numbers(request_)
    if " has " in text:
        assert not _suggestions(text)
        assert _listed_indices(text) == set(present) and index not in present


def _backtracking_glob_matches(pattern: list[str], name: list[str]) -> bool:
    """The first version's matcher (exponential in the number of ``**``): the reference."""
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_backtracking_glob_matches(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _backtracking_glob_matches(rest, name[1:])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "*", "**", "a*"]), min_size=1, max_size=6),
    st.lists(st.sampled_from(["a", "b", "ab"]), min_size=0, max_size=6),
)
def test_glob_matching_equals_the_backtracking_reference(
    pattern: list[str], name: list[str]
) -> None:
    from lightning_iocatch.capture.spec import _glob_matches

    assert _glob_matches(pattern, name) == _backtracking_glob_matches(pattern, name)


def test_many_double_stars_resolve_in_linear_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_iocatch.capture.spec as spec

    calls = [0]

    def counting(name: str, pattern: str) -> bool:
        calls[0] += 1
        return fnmatchcase(name, pattern)

    monkeypatch.setattr(spec, "fnmatchcase", counting)
    names = [f"model.layers.{i}.block.{j}.mlp" for i in range(100) for j in range(20)]
    pattern = ".".join(["**"] * 25 + ["nothing"])  # backtracking: ~6^25 steps per name
    with pytest.raises(KeyError, match="matches no module"):
        resolve_names([pattern], names)
    assert resolve_names(["**.**.**.mlp"], names) == names
    # at most one component comparison per (pattern component, name component, module)
    assert calls[0] <= len(names) * (26 + 4) * 6


def test_a_negative_index_is_never_answered_with_another_layer() -> None:
    names = ["", "model", "model.layers", *[f"model.layers.{i}" for i in range(3)]]
    with pytest.raises(UnknownModuleError) as caught:
        resolve_names(["model.layers.-1"], names)
    assert "'model.layers' has 0..2, not -1" in str(caught.value)
    assert "did you mean" not in str(caught.value)
