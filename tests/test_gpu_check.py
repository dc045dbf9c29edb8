"""bench/gpu_check.py, the one-call device check, in its dry mode: CPU tensors, tiny shapes, the
same code. The table has every row, the numbers that can be measured on a CPU are there, and the
LM-head and attention parities lie within bounds derived here from the arithmetic; with no time
left, every part says it was skipped and the script still ends with the whole table."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_logprob  # noqa: E402

U32 = 2.0 ** -24  # fp32's unit roundoff: --dry computes in fp32 throughout

# Every row the issue asks for, by part (the table's first two columns), in the order they run
EXPECTED = (
    [("peak", "matmul")]
    + [("a. head kernels", f"parity {impl}")
       for impl in ("naive", "chunked", "triton", "triton loss", "liger", "cce")]
    + [("a. head kernels", case) for case in (
        "triton fwd", "triton fwd+bwd", "triton loss", "liger fwd", "liger fwd+bwd", "cce fwd",
        "cce fwd+bwd", "chunked fwd+bwd", "naive fwd+bwd")]
    + [("e. head tiles", case) for case in (
        "fp32 tau 0.7 offset", "forward tiles", "gemm then reduce", "training modes",
        "loss variants")]
    + [("b. update", "start"), ("b. update", "update 128 tokens"), ("b. update", "profile 128"),
       ("b. update", "update 256 tokens"), ("b. update", "update 128 tokens, compiled layers"),
       ("b. update", "optimiser step"),
       ("c. shared prefix", "forward"), ("c. shared prefix", "gradients"),
       ("d. recompiles", "recompiles"), ("d. recompiles", "dense fallback")])
# with no time at all: the rows each part writes whatever happens (the profile is an extra)
SKIPPED = tuple(r for r in EXPECTED if r != ("b. update", "profile 128"))


def dry_run(tmp_path: Path, *args: str) -> tuple[list[tuple[str, ...]], dict, str]:
    """Run `gpu_check.py --dry`; the table's rows as cells, the JSON, and the output."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry",
                           "--out", str(tmp_path), *args], check=False, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [tuple(c.strip() for c in line.strip("|").split(" | "))
            for line in (tmp_path / "gpu_check.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| part |")]
    return rows, json.loads((tmp_path / "gpu_check.json").read_text()), proc.stdout


def row(doc: dict, part: str, case: str) -> dict:
    (found,) = [r for r in doc["rows"] if r["part"] == part and r["case"] == case]
    return found


@pytest.mark.stack
def test_dry_run_has_every_row_and_parities_within_the_arithmetic(tmp_path):
    """About 50 s on 2 cores: Triton's interpreter, dynamo tracing 10 row lengths, an FSDP2
    update on gloo, two inductor compiles of flex_attention in processes of their own."""
    rows, doc, out = dry_run(tmp_path, "--budget", "600")
    assert [r[:2] for r in rows] == list(EXPECTED)
    assert "| part | case | result | detail | ok |" in out  # the table is printed, too
    assert not [r for r in rows if r[2].startswith(("error", "skipped"))], rows

    # a. The LM head against float64, fp32 inputs. Each logit z = sum_h x_h w_h is an H-term
    # fp32 sum: its rounding is about sqrt(H) u32 S, S = max_{t,v} sum_h |x_th w_vh| the largest
    # sum of absolute products. logp = z_y - lse and the entropy lse - sum p z carry that error
    # through z_y, lse (a p-weighted mean of the logits' errors) and the p's times |z| <= Z:
    # (2 + Z) sqrt(H) u32 S; the V-term sum of exponentials in lse, and the V- or T-term fp32 GEMMs
    # of the gradients add sqrt(max(T, V)) u32, and their fp32 outputs u32 each. Those are typical
    # sizes; the largest of the T (or T H, V H) entries may be 4 times as far.
    x, w, _, _ = bench_logprob.make_inputs(70, 96, 1000, torch.float32, "cpu")  # --dry's inputs
    T, H, V = 70, 96, 1000
    S = (x.double().abs() @ w.double().abs().T).max().item()
    Z = (x.double() @ w.double().T).abs().max().item()
    bound = 4 * ((2 + Z) * math.sqrt(H) * U32 * S + math.sqrt(max(T, V)) * U32 + 2 * U32)
    assert 1e-5 < bound < 1e-3  # the arithmetic's size at these shapes: tight enough to fail
    for impl in ("naive", "chunked", "triton", "triton loss"):
        err = row(doc, "a", f"parity {impl}")["values"]["errors"]
        assert set(err) == {"logp", "entropy", "dX", "dW"}, err
        # 0 would mean a comparison of something with itself
        assert all(0 < e <= bound for e in err.values()), (impl, err, bound)
    for case in ("naive fwd+bwd", "chunked fwd+bwd", "triton fwd", "triton fwd+bwd",
                 "triton loss"):
        assert row(doc, "a", case)["values"]["seconds"] > 0

    # c. FlexAttention against SDPA on the shared-prefix row, fp32 on CPU: the two differ in the
    # order of their sums only. Each rounding on the way is sqrt(n) u32 relative (n = the longest
    # sum, max(H 224, MLP 512, T)), about 8 L + 2 of them in a forward of L = 2 layers, adding in
    # quadrature; 4x for the largest entry, 2x as each path rounds on its own.
    fwd = row(doc, "c", "forward")["values"]
    eps = math.sqrt(max(224, 512, fwd["T"])) * U32
    attention_bound = 2 * 4 * math.sqrt(8 * 2 + 2) * eps
    assert 0 < fwd["flex_vs_sdpa"] <= attention_bound, fwd
    # the mask a bug could build moves the output by far more: the check can fail
    assert fwd["leak"] > 100 * attention_bound, fwd

    # d. The recompile probe ran the compiled flex path (dynamo recompiled as the lengths
    # changed) in each of its 20 forward calls, none of them dense
    rec = row(doc, "d", "recompiles")["values"]
    assert rec["calls"] == 20 and rec["errors"] == 0 and rec["skipped"] == 0, rec
    assert rec["by_function"].get("flex_attention", 0) > 0, rec
    dense = row(doc, "d", "dense fallback")["values"]
    assert dense["fallbacks"] == 0 and dense["calls"] == 20, dense

    # b. update_policy ran both micro-batch sizes; memory is not measured on a CPU
    for T in (128, 256):
        b = row(doc, "b", f"update {T} tokens")["values"]
        assert b["tokens_per_s"] > 0 and b["peak_gib"] is None and b["T"] == T, b
        assert b["estimate"]["update_phase"] > 0, b

    # and again with the decoder layers compiled (aot_eager on CPU), through the same calls
    b = row(doc, "b", "update 128 tokens, compiled layers")["values"]
    assert b["tokens_per_s"] > 0 and b["T"] == 128, b

    b = row(doc, "b", "optimiser step")["values"]["rows"]
    assert [r["impl"] for r in b] == ["fused", "foreach", "loop"] and all(
        r["seconds"] > 0 for r in b), b

    # e. The fp32 offset case at tau 0.7 through the Triton op, with and without fma contraction
    # (the interpreter never contracts: both as float64 allows, well below the first GPU run's
    # 4.3e-2); the candidate forward's log-probs those of the fused kernel to fp32 rounding
    e = row(doc, "e", "fp32 tau 0.7 offset")["values"]
    assert 0 < e["without"]["dX"] < 4e-3 and 0 < e["with_fma"]["dX"] < 4e-3, e
    (candidate,) = row(doc, "e", "gemm then reduce")["values"]["rows"]
    assert candidate["logp_vs_fused"] <= bound, candidate
    variants = row(doc, "e", "loss variants")["values"]["rows"]
    assert len(variants) == 5 and all(r["ms"] > 0 and r["dw_vs_fp32"] <= bound
                                      for r in variants), variants


