"""Tests of preflight.py (`spell.py preflight`): the table, the line each failure prints and the key
it names, the largest row as spell.plan_update packs it, the prompts at their budgets; on the stack,
the demo preset's preflight end to end, a failure that names its key, and the ranks' agreement on a
failure (one rank failing inside a collective must not leave the other waiting).
"""

import datetime
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import infra
import preflight
import spell
from conftest import (REPO, CharTokenizer, descendants, process_stat, run_worker, start_torchrun,
                      stop_torchrun, torchrun)
from preflight import Row


class DecodingTokenizer(CharTokenizer):
    """CharTokenizer (one token per character), decoding too."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def config(**keys) -> spell.Config:
    """config.toml's recipe (the dataclass defaults) with `section__key=value` changed."""
    cfg = spell.Config()
    for name, value in keys.items():
        section, key = name.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------

ROWS = [Row("update", "3,456 tokens per row", 75.31, 4.671, 7.604, 10.219),
        Row("sync", "a tensor at a time", 0.42, 7.6, 7.5, 7.82)]


def test_table_on_cpu_aligns_text_left_and_numbers_right():
    assert preflight.format_table(ROWS, on_gpu=False).splitlines() == [
        preflight.TABLE_NOTE,
        "phase   size                  seconds      host GiB  host peak",
        "update  3,456 tokens per row     75.3  4.67 -> 7.60      10.22",
        "sync    a tensor at a time        0.4  7.60 -> 7.50       7.82",
    ]


def test_table_on_gpu_adds_the_device_and_the_estimate_where_there_is_one():
    update = Row("update", "3,456 tokens per row", 75.31, 4.671, 7.604, 10.219,
                 device_before=30.5, device_after=12.25, torch_peak=11.0, estimate=14.5)
    assert preflight.format_table([update, ROWS[1]], on_gpu=True).splitlines()[1:] == [
        "phase   size                  seconds      host GiB  host peak      device GiB  torch peak"
        "  estimate",
        "update  3,456 tokens per row     75.3  4.67 -> 7.60      10.22  30.50 -> 12.25       11.00"
        "     14.50",
        "sync    a tensor at a time        0.4  7.60 -> 7.50       7.82    0.00 -> 0.00"
        "        0.00",
    ]


def test_combine_takes_the_slowest_rank_and_the_largest_memory_and_rank_zeros_words():
    a = Row("save", "1.61 GiB", 3.0, 7.5, 7.51, 7.6, 1.0, 2.0, 3.0)
    b = Row("save", "other", 5.0, 7.7, 7.40, 7.5, 1.5, 1.0, 4.0)
    assert preflight.combine([a, b]) == Row("save", "1.61 GiB", 5.0, 7.7, 7.51, 7.6, 1.5, 2.0, 4.0)


# ------------------------------------------------------------------------------------------------
# What a failure prints: one line naming the key
# ------------------------------------------------------------------------------------------------

# vLLM 0.32's text when its KV cache cannot hold one sequence (v1/core/kv_cache_utils.py)
VLLM_KV_ERROR = ValueError(
    "To serve at least one request with the model's max seq len (30016), (1.29 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (1.00 GiB). Based on the "
    "available memory, the estimated maximum model length is 23296. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
    "`max_model_len` when initializing the engine.")
CPU_ALLOC_ERROR = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 8589934592 bytes.")


