"""Fused LM-head log-prob and entropy of the sampled tokens, in Triton, without [T, V] logits.

Notation (per token t; X [T, H] final hidden states, W [V, H] LM head, y [T] sampled ids):

    z_v   = <X_t, W_v> / tau                  tempered logits, fp32 GEMM accumulator times 1/tau
    lse   = log sum_v exp(z_v)
    logp  = z_y - lse                         log-prob of the sampled token
    H     = lse - E_p[z] = -sum_v p_v log p_v entropy of p = softmax(z) (the same tempered logits)

Backward, given upstream per-token gradients g = dL/dlogp and g_H = dL/dH:

    dlogp/dz_v = 1[v=y] - p_v         dH/dz_v = -p_v (log p_v + H) = -p_v (z_v - E_p[z])
    dZ         = (g (1[v=y] - p) - g_H p (z - E_p[z])) / tau          (1/tau: z = raw logits / tau)
    dX = dZ W                         dW = dZ^T X

Forward (`_logprob_fwd_kernel`, then `_logprob_merge_kernel`). One program owns BM tokens and a
contiguous split of SPLIT vocabulary columns. It walks the split one BN-wide tile at a time, each
tile a BM x BN x H GEMM into an fp32 accumulator, and folds it into running per-token statistics
(online log-sum-exp): m = running max, s = sum exp(z - m), r = sum exp(z - m) (z - m) and z_y.
r is kept relative to the running max so that a large common offset in the logits (say +1000)
cancels before it can swamp the entropy. Columns past V are -inf before the max and are excluded
from the sums with `where` (never a multiply by a 0/1 mask, which turns -inf into NaN). The
per-split partials [n_splits, T] are merged in a fixed order by a second small kernel:
M = max m_i, S = sum s_i e^{m_i - M}, R = sum e^{m_i - M} (r_i + (m_i - M) s_i),
lse = M + log S, logp = (z_y - M) - log S, H = log S - R / S. lse is kept as the pair (M, log S):
rounding their fp32 sum at |z| ~ 1e3 would shift every log p by ~1e-4 and leave sum_v p != 1 in the
backward, an error the large LM-head columns then amplify. No atomics, so the result is a pure
function of the inputs and the tile table: the no-grad pass and the training pass give bitwise the
same logp.

Backward (`_logprob_bwd_kernel` + torch GEMMs). The forward keeps only (M, log S) and H (12 bytes
per token). The backward walks [token chunk x vocab slice] blocks sized so that one block of dZ fits
in a workspace bounded in bytes; the kernel recomputes each BM x BN logit tile, forms dZ in fp32 and
rounds it once to the GEMM operand dtype; then torch (cuBLAS) does dX += dZ W_slice (accumulated in
fp32 across slices) and dW_slice = dZ^T X. When one token chunk covers all T (the usual case for
T < ~100k at the default 1 GiB workspace) every dW row slice is written exactly once, with no
[V, H] fp32 buffer. Total work 8 T H V FLOPs (2 forward, 2 recompute, 4 for dX and dW).

Fused loss path (`triton_logprob_loss`). When every token's loss weight coef_t is known before the
forward, as in on-policy GRPO (loss = sum_t coef_t logp_t), the gradient needs no second pass: per
token chunk the forward kernel also stores the fp32 logits in the workspace, the merge gives
(M, log S), the backward kernel turns the stored logits into dZ (g = coef), and the two GEMMs give
dX and dW right away. 6 T H V FLOPs; the backward only scales the stored dX, dW by the
incoming scalar. Over several token chunks dW is summed in its own dtype (one rounding a chunk,
as Liger-Kernel does): an fp32 sum would hold V H 4 bytes more (2 GiB at Qwen2.5-7B's head) for
one ulp of bf16 (measured: 3.9e-3 of dW's largest entry on an H200, 15 chunks).

Limits: X and W fp32, fp16 or bf16 (same dtype), contiguous; y int64 in [0, V); tau > 0. fp32
inputs use IEEE fp32 dots unless torch's float32 matmul precision allows TF32. All offsets are
int64, so T V and V H beyond 2^31 are fine. Outputs logp and H are fp32. Deterministic given the
tile table.

CPU: with TRITON_INTERPRET=1 (set by kernels/__init__.py when there is no CUDA) the same source
runs on CPU tensors, one program at a time in numpy. The interpreter multiplies bf16 tiles as raw
bits, so there every loaded tile is upcast to fp32 before tl.dot (constexpr UPCAST); on a GPU the
dot takes bf16/fp16 tiles with an fp32 accumulator.

Credits, ideas only (the code here is our own): streaming the vocabulary through an online
log-sum-exp next to the LM-head GEMM so [T, V] logits never exist, and a backward that recomputes
logit tiles, are the core of Apple's Cut Cross-Entropy (Wijmans et al., 2025). Computing the
gradient inside the forward from a bounded chunk of logits when the loss is the only consumer, and
forming the target-column gradient 1 - p_y in fp32 before any rounding, come from LinkedIn's
Liger-Kernel fused linear cross-entropy. The split-vocabulary partials merged in a fixed order
(deterministic, no locks) and the dZ-workspace-then-cuBLAS backward follow verl's fused
linear-cross-entropy kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import addmm_fp32_, check_inputs, fused_logprob_reference, operand_dtype

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Bytes the backward (and the loss path's forward) may use for logits/dZ scratch at once. 384 MiB:
# on an H200 at the Qwen2.5-7B head (T 16384, bf16) the loss path then holds 1.45 GiB beside its
# inputs (4.14 at 1 GiB with dW summed in fp32) and runs in 113.8 ms (112.2 at 1 GiB); at 256 MiB
# its token chunks halve to 256 and it slows to 146 ms (bench/RESULTS.md, 2026-11-28).
DEFAULT_WORKSPACE_BYTES = 3 << 27

# No fused multiply-add contraction in the kernels (Triton's enable_fp_fusion). With it the GPU
# compiler may turn z - m = acc / tau - m into one fma(acc, 1/tau, -m), skipping z's rounding in
# some expressions and not in others (the max, the target logit, the recomputed tile): at tau != 1
# and |z| ~ 1e3 log p and sum_v p_v then move by z's half ulp (6e-5), and a large LM-head column
# multiplies that in dX (issue #43: fp32 dX 4.3e-2 off at tau 0.7 on an H200). Each product rounded
# once, as written, every pass sees the same z. The GEMM's own accumulation (tl.dot) is unaffected.
FP_FUSION = False


# ----------------------------------------------------------------------------------------------
# Tile table (fixed; never autotuned, so the no-grad and training passes use the same tiles)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    bm: int           # tokens per program
    bn: int           # vocabulary columns per tile
    bk: int           # hidden-size step of the GEMM
    split: int        # vocabulary columns per forward program (a multiple of bn)
    group_m: int      # token tiles that share a vocabulary split in flight (L2 reuse of W)
    num_warps: int
    num_stages: int


def pick_tiles(dtype: torch.dtype, num_tokens: int, hidden_size: int, vocab_size: int = 0) -> Tiles:
    """Tile sizes from the dtype and shape; untuned starting points on GPU (see bench/)."""
    if INTERPRET:
        # The interpreter pays ~2-3 ms per inner-loop step per program whatever the block size, so
        # blocks grow with the vocabulary: a real tokenizer's 49K columns in 2048-wide tiles run 20x
        # faster than in 128-wide ones, while the tests' small vocabularies still span several tiles
        # and splits (V = 1000: 128-wide tiles, 512-wide splits).
        big = vocab_size >= 16384
        bm = min(256 if big else 64, max(16, triton.next_power_of_2(num_tokens)))
        bk = min(128 if big else 64, max(16, triton.next_power_of_2(hidden_size)))
        bn = 2048 if big else 128
        return Tiles(bm=bm, bn=bn, bk=bk, split=4 * bn, group_m=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return Tiles(bm=64, bn=128, bk=32, split=2048, group_m=8, num_warps=8, num_stages=3)
    # measured on an H200 (bench/gpu_check.py part e, 2026-11-28; bench/RESULTS.md): 128 x 256
    # tiles in 4 stages against 128 x 128 in 3, the forward statistics 590-634 TFLOP/s against
    # 481-493, the two-pass training op 606 against 553, the fused loss 478 against 453. 5
    # stages, or a 128-wide K step, need more shared memory than a multiprocessor has.
    return Tiles(bm=128, bn=256, bk=64, split=2048, group_m=8, num_warps=8, num_stages=4)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 tiles: IEEE unless the user allowed TF32 for fp32 matmuls in torch. Others: unused."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (token tile, vocab tile) so GROUP_M token tiles run side by side
    on the same vocabulary columns: those W tiles are then read from L2, not HBM, by the group."""
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    return pid_m, pid_n


