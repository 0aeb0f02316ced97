"""Variants: one batch's clean forward and its forward under each set of edits, sharing the
computation that comes before the first edit.

:class:`Variants` runs a forward once clean, recording every module call of the model, then
once per variant in a session with that variant's edits. A variant's edits first take effect
at one module call (its *edit point*: the start of the call for an edit of inputs, its end
for an edit of outputs). Every module call that ended before that point is *replayed*: the
module's forward is swapped, for the variant's forward only, for one that returns the clean
run's output of that call, so the variant computes only what follows the edit point (and
the code between modules, such as adding embeddings, which is cheap). For an edit of block
6 of a 12-block model, a variant costs the last blocks and the head.

Replaying is exact when:

1. every module is in eval mode (a module in training mode may draw random numbers, such
   as dropout: then every variant runs its whole forward, said once in a warning), and no
   module draws random numbers in eval mode (a replayed one would not draw again, which
   shifts the random numbers of what follows);
2. what a module computes depends only on its inputs and its parameters, not on state
   carried between forwards;
3. the modules before the edit point affect the rest only through what they return, not
   by side effects read later. A key/value cache is such a side effect: a variant's cache
   lacks what the replayed layers would have written (said once; ``use_cache=False``
   avoids it); where later layers read keys stored by earlier ones, their arguments differ
   from the clean call's and they run for real;
4. changes in place go through PyTorch (a kernel of your own that writes into a tensor
   without bumping its version counter is not seen). Under inference mode a replayed
   output is a private copy of what the call returned: code that writes into it in place
   to change a module's own state through it (a view of a buffer) does not change that
   state in a variant.

Each replayed call is checked before it is replayed: its tensor arguments must be equal
(``torch.equal``, or the very tensor not modified since) to the clean call's, its other
arguments equal, or, for objects that do not compare by value (a cache object), of the same
type. A call that differs runs for real (once said in a warning), so a variant never sees
a clean output its own inputs did not produce. A call whose output was modified in place
later in the clean forward is never replayed; inference tensors, which have no version
counter, are kept as private copies when the call starts and ends (see
:mod:`~lightning_iocatch.capture.replay`). A variant that modifies a replayed output in
place (an edit function working in place) makes the batch run again with every forward
whole. A global module forward hook makes every variant run whole, and so do
``torch.compile``'d or TorchScript parts (which take no hooks; said once). No hook or
swapped forward outlives the call, also when a forward raises. With ``share=False``
every variant runs its whole forward. Module names are resolved at every call (a module
replaced since is the one edited).

**A forward run elsewhere as the clean one.** :meth:`Variants.record` arms the recording
before a forward that is not the variants' own (a validation step's), and
``variants(forward, recorded=recording)`` replays it as the clean forward: every outermost
call of ``forward()`` is checked as above against the recorded one, except that an argument
that does not compare by value (an object whose class has no ``__eq__``) must be the very
object the recorded call was given (its attributes are not compared: one set between the
two is not seen), so a forward that calls the model otherwise runs for real, and then the
clean forward runs apart with its own recording (said once). The recorded call must also
have run in the context the call of ``forward()`` finds when it starts (``forward()`` may
enter autocast or change a module's mode itself): the same autocast, grad and inference
mode, default dtype, TF32 and reduced-precision matmul flags, attention (SDPA) backend
flags, module hooks and modes, and no open session's edits (else it is not reused, said
once). Not checked: other global state a forward reads (a seed drawn from, a flag of the
model's own, cuDNN's benchmark or deterministic settings, changed between the two).

Other sessions open on the model (or a module of it) are set aside while the forwards run
(:meth:`~lightning_iocatch.capture.coordinator.ForwardCoordinator.apart`): their hooks
neither capture these forwards nor edit them. The forwards run under ``torch.no_grad()``,
in inference mode where the caller is (as Lightning's validation loop): a model that writes
in place into a tensor made in inference mode (its input, a buffer made at its first
forward) runs as it does in the loop. Changes in place are seen by version counters, and
inference tensors, which have none, are kept as private copies (see
:mod:`~lightning_iocatch.capture.replay`).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher, Zero
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).eval()
    >>> variants = Variants(ModelIOCatcher(net, "cpu"), {"zero": [Zero("1")]})
    >>> x = torch.ones(4, 2)
    >>> out = variants(lambda: net(x))
    >>> torch.equal(out["clean"], net(x)), torch.equal(out["zero"], net[2].bias.expand(4, 1))
    (True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.replay import Call, Recorder, Replaying, unchanged

__all__ = ["CLEAN", "Variants"]

CLEAN = "clean"
_KINDS = ("cpu", "cuda")  # the autocast device types a context records


class Variants:
    """Runs a forward clean and under each variant's edits; see the module's docstring.

    Args:
        catcher: the catcher of the model the edits name modules of (its sessions apply
            them; another session must not be open on it).
        variants: name -> the edits of that variant (``"clean"`` is reserved).
        share: replay the clean forward's calls before each variant's edit point.
        say: how a fallback or a note is said, once each (default: ``warnings.warn``; under
            several processes, e.g. Lightning's ``rank_zero_warn``).

    Calling it with a function that runs the forward (``lambda: model(batch)``) returns
    ``{"clean": output, name: output, ...}``. :attr:`fallbacks` says why a forward or a
    call ran whole where it could have been replayed, :attr:`notes` what a variant's output
    lacks (each also said once in a warning).
    """

    def __init__(
        self,
        catcher: ModelIOCatcher,
        variants: Mapping[str, Sequence[Edit]],
        share: bool = True,
        say: Callable[[str], None] | None = None,
    ) -> None:
        if not variants:
            raise ValueError("`variants` is empty: give at least one name -> edits")
        if CLEAN in variants:
            raise ValueError(f"{CLEAN!r} names the unedited forward: call a variant otherwise")
        for name, edits in variants.items():
            if not isinstance(name, str) or not edits:
                raise ValueError(f"variant {name!r} must be named by a string and have edits")
            catcher(edits=edits)  # checks the edits and their names, opens nothing
        catcher._requested = None
        self.catcher = catcher
        self.variants = {name: list(edits) for name, edits in variants.items()}
        self.share = share
        self._say = say
        self.fallbacks: list[str] = []
        self.reused = False
        self.notes: list[str] = []

    def _points(self) -> dict[str, list[tuple[nn.Module, Edit]]]:
        """Each variant's edits with the modules they name now (a module may have been
        replaced since the last forward)."""
        index = self.catcher._modules()
        return {
            name: [(index[edit.module], edit) for edit in edits]
            for name, edits in self.variants.items()
        }

    def record(self) -> Recorder | None:
        """Start recording the model's calls, to reuse a forward run elsewhere (a validation
        step's own) as the clean one: hand it to the next call as ``recorded=`` (which
        removes its hooks; :meth:`Recorder.remove` if it is not handed). ``None`` where the
        variants are not shared."""
        if not self.share or self._why_not_shared() is not None:
            return None
        return Recorder(self.catcher.model, self._points(), self._context)

    def __call__(
        self,
        forward: Callable[[], Any],
        indices: Sequence[int] | None = None,
        recorded: Recorder | None = None,
    ) -> dict[str, Any]:
        """``{"clean": forward(), name: forward() under the variant's edits, ...}``;
        ``indices``: the batch's dataset indices, for edits that need them
        (:meth:`~lightning_iocatch.capture.edits.Edit.for_batch`); ``recorded``: a
        recording (:meth:`record`) of a forward run since, reused as the clean forward
        where ``forward()`` calls the model as it did, in the same context (else said once,
        and the clean forward runs; :attr:`reused` says which)."""
        coordinator = self.catcher.coordinator
        self.reused = False
        if recorded is not None:
            recorded.remove()
        with torch.no_grad(), coordinator.apart(self.catcher.root):
            reason = self._why_not_shared() if self.share else None
            if reason is not None:
                self._fell_back(reason)
            if not self.share or reason is not None:
                return self._whole(forward, indices)
            outputs = self._reuse(recorded, forward) if recorded is not None else None
            if outputs is None or recorded is None:
                recorded = Recorder(self.catcher.model, self._points())
                try:
                    outputs = {CLEAN: forward()}
                finally:
                    recorded.remove()
            recorder, last = recorded, list(self.variants)[-1]
            for name in self.variants:
                replayed = recorder.replayable(name, self._fell_back)
                outputs[name] = self._variant(name, forward, indices, replayed, name == last)
                if not all(unchanged(call.versions) for call in replayed):
                    self._fell_back(
                        f"variant {name!r} modified a replayed output in place (an edit "
                        "function working in place?), which is also the clean forward's: "
                        "this batch ran again with every forward whole (a RunningMean saw it "
                        "twice)"
                    )
                    return self._whole(forward, indices)
            return outputs

    def _reuse(self, recorded: Recorder, forward: Callable[[], Any]) -> dict[str, Any] | None:
        """The clean output replayed from ``recorded``, or ``None`` (said once) where
        ``forward()`` does not call the model as the recorded forward did, in its context
        (compared when each outermost call of ``forward()`` starts: ``forward()`` may enter
        autocast or change a module's mode itself)."""
        why = "it ran no forward of the model"
        if recorded.top:
            said: list[str] = []  # a call that differs: said below as the reason
            calls = recorded.replayable(CLEAN, _quiet)
            edit_at = recorded.edit_at.values()  # calls after every edit point: replayed once
            late = {id(c) for c in calls if all(c.end > at for at in edit_at)}
            replaying = Replaying(
                calls, said.append, self._noted, self._context, recorded.top, late
            )
            with replaying:
                clean = forward()
            if replaying.replayed and not replaying.differed:
                self.reused = True
                return {CLEAN: clean}
            why = said[0] if said else "none of its calls could be replayed"
        self._fell_back(
            f"the recorded forward (a validation step's own) could not be reused as the clean "
            f"forward ({why}): the clean forward runs apart"
        )
        return None

    def _context(self) -> tuple[Any, ...]:
        """What a forward's values depend on besides its arguments and weights, that a
        replay from another forward must share."""
        model, coordinator = self.catcher.model, self.catcher.coordinator
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        edits = [id(s) for s in coordinator.sessions if coordinator.acts(s) and _edits(s)]
        autocast = [(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _KINDS]
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), hooks, edits,
                autocast, len(_global_forward_hooks), len(_global_forward_pre_hooks),
                [m.training for m in model.modules()], _flags())  # fmt: skip

    def _whole(self, forward: Callable[[], Any], indices: Sequence[int] | None) -> dict[str, Any]:
        outputs = {CLEAN: forward()}
        for name in self.variants:
            outputs[name] = self._variant(name, forward, indices, [])
        return outputs

    def _variant(
        self,
        name: str,
        forward: Callable[[], Any],
        indices: Sequence[int] | None,
        replayed: list[Call],
        last: bool = False,
    ) -> Any:
        session = self.catcher(edits=self.variants[name])
        try:
            with Replaying(replayed, self._fell_back, self._noted, last=last), session:
                session.set_batch_indices(indices)
                return forward()
        except (ValueError, TypeError, RuntimeError) as error:  # say which variant failed
            error.add_note(f"in variant {name!r} of Variants({', '.join(self.variants)})")
            raise

    def _why_not_shared(self) -> str | None:
        training: list[str] = []
        scripted: list[str] = []
        compiled = isinstance(self.catcher.root, torch._dynamo.eval_frame.OptimizedModule)
        for name, m in self.catcher.model.named_modules():  # one walk for the three
            training += [name] if m.training else []
            scripted += [name] if _scripted(m) else []
            compiled = compiled or isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
        if training:
            which = f"module {training[0]!r}" if training[0] else "the model"
            return (
                f"{which} is in training mode (it may draw random numbers): every variant "
                "runs its whole forward; call model.eval()"
            )
        if compiled:
            return "the model has torch.compile'd parts: every variant runs its whole forward"
        if scripted or _scripted(self.catcher.root):
            which = f"module {scripted[0]!r}" if scripted and scripted[0] else "the model"
            return (
                f"{which} is TorchScript (torch.jit.script or trace), which takes no hooks to "
                "record its calls: every variant runs its whole forward"
            )
        if _global_forward_hooks:
            return (
                "a global module forward hook is registered (it would run again on a "
                "replayed output): every variant runs its whole forward"
            )
        return None

    def _fell_back(self, reason: str) -> None:
        if reason not in self.fallbacks:
            self.fallbacks.append(reason)
            self._said(f"Variants: {reason}")

    def _noted(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)
            self._said(f"Variants: {note}")

    def _said(self, message: str) -> None:
        if self._say is not None:
            self._say(message)
        else:
            warnings.warn(message, stacklevel=4)


def _scripted(module: nn.Module) -> bool:
    return isinstance(module, torch.jit.ScriptModule)


def _edits(session: object) -> bool:
    return bool(getattr(session, "edits", None))


def _quiet(reason: str) -> None:
    return None


def _flags() -> tuple[Any, ...]:
    """The global numeric flags a forward's values depend on: the default dtype, TF32 and
    reduced-precision matmuls, the attention (SDPA) backends (reads only: no GPU needed)."""
    cuda = torch.backends.cuda
    return (torch.get_default_dtype(), torch.get_float32_matmul_precision(),
            cuda.matmul.allow_tf32, cuda.matmul.allow_fp16_reduced_precision_reduction,
            cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32,
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled())  # fmt: skip