@pytest.mark.parametrize("phase, what, error, keys, on_gpu, line", [
    # config.toml: a row of engine.micro_batch_tokens = 32,768 is longer than any one rollout
    ("update", "32,768 tokens per row", torch.OutOfMemoryError("CUDA out of memory."), {}, True,
     "preflight: update (32,768 tokens per row) ran out of device memory: lower "
     "engine.micro_batch_tokens or raise engine.sequence_parallel"),
    # one rollout (16,384 + 4,096 tokens) is longer than a row's budget: the lengths decide
    ("update", "20,480 tokens per row", torch.OutOfMemoryError("CUDA out of memory."),
     {"engine__micro_batch_tokens": 1024}, True,
     "preflight: update (20,480 tokens per row) ran out of device memory: lower "
     "rollout.max_prompt_tokens, rollout.max_new_tokens or rollout.role_max_new_tokens (one "
     "sequence of the longest prompt and budget is the longest row) or raise "
     "engine.sequence_parallel"),
    ("update", "2,048 tokens per row", CPU_ALLOC_ERROR,
     {"engine__micro_batch_tokens": 32768, "engine__gradient_checkpointing": False}, False,
     "preflight: update (2,048 tokens per row) ran out of host memory: lower "
     "engine.micro_batch_tokens or raise engine.sequence_parallel or set "
     "engine.gradient_checkpointing = true"),
    ("start vLLM", "context 30,016 tokens", VLLM_KV_ERROR,
     {"rollout__max_prompt_tokens": 30000, "rollout__max_new_tokens": 16}, False,
     "preflight: start vLLM (context 30,016 tokens): vLLM's KV cache cannot hold one sequence of "
     "the context (30,016 tokens): raise engine.kv_cache_gb, or lower the context "
     "(rollout.max_prompt_tokens, rollout.max_new_tokens or rollout.role_max_new_tokens)"),
    ("start vLLM", "context 20,480 tokens", VLLM_KV_ERROR, {}, True,
     "preflight: start vLLM (context 20,480 tokens): vLLM's KV cache cannot hold one sequence of "
     "the context (20,480 tokens): raise engine.gpu_memory_utilization, or lower the context "
     "(rollout.max_prompt_tokens, rollout.max_new_tokens or rollout.role_max_new_tokens)"),
    ("responder", "16,384 + 8 x 4,096 tokens", torch.OutOfMemoryError(), {}, True,
     "preflight: responder (16,384 + 8 x 4,096 tokens) ran out of device memory: lower "
     "engine.gpu_memory_utilization (the trainer's weights and AdamW stay beside vLLM), or shard "
     "the policy over more ranks (engine.fsdp_shard_size)"),
    ("sync", "buckets of 512 MiB", torch.OutOfMemoryError(), {}, True,
     "preflight: sync (buckets of 512 MiB) ran out of device memory: lower engine.sync_bucket_mb "
     "(about three buckets are alive at once) or engine.gpu_memory_utilization (vLLM's KV cache "
     "wakes up here)"),
    ("sleep", "level 1", torch.OutOfMemoryError(), {"engine__sleep_level": 1}, True,
     "preflight: sleep (level 1) ran out of device memory: set engine.sleep_level = 2 (vLLM drops "
     "its weights instead of copying them to host memory; the sync restores them)"),
    # our own checks name their key themselves
    ("verifier", "900 + samples of 192 tokens",
     infra.ConfigError("its longest prompt ...: raise rollout.max_prompt_tokens"), {}, False,
     "preflight: verifier (900 + samples of 192 tokens): its longest prompt ...: raise "
     "rollout.max_prompt_tokens"),
    ("save", "", OSError(errno.ENOSPC, "No space left on device", "/runs/x/preflight.tmp"), {},
     False, "preflight: save: No space left on device (/runs/x/preflight.tmp): choose a "
            "log.out_dir with room for a checkpoint"),
])
def test_a_failure_is_one_line_naming_the_key_to_change(phase, what, error, keys, on_gpu, line):
    failure = preflight.failure_line(phase, what, error, config(**keys), on_gpu)
    assert failure == preflight.Failure(line)  # known: no traceback to show


def test_an_unknown_error_names_its_phase_and_keeps_its_traceback():
    try:
        raise KeyError("boom")
    except KeyError as e:
        failure = preflight.failure_line("sync", "", e, config(), False)
    assert failure.line == "preflight: sync failed: KeyError: 'boom'" and not failure.peer_gone
    assert "Traceback" in failure.trace and "raise KeyError" in failure.trace


def test_a_rank_gone_is_a_hedged_line_naming_the_phases_keys():
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:39314. This is typically caused by a remote worker crashing.")
    failure = preflight.failure_line("update", "2,048 tokens per row", gone, config(), False)
    assert failure.peer_gone and failure.trace is None
    assert failure.line == (
        "preflight: update (2,048 tokens per row): a rank left (its own line is above if it "
        "failed; torchrun's report says SIGKILL if the host ran out of memory: lower "
        "engine.micro_batch_tokens or raise engine.sequence_parallel)")


def test_each_groups_timeout_is_printed_and_a_shorter_one_warned_about():
    minutes = lambda m: datetime.timedelta(minutes=m)  # noqa: E731
    found = [("world", minutes(120)), ("policy mesh shard", minutes(120)),
             ("vLLM ep:0 cpu", minutes(30)), ("vLLM ep:0 device", minutes(10)),
             ("preflight", minutes(120))]
    assert preflight.timeout_lines(found, 120) == [
        "groups waiting 10 min for their slowest rank: vLLM ep:0 device",
        "groups waiting 30 min for their slowest rank: vLLM ep:0 cpu",
        "groups waiting 120 min for their slowest rank: world, policy mesh shard, preflight",
        "WARNING: vLLM ep:0 cpu, vLLM ep:0 device wait less than "
        "engine.collective_timeout_min = 120 min"]
    assert preflight.timeout_lines(found[:2], 7.5) == [
        "groups waiting 120 min for their slowest rank: world, policy mesh shard"]


@pytest.mark.parametrize("on_gpu", [False, True])
def test_every_phase_of_main_has_its_remedy(on_gpu):
    source = Path(preflight.__file__).read_text()
    phases = set(re.findall(r'run\.phase\("([^"]+)"', source)) | set(spell.ROLES.values())
    assert set(preflight.remedies(config(), on_gpu)) == phases


def test_the_estimate_beside_each_phase_is_infras_for_that_phase(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * 2**30))
    cfg = config()
    est = infra.memory_estimate(cfg, LlamaConfig.from_pretrained(tmp_path), 8, 80.0,
                                spell.longest_sequence(cfg))
    assert preflight.memory_estimates(cfg, str(tmp_path), torch.device("cuda", 0), 8) == {
        "load policy": est["start_phase"],
        **dict.fromkeys(spell.ROLES.values(), est["rollout_phase"]),  # every role's, a fork's too
        "update": est["update_phase"]}
    assert preflight.memory_estimates(cfg, str(tmp_path), torch.device("cpu"), 8) == {}


