"""The probe metrics against NumPy/scikit-learn, and probes through a real Trainer."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe
from lightning_iocatch.probes.linear import _unit_hash
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer


def numpy_stats(x: np.ndarray) -> dict[str, float]:
    units = x.reshape(-1, x.shape[-1])
    return {
        "mean": x.mean(),
        "std": x.std(),
        "rms": np.sqrt((x.astype(np.float64) ** 2).mean()),
        "absmax": np.abs(x).max(),
        "zero_frac": (x == 0).mean(),
        "dead_frac": (~(units != 0).any(axis=0)).mean(),
    }


def relu_with_dead_units() -> torch.Tensor:
    x = torch.relu(torch.randn(64, 7, 10))
    x[..., [2, 5]] = 0
    return x


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(100, 16),
        relu_with_dead_units,
        lambda: torch.randn(30, 5, 12) * 3 - 2,
        lambda: torch.randn(40),
    ],
)
def test_activation_stats_match_numpy(make: object) -> None:
    torch.manual_seed(0)
    x = make()  # type: ignore[operator]
    stats = ActivationStats()
    for part in x.split(7):
        stats.update(part)
    got = {k: float(v) for k, v in stats.compute().items()}
    expected = numpy_stats(x.double().numpy())
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)  # float32 activations


def test_activation_stats_are_stable_for_large_counts_and_means() -> None:
    torch.manual_seed(0)
    stats = ActivationStats()
    chunks = [1e4 + 1e-2 * torch.randn(1_000_000) for _ in range(4)]  # float32, mean >> std
    for chunk in chunks:
        stats.update(chunk)
    reference = np.concatenate([c.double().numpy() for c in chunks])
    assert float(stats.compute()["std"]) == pytest.approx(reference.std(), rel=1e-6)
    naive = float(
        ((torch.cat(chunks) ** 2).mean() - torch.cat(chunks).mean() ** 2).clamp_min(0).sqrt()
    )
    assert abs(naive - reference.std()) > 10 * abs(float(stats.compute()["std"]) - reference.std())


def numpy_batch_stats(batches: list[np.ndarray]) -> dict[str, float]:
    """The statistics of batches whose last dimension may differ, in float64.

    ``dead_frac``: units are the positions 0..U-1 of the last dimension (U the largest);
    a unit is dead when it is zero in every batch that has it.
    """
    values = np.concatenate([b.astype(np.float64).reshape(-1) for b in batches])
    units = max(b.shape[-1] for b in batches)
    alive = np.zeros(units, dtype=bool)
    for b in batches:
        alive[: b.shape[-1]] |= (b.reshape(-1, b.shape[-1]) != 0).any(axis=0)
    return {
        "mean": values.mean(),
        "std": values.std(),
        "rms": np.sqrt((values**2).mean()),
        "absmax": np.abs(values).max(),
        "zero_frac": (values == 0).mean(),
        "dead_frac": 1 - alive.mean(),
    }


def padded_sequences(widths: tuple[int, ...]) -> list[torch.Tensor]:
    """ReLU features ``(4, 3, w)`` whose positions past each batch's longest sample are 0."""
    generator = torch.Generator().manual_seed(len(widths))
    batches = []
    for width in widths:
        x = torch.relu(torch.randn(4, 3, width, generator=generator))
        x[..., max(1, width - 2) :] = 0  # padding: zero in this batch only
        batches.append(x)
    return batches


