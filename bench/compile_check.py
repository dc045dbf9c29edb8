"""Compile the Triton kernels for a GPU target on a machine without one, and report resources.

    python bench/compile_check.py                 # sm_90 (H100/H200) and sm_80 (A100)
    python bench/compile_check.py --sm 90 --tiles 128x256x64/2048/8/3

Triton lowers to PTX and runs its bundled ptxas without touching a driver, so this catches GPU-only
compile errors (the CPU interpreter accepts more than the compiler does) and shows registers, spill
stack, shared memory and whether the GEMM loop was software-pipelined (async copies) and, on
sm_90, lowered to wgmma. Launch-time specialisation is mimicked by declaring the pointers, H, V
and row strides divisible by 16, as they are for real LM heads. Uses Triton's compiler entry
points (ASTSource, GPUTarget), which are less stable across versions than @triton.jit.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"       # compile for real, even on a CPU-only machine
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import logprob as K  # noqa: E402

ALIGNED = {"x_ptr", "w_ptr", "y_ptr", "m_ptr", "s_ptr", "r_ptr", "zy_ptr", "z_ptr", "mx_ptr",
           "logs_ptr", "ent_ptr", "g_ptr", "gh_ptr", "dz_ptr", "H", "V", "stride_z", "stride_dz"}


def compile_kernel(fn, signature, constexprs, sm, tiles):
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in signature if k in ALIGNED}
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", sm, 32),
                          options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def resources(compiled):
    """'REG:.. STACK:..' line of cuobjdump for the kernel's cubin, plus pipelining facts."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    usage = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "?")
    regs_stack = " ".join(tok for tok in usage.split() if tok.startswith(("REG:", "STACK:")))
    ttgir = compiled.asm["ttgir"]
    return (f"{regs_stack}, shared {compiled.metadata.shared // 1024} KiB, "
            f"pipelined={'async_copy' in ttgir}, wgmma={'warp_group_dot' in ttgir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sm", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--tiles", default=None,
                    help="BMxBNxBK/SPLIT/WARPS/STAGES (default: the table)")
    args = ap.parse_args()
    for sm in args.sm:
        for dt, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                ("fp32", torch.float32)):
            tiles = K.pick_tiles(torch_dtype, 4096, 4096)
            if args.tiles:
                dims, split, warps, stages = args.tiles.split("/")
                bm, bn, bk = (int(v) for v in dims.split("x"))
                tiles = K.Tiles(bm, bn, bk, int(split), 8, int(warps), int(stages))
            prec = "ieee" if dt == "fp32" else "tf32"
            common = dict(BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, GROUP_M=tiles.group_m,
                          UPCAST=False, PRECISION=prec)
            fwd_sig = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr="*i64", m_ptr="*fp32",
                           s_ptr="*fp32", r_ptr="*fp32", zy_ptr="*fp32", z_ptr="*fp32",
                           T="i32", V="i32", H="i32", inv_tau="fp32")
            for store_z in (False, True):
                c = compile_kernel(K._logprob_fwd_kernel, fwd_sig,
                                   dict(SPLIT=tiles.split, STORE_Z=store_z, **common), sm, tiles)
                print(f"sm_{sm} {dt} forward (STORE_Z={store_z}) {tiles}: {resources(c)}")
            bwd_sig = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", z_ptr="*fp32", y_ptr="*i64",
                           mx_ptr="*fp32", logs_ptr="*fp32", ent_ptr="*fp32", g_ptr="*fp32",
                           gh_ptr="*fp32", dz_ptr=f"*{dt}", T="i32", Vs="i32", v_offset="i32",
                           H="i32", inv_tau="fp32", stride_z="i32", stride_dz="i32")
            for load_z, has_gh in ((False, True), (False, False), (True, False)):
                c = compile_kernel(K._logprob_bwd_kernel, bwd_sig,
                                   dict(LOAD_Z=load_z, HAS_G=True, HAS_GH=has_gh, **common),
                                   sm, tiles)
                print(f"sm_{sm} {dt} dZ (LOAD_Z={load_z}, HAS_GH={has_gh}): {resources(c)}")
        merge_sig = dict(m_ptr="*fp32", s_ptr="*fp32", r_ptr="*fp32", zy_ptr="*fp32",
                         logp_ptr="*fp32", ent_ptr="*fp32", mx_ptr="*fp32", logs_ptr="*fp32",
                         T="i32", n_splits="i32")
        compile_kernel(K._logprob_merge_kernel, merge_sig, dict(BLOCK=128), sm,
                       K.Tiles(0, 0, 0, 0, 0, num_warps=4, num_stages=1))
        print(f"sm_{sm} merge: compiled")


if __name__ == "__main__":
    main()