# ------------------------------------------------------------------------------------------------
# The sizes: the largest row, the prompts, the full budget
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, tokens, sequences", [
    # config.toml: a group of 16,384 prompt tokens and 4 completions of 4,096 fills 32,768
    ({}, 32768, 4),
    # unshared: one 20,480-token sequence, then one of 8,192 + 4,096
    ({"engine__shared_prefix": False}, 32768, 2),
    # a row's budget below one rollout: that rollout is the row
    ({"engine__micro_batch_tokens": 1024}, 20480, 1),
    # sequence parallelism: 2 ranks share a row of 2 x 16,384
    ({"engine__micro_batch_tokens": 16384, "engine__sequence_parallel": 2}, 32768, 4),
    # 100 + 30 x 30 + 5: the last completion shorter
    ({"rollout__max_prompt_tokens": 100, "rollout__max_new_tokens": 30,
      "engine__micro_batch_tokens": 1005}, 1005, 31),
    # 7 x (100 + 30), then 65 + 30
    ({"rollout__max_prompt_tokens": 100, "rollout__max_new_tokens": 30,
      "engine__micro_batch_tokens": 1005, "engine__shared_prefix": False}, 1005, 8),
])
def test_the_largest_row_is_one_micro_batch_of_the_row_budget(keys, tokens, sequences):
    cfg = config(**keys)
    seqs = preflight.largest_row(cfg, vocab=1000)
    assert preflight.row_tokens(cfg) == tokens and len(seqs) == sequences
    # spell's own planning (no process group: its all-reduce is the identity)
    [plan], split = spell.plan_update(seqs, cfg, torch.device("cpu"))
    assert len(plan) == 1 and split == 0
    assert spell.pack_sequences([(s.prompt, s.completion) for s in plan[0]],
                                cfg.engine.shared_prefix)["input_ids"].shape[1] == tokens
    assert all(0 <= t < 1000 for s in seqs for t in s.prompt + s.completion)
    assert sum(s.weight * len(s.completion) for s in seqs) == pytest.approx(1.0, abs=1e-12)
    assert preflight.largest_row(cfg, vocab=1000) == seqs  # the same on every rank


def test_a_long_prompt_is_exactly_as_long_and_keeps_the_chat_templates_ends():
    corpus = [spell.Cluster("a", "doc_qa", ["One report. " * 5, "Another report."])]
    for length in (40, 1000, 4097):
        ids = preflight.long_prompt(CharTokenizer(), corpus, length)
        text = "".join(map(chr, ids))
        assert len(ids) == length
        assert text.startswith("<|user|>One report.") and text.endswith("report.<|assistant|>")


def test_the_verifiers_longest_prompt_holds_the_questioners_budget_and_a_long_reference():
    words = " ".join(f"w{i}" for i in range(3000))
    corpus = [spell.Cluster("a", "doc_qa", [words])]
    tok = DecodingTokenizer()
    short, long = (preflight.verifier_prompt_ids(
        tok, config(rollout__role_max_new_tokens={"que": n, "res": 0, "ver": 0}), corpus)
        for n in (500, 800))
    # one token a character, one space between words: the question grows by 300 tokens
    assert len(long) - len(short) == 300
    text = "".join(map(chr, long))
    reference = " ".join(f"w{i}" for i in range(30))  # rollout.max_answer_words = 30
    # (the fence folds whitespace, the last space of the question's 800 characters with it)
    assert f"Answer 2: ⟦{reference}⟧" in text and f"Question: ⟦{words[:800].strip()}⟧" in text


def test_under_rlvr_the_verifier_sees_the_sets_longest_question_and_answer():
    qa = [{"question": "Short?", "answer": "a very long answer indeed"},
          {"question": "A much longer question than that?", "answer": "short"}]
    corpus = [spell.Cluster(f"c{i}", "doc_qa", ["Doc."], q) for i, q in enumerate(qa)]
    text = "".join(map(chr, preflight.verifier_prompt_ids(
        DecodingTokenizer(), config(data__qa="set.jsonl"), corpus)))
    assert ("Question: ⟦A much longer question than that?⟧" in text
            and "Answer 2: ⟦a very long answer indeed⟧" in text)


def test_a_prompt_and_budget_past_vllms_context_stop_before_the_engine_naming_the_keys():
    cfg = config(rollout__max_prompt_tokens=1000, rollout__max_new_tokens=100)
    with pytest.raises(infra.ConfigError, match=r"its longest prompt, 1,001 tokens, and its "
                       r"budget, 100, pass vLLM's context of 1,100 .*raise "
                       r"rollout.max_prompt_tokens, or lower rollout.role_max_new_tokens.ver or "
                       r"the questioner's budget"):
        preflight.rollout(None, cfg, "ver", [0] * 1001, group=0)


def test_full_budget_makes_every_request_sample_its_whole_budget():
    seen = []
    llm = SimpleNamespace(generate=lambda prompts, params, **kw: seen.append((params, kw)) or "out")
    params = [SimpleNamespace(max_tokens=16, min_tokens=0, ignore_eos=False),
              SimpleNamespace(max_tokens=384, min_tokens=0, ignore_eos=False)]
    assert preflight.FullBudget(llm).generate(["p", "q"], params, use_tqdm=False) == "out"
    assert [(p.min_tokens, p.ignore_eos) for p in seen[0][0]] == [(16, True), (384, True)]
    assert seen[0][1] == {"use_tqdm": False}


