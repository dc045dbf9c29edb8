"""One device check of the GPU path in under 8 minutes on one H100 or H200 (issue #36, item 3): the
LM-head kernels' bf16 parity and speed beside their peers, spell.update_policy's throughput and
peak memory against infra.memory_estimate, FlexAttention's shared-prefix mask against SDPA, and
the recompile probe of compiled FlexAttention. One Markdown table, also written with the raw
numbers to $OUT (or --out).

    bash bench/gpu_check.sh                      # on the device: installs the carried peer wheels
                                                 # (.whl/), then runs this script under `timeout`
    python bench/gpu_check.py                    # the same, without the wheels
    python bench/gpu_check.py --parts a,d        # only some parts (header and peak always run)
    python bench/gpu_check.py --dry --out /tmp/g # any machine, CPU only, tiny shapes, < 1 minute
                                                 # (tests/test_gpu_check.py runs this)

First the device (as torch.cuda.get_device_name() reports it), the versions, and the measured
bf16 dense matmul peak (an 8192^3 torch.mm, best of 5 rounds of 10): every TFLOP/s below is
compared with it. The parts run in the order a, e, b, c, d: what a short lease needs most first;
d resets dynamo's cache last.

  a. head kernels  At the Qwen2.5-7B head (H 3584, V 152064, bf16, tau 1). Parity, on T = 1000
                   tokens: logp and entropy (absolute) and the gradients dX, dW of sum_t g_t logp_t
                   (relative to the reference's largest entry) against a float64 evaluation of the
                   textbook formula on the same bf16 inputs, for the naive path, the chunked torch
                   twin, the Triton op, its fused loss path, Liger-Kernel's fused linear
                   cross-entropy and Apple's Cut Cross-Entropy (rows say "not installed" where a
                   peer does not import; carry their wheels, bench/RESULTS.md). Each bound
                   follows from the arithmetic (head_bounds). Speed, on T = 16384: the median of
                   3 calls after a warm-up (bench_logprob.measure), TFLOP/s credited 2THV (fwd),
                   8THV (fwd+bwd) or 6THV (loss) whatever an implementation really does, so at a
                   mode they rank by time; peak extra memory as in bench_logprob.py.
  b. update        spell.update_policy on one GPU (FSDP2 world of one, fp32 masters, bf16
                   compute, gradient checkpointing, spell.make_optimizer's fused AdamW with its
                   state made by infra.create_optimizer_state) with config.toml's recipe
                   (attention "auto" = flex on a GPU without flash-attn, the fused Triton head)
                   on a random Qwen2.5-7B-shaped policy of --layers (8) of its 28 layers, built
                   from a transformers config (no weights travel), 2 micro-batches of T = 16K,
                   then 32K tokens an update (bench_trainer.update_batch). Tokens/s, MFU (model
                   FLOPs, bench_trainer.model_flops, over the measured peak), and the peak
                   allocated over the timed updates (less what earlier parts left allocated, ~0)
                   against infra.memory_estimate's update phase for this batch. Beside them: the
                   start's peak (the policy and its optimiser state); each length's peak split at
                   the optimiser step (phase_peaks); for the first length, the kernel time of one
                   update by kind (profiled_update, KERNEL_KINDS); for the last, what is alive at
                   the peak by allocation site (the CUDA allocator's trace replayed:
                   peak_breakdown); then the first length again with the decoder layers
                   compiled (engine.compile_layers: inductor, the compile in the warm-up); then
                   AdamW's three implementations timed on the same shards.
  c. shared prefix spell.pack_sequences(shared=True) rows (two groups of 4 and 2 answers) through
                   a 2-layer Qwen2.5-7B-shaped decoder in bf16, tree mask from
                   infra.tree_attention_mask: FlexAttention's BlockMask against SDPA's dense mask,
                   the last hidden state and the parameter gradients of sum_t w_t logp_t
                   (infra.packed_logprobs), each relative to SDPA's largest entry; beside it how
                   far a mask that lets a group's answers see each other moves the output, which
                   the bound must lie below for the check to be able to fail.
  d. recompiles    A fresh dynamo cache (one torch._dynamo.reset() before the probe, none after),
                   then the project's path (infra.packed_logprobs on a 1-layer Qwen2.5-7B-shaped
                   decoder, checkpointed, in train mode) over 10 row lengths 8192 + 331 i, each a
                   shared-prefix row (infra's compiled BlockMask) and a packed row (transformers'
                   BlockMask), each a no-grad forward and a forward + backward: 40 calls. Counted:
                   the recompiles dynamo logs, its recompile-limit hits, the compiled entries it
                   keeps per function, and the calls that fell back to the unfused dense path
                   (torch's "without torch.compile" warning fired, or the call's peak extra memory
                   reached the bf16 (H, T, T) scores that path materialises): F3 of
                   shared/notes/gpu-path-review.md, where a fallback at 32K would need ~112 GiB.
  e. head tiles    The kernels' tuning at part a's timed shape: tests/test_kernels.py's fp32
                   offset case at tau 0.7 with and without fma contraction (FP_FUSION); the
                   forward statistics at each of FWD_TILES; a candidate forward, cuBLAS fp32 logits
                   a token chunk then one Triton pass a row (gemm_then_reduce); the two training
                   paths (two-pass fwd+bwd, one-pass loss) at MODE_TILES x MODE_CASES; the loss
                   path's dW summed in fp32 or its own dtype at three workspaces. Each with its
                   time, extra memory and its difference from the first variant's result.

Each part runs under a time guard: it may use its share of --budget (440 s) plus what earlier
parts left; a case that would not fit is skipped, a part past its guard is stopped, and any
failure is written in its rows, never stopping the script (a failure is data). Rows are written
to $OUT as they come, so a run killed by `timeout` still leaves what it measured.

--dry runs the same code on CPU tensors (CUDA hidden) at tiny shapes in fp32: the Triton kernels
under TRITON_INTERPRET=1, dynamo's compiles with the "eager" backend (inductor's CPU templates
would take minutes, and torch's CPU FlexAttention has no backward, so the flex gradients and the
probe's backward calls are n/a there), the update on gloo with the torch head; no memory numbers.
Needs torch, transformers, triton; never vLLM, flash-attn or the network.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

if "--dry" in sys.argv:  # before torch is imported: CPU tensors only, Triton's interpreter
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run from anywhere: spell, infra, bench scripts

import bench_attention  # noqa: E402
import bench_logprob  # noqa: E402
import bench_trainer  # noqa: E402
import infra  # noqa: E402
import kernels  # noqa: E402
import spell  # noqa: E402

GiB = 1 << 30
U32 = 2.0 ** -24  # unit roundoff of fp32
UNIT_ROUNDOFF = {torch.float32: U32, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}

# the LM-head implementations of part a's rows
HEAD_PARITY = ("naive", "chunked", "triton", "triton loss", "liger", "cce")
# timed in this order: the kernels and their peers first, the torch baselines last
HEAD_TIMED = (("triton", "fwd"), ("triton", "fwd+bwd"), ("triton", "loss"), ("liger", "fwd"),
              ("liger", "fwd+bwd"), ("cce", "fwd"), ("cce", "fwd+bwd"), ("chunked", "fwd+bwd"),
              ("naive", "fwd+bwd"))
PART_NAMES = {"a": "a. head kernels", "b": "b. update", "c": "c. shared prefix",
              "d": "d. recompiles", "e": "e. head tiles"}
# the parts a short lease needs most first: the kernels, their tuning, the update; then c, and d,
# which resets dynamo (b compiles its own flex)
ORDER = ("a", "e", "b", "c", "d")
# of --budget, by part: b compiles FlexAttention forward and backward (~20 s) and runs 10 updates
# and an optimiser comparison; d compiles flex and its mask builder for two masks, twice
SHARE = {"a": 0.17, "e": 0.20, "b": 0.33, "c": 0.08, "d": 0.22}


@dataclass
class Shapes:
    """What each part runs at: the device's shapes, or --dry's tiny ones."""
    dtype: torch.dtype
    peak_n: int                 # the matmul peak's n x n x n
    head_H: int
    head_V: int
    parity_T: int
    timed_T: int
    timed_repeats: int
    timed_warmup: int
    workspace: int              # bytes of the kernels' dZ / logits workspace
    update_shape: dict          # bench_trainer's model shape (less the depth)
    update_layers: int
    update_tokens: tuple        # T a micro-batch of part b's two rows
    update_repeats: int
    flex_tiny: bool             # bench_attention.qwen_layers(smoke=...)
    probe_intermediate: int     # the probe's MLP width: its activations stay far below dense
    probe_lengths: tuple
    shared_groups: tuple        # (prompt, answer lengths) per group of part c's row
    case_seconds: dict          # the least time a case of each part needs: skipped below it
    compile_backend: str | None  # None: torch.compile's default (inductor)


def expected_rows(sh: Shapes) -> dict[str, list[str]]:
    """The cases of each part's rows: a part that fails or is skipped still writes every one."""
    return {"a": [f"parity {impl}" for impl in HEAD_PARITY]
                 + [f"{impl} {mode}" for impl, mode in HEAD_TIMED],
            "d": ["recompiles", "dense fallback"],
            "c": ["forward", "gradients"],
            "b": ["start"] + [f"update {T} tokens" for T in sh.update_tokens]
                 + [f"update {min(sh.update_tokens)} tokens, compiled layers", "optimiser step"],
            "e": ["fp32 tau 0.7 offset", "forward tiles", "gemm then reduce", "training modes",
                  "loss variants"]}


