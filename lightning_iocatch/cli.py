"""The ``lightning-iocatch`` command: list modules, inspect or export a dump, redraw figures.

    lightning-iocatch modules TARGET [--spec SPEC]   # TARGET: package.module:attribute
    lightning-iocatch inspect PATH|URL [--expected N] [--dataloader-idx I] [--verify]
                              [--storage-options JSON] [--quiet]
    lightning-iocatch export STORE OUT [--keys K ...] [--layout columns|saelens] [--hook-name NAME]
                             [--storage-options JSON] [--quiet]
    lightning-iocatch plot METRICS [--out DIR]
    lightning-iocatch browse RESULT [--tokenizer NAME_OR_PATH] [--out DIR]

Also ``python -m lightning_iocatch``. Errors go to stderr in one line, with exit code 2
(``inspect``: 1 when a dataset index is missing or duplicated). Long work (``export``,
``inspect --verify``, opening a store of many commit records on object storage) shows a
progress bar on stderr when stderr is a terminal, never on stdout; ``--quiet`` hides it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from torch import nn

from lightning_iocatch.capture.catcher import module_index
from lightning_iocatch.capture.spec import CaptureSpec, resolve_names
from lightning_iocatch.errors import SpecError, StoreError, UnknownModuleError
from lightning_iocatch.store.reader import FeatureStore

__all__ = ["main"]


class CommandError(Exception):
    """A failure to report in one line, with exit code 2."""


_REPORTED = (
    CommandError,
    SpecError,
    UnknownModuleError,
    StoreError,
    ValueError,
    ImportError,
    OSError,
)


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line (exit code 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _count(text: str) -> int:
    """A non-negative integer argument."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def load_target(target: str) -> nn.Module:
    """``package.module:attribute``: a module class, a zero-argument factory, or an instance."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise CommandError(f"TARGET must look like 'package.module:attribute', got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # let a module in the working directory be found
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise CommandError(f"cannot import {module_name!r}: {error}") from error
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise CommandError(f"{module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise CommandError(f"{target!r} is neither an nn.Module, a class nor a factory")
    try:
        made = obj()
    except TypeError as error:
        raise CommandError(
            f"{target!r} could not be called without arguments ({error}); point TARGET at a "
            "zero-argument factory that builds the model"
        ) from error
    if not isinstance(made, nn.Module):
        raise CommandError(f"{target!r} returned {type(made).__name__}, not an nn.Module")
    return made


def _modules(args: argparse.Namespace) -> int:
    index = module_index(load_target(args.target))
    if args.spec is None:
        print(f"{'name':<48} {'type':<28} {'params':>12}")
        for name, module in index.items():
            label = "  " * (name.count(".") + 1) + name if name else "(root)"
            params = sum(p.numel() for p in module.parameters())
            print(f"{label:<48} {type(module).__name__:<28} {params:>12,}")
        print(f"\n{len(index)} modules; use the full dotted name, e.g. {_example(index)}")
        return 0
    spec = CaptureSpec.parse(args.spec)
    if spec.is_empty:
        raise CommandError(f"capture spec {args.spec!r} selects no module")
    available = list(index)
    for kind, items in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        for item in items:
            resolved = resolve_names([item], available)
            print(f"{kind:<8} {item:<32} -> {', '.join(n or '(root)' for n in resolved)}")
    return 0


def _example(index: dict[str, nn.Module]) -> str:
    names = [name for name in index if name]
    return repr(names[min(len(names) - 1, 2)]) if names else "''"


def _storage_options(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object of fsspec options."""
    try:
        options = json.loads(text)
    except ValueError as error:
        message = f"must be a JSON object, got {text!r} ({error})"
        raise argparse.ArgumentTypeError(message) from error
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return options