def test_clean_up_removes_the_scratch_folder_and_an_out_dir_it_made(tmp_path):
    for made in (True, False):
        out = tmp_path / f"made-{made}"
        (out / preflight.SCRATCH / "checkpoints").mkdir(parents=True)
        run = SimpleNamespace(rank=0, made_out_dir=made, holds_scratch=True,
                              cfg=config(log__out_dir=str(out)))
        preflight.Preflight.clean_up(run, barrier=False)
        assert not out.exists() if made else list(out.iterdir()) == []


# a live preflight's rank 0, as far as the lock goes: an exclusive flock on the scratch folder's
# .lock, its holder written in it, held until the process ends
LIVE_PREFLIGHT = ("import fcntl, os, socket, sys, time\n"
                  "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                  "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                  "os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode())\n"
                  "print('held', flush=True)\n"
                  "time.sleep(600)\n")


def test_a_second_preflight_leaves_a_live_ones_scratch_checkpoint_alone(tmp_path):
    """Two preflights into one log.out_dir: the second removed the first's scratch folder (its
    checkpoint mid-save or mid-load) before it took the folder's lock, and again when it stopped.
    Now it takes the lock first, stops naming the holder, and its clean-up leaves the folder; what a
    killed preflight left (no live holder) is removed as before."""
    out = tmp_path / "run"
    scratch = out / preflight.SCRATCH
    (scratch / "checkpoints" / "step_000001").mkdir(parents=True)
    (scratch / "checkpoints" / "step_000001" / "rank0.pt").write_text("the live one's")
    first = subprocess.Popen([sys.executable, "-c", LIVE_PREFLIGHT, str(scratch / ".lock")],
                             stdout=subprocess.PIPE, text=True)
    second = SimpleNamespace(rank=0, made_out_dir=False, holds_scratch=False,
                             cfg=config(log__out_dir=str(out)))
    try:
        assert first.stdout.readline() == "held\n"
        with pytest.raises(infra.ConfigError, match=re.escape(
                f"log.out_dir {infra.shown(str(scratch))}: another run holds it (pid {first.pid}")):
            preflight.Preflight.hold_scratch(second)
        preflight.Preflight.clean_up(second, barrier=False)
        live = scratch / "checkpoints" / "step_000001" / "rank0.pt"
        assert live.read_text() == "the live one's"
    finally:
        first.kill()
        first.wait()
    preflight.Preflight.hold_scratch(second)  # the first is gone: what it left goes, the lock stays
    assert second.holds_scratch and [p.name for p in scratch.iterdir()] == [".lock"]
    preflight.Preflight.clean_up(second, barrier=False)
    assert not scratch.exists()


# ------------------------------------------------------------------------------------------------
# Beyond one of each: a round's time, the disk, the compiled variants
# ------------------------------------------------------------------------------------------------

# a request of 1,000 prompt tokens and 1 sample of 100: 2 s of prefill, 40 s of decode (0.4 s a
# step), on a model whose weights weigh as much as 8,950 tokens of KV cache: the measured step
# read 8,950 + 1,000 + 100 / 2 = 10,000 tokens' worth
REF = preflight.Timing(prefill_s=2.0, decode_s=40.0, prompt=1000, samples=1, budget=100)


def test_a_phase_of_a_round_scales_prefill_by_tokens_and_decode_by_waves_and_reads():
    def seconds(count, prefills, prompt, samples, kv_tokens, max_seqs):
        req = preflight.Requests("x", count, prefills, prompt, samples, 100, REF)
        return preflight.phase_seconds(req, kv_tokens, max_seqs, 8950)

    # 10 prompts like the measured one: prefill 10 x 2 s. A cache of 4,400 tokens holds 4 of
    # them (1,100 each): 3 waves of 100 steps, each step reading 8,950 + 4 x 1,050 = 13,150
    # tokens' worth, 1.315 x the measured 0.4 s
    assert seconds(10, 10, 1000, 1, 4400, 256) == pytest.approx(20 + 3 * 100 * 0.4 * 1.315)
    # an unknown cache: one prompt at a time, each step as measured
    assert seconds(10, 10, 1000, 1, None, 256) == pytest.approx(20 + 10 * 100 * 0.4)
    # 8 samples a prompt and 16 sequences at most: 2 prompts a wave however large the cache; a
    # prompt of 500 tokens prefills in half the time
    assert seconds(4, 4, 500, 8, 10**9, 16) == \
        pytest.approx(4 + 2 * 100 * 0.4 * (8950 + 16 * 550) / 10_000)
    # 10 requests of 5 distinct prompts (the prefix cache has the rest): 5 prefills
    assert seconds(10, 5, 1000, 1, None, 256) == pytest.approx(10 + 10 * 100 * 0.4)


def test_a_rounds_requests_are_what_rollout_round_generates_on_one_engine():
    cfg = config()  # config.toml's: 480 clusters a round, G = 8, the grounding check, 8 votes
    t = {role: REF for role in ("que", "res", "ver")}
    assert [r[:6] for r in preflight.round_requests(cfg, 8, t)] == [
        ("questioner", 60, 60, 16384, 1, 4096), ("grounding", 60, 60, 4096, 1, 4096),
        ("responder", 60, 60, 16384, 8, 4096), ("verifier", 480, 480, 1000, 8, 4096)]
    # a request per vote, of two prompts an answer; no grounding check; under RLVR (no
    # questioner) no grounding either
    cfg = config(bootstrap__verdict_order="random", rollout__grounding_filter=False)
    assert [r[:5] for r in preflight.round_requests(cfg, 8, t)][1:] == [
        ("responder", 60, 60, 16384, 8), ("verifier", 3840, 960, 1000, 1)]
    assert [r.name for r in preflight.round_requests(config(), 8, {"res": REF})] == ["responder"]
    # paired votes (spell.sample_answer_votes): a request of 8 replies per verdict order, two
    # prompts an answer
    cfg = config(bootstrap__verdict_order="paired")
    assert preflight.round_requests(cfg, 8, t)[-1][:5] == ("verifier", 960, 960, 1000, 8)


