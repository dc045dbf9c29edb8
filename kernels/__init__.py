"""Vocabulary-sized work of SPELL's policy update: per-token log-probs (and entropy) of the sampled
tokens straight from final hidden states and the LM-head weight, never materialising [T, V] logits.

    from kernels import fused_logprob, fused_logprob_loss
    logp, entropy = fused_logprob(hidden, weight, targets, temperature=1.0)          # fp32 [T] each
    loss, logp, entropy = fused_logprob_loss(hidden, weight, targets, coef, temperature=1.0)

`backend` picks the implementation: "triton" (kernels/logprob.py), "torch" (the chunked twin in
kernels/reference.py), or "auto" = Triton for CUDA tensors when Triton imports, else the twin.
The RL objective itself stays in torch (spell.py); only these vocabulary-sized ops live here.
"""

import os

import torch

# Triton has no CPU backend. Without CUDA we switch on its interpreter so the very same kernel
# source runs on CPU tensors (tests, CI). It must happen before any @triton.jit function is
# defined, i.e. before kernels.logprob is imported; setdefault keeps an explicit choice.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .reference import chunked_logprob, chunked_logprob_loss, fused_logprob_reference  # noqa: E402

try:
    from .logprob import triton_logprob, triton_logprob_loss  # noqa: E402
    TRITON_AVAILABLE = True
except ImportError:            # no triton installed: the chunked torch twin does the work
    triton_logprob = triton_logprob_loss = None
    TRITON_AVAILABLE = False

__all__ = ["fused_logprob", "fused_logprob_loss", "fused_logprob_reference", "chunked_logprob",
           "chunked_logprob_loss", "TRITON_AVAILABLE"]


def _use_triton(backend: str, hidden: torch.Tensor) -> bool:
    if backend == "auto":
        # The interpreter is far too slow for real shapes, so "auto" uses Triton only on a GPU.
        return TRITON_AVAILABLE and isinstance(hidden, torch.Tensor) and hidden.is_cuda
    if backend == "triton":
        if not TRITON_AVAILABLE:
            raise ValueError("backend='triton' but triton is not installed")
        return True
    if backend == "torch":
        return False
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def fused_logprob(hidden, weight, targets, temperature=1.0, *, backend="auto",
                  workspace_bytes=None):
    """logp, entropy (fp32 [T]) of `targets` under softmax(hidden @ weight.T / temperature).

    hidden [T, H], weight [V, H] (same dtype: fp32/fp16/bf16; contiguous; may be a non-leaf view),
    targets [T] int64 in [0, V). Differentiable w.r.t. hidden and weight; upstream gradients on
    both logp and entropy are supported. Masked tokens: any valid id and a zero upstream gradient.
    """
    impl = triton_logprob if _use_triton(backend, hidden) else chunked_logprob
    return impl(hidden, weight, targets, temperature, workspace_bytes=workspace_bytes)


def fused_logprob_loss(hidden, weight, targets, coef, temperature=1.0, *, backend="auto",
                       workspace_bytes=None):
    """(loss, logp, entropy) with loss = sum_t coef[t] * logp[t] (fp32 scalar).

    coef is a constant fp32 [T] (no grad). With Triton the loss's dX and dW are computed during
    the forward in one pass over the vocabulary (6 T H V FLOPs instead of 8); loss.backward() only
    scales them. logp and entropy come back detached, for logging.
    """
    impl = triton_logprob_loss if _use_triton(backend, hidden) else chunked_logprob_loss
    return impl(hidden, weight, targets, coef, temperature, workspace_bytes=workspace_bytes)
