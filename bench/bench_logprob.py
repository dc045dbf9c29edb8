"""Time and peak memory of the LM-head log-prob op: fused Triton vs naive torch vs chunked torch.

    python bench/bench_logprob.py                 # GPU: Qwen2.5-7B head (H 3584, V 152064), bf16,
                                                  #      T = 4K, 16K, 32K, 64K
    python bench/bench_logprob.py --quick         # GPU: T = 4K only; CPU: T = 512 only
    python bench/bench_logprob.py --T 8192 --H 4096 --V 128256 --dtype bfloat16
    python bench/bench_logprob.py --tiles 128x256x64/2048/8/3   # try another Triton tile table

Implementations (per-token logp of the sampled tokens and the entropy, fp32):
  naive    materialised logits: (X @ W.T).float() / tau, log_softmax, gather; entropy under no_grad
  chunked  kernels.chunked_logprob, the torch twin (token chunks, recompute in the backward)
  triton   kernels.fused_logprob (Triton), and its fused loss path kernels.fused_logprob_loss
  liger    peer: Liger-Kernel's fused linear cross-entropy (LigerFusedLinearCrossEntropyFunction,
           reduction "none"; it computes the gradient in its forward), logp = -CE
  cce      peer: Apple's Cut Cross-Entropy (cut_cross_entropy.linear_cross_entropy, its "cce" Triton
           kernels with their default gradient filter, filter_eps "high"), logp = -CE
  The peers compute no entropy and have no temperature: they run at tau = 1 only, in the fwd and
  fwd+bwd modes (credited like the others), when importable; on a GPU machine without them, carry
  the wheels (bench/RESULTS.md, "Peers").

Modes and the FLOPs credited (the LM-head GEMMs only):
  fwd      no-grad forward, as for old/reference log-probs          2 T H V
  fwd+bwd  forward, then backward of sum_t g_t logp_t              8 T H V (recompute in backward)
           (the naive path keeps its logits, so it really does 6 T H V;
           credited 8 for comparability)
  loss     fused loss path: gradient computed in the forward       6 T H V

TFLOP/s are compared with the measured dense matmul peak of the same device and dtype (a large
square torch.mm), not the datasheet. Peak memory is the highest allocation during the call above
what was allocated before it (inputs excluded; outputs such as dX and dW included). On a CPU there
is no Triton backend worth timing (the interpreter is a numpy emulator), so only the torch paths
run, at small shapes, and memory is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere: import kernels

import kernels  # noqa: E402
from kernels import chunked_logprob, fused_logprob, fused_logprob_loss  # noqa: E402

GiB = 1 << 30


def naive_logprob(hidden, weight, targets, temperature):
    """What a plain training loop does: all [T, V] logits in fp32, autograd for the backward."""
    logits = (hidden @ weight.T).float() / temperature             # (T, V) fp32
    logp_all = torch.log_softmax(logits, dim=-1)                    # (T, V)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)       # (T,)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)              # logged, no gradient
    return logp, entropy


def peer_logprob(impl, hidden, weight, targets):
    """A peer's per-token log-probs at tau = 1: minus its unreduced linear cross-entropy."""
    if impl == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        ce = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, None, None, -100,
                                                        0.0, 0.0, "none")
    else:
        from cut_cross_entropy import linear_cross_entropy
        ce = linear_cross_entropy(hidden, weight, targets, reduction="none", impl="cce")
    # Liger returns (loss, z_loss, ...) in some versions
    ce = ce[0] if isinstance(ce, tuple) else ce
    return -ce.float()


PEERS = ("liger", "cce")


def peer_available(impl) -> bool:
    import importlib.util
    module = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}[impl]
    return importlib.util.find_spec(module) is not None