def test_no_time_left_skips_every_part_and_still_writes_the_table(tmp_path):
    """--budget 0: each part is skipped before it starts, each of its rows says so, and the
    script ends normally with every row."""
    rows, doc, _ = dry_run(tmp_path, "--budget", "0")
    assert [r[:2] for r in rows] == list(SKIPPED)
    assert all(r[2] == "skipped: time budget" for r in rows[1:]), rows
    assert doc["rows"][0]["values"]["tflops"] > 0  # the peak is measured before any part


def test_the_peak_replay_names_what_is_alive_at_the_highest_point():
    """gpu_check.peak_breakdown on a hand-made allocator trace (the events torch.cuda.memory's
    recorder writes). Worked: 100 bytes held before; a (FSDP) +50 = 150, b (the head) +30 = 180,
    a freed = 130, c (no frame) +40 = 170, a block from before freed = 110. The peak is 180, after
    the second event, with a and b alive."""
    import gpu_check

    fsdp = [{"filename": "/x/site-packages/torch/distributed/fsdp/_fully_shard/x.py",
             "name": "all_gather"}]
    head = [{"filename": "/repo/kernels/logprob.py", "name": "_loss_forward"}]
    trace = [dict(action="alloc", addr=1, size=50, frames=fsdp),
             dict(action="alloc", addr=2, size=30, frames=head),
             dict(action="free_requested", addr=1, size=50, frames=fsdp),
             dict(action="free_completed", addr=1, size=50, frames=fsdp),
             dict(action="alloc", addr=3, size=40, frames=[]),
             dict(action="free_completed", addr=99, size=60, frames=[])]
    got = gpu_check.peak_breakdown(trace, base=100)
    assert got["peak_event"] == 1 and got["peak_gib"] * gpu_check.GiB == 180
    assert got["made_since_gib"] * gpu_check.GiB == 80
    owners = {name: (gib * gpu_check.GiB, n) for name, gib, n in got["owners"]}
    assert owners == {"x.py:all_gather": (50, 1), "logprob.py:_loss_forward": (30, 1)}
    assert gpu_check.allocation_owner([], 3 << 20) == "no Python frame, 3 MiB blocks"


def test_kernel_kinds_sort_the_update_profiles_kernels():
    """gpu_check.kernel_kind on kernel names of the kinds an update runs."""
    import gpu_check

    assert gpu_check.kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "GEMM (cuBLAS)"
    assert gpu_check.kernel_kind("triton_tem_fused_flex_attention_backward_0").startswith("att")
    assert gpu_check.kernel_kind("_logprob_fwd_kernel") == "LM head (Triton)"
    assert gpu_check.kernel_kind("void at::native::(anonymous namespace)::multi_tensor_apply_"
                                 "kernel<FusedAdamMathFunctor>") == "optimiser"
    assert gpu_check.kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32") == "communication, copies"
    assert gpu_check.kernel_kind("triton_poi_fused_add_0") == "fused elementwise (inductor)"
    assert gpu_check.kernel_kind("rms_norm_kernel").startswith("other")
