"""Weight sync (trainer -> vLLM) of the embedded SmolLM2-135M on 2 CPU ranks,
per engine.sync_bucket_mb.

    .venv/bin/python bench/bench_weight_sync.py                  # 2 ranks, 3 repeats (about 5 min)
    .venv/bin/python bench/bench_weight_sync.py --buckets 0,8,64 --repeats 5

Each rank holds what `spell.py` holds: an FSDP2-sharded fp32 policy (gloo) and its own in-process
vLLM engine. For every setting (0 = one all-gather per tensor, `gathered_state_dict`; else buckets
of that many MiB, with `ahead` 0 or 1 buckets in flight) it times two things, `repeats` times each:
  gather  the iterator alone, each full tensor dropped as it arrives (our side of the sync);
  sync    `sync_weights` into the engine (gather + vLLM's in-place reload + the tied-head refresh).
Seconds per GB: median seconds / GB of full tensors sent (fp32 on CPU, as main() sends;
1 GB = 1e9 B).
Peak extra RSS: the process's peak resident memory during the call above what it held just before
(VmHWM after resetting it through /proc/self/clear_refs), the larger of the two ranks, the median
over repeats. glibc would keep freed blocks below its dynamic mmap threshold (up to 32 MiB) in its
heap and make them look live, so the workers run with MALLOC_MMAP_THRESHOLD_=65536: every freed
tensor of 64 KiB or more goes back to the system.

After the table it prints the GPU figure this design predicts for Qwen2.5-7B on 8 GPUs: an estimate
from stated assumptions, not a measurement (there is no GPU here).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def status_kib(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM), in KiB."""
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def measured(fn) -> tuple[float, float]:
    """(seconds, peak extra resident GiB) of fn()."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, (status_kib("VmHWM") - before) / 2**20


def worker(buckets: list[int], repeats: int) -> None:
    """One torchrun rank: engine + sharded policy, then every setting; rank 0 prints the table."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    import infra
    import spell

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = str(REPO / ".cache" / "SmolLM2-135M-Instruct")
    if rank == 0:
        infra.export_embedded_model(model_dir)  # a no-op once exported
    dist.barrier()
    infra.set_vllm_log_level("ERROR")
    rollout_dtype = infra.rollout_dtype("auto", on_gpu=False)
    llm = spell.start_vllm(model_dir, max_model_len=1024, seed=rank, dtype=rollout_dtype)
    transformers.utils.logging.disable_progress_bar()
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = spell.shard_policy(policy, init_device_mesh("cpu", (world,)),
                                param_dtype=torch.float32)
    dtype = torch.float32  # what main() sends on CPU
    # the tied LM head once
    tensors = {id(t): t for t in policy.state_dict(keep_vars=True).values()}
    sent_gb = sum(t.numel() for t in tensors.values()) * 4 / 1e9

    settings = [(0, 0)] + [(mb, ahead) for mb in buckets if mb > 0 for ahead in (0, 1)]
    rows = []
    for mb, ahead in settings:
        def weights():
            if mb == 0:
                return spell.gathered_state_dict(policy, dtype)
            return infra.bucketed_state_dict(policy, dtype, mb << 20, ahead=ahead)

        def gather_only():
            for _ in weights():
                pass

        results = {"gather": [], "sync": []}
        for _ in range(repeats):
            dist.barrier()
            results["gather"].append(measured(gather_only))
            dist.barrier()
            results["sync"].append(measured(lambda: spell.sync_weights(llm, weights())))
        # the slower rank decides: everyone waits for it at the next collective
        mine = torch.tensor([[statistics.median(s for s, _ in results[k]),
                              statistics.median(g for _, g in results[k])]
                             for k in ("gather", "sync")], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rows.append((mb, ahead, mine.tolist()))

    # the engine still answers after all these syncs (same weights: the policy never changed)
    [[out]] = spell.generate(llm, [[1, 2, 3, 4]], n=1, temperature=0.0, top_p=1.0, max_tokens=4)
    assert len(out.token_ids) > 0
    if rank == 0:
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        print(f"\n### Weight sync on CPU, SmolLM2-135M "
              f"({sent_gb:.3f} GB of fp32 full tensors a sync)\n")
        print(f"Device: {cpu[1] if cpu else platform.processor()}, {os.cpu_count()} cores, "
              f"{world} ranks (gloo), vLLM weights in {rollout_dtype}; "
              f"date {datetime.date.today()}; median of {repeats}.\n")
        print("| engine.sync_bucket_mb | ahead | gather s | gather s/GB "
              "| gather peak extra RSS GiB | sync s | sync s/GB | sync peak extra RSS GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for mb, ahead, ((gs, gm), (ss, sm)) in rows:
            name = "0 (one all-gather per tensor)" if mb == 0 else str(mb)
            print(f"| {name} | {ahead if mb else '-'} | {gs:.3f} | {gs / sent_gb:.2f} | {gm:.3f} "
                  f"| {ss:.3f} | {ss / sent_gb:.2f} | {sm:.3f} |")
        print(gpu_estimate())
    dist.barrier()


def gpu_estimate(load_s: float = 0.55, params: float = 7.616e9, world: int = 8,
                 bus_gb_s: float = 350.0, latency_s: float = 30e-6, tensors: int = 339,
                 bucket_mb: int = 512) -> str:
    """The sync time this design predicts for Qwen2.5-7B (bf16) on one 8-GPU NVLink node.
    An estimate."""
    size_gb = params * 2 / 1e9  # bf16 full tensors
    # an all-gather moves (W-1)/W of the output per rank
    wire_s = size_gb * (world - 1) / world / bus_gb_s
    # the embedding and the untied LM head (152064 x 3584 bf16, 1.09 GB each) exceed 512 MiB: alone
    n_buckets = 2 + math.ceil((size_gb - 2 * 1.09) * 1e9 / (bucket_mb << 20))
    # gather and load take turns, tensor by tensor
    per_tensor = load_s + wire_s + tensors * latency_s
    # only the first bucket is not hidden
    bucketed = load_s + (wire_s + n_buckets * latency_s) / n_buckets
    return f"""
**Expected on GPU (an estimate from the design, not a measurement).** Qwen2.5-7B, \
{params / 1e9:.3f}e9
parameters = {size_gb:.2f} GB of bf16 full tensors, {tensors} tensors, FSDP2 over {world} GPUs \
of one NVLink node.
Assumed: vLLM's in-place reload of a 7B takes {load_s} s (the published figure quoted in \
issue #13), the
all-gather reaches a bus bandwidth of {bus_gb_s:.0f} GB/s, a collective costs \
{latency_s * 1e6:.0f} us of latency.
Wire time of the whole gather: {size_gb:.2f} GB x {world - 1}/{world} / {bus_gb_s:.0f} GB/s = \
{wire_s:.3f} s.
- one all-gather per tensor (sync_bucket_mb = 0): {load_s} + {wire_s:.3f} + {tensors} x \
{latency_s * 1e6:.0f} us
  = {per_tensor:.2f} s ({per_tensor / size_gb:.3f} s/GB);
- {bucket_mb} MiB buckets, one in flight ahead: {n_buckets} all-gathers, all but the first \
hidden behind the
  reload: {load_s} + ({wire_s:.3f} + {n_buckets} x {latency_s * 1e6:.0f} us) / {n_buckets} = \
{bucketed:.2f} s
  ({bucketed / size_gb:.3f} s/GB).
So on one node the sync is the reload's: buckets and overlap save about \
{per_tensor - bucketed:.2f} s a step
({(per_tensor - bucketed) / per_tensor:.0%}). They matter where the wire is slow: across nodes at
~50 GB/s a GPU the gather alone is {size_gb * (world - 1) / world / 50:.2f} s, which the overlap \
hides behind the
reload. The price is memory: ~3 buckets in flight (the 1.09 GB embedding bucket, the next
bucket's gathered buffer and its shard) against one full tensor at a time.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buckets", default="8,32,128,512",
                    help="comma-separated MiB (0 = per tensor, always run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    buckets = [int(x) for x in args.buckets.split(",") if x.strip()]
    if args.worker:
        return worker(buckets, args.repeats)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}",
           __file__, "--worker", f"--buckets={args.buckets}", f"--repeats={args.repeats}"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


if __name__ == "__main__":
    main()