def test_a_round_past_half_the_collective_timeout_is_a_warning_naming_the_keys():
    cfg = config(rollout__clusters_per_round=16, rollout__max_prompt_tokens=1000,
                 rollout__max_new_tokens=100, rollout__group_size=1,
                 rollout__grounding_filter=False, reward__judge="rule")
    t = {"que": REF, "res": REF}
    # 2 engines: 8 questioner prompts and 8 responder prompts, one at a time, 42 s each: 11.2 min
    line = preflight.round_line(cfg, 2, t, None, 256, 8950, sync_s=3.0)
    assert line == ("a round of one engine: ~11.2 min (questioner 8 x 42.0 s, responder 8 x "
                    "42.0 s; from the measured prefill and decode, KV cache unknown) against "
                    "engine.collective_timeout_min = 120: within half of it")
    # 4 prompts a wave in a cache of 4,400 tokens (test above): 2 x 121.2 s, and two syncs more
    # a round under the frozen judge: 4.1 min, past half of 8
    cfg.engine.collective_timeout_min = 8.0
    cfg.reward.judge = "frozen"
    line = preflight.round_line(cfg, 2, t, 4400, 256, 8950, sync_s=3.0)
    assert line.startswith("WARNING: a round of one engine: ~") and line.endswith(
        "judge swaps 2 x 3.0 s; from the measured prefill and decode, 4,400 tokens of KV cache) "
        "against engine.collective_timeout_min = 8: past half of it. A rank whose round ends "
        "early waits that long in the all-reduce after it: raise "
        "engine.collective_timeout_min, or lower rollout.clusters_per_round"), line


def test_the_disk_line_counts_the_checkpoints_kept_and_the_export_against_the_free_disk():
    """config.toml: 1000 steps, a save every 10 (100 saves), 2 kept and a third being written; a
    7B checkpoint is 12 bytes a parameter (91 GB), its bf16 export 2 (15 GB)."""
    cfg, gb = config(), 10**9
    fits = preflight.disk_line(cfg, 91 * gb, 15 * gb, 500 * gb)
    assert fits == ("disk: 100 checkpoint(s) of 84.75 GiB (train.steps 1000, log.save_every 10), "
                    "at most 3 on disk at once (log.keep_checkpoints = 2, and the one being "
                    "written), and the HF export's 13.97 GiB: 268.2 GiB of the 465.7 GiB free in "
                    "log.out_dir")
    assert preflight.disk_line(cfg, 91 * gb, 15 * gb, 200 * gb).endswith(
        "of the 186.3 GiB free in log.out_dir: it does not fit: lower log.keep_checkpoints, or "
        "choose a log.out_dir with more room")
    every = preflight.disk_line(config(log__keep_checkpoints=0, train__steps=1001), 91 * gb, 0,
                                500 * gb)  # 101 saves: the last step's too
    assert every.startswith("WARNING: disk: 101 checkpoint(s) of 84.75 GiB (train.steps 1001, "
                            "log.save_every 10), at most 101 on disk at once "
                            "(log.keep_checkpoints = 0), ") and "set log.keep_checkpoints" in every


def test_without_flex_attention_nothing_is_compiled():
    assert preflight.compile_like_a_run(None, config(), torch.device("cpu"), 1000) == (
        "compile: nothing (attention sdpa, engine.compile_layers off: the project compiles only "
        "FlexAttention and, asked, the decoder layers)")


def test_the_compile_rows_are_the_dummy_an_odd_row_and_the_largest_with_and_without_grad():
    cfg = config(rollout__max_prompt_tokens=100, rollout__max_new_tokens=30,
                 engine__micro_batch_tokens=1005)
    rows = preflight.compile_rows(cfg, 1000)
    lengths = [spell.pack_sequences([(s.prompt, s.completion) for s in seqs],
                                    shared=True)["input_ids"].shape[1] for seqs, _ in rows]
    assert lengths == [2, 2, 385, 385, 1005] and [g for _, g in rows] == [False, True] * 2 + [False]
    assert 385 % 128 and rows[0][0] == [spell.dummy_sequence()]


def train_rows_of_other_lengths(policy, cfg: spell.Config, backward: bool) -> None:
    """Rows of 97, 129 and 640 tokens, none of the pre-flight's lengths, each without and with
    grad as a run trains them (the backward too, where asked)."""
    g = np.random.default_rng(1)
    for length in (97, 129, 640):
        seqs = [spell.Seq(prompt=g.integers(1000, size=length - 20).tolist(),
                          completion=g.integers(1000, size=20).tolist(), advantage=1.0,
                          weight=0.05)]
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                loss = spell.micro_batch_loss(policy, seqs, None, cfg, torch.device("cpu"))[0]
                if grad and backward:
                    loss.backward()