def _inspect(args: argparse.Namespace) -> int:
    store = FeatureStore(
        args.path,
        dataloader_idx=args.dataloader_idx,
        on_duplicate="first",
        verify=args.verify,
        storage_options=args.storage_options,
        progress=_progress(args),
    )  # with --verify, every checksum is checked before a shard is read or a line printed
    meta = store.metadata
    on_disk, where = sum(store.backend.names().values()), store.backend.place
    print(f"store      {args.path}")
    print(f"spec       {meta.get('spec')}  (stage {meta.get('stage')}, dtype {meta.get('dtype')})")
    tokens = meta.get("tokens")
    samples = store.sample_count
    kind = f"token rows of {samples} samples" if tokens else "rows"
    print(f"rows       {len(store)} {kind}  ranks {meta['ranks']}  shards {len(meta['shards'])}")
    if tokens:
        print(f"tokens     {', '.join(f'{k}={v}' for k, v in tokens.items())}")
    print(f"bytes      {meta['bytes']:,} in shards, {on_disk:,} {where}")
    if meta["codecs"]:
        print(f"codec      {', '.join(meta['codecs'])} (lossless, in blocks of rows)")
    print(f"libraries  {', '.join(f'{k} {v}' for k, v in meta.get('libraries', {}).items())}")
    if len(meta["dataloaders"]) > 1:
        print(f"dataloader {args.dataloader_idx} of {meta['dataloaders']}")
    if args.verify:
        print(f"checksums  every {store.backend.commit_point} and every shard match their CRC-32")
    table = [("key", "dtype", "row shape", "rows")]
    for key, info in meta["keys"].items():
        shape = "varies" if info["shape"] is None else str(tuple(info["shape"]))
        if key in meta["per_batch"]:
            shape, rows = f"per batch {shape}", f"{meta['per_batch'][key]} batches"
        else:
            count = store.row_count(key)
            rows = str(count) if count == len(store) else f"{count} of {len(store)}"
        dtype = info["dtype"] + (" (scaled per row)" if info.get("scaled") else "")
        table.append((key, dtype, shape, rows))
    widths = [
        max(least, *(len(row[n]) for row in table)) for n, least in enumerate((56, 10, 16, 8))
    ]
    print()
    for key, dtype, shape, rows in table:  # columns as wide as their widest entry
        print(f"{key:<{widths[0]}} {dtype:<{widths[1]}} {shape:<{widths[2]}} {rows:>{widths[3]}}")
    for key, reason in meta["skipped"].items():
        print(f"{key:<56} skipped: {reason}")
    problems = []
    duplicated = store.duplicated_indices()
    gaps = store.missing_ranges(args.expected)  # one per gap, however long
    if duplicated:
        problems.append(
            f"{len(duplicated)} dataset indices duplicated, e.g. {duplicated[:5]} (read once, "
            "from their first commit, with FeatureStore(..., on_duplicate='first'))"
        )
    if gaps:
        missing = sum(stop - start for start, stop in gaps)
        shown = ", ".join(_span(start, stop) for start, stop in gaps[:5])
        more = f" and {len(gaps) - 5} more" if len(gaps) > 5 else ""
        problems.append(f"{missing} dataset indices missing, in {len(gaps)} gap(s): {shown}{more}")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    upto = args.expected if args.expected is not None else samples
    once = "in exactly one commit" if tokens else "exactly once"
    if upto:
        print(f"\nindices    complete: each of 0..{upto - 1} present {once}")
    else:
        print("\nindices    none: nothing is committed yet")
    return 0


def _span(start: int, stop: int) -> str:
    """``5..9`` for the indices ``range(5, 10)``; ``5`` for one."""
    return str(start) if stop == start + 1 else f"{start}..{stop - 1}"


def _export(args: argparse.Namespace) -> int:
    from lightning_iocatch.store.export import export_dataset

    out = export_dataset(
        args.store,
        args.out,
        keys=args.keys,
        layout=args.layout,
        hook_name=args.hook_name,
        token_ids_key=args.token_ids_key,
        dataloader_idx=args.dataloader_idx,
        storage_options=args.storage_options,
        on_duplicate=args.on_duplicate,
        progress=_progress(args),
    )
    print(f"wrote {out} (read it with datasets.load_from_disk)")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from lightning_iocatch.plots import read_metrics_csv, save_probe_figures

    metrics = Path(args.metrics)
    if not metrics.is_file():
        raise CommandError(f"no such metrics file: {metrics}")
    out = Path(args.out) if args.out else metrics.parent
    for path in save_probe_figures(read_metrics_csv(metrics), out):
        print(f"wrote {path}")
    return 0


def _browse(args: argparse.Namespace) -> int:
    from lightning_iocatch.reports import write_browser

    result = Path(args.result)
    out = Path(args.out) if args.out else result.with_name(f"{result.stem}_browser")
    print(write_browser(result, out, tokenizer=args.tokenizer))
    return 0


def _progress(args: argparse.Namespace) -> bool | None:
    """``--quiet``: no bar; otherwise one where stderr is a terminal."""
    return False if args.quiet else None


def _add_quiet(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (one is drawn on stderr only when it is a terminal)",
    )


