"""Tests for kernels/: the fused LM-head log-prob op, its fused-loss path and its torch twins.

CPU: the Triton kernels run under TRITON_INTERPRET=1 on small irregular shapes (under ten seconds
in all on 2 cores, measured 2026-11-21). GPU-only tests (bf16 tensor-core dots, bigger shapes) skip
without CUDA.

    .venv/bin/python -m pytest -q tests/test_kernels.py

Accuracy is always measured against a float64 evaluation of the textbook formula on the same
(dtype-rounded) inputs. Tolerances, per dtype, are TOL[dtype] plus 4x the error of the plain fp32
torch path (materialised logits + log_softmax + autograd) on the same inputs: fp32 logits of size
~1e3 are themselves off by ~1e-4, which no fp32 implementation can beat, so that floor only
matters in the large-offset cases. Errors of gradients are relative to the reference's largest
entry.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before kernels (and so any @triton.jit function) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import (  # noqa: E402
    TRITON_AVAILABLE, chunked_logprob, fused_logprob, fused_logprob_loss, fused_logprob_reference)
from kernels.reference import operand_dtype  # noqa: E402

needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# stat: absolute error of logp / entropy; grad: max |error| / max |reference| for dX and dW.
# Unit roundoffs: u32 = 2^-24 = 6e-8, u16 = 2^-11 = 4.9e-4, u_bf16 = 2^-8 = 3.9e-3. Each dtype's
# logits are accumulated and logp / entropy computed in fp32, so stat = 2e-5 ~ sqrt(H) u32 S, the
# typical rounding of one H-term fp32 logit of size S = max sum_h |x_h w_h| / tau (H = 96,
# S ~ 30-43 for the randn inputs: 1.7e-5-2.5e-5); larger logits (the offset cases) raise the fp32
# floor added in check_against_reference.
# grad fp32: 1e-5 ~ 5 sqrt(V) u32, the typical rounding of the backward GEMMs' V = 1000-term sums
# (the logit rounding the gradients inherit is in the floor). grad 16-bit: dZ is rounded once to the
# input dtype for the GEMMs, up to u per entry, so ~4u normwise (4 u16 = 2.0e-3, 4 u_bf16 = 1.6e-2).
TOL = {
    torch.float32: dict(stat=2e-5, grad=1e-5),
    torch.float16: dict(stat=2e-5, grad=2e-3),     # dZ is rounded once to fp16 for the GEMMs
    torch.bfloat16: dict(stat=2e-5, grad=1.5e-2),  # ... and to bf16 (8 mantissa bits)
}

# Irregular on purpose: T, V and H are multiples of no tile size (V spans two forward splits on
# the CPU tile table, T two token tiles, H two K steps).
T, V, H = 70, 1000, 96


def make_inputs(dtype, logits="randn", seed=0, t=T, v=V, h=H):
    """hidden, weight, targets; 'offset'/'negative' add a bias-like +-1000 to every logit through
    one huge weight column; 'shared' adds about +32 as real models do, through a direction every
    hidden state and every weight row share, with weights of the usual scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * (3 / h ** 0.5)
    if logits in ("offset", "negative"):
        x[:, 0] = 1.0                                   # a constant feature ...
        w[:, 0] = 1000.0 if logits == "offset" else -1000.0   # ... times a huge shared weight
    if logits == "shared":
        d = torch.randn(h, generator=gen)
        d = d / d.norm()                                # a unit direction
        x += 32 ** 0.5 * d                              # <x_t, w_v> grows by ~32 for every pair
        w += 32 ** 0.5 * d
    y = torch.randint(0, v, (t,), generator=gen)
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE), y.to(DEVICE)


def make_upstream(t=T, seed=1, masked=0.3):
    """Per-token upstream gradients on logp and entropy; a third of the tokens masked (zeros)."""
    gen = torch.Generator().manual_seed(seed)
    g, gh = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    mask = torch.rand(t, generator=gen) < masked
    g[mask], gh[mask] = 0.0, 0.0
    return g.to(DEVICE), gh.to(DEVICE), mask.to(DEVICE)


