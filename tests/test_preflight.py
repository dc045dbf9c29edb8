"""Tests of preflight.py (`spell.py preflight`): the table, the line each failure prints and the key
it names, the largest row as spell.plan_update packs it, the prompts at their budgets; on the stack,
the demo preset's preflight end to end, a failure that names its key, and the ranks' agreement on a
failure (one rank failing inside a collective must not leave the other waiting).
"""

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

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


@pytest.mark.parametrize("on_gpu", [False, True])
def test_every_phase_of_main_has_its_remedy(on_gpu):
    source = Path(preflight.__file__).read_text()
    phases = set(re.findall(r'run\.phase\("([^"]+)"', source)) | set(spell.ROLES.values())
    assert len(phases) == 11 and set(preflight.remedies(config(), on_gpu)) == phases


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
        "questioner": est["rollout_phase"], "responder": est["rollout_phase"],
        "verifier": est["rollout_phase"], "update": est["update_phase"]}
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


def test_the_roles_a_step_runs():
    assert preflight.rollout_roles(config()) == ["que", "res", "ver"]
    assert preflight.rollout_roles(config(data__qa="set.jsonl", reward__judge="rule")) == ["res"]


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
# On the stack: the demo preset end to end, a failure that names its key, the ranks' agreement
# ------------------------------------------------------------------------------------------------

# the demo preset, short and small: 768-token prompts, 16-token budgets, rows of 784 (one rollout),
# recomputed layers and 1 GiB of KV cache (about 5 GiB a rank at its peak); vLLM in fp32, eager
# (bf16 would compile for a minute on an AMX CPU)
SHORT = ["--engine.cpu_bf16=false", "--rollout.max_prompt_tokens=768",
         "--rollout.max_new_tokens=16", "--rollout.role_max_new_tokens=que:0,res:0,ver:0",
         "--engine.micro_batch_tokens=768", "--engine.gradient_checkpointing=true",
         "--engine.kv_cache_gb=1"]
PHASES = ["launch checks", "start vLLM", "load policy", "questioner", "responder", "verifier",
          "sleep", "update", "sync", "save", "load"]


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
    return {line.split("  ")[0]: line for line in lines[start + 1:start + 12]
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
    assert proc.stdout.rstrip().splitlines()[-1].startswith("preflight: 11 phases passed in ")
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
    lines = [line for line in proc.stdout.splitlines() if "preflight: " in line]
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
