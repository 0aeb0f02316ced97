"""The feature browser: a static site of a :class:`~lightning_iocatch.probes.UnitSummary`.

``write_browser(summary, out_dir)`` writes ``index.html`` (the layer's feature-density
histogram and a table of the units, sortable and paginated), ``unit.html`` (one unit:
its density, mean when active, log10 activation histogram and top examples, each token
shaded by the unit's value on it) and their data under ``data/``. It opens from disk
(``file://``), with nothing fetched from the network: the CSS and JavaScript are inline,
the data are JavaScript files loaded with ``<script src>``.

The data: ``data/table.js`` is ``iocTable(JSON)``, one column per statistic;
``data/units-NNNNN.js`` is ``iocChunk(N, JSON)`` for units ``N * chunk`` onwards, each
unit's ``hist`` (its histogram counts) and ``examples``, each ``[value, dataset index,
position, token ids, values]`` (best first; ``-1`` where no token, ``null`` for no
value), and the chunk's ``tokens`` (id -> decoded text) when a tokenizer was given.
Every statistic and example value is exact; the per-token values around an example
have 6 significant digits.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.reports.browser_assets import index_page, unit_page

__all__ = ["write_browser"]

_CHUNK = 256  # units per data file: 64 files of about 1 MB at 16,384 units, k=20, window=8
_PAGE = 200  # table rows per page of the index


def write_browser(
    summary: UnitSummary | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    local_files_only: bool = False,
    title: str | None = None,
) -> Path:
    """Write the feature browser of ``summary`` to ``out_dir``; returns ``index.html``'s path.

    Open that file in a browser: no server is needed. Files of an earlier browser in
    ``out_dir`` are replaced.

    Args:
        summary: a :class:`~lightning_iocatch.probes.UnitSummary`, or the path of one
            saved with :meth:`~lightning_iocatch.probes.UnitSummary.save`.
        out_dir: the directory to write (made if missing).
        tokenizer: shows each token as text: a Hugging Face tokenizer, or its Hub name
            or saved directory (loaded with ``transformers.AutoTokenizer``), or a function
            of a list of ids giving their texts; ``None``: token ids.
        local_files_only: load a tokenizer named by ``tokenizer`` from the local
            Hugging Face cache only, never downloading it.
        title: the pages' title (default: the summary's key).

    Raises:
        FileNotFoundError: ``summary`` is a path to no file.
        ValueError: that file is not a unit summary, or the tokenizer cannot be loaded.

    Examples:
        >>> import tempfile
        >>> from lightning_iocatch.probes import UnitActivations
        >>> probe = UnitActivations(k=2, window=1)
        >>> hidden = torch.tensor([[[0.0, 1.0], [4.0, 0.0], [2.0, 2.0]]])  # (batch, seq, units)
        >>> probe.update(hidden, indices=[7], token_ids=torch.tensor([[11, 12, 13]]))
        >>> index = write_browser(probe.compute(), tempfile.mkdtemp())
        >>> index.name, sorted(path.name for path in (index.parent / "data").iterdir())
        ('index.html', ['table.js', 'units-00000.js'])
    """
    summary = _loaded(summary)
    decode = _decoder(_tokenizer(tokenizer, local_files_only))
    out = Path(out_dir)
    data = out / "data"
    if (
        out.exists()
        and (not out.is_dir() or any(out.iterdir()))
        and not (data / "table.js").is_file()
    ):
        raise ValueError(
            f"{os.fspath(out)!r} is not empty and holds no feature browser: give a new or "
            "empty directory (a browser written there before is replaced)"
        )
    data.mkdir(parents=True, exist_ok=True)
    for stale in data.glob("units-*.js"):
        stale.unlink()
    table = _table(summary, decode)
    _write_js(data / "table.js", "iocTable(", table)
    for number, start in enumerate(range(0, summary.units, _CHUNK)):
        chunk = _chunk(summary, start, min(start + _CHUNK, summary.units), decode)
        _write_js(data / f"units-{number:05d}.js", f"iocChunk({number}, ", chunk)
    name = title if title is not None else (summary.key or "units")
    (out / "unit.html").write_text(unit_page(name), encoding="utf-8")
    index = out / "index.html"
    index.write_text(index_page(name, _PAGE), encoding="utf-8")
    return index


def _loaded(summary: UnitSummary | str | os.PathLike[str]) -> UnitSummary:
    """The summary itself, or the one saved at that path."""
    if isinstance(summary, UnitSummary):
        return summary
    if not isinstance(summary, str | os.PathLike):
        raise TypeError(f"`summary` must be a UnitSummary or a path, got {summary!r:.80}")
    path = os.fspath(summary)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no unit summary file at {path!r}: give the .safetensors file that "
            "UnitSummary.save (or capture.probes.summaries[key].save) wrote"
        )
    return UnitSummary.load(path)


def _tokenizer(tokenizer: Any, local_files_only: bool) -> Any:
    """A tokenizer object (or ``None``); a name or directory loaded with AutoTokenizer."""
    if tokenizer is None or not isinstance(tokenizer, str | os.PathLike):
        if not (
            tokenizer is None or hasattr(tokenizer, "convert_ids_to_tokens") or callable(tokenizer)
        ):
            raise TypeError(
                "`tokenizer` must be a Hugging Face tokenizer, its name or directory, a "
                f"function of a list of ids giving their texts, or None, got {tokenizer!r:.80}"
            )
        return tokenizer
    name = os.fspath(tokenizer)
    if (os.path.isabs(name) or name.startswith(".")) and not os.path.isdir(name):
        raise FileNotFoundError(
            f"no tokenizer directory at {name!r}: give a directory written by "
            "tokenizer.save_pretrained, or a Hugging Face Hub name"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(
            f"loading the tokenizer {name!r} needs transformers: pip install transformers "
            "(or leave the tokenizer out to show token ids)"
        ) from error
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"cannot load the tokenizer {name!r} with transformers.AutoTokenizer ({first}); "
            "give a Hugging Face Hub name or a directory written by tokenizer.save_pretrained"
        ) from None


_Decode = Callable[[Sequence[int]], list[str]] | None


def _decoder(tokenizer: Any) -> _Decode:
    """``decode(ids)``: each id's text, or None without a tokenizer.

    A token's text is ``tokenizer.decode([id])`` (``" the"`` for GPT-2's ``"Ġthe"``); its
    vocabulary entry (``convert_ids_to_tokens``) where that is empty or an incomplete
    character (a byte of a multi-byte one); ``[id]`` for an id the tokenizer lacks.
    """
    if tokenizer is None:
        return None
    if not hasattr(tokenizer, "convert_ids_to_tokens"):  # a function of the ids
        return lambda ids: [str(text) for text in tokenizer(list(ids))] if ids else []

    def decode(ids: Sequence[int]) -> list[str]:
        if not ids:
            return []
        texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
        pieces = tokenizer.convert_ids_to_tokens(list(ids))
        found = []
        for i, text, piece in zip(ids, texts, pieces, strict=True):
            if not text or "\ufffd" in text:
                text = piece if isinstance(piece, str) and piece else f"[{i}]"
            found.append(_word_start(text, piece, wordpiece))
        return found

    wordpiece = _model_kind(tokenizer) == "WordPiece"

    return decode


def _model_kind(tokenizer: Any) -> str:
    """The class name of a fast tokenizer's model (``"BPE"``, ``"WordPiece"``...), else ``""``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "model", None)).__name__ if backend is not None else ""


