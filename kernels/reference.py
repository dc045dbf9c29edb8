"""Plain-torch twins of the fused LM-head log-prob op, and the input checks they share with it.

Notation: X [T, H] final hidden states, W [V, H] LM head, y [T] sampled tokens, tau the temperature.

    z      = X W^T / tau                     tempered logits, fp32 (fp64 for fp64 inputs)
    lse    = log sum_v exp(z_v)
    logp   = z_y - lse                       log-prob of the sampled token
    H      = lse - sum_v p_v z_v             entropy of p = softmax(z), same tempered logits
    dZ     = (g (1[v=y] - p) - g_H p (z - lse + H)) / tau      upstream grads g on logp, g_H on H
    dX     = dZ W        dW = dZ^T X

The twins here do not import Triton, so they work on any machine.

* `fused_logprob_reference` is the obviously correct version: it materialises every logit and lets
  autograd do the backward. It is the naive path the benchmark compares against (O(T V) memory).
* `chunked_logprob` walks the tokens in chunks so only a [chunk, V] slab of fp32 logits is alive at
  a time, keeps nothing but its inputs for the backward, and recomputes each chunk's logits there
  (8 T H V FLOPs). It is the fallback the package uses when Triton is unavailable or switched off,
  and the CPU path of the demo.
* `chunked_logprob_loss` composes it with the token-level loss so that the fused-loss entry point
  has a twin too.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

# Bytes of fp32 scratch the chunked twin may hold at once (about four [chunk, V] fp32 slabs).
DEFAULT_CHUNK_BYTES = 256 << 20

HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Input checks (shared with the Triton launchers)
# ----------------------------------------------------------------------------------------------


def holds_values(t: torch.Tensor) -> bool:
    """Whether t's values can be read back. A fake tensor (torch._subclasses.fake_tensor, as in
    bench/simulate_node.py) has shapes only, unless it keeps the constant it was built from."""
    return not is_fake(t) or getattr(t, "constant", None) is not None


def check_inputs(hidden, weight, targets, temperature, *, dtypes, coef=None) -> float:
    """Validate the op's arguments; raise ValueError naming the bad one. Returns 1/temperature.

    The label-range check reads min/max back to the host (one device sync per call); it is skipped
    for fake tensors without values, which have no range to check.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be 2-D [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
                         f"got shape {tuple(weight.shape)}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be 1-D [T] with T = hidden.shape[0] = {hidden.shape[0]}, "
                         f"got shape {tuple(targets.shape)}")
    if hidden.dtype not in dtypes:
        raise ValueError(f"hidden dtype must be one of {[str(d) for d in dtypes]}, "
                         f"got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 token ids, got {targets.dtype}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got "
                         f"{hidden.device}, {weight.device}, {targets.device}")
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if hidden.shape[1] == 0 or weight.shape[0] == 0:
        raise ValueError(f"hidden size H and vocabulary V must be > 0, got H={hidden.shape[1]}, "
                         f"V={weight.shape[0]}")
    tau = float(temperature)
    if not (math.isfinite(tau) and tau > 0):
        # tau -> 0 is greedy decoding; its log-probs are not defined,
        # so refuse rather than divide by 0.
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if coef is not None:
        if not isinstance(coef, torch.Tensor):
            raise ValueError(f"coef must be a torch.Tensor, got {type(coef).__name__}")
        if coef.shape != targets.shape or coef.dtype != torch.float32:
            raise ValueError(f"coef must be fp32 [T] = [{targets.shape[0]}], got {coef.dtype} "
                             f"{tuple(coef.shape)}")
        if coef.device != hidden.device or not coef.is_contiguous():
            raise ValueError("coef must be contiguous and on the same device as hidden")
        if coef.requires_grad:
            raise ValueError("coef must not require grad: it is a constant per-token loss weight "
                             "(pass coef.detach())")
    if targets.numel() > 0 and holds_values(targets):
        lo, hi = (int(v) for v in torch.aminmax(targets))
        vocab = weight.shape[0]
        if lo < 0 or hi >= vocab:
            raise ValueError(f"targets must lie in [0, V) = [0, {vocab}), got min {lo}, max {hi}; "
                             "give masked tokens any valid id and a zero upstream gradient")
    return 1.0 / tau