def run_once(impl, mode, x, w, y, g, tau, workspace):
    """One call of `impl` in `mode`; returns nothing (results are discarded)."""
    if impl in PEERS:
        if mode == "fwd":
            with torch.no_grad():
                peer_logprob(impl, x, w, y)
            return
        xr, wr = x.requires_grad_(), w.requires_grad_()
        (g * peer_logprob(impl, xr, wr, y)).sum().backward()
        xr.grad = wr.grad = None
        return
    kw = {} if impl == "naive" else dict(workspace_bytes=workspace)
    if mode == "fwd":
        with torch.no_grad():
            if impl == "naive":
                naive_logprob(x, w, y, tau)
            elif impl == "chunked":
                chunked_logprob(x, w, y, tau, **kw)
            else:
                fused_logprob(x, w, y, tau, backend="triton", **kw)
        return
    xr, wr = x.requires_grad_(), w.requires_grad_()
    if mode == "loss":
        backend = "triton" if impl == "triton" else "torch"
        loss, _, _ = fused_logprob_loss(xr, wr, y, g, tau, backend=backend, **kw)
    else:
        fn = {"naive": naive_logprob, "chunked": chunked_logprob}.get(impl)
        logp, _ = (fn(xr, wr, y, tau, **kw) if fn
                   else fused_logprob(xr, wr, y, tau, backend="triton", **kw))
        loss = (g * logp).sum()
    loss.backward()
    xr.grad = wr.grad = None


def measure(impl, mode, x, w, y, g, tau, workspace, repeats, warmup):
    """(median seconds, peak extra bytes or None) of `repeats` timed calls after `warmup` calls."""
    cuda = x.is_cuda
    for _ in range(warmup):
        run_once(impl, mode, x, w, y, g, tau, workspace)
    times, peak = [], None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_once(impl, mode, x, w, y, g, tau, workspace)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run_once(impl, mode, x, w, y, g, tau, workspace)
            times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def make_inputs(T, H, V, dtype, device):
    """Random hidden states, a random LM head scaled to O(1) logits, targets, logp gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, device=device, generator=gen).to(dtype)
    w = (torch.randn(V, H, device=device, generator=gen) / H ** 0.5).to(dtype)
    y = torch.randint(0, V, (T,), device=device, generator=gen)
    g = torch.randn(T, device=device, generator=gen) / T
    return x, w, y, g


def check_agreement(impls, x, w, y, tau, workspace):
    """Print how far each implementation's logp/entropy are from the first one's (sanity check)."""
    outs = {}
    for impl in impls:
        try:
            with torch.no_grad():
                if impl in PEERS:
                    outs[impl] = (peer_logprob(impl, x, w, y), None)
                elif impl == "naive":
                    outs[impl] = naive_logprob(x, w, y, tau)
                elif impl == "chunked":
                    outs[impl] = chunked_logprob(x, w, y, tau, workspace_bytes=workspace)
                else:
                    outs[impl] = fused_logprob(x, w, y, tau, backend="triton",
                                               workspace_bytes=workspace)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
        except Exception as e:  # a peer's API may differ from the version this was written against
            print(f"check: {impl} failed: {type(e).__name__}: {e}")
    if len(outs) < 2:
        return
    first, (lp0, en0) = next(iter(outs.items()))
    for impl, (lp, en) in list(outs.items())[1:]:
        entropy = ("" if en is None
                   else f", max |entropy diff| = {(en - en0).abs().max().item():.2e}")
        print(f"check: max |logp {impl} - {first}| = {(lp - lp0).abs().max().item():.2e}{entropy}")
    print()


def matmul_peak(device, dtype, n):
    """Measured dense matmul TFLOP/s of an n x n x n torch.mm (best of a few)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(5 if device.type == "cuda" else 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10 if device.type == "cuda" else 1):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / (10 if device.type == "cuda" else 1))
    return 2 * n ** 3 / best / 1e12


