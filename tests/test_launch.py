"""Tests of the launch (issue #41): every process group a run waits in has the run's collective
timeout (the world, the policy's HSDP mesh, the Ulysses groups, vLLM's).
"""

import json
from pathlib import Path

import pytest
import torch

import infra
import spell
from conftest import end_worker, run_worker, tiny_llama, torchrun

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


if __name__ == "__main__":
    run_worker({"groups": worker_groups, "vllm-groups": worker_vllm_groups})
