"""Draw the probes page's figures from a real run of the digits demo.

    python tools/docs_probe_figures.py     # about a minute on 2 cores

Trains ``examples/demo.py``'s MLP on scikit-learn's bundled digits with validation probes
(nothing is downloaded), then draws probe accuracy by layer and the CKA heatmap with
``lightning_iocatch.plots`` into ``docs/images/probe-by-layer.png`` and
``docs/images/probe-cka.png``. Each PNG must stay under 150 KB.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

from examples.demo import run
from lightning_iocatch.plots import cka_heatmap, probe_by_layer, read_metrics_csv

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
LIMIT = 150_000


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(epochs=12, out=tmp)
        metrics = next(Path(tmp).rglob("metrics.csv"))
        history = read_metrics_csv(metrics)
        for name, draw in (("probe-by-layer.png", probe_by_layer), ("probe-cka.png", cka_heatmap)):
            path = IMAGES / name
            draw(history).savefig(path, dpi=96)
            size = path.stat().st_size
            print(f"{path}: {size:,} bytes")
            if size > LIMIT:
                raise SystemExit(f"{path} is {size:,} bytes, over {LIMIT:,}: lower the dpi")
    print({layer: round(acc, 3) for layer, acc in result.probe_acc.items()})


if __name__ == "__main__":
    main()