@pytest.mark.parametrize(
    "widths",
    [
        (5, 9, 7),  # positions 7, 8: only in the longest batch, padding there: dead
        (9, 5, 7),  # the longest batch first
        (6, 6, 6),
        (3, 11),
    ],
)
def test_dead_frac_with_a_last_dimension_that_changes(widths: tuple[int, ...]) -> None:
    batches = padded_sequences(widths)
    stats = ActivationStats()
    for batch in batches:
        stats.update(batch)
    got = {k: float(v) for k, v in stats.compute().items()}
    expected = numpy_batch_stats([b.numpy() for b in batches])
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_values_are_summed_in_float64(dtype: torch.dtype) -> None:
    """Values near 300: float16 sums of squares overflow at 65,504; here nothing does."""
    torch.manual_seed(0)
    batches = [(300 + 5 * torch.randn(64, 50)).to(dtype) for _ in range(3)]
    batches[1][:, :4] = 0
    stats = ActivationStats()
    for batch in batches:
        stats.update(batch)
    got = {k: float(v) for k, v in stats.compute().items()}
    expected = numpy_batch_stats([b.double().numpy() for b in batches])
    assert got == pytest.approx(expected, rel=1e-6)
    cka = LayerCKA()
    for batch in batches:
        cka.update({"a": batch, "b": batch[:, :10] * 2})
    expected_cka = numpy_cka(
        np.concatenate([b.double().numpy() for b in batches]),
        np.concatenate([b[:, :10].double().numpy() * 2 for b in batches]),
    )
    assert float(cka.compute()["cka/a~b"]) == pytest.approx(expected_cka, rel=1e-6)


def test_probes_ignore_values_they_cannot_use() -> None:
    """Masks, ids, tables without a batch dimension, scalars: ignored, no error."""
    batch = torch.randn(4, 6, 8)
    junk = {
        "mask": torch.ones(4, 1, 6, 6, dtype=torch.bool),
        "position_ids": torch.arange(6)[None],
        "cos": torch.randn(1, 6, 8),
        "scalar": torch.tensor(2.0),
    }
    indices = list(range(4))
    for value in junk.values():
        stats = ActivationStats()
        stats.update(value, indices=indices)
        assert math.isnan(float(stats.compute()["mean"]))
        probe = LinearProbe(lambda b: b, num_classes=2)
        probe.update(value, batch=torch.zeros(4), indices=indices)
        assert probe.gram.numel() == 0
    cka, reference = LayerCKA(), LayerCKA()
    cka.update({"h": batch, "g": batch * 2 + 1, **junk}, indices=indices)
    reference.update({"h": batch, "g": batch * 2 + 1})
    assert cka.compute().keys() == {"cka/g~h"}
    assert float(cka.compute()["cka/g~h"]) == float(reference.compute()["cka/g~h"])


def test_padding_rows_are_ignored() -> None:
    """Rows flagged in ``repeated`` count nowhere: NumPy on the other rows agrees."""
    torch.manual_seed(0)
    pattern = (False, False, True, False, True, False)  # rows 2 and 4 repeat rows 0 and 1
    stats, cka = ActivationStats(), LayerCKA()
    probe = LinearProbe(
        lambda b: b, task="regression", ridge=0.0, holdout=0.3, holdout_dtype=torch.float64
    )
    real_x, real_y, real_indices = [], [], []
    for k in range(40):
        x, y = torch.randn(6, 3), torch.randn(6)
        x[2], x[4], y[2], y[4] = x[0] + 100, x[1] - 100, 1e6, -1e6  # padding: far off
        indices = [4 * k, 4 * k + 1, 4 * k, 4 * k + 2, 4 * k + 1, 4 * k + 3]
        stats.update(x, indices=indices, repeated=pattern)
        cka.update({"a": x, "b": x.tanh()}, indices=indices, repeated=pattern)
        probe.update(x, batch=y, indices=indices, repeated=pattern)
        real = [i for i, flag in enumerate(pattern) if not flag]
        real_x.append(x[real].double().numpy())
        real_y.append(y[real].double().numpy())
        real_indices += [indices[i] for i in real]
    x, y = np.concatenate(real_x), np.concatenate(real_y)
    got = {k: float(v) for k, v in stats.compute().items()}
    assert got == pytest.approx(numpy_batch_stats([x]), rel=1e-9)
    assert float(cka.compute()["cka/a~b"]) == pytest.approx(numpy_cka(x, np.tanh(x)), rel=1e-9)
    held = np.array([_unit_hash(i) < 0.3 for i in real_indices])
    design = np.c_[x, np.ones(len(x))]
    weights = np.linalg.lstsq(design[~held], y[~held], rcond=None)[0]
    residual = ((y[held] - design[held] @ weights) ** 2).sum()
    expected = 1 - residual / ((y[held] - y[held].mean()) ** 2).sum()
    assert float(probe.compute()["probe_r2"]) == pytest.approx(expected, rel=1e-9)


