"""probes.py: every statistic against NumPy/scikit-learn, and probes through a real Trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe, _unit_hash
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


def holdout_split(n: int, fraction: float) -> np.ndarray:
    return np.array([_unit_hash(i) < fraction for i in range(n)])


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
    x = torch.randn(100, 9, 3)
    probe.update(x, batch=(x[:, -1, 0] > 0).long(), indices=range(100))
    assert sum(part.shape[0] for part in probe.held_x) == 5 and probe.held_x[0].shape[1] == 3


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
        assert 0 <= float(logged[f"iocatch/{layer}/outputs/probe_acc"]) <= 1
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


@pytest.mark.slow
def test_two_process_probes_equal_one_process(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    values = {}
    for devices in (1, 2):
        out = tmp_path / f"{devices}.json"
        result = subprocess.run(
            [sys.executable, str(root / "tests/scripts/ddp_probes.py"), str(out), str(devices)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        values[devices] = json.loads(out.read_text())
    assert len(values[1]) == 3 * 7 + 3  # 3 layers x (6 stats + probe_acc) + 3 CKA pairs
    assert values[2].keys() == values[1].keys()
    for name, value in values[1].items():
        assert values[2][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
