"""The feature browser: its data files hold the summary's examples, escaped, and it opens
from disk; ``lightning-iocatch browse`` writes it. Ground truth: a hand-made activation
tensor whose top examples and densities are worked out by hand below."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_iocatch.cli import main
from lightning_iocatch.probes import UnitActivations, UnitSummary
from lightning_iocatch.reports import write_browser

WORDS = ["[UNK]", "<b>&", "hello", " world", '"q"', "x\n"]  # token id -> text
# (batch 2, seq 4, units 3): unit 0 ties at 2.0, unit 1 is dead, unit 2 peaks at 3.0
FEATURES = [
    [[0.5, 0.0, 0.0], [2.0, 0.0, 1.0], [0.25, 0.0, 3.0], [1.5, 0.0, 0.0]],
    [[2.0, 0.0, 0.75], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
]
TOKEN_IDS = [[1, 2, 3, 4], [5, 7, 2, 1]]  # 7: an id the tokenizer lacks
INDICES = [5, 9]
# unit 0's top 3 with 1 token each side, best first, ties by dataset index then position:
# (value, dataset index, position, ids around, values around); None: no token there
UNIT0 = [
    (2.0, 5, 1, [1, 2, 3], [0.5, 2.0, 0.25]),
    (2.0, 9, 0, [-1, 5, 7], [None, 2.0, 0.0]),
    (1.5, 5, 3, [3, 4, -1], [0.25, 1.5, None]),
]


def tokenizer() -> Any:
    """A word-level tokenizer over WORDS, built offline."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(WORDS)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")


@pytest.fixture(scope="module")
def summary() -> UnitSummary:
    probe = UnitActivations(k=3, window=1, above=0.0)
    probe.update(torch.tensor(FEATURES), indices=INDICES, token_ids=torch.tensor(TOKEN_IDS))
    return probe.compute().with_key("sae.<latents>")


def script_data(path: Path, call: str) -> tuple[list[str], Any]:
    """The arguments before the JSON, and the JSON, of a ``call(..., JSON);`` data file."""
    match = re.fullmatch(rf"{call}\(((?:\d+, )*)(.*)\);\n", path.read_text(encoding="ascii"))
    assert match, path.read_text()[:200]
    return match.group(1).split(", ")[:-1], json.loads(match.group(2))


def test_a_units_examples_and_statistics_are_the_summarys(
    summary: UnitSummary, tmp_path: Path
) -> None:
    index = write_browser(summary, tmp_path / "site", tokenizer())
    assert index == tmp_path / "site" / "index.html"
    number, chunk = script_data(tmp_path / "site" / "data" / "units-00000.js", "iocChunk")
    assert number == ["0"] and chunk["start"] == 0 and len(chunk["units"]) == 3
    shown = [tuple(example) for example in chunk["units"][0]["examples"]]
    assert shown == UNIT0  # hand-worked: values, indices, positions, ids, values, order
    for slot, example in enumerate(chunk["units"][2]["examples"]):  # and as the tensors say
        assert example[:3] == [
            summary.top_values[2, slot].item(),
            summary.top_index[2, slot].item(),
            summary.top_position[2, slot].item(),
        ]
        assert example[3] == summary.context_ids[2, slot].tolist()
        want = summary.context_values[2, slot].tolist()
        assert [math.nan if v is None else v for v in example[4]] == pytest.approx(
            want, nan_ok=True
        )
    assert chunk["units"][1]["examples"] == []  # dead
    assert chunk["units"][0]["hist"] == summary.histogram[0].tolist()
    assert sum(chunk["units"][0]["hist"]) == 6
    texts = {"1": "<b>&", "2": "hello", "3": " world", "4": '"q"', "5": "x\n", "7": "[7]"}
    assert chunk["tokens"] == texts  # 7: not in the tokenizer's vocabulary

    _, table = script_data(tmp_path / "site" / "data" / "table.js", "iocTable")
    assert (table["units"], table["rows"], table["k"], table["window"]) == (3, 8, 3, 1)
    assert table["active"] == [6, 0, 3]
    assert table["density"] == [0.75, 0.0, 0.375]
    assert table["mean"] == [7.25 / 6, None, 4.75 / 3]
    assert table["max"] == [2.0, None, 3.0]
    assert table["top"] == ["hello", None, " world"]
    counts, _, dead = summary.density_histogram()
    assert table["density_counts"] == counts.tolist() and dead == 1
    assert table["hist_edges"] == summary.edges().tolist()