def run_op(fn, x, w, y, tau, g, gh, grads="both", dtype=None, **kw):
    """logp, entropy, dX, dW of L = sum g logp + sum gh H through `fn` (inputs cast to dtype)."""
    xr = x.detach().to(dtype or x.dtype).requires_grad_()
    wr = w.detach().to(dtype or w.dtype).requires_grad_()
    logp, ent = fn(xr, wr, y, tau, **kw)
    loss = 0
    if grads in ("both", "logp"):
        loss = loss + (logp * g.to(logp.dtype)).sum()
    if grads in ("both", "entropy"):
        loss = loss + (ent * gh.to(ent.dtype)).sum()
    loss.backward()
    return logp.detach(), ent.detach(), xr.grad, wr.grad


def errors(got, want):
    """(logp abs, entropy abs, dX rel, dW rel) errors of `got` against `want`."""
    stat = [(a.double() - b.double()).abs().max().item() for a, b in zip(got[:2], want[:2])]
    grad = [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            for a, b in zip(got[2:], want[2:])]
    return stat + grad


def dz_rounding(x, w, y, tau, g, gh, grads, want) -> list[float]:
    """How far rounding dZ once to the GEMMs' 16-bit operand dtype can move dX and dW, each
    relative to the reference's largest entry: |delta dZ| <= u |dZ| entrywise, so |delta dX| <=
    u (|dZ| |W|) and |delta dW| <= u (|dZ|^T |X|). It is the weights' scale that matters: one
    column of 1000 (the offset cases) multiplies a row's roundings by 1000 in that column of dX,
    which the exact dX nearly cancels there. 0 where dZ stays fp32 (fp32 inputs, or 16-bit ones
    on a CPU, whose GEMMs take fp32 operands: kernels.reference.operand_dtype)."""
    dtype = operand_dtype(x)
    if dtype == torch.float32:
        return [0.0, 0.0]
    u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    xd, wd = x.double(), w.double()
    logp = torch.log_softmax(xd @ wd.T / tau, dim=1)  # (T, V)
    p = logp.exp()
    dz = torch.zeros_like(p)
    if grads in ("both", "logp"):
        dz += g.double()[:, None] * (torch.nn.functional.one_hot(y, p.shape[1]) - p)
    if grads in ("both", "entropy"):
        ent = -(p * logp).sum(1, keepdim=True)
        dz -= gh.double()[:, None] * p * (logp + ent)
    dz = dz.abs() / tau
    return [(u * (dz @ wd.abs())).max().item() / want[2].double().abs().max().item(),
            (u * (dz.T @ xd.abs())).max().item() / want[3].double().abs().max().item()]


def check_against_reference(fn, dtype, logits, tau, grads, seed=0, shape=(T, V, H), **kw):
    t, v, h = shape
    x, w, y = make_inputs(dtype, logits, seed, t=t, v=v, h=h)
    g, gh, mask = make_upstream(t=t)
    want = run_op(fused_logprob_reference, x, w, y, tau, g, gh, grads, dtype=torch.float64)
    fp32 = run_op(fused_logprob_reference, x, w, y, tau, g, gh, grads, dtype=torch.float32)
    got = run_op(fn, x, w, y, tau, g, gh, grads, **kw)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[2].dtype == x.dtype and got[3].dtype == w.dtype and got[3].shape == w.shape
    # The plain fp32 path carries the rounding these inputs force on any fp32 evaluation; another
    # summation order may err as much the other way, and 4x leaves room over that 2x. A 16-bit dZ
    # adds its own rounding, bounded entrywise (dz_rounding) and so not scaled again.
    floor = errors(fp32, want)
    err = errors(got, want)
    tol = TOL[dtype]
    names = ["logp", "entropy", "dX", "dW"]
    extra = [0.0, 0.0] + dz_rounding(x, w, y, tau, g, gh, grads, want)
    for name, e, f, base, r in zip(names, err, floor, [tol["stat"]] * 2 + [tol["grad"]] * 2,
                                   extra):
        assert e <= base + 4 * f + r, \
            f"{name}: error {e:.3g} > {base:.1g} + 4 x fp32-torch {f:.3g} + dZ rounding {r:.3g}"
    assert torch.all(got[2][mask] == 0), "masked tokens (zero upstream gradient) must get dX = 0"
    return err