@pytest.mark.stack
def test_after_the_preflight_compiled_layers_compile_nothing_new():
    """engine.compile_layers: after the update phase's row and compile_like_a_run, rows of other
    lengths, with and without grad, run on the decoder layer's variants the pre-flight made. A
    tiny SDPA Llama with checkpointing, trained (SDPA has a backward on CPU), its layers compiled
    as shard_policy compiles them (aot_eager on CPU)."""
    from conftest import tiny_llama

    cfg = config(rollout__max_prompt_tokens=200, rollout__max_new_tokens=60,
                 engine__micro_batch_tokens=700, engine__compile_layers=True)
    policy = tiny_llama()
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    infra.train_mode_without_dropout(policy)
    infra.compile_decoder_layers(policy, "cpu")
    forward = type(policy.model.layers[0]).forward
    assert infra.compiled_variants(forward) == 0  # nothing before the first call
    device = torch.device("cpu")
    spell.micro_batch_loss(policy, preflight.largest_row(cfg, 1000), None, cfg, device)[0].backward()
    line = preflight.compile_like_a_run(policy, cfg, device, 1000)
    made = infra.compiled_variants(forward)
    print(f"METRIC compiled_layer_variants={made}")
    assert line == (f"compile: the decoder layer {made} variant(s) of dynamo's recompile_limit = "
                    f"{torch._dynamo.config.recompile_limit} (rows of 2, 385 and 700 tokens, "
                    "with and without grad)")
    assert 0 < made < torch._dynamo.config.recompile_limit
    train_rows_of_other_lengths(policy, cfg, backward=True)
    assert infra.compiled_variants(forward) == made


@pytest.mark.stack
def test_after_the_preflights_compile_a_runs_rows_compile_nothing_new(monkeypatch):
    """Issue #41 (G8): the update's compiled variants are made by the preflight, not first inside
    a real step: after the update phase's row (with grad) and compile_like_a_run, rows of other
    lengths, with and without grad, as a run trains them, find every variant they need. A tiny
    FlexAttention Llama, frozen (torch 2.13 has no FlexAttention backward on CPU; grad mode is what
    dynamo guards on). Watched fail with the dummy row left out of compile_rows: the 1-block
    variants were compiled later, by the run's 97-token row."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from conftest import tiny_llama

    cfg = config(engine__attn_implementation="flex_attention", rollout__max_prompt_tokens=200,
                 rollout__max_new_tokens=60, engine__micro_batch_tokens=700)
    policy = tiny_llama(attn="flex_attention").requires_grad_(False)
    device = torch.device("cpu")
    with torch.enable_grad():  # the update phase: the largest row, with grad
        spell.micro_batch_loss(policy, preflight.largest_row(cfg, 1000), None, cfg, device)
    line = preflight.compile_like_a_run(policy, cfg, device, 1000)
    made = (infra.compiled_variants(flex_attention), infra.compiled_variants(create_block_mask))
    assert line == (f"compile: flex_attention {made[0]} variant(s), the BlockMask builder "
                    f"{made[1]}, of infra.FLEX_RECOMPILE_LIMIT = {infra.FLEX_RECOMPILE_LIMIT} "
                    f"each (rows of 2, 385 and 700 tokens, with and without grad)")
    train_rows_of_other_lengths(policy, cfg, backward=False)
    assert (infra.compiled_variants(flex_attention),
            infra.compiled_variants(create_block_mask)) == made


# ------------------------------------------------------------------------------------------------
# On the stack: the demo preset end to end, a failure that names its key, the ranks' agreement
# ------------------------------------------------------------------------------------------------

# the demo preset, short and small: 768-token prompts, 16-token budgets, rows of 784 (one rollout),
# recomputed layers and 1 GiB of KV cache (about 5 GiB a rank at its peak); vLLM in fp32, eager
# (bf16 would compile for a minute on an AMX CPU)
SHORT = ["--engine.cpu_bf16=false", "--rollout.max_prompt_tokens=768",
         "--rollout.max_new_tokens=16", "--rollout.role_max_new_tokens=que:0,res:0,ver:0",
         "--engine.micro_batch_tokens=768", "--engine.gradient_checkpointing=true",
         "--engine.kv_cache_gb=1"]
# the lines main prints before the table besides the header: versions, allocator, timeouts
ENVIRONMENT_LINES = ("torch ", "allocator: ", "groups waiting ", "WARNING: ")
PHASES = ["launch checks", "start vLLM", "load policy", "questioner", "responder", "verifier",
          "sleep", "update", "compile", "sync", "save", "load"]


def tree(root: Path) -> dict[str, bytes | int]:
    """Every path under `root`: a small file's bytes, a large one's size (a checkpoint written
    where it must not be would otherwise be read, and diffed, whole)."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.stat().st_size > 1 << 16
                                       else p.read_bytes()) if p.is_file() else 0
            for p in sorted(root.rglob("*"))}


def table_rows(output: str) -> dict[str, str]:
    """The printed table's rows by phase (the line after the header)."""
    lines = output.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("phase   ")))
    return {line.split("  ")[0]: line for line in lines[start + 1:start + 1 + len(PHASES)]
            if line.split("  ")[0] in PHASES}