def test_tokens_and_titles_are_escaped(summary: UnitSummary, tmp_path: Path) -> None:
    write_browser(summary, tmp_path, tokenizer(), title='<script>alert("x")</script> & co')
    raw = (tmp_path / "data" / "units-00000.js").read_text(encoding="ascii")
    assert "<" not in raw and "&" not in raw and "\\u003cb\\u003e\\u0026" in raw
    page = Page.parse(tmp_path / "index.html")
    assert page.title == '<script>alert("x")</script> & co'
    assert page.scripts == ["data/table.js"]  # the title made no script


class Page(HTMLParser):
    """The title, the ``src`` of scripts, the ``href`` of links of an HTML file."""

    def __init__(self) -> None:
        super().__init__()
        self.title, self.scripts, self.links, self._in_title = "", [], [], False

    @classmethod
    def parse(cls, path: Path) -> Page:
        page = cls()
        page.feed(path.read_text(encoding="utf-8"))
        return page

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self._in_title = tag == "title"
        if tag == "script" and found.get("src"):
            self.scripts.append(found["src"])
        if tag == "link" and found.get("href"):
            self.links.append(found["href"])

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False


def test_it_opens_from_disk_in_chunks_with_ids_when_no_tokenizer(
    summary: UnitSummary, tmp_path: Path
) -> None:
    units = 600  # chunks of 256 units: 0-255, 256-511, 512-599
    values = torch.arange(units, dtype=torch.float32)[None, :] + 1.0
    probe = UnitActivations(k=1, window=0)
    probe.update(values, indices=[3], positions=torch.tensor([4]))
    write_browser(probe.compute(), tmp_path / "old")  # a stale chunk to be removed
    (tmp_path / "old" / "data" / "units-00009.js").write_text("")
    write_browser(probe.compute(), tmp_path / "old")
    names = sorted(path.name for path in (tmp_path / "old" / "data").iterdir())
    assert names == ["table.js", "units-00000.js", "units-00001.js", "units-00002.js"]
    number, chunk = script_data(tmp_path / "old" / "data" / "units-00002.js", "iocChunk")
    assert number == ["2"] and chunk["start"] == 512 and chunk["tokens"] == {}
    assert chunk["units"][599 - 512]["examples"] == [[600.0, 3, 4, [-1], [600.0]]]  # window 0
    _, table = script_data(tmp_path / "old" / "data" / "table.js", "iocTable")
    assert table["max"][-1] == 600.0 and table["top"][-1] is None
    write_browser(summary, tmp_path / "ids")  # no tokenizer: ids
    _, table = script_data(tmp_path / "ids" / "data" / "table.js", "iocTable")
    assert table["decoded"] is False and table["top"] == ["[2]", None, "[3]"]
    _, chunk = script_data(tmp_path / "ids" / "data" / "units-00000.js", "iocChunk")
    assert chunk["tokens"] == {} and [tuple(e) for e in chunk["units"][0]["examples"]] == UNIT0
    write_browser(summary, tmp_path / "fn", tokenizer=lambda ids: [f"<{i}>" for i in ids])
    _, chunk = script_data(tmp_path / "fn" / "data" / "units-00000.js", "iocChunk")
    assert chunk["tokens"]["7"] == "<7>" and chunk["tokens"]["1"] == "<1>"  # a function of ids
    for name in ("index.html", "unit.html"):
        page = Page.parse(tmp_path / "old" / name)
        assert page.scripts == ["data/table.js"] and page.links == []
        assert "http" not in (tmp_path / "old" / name).read_text().replace(
            "http://www.w3.org/2000/svg", ""
        )  # nothing from the network: CSS and JavaScript inline