# ----------------------------------------------------------------------------------------------
# The Triton op against float64
# ----------------------------------------------------------------------------------------------

# (dtype, logits, tau, which outputs get a gradient, workspace bytes: None = one block,
#  100_000 = several vocab slices with all tokens, 16_384 = several token chunks x vocab slices)
CASES = [
    (torch.float32, "randn", 0.7, "both", None),
    (torch.float32, "randn", 1.0, "logp", 16_384),
    (torch.float32, "offset", 0.7, "both", 100_000),
    (torch.float32, "negative", 0.7, "entropy", None),
    (torch.float16, "randn", 0.7, "both", 16_384),
    (torch.float16, "offset", 1.3, "both", None),
    (torch.float16, "negative", 0.7, "both", 100_000),
    (torch.bfloat16, "randn", 0.7, "both", None),      # CPU: exercises the upcast-before-dot path
    (torch.float32, "shared", 0.7, "both", 16_384),
    (torch.bfloat16, "shared", 1.3, "both", 100_000),
]


@needs_triton
@pytest.mark.parametrize("dtype,logits,tau,grads,ws", CASES)
def test_triton_matches_fp64_reference(dtype, logits, tau, grads, ws):
    check_against_reference(fused_logprob, dtype, logits, tau, grads, backend="triton",
                            workspace_bytes=ws)


@needs_triton
def test_triton_matches_fp64_reference_at_tokenizer_vocabulary():
    """V >= 16384 switches the interpreter to its wide tiles (2048 columns, 8192-column splits),
    the ones a real tokenizer's vocabulary runs on: V = 20000 spans three splits and ends in a
    masked tail."""
    check_against_reference(fused_logprob, torch.float32, "randn", 0.7, "both",
                            shape=(40, 20_000, 128), backend="triton")


@needs_triton
def test_tolerance_can_fail():
    """The check above is not vacuous: a 1/tau mistake in the logits is caught."""
    def wrong_tau(x, w, y, tau, **kw):
        return fused_logprob(x, w, y, 1.0, backend="triton")
    with pytest.raises(AssertionError):
        check_against_reference(wrong_tau, torch.float32, "randn", 0.7, "both")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_grad_logp_is_bitwise_the_grad_pass(dtype):
    x, w, y = make_inputs(dtype, "randn")
    with torch.no_grad():
        logp_old, ent_old = fused_logprob(x, w, y, 0.7, backend="triton")
    logp, ent = fused_logprob(x.requires_grad_(), w.requires_grad_(), y, 0.7, backend="triton")
    assert torch.equal(logp_old, logp.detach()) and torch.equal(ent_old, ent.detach())
    ratio = torch.exp(logp.detach() - logp_old)
    assert torch.all(ratio == 1.0), "PPO's first ratio must be exactly 1"


# ----------------------------------------------------------------------------------------------
# The launcher's checks
# ----------------------------------------------------------------------------------------------

def _bad_inputs():
    x, w, y = make_inputs(torch.float32)
    c = torch.zeros(T, device=DEVICE)
    return [
        ("3-D hidden", dict(hidden=x[None]), "hidden"),
        ("H mismatch", dict(weight=w[:, :-1].contiguous()), "weight"),
        ("targets too short", dict(targets=y[:-1]), "targets"),
        ("int32 targets", dict(targets=y.int()), "targets"),
        ("fp64 hidden", dict(hidden=x.double(), weight=w.double()), "hidden"),
        ("dtype mismatch", dict(weight=w.half()), "weight"),
        ("non-contiguous hidden", dict(hidden=x.T.contiguous().T), "hidden"),
        ("label -1", dict(targets=torch.where(y == y[0], -1, y)), "targets"),
        ("label V", dict(targets=torch.where(y == y[0], V, y)), "targets"),
        ("temperature 0", dict(temperature=0.0), "temperature"),
        ("temperature nan", dict(temperature=float("nan")), "temperature"),
        ("coef needs grad", dict(coef=c.clone().requires_grad_()), "coef"),
        ("coef fp64", dict(coef=c.double()), "coef"),
        ("coef wrong length", dict(coef=c[:-1]), "coef"),
    ]


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_launcher_rejects_bad_inputs(backend, case):
    what, override, argname = _bad_inputs()[case]
    x, w, y = make_inputs(torch.float32)
    args = dict(hidden=x, weight=w, targets=y, coef=torch.zeros(T, device=DEVICE), temperature=0.7)
    args.update(override)
    if backend == "torch" and what == "fp64 hidden":
        pytest.skip("the torch twin accepts fp64 (used by these tests)")
    with pytest.raises(ValueError, match=argname):
        if "coef" in override:
            fused_logprob_loss(**args, backend=backend)
        else:
            args.pop("coef")
            fused_logprob(**args, backend=backend)