def test_layer_cka_pairs_only_keys_present_in_every_batch() -> None:
    torch.manual_seed(0)
    a, b, c = torch.randn(30, 4), torch.randn(30, 3), torch.randn(30, 5)
    cka = LayerCKA()
    cka.update({"a": a[:10], "b": b[:10], "c": c[:10]})
    cka.update({"a": a[10:20], "b": b[10:20], "extra": torch.randn(10, 2)})  # no "c"
    cka.update({"a": a[20:], "b": b[20:], "c": c[20:]})
    got = {k: float(v) for k, v in cka.compute().items()}
    assert got == pytest.approx(
        {"cka/a~b": numpy_cka(a.double().numpy(), b.double().numpy())}, rel=1e-9
    )
    cka.reset()
    cka.update({"b": b, "c": c})  # a new epoch starts a new layout
    assert set(cka.compute()) == {"cka/b~c"}


def test_probes_import_and_compute_without_lightning() -> None:
    code = (
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
        "    sys.modules[name] = None  # any import of Lightning raises ImportError\n"
        "import torch\n"
        "from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe\n"
        "stats = ActivationStats()\n"
        "stats.update(torch.tensor([[0.0, 1.0], [0.0, 3.0]]))\n"
        "assert float(stats.compute()['mean']) == 1.0\n"
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning')"
        " for m in sys.modules if sys.modules[m] is not None)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def holdout_split(n: int, fraction: float) -> np.ndarray:
    return np.array([_unit_hash(i) < fraction for i in range(n)])


def numpy_probe_acc(
    x: np.ndarray, labels: np.ndarray, indices: np.ndarray, num_classes: int, ridge: float = 1e-3
) -> float:
    """A ridge classifier on one-hot targets in float64, trained on the samples whose index
    hashes at or above the default held-out fraction 0.2 and scored on the others."""
    held = np.array([_unit_hash(int(i)) < 0.2 for i in indices])
    train = np.c_[x[~held], np.ones((~held).sum())]
    gram = train.T @ train
    penalty = ridge * max(gram.diagonal()[:-1].mean(), 1e-12)
    gram += np.diag([penalty] * x.shape[1] + [0.0])
    weights = np.linalg.lstsq(gram, train.T @ np.eye(num_classes)[labels[~held]], rcond=None)[0]
    predicted = (np.c_[x[held], np.ones(held.sum())] @ weights).argmax(axis=1)
    return float((predicted == labels[held]).mean())


def test_linear_probe_regression_equals_least_squares_on_the_same_split() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 6))
    y = x @ rng.normal(size=6) + 0.5 * rng.normal(size=500) + 3.0
    probe = LinearProbe(
        lambda batch: batch, task="regression", ridge=0.0, holdout_dtype=torch.float64
    )
    for start in range(0, 500, 64):
        rows = slice(start, start + 64)
        probe.update(
            torch.tensor(x[rows]),
            batch=torch.tensor(y[rows]),
            indices=range(start, start + 64)[: len(y[rows])],
        )
    held = holdout_split(500, 0.2)
    design = np.c_[x, np.ones(500)]
    weights = np.linalg.lstsq(design[~held], y[~held], rcond=None)[0]
    residual = ((y[held] - design[held] @ weights) ** 2).sum()
    expected = 1 - residual / ((y[held] - y[held].mean()) ** 2).sum()
    assert float(probe.compute()["probe_r2"]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("shuffle", "low", "high"), [(False, 0.99, 1.0), (True, 0.15, 0.4)])