def test_browse_command_end_to_end(
    summary: UnitSummary, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "units.safetensors"
    summary.save(result)
    tokenizer().save_pretrained(tmp_path / "tok")
    assert main(["browse", str(result), "--tokenizer", str(tmp_path / "tok")]) == 0
    index = tmp_path / "units_browser" / "index.html"
    assert capsys.readouterr().out == f"{index}\n" and index.is_file()
    _, chunk = script_data(tmp_path / "units_browser" / "data" / "units-00000.js", "iocChunk")
    assert [tuple(example) for example in chunk["units"][0]["examples"]] == UNIT0
    assert chunk["tokens"]["1"] == "<b>&" and chunk["tokens"]["7"] == "[7]"  # unknown id
    assert main(["browse", str(result), "--out", str(tmp_path / "ids")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'ids' / 'index.html'}\n"


@pytest.mark.parametrize(
    ("make", "argument", "message"),
    [
        (None, [], "no unit summary file at .*missing.safetensors"),
        ("text", [], "is not a unit summary \\(not a safetensors file"),
        (
            "other",
            [],
            "is not a unit summary \\(lightning-iocatch-units/1\\): make one .*summarize_store",
        ),
        ("summary", ["--tokenizer", "./no/such/dir"], "no tokenizer directory at './no/such"),
    ],
)
def test_browse_refuses_bad_input_in_one_line(
    summary: UnitSummary,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: str | None,
    argument: list[str],
    message: str,
) -> None:
    path = tmp_path / "missing.safetensors"
    if make == "text":
        path.write_text("not tensors")
    elif make == "other":
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(2)}, str(path))
    elif make == "summary":
        summary.save(path)
    assert main(["browse", str(path), *argument]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and len(err.splitlines()) == 1
        and err.startswith("error: ")
        and re.search(message, err)
    ), err
    assert not (tmp_path / "missing_browser").exists()
    for command in re.findall(r"lightning-iocatch (\w+)", err):  # advice names real commands
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0, f"the advice names `lightning-iocatch {command}`"
    capsys.readouterr()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt install)")
def test_chromium_draws_a_units_examples(summary: UnitSummary, tmp_path: Path) -> None:
    write_browser(summary, tmp_path, tokenizer())
    dom = rendered(tmp_path / "unit.html", "#u=0")
    spans = re.findall(r'<span class="t( ex)?( none)?" data-id="(-?\d+)" data-value="([^"]*)"', dom)
    rows = [spans[0:3], spans[3:5], spans[5:7]]  # no span where there is no token
    assert [[int(s[2]) for s in row] for row in rows] == [[1, 2, 3], [5, 7], [3, 4]]
    assert [[s[0] == " ex" for s in row] for row in rows] == [[0, 1, 0], [1, 0], [0, 1]]
    assert [float(s[3]) for s in rows[0]] == [0.5, 2.0, 0.25]
    assert ">&lt;b&gt;&amp;</span>" in dom and "x\u21b5</span>" in dom  # escaped; line break shown
    assert 'title="value 2, dataset index 9, position 0"' in dom  # the second example's row
    table = rendered(tmp_path / "index.html", "#sort=max")  # largest first, none last
    assert re.findall(r'<a href="unit.html#u=(\d+)">', table) == ["2", "0", "1"]


def rendered(page: Path, fragment: str) -> str:
    """The DOM of ``page`` once Chromium has run its scripts."""
    return subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
         "--dump-dom", page.as_uri() + fragment],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip


def test_infinities_word_starts_and_a_directory_of_other_files(tmp_path: Path) -> None:
    probe = UnitActivations(k=2, window=1, above=None)
    values = torch.tensor([[[float("inf"), 1.0], [2.0, float("-inf")], [0.5, 3.0]]])
    probe.update(values, indices=[4], token_ids=torch.tensor([[0, 1, 2]]))
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"\u2581The": 0, "\u2581cat": 1, "s": 2, "[UNK]": 3}  # SentencePiece pieces
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.decoder = decoders.Metaspace()
    pieces = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    write_browser(probe.compute(), tmp_path / "b", tokenizer=pieces)
    _, table = script_data(tmp_path / "b" / "data" / "table.js", "iocTable")
    assert table["max"] == ["inf", 3.0] and table["mean"][0] == "inf"  # JSON has no Infinity
    _, chunk = script_data(tmp_path / "b" / "data" / "units-00000.js", "iocChunk")
    assert chunk["units"][0]["examples"][0][0] == "inf"
    assert chunk["tokens"] == {"0": " The", "1": " cat", "2": "s"}  # " The cats", not "Thecats"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not empty and holds no feature browser"):
        write_browser(probe.compute(), tmp_path / "mine")
    write_browser(probe.compute(), tmp_path / "b")  # a browser is replaced


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt install)")
def test_chromium_reads_infinities_and_bad_unit_numbers(tmp_path: Path) -> None:
    probe = UnitActivations(k=1, window=0)
    probe.update(torch.tensor([[float("inf"), 1.0], [2.0, 3.0]]), indices=[0, 1])
    write_browser(probe.compute(), tmp_path)
    table = rendered(tmp_path / "index.html", "#sort=max")  # +inf first
    assert re.findall(r'<a href="unit.html#u=(\d+)">', table) == ["0", "1"]
    assert "Infinity" in rendered(tmp_path / "unit.html", "#u=0")
    for bad in ("#u=abc", "#u=7", "#sort=toString"):
        page = "index.html" if "sort" in bad else "unit.html"
        dom = rendered(tmp_path / page, bad)
        assert ("no unit" in dom) if page == "unit.html" else ('href="unit.html#u=1"' in dom)


_MEASURE = """<style>__STYLE__</style><script>
setTimeout(function () {  // every unit drawn in turn; each SVG text outside its figure
  var out = [];
  for (var u = 0; u < T.units; u++) {
    location.hash = "#u=" + u; show();
    var svgs = document.querySelectorAll("svg");
    for (var i = 0; i < svgs.length; i++) {
      var width = svgs[i].viewBox.baseVal.width, texts = svgs[i].querySelectorAll("text");
      for (var j = 0; j < texts.length; j++) {
        var box = texts[j].getBBox();
        if (box.x < 0 || box.x + box.width > width) out.push([u, texts[j].textContent]);
      }
    }
  }
  var pre = document.createElement("pre"); pre.id = "outside";
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
}, 300);
</script></body>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt install)")
@pytest.mark.parametrize("font", [None, "18px"])
def test_chromium_keeps_every_label_inside_its_figure(tmp_path: Path, font: str | None) -> None:
    """Units of densities from 0.01 to 1 (the "this unit" mark anywhere along the axis),
    each drawn and every SVG text measured. With a larger font (a system font wider than
    DejaVu Sans, a reader's minimum font size) the "this unit" label still fits: its side
    of the line must not depend on its width."""
    rows = 400
    counts = [*range(4, rows + 1, 4)]
    values = torch.zeros(rows, len(counts))
    for unit, count in enumerate(counts):
        values[:count, unit] = 1.0
    probe = UnitActivations(k=1, window=0)
    probe.update(values, indices=list(range(rows)))
    write_browser(probe.compute(), tmp_path)
    style = "" if font is None else f"svg text{{font-size:{font}}}"
    page = (tmp_path / "unit.html").read_text(encoding="utf-8")
    measured = page.replace("</body>", _MEASURE.replace("__STYLE__", style))
    (tmp_path / "measured.html").write_text(measured, encoding="utf-8")
    dom = rendered(tmp_path / "measured.html", "")
    found = re.search(r'<pre id="outside">(.*?)</pre>', dom)
    assert found, dom[-2000:]
    outside = json.loads(found.group(1))
    if font is not None:  # larger tick labels may reach the edge: the mark's label may not
        outside = [item for item in outside if item[1] == "this unit"]
    assert outside == [], [(counts[unit] / rows, text) for unit, text in outside[:5]]