def _add_storage_options(command: argparse.ArgumentParser, what: str) -> None:
    command.add_argument(
        "--storage-options",
        type=_storage_options,
        metavar="JSON",
        help=f"fsspec options for a URL {what}, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:9000", "profile": "dumps"}\'',
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lightning-iocatch",
        description="Capture inputs and outputs of named submodules inside Lightning's loops.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = commands.add_parser(
        "modules",
        help="list the module names a spec can use",
        description="List capturable module names (type, parameter count), or resolve a spec.",
    )
    modules.add_argument("target", metavar="TARGET", help="package.module:attribute of a model")
    modules.add_argument("--spec", help="show what each item of this spec resolves to")
    modules.set_defaults(run=_modules)
    inspect_ = commands.add_parser(
        "inspect",
        help="describe a feature store",
        description="Keys (with their row counts), shapes, dtypes, rows, ranks and bytes of a "
        "feature store. Exit code 0: every dataset index present once; 1: an index is missing "
        "or duplicated; 2: the store cannot be read (damaged, not a store) or a bad argument.",
    )
    inspect_.add_argument(
        "path", metavar="PATH", help="the directory FeatureWriter wrote, or its fsspec URL"
    )
    _add_storage_options(inspect_, "PATH")
    inspect_.add_argument(
        "--expected", type=_count, help="the data set size (default: max index + 1)"
    )
    inspect_.add_argument("--dataloader-idx", type=_count, default=0, help="which dataloader")
    inspect_.add_argument(
        "--verify",
        action="store_true",
        help="check every shard's checksum first, before reading anything from the shards",
    )
    _add_quiet(inspect_)
    inspect_.set_defaults(run=_inspect)
    export = commands.add_parser(
        "export",
        help="write a store as a Hugging Face datasets dataset",
        description="Write the rows of a feature store as a Hugging Face `datasets` dataset "
        "(Arrow, read it with datasets.load_from_disk): one column per key plus `index`, or "
        "the layout SAELens reads for cached activations (--layout saelens). Needs `datasets`.",
    )
    export.add_argument(
        "store", metavar="STORE", help="the directory FeatureWriter wrote, or its fsspec URL"
    )
    export.add_argument(
        "out", metavar="OUT", help="a new (or empty) local directory for the dataset"
    )
    _add_storage_options(export, "STORE")
    export.add_argument("--keys", nargs="+", metavar="K", help="keys to export (default: all)")
    export.add_argument(
        "--layout",
        choices=["columns", "saelens"],
        default="columns",
        help="one column per key (default), or SAELens' cached-activations layout",
    )
    export.add_argument(
        "--hook-name", help="saelens: the activation column's name (SAELens' hook_name)"
    )
    export.add_argument(
        "--token-ids-key", help="saelens: the integer key of the token ids (default: detected)"
    )
    export.add_argument("--dataloader-idx", type=_count, default=0, help="which dataloader")
    export.add_argument(
        "--on-duplicate",
        choices=["error", "first"],
        default="error",
        help="an index stored twice: refuse the store (default), or export its first commit",
    )
    _add_quiet(export)
    export.set_defaults(run=_export)
    plot = commands.add_parser(
        "plot",
        help="redraw the probe figures from a CSVLogger metrics.csv",
        description="Write probe_by_layer.png and cka.png from a CSVLogger metrics.csv.",
    )
    plot.add_argument("metrics", metavar="METRICS", help="path to metrics.csv")
    plot.add_argument("--out", help="output directory (default: next to METRICS)")
    plot.set_defaults(run=_plot)
    browse = commands.add_parser(
        "browse",
        help="write the feature browser of a unit summary",
        description="Write a static HTML site (open its index.html from disk) of the units of "
        "a summary UnitSummary.save wrote: their density, activation histograms and top "
        "examples, each token shaded by the unit's value. Prints the index's path.",
    )
    browse.add_argument("result", metavar="RESULT", help="the unit summary (.safetensors)")
    browse.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="a Hugging Face tokenizer (Hub name or saved directory) to show tokens as text "
        "(default: token ids)",
    )
    browse.add_argument("--out", metavar="DIR", help="default: RESULT's stem + _browser/")
    browse.set_defaults(run=_browse)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Examples:
        >>> main(["modules", "torch.nn:Identity"])  # doctest: +NORMALIZE_WHITESPACE
        name                                             type                               params
        (root)                                           Identity                                0
        <BLANKLINE>
        1 modules; use the full dotted name, e.g. ''
        0
    """
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except BrokenPipeError:  # e.g. `lightning-iocatch modules X | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep Python quiet at exit
        return 0
    except _REPORTED as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
