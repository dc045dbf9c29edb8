"""What issue #41's launch fixes do on a real NVIDIA machine, which the CPU tests cannot show: one
GPU, a world of one, NCCL. Prints one line per check; exits non-zero if one fails.

  driver      infra.nvidia_driver reads /proc/driver/nvidia/version's first line
  usable      infra.check_gpus_usable passes (torch can use the GPU here)
  default allocator  spell.init_distributed's expandable segments reach torch's live settings
  versions    infra.version_line: torch, CUDA, NCCL, the driver, Triton
  threads     spell.init_distributed sets torch's threads to infra.cores_per_rank on a GPU node
  groups      on NCCL: the world, an SP group (infra.sp_group), infra.policy_mesh, and a 2-D mesh
              made with infra.world_options as backend_override (the split_group path with a
              bound device) all wait engine.collective_timeout_min; the same mesh without the
              override shows what torch gives its groups
  allocator   which of PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF the caching allocator reads
              (a fresh process per setting; a segment's is_expandable in torch's snapshot),
              against infra.allocator_conf
  torchrun    whether the installed torchrun takes --shutdown-timeout (torch 2.13's does)

Run from the repository root: `python bench/launch_check.py`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import infra  # noqa: E402
import spell  # noqa: E402

MINUTES = 7.5  # neither torch's defaults (NCCL 10, gloo 30) nor the config's (120)

# one allocation in a fresh process, with the allocator's variables as given
ALLOCATE = ("import json, torch; x = torch.empty(2**20, device='cuda'); "
            "s = torch.cuda.memory._snapshot(); "
            "live = getattr(torch._C, '_accelerator_getAllocatorSettings', None); "
            "print(json.dumps([s['segments'][0].get('is_expandable'), live and live()]))")


def allocator_reads(env: dict[str, str]) -> list:
    """[whether the first segment is expandable, torch's live settings string] with these
    variables set (and the others unset), in a fresh process."""
    clean = {k: v for k, v in os.environ.items() if k not in infra.ALLOC_CONF_VARS}
    out = subprocess.run([sys.executable, "-c", ALLOCATE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.stdout.startswith("[") else [out.stderr[-300:]]


def main() -> int:
    failed = []

    def check(name: str, ok: bool, said: str) -> None:
        print(f"{name}: {'ok' if ok else 'FAILED'}: {said}", flush=True)
        if not ok:
            failed.append(name)

    first = Path(infra.NVIDIA_DRIVER_FILE).read_text().splitlines()[0]
    driver = infra.nvidia_driver()
    check("driver", driver is not None and driver[0].isdigit(), f"{driver} from {first!r}")
    infra.check_gpus_usable(torch.cuda.is_available())
    check("usable", torch.cuda.is_available(), "check_gpus_usable passed")

    cfg = spell.Config()
    cfg.engine.collective_timeout_min = MINUTES
    torch.set_num_threads(1)  # as torchrun leaves a rank
    rank, world, device = spell.init_distributed(cfg)  # as spell.main: first
    live = infra.live_allocator_settings()
    x = torch.empty(2**20, device=device)  # noqa: F841  (a segment to look at)
    expandable = [seg.get("is_expandable") for seg in torch.cuda.memory._snapshot()["segments"]]
    check("default allocator", live in (None, infra.EXPANDABLE) and all(expandable),
          f"segments expandable {expandable}; " + "; ".join(infra.allocator_lines(live=live)))
    check("versions", True, infra.version_line(device))
    check("threads", torch.get_num_threads() == infra.cores_per_rank(),
          f"{torch.get_num_threads()} threads, cores_per_rank {infra.cores_per_rank()}, "
          f"{dist.get_backend()} on {device}")

    from torch.distributed.device_mesh import init_device_mesh

    want = MINUTES * 60
    seen = {"world": infra.group_timeout(), "sp": infra.group_timeout(infra.sp_group(world, 1))}
    mesh = infra.policy_mesh(cfg, "cuda", world)
    seen.update({f"policy_mesh {n}": infra.group_timeout(mesh.get_group(n))
                 for n in mesh.mesh_dim_names})
    names = ("replicate", "shard")
    override = init_device_mesh("cuda", (1, 1), mesh_dim_names=names,
                                backend_override={n: infra.world_options() for n in names})
    seen.update({f"override {n}": infra.group_timeout(override.get_group(n)) for n in names})
    check("groups", all(t.total_seconds() == want for t in seen.values()),
          ", ".join(f"{k} {t.total_seconds():g} s" for k, t in seen.items()))
    plain = init_device_mesh("cuda", (1, 1), mesh_dim_names=names)
    check("groups without override", True,
          ", ".join(f"{n} {infra.group_timeout(plain.get_group(n)).total_seconds():g} s "
                    f"(the world's own group: {plain.get_group(n) is dist.group.WORLD})"
                    for n in names))
    dist.destroy_process_group()

    cases = [{"PYTORCH_ALLOC_CONF": "expandable_segments:False",
              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
             {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
             {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
              "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
             {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}]
    for env in cases:  # what allocator_conf says torch reads, against the segment torch made
        got = allocator_reads(env)
        want = infra.expandable_segments(infra.allocator_conf(env)[1])
        check("allocator", got[0] == want, f"{env}: expandable {got[0]} (infra: {want}), "
                                           f"live settings {got[1:]}")
    usage = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"],
                           capture_output=True, text=True, timeout=120).stdout
    has = "--shutdown-timeout" in usage  # new after 2.11 (the SLURM example's torch is 2.13)
    check("torchrun", has or torch.__version__ < "2.13",
          f"torch {torch.__version__}: --shutdown-timeout {'in' if has else 'not in'} its --help")
    print(f"launch_check: {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