GPU_SHAPES = Shapes(
    dtype=torch.bfloat16, peak_n=8192, head_H=3584, head_V=152064, parity_T=1000, timed_T=16384,
    timed_repeats=3, timed_warmup=1, workspace=1 << 30, update_shape=bench_trainer.QWEN25_7B,
    update_layers=8, update_tokens=(16384, 32768), update_repeats=2, flex_tiny=False,
    probe_intermediate=1024, probe_lengths=tuple(8192 + 331 * i for i in range(10)),
    shared_groups=((2000, (400, 700, 250, 550)), (1500, (600, 330))),
    case_seconds={"a": 5, "b": 40, "c": 20, "d": 5, "e": 8}, compile_backend=None)

DRY_SHAPES = Shapes(
    dtype=torch.float32, peak_n=256, head_H=96, head_V=1000, parity_T=70, timed_T=70,
    timed_repeats=1, timed_warmup=0, workspace=1 << 30, update_shape=bench_trainer.TINY,
    update_layers=2, update_tokens=(128, 256), update_repeats=1, flex_tiny=True,
    probe_intermediate=128, probe_lengths=tuple(96 + 13 * i for i in range(10)),
    shared_groups=((150, (40, 70, 25, 31)), (90, (60, 33))),
    case_seconds={"a": 0.5, "b": 2, "c": 1, "d": 0.5, "e": 0.5}, compile_backend="eager")


# --------------------------------------------------------------------------------------------------
# The report: one table, written as it grows
# --------------------------------------------------------------------------------------------------

class Report:
    """The table's rows (part, case, result, detail, ok) with their raw numbers, and the header.
    Every add() rewrites gpu_check.md and gpu_check.json in `out`: a killed run keeps its rows."""

    def __init__(self, out: Path | None):
        self.out, self.meta, self.rows, self.raw = out, {}, [], {}
        if out:
            out.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, case: str, result: str, detail: str = "", ok: bool | None = None,
            **values) -> None:
        row = dict(part=part, case=case, result=result, detail=detail,
                   ok=None if ok is None else bool(ok), values=values)
        self.rows.append(row)
        flag = "" if ok is None else " [ok]" if ok else " [NOT OK]"
        print(f"# {PART_NAMES.get(part, part)} | {case}: {result}{flag}", flush=True)
        self.write()

    def has(self, part: str, case: str) -> bool:
        return any(r["part"] == part and r["case"] == case for r in self.rows)

    def markdown(self) -> str:
        lines = [f"# gpu_check: {self.meta.get('device', '?')}, {self.meta.get('date', '?')}", ""]
        lines += [f"- {key}: {value}" for key, value in self.meta.items()]
        lines += ["", "| part | case | result | detail | ok |", "|---|---|---|---|---|"]
        for r in self.rows:
            ok = "" if r["ok"] is None else "yes" if r["ok"] else "**NO**"
            cells = [PART_NAMES.get(r["part"], r["part"]), r["case"], r["result"], r["detail"], ok]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if not self.out:
            return
        (self.out / "gpu_check.md").write_text(self.markdown())
        doc = {"meta": self.meta, "rows": self.rows, "raw": self.raw}
        (self.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))


def fmt(x: float | None, digits: int = 2) -> str:
    """A number for the table: None as n/a, small or large ones in e-notation."""
    if x is None:
        return "n/a"
    if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e6):
        return f"{x:.{digits}g}" if abs(x) >= 1e6 else f"{x:.1e}"
    return f"{x:.{digits}f}"


# --------------------------------------------------------------------------------------------------
# Time guards
# --------------------------------------------------------------------------------------------------

class PartTimeout(BaseException):
    """A part ran past its hard guard (SIGALRM). Not an Exception: the handlers that turn one
    case's failure into its row must let it through to the part."""


