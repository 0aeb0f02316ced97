"""SparseAutoencoder: the model and its math, usable without Lightning.

``encode`` and ``decode`` take and give activations at their own scale; the input
normalisation (``input_scale``), the decoder-norm scaling of TopK pre-activations and
the encoder bias are inside. The training losses work on scaled inputs
(:meth:`SparseAutoencoder.scaled`), as SAELens' do.

Examples:
    >>> sae = SparseAutoencoder(8, 32, "topk", k=4, generator=torch.Generator().manual_seed(0))
    >>> x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    >>> latents = sae.encode(x)
    >>> tuple(latents.shape), int((latents > 0).sum(-1).max()) <= 4, tuple(sae(x).shape)
    ((5, 32), True, (5, 8))
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor, nn

from lightning_iocatch.sae.activations import (
    Across,
    JumpReLU,
    batch_topk,
    batch_topk_mask,
    topk,
)
from lightning_iocatch.sae.sparse_decode import Chosen
from lightning_iocatch.sae.sparse_decode import decode as sparse_decode

__all__ = ["ARCHITECTURES", "Architecture", "SparseAutoencoder"]

Architecture = Literal["topk", "batchtopk", "jumprelu", "relu"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)


class SparseAutoencoder(nn.Module):
    """A sparse autoencoder ``x -> latents -> x_hat`` of ``d_in`` inputs and ``d_sae``
    latents, with SAELens' parameter names and layout (``W_enc`` ``(d_in, d_sae)``,
    ``b_enc``, ``W_dec`` ``(d_sae, d_in)``, ``b_dec``).

    ``pre = (x * input_scale - b_dec) @ W_enc + b_enc``, times each decoder row's norm
    when ``scale_by_decoder_norm``; ``latents = act(pre)``;
    ``x_hat = (latents / |W_dec rows| @ W_dec + b_dec) / input_scale``.

    Architectures (``act``):
        ``"topk"``: each row's ``k`` largest pre-activations (ReLU'd).
        ``"batchtopk"``: in training, the batch's ``k * rows`` largest (``k`` on average);
            a running ``topk_threshold`` learns the value that cut keeps (a float64 average,
            0.99 old + 0.01 the batch's smallest kept value, as SAELens), and outside
            training it is a JumpReLU at that threshold (what the export saves).
        ``"jumprelu"``: ``pre`` where above a learned per-latent ``threshold`` (a float32
            parameter, clamped at 0 before each training step; outside training
            ``relu(pre)`` there, as SAELens' inference SAE, and exported clamped),
            straight-through gradients of ``bandwidth`` to the threshold (DeepMind's,
            SAELens 6's).
        ``"relu"``: ``relu(pre)``, trained with an L1 penalty.

    Args:
        d_in: input width.
        d_sae: number of latents.
        architecture: one of ``ARCHITECTURES``.
        k: latents per row for ``topk`` and ``batchtopk`` (a float for ``batchtopk``).
        scale_by_decoder_norm: multiply pre-activations by each decoder row's norm and
            divide latents by it when decoding (SAELens' ``rescale_acts_by_decoder_norm``;
            by default for ``topk`` and ``batchtopk``).
        decoder_init_norm: each decoder row's norm at the start (SAELens: 0.1), the
            encoder its transpose; ``None``: Kaiming-uniform rows as they are drawn.
        jumprelu_init_threshold: a JumpReLU's threshold at the start.
        bandwidth: the JumpReLU's straight-through kernel width.
        dtype: the parameters' dtype.
        generator: the random generator of the initial weights.
    """

    topk_threshold: Tensor
    input_scale: Tensor

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        architecture: Architecture = "topk",
        k: float | None = None,
        *,
        scale_by_decoder_norm: bool | None = None,
        decoder_init_norm: float | None = 0.1,
        jumprelu_init_threshold: float = 0.01,
        bandwidth: float = 0.05,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        _check_shape(d_in, d_sae, architecture, k)
        self.d_in, self.d_sae, self.architecture = d_in, d_sae, architecture
        self.k = None if k is None else (int(k) if architecture == "topk" else float(k))
        self.scale_by_decoder_norm = (
            architecture in ("topk", "batchtopk")
            if scale_by_decoder_norm is None
            else bool(scale_by_decoder_norm)
        )
        self.bandwidth = float(bandwidth)
        # registered in SAELens' order, so that a gradient norm over the parameters adds
        # them up in the same order
        self.b_dec = nn.Parameter(torch.zeros(d_in, dtype=dtype))
        rows = torch.empty(d_sae, d_in, dtype=dtype)
        nn.init.kaiming_uniform_(rows, generator=generator)
        if decoder_init_norm is not None:
            rows = rows / rows.norm(dim=-1, keepdim=True) * decoder_init_norm
        self.W_dec = nn.Parameter(rows)
        self.W_enc = nn.Parameter(rows.T.clone().contiguous())
        self.b_enc = nn.Parameter(torch.zeros(d_sae, dtype=dtype))
        if architecture == "jumprelu":  # float32 whatever the weights, as SAELens
            start = torch.full((d_sae,), float(jumprelu_init_threshold), dtype=torch.float32)
            self.threshold = nn.Parameter(start)
        if architecture == "batchtopk":  # a float64 running average, as SAELens
            self.register_buffer("topk_threshold", torch.zeros((), dtype=torch.float64))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float64))

    def extra_repr(self) -> str:
        k = "" if self.k is None else f", k={self.k}"
        return f"{self.d_in} -> {self.d_sae}, {self.architecture}{k}"

    # -- inference: activations at their own scale ------------------------------------

    def encode(self, x: Tensor) -> Tensor:
        """The latents of ``x`` ``(..., d_in)``, in the units of the exported SAE
        (:meth:`folded`): those of training divided by ``input_scale`` where
        pre-activations are scaled by the decoder norms (as SAELens' export)."""
        latents = self.activate(self.pre_activations(self.scaled(x)))
        return latents / self._latent_unit() if self.scale_by_decoder_norm else latents

    def decode(self, latents: Tensor) -> Tensor:
        """The reconstruction of ``encode``'s ``latents``, at the inputs' scale."""
        if self.scale_by_decoder_norm:
            latents = latents * self._latent_unit()
        return self.decode_scaled(latents) / self._latent_unit()

    def forward(self, x: Tensor) -> Tensor:
        """``decode(encode(x))``."""
        return self.decode(self.encode(x))

    def _latent_unit(self) -> Tensor:
        return self.input_scale.to(self.W_dec.dtype)

    # -- the parts the training step uses (scaled inputs) -----------------------------

    def scaled(self, x: Tensor) -> Tensor:
        """``x`` in the parameters' dtype, times the input normalisation."""
        return x.to(self.W_enc.dtype) * self.input_scale.to(self.W_enc.dtype)

    def pre_activations(self, scaled: Tensor, b_dec_vector_gradient: bool = False) -> Tensor:
        """``(scaled - b_dec) @ W_enc + b_enc`` (times the decoder norms where they scale).

        ``b_dec_vector_gradient``: the same values, with ``b_dec`` subtracted detached and
        its gradient carried by a term of value zero, ``(b_dec - b_dec.detach()) @ W_enc``:
        ``b_dec``'s gradient through the encoder is then one vector product,
        ``-(W_enc @ grad.sum(0))``, instead of a ``(rows, d_in)`` product summed over the
        rows (the same to float rounding)."""
        if b_dec_vector_gradient:  # the zero term in the parameters' dtype, autocast or not
            with torch.autocast(self.W_enc.device.type, enabled=False):
                zero = (self.b_dec - self.b_dec.detach()) @ self.W_enc
            pre = (scaled - self.b_dec.detach()) @ self.W_enc + self.b_enc - zero
        else:
            pre = (scaled - self.b_dec) @ self.W_enc + self.b_enc
        return pre * self.W_dec.norm(dim=-1) if self.scale_by_decoder_norm else pre

    def activate(self, pre: Tensor, across: Across | None = None) -> Tensor:
        """The latents of pre-activations; ``across``: a BatchTopK batch spanning
        processes (training only)."""
        if self.architecture == "topk":
            return topk(pre, int(self.k))  # type: ignore[arg-type]
        if self.architecture == "batchtopk":
            if self.training:
                return batch_topk(pre, float(self.k), across)  # type: ignore[arg-type]
            return pre.relu() * (pre > self.topk_threshold.to(pre.dtype))
        if self.architecture == "jumprelu":
            threshold = self.threshold.to(pre.dtype)
            if not self.training:  # SAELens' inference: a threshold below 0 passes no negative
                return pre.relu() * (pre > threshold)
            return JumpReLU.apply(pre, threshold, self.bandwidth)
        return pre.relu()

    def choose(self, pre: Tensor, across: Across | None = None) -> Chosen | None:
        """What :meth:`activate` keeps of ``pre``, as its non-zero entries, where the
        architecture fixes them by a selection (TopK; BatchTopK in training), else
        ``None``; the values carry ``pre``'s gradient."""
        if self.architecture == "topk":
            values, indices = torch.topk(pre, k=int(self.k), dim=-1, sorted=False)  # type: ignore[arg-type]
            return Chosen.of_rows(indices, values.relu())
        if self.architecture == "batchtopk" and self.training:
            acts = pre.relu()
            return Chosen.of_mask(acts, batch_topk_mask(acts.detach(), float(self.k), across))  # type: ignore[arg-type]
        return None

    def decode_chosen(self, chosen: Chosen, bias: bool = True) -> Tensor:
        """:meth:`decode_scaled` of latents given by their non-zero entries, computing
        only with those (:mod:`~lightning_iocatch.sae.sparse_decode`): the same to float
        rounding."""
        values = chosen.values
        if self.scale_by_decoder_norm:
            values = values * (1 / self.W_dec.norm(dim=-1))[chosen.latents]
        product = sparse_decode(chosen._replace(values=values), self.W_dec)
        return product + self.b_dec if bias else product

    def decode_scaled(self, latents: Tensor, bias: bool = True) -> Tensor:
        """The reconstruction at the scaled inputs' scale (``bias=False``: without
        ``b_dec``)."""
        if self.scale_by_decoder_norm:
            latents = latents * (1 / self.W_dec.norm(dim=-1))
        product = latents @ self.W_dec
        return product + self.b_dec if bias else product

    # -- export ------------------------------------------------------------------------

    @torch.no_grad()
    def folded(self) -> dict[str, Tensor]:
        """The weights of :meth:`encode` and :meth:`decode` on raw activations with no
        scaling inside, as SAELens' export computes them: ``input_scale`` folded into
        ``W_enc``, ``W_dec`` and ``b_dec``; where pre-activations are scaled by the decoder
        norms, those norms folded into ``W_enc`` and ``b_enc`` and the decoder rows made
        unit norm (the thresholds follow); ``threshold`` per latent for a JumpReLU (a
        BatchTopK's learned one, repeated)."""
        scale = self.input_scale.to(self.W_enc.dtype)
        w_enc, b_enc = self.W_enc * scale, self.b_enc.clone()
        w_dec, b_dec = self.W_dec / scale, self.b_dec / scale
        threshold = None
        if self.architecture == "jumprelu":  # the last step may leave some below 0
            threshold = self.threshold.to(b_enc.dtype).clamp(min=0)
        elif self.architecture == "batchtopk":
            threshold = torch.full_like(b_enc, float(self.topk_threshold))
        if self.scale_by_decoder_norm:
            norms = w_dec.norm(dim=-1).clamp(min=1e-8)
            b_enc, w_enc, w_dec = b_enc * norms, w_enc * norms, w_dec / norms[:, None]
            threshold = None if threshold is None else threshold / scale
        weights = {"W_enc": w_enc, "b_enc": b_enc, "W_dec": w_dec, "b_dec": b_dec}
        return weights if threshold is None else {**weights, "threshold": threshold}


def _check_shape(d_in: int, d_sae: int, architecture: str, k: float | None) -> None:
    for name, value in (("d_in", d_in), ("d_sae", d_sae)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"`architecture` must be one of {ARCHITECTURES}, got {architecture!r}")
    if architecture in ("topk", "batchtopk"):
        if k is None or isinstance(k, bool) or not 0 < float(k) <= d_sae:
            raise ValueError(
                f"`k` must be a number in (0, d_sae={d_sae}] for {architecture!r}, got {k!r}"
            )
        if architecture == "topk" and float(k) != int(k):
            raise ValueError(f"`k` must be a whole number for 'topk', got {k!r}")
    elif k is not None:
        raise ValueError(f"`k` is for 'topk' and 'batchtopk', not {architecture!r}: leave it out")