def set_tiles(spec: str) -> None:
    """--tiles BMxBNxBK/SPLIT/WARPS/STAGES: replace the Triton tile table for this run."""
    from kernels import logprob
    dims, split, warps, stages = spec.split("/")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    tiles = logprob.Tiles(bm=bm, bn=bn, bk=bk, split=int(split), group_m=8,
                          num_warps=int(warps), num_stages=int(stages))
    logprob.pick_tiles = lambda *args, **kwargs: tiles


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one (the smallest) T only, fewer repeats")
    ap.add_argument("--T", type=int, nargs="+",
                    help="token counts (default: GPU 4K..64K, CPU 512 1024)")
    ap.add_argument("--H", type=int, help="hidden size (default: GPU 3584, CPU 256)")
    ap.add_argument("--V", type=int, help="vocabulary (default: GPU 152064, CPU 4096)")
    ap.add_argument("--dtype", default=None,
                    help="bfloat16 | float16 | float32 (default: GPU bf16, CPU fp32)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--impls", nargs="+", default=["naive", "chunked", "triton", *PEERS],
                    help="naive chunked triton liger cce (the peers run only where importable)")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd", "loss"])
    ap.add_argument("--workspace-mib", type=int, default=1024, help="workspace of triton/chunked")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tiles", default=None, help="Triton tiles BMxBNxBK/SPLIT/WARPS/STAGES")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    H = args.H or (3584 if cuda else 256)
    V = args.V or (152064 if cuda else 4096)
    Ts = args.T or ([4096, 16384, 32768, 65536] if cuda else [512, 1024])
    if args.quick:
        Ts = Ts[:1]
    repeats = args.repeats or (2 if args.quick else 3 if cuda else 3)
    workspace = args.workspace_mib << 20
    impls = list(args.impls)
    if args.tiles:
        set_tiles(args.tiles)

    print(f"# bench_logprob: {datetime.date.today()}, torch {torch.__version__}, "
          f"triton {'yes' if kernels.TRITON_AVAILABLE else 'no'}")
    if cuda:
        name = torch.cuda.get_device_name()
        print(f"device: {name}, {torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads")
        if "triton" in impls:
            impls.remove("triton")
            print("Triton timings skipped (no GPU): "
                  "the CPU interpreter is an emulator, not a backend.")
    for impl in [i for i in impls if i in PEERS]:
        why = ("no GPU (peers are timed on GPUs only)" if not cuda
               else "not installed" if not peer_available(impl)
               else "tau != 1 (they have no temperature)" if args.temperature != 1.0 else "")
        if why:
            impls.remove(impl)
            print(f"peer {impl} skipped: {why}")
    peak = matmul_peak(device, dtype, 8192 if cuda else 1024)
    print(f"measured {dtype} matmul peak: {peak:.3g} TFLOP/s;  H={H} V={V} tau={args.temperature} "
          f"workspace={args.workspace_mib} MiB\n")

    check_agreement(impls, *make_inputs(Ts[0], H, V, dtype, device)[:3], args.temperature,
                    workspace)
    flops_per = {"fwd": 2, "fwd+bwd": 8, "loss": 6}
    rows = []
    print("| impl | mode | T | time (ms) | TFLOP/s | % of peak | peak extra mem (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for T in Ts:
        x, w, y, g = make_inputs(T, H, V, dtype, device)
        for impl in impls:
            for mode in args.modes:
                if mode == "loss" and impl in ("naive", *PEERS):
                    continue                      # their loss is their fwd+bwd row
                flops = flops_per[mode] * T * H * V
                if mode == "loss" and impl == "chunked":
                    flops = 8 * T * H * V         # the twin's loss path recomputes in its backward
                try:
                    sec, mem = measure(impl, mode, x.detach(), w.detach(), y, g, args.temperature,
                                       workspace, repeats, warmup=1)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    line = f"| {impl} | {mode} | {T} | OOM | | | |"
                except Exception as e:  # a peer failing must not cost the rest of the table
                    if impl not in PEERS:
                        raise
                    line = f"| {impl} | {mode} | {T} | error: {type(e).__name__} | | | |"
                else:
                    tf = flops / sec / 1e12
                    mem_s = f"{mem / GiB:.2f}" if mem is not None else "n/a"
                    line = (f"| {impl} | {mode} | {T} | {sec * 1e3:.1f} | {tf:.3g} | "
                            f"{100 * tf / peak:.0f}% | {mem_s} |")
                print(line, flush=True)
                rows.append(line)
        del x, w, y, g
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