# ----------------------------------------------------------------------------------------------
# The naive reference (materialises all logits; autograd does the backward)
# ----------------------------------------------------------------------------------------------


def fused_logprob_reference(hidden, weight, targets, temperature=1.0):
    """logp, entropy of the sampled tokens from all [T, V] logits at once (fp32; fp64 stays fp64).

    This is the textbook formula and the naive path of the benchmark: `hidden @ weight.T` runs in
    the input dtype, so for bf16 inputs the logits are rounded to bf16 before the upcast.
    """
    logits = hidden @ weight.T                                    # (T, V)
    if logits.dtype != torch.float64:
        logits = logits.float()
    logits = logits / temperature                                 # the sampler's temperature
    logp_all = torch.log_softmax(logits, dim=-1)                  # (T, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)      # (T,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)                # (T,)
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# fp32-accumulating matmuls (shared with the Triton launchers' backward)
# ----------------------------------------------------------------------------------------------

_FP32_OUT_OK: dict = {}


def half_gemm_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Can this device run a 16-bit GEMM that writes/accumulates an fp32 result in place?

    torch >= 2.8 has `out_dtype=torch.float32` on CUDA for fp16/bf16 mm/addmm; CPU builds do not.
    We try it once per (device, dtype) on a tiny problem and check the numbers, so an unsupported
    or misbehaving build falls back to fp32 operands instead of giving wrong gradients.
    """
    key = (device.type, device.index, dtype)
    if key not in _FP32_OUT_OK:
        ok = False
        if device.type == "cuda" and dtype in HALF_DTYPES:
            try:
                g = torch.Generator(device=device).manual_seed(0)
                a = torch.randn(48, 80, device=device, generator=g).to(dtype)
                b = torch.randn(80, 24, device=device, generator=g).to(dtype)
                c = torch.randn(48, 24, device=device, generator=g)
                prod = a.float() @ b.float()
                want = c + prod
                got = torch.mm(a, b, out_dtype=torch.float32)
                torch.addmm(c, a, b, out_dtype=torch.float32, out=c)          # accumulate in place
                ok = (got.dtype == torch.float32 and torch.allclose(got, prod, rtol=1e-4, atol=1e-4)
                      and torch.allclose(c, want, rtol=1e-4, atol=1e-4))
            except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
                ok = False
        _FP32_OUT_OK[key] = ok
    return _FP32_OUT_OK[key]


def operand_dtype(t: torch.Tensor) -> torch.dtype:
    """Dtype to feed GEMMs that must produce fp32 results: t's own unless that needs an upcast."""
    if t.dtype in HALF_DTYPES and not half_gemm_fp32_out(t.device, t.dtype):
        return torch.float32
    return t.dtype


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation and an fp32 (fp64 for fp64) result."""
    if a.dtype in HALF_DTYPES:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


def addmm_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place, out fp32, a/b either fp32 or 16-bit (fp32 accumulation either way)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


# ----------------------------------------------------------------------------------------------
# The chunked twin (bounded memory, own backward)
# ----------------------------------------------------------------------------------------------


def _chunk_tokens(vocab: int, chunk_bytes: int) -> int:
    # About four [chunk, V] fp32 slabs are alive at once (logits, log p, p, dZ).
    return max(1, chunk_bytes // (4 * 4 * vocab))


def _chunk_stats(x_c, w_c, y_c, inv_tau):
    """log softmax of one token chunk's tempered logits, its exp, logp, entropy
    (fp32; fp64 for fp64)."""
    z = mm_fp32(x_c, w_c.T) * inv_tau                               # (C, V)
    # log_softmax subtracts the max before adding log-sum-exp back, so a large common offset in z
    # never passes through a rounded lse (z - logsumexp(z) would leave sum p != 1 by ~1e-4 at 1e3).
    logp_all = torch.log_softmax(z, dim=-1)                         # (C, V)
    p = torch.exp(logp_all)                                         # (C, V)
    # -sum p log p rather than lse - sum p z: no cancellation when all logits share a large offset.
    entropy = -(p * logp_all).sum(-1)                               # (C,)
    logp = logp_all.gather(-1, y_c[:, None]).squeeze(-1)            # (C,)
    return logp_all, p, logp, entropy


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, chunk_bytes):
        T, V = hidden.shape[0], weight.shape[0]
        cdt = operand_dtype(weight)
        w_c = weight.to(cdt)  # upcast once (if at all), not per chunk
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp = torch.empty(T, dtype=stat_dtype, device=hidden.device)
        entropy = torch.empty_like(logp)
        step = _chunk_tokens(V, chunk_bytes)
        for t0 in range(0, T, step):
            x_c = hidden[t0:t0 + step].to(cdt)
            _, _, lp, ent = _chunk_stats(x_c, w_c, targets[t0:t0 + step], inv_tau)
            logp[t0:t0 + step], entropy[t0:t0 + step] = lp, ent
        ctx.save_for_backward(hidden, weight, targets)
        ctx.inv_tau, ctx.chunk_bytes = inv_tau, chunk_bytes
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, V = hidden.shape[0], weight.shape[0]
        cdt = operand_dtype(weight)
        w_c = weight.to(cdt)
        acc_dtype = torch.float64 if cdt == torch.float64 else torch.float32
        dx = torch.empty_like(hidden) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_dw else None
        step = _chunk_tokens(V, ctx.chunk_bytes)
        for t0 in range(0, T, step):
            x_c, y_c = hidden[t0:t0 + step].to(cdt), targets[t0:t0 + step]
            # Recompute this chunk's logits rather than keeping [T, V] alive since the forward.
            logp_all, p, _, ent = _chunk_stats(x_c, w_c, y_c, ctx.inv_tau)
            dz = torch.zeros_like(p)                                 # (C, V) fp32
            if g_logp is not None:
                g = g_logp[t0:t0 + step].to(p.dtype)[:, None]
                dz -= g * p
                dz.scatter_add_(-1, y_c[:, None], g)                 # + g at the sampled column
            if g_ent is not None:
                gh = g_ent[t0:t0 + step].to(p.dtype)[:, None]
                dz -= gh * p * (logp_all + ent[:, None])             # dH/dz = -p (log p + H)
            # Chain rule through z = raw / tau, in fp32; only then round to the GEMM operand dtype.
            dz = (dz * ctx.inv_tau).to(cdt)
            if need_dx:
                # one product per chunk: no accumulation
                dx[t0:t0 + step] = dz @ w_c
            if need_dw:
                addmm_fp32_(dw, dz.T, x_c)                           # fp32 accumulation over chunks
        return dx, (dw.to(weight.dtype) if need_dw else None), None, None, None


def chunked_logprob(hidden, weight, targets, temperature=1.0, *, workspace_bytes=None):
    """Chunked torch twin of `fused_logprob`: same outputs, memory bounded by `workspace_bytes`.

    Logits are computed with fp32 accumulation and fp32 output (16-bit operands are upcast to fp32
    here, since the fp32-output half GEMM is CUDA-only); logp and entropy come back in fp32 (fp64
    for fp64 inputs).
    """
    inv_tau = check_inputs(hidden, weight, targets, temperature,
                           dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    chunk_bytes = int(workspace_bytes or DEFAULT_CHUNK_BYTES)
    return _ChunkedLogprob.apply(hidden, weight, targets, inv_tau, chunk_bytes)


def chunked_logprob_loss(hidden, weight, targets, coef, temperature=1.0, *, workspace_bytes=None):
    """Twin of `fused_logprob_loss`: loss = sum_t coef[t] logp[t], with logp, entropy detached."""
    check_inputs(hidden, weight, targets, temperature,
                 dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64), coef=coef)
    logp, entropy = chunked_logprob(hidden, weight, targets, temperature,
                                    workspace_bytes=workspace_bytes)
    loss = (coef.to(logp.dtype) * logp).sum()
    return loss, logp.detach(), entropy.detach()