@pytest.mark.stack
def test_demo_preflight_prints_every_phase_and_leaves_the_run_as_it_was(embedded_dir, corpus_file,
                                                                        tmp_path):
    out = tmp_path / "run"
    # a run already there: its checkpoint and metrics must be neither read nor touched
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "checkpoints" / "step_000002" / "meta.json").write_text('{"step": 2}')
    (out / "checkpoints" / "latest").write_text("step_000002")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = tree(out)
    t0 = time.perf_counter()
    proc = torchrun(2, "spell.py", "preflight", "--config", str(REPO / "presets" / "demo.toml"),
                    f"--data.corpus={corpus_file}", f"--log.out_dir={out}", *SHORT)
    print(proc.stdout[-4000:], f"\n{time.perf_counter() - t0:.0f} s")
    rows = table_rows(proc.stdout)
    assert list(rows) == PHASES
    # every rollout ran to its whole budget (rollout checks it) at the longest prompt
    assert "768 + 1 x 16 tokens" in rows["questioner"]
    assert "768 + 4 x 16 tokens" in rows["responder"]
    assert re.search(r"verifier\s+\d{3},?\d* \+ 4 x 16 tokens", rows["verifier"])
    assert "784 tokens per row" in rows["update"] and "off" in rows["sleep"]
    assert re.search(r"save\s+\d\.\d\d GiB", rows["save"])
    # the versions, the allocator's settings and each group's timeout, before the table
    said = [line.removeprefix("preflight: ") for line in proc.stdout.splitlines()
            if line.startswith("preflight: ")]
    assert said[1] == infra.version_line(torch.device("cpu"))
    assert said[2] == infra.allocator_lines({}, "")[0]  # nothing set on CPU
    groups = re.fullmatch(r"groups waiting 120 min for their slowest rank: (.*)", said[3])
    assert groups and len(said) == 5, said  # one timeout for all, no warning; the last line
    assert {"world", "policy mesh shard", "preflight", "vLLM world:0 device",
            "vLLM world:0 cpu", "vLLM tp:0 device"} <= set(groups.group(1).split(", "))
    assert re.search(r"compile\s+nothing\s", rows["compile"])
    *_, compiled, round_time, disk, last = proc.stdout.rstrip().splitlines()
    assert compiled == ("compile: nothing (attention sdpa, engine.compile_layers off: the "
                        "project compiles only FlexAttention and, asked, the decoder layers)")
    # the demo's 48 clusters a round over 2 engines: 24 questions, their grounding checks, 24
    # prompts of 4 answers, and two requests of 4 replies an answer (verdict_order "paired"):
    # 24 x 4 x 2
    assert re.fullmatch(r"a round of one engine: ~\d+\.\d min \(questioner 24 x [0-9.]+ s, "
                        r"grounding 24 x [0-9.]+ s, responder 24 x [0-9.]+ s, verifier 192 x "
                        r"[0-9.]+ "
                        r"s; from the measured prefill and decode, [0-9,]+ tokens of KV cache\) "
                        r"against engine.collective_timeout_min = 120: (within half of it|past "
                        r"half of it\. .*)", round_time.removeprefix("WARNING: ")), round_time
    assert re.fullmatch(r"disk: 1 checkpoint\(s\) of \d\.\d\d GiB \(train.steps 2, "
                        r"log.save_every 2\), at most 1 on disk at once \(log.keep_checkpoints = "
                        r"2\), and the HF export's 0.50 GiB: .* GiB free in log.out_dir",
                        disk), disk
    assert last.startswith("preflight: 12 phases passed in ")
    assert tree(out) == before  # the scratch checkpoint is gone, the run's untouched


@pytest.mark.stack
def test_a_kv_cache_too_small_for_the_context_names_engine_kv_cache_gb(embedded_dir, corpus_file,
                                                                      tmp_path):
    out = tmp_path / "new"
    # SmolLM2 in fp32 keeps 45 KiB a token: 1 GiB holds 23K of the 30,016 (YaRN x4 makes room)
    proc = torchrun(2, "spell.py", "preflight", "--config", str(REPO / "presets" / "demo.toml"),
                    f"--data.corpus={corpus_file}", f"--log.out_dir={out}", *SHORT[:1],
                    "--model.rope_scaling=yarn:4", "--rollout.max_prompt_tokens=30000",
                    "--rollout.max_new_tokens=16", "--rollout.role_max_new_tokens=que:0",
                    "--engine.kv_cache_gb=1", check=False)
    print(proc.stdout[-4000:])
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("preflight: start vLLM")]
    assert lines == [
        "preflight: start vLLM (context 30,016 tokens): vLLM's KV cache cannot hold one sequence "
        "of the context (30,016 tokens): raise engine.kv_cache_gb, or lower the context "
        "(rollout.max_prompt_tokens, rollout.max_new_tokens or rollout.role_max_new_tokens)"]
    assert list(table_rows(proc.stdout)) == ["launch checks"]  # the table of what passed
    assert not out.exists()  # made for the scratch checkpoint, removed


