"""transfer.py: structure kept, tensors detached, private, moved and cast."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from lightning_iocatch import transfer_to_device

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor
    label: str


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_every_tensor_is_a_detached_private_copy(device: object) -> None:
    leaf = torch.randn(3, requires_grad=True)
    live = leaf * 2
    out = transfer_to_device({"a": [live, (live,)]}, device)  # type: ignore[arg-type]
    for tensor in (out["a"][0], out["a"][1][0]):
        assert not tensor.requires_grad and tensor.grad_fn is None
        assert tensor.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
        assert torch.equal(tensor, live.detach())
    with torch.no_grad():
        live += 1
    assert torch.equal(out["a"][0], (leaf * 2).detach())


def test_structure_and_types_are_kept() -> None:
    t = torch.ones(2)
    ordered = OrderedDict(b=t, a=t)
    pair = Pair(t, [t, 3])
    frozen = Frozen(t, "x")
    hf = BaseModelOutputWithPast(last_hidden_state=t, hidden_states=(t, t))
    out = transfer_to_device([ordered, pair, frozen, hf, None, "s", 1.5, torch.Size([2])], "cpu")
    assert type(out[0]) is OrderedDict and list(out[0]) == ["b", "a"]
    assert type(out[1]) is Pair and out[1].second[1] == 3
    assert type(out[2]) is Frozen and out[2].label == "x" and out[2].hidden is not t
    assert type(out[3]) is BaseModelOutputWithPast
    assert out[3].last_hidden_state is not t and out[3][0] is out[3].last_hidden_state
    assert len(out[3].hidden_states) == 2 and out[3].past_key_values is None
    assert out[4:] == [None, "s", 1.5, torch.Size([2])]


def test_dtype_casts_floating_tensors_only() -> None:
    out = transfer_to_device((torch.ones(2), torch.arange(2)), None, dtype=torch.bfloat16)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.int64


def test_containers_are_new_objects() -> None:
    inner = [torch.ones(1)]
    out = transfer_to_device({"k": inner}, None)
    inner.append(torch.zeros(1))
    assert len(out["k"]) == 1


def test_capture_transfer_on_cpu_is_synchronous_and_private() -> None:
    from lightning_iocatch.capture.snapshots import CaptureTransfer

    live = torch.ones(3)
    copied, events, changed = CaptureTransfer(torch.device("cpu"), torch.float16)({"x": [live]})
    assert events == [] and changed == [] and copied["x"][0].dtype == torch.float16
    live += 1
    assert torch.equal(copied["x"][0], torch.ones(3, dtype=torch.float16))