@triton.jit
def _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_tau,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """z[BM, BN] = X[rows] W[cols]^T * inv_tau in fp32
    (int64 rows/cols; padded rows/cols give 0)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < H
        x = tl.load(x_ptr + rows[:, None] * H + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # W tile loaded already transposed, [BK, BN]: W is [V, H] row-major, so k is contiguous.
        w = tl.load(w_ptr + cols[None, :] * H + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc * inv_tau


@triton.jit
def _logprob_fwd_kernel(
    x_ptr, w_ptr, y_ptr,                  # X [T, H], W [V, H], y [T] int64
    m_ptr, s_ptr, r_ptr, zy_ptr,          # partials, each [n_splits, T] fp32
    z_ptr,                                # STORE_Z only: tempered logits [T, V] fp32
    T, V, H, inv_tau,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, STORE_Z: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    n_splits = tl.cdiv(V, SPLIT)
    pid_m, pid_s = _grouped_tile(tl.program_id(0), tl.cdiv(T, BM), n_splits, GROUP_M)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)                  # int64: T*V may exceed 2^31
    row_ok = rows < T
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)

    m = tl.full((BM,), float("-inf"), dtype=tl.float32)                # running max
    s = tl.zeros((BM,), dtype=tl.float32)                              # sum exp(z - m)
    r = tl.zeros((BM,), dtype=tl.float32)                              # sum exp(z - m) (z - m)
    zy = tl.zeros((BM,), dtype=tl.float32)                             # target logit
    v_begin = pid_s.to(tl.int64) * SPLIT
    v_end = tl.minimum(v_begin + SPLIT, V)
    for v0 in range(v_begin, v_end, BN):
        cols = v0 + tl.arange(0, BN)
        col_ok = cols < V
        z = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_tau,
                        BM, BN, BK, UPCAST, PRECISION)
        if STORE_Z:
            tl.store(z_ptr + rows[:, None] * V + cols[None, :], z,
                     mask=row_ok[:, None] & col_ok[None, :])
        z = tl.where(col_ok[None, :], z, float("-inf"))  # vocab tail: -inf before the max
        zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))         # finite: every tile has a real column
        alpha = tl.exp(m - m_new)                        # 0 on the first tile (m = -inf)
        shift = tl.where(m == float("-inf"), 0.0, m - m_new)
        d = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.exp(z - m_new[:, None])                   # exactly 0 on the tail
        r = alpha * (r + shift * s) + tl.sum(e * d, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new

    out = pid_s.to(tl.int64) * T + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(r_ptr + out, r, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)


@triton.jit
def _logprob_merge_kernel(
    m_ptr, s_ptr, r_ptr, zy_ptr,          # partials [n_splits, T]
    logp_ptr, ent_ptr, mx_ptr, logs_ptr,  # outputs [T] fp32: logp, H, and lse = M + log S
                                          # in two parts
    T, n_splits, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    r = tl.zeros((BLOCK,), dtype=tl.float32)
    zy = tl.zeros((BLOCK,), dtype=tl.float32)
    at = rows                                                          # int64 offset of split i
    for i in range(0, n_splits):                                       # fixed order: deterministic
        m_i = tl.load(m_ptr + at, mask=ok, other=0.0)
        s_i = tl.load(s_ptr + at, mask=ok, other=1.0)
        r_i = tl.load(r_ptr + at, mask=ok, other=0.0)
        zy += tl.load(zy_ptr + at, mask=ok, other=0.0)                 # only one split holds y
        m_new = tl.maximum(m, m_i)
        a = tl.exp(m - m_new)
        b = tl.exp(m_i - m_new)
        shift = tl.where(m == float("-inf"), 0.0, m - m_new)
        r = a * (r + shift * s) + b * (r_i + (m_i - m_new) * s_i)
        s = a * s + b * s_i
        m = m_new
        at += T
    log_s = tl.log(s)
    # lse is kept as (M, log S) and never summed: at |z| ~ 1e3 the fp32 sum M + log S would be
    # rounded by ~6e-5, which shifts every log p and leaves sum_v p != 1 in the backward.
    tl.store(mx_ptr + rows, m, mask=ok)
    tl.store(logs_ptr + rows, log_s, mask=ok)
    tl.store(logp_ptr + rows, (zy - m) - log_s, mask=ok)
    tl.store(ent_ptr + rows, log_s - r / s, mask=ok)


@triton.jit
def _logprob_bwd_kernel(
    x_ptr, w_ptr, z_ptr,                  # X [Tc, H] and W slice [Vs, H]; or stored logits (LOAD_Z)
    y_ptr, mx_ptr, logs_ptr, ent_ptr, g_ptr, gh_ptr,   # per token [Tc]
    dz_ptr,                               # out: dZ [Tc, Vs] (row stride stride_dz), operand dtype
    T, Vs, v_offset, H, inv_tau, stride_z, stride_dz,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    LOAD_Z: tl.constexpr, HAS_G: tl.constexpr, HAS_GH: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(T, BM), tl.cdiv(Vs, BN), GROUP_M)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n.to(tl.int64) * BN + tl.arange(0, BN)                  # local to the slice
    row_ok = rows < T
    col_ok = cols < Vs
    if LOAD_Z:
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    else:
        z = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_tau,
                        BM, BN, BK, UPCAST, PRECISION)
    mx = tl.load(mx_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(logs_ptr + rows, mask=row_ok, other=0.0)
    # Padding lanes (rows past T, columns past the slice) get p = 0, and never exp of a big number.
    ok = row_ok[:, None] & col_ok[None, :]
    log_p = tl.where(ok, (z - mx[:, None]) - log_s[:, None], 0.0)
    p = tl.where(ok, tl.exp(log_p), 0.0)
    dz = tl.zeros((BM, BN), dtype=tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        is_y = (cols[None, :] + v_offset) == y[:, None]
        # 1[v=y] - p in fp32: rounding p_y first would cancel catastrophically when p_y ~ 1.
        dz += g[:, None] * (tl.where(is_y, 1.0, 0.0) - p)
    if HAS_GH:
        gh = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        dz -= gh[:, None] * p * (log_p + ent[:, None])
    dz = dz * inv_tau
    tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :],
             dz.to(dz_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------


def _check_device(hidden: torch.Tensor) -> None:
    if not hidden.is_cuda and not INTERPRET:
        raise ValueError("hidden is on the CPU but Triton has no CPU backend: use CUDA tensors, or "
                         "set TRITON_INTERPRET=1 before importing kernels, or use backend='torch'")


def _forward_stats(x, w, y, inv_tau, tiles, z_out=None):
    """logp, entropy (fp32 [T]) and norm = (M, log S) (fp32 [2, T], lse = M + log S) of the tokens
    in x; also writes the tempered logits into z_out if given."""
    T, H = x.shape
    V = w.shape[0]
    n_splits = triton.cdiv(V, tiles.split)
    partials = torch.empty(4, n_splits, T, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, tiles.bm) * n_splits,)
    _logprob_fwd_kernel[grid](
        x, w, y, partials[0], partials[1], partials[2], partials[3],
        z_out if z_out is not None else partials, T, V, H, inv_tau,
        SPLIT=tiles.split, BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, GROUP_M=tiles.group_m,
        STORE_Z=z_out is not None, UPCAST=INTERPRET, PRECISION=_dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)
    logp = torch.empty(T, dtype=torch.float32, device=x.device)
    ent = torch.empty_like(logp)
    norm = torch.empty(2, T, dtype=torch.float32, device=x.device)
    block = 128
    _logprob_merge_kernel[(triton.cdiv(T, block),)](
        partials[0], partials[1], partials[2], partials[3], logp, ent, norm[0], norm[1],
        T, n_splits, BLOCK=block, num_warps=4, enable_fp_fusion=FP_FUSION)
    return logp, ent, norm


def _launch_dz(dz, x, w, z, y, norm, ent, g, gh, v_offset, inv_tau, tiles):
    """Fill dz [Tc, Vs] (a view with unit column stride)
    from recomputed (z None) or stored logits."""
    Tc, Vs = dz.shape
    grid = (triton.cdiv(Tc, tiles.bm) * triton.cdiv(Vs, tiles.bn),)
    _logprob_bwd_kernel[grid](
        x, w, z if z is not None else dz, y, norm[0], norm[1], ent,
        g if g is not None else ent, gh if gh is not None else ent, dz,
        Tc, Vs, v_offset, x.shape[1], inv_tau, z.stride(0) if z is not None else 0, dz.stride(0),
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, GROUP_M=tiles.group_m,
        LOAD_Z=z is not None, HAS_G=g is not None, HAS_GH=gh is not None,
        UPCAST=INTERPRET, PRECISION=_dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b (cuBLAS accumulates in fp32 either way); no temporary when dtypes agree."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def _round_down(n: int, multiple: int) -> int:
    return max(multiple, n // multiple * multiple)


def backward_blocks(T: int, V: int, elem_bytes: int, workspace_bytes: int, tiles: Tiles):
    """(token chunk, vocab slice) of the backward's dZ block: as wide a vocab slice as fits with
    all T tokens (so each dW slice is written once), else narrow slices and token chunks.
    Never smaller than one BM x BN tile, so a tiny budget can be exceeded by that much."""
    cols = workspace_bytes // max(1, T * elem_bytes)
    if cols >= V:
        return T, V
    if cols >= tiles.bn:
        return T, _round_down(cols, tiles.bn)
    chunk = workspace_bytes // (tiles.bn * elem_bytes)
    return min(T, _round_down(chunk, tiles.bm)), tiles.bn


def _gemm_operands(x, w):
    """(dZ and GEMM operand dtype, X and W in it): fp32 on CPU for 16-bit inputs, whose GEMMs
    cannot accumulate in fp32 there; the inputs themselves otherwise."""
    cdt = operand_dtype(x)
    return (cdt, x.to(cdt), w.to(cdt)) if cdt != x.dtype else (cdt, x, w)


def _grad_outputs(x, w, need_dx, need_dw, one_chunk, dw_fp32=True):
    """dX, dW, dW32. When several token chunks add into each dW row, the sums go to an fp32 buffer
    dW32 (V H 4 bytes) and dW is made from it at the end; with dw_fp32=False they add into dW
    itself, rounded to its dtype after each chunk (as Liger-Kernel does: no V H 4-byte buffer)."""
    dx = torch.empty_like(x) if need_dx else None
    dw = dw32 = None
    if need_dw and one_chunk:
        dw = torch.empty_like(w)
    elif need_dw and dw_fp32:
        dw32 = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    elif need_dw:
        dw = torch.zeros_like(w)
    return dx, dw, dw32


def _backward(x, w, y, norm, ent, g, gh, inv_tau, need_dx, need_dw, workspace_bytes, tiles):
    """dX, dW of sum_t g_t logp_t + gh_t H_t, recomputing logits block by block (8THV in all)."""
    T, H = x.shape
    V = w.shape[0]
    cdt, x_op, w_op = _gemm_operands(x, w)
    tc, vs = backward_blocks(T, V, torch.finfo(cdt).bits // 8, workspace_bytes, tiles)
    workspace = torch.empty(tc * vs, dtype=cdt, device=x.device)
    dx, dw, dw32 = _grad_outputs(x, w, need_dx, need_dw, one_chunk=tc >= T)
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        x_c, x_c_op = x[t0:t1], x_op[t0:t1]
        dx32 = None
        if need_dx and vs < V:                     # dX sums over vocab slices: fp32 accumulator
            dx32 = torch.zeros(t1 - t0, H, dtype=torch.float32, device=x.device)
        for v0 in range(0, V, vs):
            v1 = min(V, v0 + vs)
            dz = workspace[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0)
            _launch_dz(dz, x_c, w[v0:v1], None, y[t0:t1], norm[:, t0:t1], ent[t0:t1],
                       None if g is None else g[t0:t1], None if gh is None else gh[t0:t1],
                       v0, inv_tau, tiles)
            if need_dx:
                if dx32 is None:
                    _mm_into(dx[t0:t1], dz, w_op[v0:v1])   # one product over the full vocabulary
                else:
                    addmm_fp32_(dx32, dz, w_op[v0:v1])
            if need_dw:
                if dw is not None:
                    _mm_into(dw[v0:v1], dz.T, x_c_op)      # written once; fp32 accumulation over T
                else:
                    addmm_fp32_(dw32[v0:v1], dz.T, x_c_op)
        if dx32 is not None:
            dx[t0:t1].copy_(dx32)
    if dw32 is not None:
        dw = dw32.to(w.dtype)
    return dx, dw


def loss_chunk_tokens(T: int, V: int, elem_bytes: int, workspace_bytes: int, tiles: Tiles) -> int:
    """Tokens per chunk of the fused loss path: fp32 logits + dZ for [chunk, V] fit the budget."""
    return min(T, _round_down(workspace_bytes // (V * (4 + elem_bytes)), tiles.bm))


def _loss_forward(x, w, y, coef, inv_tau, need_dx, need_dw, workspace_bytes, tiles,
                  dw_fp32=False):
    """logp, entropy, and dX, dW of sum_t coef_t logp_t, from one pass over the vocabulary (6THV).
    Over several token chunks dW is summed in its own dtype unless dw_fp32 (_grad_outputs); in
    fp32 anyway where the GEMMs' operands are not in dW's dtype (16-bit inputs on a CPU)."""
    T, H = x.shape
    V = w.shape[0]
    logp = torch.empty(T, dtype=torch.float32, device=x.device)
    ent = torch.empty_like(logp)
    cdt, x_op, w_op = _gemm_operands(x, w)
    tc = loss_chunk_tokens(T, V, torch.finfo(cdt).bits // 8, workspace_bytes, tiles)
    z_buf = torch.empty(tc * V, dtype=torch.float32, device=x.device)
    dz_buf = torch.empty(tc * V, dtype=cdt, device=x.device)
    dx, dw, dw32 = _grad_outputs(x, w, need_dx, need_dw, tc >= T, dw_fp32 or cdt != w.dtype)
    one_chunk = tc >= T
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        n = t1 - t0
        z = z_buf[: n * V].view(n, V)
        dz = dz_buf[: n * V].view(n, V)
        lp, en, norm = _forward_stats(x[t0:t1], w, y[t0:t1], inv_tau, tiles, z_out=z)
        logp[t0:t1], ent[t0:t1] = lp, en
        # dZ from the stored logits: no recompute. The loss has no entropy term (g_H = 0).
        _launch_dz(dz, x[t0:t1], w, z, y[t0:t1], norm, en, coef[t0:t1], None, 0, inv_tau, tiles)
        if need_dx:
            _mm_into(dx[t0:t1], dz, w_op)
        if need_dw:
            if one_chunk:
                _mm_into(dw, dz.T, x_op[t0:t1])
            elif dw32 is not None:
                addmm_fp32_(dw32, dz.T, x_op[t0:t1])
            else:
                dw.addmm_(dz.T, x_op[t0:t1])  # fp32 inside the GEMM, rounded to dW's dtype
    if dw32 is not None:
        dw = dw32.to(w.dtype)
    return logp, ent, dx, dw


# ----------------------------------------------------------------------------------------------
# autograd.Functions and launchers
# ----------------------------------------------------------------------------------------------


class TritonLogprob(torch.autograd.Function):
    """(hidden, weight, targets, inv_tau, workspace_bytes) -> (logp, entropy), fp32 [T] each."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, workspace_bytes):
        tiles = pick_tiles(hidden.dtype, hidden.shape[0], hidden.shape[1], weight.shape[0])
        logp, ent, norm = _forward_stats(hidden, weight, targets, inv_tau, tiles)
        ctx.save_for_backward(hidden, weight, targets, norm, ent)
        ctx.inv_tau, ctx.workspace_bytes, ctx.tiles = inv_tau, workspace_bytes, tiles
        ctx.set_materialize_grads(False)           # an unused output's gradient arrives as None
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, norm, ent = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = None if g_logp is None else g_logp.float().contiguous()
        gh = None if g_ent is None else g_ent.float().contiguous()
        dx, dw = _backward(hidden, weight, targets, norm, ent, g, gh, ctx.inv_tau,
                           need_dx, need_dw, ctx.workspace_bytes, ctx.tiles)
        return dx, dw, None, None, None


