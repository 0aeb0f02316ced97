"""callback.py: IOCaptureCallback driven through a real Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import (
    BatchCaptures,
    CaptureSink,
    IOCaptureCallback,
    SpecError,
    UnknownModuleError,
)
from tests.conftest import hook_count
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer


def test_predict_without_fit_captures_and_records_dataset_indices() -> None:
    torch.manual_seed(0)
    module = TinyModule()
    callback = IOCaptureCallback("outputs[model.layers.1]|inputs[head]")
    predictions = trainer([callback]).predict(module, loader(20, 6))
    assert len(predictions) == 4 and predictions[0].shape == (6, 1)  # the user's predictions
    buf = callback.captures["predict"][0]
    expected = manual_outputs(module, dataset(20).tensors[0])
    assert torch.equal(torch.cat(buf["model.layers.1"]["outputs"]), expected[1])
    head_in = torch.cat([entry["args"][0] for entry in buf["head"]["inputs"]])
    assert torch.equal(head_in, expected[2])
    assert callback.batch_indices["predict"][0] == [
        tuple(range(0, 6)),
        tuple(range(6, 12)),
        tuple(range(12, 18)),
        (18, 19),
    ]
    assert hook_count(module) == 0


def test_predict_early_exit_returns_captures_and_skips_the_rest() -> None:
    module = TinyModule()
    callback = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    batches = trainer([callback]).predict(module, loader(20, 5))
    assert len(batches) == 4
    expected = manual_outputs(module, dataset(20).tensors[0])[0]
    assert torch.equal(torch.cat([b["model.layers.0"]["outputs"][0] for b in batches]), expected)
    assert module.model.tail.calls == 0  # layers 1.. and the head never ran
    assert "predict_step" not in vars(module)  # the original step is back
    assert hook_count(module) == 0


def test_validate_only_with_two_dataloaders_keeps_metrics_unchanged() -> None:
    module = TinyModule()
    plain = trainer([]).validate(
        module, [loader(12, 4, seed=1), loader(8, 4, seed=2)], verbose=False
    )
    losses = list(module.val_losses)
    module.val_losses.clear()
    callback = IOCaptureCallback("outputs[model.layers.2]", early_exit=True)  # predict only
    results = trainer([callback]).validate(
        module, [loader(12, 4, seed=1), loader(8, 4, seed=2)], verbose=False
    )
    assert results == plain and module.val_losses == losses
    assert callback.batch_indices["validate"][1] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for dataloader_idx, (n, seed) in enumerate([(12, 1), (8, 2)]):
        captured = torch.cat(
            callback.captures["validate"][dataloader_idx]["model.layers.2"]["outputs"]
        )
        assert torch.equal(captured, manual_outputs(module, dataset(n, seed).tensors[0])[2])
    assert hook_count(module) == 0


def test_fit_captures_validation_only_never_training_nor_sanity_check() -> None:
    module = TinyModule()
    callback = IOCaptureCallback("outputs[model.layers.0]")
    trainer([callback], max_epochs=2, num_sanity_val_steps=2).fit(
        module, loader(24, 6), loader(10, 5, seed=3)
    )
    assert module.hooks_seen_in_training == [0] * 8
    buf = callback.captures["validate"][0]
    assert len(buf["model.layers.0"]["outputs"]) == 2  # the last epoch's 2 batches only
    expected = manual_outputs(module, dataset(10, 3).tensors[0])[0]
    assert torch.equal(torch.cat(buf["model.layers.0"]["outputs"]), expected)
    assert hook_count(module) == 0


def test_sanity_check_is_captured_when_asked() -> None:
    seen: list[tuple[str, int]] = []

    class Recorder(CaptureSink):
        def on_batch(self, batch: BatchCaptures) -> None:
            seen.append((batch.stage, batch.batch_idx))

    callback = IOCaptureCallback(
        "outputs[model.layers.0]", sinks=[Recorder()], capture_sanity_check=True
    )
    trainer([callback], max_epochs=1, num_sanity_val_steps=1).fit(
        TinyModule(), loader(6, 6), loader(10, 5)
    )
    assert seen == [("validate", 0), ("validate", 0), ("validate", 1)]


def test_test_stage_and_stage_selection() -> None:
    module = TinyModule()
    callback = IOCaptureCallback("outputs[model.layers.0]", stages=["test"])
    run = trainer([callback])
    run.validate(module, loader(10, 5), verbose=False)
    run.test(module, loader(10, 5), verbose=False)
    assert set(callback.captures) == {"test"}
    assert len(callback.captures["test"][0]["model.layers.0"]["outputs"]) == 2


def test_two_callbacks_with_different_specs_at_once() -> None:
    module = TinyModule()
    first = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    second = IOCaptureCallback("outputs[model.layers.*]", stages=["predict"])
    assert first.state_key != second.state_key
    batches = trainer([first, second]).predict(module, loader(10, 5))
    assert list(batches[0]) == ["model.layers.0"]
    assert list(second.captures["predict"][0]) == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
    ]
    # the second has no early exit, so the forward ran whole and it saw every layer
    assert len(second.captures["predict"][0]["model.layers.2"]["outputs"]) == 2
    assert len(first.captures["predict"][0]["model.layers.0"]["outputs"]) == 2


def test_an_exception_mid_loop_leaves_no_hook_and_restores_predict_step() -> None:
    module = TinyModule(fail_at_batch=2)
    callback = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    errors: list[str] = []

    class Recorder(CaptureSink):
        def on_exception(self, stage: str, exception: BaseException) -> None:
            errors.append(f"{stage}: {exception}")

    callback._sinks.append(Recorder())
    with pytest.raises(RuntimeError, match="boom in predict_step"):
        trainer([callback]).predict(module, loader(20, 5))
    assert hook_count(module) == 0 and "predict_step" not in vars(module)
    assert errors == ["predict: boom in predict_step"]
    module.fail_at_batch = None
    assert len(trainer([callback]).predict(module, loader(20, 5))) == 4


def test_unknown_names_fail_before_any_batch_runs() -> None:
    module = TinyModule()
    with pytest.raises(UnknownModuleError, match="did you mean 'model.layers.1'"):
        trainer([IOCaptureCallback("outputs[model.layer.1]")]).predict(module, loader(10, 5))
    with pytest.raises(UnknownModuleError, match="did you mean"):
        trainer([IOCaptureCallback("outputs[model.layer.1]")]).fit(
            module, loader(10, 5), loader(10, 5)
        )
    assert module.model.tail.calls == 0 and hook_count(module) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(spec="output[a]"), SpecError, "did you mean 'outputs'"),
        (dict(spec="inputs[]"), SpecError, "selects no module"),
        (dict(spec="outputs[a]", stages=["train"]), ValueError, "`stages` must be.*'predict'"),
        (dict(spec="outputs[a]", stages=[]), ValueError, "`stages` must be"),
        (
            dict(spec="outputs[a]", stages=["validate"], early_exit=True),
            ValueError,
            "`early_exit=True` applies to the predict loop only",
        ),
        (dict(spec="outputs[a]", dtype="int8"), ValueError, "`dtype` must be a floating-point"),
        (dict(spec="outputs[a]", sinks=[object()]), TypeError, "CaptureSink"),
        (dict(spec=["outputs[a]"]), TypeError, "`spec` must be a spec string"),
        (dict(spec="outputs[a]", stages=7), TypeError, "`stages` must be a list"),
        (dict(spec="outputs[a]", early_exit="yes"), TypeError, "`early_exit` must be True or"),
        (dict(spec="outputs[a]", keep_in_memory=1), TypeError, "`keep_in_memory` must be True"),
        (dict(spec="outputs[a]", capture_sanity_check=None), TypeError, "`capture_sanity_check`"),
        (dict(spec="outputs[a]", device="gpu0"), ValueError, "`device` 'gpu0' is not a device"),
        (dict(spec="outputs[a]", device=0), TypeError, "`device` must be a torch.device"),
        (dict(spec="outputs[a]", dtype=3), ValueError, "`dtype` must be a floating-point"),
        (dict(spec="outputs[a]", pinned_memory_bytes=-1), ValueError, "`pinned_memory_bytes`"),
        (dict(spec="outputs[a]", pinned_memory_bytes=1.5), TypeError, "`pinned_memory_bytes`"),
        (dict(spec="outputs[a]", writer=3), TypeError, "`writer` must be a FeatureWriter"),
        (dict(spec="outputs[a]", probes="stats"), TypeError, "`probes` must be a list"),
        (dict(spec="outputs[a]", sinks=object()), TypeError, "`sinks` must be a list"),
    ],
)
def test_bad_arguments_are_refused_in_init(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        IOCaptureCallback(**kwargs)


def test_sinks_receive_batches_and_memory_is_off_by_default_then() -> None:
    events: list[object] = []

    class Recorder(CaptureSink):
        def on_loop_start(self, trainer: object, pl_module: object, stage: str) -> None:
            events.append(("start", stage))

        def on_batch(self, batch: BatchCaptures) -> None:
            shape = batch.captures["model.layers.0"]["outputs"][0].shape
            events.append(
                (batch.stage, batch.batch_idx, batch.dataloader_idx, batch.indices, shape)
            )

        def on_loop_end(self, trainer: object, pl_module: object, stage: str) -> None:
            events.append(("end", stage))

    callback = IOCaptureCallback("outputs[model.layers.0]", sinks=[Recorder()], dtype="float16")
    trainer([callback]).predict(TinyModule(), loader(8, 5))
    assert events == [
        ("start", "predict"),
        ("predict", 0, 0, (0, 1, 2, 3, 4), torch.Size([5, 8])),
        ("predict", 1, 0, (5, 6, 7), torch.Size([3, 8])),
        ("end", "predict"),
    ]
    assert callback.captures == {}
    kept = IOCaptureCallback("outputs[model.layers.0]", sinks=[Recorder()], keep_in_memory=True)
    trainer([kept]).predict(TinyModule(), loader(8, 5))
    assert len(kept.captures["predict"][0]["model.layers.0"]["outputs"]) == 2


def test_dtype_and_device_options() -> None:
    callback = IOCaptureCallback("outputs[model.layers.0]", dtype="bfloat16", device=None)
    trainer([callback]).predict(TinyModule(), loader(8, 4))
    captured = callback.captures["predict"][0]["model.layers.0"]["outputs"][0]
    assert captured.dtype == torch.bfloat16 and not captured.requires_grad


def test_compiled_submodule_names_with_and_without_orig_mod() -> None:
    torch.manual_seed(0)
    module = TinyModule()
    eager_net = module.model
    module.model = torch.compile(eager_net, backend="eager")  # type: ignore[assignment]
    expected = manual_outputs(TinyModule(eager_net), dataset(10).tensors[0])[1]
    for spec in ["outputs[model.layers.1]", "outputs[model._orig_mod.layers.1]"]:
        callback = IOCaptureCallback(spec, early_exit=True)
        batches = trainer([callback]).predict(module, loader(10, 5))
        assert torch.equal(
            torch.cat([b["model.layers.1"]["outputs"][0] for b in batches]), expected
        )
    assert hook_count(module) == 0


class GPT2Module(TinyModule):
    def __init__(self) -> None:
        config = GPT2Config(
            n_layer=3, n_embd=32, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0
        )
        super().__init__(model=GPT2Model(config))

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.model(input_ids=batch[0]).last_hidden_state


def test_hugging_face_model_inside_a_lightning_module() -> None:
    torch.manual_seed(0)
    module = GPT2Module().eval()
    ids = torch.randint(0, 64, (6, 10))
    callback = IOCaptureCallback("outputs[model.h.1]", early_exit=True)
    batches = trainer([callback]).predict(
        module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=3)
    )
    reference = module.model(ids, output_hidden_states=True).hidden_states[2]
    assert torch.equal(torch.cat([b["model.h.1"]["outputs"][0] for b in batches]), reference)


def test_catcher_is_rebuilt_for_a_new_module() -> None:
    callback = IOCaptureCallback("outputs[model.layers.0]")
    run = trainer([callback])
    first, second = TinyModule(), TinyModule(nn.Sequential())
    run.predict(first, loader(4, 4))
    with pytest.raises(UnknownModuleError):
        trainer([callback]).predict(second, loader(4, 4))
    assert hook_count(first) == 0 and hook_count(second) == 0


def test_validation_indices_are_unknown_for_a_shuffling_sampler() -> None:
    callback = IOCaptureCallback("outputs[model.layers.0]")
    shuffled = torch.utils.data.DataLoader(dataset(8), batch_size=4, shuffle=True)
    trainer([callback]).validate(TinyModule(), shuffled, verbose=False)
    assert callback.batch_indices["validate"][0] == [None, None]