def test_unknown_backend_is_rejected():
    x, w, y = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="backend"):
        fused_logprob(x, w, y, backend="cuda")


# ----------------------------------------------------------------------------------------------
# Fused loss path == composed path
# ----------------------------------------------------------------------------------------------

LOSS_CASES = [
    ("triton", torch.float32, None),        # one token chunk
    ("triton", torch.float32, 300_000),     # several token chunks: dW summed in its dtype
    ("triton", torch.float16, 300_000),
    ("torch", torch.float32, 100_000),
]


@pytest.mark.parametrize("backend,dtype,ws", LOSS_CASES)
def test_fused_loss_equals_composed_path(backend, dtype, ws):
    if backend == "triton" and not TRITON_AVAILABLE:
        pytest.skip("needs triton")
    x, w, y = make_inputs(dtype, "randn", seed=3)
    coef, _, mask = make_upstream(seed=4)                    # advantage-like weights, some masked
    kw = dict(backend=backend, workspace_bytes=ws)

    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logp, ent = fused_logprob_loss(xa, wa, y, coef, 0.7, **kw)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert not logp.requires_grad and not ent.requires_grad, "logp/entropy are for logging"
    (2.5 * loss).backward()                                  # the incoming scalar must be applied

    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    logp_b, ent_b = fused_logprob(xb, wb, y, 0.7, **kw)
    loss_b = (coef * logp_b).sum()
    (2.5 * loss_b).backward()

    assert torch.equal(loss, loss_b) and torch.equal(logp, logp_b.detach())
    assert torch.equal(ent, ent_b.detach())
    # The same kernels on both sides; the incoming 2.5 and coef enter dZ at different points, so
    # each fp32 dZ entry may differ by an ulp or two, about 2 u32 normwise through the GEMMs:
    # 1e-6 ~ 16 u32. In fp16 that 1-ulp difference can flip dZ's rounding to fp16,
    # one u16 per entry: 2e-3 ~ 4 u16.
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for a, b in ((xa.grad, xb.grad), (wa.grad, wb.grad)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() <= tol
    assert torch.all(xa.grad[mask] == 0)


@needs_triton
def test_fused_loss_without_grad_is_forward_only():
    x, w, y = make_inputs(torch.float32, "randn", seed=3)
    coef, _, _ = make_upstream(seed=4)
    with torch.no_grad():
        loss, logp, _ = fused_logprob_loss(x, w, y, coef, 0.7, backend="triton")
    logp_b, _ = fused_logprob(x, w, y, 0.7, backend="triton")
    assert torch.equal(logp, logp_b) and torch.equal(loss, (coef * logp_b).sum())


# ----------------------------------------------------------------------------------------------
# The torch twins
# ----------------------------------------------------------------------------------------------

def test_chunked_twin_equals_reference_in_fp64():
    """Same maths in float64: chunking (7 chunks here) changes nothing beyond fp64 rounding."""
    tau, u = 0.7, 2.0 ** -53                                 # u: fp64 unit roundoff
    x, w, y = make_inputs(torch.float64, "offset")
    g, gh, _ = make_upstream()
    want = run_op(fused_logprob_reference, x, w, y, tau, g, gh)
    got = run_op(chunked_logprob, x, w, y, tau, g, gh, workspace_bytes=10 * 16 * V)
    # Both sides differ only in summation order (GEMM shapes, chunks) and in z/tau vs z*(1/tau).
    # Each logit is an H-term dot product, so the two may differ by d = 2(H+2) u S,
    # S = max sum_h |x_h w_h| / tau (~1.5e3: the +-1000 offset). A log-softmax entry then moves by
    # at most 2e, e = d + V u (its log-sum-exp adds V terms): logp by 2e; the entropy,
    # dH = -sum p (1 + log p) dlog p, by 2(e + V u)(1 + log V) (V u for its own sum); each
    # dz = dL/dz by 2e m, m = p (|g| + |gh| (|log p| + H + 2 + log V)) / tau
    # (+ |g| / tau at the target, so that |dz| <= m too), and the backward GEMMs add K-term
    # rounding: dX by (2e + 2V u)(m @ |W|), dW by (2e + 2T u)(m^T @ |X|).
    # About 6e-11 for logp; measured ~1e-12.
    S = ((x.abs() @ w.abs().T) / tau).max().item()
    e = 2 * (H + 2) * u * S + V * u
    logp_all = torch.log_softmax(x @ w.T / tau, -1)         # (T, V) fp64
    p, ent = logp_all.exp(), want[1][:, None]
    m = p * (g.abs()[:, None] + gh.abs()[:, None] * (logp_all.abs() + ent + 2 + math.log(V))) / tau
    m[torch.arange(T), y] += g.abs() / tau
    bounds = [torch.full_like(want[0], 2 * e),
              torch.full_like(want[1], 2 * (e + V * u) * (1 + math.log(V))),
              (2 * e + 2 * V * u) * (m @ w.abs()), (2 * e + 2 * T * u) * (m.T @ x.abs())]
    for name, a, b, bound in zip(["logp", "entropy", "dX", "dW"], got, want, bounds):
        # masked tokens: bound 0, both sides exactly 0
        beyond = ((a - b).abs() > bound).sum().item()
        assert beyond == 0, f"{name}: {beyond} entries differ by more than fp64 rounding allows"


@pytest.mark.parametrize("dtype,logits", [(torch.float32, "randn"), (torch.float32, "offset"),
                                          (torch.float16, "negative"), (torch.bfloat16, "randn")])
def test_chunked_twin_matches_fp64_reference(dtype, logits):
    check_against_reference(chunked_logprob, dtype, logits, 0.7, "both", workspace_bytes=100_000)


def test_auto_backend_uses_the_twin_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("on a GPU 'auto' means Triton")
    x, w, y = make_inputs(torch.float32)
    assert torch.equal(fused_logprob(x, w, y, 0.7)[0], chunked_logprob(x, w, y, 0.7)[0])


# ----------------------------------------------------------------------------------------------
# Plumbing: FSDP2-style weight views, workspace sizing, empty batches
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_weight_may_be_a_nonleaf_view(backend):
    """FSDP2 hands over the unsharded weight as a view of a flat buffer; dW must reach it."""
    if backend == "triton" and not TRITON_AVAILABLE:
        pytest.skip("needs triton")
    x, w, y = make_inputs(torch.float16, "randn", seed=5, t=40, v=300, h=48)
    flat = torch.cat([torch.zeros(7, dtype=w.dtype, device=DEVICE), w.flatten()]).requires_grad_()
    weight = flat[7:].view(w.shape)                          # non-leaf, storage offset 7
    logp, _ = fused_logprob(x, weight, y, 0.7, backend=backend)
    logp.sum().backward()
    wr = w.double().requires_grad_()
    fused_logprob_reference(x.double(), wr, y, 0.7)[0].sum().backward()
    assert flat.grad.dtype == w.dtype and torch.all(flat.grad[:7] == 0)
    dw = flat.grad[7:].view(w.shape).double()
    # fp16 inputs: dZ is rounded to fp16 for the dW GEMM, as in TOL[torch.float16]["grad"] (~4 u16)
    assert ((dw - wr.grad).abs().max() / wr.grad.abs().max()).item() < TOL[torch.float16]["grad"]


@needs_triton
def test_backward_blocks_respect_the_budget():
    from kernels.logprob import backward_blocks, loss_chunk_tokens, pick_tiles
    tiles = pick_tiles(torch.bfloat16, 4096, 3584)
    for t, v, ws in [(65536, 152064, 1 << 30), (4096, 152064, 1 << 30), (300, 1000, 1 << 30),
                     (10 ** 6, 152064, 256 << 20), (65536, 152064, 64 << 20)]:
        tc, vs = backward_blocks(t, v, 2, ws, tiles)
        assert 0 < tc <= t and 0 < vs <= v
        assert tc * vs * 2 <= max(ws, tiles.bm * tiles.bn * 2)
        if t * v * 2 > ws and vs < v:
            assert vs % tiles.bn == 0
        lc = loss_chunk_tokens(t, v, 2, ws, tiles)
        assert lc * v * 6 <= max(ws, tiles.bm * v * 6) and 0 < lc <= t
    assert backward_blocks(65536, 152064, 2, 1 << 30, tiles)[0] == 65536   # dW slices written once


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_batch(backend):
    if backend == "triton" and not TRITON_AVAILABLE:
        pytest.skip("needs triton")
    x, w, y = make_inputs(torch.float32, t=0)
    logp, ent = fused_logprob(x, w, y, 0.7, backend=backend)
    assert logp.shape == (0,) and ent.shape == (0,) and logp.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# GPU only: bf16 tensor-core dots, bigger irregular shapes
# ----------------------------------------------------------------------------------------------

@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype,logits", [(torch.bfloat16, "randn"), (torch.bfloat16, "offset"),
                                          (torch.float16, "randn"), (torch.float32, "negative"),
                                          (torch.bfloat16, "shared"), (torch.float32, "offset")])