def test_linear_probe_separable_vs_shuffled_labels(shuffle: bool, low: float, high: float) -> None:
    torch.manual_seed(0)
    centres = torch.randn(4, 32) * 4
    labels = torch.randint(0, 4, (4000,))
    x = centres[labels] + torch.randn(4000, 32)
    if shuffle:
        labels = labels[torch.randperm(4000)]
    probe = LinearProbe(lambda batch: batch, num_classes=4, holdout_dtype=torch.float16)
    for start in range(0, 4000, 100):
        probe.update(
            x[start : start + 100],
            batch=labels[start : start + 100],
            indices=range(start, start + 100),
        )
    assert low <= float(probe.compute()["probe_acc"]) <= high


def test_linear_probe_pools_sequences_and_bounds_held_out_rows() -> None:
    probe = LinearProbe(lambda batch: batch, num_classes=2, pool="last", max_holdout=5)
    for start in range(0, 400, 100):
        x = torch.randn(100, 9, 3)
        probe.update(x, batch=(x[:, -1, 0] > 0).long(), indices=range(start, start + 100))
    assert sum(part.shape[0] for part in probe.held_x) <= 2 * 5
    assert probe.held_x[0].shape[1] == 3


def test_linear_probe_scores_the_max_holdout_smallest_hashes() -> None:
    """The cap keeps the held-out samples of smallest (hash, index), whatever the batching."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, 4))
    y = x @ rng.normal(size=4) + rng.normal(size=600)
    probe = LinearProbe(
        lambda batch: batch,
        task="regression",
        ridge=0.0,
        max_holdout=7,
        holdout_dtype=torch.float64,
    )
    for rows in np.array_split(np.arange(600), 13):
        probe.update(torch.tensor(x[rows]), batch=torch.tensor(y[rows]), indices=rows.tolist())
    held = holdout_split(600, 0.2)
    scored = sorted(np.flatnonzero(held), key=lambda i: (_unit_hash(int(i)), i))[:7]
    design = np.c_[x, np.ones(600)]
    weights = np.linalg.lstsq(design[~held], y[~held], rcond=None)[0]
    residual = ((y[scored] - design[scored] @ weights) ** 2).sum()
    expected = 1 - residual / ((y[scored] - y[scored].mean()) ** 2).sum()
    assert held.sum() > 7
    assert float(probe.compute()["probe_r2"]) == pytest.approx(expected, rel=1e-9)


def numpy_cka(x: np.ndarray, y: np.ndarray) -> float:
    x = x - x.mean(axis=0)
    y = y - y.mean(axis=0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def test_layer_cka_matches_numpy_and_its_invariances() -> None:
    torch.manual_seed(0)
    a = torch.randn(300, 12)
    b = torch.tanh(a @ torch.randn(12, 7)) + 0.3 * torch.randn(300, 7)
    c = torch.randn(300, 5, 4)  # a sequence output: mean-pooled per sample
    rotation = torch.linalg.qr(torch.randn(12, 12))[0]
    cka = LayerCKA()
    for rows in torch.arange(300).split(64):
        cka.update({"a": a[rows], "b": b[rows], "c": c[rows], "a_rot": 2.5 * a[rows] @ rotation})
    got = {k: float(v) for k, v in cka.compute().items()}
    pooled_c = c.mean(dim=1).double().numpy()
    assert got["cka/a~b"] == pytest.approx(
        numpy_cka(a.double().numpy(), b.double().numpy()), abs=1e-5
    )
    assert got["cka/b~c"] == pytest.approx(numpy_cka(b.double().numpy(), pooled_c), abs=1e-5)
    # orthogonal transform + isotropic scaling, up to the float32 rounding of the inputs
    assert got["cka/a~a_rot"] == pytest.approx(1.0, abs=1e-6)
    assert got["cka/a_rot~b"] == pytest.approx(got["cka/a~b"], abs=1e-6)
    assert set(got) == {
        "cka/a~a_rot",
        "cka/a~b",
        "cka/a~c",
        "cka/a_rot~b",
        "cka/a_rot~c",
        "cka/b~c",
    }


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LinearProbe(lambda b: b, task="ranking"), "`task` must be"),
        (lambda: LinearProbe(lambda b: b), "`num_classes` >= 2"),
        (lambda: LinearProbe(lambda b: b, num_classes=2, pool="max"), "`pool` must be one of"),
        (lambda: LinearProbe(lambda b: b, num_classes=2, holdout=1.5), "`holdout` must be"),
        (
            lambda: IOCaptureCallback("outputs[a]", probes=[ActivationStats()], stages=["predict"]),
            "`probes` run in",
        ),
    ],
)
def test_bad_probe_arguments(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_only_probe_metrics_are_accepted() -> None:
    from torchmetrics.aggregation import MeanMetric

    with pytest.raises(TypeError, match="ActivationStats, LinearProbe, LayerCKA"):
        IOCaptureCallback("outputs[a]", probes=[MeanMetric()])


def labels_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (batch[1] > 0).long()


def test_probes_in_a_fit_are_logged_and_match_numpy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    baseline = TinyModule()
    baseline.load_state_dict(module.state_dict())
    spec = "outputs[model.layers.0|model.layers.2]"
    probes = [ActivationStats(), LinearProbe(labels_of, num_classes=2), LayerCKA()]
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="iocatch/model.layers.2/outputs/rms"
    )
    callback = IOCaptureCallback(spec, probes=probes)
    run = trainer(
        [callback, checkpoint],
        max_epochs=2,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=True,
        num_sanity_val_steps=0,
    )
    run.fit(module, loader(32, 8), loader(40, 8, seed=5))
    trainer([], max_epochs=2, num_sanity_val_steps=0).fit(
        baseline, loader(32, 8), loader(40, 8, seed=5)
    )
    assert module.val_losses == baseline.val_losses  # probes never touch the model's metrics

    logged = run.callback_metrics
    x = dataset(40, seed=5).tensors[0]
    outputs = manual_outputs(module, x)
    for index, layer in ((0, "model.layers.0"), (2, "model.layers.2")):
        expected = numpy_stats(outputs[index].double().numpy())
        for stat, value in expected.items():
            assert float(logged[f"iocatch/{layer}/outputs/{stat}"]) == pytest.approx(
                value, rel=1e-5, abs=1e-6
            )
        expected_acc = numpy_probe_acc(
            outputs[index].double().numpy(),
            labels_of(dataset(40, seed=5).tensors).numpy(),
            np.arange(40),
            num_classes=2,
        )
        assert float(logged[f"iocatch/{layer}/outputs/probe_acc"]) == pytest.approx(expected_acc)
    expected_cka = numpy_cka(outputs[0].double().numpy(), outputs[2].double().numpy())
    assert float(
        logged["iocatch/cka/model.layers.0/outputs~model.layers.2/outputs"]
    ) == pytest.approx(expected_cka, abs=1e-5)
    csv = (Path(run.logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert "iocatch/model.layers.0/outputs/dead_frac" in csv[0]
    assert checkpoint.best_model_path  # ModelCheckpoint could monitor a probe value


def test_probes_with_two_validation_dataloaders_get_a_suffix() -> None:
    callback = IOCaptureCallback("outputs[model.layers.0]", probes=[ActivationStats()])
    results = trainer([callback]).validate(
        TinyModule(), [loader(8, 4), loader(8, 4, seed=3)], verbose=False
    )
    assert "iocatch/model.layers.0/outputs/mean/dataloader_idx_1" in results[1]


def test_linear_probe_refuses_one_hot_targets_and_bad_options() -> None:
    import pytest

    x = torch.randn(6, 3)
    one_hot = torch.nn.functional.one_hot(torch.arange(6) % 2, 2)
    probe = LinearProbe(lambda batch: batch, num_classes=2)
    with pytest.raises(ValueError, match="whole class ids of shape \\(6,\\).*argmax"):
        probe.update(x, batch=one_hot, indices=list(range(6)))
    for bad in ({"max_holdout": 0}, {"max_holdout": 2.5}, {"ridge": -1}, {"ridge": "x"}):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}` must be"):
            LinearProbe(lambda batch: batch, num_classes=2, **bad)
    with pytest.raises(ValueError, match="`holdout_dtype` must be a floating"):
        LinearProbe(lambda batch: batch, num_classes=2, holdout_dtype=torch.int8)