def _word_start(text: str, piece: Any, wordpiece: bool) -> str:
    """``text`` with the space its token's vocabulary entry says it starts with, which a
    token decoded alone loses: SentencePiece's ``"\u2581The"`` (Llama, Mistral, T5) and a
    WordPiece token that is not a ``"##"`` continuation (BERT)."""
    if not isinstance(piece, str) or text.startswith(" "):
        return text
    if piece.startswith("\u2581"):
        return " " + text
    if (
        wordpiece
        and not piece.startswith("##")
        and not (piece.startswith("[") and piece.endswith("]"))
    ):
        return " " + text
    if wordpiece and piece.startswith("##") and text.startswith("##"):
        return text[2:]
    return text


def _table(summary: UnitSummary, decode: _Decode) -> dict[str, Any]:
    """The settings, the histograms' edges and one column per statistic of the units."""
    counts, edges, _ = summary.density_histogram()
    k, w = summary.k, summary.window
    best = summary.top_values[:, 0] if k else torch.full((summary.units,), math.nan)
    top_ids = torch.full((summary.units,), -1)
    if k and summary.context_ids.shape[2]:  # none in a file of an older version, window=0
        top_ids = torch.where(summary.top_index[:, 0] >= 0, summary.context_ids[:, 0, w], -1)
    top: list[str | None]
    if decode is not None:
        unique = sorted({i for i in top_ids.tolist() if i >= 0})
        text = dict(zip(unique, decode(unique), strict=True))
        top = [text.get(i) for i in top_ids.tolist()]
    else:
        top = [None if i < 0 else f"[{i}]" for i in top_ids.tolist()]
    return {
        "key": summary.key,
        "units": summary.units,
        "rows": summary.rows,
        "k": k,
        "window": w,
        "threshold": summary.threshold,
        "chunk": _CHUNK,
        "decoded": decode is not None,
        "density_counts": counts.tolist(),
        "density_edges": edges.tolist(),
        "hist_edges": summary.edges().tolist(),
        "active": summary.active.tolist(),
        "density": _exact_list(summary.density()),
        "mean": _exact_list(summary.mean_active()),
        "max": _exact_list(best),
        "top": top,
    }