def test_gpu_triton_matches_fp64_reference(dtype, logits):
    for ws in (None, 8 << 20):                              # one block; several vocab slices
        check_against_reference(fused_logprob, dtype, logits, 0.7, "both", backend="triton",
                                workspace_bytes=ws)


@needs_cuda
@needs_triton
def test_gpu_bf16_bigger_shape_and_determinism():
    x, w, y = make_inputs(torch.bfloat16, "randn", seed=7, t=1000, v=32_013, h=512)
    g, gh, _ = make_upstream(t=1000)
    want = run_op(fused_logprob_reference, x, w, y, 0.9, g, gh, dtype=torch.float64)
    got = run_op(fused_logprob, x, w, y, 0.9, g, gh, backend="triton")
    again = run_op(fused_logprob, x, w, y, 0.9, g, gh, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two runs must agree bitwise"
    # the bound of check_against_reference: TOL plus 4x the plain fp32 path's error on these inputs
    # (the logits here are H = 512-term sums of size S ~ 64,
    # so their fp32 rounding is ~ sqrt(H) u32 S ~ 9e-5)
    fp32 = run_op(fused_logprob_reference, x, w, y, 0.9, g, gh, dtype=torch.float32)
    err, floor = errors(got, want), errors(fp32, want)
    bases = [TOL[torch.bfloat16]["stat"]] * 2 + [TOL[torch.bfloat16]["grad"]] * 2
    assert all(e <= b + 4 * f for e, f, b in zip(err, floor, bases)), (err, floor)
    with torch.no_grad():
        logp_old, _ = fused_logprob(x, w, y, 0.9, backend="triton")
    assert torch.equal(logp_old, got[0])
    coef = g.clone()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logp, _ = fused_logprob_loss(xa, wa, y, coef, 0.9, backend="triton")
    loss.backward()
    assert torch.equal(logp, got[0]) and torch.equal(loss, (coef * got[0]).sum())
    composed = run_op(fused_logprob, x, w, y, 0.9, coef, gh, grads="logp", backend="triton")
    # bf16 dZ may round 1 ulp (2 u_bf16) apart
    for a, b in ((xa.grad, composed[2]), (wa.grad, composed[3])):
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() < 1e-2