class TritonLogprobLoss(torch.autograd.Function):
    """(hidden, weight, targets, coef, inv_tau, workspace_bytes) -> (loss, logp, entropy); the
    gradients of loss are computed in the forward and only scaled in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, inv_tau, workspace_bytes):
        tiles = pick_tiles(hidden.dtype, hidden.shape[0], hidden.shape[1], weight.shape[0])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        logp, ent, dx, dw = _loss_forward(hidden, weight, targets, coef, inv_tau,
                                          need_dx, need_dw, workspace_bytes, tiles)
        loss = (coef * logp).sum()                 # same expression as the composed path
        ctx.save_for_backward(dx, dw)
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        dx, dw = ctx.saved_tensors
        # Out of place: the saved dX, dW stay valid if the graph is retained and replayed.
        gx = None if dx is None else (dx * g_loss).to(dx.dtype)
        gw = None if dw is None else (dw * g_loss).to(dw.dtype)
        return gx, gw, None, None, None, None


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_logprob(hidden, weight, targets, temperature=1.0, *, workspace_bytes=None):
    """Triton launcher: logp, entropy (fp32 [T]) of targets under softmax(hidden @ weight.T / tau).

    Differentiable w.r.t. hidden and weight (which may be a non-leaf view, e.g. FSDP2's unsharded
    parameter); the backward uses at most about `workspace_bytes` of dZ scratch.
    """
    inv_tau = check_inputs(hidden, weight, targets, temperature, dtypes=_DTYPES)
    _check_device(hidden)
    ws = int(workspace_bytes or DEFAULT_WORKSPACE_BYTES)
    if hidden.shape[0] == 0:                      # nothing to launch; torch handles empty shapes
        return fused_logprob_reference(hidden, weight, targets, temperature)
    return TritonLogprob.apply(hidden, weight, targets, inv_tau, ws)


def triton_logprob_loss(hidden, weight, targets, coef, temperature=1.0, *, workspace_bytes=None):
    """Triton launcher of the fused loss path: (loss, logp, entropy), loss = sum_t coef_t logp_t.

    coef is a constant fp32 [T] (no grad); logp and entropy come back detached, for logging.
    """
    inv_tau = check_inputs(hidden, weight, targets, temperature, dtypes=_DTYPES, coef=coef)
    _check_device(hidden)
    ws = int(workspace_bytes or DEFAULT_WORKSPACE_BYTES)
    if hidden.shape[0] == 0:
        logp, ent = fused_logprob_reference(hidden, weight, targets, temperature)
        return (coef * logp).sum(), logp.detach(), ent.detach()
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        # No gradient wanted (e.g. evaluation): the forward statistics alone, 2THV.
        tiles = pick_tiles(hidden.dtype, hidden.shape[0], hidden.shape[1], weight.shape[0])
        logp, ent, _ = _forward_stats(hidden, weight, targets, inv_tau, tiles)
        return (coef * logp).sum(), logp, ent
    return TritonLogprobLoss.apply(hidden, weight, targets, coef, inv_tau, ws)