@contextlib.contextmanager
def hard_guard(seconds: float):
    """Raise PartTimeout in this (main) thread once `seconds` have passed: a compile or a step
    that hangs costs its part, not the rest of the table."""
    def expire(*_):
        raise PartTimeout(f"stopped by its time guard after {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Deadline:
    """The time a part may run until; `fits(s)`: can a case of about s seconds still start?"""

    def __init__(self, until: float):
        self.until = until

    def left(self) -> float:
        return self.until - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


@contextlib.contextmanager
def compile_backend(backend: str | None):
    """--dry: every torch.compile made inside (transformers' compiled flex_attention, the compiled
    create_block_mask of masking_utils) gets `backend` unless it names one. Dynamo still traces,
    guards and recompiles as on the device; only the code generation is skipped."""
    if backend is None:
        yield
        return
    real = torch.compile

    def compile_with_backend(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return real(*args, **kwargs)

    torch.compile = compile_with_backend
    try:
        yield
    finally:
        torch.compile = real


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return "error: " + (text[:180] + "..." if len(text) > 180 else text)


# --------------------------------------------------------------------------------------------------
# a. LM-head kernels: parity against float64, and speed beside the peers
# --------------------------------------------------------------------------------------------------

def head_pass(impl: str, x, w, y, g, tau: float, workspace: int):
    """logp, entropy (None for a peer), dX, dW of L = sum_t g_t logp_t through `impl`; "reference"
    is the textbook formula in x's dtype (float64 for the reference)."""
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    entropy = None
    if impl == "triton loss":  # dX and dW are made in the forward; backward() only scales them
        loss, logp, entropy = kernels.fused_logprob_loss(xr, wr, y, g, tau, backend="triton",
                                                         workspace_bytes=workspace)
    else:
        if impl in bench_logprob.PEERS:
            logp = bench_logprob.peer_logprob(impl, xr, wr, y)
        elif impl == "naive":
            logp, entropy = bench_logprob.naive_logprob(xr, wr, y, tau)
        elif impl == "chunked":
            logp, entropy = kernels.chunked_logprob(xr, wr, y, tau, workspace_bytes=workspace)
        elif impl == "triton":
            logp, entropy = kernels.fused_logprob(xr, wr, y, tau, backend="triton",
                                                  workspace_bytes=workspace)
        else:
            logp, entropy = kernels.fused_logprob_reference(xr, wr, y, tau)
        loss = (g.to(logp.dtype) * logp).sum()
    loss.backward()
    return (logp.detach(), None if entropy is None else entropy.detach(), xr.grad, wr.grad)


def head_errors(got, want) -> dict:
    """logp and entropy: max absolute error; dX, dW: max |error| / max |reference|."""
    err = {"logp": (got[0].double() - want[0]).abs().max().item(),
           "entropy": None if got[1] is None else (got[1].double() - want[1]).abs().max().item()}
    for name, a, b in (("dX", got[2], want[2]), ("dW", got[3], want[3])):
        err[name] = ((a.double() - b).abs().max() / b.abs().max()).item()
    return err


def head_bounds(impl: str, dtype: torch.dtype, T: int, H: int, V: int, S: float,
                Z: float) -> dict:
    """How far from float64 an implementation may be, from its arithmetic alone.

    A logit z = sum_h x_h w_h over H terms, accumulated in fp32, is off by about sqrt(H) u32 S
    (independent roundings of partial sums no larger than S = max_{t,v} sum_h |x_th w_vh|), plus
    u Z where the path stores the logits in the input dtype (naive and Liger: `x @ w.T` in bf16;
    u that dtype's unit roundoff, Z = max |z|): e_z. logp = z_y - lse moves by e_z through z_y and
    by sum_v p_v e_z through lse, and the fp32 sum of V exponentials adds sqrt(V) u32 to lse; the
    entropy, lse - sum_v p_v z_v, also feels each p_v's error times |z_v| <= Z: (2 + Z) e_z +
    sqrt(V) u32 covers both. The gradients dZ = g (1[y] - p) carry p's error (the same term) and
    the fp32 GEMMs' sqrt(max(T, V)) u32; a 16-bit path rounds dZ to the input dtype for the GEMMs
    and dX, dW once more on the way out: 2u. Each is a typical size; the max over all entries is
    allowed 4x. fp32 inputs: u = u32, so only the accumulation terms remain.
    """
    u = UNIT_ROUNDOFF[dtype]
    stores_logits = impl in ("naive", "liger") and dtype != torch.float32
    e_z = math.sqrt(H) * U32 * S + (u * Z if stores_logits else 0.0)
    stat = 4 * ((2 + Z) * e_z + math.sqrt(V) * U32)
    grad = 4 * ((2 + Z) * e_z + math.sqrt(max(T, V)) * U32 + 2 * u)
    return {"logp": stat, "entropy": stat, "dX": grad, "dW": grad}


def head_parity(rep: Report, sh: Shapes, device, deadline: Deadline) -> None:
    T, H, V, tau = sh.parity_T, sh.head_H, sh.head_V, 1.0  # the peers have no temperature
    x, w, y, g = bench_logprob.make_inputs(T, H, V, sh.dtype, device)
    want = head_pass("reference", x.double(), w.double(), y, g.double(), tau, sh.workspace)
    S = (x.double().abs() @ w.double().abs().T).max().item()
    Z = (x.double() @ w.double().T).abs().max().item()
    rep.raw["head_parity_inputs"] = dict(T=T, H=H, V=V, tau=tau, dtype=str(sh.dtype), S=S, Z=Z)
    for impl in HEAD_PARITY:
        case = f"parity {impl}"
        base = impl.split()[0]
        if base in bench_logprob.PEERS and not bench_logprob.peer_available(base):
            rep.add("a", case, "not installed", "carry its wheel (.whl/, bench/RESULTS.md)")
            continue
        if not deadline.fits(sh.case_seconds["a"]):
            rep.add("a", case, "skipped: time budget")
            continue
        try:
            err = head_errors(head_pass(impl, x, w, y, g, tau, sh.workspace), want)
        except Exception as e:  # a failing implementation is a row, not the end of the table
            rep.add("a", case, error_text(e))
            free_memory(device)
            continue
        bound = head_bounds(base, sh.dtype, T, H, V, S, Z)
        ok = all(err[k] is None or err[k] <= bound[k] for k in err)
        rep.add("a", case,
                " / ".join(fmt(err[k], 2) for k in ("logp", "entropy", "dX", "dW")),
                "logp / entropy / dX / dW vs float64; bound "
                + " / ".join(fmt(bound[k], 2) for k in ("logp", "entropy", "dX", "dW"))
                + (" (CCE drops small gradient terms by design: filter_eps 'high')"
                   if base == "cce" else ""),
                ok, errors=err, bounds=bound)
        free_memory(device)
    del want, x, w, y, g
    free_memory(device)


def head_speed(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    T, H, V, tau = sh.timed_T, sh.head_H, sh.head_V, 1.0
    x, w, y, g = bench_logprob.make_inputs(T, H, V, sh.dtype, device)
    credit = {"fwd": 2, "fwd+bwd": 8, "loss": 6}
    for impl, mode in HEAD_TIMED:
        case = f"{impl} {mode}"
        if impl in bench_logprob.PEERS and not bench_logprob.peer_available(impl):
            rep.add("a", case, "not installed", "carry its wheel (.whl/, bench/RESULTS.md)")
            continue
        if not deadline.fits(sh.case_seconds["a"]):
            rep.add("a", case, "skipped: time budget")
            continue
        flops = credit[mode] * T * H * V
        try:
            sec, mem = bench_logprob.measure(impl, mode, x.detach(), w.detach(), y, g, tau,
                                             sh.workspace, sh.timed_repeats, sh.timed_warmup)
        except torch.OutOfMemoryError:
            free_memory(device)
            rep.add("a", case, "OOM", f"T {T}")
            continue
        except Exception as e:  # a peer's failure (its API, its kernels) is its row
            free_memory(device)
            rep.add("a", case, error_text(e))
            continue
        tflops = flops / sec / 1e12
        rep.add("a", case, f"{sec * 1e3:.1f} ms, {tflops:.3g} TFLOP/s, "
                f"{100 * tflops / peak:.0f}% of peak",
                f"T {T}, credited {credit[mode]}THV; peak extra "
                + ("memory n/a (CPU)" if mem is None else f"{mem / GiB:.2f} GiB"),
                seconds=sec, tflops=tflops, peak_fraction=tflops / peak,
                peak_extra_gib=None if mem is None else mem / GiB, T=T)
    del x, w, y, g
    free_memory(device)


def part_head(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    head_parity(rep, sh, device, deadline)
    head_speed(rep, sh, device, peak, deadline)


# --------------------------------------------------------------------------------------------------
# Rows for parts c and d: packed rows of exactly T tokens, a Qwen2.5-7B-shaped decoder
# --------------------------------------------------------------------------------------------------

def split_lengths(n: int, k: int, gen: torch.Generator) -> list[int]:
    """k positive lengths of about n / k each (0.5x to 1.5x), summing to n."""
    weights = 0.5 + torch.rand(k, generator=gen)
    lengths = (weights / weights.sum() * n).long().clamp(min=1)
    lengths[-1] += n - lengths.sum()
    assert lengths.min() >= 1 and lengths.sum() == n, (n, k, lengths)
    return lengths.tolist()


def random_ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def shared_row(groups, vocab: int, gen: torch.Generator) -> dict:
    """spell.pack_sequences(shared=True) of groups (prompt length, answer lengths)."""
    pairs = []
    for prompt_len, answers in groups:
        prompt = random_ids(prompt_len, vocab, gen)
        pairs += [(prompt, random_ids(n, vocab, gen)) for n in answers]
    return spell.pack_sequences(pairs, shared=True)


def probe_row(T: int, kind: str, vocab: int, seed: int) -> dict:
    """A row of exactly T tokens: "tree", two responder groups sharing their prompts (60 % of the
    group) with 4 answers each; "packed", 5 unshared sequences, 90 % prompt."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "tree":
        groups = []
        for size in split_lengths(T, 2, gen):
            prompt = max(1, int(0.6 * size))
            groups.append((prompt, split_lengths(size - prompt, 4, gen)))
        packed = shared_row(groups, vocab, gen)
    else:
        pairs = []
        for size in split_lengths(T, 5, gen):
            prompt = min(size - 1, max(1, int(0.9 * size)))
            pairs.append((random_ids(prompt, vocab, gen), random_ids(size - prompt, vocab, gen)))
        packed = spell.pack_sequences(pairs)
    assert packed["input_ids"].shape[1] == T, (kind, T, packed["input_ids"].shape)
    return packed


def decoder(sh: Shapes, layers: int, device, intermediate: int | None = None):
    """A random Qwen2ForCausalLM with Qwen2.5-7B's decoder layer (28 query and 4 KV heads of 128;
    --dry: bench_attention's tiny layout, 7 heads on 1), vocabulary 1024, in the compute dtype,
    in train mode without dropout as the trainer runs it."""
    from transformers import Qwen2ForCausalLM
    config = bench_attention.qwen_layers(layers, sh.flex_tiny, 32768)
    if intermediate:
        config.intermediate_size = intermediate
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config).to(sh.dtype)
    infra.train_mode_without_dropout(model)
    return model


def last_hidden(model, packed: dict, device) -> torch.Tensor:
    """The decoder's output (T, H) on a packed row, with the mask packed_logprobs would build."""
    dtype = model.lm_head.weight.dtype
    mask = infra.tree_attention_mask(packed, model.config._attn_implementation, device,
                                     infra.mask_dtype(device, dtype))
    return model.model(input_ids=packed["input_ids"].to(device),
                       position_ids=packed["position_ids"].to(device), attention_mask=mask,
                       use_cache=False).last_hidden_state[0].float()


def weighted_logprob_loss(model, packed: dict, weights: torch.Tensor) -> torch.Tensor:
    """sum_t w_t logp_t of the row's completion tokens, the trainer's path (chunked torch head)."""
    logp = infra.packed_logprobs(model, packed, 1.0, "torch")[0]  # (N,)
    return (weights * logp).sum()


# --------------------------------------------------------------------------------------------------
# d. The recompile probe
# --------------------------------------------------------------------------------------------------

class DynamoLog(logging.Handler):
    """Counts what dynamo logs: "Recompiling function NAME" (the recompiles artifact, switched on
    with torch._logging.set_logs(recompiles=True)) and "hit config.recompile_limit"."""

    def __init__(self):
        super().__init__()
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Recompiling function"):
            self.recompiles.append(msg.split()[2])
        elif "hit config." in msg:
            self.limit_hits.append(msg.splitlines()[0][:160])


def cache_entries(fn) -> int | None:
    """Compiled variants dynamo holds for fn's code object (None where torch cannot say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return len(_debug_get_cache_entry_list(fn.__code__))
    except (ImportError, AttributeError, TypeError):
        return None


@contextlib.contextmanager
def dense_flex_calls(armed: bool):
    """Count the calls of torch's dense FlexAttention on real tensors (its eager forward and
    backward build the (H, T, T) scores in `_math_attention_inner`; a fused call never runs it;
    the idea is tests/test_flex_lengths.py's). Yields the list of their q shapes, or None where
    not armed: under --dry's eager backend every call runs that path by design."""
    module = importlib.import_module("torch._higher_order_ops.flex_attention")
    inner = getattr(module, "_math_attention_inner", None)
    if not armed or inner is None:
        yield None
        return
    calls = []

    def counted(query, *args, **kwargs):
        if type(query) in (torch.Tensor, torch.nn.Parameter):  # not a tracer's fake tensor
            calls.append(tuple(query.shape))
        return inner(query, *args, **kwargs)

    module._math_attention_inner = counted
    try:
        yield calls
    finally:
        module._math_attention_inner = inner


def probe_call(model, packed: dict, backward: bool, weights, device) -> dict:
    """One call of the trainer's path; its seconds, peak extra memory and whether torch's eager
    (unfused, dense) FlexAttention ran: it warns once per process, so its flag is cleared first."""
    from torch.nn.attention import flex_attention as flex_module
    getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
    cuda = device.type == "cuda"
    if cuda:  # the last call's tensors went with it: what is allocated now is the model's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if backward:
            model.zero_grad(set_to_none=True)
            weighted_logprob_loss(model, packed, weights).backward()
        else:
            with torch.no_grad():
                infra.packed_logprobs(model, packed, 1.0, "torch")
        sync(device)
    seconds = time.perf_counter() - t0
    unfused = any("without torch.compile" in str(w.message) for w in caught)
    peak = (torch.cuda.max_memory_allocated() - base) / GiB if cuda else None
    return {"seconds": seconds, "peak_extra_gib": peak, "unfused_warning": unfused}


def probe_calls(model, sh: Shapes, passes, device, deadline: Deadline,
                dense_log: list | None) -> tuple[list[dict], str | None]:
    """The probe's calls, lengths outermost (the recompiles happen over the first few, so a
    probe cut short still shows them); each call's record, and why the probe stopped early (its
    hard guard), if it did."""
    heads, vocab = model.config.num_attention_heads, model.config.vocab_size
    calls = []
    try:
        for i, T in enumerate(sh.probe_lengths):
            for kind in ("tree", "packed"):
                packed = probe_row(T, kind, vocab, seed=i)
                weights = torch.randn(len(packed["targets"]),
                                      generator=torch.Generator().manual_seed(i)).to(device)
                for backward in passes:
                    if not deadline.fits(sh.case_seconds["d"]):
                        return calls, None
                    call = {"T": T, "kind": kind, "backward": backward,
                            "dense_gib": heads * T * T * 2 / GiB}  # bf16 (H, T, T) scores
                    calls.append(call)
                    before = len(dense_log or ())
                    try:
                        call.update(probe_call(model, packed, backward, weights, device))
                        if dense_log is not None:
                            call["dense_path_calls"] = len(dense_log) - before
                    except torch.OutOfMemoryError as e:
                        call.update(error=error_text(e), oom=True)
                        free_memory(device)
                    except Exception as e:  # a failed compile is what the probe looks for
                        call["error"] = error_text(e)
    except PartTimeout as e:  # a compile that outlasts the guard: report the calls made so far
        if calls and "seconds" not in calls[-1]:  # the call it interrupted
            calls[-1]["error"] = error_text(e)
        return calls, error_text(e)
    return calls, None


def part_recompiles(rep: Report, sh: Shapes, device, deadline: Deadline, log: DynamoLog) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.reset()  # the probe starts from a fresh cache, as a trainer process does
    counters = torch._dynamo.utils.counters
    graphs0, recompiles0, hits0 = (counters["stats"]["unique_graphs"], len(log.recompiles),
                                   len(log.limit_hits))
    model = decoder(sh, 1, device, sh.probe_intermediate)
    model.set_attn_implementation("flex_attention")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # torch (2.13) has no CPU FlexAttention backward: on CPU the probe's calls are forward only
    passes = (False, True) if device.type == "cuda" else (False,)
    with dense_flex_calls(armed=sh.compile_backend is None) as dense_log:
        calls, stopped = probe_calls(model, sh, passes, device, deadline, dense_log)
    rep.raw["probe_calls"] = calls
    n_calls = len(sh.probe_lengths) * 2 * len(passes)
    done = [c for c in calls if "error" not in c]
    errors = [c for c in calls if "error" in c]
    recompiled = log.recompiles[recompiles0:]
    hits = log.limit_hits[hits0:]
    by_fn = {name: recompiled.count(name) for name in sorted(set(recompiled))}
    entries = {"flex_attention": cache_entries(flex_attention),
               "create_block_mask": cache_entries(create_block_mask)}
    limit = getattr(torch._dynamo.config, "recompile_limit",
                    getattr(torch._dynamo.config, "cache_size_limit", None))
    graphs = counters["stats"]["unique_graphs"] - graphs0
    seconds = [c["seconds"] for c in done]
    steady = statistics.median(seconds[len(seconds) // 2:]) if seconds else None
    skipped = n_calls - len(calls)
    cover = (f"{len(calls)} of {n_calls} calls ({skipped} skipped: time budget)" if skipped
             else f"{n_calls} calls")
    scope = (f"{cover}: lengths {sh.probe_lengths[0]}..{sh.probe_lengths[-1]} x tree/packed x "
             + ("no-grad fwd / fwd+bwd" if len(passes) == 2 else "no-grad fwd (no CPU backward)"))
    rep.add("d", "recompiles",
            f"{len(recompiled)} recompiles ("
            + (", ".join(f"{k} {v}" for k, v in by_fn.items()) or "none")
            + f"); recompile-limit hits {len(hits)}; errors {len(errors)}",
            f"{scope}; compiled entries kept: flex_attention {entries['flex_attention']}, "
            f"create_block_mask {entries['create_block_mask']} (limit {limit}); unique graphs "
            f"{graphs}; all calls {sum(seconds):.1f} s, steady call {fmt(steady, 3)} s"
            + (f"; first error: {errors[0]['error']}" if errors else "")
            + (f"; the probe was {stopped}" if stopped else ""),
            not hits and not errors and not skipped,
            recompiles=len(recompiled), by_function=by_fn, limit_hits=hits, errors=len(errors),
            cache_entries=entries, recompile_limit=limit, unique_graphs=graphs,
            calls=len(calls), skipped=skipped)
    dense = [c for c in done if c["unfused_warning"] or c.get("dense_path_calls")
             or (c["peak_extra_gib"] is not None and c["peak_extra_gib"] >= c["dense_gib"])]
    peaks = [c["peak_extra_gib"] for c in done if c["peak_extra_gib"] is not None]
    worst = max(done, key=lambda c: c["peak_extra_gib"] or 0.0) if done else None
    memory = ("peak extra memory not measured on CPU" if not peaks else
              f"largest peak extra {max(peaks):.2f} GiB (T {worst['T']}) against the dense path's "
              f"bf16 scores {worst['dense_gib']:.1f} GiB there")
    rep.add("d", "dense fallback",
            f"{len(dense)} of {len(done)} calls fell back to the unfused dense path",
            f"{memory}; unfused-flex warnings {sum(c['unfused_warning'] for c in done)}; "
            + (f"dense-path calls {sum(c.get('dense_path_calls', 0) for c in done)}"
               if sh.compile_backend is None
               else "dense-path calls not counted (the eager backend runs that path)")
            + (f"; OOM in {sum('oom' in c for c in errors)} calls" if errors else ""),
            not dense and not any("oom" in c for c in errors) and bool(done),
            fallbacks=len(dense), calls=len(done), max_peak_extra_gib=max(peaks, default=None))
    del model
    free_memory(device)


# --------------------------------------------------------------------------------------------------
# c. Shared-prefix FlexAttention against SDPA
# --------------------------------------------------------------------------------------------------

def attention_bounds(dtype: torch.dtype, layers: int, widest: int) -> tuple[float, float]:
    """How far two attention paths' outputs and gradients may be apart, relative to the largest
    entry. Each rounding on the way is eps = u + sqrt(n) u32 relative (u: the activations' unit
    roundoff, 2^-8 in bf16, 0 in fp32 where every value stays fp32; sqrt(n) u32 the fp32
    accumulation of the longest sum, n = max(H, MLP, T) terms). The forward rounds about 8 times a
    layer (norm, q/k/v, attention, o_proj, residual, norm, gate * up, down) plus the embedding and
    the final norm, k = 8 L + 2; the backward doubles it, k = 16 L + 4 (bench_trainer --check).
    Independent roundings add in quadrature, sqrt(k) eps; the max over many entries is allowed 4x;
    and each path carries its own: 2x for their difference."""
    u = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
    eps = u + math.sqrt(widest) * U32
    return (2 * 4 * math.sqrt(8 * layers + 2) * eps, 2 * 4 * math.sqrt(16 * layers + 4) * eps)


def part_shared_prefix(rep: Report, sh: Shapes, device, deadline: Deadline) -> None:
    layers = 2
    model = decoder(sh, layers, device)
    cfg = model.config
    packed = shared_row(sh.shared_groups, cfg.vocab_size, torch.Generator().manual_seed(0))
    T = packed["input_ids"].shape[1]
    # the mask a bug could build: every token sees its whole group causally, answers each other
    leaky = dict(packed, segment_ids=torch.zeros_like(packed["segment_ids"]))
    hidden = {}
    with torch.no_grad():
        for name, attn, row in (("sdpa", "sdpa", packed), ("flex", "flex_attention", packed),
                                ("leak", "sdpa", leaky)):
            model.set_attn_implementation(attn)
            hidden[name] = last_hidden(model, row, device)
    scale = hidden["sdpa"].abs().max()
    fwd = ((hidden["flex"] - hidden["sdpa"]).abs().max() / scale).item()
    leak = ((hidden["leak"] - hidden["sdpa"]).abs().max() / scale).item()
    fwd_bound, grad_bound = attention_bounds(
        sh.dtype, layers, max(cfg.hidden_size, cfg.intermediate_size, T))
    shape = (f"T {T}, groups of {len(sh.shared_groups[0][1])} and {len(sh.shared_groups[1][1])} "
             f"answers, {layers} layers, heads {cfg.num_attention_heads}/"
             f"{cfg.num_key_value_heads}, {str(sh.dtype).removeprefix('torch.')}")
    rep.add("c", "forward", f"flex - sdpa {fmt(fwd, 2)} of max |h|",
            f"bound {fmt(fwd_bound, 2)}; a leaking mask moves it {fmt(leak, 2)}; {shape}",
            fwd <= fwd_bound < leak, flex_vs_sdpa=fwd, leak=leak, bound=fwd_bound, T=T)
    del hidden
    if device.type != "cuda":
        rep.add("c", "gradients", "n/a: torch's CPU FlexAttention has no backward",
                f"bound {fmt(grad_bound, 2)}; {shape}")
        return
    weights = torch.randn(len(packed["targets"]), generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, attn in (("sdpa", "sdpa"), ("flex", "flex_attention")):
        model.set_attn_implementation(attn)
        model.zero_grad(set_to_none=True)
        weighted_logprob_loss(model, packed, weights.to(device)).backward()
        grads[name] = {n: p.grad.float().clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    ref_max = max(g.abs().max().item() for g in grads["sdpa"].values())
    diffs = {n: (grads["flex"][n] - g).abs().max().item() / ref_max
             for n, g in grads["sdpa"].items()}
    worst = max(diffs, key=diffs.get)
    rel = diffs[worst]
    rep.add("c", "gradients", f"flex - sdpa {fmt(rel, 2)} of max |grad|",
            f"bound {fmt(grad_bound, 2)}; worst tensor {worst}; {shape}", rel <= grad_bound,
            flex_vs_sdpa=rel, bound=grad_bound, worst=worst)
    del model, grads
    free_memory(device)


# --------------------------------------------------------------------------------------------------
# b. spell.update_policy on one GPU
# --------------------------------------------------------------------------------------------------

def extras(rep: Report, policy, optimizer, seqs, cfg, device, T: int, held: float, est: dict,
           first: bool, last: bool, deadline: Deadline, sh: Shapes) -> None:
    """Part b's rows beside each timed case: the peak split at the optimiser step; for the first
    length, where the update's time goes by kernel kind; for the last, what is alive at the peak."""
    if not deadline.fits(sh.case_seconds["b"] / 4):
        return
    try:
        marks = phase_peaks(policy, optimizer, seqs, cfg, device)
        if marks:
            rep.add("b", f"phases {T}",
                    f"backward {marks['backward'] - held:.2f} GiB, at the step "
                    f"{marks['at_step'] - held:.2f}, step {marks['step'] - held:.2f}",
                    "GiB allocated at most before the optimiser step, when it starts, at most "
                    f"during it; estimate's update phase {est['update_phase']:.2f}", None,
                    **{k: v - held for k, v in marks.items()})
        if first and deadline.fits(sh.case_seconds["b"] / 4):
            prof = profiled_update(policy, optimizer, seqs, cfg, device, rep.out)
            rep.add("b", f"profile {T}",
                    f"kernels {prof['kernel_s']:.2f} s of {prof['wall_s']:.2f} s wall: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in prof["by_kind"].items()),
                    "one update under torch.profiler (its overhead included in the wall time); "
                    "seconds of device time by kernel kind; the top kernels in "
                    "update_profile.txt", None, **prof)
        if last and device.type == "cuda" and deadline.fits(sh.case_seconds["b"] / 4):
            br = recorded_update(policy, optimizer, seqs, cfg, device)
            rep.add("b", f"peak owners {T}",
                    f"peak {br['peak_gib'] - held:.2f} GiB = {br['base_gib'] - held:.2f} held "
                    f"before the update + {br['made_since_gib']:.2f} made in it and alive",
                    "; ".join(f"{k} {v:.2f} GiB ({n})" for k, v, n in br["owners"]), None, **br)
    except torch.OutOfMemoryError:
        policy.reshard()
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        rep.add("b", f"phases {T}", "OOM in an instrumented update")
    except Exception as e:  # an instrument that fails is a row, not the end of the part
        rep.add("b", f"extras {T}", error_text(e))
        traceback.print_exc()


def phase_peaks(policy, optimizer, seqs, cfg, device) -> dict:
    """One update with its peak split at the optimiser step: GiB allocated at most before the step
    (forwards, backwards, the clip), when the step starts, and at most during the step."""
    if device.type != "cuda":
        spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
        return {}
    marks = {}

    def before_step(*_):
        torch.cuda.synchronize()
        marks["backward"] = torch.cuda.max_memory_allocated() / GiB
        marks["at_step"] = torch.cuda.memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()

    hook = optimizer.register_step_pre_hook(before_step)
    try:
        free_memory(device)
        torch.cuda.reset_peak_memory_stats()
        spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
        torch.cuda.synchronize()
        marks["step"] = torch.cuda.max_memory_allocated() / GiB
    finally:
        hook.remove()
    return marks


# Where an allocation made at the peak came from: the innermost frame in one of these files, else
# the innermost frame, else (an allocation of autograd's C++ engine, which has no Python frame) its
# size, which names its shape well enough at these sizes
OWNERS = ("spell.py", "infra.py", "kernels/", "transformers/", "torch/distributed/fsdp",
          "torch/optim", "torch/utils/checkpoint", "torch/nn/attention", "torch/nn/functional")


def allocation_owner(frames: list, size: int) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(key in name for key in OWNERS):
            return f"{name.split('site-packages/')[-1].split('/')[-1]}:{frame.get('name', '?')}"
    if frames:
        return f"{frames[0].get('filename', '?').split('/')[-1]}:{frames[0].get('name', '?')}"
    return f"no Python frame, {size / 2**20:.0f} MiB blocks"


def peak_breakdown(trace: list[dict], base: int, top: int = 14) -> dict:
    """Replay a CUDA caching-allocator trace (torch.cuda.memory._snapshot()'s device_traces[i]):
    from `base` bytes allocated when recording began, add each alloc and subtract each completed
    free; at the highest point, the live allocations made since, grouped by allocation_owner.
    Frees of blocks allocated before the recording lower the total but name no owner."""
    total = peak = base
    at = -1
    for i, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            total += event["size"]
        elif action == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, at = total, i
    live: dict[int, dict] = {}
    for event in trace[:at + 1]:
        if event.get("action") == "alloc":
            live[event["addr"]] = event
        elif event.get("action") == "free_completed":
            live.pop(event["addr"], None)
    owners: dict[str, list] = {}
    for event in live.values():
        owner = allocation_owner(event.get("frames") or [], event["size"])
        entry = owners.setdefault(owner, [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(owners.items(), key=lambda kv: -kv[1][0])
    made = sum(v[0] for v in owners.values())
    return {"peak_gib": peak / GiB, "base_gib": base / GiB, "made_since_gib": made / GiB,
            "owners": [(k, v[0] / GiB, v[1]) for k, v in ranked[:top]],
            "events": len(trace), "peak_event": at}


def recorded_update(policy, optimizer, seqs, cfg, device) -> dict:
    """One update under the CUDA allocator's recorder (Python frames only: C++ stacks would take
    minutes to symbolise), replayed by peak_breakdown."""
    memory = torch.cuda.memory
    free_memory(device)
    base = torch.cuda.memory_allocated()
    memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
        torch.cuda.synchronize()
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    index = torch.cuda.current_device()
    return peak_breakdown(snapshot["device_traces"][index], base)


KERNEL_KINDS = (("GEMM (cuBLAS)", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas")),
                ("attention (flex)", ("flex", "triton_tem")),
                ("LM head (Triton)", ("_logprob",)),
                ("optimiser", ("adam", "multi_tensor")),
                ("communication, copies", ("nccl", "memcpy", "memset", "copy", "cat")),
                ("fused elementwise (inductor)", ("triton_poi", "triton_red", "triton_per")))


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(key in lower for key in keys):
            return kind
    return "other (eager elementwise, norms, ...)"


def profiled_update(policy, optimizer, seqs, cfg, device, out: Path | None) -> dict:
    """One update under torch.profiler: the device time of its kernels by kind (KERNEL_KINDS),
    against the update's wall time; the top kernels' table goes to $OUT/update_profile.txt."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
        sync(device)
    wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if "#" in event.key or event.key.startswith(("FSDP::", "ProfilerStep")):
            continue  # a range marked on the GPU's timeline (Optimizer.step#AdamW.step), no kernel
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        kinds[kernel_kind(event.key)] = kinds.get(kernel_kind(event.key), 0.0) + us / 1e6
    if out:
        for sort in (("self_device_time_total", "self_cuda_time_total")
                     if device.type == "cuda" else ()) + ("self_cpu_time_total",):
            try:  # the sort key's name moved between torch versions
                table = prof.key_averages().table(sort_by=sort, row_limit=40)
            except (AttributeError, KeyError, ValueError):
                continue
            (out / "update_profile.txt").write_text(table)
            break
    return {"wall_s": wall, "kernel_s": sum(kinds.values()),
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def optimizer_steps(policy, cfg, device) -> list[dict]:
    """AdamW's step on the policy's shards in torch's three implementations: seconds (median of
    3 after one) and GiB allocated beyond what the step starts with."""
    rows = []
    for name, kwargs in (("fused", dict(fused=True)), ("foreach", dict(foreach=True)),
                         ("loop", dict(foreach=False))):
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay, **kwargs)
        infra.create_optimizer_state(optimizer)
        for p in policy.parameters():
            p.grad = torch.full_like(p, 1e-4)
        try:
            optimizer.step()
            times = []
            free_memory(device)
            start = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                optimizer.step()
                sync(device)
                times.append(time.perf_counter() - t0)
            extra = ((torch.cuda.max_memory_allocated() - start) / GiB
                     if device.type == "cuda" else None)
            rows.append(dict(impl=name, seconds=statistics.median(times), extra_gib=extra))
        except torch.OutOfMemoryError:
            rows.append(dict(impl=name, error="OOM"))
        finally:
            optimizer.zero_grad(set_to_none=True)
            del optimizer
            free_memory(device)
    return rows


def update_row(rep: Report, case: str, policy, optimizer, cfg, config, sh: Shapes, device,
               peak: float, T: int, held: float, device_gib: float, layers: int, attn: str,
               log: DynamoLog) -> tuple | None:
    """One timed case of part b: two packed rows of T tokens through spell.update_policy, its
    tokens/s, MFU and peak against infra.memory_estimate; (the batch, the estimate), or None on
    an OOM (written as the row)."""
    cfg.engine.micro_batch_tokens = T
    seqs = bench_trainer.update_batch(T, 2, config.vocab_size, cfg, seed=T)
    longest = max(len(p) + len(c) for p, c, *_ in seqs)
    est = infra.memory_estimate(cfg, config, world=1, device_gib=device_gib, longest=longest)
    tokens = sum(len(p) + len(c) for p, c, *_ in seqs)
    flops = bench_trainer.model_flops(config, seqs)
    recompiles0, hits0 = len(log.recompiles), len(log.limit_hits)
    try:
        sec, mem, stats = bench_trainer.time_updates(policy, optimizer, seqs, cfg, device,
                                                     sh.update_repeats)
    except torch.OutOfMemoryError:
        policy.reshard()  # FSDP2: drop what the failed forward or backward gathered
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        rep.add("b", case, "OOM", f"estimate {est['update_phase']:.1f} GiB",
                estimate_gib=est["update_phase"])
        return None
    cuda = device.type == "cuda"
    tflops = flops / sec / 1e12
    own = None if mem is None else mem - held
    ok = None if own is None else own <= est["update_phase"]
    rep.add("b", case,
            f"{tokens / sec:,.0f} tokens/s, MFU {100 * tflops / peak:.1f}%, peak "
            f"{fmt(own, 1)} GiB vs estimate {est['update_phase']:.1f} GiB",
            f"{sec:.2f} s/update of {stats['micro_batches']:.0f} x {T} tokens "
            f"({len(seqs)} seqs); {layers} of 28 layers, {attn}, head "
            f"{cfg.engine.logprob_impl} (one pass: {spell.fused_head(cfg)}); "
            f"{tflops:.3g} model TFLOP/s; recompiles here "
            f"{len(log.recompiles) - recompiles0}, recompile-limit hits "
            f"{len(log.limit_hits) - hits0}"
            + (f"; {held:.2f} GiB held by earlier parts" if held else ""),
            ok, seconds=sec, tokens=tokens, tokens_per_s=tokens / sec, tflops=tflops,
            mfu=tflops / peak, peak_gib=own, held_before_gib=held, estimate=est,
            layers=layers, T=T,
            reserved_gib=torch.cuda.max_memory_reserved() / GiB if cuda else None)
    return seqs, est


def part_update(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline,
                layers: int, log: DynamoLog) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    cfg = spell.load_config(str(spell.ROOT / "config.toml"))  # the paper's recipe
    _, world, device = spell.init_distributed(cfg)  # a world of one on a free local port
    cuda = device.type == "cuda"
    try:
        mesh = init_device_mesh(device.type, (world,))
        if not cuda:
            cfg.engine.logprob_impl = "torch"  # Triton's interpreter: minutes at these shapes
        config = bench_trainer.model_config(sh.update_shape, layers, max(sh.update_tokens))
        attn = infra.attention_implementation(cfg, on_gpu=cuda)
        free_memory(device)
        # what earlier parts left allocated (~0): the update's own peak is the peak less this
        held = torch.cuda.memory_allocated() / GiB if cuda else 0.0
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # part a's peaks are not this part's
        policy = bench_trainer.build_policy(config, cfg, mesh, spell.compute_dtype(device),
                                            init_on=device)
        optimizer = spell.make_optimizer(policy, cfg)  # as spell.load_policy
        infra.create_optimizer_state(optimizer)
        device_gib = torch.cuda.get_device_properties(device).total_memory / GiB if cuda else 0.0
        P = sum(p.numel() for p in policy.parameters())
        started = torch.cuda.max_memory_allocated() / GiB - held if cuda else None
        rep.add("b", "start", f"peak {fmt(started, 2)} GiB building the policy and its AdamW "
                f"state; 12P = {12 * P / GiB:.2f} GiB",
                f"P {P / 1e9:.3f} B parameters in one shard (fp32 weights 4P, two moments 8P)",
                None, peak_gib=started, parameters=P)
        for T in sh.update_tokens:
            case = f"update {T} tokens"
            if not deadline.fits(sh.case_seconds["b"]):
                rep.add("b", case, "skipped: time budget")
                continue
            ran = update_row(rep, case, policy, optimizer, cfg, config, sh, device, peak, T,
                             held, device_gib, layers, attn, log)
            if ran is not None:
                extras(rep, policy, optimizer, ran[0], cfg, device, T, held, ran[1],
                       first=T == min(sh.update_tokens), last=T == max(sh.update_tokens),
                       deadline=deadline, sh=sh)
        # engine.compile_layers at the first length, on the same shards (nn.Module.compile works in
        # place after fully_shard): inductor's compile of the layer, forward and backward, falls
        # in time_updates' warm-up
        T = min(sh.update_tokens)
        case = f"update {T} tokens, compiled layers"
        if not deadline.fits(3 * sh.case_seconds["b"]):
            rep.add("b", case, "skipped: time budget")
        else:
            infra.compile_decoder_layers(policy, device.type)
            update_row(rep, case, policy, optimizer, cfg, config, sh, device, peak, T, held,
                       device_gib, layers, attn, log)
        if deadline.fits(sh.case_seconds["b"]):
            rows = optimizer_steps(policy, cfg, device)
            rep.add("b", "optimiser step", "; ".join(
                f"{r['impl']} " + (r["error"] if "error" in r else
                                   f"{1e3 * r['seconds']:.0f} ms, +{fmt(r['extra_gib'], 2)} GiB")
                for r in rows), f"AdamW over the {P / 1e9:.3f} B parameters of one shard, "
                f"torch's three implementations; + GiB allocated beyond the step's start", None,
                rows=rows)
        del policy, optimizer
        free_memory(device)
    finally:
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Header, the parts in order, and the command line
# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# e. The head kernels' tiles and variants, for tuning on the device (issue #43, items 2 and 3)
# --------------------------------------------------------------------------------------------------

# Candidate tiles for the forward statistics (bm, bn, bk, split, group_m, num_warps, num_stages);
# the first is the bf16 table's before 2026-11-28, the second today's (bench/RESULTS.md).
FWD_TILES = ((128, 128, 64, 2048, 8, 8, 3), (128, 256, 64, 2048, 8, 8, 4),
             (128, 256, 64, 4096, 8, 8, 4), (128, 256, 64, 1024, 8, 8, 4),
             (256, 128, 64, 2048, 8, 8, 4), (128, 256, 64, 2048, 4, 8, 4),
             (128, 256, 64, 2048, 8, 8, 5), (128, 256, 128, 2048, 8, 8, 3))


def timed(fn, device, repeats: int, warmup: int) -> tuple[float, float | None]:
    """(median seconds, peak extra GiB or None on CPU) of fn() after warm-up calls."""
    for _ in range(warmup):
        fn()
    free_memory(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    extra = ((torch.cuda.max_memory_allocated() - base) / GiB if device.type == "cuda" else None)
    return statistics.median(times), extra


@triton.jit
def row_stats_kernel(z_ptr, y_ptr, m_ptr, s_ptr, r_ptr, zy_ptr, T, V, inv_tau,
                     BM: tl.constexpr, BN: tl.constexpr):
    """Online statistics (kernels/logprob.py's m, s, r, z_y) of BM rows of stored fp32 logits
    [T, V], one BN-wide tile at a time: one pass over each row, no GEMM."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok = rows < T
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BM,), dtype=tl.float32)
    r = tl.zeros((BM,), dtype=tl.float32)
    zy = tl.zeros((BM,), dtype=tl.float32)
    for v0 in range(0, V, BN):
        cols = v0 + tl.arange(0, BN)
        col_ok = cols < V
        z = tl.load(z_ptr + rows[:, None] * V + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0) * inv_tau
        z = tl.where(col_ok[None, :], z, float("-inf"))
        zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        shift = tl.where(m == float("-inf"), 0.0, m - m_new)
        d = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.exp(z - m_new[:, None])
        r = alpha * (r + shift * s) + tl.sum(e * d, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    tl.store(r_ptr + rows, r, mask=row_ok)
    tl.store(zy_ptr + rows, zy, mask=row_ok)


def gemm_then_reduce(x, w, y, inv_tau: float, chunk: int):
    """A candidate forward: per token chunk, the logits from one cuBLAS GEMM into fp32 (torch.mm
    out_dtype), then one Triton pass over each row for the online statistics, merged by the
    project's merge kernel. Writes and reads [chunk, V] fp32 logits: 8 bytes a logit of traffic."""
    from kernels import logprob as lp
    from kernels.reference import mm_fp32

    T, V = x.shape[0], w.shape[0]
    partials = torch.empty(4, 1, T, dtype=torch.float32, device=x.device)
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        z = mm_fp32(x[t0:t0 + n], w.T)  # (n, V) fp32
        row_stats_kernel[(triton.cdiv(n, 16),)](
            z, y[t0:t0 + n], partials[0, 0, t0:], partials[1, 0, t0:], partials[2, 0, t0:],
            partials[3, 0, t0:], n, V, inv_tau, BM=16, BN=512, num_warps=8)
        del z
    logp = torch.empty(T, dtype=torch.float32, device=x.device)
    ent, norm = torch.empty_like(logp), torch.empty(2, T, dtype=torch.float32, device=x.device)
    lp._logprob_merge_kernel[(triton.cdiv(T, 128),)](
        partials[0], partials[1], partials[2], partials[3], logp, ent, norm[0], norm[1], T, 1,
        BLOCK=128, num_warps=4)
    return logp, ent


def tiles_sweep(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    """The forward statistics (the old-log-prob pass) at each candidate tile, and the candidate
    GEMM-then-reduce forward, at part a's timed shape; logp of each against the default tiles'."""
    from kernels import logprob as lp
    T, H, V = sh.timed_T, sh.head_H, sh.head_V
    x, w, y, _ = bench_logprob.make_inputs(T, H, V, sh.dtype, device)
    flops = 2 * T * H * V
    results, base = [], None
    tiles = FWD_TILES if device.type == "cuda" else (None,)  # the interpreter: its own tiles
    for spec in tiles:
        if not deadline.fits(sh.case_seconds["e"]):
            break
        t = lp.pick_tiles(sh.dtype, T, H, V) if spec is None else lp.Tiles(*spec)
        try:
            run = lambda t=t: lp._forward_stats(x, w, y, 1.0, t)  # noqa: E731
            sec, _ = timed(run, device, sh.timed_repeats, sh.timed_warmup)
            logp = run()[0]
        except Exception as e:  # a tile the compiler refuses (shared memory) is a row detail
            results.append((spec, None, error_text(e)[:80]))
            free_memory(device)
            continue
        base = logp if base is None else base
        diff = (logp - base).abs().max().item()
        results.append((spec, flops / sec / 1e12, f"logp vs first {fmt(diff, 2)}"))
    done = [r for r in results if r[1] is not None]
    best = max(done, key=lambda r: r[1]) if done else None
    rep.add("e", "forward tiles",
            "n/a" if best is None else
            f"best {best[1]:.3g} TFLOP/s ({100 * best[1] / peak:.0f}% of peak) at {best[0]}",
            "; ".join(f"{r[0]}: " + (f"{r[1]:.3g}" if r[1] else "-") + f" ({r[2]})"
                      for r in results) + f"; T {T}, (bm, bn, bk, split, group_m, warps, stages)",
            None, sweep=[dict(tiles=r[0], tflops=r[1], note=r[2]) for r in results])
    if deadline.fits(sh.case_seconds["e"]):
        rows = []
        for chunk in ((2048, 4096, 8192) if device.type == "cuda" else (32,)):
            try:
                sec, extra = timed(lambda c=chunk: gemm_then_reduce(x, w, y, 1.0, c), device,
                                   sh.timed_repeats, sh.timed_warmup)
                logp = gemm_then_reduce(x, w, y, 1.0, chunk)[0]
                diff = None if base is None else (logp - base).abs().max().item()
                rows.append(dict(chunk=chunk, tflops=flops / sec / 1e12, extra_gib=extra,
                                 logp_vs_fused=diff))
            except Exception as e:
                rows.append(dict(chunk=chunk, error=error_text(e)[:120]))
                free_memory(device)
        ok = [r for r in rows if "tflops" in r]
        top = max(ok, key=lambda r: r["tflops"]) if ok else None
        rep.add("e", "gemm then reduce",
                "n/a" if top is None else
                f"best {top['tflops']:.3g} TFLOP/s ({100 * top['tflops'] / peak:.0f}%) at chunk "
                f"{top['chunk']}, +{fmt(top['extra_gib'], 2)} GiB",
                "; ".join(f"chunk {r['chunk']}: " + (f"{r['tflops']:.3g} TFLOP/s, "
                          f"+{fmt(r['extra_gib'], 2)} GiB, logp vs fused {fmt(r['logp_vs_fused'], 2)}"
                          if "tflops" in r else r["error"]) for r in rows),
                None, rows=rows)
    else:
        rep.add("e", "gemm then reduce", "skipped: time budget")
    del x, w, y
    free_memory(device)


def loss_variants(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    """The fused loss path (the on-policy update's head) at part a's timed shape: its time and
    extra memory with dW summed over token chunks in fp32 (the default) or in dW's own dtype (as
    Liger does), at three workspaces; dW's difference between the two, relative to its largest."""
    from kernels import logprob as lp
    T, H, V = sh.timed_T, sh.head_H, sh.head_V
    x, w, y, g = bench_logprob.make_inputs(T, H, V, sh.dtype, device)
    tiles = lp.pick_tiles(sh.dtype, T, H, V)
    rows, ref = [], None
    for workspace, dw_fp32 in ((1 << 30, True), (1 << 30, False), (1 << 28, False),
                               (1 << 32, False), (1 << 32, True)):
        if not deadline.fits(sh.case_seconds["e"]):
            break
        run = lambda ws=workspace, f=dw_fp32: lp._loss_forward(  # noqa: E731
            x, w, y, g, 1.0, True, True, ws, tiles, dw_fp32=f)
        try:
            sec, extra = timed(run, device, sh.timed_repeats, sh.timed_warmup)
            dw = run()[3].float()
        except Exception as e:
            rows.append(dict(workspace=workspace, dw_fp32=dw_fp32, error=error_text(e)[:120]))
            free_memory(device)
            continue
        ref = dw if ref is None else ref
        diff = ((dw - ref).abs().max() / ref.abs().max()).item()
        rows.append(dict(workspace=workspace, dw_fp32=dw_fp32, ms=sec * 1e3,
                         tflops=6 * T * H * V / sec / 1e12, extra_gib=extra, dw_vs_fp32=diff,
                         chunks=-(-T // lp.loss_chunk_tokens(T, V, x.element_size(), workspace,
                                                              tiles))))
        del dw
        free_memory(device)
    rep.add("e", "loss variants",
            f"{len(rows)} variants",
            "; ".join(f"ws {r['workspace'] >> 20} MiB dW {'fp32' if r['dw_fp32'] else 'own'}: "
                      + (f"{r['ms']:.1f} ms, {r['tflops']:.3g} TFLOP/s, "
                         + (f"+{r['extra_gib']:.2f} GiB, " if r['extra_gib'] is not None else "")
                         + f"{r['chunks']} chunks, dW vs fp32-summed {fmt(r['dw_vs_fp32'], 2)}"
                         if "ms" in r else r["error"]) for r in rows),
            None, rows=rows)
    del x, w, y, g, ref
    free_memory(device)


def fp32_tau_case(rep: Report, sh: Shapes, device, deadline: Deadline) -> None:
    """tests/test_kernels.py's fp32 "offset" case at tau 0.7 (T 70, V 1000, H 96, every logit
    +1000 through one shared weight column, gradients of logp and entropy, a 100,000-byte
    workspace): the one real gap of the first GPU run, Triton's dX 4.3e-2 of its largest entry
    from float64 against the chunked twin's 1.1e-3. Here with and without fused multiply-adds in
    the kernels (kernels.logprob.FP_FUSION), the twin beside them."""
    from kernels import logprob as lp
    T, H, V, tau, ws = 70, 96, 1000, 0.7, 100_000
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * (3 / H ** 0.5)
    x[:, 0], w[:, 0] = 1.0, 1000.0
    y = torch.randint(0, V, (T,), generator=gen)
    up = torch.Generator().manual_seed(1)
    g, gh = torch.randn(T, generator=up), torch.randn(T, generator=up)
    x, w, y, g, gh = (t.to(device) for t in (x, w, y, g, gh))

    def grads(fn, dtype, **kw):
        xr = x.detach().clone().to(dtype).requires_grad_()
        wr = w.detach().clone().to(dtype).requires_grad_()
        logp, ent = fn(xr, wr, y, tau, **kw)
        ((logp * g.to(dtype)).sum() + (ent * gh.to(dtype)).sum()).backward()
        return logp.detach().double(), xr.grad.double()

    want = grads(kernels.fused_logprob_reference, torch.float64)
    found, saved = {}, lp.FP_FUSION
    try:
        for fusion in (False, True):
            lp.FP_FUSION = fusion
            logp, dx = grads(kernels.fused_logprob, torch.float32, backend="triton",
                             workspace_bytes=ws)
            found[fusion] = {"logp": (logp - want[0]).abs().max().item(),
                             "dX": ((dx - want[1]).abs().max() / want[1].abs().max()).item()}
    finally:
        lp.FP_FUSION = saved
    logp, dx = grads(kernels.chunked_logprob, torch.float32, workspace_bytes=ws)
    twin = ((dx - want[1]).abs().max() / want[1].abs().max()).item()
    rep.add("e", "fp32 tau 0.7 offset",
            f"dX off {fmt(found[False]['dX'], 2)} without fma, {fmt(found[True]['dX'], 2)} with",
            f"T {T}, H {H}, V {V}, w[:, 0] = 1000, tau {tau}; logp off "
            f"{fmt(found[False]['logp'], 2)} / {fmt(found[True]['logp'], 2)}; chunked twin dX "
            f"{fmt(twin, 2)}", found[False]["dX"] <= 4 * twin,
            without=found[False], with_fma=found[True], chunked_dx=twin)


# The tiles the training modes are timed at (kernels.logprob.Tiles fields): the bf16 table's before
# 2026-11-28, today's (the forward sweep's best of the first H200 run: 634 TFLOP/s against 493),
# and 256 x 128
MODE_TILES = ((128, 128, 64, 2048, 8, 8, 3), (128, 256, 64, 2048, 8, 8, 4),
              (256, 128, 64, 2048, 8, 8, 4))
# (mode, workspace bytes, dW summed in fp32): the training pass's two paths at the default and
# at smaller workspaces, the loss path also with dW summed in its own dtype
MODE_CASES = (("fwd+bwd", 1 << 30, True), ("fwd+bwd", 1 << 28, True),
              ("loss", 1 << 30, True), ("loss", 1 << 29, False), ("loss", 3 << 27, False),
              ("loss", 1 << 28, False))


def mode_sweep(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    """The two training paths of the head (fwd+bwd: the two-pass op; loss: the one-pass fused
    loss of the on-policy update) at each of MODE_TILES and MODE_CASES, at part a's timed shape:
    time, TFLOP/s (8THV or 6THV credited), extra memory, and dX, dW against the first tile's
    result at the same case (relative to its largest entry: the tiles change only the order of
    fp32 sums, and dW's dtype summing the token chunks)."""
    from kernels import logprob as lp
    T, H, V = sh.timed_T, sh.head_H, sh.head_V
    x, w, y, g = bench_logprob.make_inputs(T, H, V, sh.dtype, device)
    tiles = [lp.Tiles(*spec) for spec in MODE_TILES] if device.type == "cuda" else [
        lp.pick_tiles(sh.dtype, T, H, V)]
    rows = []
    for mode, ws, dw_fp32 in MODE_CASES:
        first = None
        for t in tiles:
            if not deadline.fits(sh.case_seconds["e"]):
                break
            if mode == "loss":
                run = lambda t=t, ws=ws, f=dw_fp32: lp._loss_forward(  # noqa: E731
                    x, w, y, g, 1.0, True, True, ws, t, dw_fp32=f)[2:]
            else:
                def run(t=t, ws=ws):
                    _, ent, norm = lp._forward_stats(x, w, y, 1.0, t)
                    return lp._backward(x, w, y, norm, ent, g, None, 1.0, True, True, ws, t)
            try:
                sec, extra = timed(run, device, sh.timed_repeats, sh.timed_warmup)
                dx, dw = (a.float() for a in run())
            except Exception as e:
                rows.append(dict(mode=mode, ws=ws, dw_fp32=dw_fp32, tiles=tuple(vars(t).values()),
                                 error=error_text(e)[:100]))
                free_memory(device)
                continue
            first = first or (dx, dw)
            diff = max(((a - b).abs().max() / b.abs().max()).item()
                       for a, b in zip((dx, dw), first))
            credit = 6 if mode == "loss" else 8
            rows.append(dict(mode=mode, ws=ws, dw_fp32=dw_fp32, tiles=tuple(vars(t).values()),
                             ms=sec * 1e3, tflops=credit * T * H * V / sec / 1e12,
                             extra_gib=extra, vs_first_tiles=diff))
            del dx, dw
            free_memory(device)
        del first
        free_memory(device)
    rep.add("e", "training modes", f"{len(rows)} runs",
            "; ".join(f"{r['mode']} ws {r['ws'] >> 20} MiB dW "
                      f"{'fp32' if r['dw_fp32'] else 'own'} {r['tiles'][:3]}x{r['tiles'][6]}: "
                      + (r["error"] if "error" in r else
                         f"{r['ms']:.1f} ms, {r['tflops']:.3g} TFLOP/s, "
                         f"+{fmt(r['extra_gib'], 2)} GiB, vs first tiles "
                         f"{fmt(r['vs_first_tiles'], 2)}") for r in rows),
            None, rows=rows)
    del x, w, y, g
    free_memory(device)


def part_tiles(rep: Report, sh: Shapes, device, peak: float, deadline: Deadline) -> None:
    fp32_tau_case(rep, sh, device, deadline)
    tiles_sweep(rep, sh, device, peak, deadline)
    mode_sweep(rep, sh, device, peak, deadline)
    loss_variants(rep, sh, device, peak, deadline)


def version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(rep: Report, sh: Shapes, device, dry: bool) -> float:
    """Device, versions, commit; the measured matmul peak (a row, and returned)."""
    import transformers
    import triton
    try:  # the device's copy of the tree may have no .git, or no git
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    commit = commit or "unknown"
    cuda = device.type == "cuda"
    rep.meta.update(
        device=(torch.cuda.get_device_name() if cuda
                else f"CPU ({platform.processor() or platform.machine()}, "
                     f"{torch.get_num_threads()} threads)"),
        memory_gib=(round(torch.cuda.get_device_properties(0).total_memory / GiB, 1)
                    if cuda else None),
        date=str(datetime.date.today()), mode="dry (CPU, tiny shapes)" if dry else "device",
        python=platform.python_version(), torch=torch.__version__,
        triton=triton.__version__, transformers=transformers.__version__,
        liger_kernel=version("liger-kernel"), cut_cross_entropy=version("cut-cross-entropy"),
        commit=commit)
    for key, value in rep.meta.items():
        print(f"# {key}: {value}", flush=True)
    peak = bench_logprob.matmul_peak(device, sh.dtype, sh.peak_n)
    rep.add("peak", "matmul", f"{peak:.4g} TFLOP/s",
            f"{str(sh.dtype).removeprefix('torch.')} torch.mm {sh.peak_n}^3, the best of a few "
            "rounds (bench_logprob.matmul_peak); MFU and % of peak are against it", tflops=peak)
    return peak


def run_part(rep: Report, part: str, cases: list[str], fn, deadline: Deadline,
             grace: float) -> None:
    """Run one part under its guard; whatever it did not write becomes an error or skip row."""
    t0 = time.perf_counter()
    why = None
    if not deadline.fits(0):
        why = "skipped: time budget"
    else:
        try:
            with hard_guard(deadline.left() + grace):
                fn(deadline)
        except (Exception, PartTimeout) as e:  # a failure is data: it goes in the part's rows
            why = error_text(e)
            traceback.print_exc()
    for case in cases:
        if not rep.has(part, case):
            rep.add(part, case, why or "not run")
    rep.raw.setdefault("part_seconds", {})[part] = time.perf_counter() - t0
    print(f"# {PART_NAMES[part]}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv=None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true",
                    help="CPU tensors, tiny shapes, the same code: proves the script runs")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="folder for gpu_check.md and gpu_check.json (default: $OUT)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the parts in all (default 440 on a GPU, 300 dry)")
    ap.add_argument("--parts", default="a,e,b,c,d", help="which parts, e.g. a,d")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of part b's policy (default 8 of 28; dry 2)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    sh = DRY_SHAPES if args.dry else GPU_SHAPES
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry:
        raise SystemExit("no GPU: run with --dry on a CPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rep = Report(Path(args.out) if args.out else None)
    budget = args.budget if args.budget is not None else 300.0 if args.dry else 440.0
    rep.raw["shapes"] = asdict(sh)
    rep.raw["budget_s"] = budget
    grace = 15.0  # the hard guard's slack past a part's deadline
    log = DynamoLog()
    logging.getLogger("torch._dynamo").addHandler(log)
    torch._logging.set_logs(recompiles=True)  # dynamo logs each recompile and its reason
    parts = [p for p in ORDER if p in args.parts.split(",")]
    layers = args.layers or sh.update_layers
    with compile_backend(sh.compile_backend):
        peak = header(rep, sh, device, args.dry)
        until = start
        tasks = {
            "a": lambda d: part_head(rep, sh, device, peak, d),
            "d": lambda d: part_recompiles(rep, sh, device, d, log),
            "c": lambda d: part_shared_prefix(rep, sh, device, d),
            "b": lambda d: part_update(rep, sh, device, peak, d, layers, log),
            "e": lambda d: part_tiles(rep, sh, device, peak, d),
        }
        total_share = sum(SHARE[p] for p in parts) or 1.0
        for part in parts:
            # a part may use its share plus whatever earlier parts left, never later ones' shares
            until += budget * SHARE[part] / total_share
            run_part(rep, part, expected_rows(sh)[part], tasks[part], Deadline(until), grace)
    rep.meta["seconds"] = round(time.perf_counter() - start, 1)
    rep.write()
    print()
    print(rep.markdown(), flush=True)
    return rep


if __name__ == "__main__":
    main()
