"""The logits at the peak: when a language model's (tokens × vocabulary) scores are what fills the GPU.

With a 32k-256k vocabulary the output layer's logits, their fp32 copy (Hugging Face upcasts before the loss),
log-softmax's output and their gradients are N × V tensors each, often larger than all the model's activations
together. ``explain`` names them and offers the chunked cross-entropy (``Workload.loss_impl="chunked"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.estimate.predict import Estimate
from memfit.units import format_bytes
from memfit.workload.chunked_cross_entropy import LARGE_VOCAB

LOGITS_SHARE = 0.25
"""Logits-shaped tensors holding at least this share of the allocated peak are worth naming at any vocabulary."""
_STATE = frozenset({"params", "grads", "optimizer_state"})


@dataclass(frozen=True)
class LogitsAtPeak:
    """The (…, vocabulary) tensors among the largest alive at the allocated peak."""

    vocab: int
    count: int
    nbytes: int
    share: float
    """Of ``peak_allocated_bytes``."""
    shape: tuple[int, ...]
    """The largest one's shape."""

    def sentence(self, loss_impl: str, chunkable: bool) -> str:
        """One line for the explanation: what the logits hold, and what to do about it."""
        shape = " × ".join(map(str, self.shape))
        text = (f"The logits dominate the peak: {self.count} tensor{'s' if self.count > 1 else ''} of "
                f"{shape} (vocabulary {self.vocab}) hold {format_bytes(self.nbytes)}, {self.share:.0%} of it.")
        if loss_impl == "chunked":
            return text + (" loss_impl='chunked' is set but they are still built: call the model with labels "
                           "(model(input_ids, labels=...)) so its loss runs chunk by chunk.")
        if chunkable:
            return text + " The chunked cross-entropy (loss_impl='chunked') never builds them; see its fix."
        return text + (" Compute the loss chunk by chunk (memfit.workload.chunked_cross_entropy."
                       "chunked_linear_cross_entropy) or expose the output layer as a Hugging Face causal LM does "
                       "(get_output_embeddings, base_model, labels) so memfit can swap it in.")


def logits_at_peak(est: Estimate, vocab: int | None) -> LogitsAtPeak | None:
    """The logits-shaped tensors alive at the peak, if they matter: a vocabulary of at least ``LARGE_VOCAB``, or
    at least ``LOGITS_SHARE`` of the peak.

    ``vocab`` is the output layer's width when known; otherwise a last axis of ``LARGE_VOCAB`` or more on a
    non-state tensor of two or more axes counts as a vocabulary.
    """
    def is_logits(shape: tuple[int, ...], category: str) -> bool:
        if category in _STATE or len(shape) < 2:
            return False
        return shape[-1] == vocab if vocab is not None else shape[-1] >= LARGE_VOCAB

    found = [t for t in est.largest_tensors if is_logits(t.shape, t.category)]
    if not found:
        return None
    nbytes = sum(t.nbytes for t in found)
    share = nbytes / max(est.peak_allocated_bytes, 1)
    width = found[0].shape[-1]
    if width < LARGE_VOCAB and share < LOGITS_SHARE:
        return None
    biggest = max(found, key=lambda t: math.prod(t.shape))
    return LogitsAtPeak(vocab=width, count=len(found), nbytes=nbytes, share=share, shape=biggest.shape)