def _chunk(summary: UnitSummary, start: int, stop: int, decode: _Decode) -> dict[str, Any]:
    """Units ``start:stop``: their histograms, examples and the text of their tokens."""
    filled = (summary.top_index[start:stop] >= 0).sum(dim=1).tolist()
    values = summary.top_values[start:stop].tolist()
    index = summary.top_index[start:stop].tolist()
    position = summary.top_position[start:stop].tolist()
    ids = summary.context_ids[start:stop].tolist()
    around = summary.context_values[start:stop].tolist()
    histogram = summary.histogram[start:stop].tolist()
    units = []
    for unit, count in enumerate(filled):
        examples = [
            [
                _exact(values[unit][slot]),
                index[unit][slot],
                position[unit][slot],
                ids[unit][slot],
                [float(f"{v:.6g}") if math.isfinite(v) else _exact(v) for v in around[unit][slot]],
            ]
            for slot in range(count)
        ]
        units.append({"hist": histogram[unit], "examples": examples})
    tokens: dict[str, str] = {}
    if decode is not None:
        used = sorted(
            {i for unit, count in enumerate(filled) for s in ids[unit][:count] for i in s}
        )
        used = [i for i in used if i >= 0]
        tokens = {str(i): text for i, text in zip(used, decode(used), strict=True)}
    return {"start": start, "tokens": tokens, "units": units}


def _exact(value: float) -> float | str | None:
    """A finite value as it is (JSON writes its shortest exact form); ``"inf"`` and
    ``"-inf"`` for infinities (JSON has none; the pages read them back); None for NaN."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value if math.isfinite(value) else None


def _exact_list(values: torch.Tensor) -> list[float | str | None]:
    """Each value as it is; None for NaN (a dead unit's mean, an empty slot)."""
    return [_exact(v) for v in values.tolist()]


def _write_js(path: Path, call: str, data: dict[str, Any]) -> None:
    """``call(JSON);`` as a script any page can load from disk: ASCII only, with ``<``,
    ``>`` and ``&`` escaped so the text could even sit inline in HTML."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    path.write_text(f"{call}{text});\n", encoding="ascii")