@pytest.mark.stack
def test_a_prompt_beyond_the_models_context_stops_at_the_launch_checks(embedded_dir, corpus_file,
                                                                      tmp_path):
    out = tmp_path / "new"
    # SmolLM2-135M holds 8,192 tokens: 8,000 + 384 do not fit
    proc = torchrun(2, "spell.py", "preflight", "--config", str(REPO / "presets" / "demo.toml"),
                    f"--data.corpus={corpus_file}", f"--log.out_dir={out}",
                    "--rollout.max_prompt_tokens=8000", check=False)
    print(proc.stdout[-3000:])
    lines = [line for line in proc.stdout.splitlines() if "preflight: " in line
             and not line.startswith(tuple(f"preflight: {w}" for w in ENVIRONMENT_LINES))]
    assert proc.returncode != 0 and len(lines) == 2  # the header, then the failure
    assert re.fullmatch(
        r"preflight: launch checks \(2 ranks, the data, log.out_dir\): rollout.max_prompt_tokens "
        r"\+ the largest role budget .*: 8000 \+ 384 = 8384 tokens, beyond the 8192-token context "
        r"of the model .*", lines[1])
    assert not out.exists()


def worker_failure(mode: str, out_dir: str) -> None:
    """Two ranks, one phase that passes, then an update that runs out of memory: on both ranks
    ("both"), or on rank 1 only while rank 0 waits in a collective of the default group that rank
    1 never joins ("one"); or rank 0 killed as the kernel kills a process out of host memory,
    rank 1 waiting ("killed")."""
    preflight.STRAGGLER_WAIT_S = 5.0
    cfg = config(log__out_dir=out_dir)
    rank, world, device = spell.init_distributed(cfg)
    run = preflight.Preflight(cfg, rank, world, device)
    with run.phase("launch checks", "a phase that passes"):
        pass
    with run.phase("update", "32,768 tokens per row"):
        if mode == "killed" and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "both" or mode == "one" and rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        torch.distributed.barrier()
    print("UNREACHED", flush=True)


OOM_LINE = ("preflight: update (32,768 tokens per row) ran out of device memory: lower "
            "engine.micro_batch_tokens or raise engine.sequence_parallel")


@pytest.mark.stack
def test_a_failure_on_every_rank_is_one_line_from_rank_zero(tmp_path):
    proc = torchrun(2, __file__, "failure", "both", str(tmp_path / "run"), check=False)
    print(proc.stdout[-3000:])
    lines = proc.stdout.splitlines()
    assert proc.returncode != 0 and "UNREACHED" not in proc.stdout
    assert [line for line in lines if "preflight: " in line] == [OOM_LINE]
    assert list(table_rows(proc.stdout)) == ["launch checks"]
    assert not (tmp_path / "run").exists()


@pytest.mark.stack
def test_a_rank_failing_while_the_other_waits_in_a_collective_ends_the_job(tmp_path):
    t0 = time.perf_counter()
    proc = start_torchrun(2, __file__, "failure", "one", str(tmp_path / "run"))
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_torchrun(proc)
        raise
    print(out[-3000:])
    # rank 1 waited STRAGGLER_WAIT_S = 5 s for rank 0, which sat in the barrier, then ended the job
    assert proc.returncode != 0 and "UNREACHED" not in out and time.perf_counter() - t0 < 100
    assert out.count(f"rank 1: {OOM_LINE}") == 1


@pytest.mark.stack
def test_a_rank_killed_mid_phase_leaves_the_next_rank_to_name_the_phase(tmp_path):
    proc = torchrun(2, __file__, "failure", "killed", str(tmp_path / "run"), check=False)
    print(proc.stdout[-3000:])
    assert proc.returncode != 0 and "UNREACHED" not in proc.stdout
    assert [line for line in proc.stdout.splitlines() if "preflight: " in line] == [
        "rank 1: preflight: update (32,768 tokens per row): a rank left (its own line is above if "
        "it failed; torchrun's report says SIGKILL if the host ran out of memory: lower "
        "engine.micro_batch_tokens or raise engine.sequence_parallel)"]


def worker_hang() -> None:
    """A rank that ignores SIGTERM (spell's ranks only note it and finish their step) and never
    ends, as a rank waiting in a collective for a peer that is gone."""
    signal.signal(signal.SIGTERM, lambda *_: None)
    os.write(1, f"HANGING {os.getpid()}\n".encode())  # one write: the ranks share one pipe
    time.sleep(600)


@pytest.mark.stack
def test_stopping_a_hung_job_stops_its_ranks_too():
    """conftest.stop_torchrun, which every test uses on a job that outlives its time: the ranks,
    in sessions of their own, must not outlive torchrun. (Watched: with a SIGKILL to torchrun's
    group alone, as before, the ranks lived on and this test hung in `communicate`.)"""
    proc = start_torchrun(2, __file__, "hang")
    ranks = set()
    for line in proc.stdout:
        ranks.update(int(pid) for pid in re.findall(r"HANGING (\d+)", line))
        if len(ranks) == 2:
            break
    assert ranks <= descendants(proc.pid)
    stop_torchrun(proc, grace_s=2.0)  # shorter than torchrun's own 30 s wait for its ranks
    deadline = time.monotonic() + 10
    while running(ranks) and time.monotonic() < deadline:  # SIGKILL lands at once; 10 s is slack
        time.sleep(0.2)
    assert not running(ranks), "ranks still running after stop_torchrun"


def running(pids: set[int]) -> set[int]:
    """The processes of `pids` that still run (a zombie has ended; its parent has not reaped it)."""
    return {pid for pid in pids if (fields := process_stat(pid)) and fields[0] != "Z"}


if __name__ == "__main__":
    run_worker({"failure": worker_failure, "hang": worker_hang})
