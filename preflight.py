"""`spell.py preflight`: each phase of a training step once, at the largest sizes the config allows.

Why: a run's memory peaks at its longest sample, which may come hours in, after the first
checkpoint; an out-of-memory error or a prompt beyond vLLM's context then costs those hours. This
finds it in minutes, before the run. It takes the run's config files and `--section.key=value`
overrides, starts what the run starts, and runs through spell.py's and infra.py's own functions:

  launch checks   the data (spell.load_data), the lengths against the model's context
                  (spell.check_lengths), infra.check_launch: ranks, meshes, log.out_dir
  start vLLM      spell.start_engine (on GPU it prints and applies infra's memory estimate first)
  load policy     spell.load_policy: the FSDP2 policy and its AdamW
  questioner      one prompt of rollout.max_prompt_tokens, 1 sample of the questioner's budget
  responder       one prompt of rollout.max_prompt_tokens, G samples of the responder's budget
  verifier        its longest prompt (a question as long as the questioner's budget, a reference
                  of rollout.max_answer_words words, an answer at its cap: spell.verifier_ids),
                  the votes of spell.sample_votes at the verifier's budget
  sleep           spell.sleep_engine: vLLM frees its memory for the update (GPU)
  update          spell.update_policy on one micro-batch of the largest packed row
                  (largest_row), an optimiser step included: AdamW's state is made here
  compile         with FlexAttention or engine.compile_layers, what a run compiles
                  (compile_like_a_run): the dummy row, a row not a multiple of 128 tokens and the
                  largest, with and without grad
  sync            spell.wake_and_sync: the new weights into vLLM
  save, load      spell.save_checkpoint, infra.resume_checkpoint and spell.load_checkpoint, in
                  <log.out_dir>/preflight.tmp, removed after: a run's own checkpoints are never
                  read or written

Every generation runs to its whole budget (vLLM's min_tokens and ignore_eos: FullBudget), so the
rollouts are as long as the config lets them be, whatever the model writes. Each phase is timed
(its slowest rank) and measured before and after (its largest rank): host memory (this process's
resident set and its peak in the phase) and on GPU device memory (torch's peak and the device's
use), beside infra.memory_estimate's figure for the phase. Rank 0 prints one table at the end,
then three lines on what a whole run needs: the compiled variants against
infra.FLEX_RECOMPILE_LIMIT; a round of one engine (every prompt it holds between two all-reduces)
extrapolated from each role's measured prefill and decode (round_line), against
engine.collective_timeout_min, a warning past half of it; and the checkpoints kept
(log.keep_checkpoints) and the HF export against the free disk of log.out_dir (disk_line).
Before the phases it prints the versions (torch, CUDA, NCCL, the NVIDIA driver, Triton) and the
caching allocator's settings (which variable torch reads; a warning when a user's setting turns
expandable segments off); once the policy is loaded, each process group's timeout (a warning for
any shorter than engine.collective_timeout_min).

When a phase fails (out of memory, a vLLM error, a length beyond the context, a bad key), the
preflight stops there: rank 0 prints the table so far and one line naming the key to change, and
every rank exits non-zero. The ranks agree on a failure after each phase over a gloo group of their
own (Preflight.agree); a rank that failed inside a collective, leaving the others waiting there,
waits STRAGGLER_WAIT_S for them and then prints its line itself and ends the job.

Launch (the run's own launch line, with `preflight` after spell.py):
  torchrun --nproc_per_node=8 spell.py preflight
  torchrun --nproc_per_node=2 spell.py preflight --config presets/demo.toml      # CPU, minutes

Not exercised: a whole round of rollouts (one prompt a role here: the longest, not the most; the
round's time is extrapolated), the grounding check (the responder's budget on a shorter prompt),
the weight swaps of reward.judge = "frozen" (counted in the round as two syncs), the held-out
verifier check and the HF export. On CPU the kernel kills a process that
runs out of host memory (SIGKILL in torchrun's report), which no Python code sees; the surviving
rank says which phase it was in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist

import evaluation
import infra
import recipes
import spell
import tasks

GiB = 2**30
# How long a rank that failed waits for the others to report; past it they are taken to be stuck in
# a collective the failed rank never joined (an FSDP all-gather, a DCP barrier), and it ends the job
STRAGGLER_WAIT_S = 60.0
SCRATCH = "preflight.tmp"  # the checkpoint's folder under log.out_dir, removed after
PF_EXITING = 0x4  # Linux's flag of a process that is exiting (include/linux/sched.h)


# ==================================================================================================
# The sizes: prompts, the largest row, what each phase runs at
# ==================================================================================================

def filler_text(corpus: Sequence[spell.Cluster], chars: int) -> str:
    """At least `chars` characters of the data's own documents, in order, repeated as needed."""
    docs = [d for c in corpus for d in c.documents] or ["preflight"]
    text, k = "", 0
    while len(text) < chars:
        text += docs[k % len(docs)] + "\n\n"
        k += 1
    return text


def long_prompt(tok, corpus: Sequence[spell.Cluster], length: int) -> list[int]:
    """A one-turn chat prompt of exactly `length` token ids (spell.chat_ids of the data's text,
    its middle cut as the eval cuts it, so the chat template's head and tail stay)."""
    chars = 8 * length
    while len(ids := spell.chat_ids(tok, filler_text(corpus, chars).rstrip())) < length:
        chars *= 2
    return evaluation.middle_truncate(ids, length)


def verifier_prompt_ids(tok, cfg: spell.Config, corpus: Sequence[spell.Cluster]) -> list[int]:
    """The verifier's longest prompt (spell.verifier_ids). Self-play: a question as long as the
    questioner's budget (it wrote the question), a reference of rollout.max_answer_words words
    (the questioner's limit), an answer cut at tasks.answer_cap of it. RLVR (data.qa): the set's
    longest question and longest answer."""
    text = filler_text(corpus, 16 * spell.max_new_tokens(cfg, "que") + 4096)
    if cfg.data.qa:
        question = spell.format_question(max((c.qa for c in corpus),
                                             key=lambda qa: len(spell.format_question(qa))))
        reference = max((c.qa["answer"] for c in corpus), key=len)
    else:
        ids = tok.encode(text, add_special_tokens=False)[:spell.max_new_tokens(cfg, "que")]
        question = tok.decode(ids)
        reference = " ".join(text.split()[:cfg.rollout.max_answer_words])
    predicted = text[:tasks.answer_cap(reference)]
    return spell.verifier_ids(tok, cfg, {"question": question}, predicted, reference)


def row_tokens(cfg: spell.Config) -> int:
    """The longest packed row an update trains: engine.micro_batch_tokens x
    engine.sequence_parallel (spell.row_budget), or one sequence of the longest prompt and the
    largest role budget (spell.longest_sequence) where that is longer: a unit longer than the
    budget gets a micro-batch of its own (spell.plan_micro_batches)."""
    return max(spell.row_budget(cfg), spell.longest_sequence(cfg))


def largest_row(cfg: spell.Config, vocab: int, seed: int = 0) -> list[spell.Seq]:
    """Sequences of random tokens that spell.plan_update packs into one micro-batch of
    row_tokens(cfg) tokens. With engine.shared_prefix, one group: a prompt of
    rollout.max_prompt_tokens and completions of the largest role budget (the last one shorter)
    sharing it, so SDPA's dense tree mask is as large as it gets; without, whole sequences. The
    same tokens on every rank (a sequence-parallel group trains the same row)."""
    prompt, budget, total = (cfg.rollout.max_prompt_tokens, spell.max_new_tokens(cfg),
                             row_tokens(cfg))
    if cfg.engine.shared_prefix:
        full, last = divmod(total - prompt, budget)
        shapes = [(prompt, budget)] * full + [(prompt, last)] * bool(last)
    else:
        shapes = [(prompt, budget)] * (total // (prompt + budget))
        left = total - len(shapes) * (prompt + budget)
        if left >= 2:  # a last, shorter sequence: a prompt token at least, and a completion token
            shapes.append((left - min(budget, left - 1), min(budget, left - 1)))
    rng = np.random.default_rng(seed)
    shared = rng.integers(vocab, size=prompt).tolist()
    completions = sum(c for _, c in shapes)
    return [spell.Seq(prompt=shared if p == prompt else rng.integers(vocab, size=p).tolist(),
                      completion=rng.integers(vocab, size=c).tolist(),
                      advantage=1.0 if k % 2 == 0 else -1.0,
                      weight=1.0 / completions)  # Eq. 12's normaliser: every completion token
            for k, (p, c) in enumerate(shapes)]


class FullBudget:
    """The vLLM engine as spell.generate calls it, with every request sampled to its whole
    budget: min_tokens = max_tokens keeps end-of-sequence and stop tokens (and the verifier's stop
    string) from ending it early, ignore_eos the end-of-sequence token."""

    def __init__(self, llm):
        self.llm = llm

    def generate(self, prompts, params, **kwargs):
        for p in params:
            p.min_tokens, p.ignore_eos = p.max_tokens, True
        return self.llm.generate(prompts, params, **kwargs)


class Timing(NamedTuple):
    """One request as measured: its prefill's seconds, its decode's (all its samples at once), its
    prompt's tokens, its samples and their budget."""
    prefill_s: float
    decode_s: float
    prompt: int
    samples: int
    budget: int


def rollout(llm, cfg: spell.Config, role: str, prompt: list[int],
            group: int) -> tuple[list[spell.Completion], Timing]:
    """One prompt of a role through spell's generation, its samples (spell.samples_per_prompt; the
    verifier's through spell.sample_votes, both verdict orders) each at the role's budget; and
    its Timing (the prefill alone first, then the samples on the cached prompt)."""
    budget, engine = spell.max_new_tokens(cfg, role), FullBudget(llm)
    if len(prompt) + budget > spell.longest_sequence(cfg):
        raise infra.ConfigError(
            f"its longest prompt, {len(prompt):,} tokens, and its budget, {budget:,}, pass vLLM's "
            f"context of {spell.longest_sequence(cfg):,} (rollout.max_prompt_tokens + the largest "
            f"role budget): raise rollout.max_prompt_tokens, or lower "
            f"rollout.role_max_new_tokens.{role}"
            + (" or the questioner's budget, which bounds the question"
               if role == "ver" and not cfg.data.qa else ""))
    seeds = spell.request_seeds(cfg.train.seed, "preflight", group, role, count=1)
    # the prompt's prefill alone (and one token), timed; vLLM's prefix cache keeps it, so the
    # samples below start from it and their time is the decode's
    t0 = time.perf_counter()
    spell.generate(llm, [prompt], n=1, seeds=seeds, desc=f"{spell.ROLES[role]} prefill",
                   **{**spell.sampling(cfg, role), "max_tokens": 1})
    prefill = time.perf_counter() - t0
    if role == "ver":
        [outs] = spell.sample_votes(engine, cfg, [prompt], seeds, desc=spell.ROLES[role])
    else:
        [outs] = spell.generate(engine, [prompt], n=spell.samples_per_prompt(cfg, role),
                                seeds=seeds, logprobs=True, desc=spell.ROLES[role],
                                **spell.sampling(cfg, role))
    if short := [len(c.token_ids) for c in outs if len(c.token_ids) < budget]:
        raise RuntimeError(f"vLLM ended {len(short)} of {len(outs)} samples before the budget "
                           f"of {budget} tokens (at {min(short)}): min_tokens was not honoured")
    return outs, Timing(prefill, time.perf_counter() - t0 - prefill, len(prompt), len(outs),
                        budget)


# ==================================================================================================
# Beyond one of each: a whole round's time, the disk a run fills, what the update compiles
# ==================================================================================================

class Requests(NamedTuple):
    """A phase of a round on one engine: `count` requests of `prompt` tokens, of which `prefills`
    are distinct (vLLM's prefix cache encodes a repeated prompt once), each `samples` samples of
    `budget` tokens; scaled from the measured request `ref`."""
    name: str
    count: int
    prefills: int
    prompt: int
    samples: int
    budget: int
    ref: Timing


def round_requests(cfg: spell.Config, groups: int, timings: dict[str, Timing]) -> list[Requests]:
    """What one engine generates in a round (spell.rollout_round), every question well formed and
    every answer read. Prompts at their longest; the grounding check's (a question alone) at the
    questioner's budget, scaled from the responder's request (its budget). Under verdict_order
    "random" a request per vote, its prompt one of two (the two orders of the verdicts); under
    "paired" two requests of G replies an answer, one per order."""
    r, k = cfg.rollout, max(1, cfg.rollout.clusters_per_round // groups)  # as main's per_round
    que, res = spell.max_new_tokens(cfg, "que"), spell.max_new_tokens(cfg, "res")
    out = []
    if "que" in timings:
        out.append(Requests("questioner", k, k, r.max_prompt_tokens, 1, que, timings["que"]))
        if r.grounding_filter:
            out.append(Requests("grounding", k, k, que, 1, res, timings["res"]))
    out.append(Requests("responder", k, k, r.max_prompt_tokens, r.group_size, res, timings["res"]))
    if "ver" in timings:
        ver, votes, answers = timings["ver"], spell.votes_per_response(cfg), k * r.group_size
        budget = spell.max_new_tokens(cfg, "ver")
        if cfg.bootstrap.verdict_order == "random":  # spell.sample_answer_votes
            out.append(Requests("verifier", answers * votes, answers * min(votes, 2), ver.prompt,
                                1, budget, ver))
        else:  # a request of G replies per verdict order the answer's votes are read in
            per = len(set(spell.vote_orders(cfg)))  # spell.sample_answer_votes
            out.append(Requests("verifier", answers * per, answers * per, ver.prompt, votes,
                                budget, ver))
    return out


def phase_seconds(req: Requests, kv_tokens: int | None, max_seqs: int,
                  weight_tokens: float) -> float:
    """A phase of a round from its measured request, to first order. Prefill is compute: the
    measured one's time for each distinct prompt, in proportion to its tokens. Decode runs in waves
    of the requests whose KV cache fits at once (kv_tokens, vLLM's cache; a request's samples share
    its prompt: prompt + samples x budget tokens each; at most max_seqs sequences; one request at a
    time where the cache is unknown), each wave `budget` steps. A step reads the weights and every
    running sequence's KV cache (memory-bound), so it costs the measured step times (weights +
    this wave's cache) / (weights + the measured request's cache), the weights counted in tokens
    of KV cache (weight_tokens) and a sequence's cache at its mean length."""
    ref = req.ref
    prefill = req.prefills * ref.prefill_s * req.prompt / ref.prompt
    fits = kv_tokens // (req.prompt + req.samples * req.budget) if kv_tokens else 1
    at_once = max(1, min(fits, max_seqs // req.samples, req.count))
    waves = -(-req.count // at_once)

    def read(seqs: int, prompt: int, budget: int) -> float:
        return weight_tokens + seqs * (prompt + budget / 2)

    step = (ref.decode_s / ref.budget * read(at_once * req.samples, req.prompt, req.budget)
            / read(ref.samples, ref.prompt, ref.budget))
    return prefill + waves * req.budget * step


def weight_tokens(model_config, parameters: int) -> float:
    """How many tokens of KV cache (keys and values of every layer) weigh as much as the weights
    (both in vLLM's dtype)."""
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return parameters / (2 * text.num_hidden_layers * kv_heads * head_dim)


def round_line(cfg: spell.Config, groups: int, timings: dict[str, Timing],
               kv_tokens: int | None, max_seqs: int, weights: float, sync_s: float) -> str:
    """The time of a round on one engine (round_requests, phase_seconds; under reward.judge =
    "frozen" two syncs more), against engine.collective_timeout_min: a rank whose round ends early
    (its questions all failed the format) waits in the all-reduce after it (spell.batch_is_full)
    for the others' whole round. A warning past half the timeout."""
    phases = [(req.name, req.count, phase_seconds(req, kv_tokens, max_seqs, weights))
              for req in round_requests(cfg, groups, timings)]
    if cfg.reward.judge == "frozen":  # the initial weights in, the policy back (FrozenJudge)
        phases.append(("judge swaps", 2, 2 * sync_s))
    total, timeout = sum(s for *_, s in phases), cfg.engine.collective_timeout_min
    cache = f"{kv_tokens:,} tokens of KV cache" if kv_tokens else "KV cache unknown"
    line = (f"a round of one engine: ~{total / 60:.1f} min ("
            + ", ".join(f"{name} {prompts} x {s / prompts:.1f} s" for name, prompts, s in phases)
            + f"; from the measured prefill and decode, {cache}) against "
            f"engine.collective_timeout_min = {timeout:g}")
    if total > timeout * 60 / 2:
        return (f"WARNING: {line}: past half of it. A rank whose round ends early waits that long "
                "in the all-reduce after it: raise engine.collective_timeout_min, or lower "
                "rollout.clusters_per_round")
    return f"{line}: within half of it"


def disk_line(cfg: spell.Config, checkpoint: int, export: int, free: int) -> str:
    """What a run writes into log.out_dir against the disk's free bytes: the checkpoints on disk
    at once (train.steps / log.save_every saves; log.keep_checkpoints of them, and the one being
    written beside them until it is complete) and the HF export. A warning where it does not
    fit."""
    t, log = cfg.train, cfg.log
    saves = t.steps // log.save_every + (t.steps % log.save_every != 0)  # and one at the end
    kept = min(saves, log.keep_checkpoints + 1) if log.keep_checkpoints else saves
    need = kept * checkpoint + export
    line = (f"disk: {saves} checkpoint(s) of {checkpoint / GiB:.2f} GiB (train.steps {t.steps}, "
            f"log.save_every {log.save_every}), at most {kept} on disk at once "
            f"(log.keep_checkpoints = {log.keep_checkpoints}"
            + (", and the one being written" if log.keep_checkpoints and kept > 1 else "")
            + f"), and the HF export's {export / GiB:.2f} GiB: {need / GiB:.1f} GiB of the "
            f"{free / GiB:.1f} GiB free in log.out_dir")
    if need <= free:
        return line
    keys = "lower log.keep_checkpoints" if log.keep_checkpoints else "set log.keep_checkpoints"
    return f"WARNING: {line}: it does not fit: {keys}, or choose a log.out_dir with more room"


def free_bytes(path: Path) -> int:
    """The free bytes of the disk that holds `path`, or would hold it once made."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def compile_rows(cfg: spell.Config, vocab: int) -> list[tuple[list[spell.Seq], bool]]:
    """The rows an update trains with compiled FlexAttention, each without and with grad
    (update_policy's no-grad pass, then its update): the 2-token dummy of a rank without data
    (one 128-token block), a row not a multiple of the block (several), and the largest row
    without grad (the update phase trained it with grad)."""
    rng = np.random.default_rng(0)
    odd = [spell.Seq(prompt=rng.integers(vocab, size=ODD_ROW - 129).tolist(),
                     completion=rng.integers(vocab, size=129).tolist(), advantage=1.0,
                     weight=1.0 / 129)]
    return [([spell.dummy_sequence()], False), ([spell.dummy_sequence()], True), (odd, False),
            (odd, True), (largest_row(cfg, vocab), False)]


ODD_ROW = 3 * 128 + 1  # tokens: several of FlexAttention's 128-token blocks, and not a multiple


def compile_like_a_run(policy, cfg: spell.Config, device: torch.device, vocab: int) -> str:
    """Run compile_rows through the update's own loss (spell.micro_batch_loss, and its backward
    with grad; no optimiser step), so the compiled variants a run makes are made now, not hours
    in; say how many each compiled function holds against its recompile limit. The project
    compiles FlexAttention, and the decoder layers with engine.compile_layers: with neither,
    nothing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    impl = infra.attention_implementation(cfg, device.type == "cuda")
    flex, layers = impl == "flex_attention", cfg.engine.compile_layers
    if not flex and not layers:
        return (f"compile: nothing (attention {impl}, engine.compile_layers off: the project "
                "compiles only FlexAttention and, asked, the decoder layers)")
    for seqs, grad in compile_rows(cfg, vocab):
        with torch.set_grad_enabled(grad):
            loss = spell.micro_batch_loss(policy, seqs, None, cfg, device)[0]
            # (a frozen model makes the same variants forward: how the CPU, whose FlexAttention
            # has no backward in torch 2.13, tests this)
            if grad and loss.requires_grad:
                loss.backward()
        policy.zero_grad(set_to_none=True)
    made = []
    if flex:
        made.append(f"flex_attention {infra.compiled_variants(flex_attention)} variant(s), the "
                    f"BlockMask builder {infra.compiled_variants(create_block_mask)}, of "
                    f"infra.FLEX_RECOMPILE_LIMIT = {infra.FLEX_RECOMPILE_LIMIT} each")
    if layers:  # torch.compile's own limit: past it a layer runs eagerly (compile_decoder_layers)
        forward = type(policy.model.layers[0]).forward
        made.append(f"the decoder layer {infra.compiled_variants(forward)} variant(s) of dynamo's "
                    f"recompile_limit = {torch._dynamo.config.recompile_limit}")
    return (f"compile: {'; '.join(made)} (rows of 2, {ODD_ROW} and {row_tokens(cfg):,} tokens, "
            "with and without grad)")


# ==================================================================================================
# What to change when a phase fails: the one line
# ==================================================================================================

def remedies(cfg: spell.Config, on_gpu: bool) -> dict[str, str]:
    """Per phase, the keys that make it fit when it runs out of memory."""
    share = "engine.gpu_memory_utilization" if on_gpu else "engine.kv_cache_gb"
    lengths = "rollout.max_prompt_tokens, rollout.max_new_tokens or rollout.role_max_new_tokens"
    if spell.row_budget(cfg) >= spell.longest_sequence(cfg):
        row = ["lower engine.micro_batch_tokens", "raise engine.sequence_parallel"]
    else:  # one rollout is longer than a row's budget: it trains alone, whatever the budget
        row = [f"lower {lengths} (one sequence of the longest prompt and budget is the longest "
               "row)", "raise engine.sequence_parallel"]
    if not cfg.engine.gradient_checkpointing:
        row.append("set engine.gradient_checkpointing = true")
    shard = "shard the policy over more ranks (engine.fsdp_shard_size)"
    rollouts = f"lower {share} (the trainer's weights and AdamW stay beside vLLM), or {shard}"
    return {
        "launch checks": "free the machine's memory (nothing of the run has started yet)",
        "start vLLM": f"lower {share}, or the context ({lengths})",
        "load policy": f"lower {share} (vLLM took its share first), or {shard}",
        **dict.fromkeys(spell.ROLES.values(), rollouts),  # each role's rollout phase
        "sleep": ("set engine.sleep_level = 2 (vLLM drops its weights instead of copying them to "
                  "host memory; the sync restores them)" if cfg.engine.sleep_level == 1
                  else f"lower {share}"),
        "update": " or ".join(row), "compile": " or ".join(row),
        "sync": "lower engine.sync_bucket_mb (about three buckets are alive at once)"
                + (f" or {share} (vLLM's KV cache wakes up here)" if on_gpu else ""),
        "save": shard, "load": shard,
    }


# vLLM's own errors that name a size, and what to change (the text is vLLM 0.32's)
VLLM_ERRORS = (
    ("To serve at least one request with the model's max seq len",
     "vLLM's KV cache cannot hold one sequence of the context ({context:,} tokens): raise {share}, "
     "or lower the context (rollout.max_prompt_tokens, rollout.max_new_tokens or "
     "rollout.role_max_new_tokens)"),
    ("No available memory for the cache blocks",
     "vLLM's share holds its weights and no KV cache: raise {share} or "
     "engine.tensor_parallel_size"),
    ("is less than desired GPU memory utilization",
     "the device has less free memory than vLLM's share: lower engine.gpu_memory_utilization, or "
     "free the device of other processes"),
    ("longer than the maximum model length",
     "a prompt longer than vLLM's context ({context:,} tokens): raise rollout.max_prompt_tokens"),
)


def out_of_memory(error: BaseException) -> str | None:
    """'device' or 'host' when `error` is an allocation that failed, else None."""
    if isinstance(error, torch.OutOfMemoryError):
        return "device"
    # torch's CPU allocator raises a plain RuntimeError; Python's own a MemoryError
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error):
        return "host"
    return None


# what gloo raises in a collective whose peer has gone (crashed, or killed for host memory)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


class Failure(NamedTuple):
    """Why a phase failed on a rank: the line to print, the traceback worth showing with it (an
    error failure_line does not know), and whether another rank's leaving caused it."""
    line: str
    trace: str | None = None
    peer_gone: bool = False


def rank_left_line(phase: str, what: str, cfg: spell.Config, on_gpu: bool) -> str:
    """The line when a rank left mid-phase without a word: the kernel kills a process out of host
    memory (SIGKILL in torchrun's report); a rank that failed otherwise printed its own line."""
    where = f"{phase} ({what})" if what else phase
    return (f"preflight: {where}: a rank left (its own line is above if it failed; torchrun's "
            f"report says SIGKILL if the host ran out of memory: "
            f"{remedies(cfg, on_gpu)[phase]})")


def failure_line(phase: str, what: str, error: BaseException, cfg: spell.Config,
                 on_gpu: bool) -> Failure:
    """The one line that says why `phase` (at `what`) failed and which key to change; with the
    traceback when the error is not one it knows."""
    where = f"{phase} ({what})" if what else phase
    if isinstance(error, infra.InputError):  # our own checks: the message names the key
        return Failure(f"preflight: {where}: {error}")
    if memory := out_of_memory(error):
        return Failure(f"preflight: {where} ran out of {memory} memory: "
                       f"{remedies(cfg, on_gpu)[phase]}")
    if any(needle in str(error) for needle in PEER_GONE):
        return Failure(rank_left_line(phase, what, cfg, on_gpu), peer_gone=True)
    share = "engine.gpu_memory_utilization" if on_gpu else "engine.kv_cache_gb"
    for needle, advice in VLLM_ERRORS:
        if needle in str(error):
            return Failure(f"preflight: {where}: " + advice.format(
                context=spell.longest_sequence(cfg), share=share))
    if isinstance(error, OSError) and phase in ("launch checks", "save", "load"):
        return Failure(f"preflight: {where}: {error.strerror or error} ({error.filename}): "
                       "choose a log.out_dir with room for a checkpoint")
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return Failure(f"preflight: {where} failed: {type(error).__name__}: {first}",
                   "".join(traceback.format_exception(error)))


def timeout_lines(found: Sequence[tuple[str, datetime.timedelta]], minutes: float) -> list[str]:
    """Each process group's timeout (infra.group_timeouts), the groups of one timeout on one
    line, and a warning naming those that wait less than engine.collective_timeout_min."""
    by_timeout: dict[float, list[str]] = {}
    for name, timeout in found:
        by_timeout.setdefault(timeout.total_seconds() / 60, []).append(name)
    lines = [f"groups waiting {wait:g} min for their slowest rank: {', '.join(names)}"
             for wait, names in sorted(by_timeout.items())]
    if short := [name for name, timeout in found if timeout.total_seconds() < 60 * minutes]:
        lines.append(f"WARNING: {', '.join(short)} wait less than engine.collective_timeout_min = "
                     f"{minutes:g} min")
    return lines


# ==================================================================================================
# Measuring a phase, and the table
# ==================================================================================================

@dataclasses.dataclass
class Row:
    """One phase as measured: seconds, host memory (this process's resident set before and after,
    its peak in the phase) and device memory (the device's use before and after, torch's peak
    allocation in the phase), GiB."""
    phase: str
    what: str
    seconds: float = 0.0
    host_before: float = 0.0
    host_after: float = 0.0
    host_peak: float = 0.0
    device_before: float = 0.0
    device_after: float = 0.0
    torch_peak: float = 0.0
    estimate: float | None = None  # infra.memory_estimate's GiB for the phase (GPU)
    prefill: float = 0.0  # a rollout's seconds of prefill and of decode (rollout: Timing)
    decode: float = 0.0


def host_memory() -> tuple[float, float]:
    """This process's resident memory now and its peak since reset_host_peak (Linux's VmRSS and
    VmHWM), GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    kib = lambda key: float(fields[key].split()[0]) / 2**20  # noqa: E731
    return kib("VmRSS"), kib("VmHWM")


def reset_host_peak() -> None:
    """Start VmHWM again from the current resident set (Linux >= 4.0); where that is refused, the
    peak is the process's since it started."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def combine(rows: Sequence[Row]) -> Row:
    """One phase over the ranks: the slowest rank's seconds, the largest rank's memory, rank 0's
    description."""
    largest = {f.name: max(getattr(r, f.name) for r in rows)
               for f in dataclasses.fields(Row) if f.name not in ("phase", "what", "estimate")}
    return dataclasses.replace(rows[0], **largest)


TABLE_NOTE = ("seconds: the slowest rank's; GiB: the largest rank's, host = resident set before -> "
              "after the phase and its peak within it")
GPU_NOTE = (", device = used before -> after and torch's peak allocation within it, estimate = "
            "infra.memory_estimate's for the phase")


def format_table(rows: Sequence[Row], on_gpu: bool) -> str:
    """The rows as one aligned table under a line saying what the numbers are: per phase its size,
    seconds, host GiB and on GPU device GiB, infra's estimate beside them."""
    header = ["phase", "size", "seconds", "host GiB", "host peak"]
    if on_gpu:
        header += ["device GiB", "torch peak", "estimate"]
    lines = [header]
    for r in rows:
        cells = [r.phase, r.what, f"{r.seconds:.1f}", f"{r.host_before:.2f} -> {r.host_after:.2f}",
                 f"{r.host_peak:.2f}"]
        if on_gpu:
            cells += [f"{r.device_before:.2f} -> {r.device_after:.2f}", f"{r.torch_peak:.2f}",
                      "" if r.estimate is None else f"{r.estimate:.2f}"]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    # text columns to the left, numbers to the right
    table = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
             for line in lines]
    return "\n".join([TABLE_NOTE + (GPU_NOTE if on_gpu else ""), *table])


def memory_estimates(cfg: spell.Config, model_dir: str, device: torch.device,
                     world: int) -> dict[str, float]:
    """infra.memory_estimate's GiB per phase of the table, on GPU for the models it knows (as
    infra.check_memory_at_start computes it: infra.start_estimate); {} otherwise. Loading the
    policy makes its AdamW state beside vLLM: the estimate's start-up phase."""
    if device.type != "cuda":
        return {}
    found = infra.start_estimate(cfg, model_dir, device, world, spell.longest_sequence(cfg))
    if found is None:
        return {}
    est, _ = found
    return {"load policy": est["start_phase"],
            **{spell.ROLES[r]: est["rollout_phase"] for r in spell.ROLES},
            "update": est["update_phase"]}


# ==================================================================================================
# The phases and the ranks' agreement after each
# ==================================================================================================

class Preflight:
    """The phases run so far and what the ranks agreed on after each. The ranks exchange their
    failures and measurements over a gloo group of their own: a rank that failed mid-phase may have
    skipped a collective of the default group, which a later one there would then pair wrongly."""

    def __init__(self, cfg: spell.Config, rank: int, world: int, device: torch.device):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.rows: list[Row] = []
        self.estimates: dict[str, float] = {}
        self.lines: list[str] = []  # what rank 0 prints under the table: beyond one of each
        # its waits as long as the run's collectives' (a rank still in a phase is not a failure)
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(
            minutes=cfg.engine.collective_timeout_min))
        out = Path(cfg.log.out_dir)
        self.scratch = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log,
                                                                        out_dir=str(out / SCRATCH)))
        self.made_out_dir = not out.exists()  # if preflight makes log.out_dir, it removes it
        self.holds_scratch = False  # rank 0 holds its lock (hold_scratch): it may remove it
        # each rank's host and process, to tell which ranks are left when one is gone (running)
        self.processes = infra.all_gather_objects((socket.gethostname(), os.getpid()),
                                                  group=self.control)

    @contextlib.contextmanager
    def phase(self, name: str, what: str = ""):
        """Time and measure the block on every rank; then agree on failure (agree). Yields the
        phase's Row, whose `what` the block may fill in."""
        row, on_gpu = Row(name, what), self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        reset_host_peak()
        row.host_before = host_memory()[0]
        if on_gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            row.device_before = (total - free) / GiB
        t0, failure = time.perf_counter(), None
        try:
            yield row
        # a preflight exists to report what stops a phase, whatever it is: caught to be reported
        # once, then every rank exits (KeyboardInterrupt and SystemExit pass)
        except Exception as e:  # noqa: BLE001
            failure = failure_line(name, row.what, e, self.cfg, on_gpu)
        row.seconds = time.perf_counter() - t0
        row.host_after, row.host_peak = host_memory()
        if on_gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            row.torch_peak = torch.cuda.max_memory_allocated(self.device) / GiB
            row.device_after = (total - free) / GiB
        self.agree(row, failure)

    def agree(self, row: Row, failure: Failure | None) -> None:
        """After a phase: an all-reduce of the failure flag over the control group. Then either
        rank 0 keeps the phase's row, or it prints the table so far and the lowest failing rank's
        line, and every rank exits non-zero.

        A rank that failed waits STRAGGLER_WAIT_S at most: past it the others are stuck in a
        collective it skipped, and it prints its line itself and ends the job (leave). A rank that
        finds another gone (gloo raises in the all-reduce) ends too, the lowest rank still running
        saying which phase it was (rank 0, unless the kernel killed rank 0 for memory)."""
        flag = torch.tensor([int(failure is not None)])
        work = dist.all_reduce(flag, group=self.control, async_op=True)
        try:
            if failure is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=STRAGGLER_WAIT_S))
        except RuntimeError:  # the wait timed out, or a rank's connection closed
            if failure is not None and not failure.peer_gone:
                self.leave(failure.line, failure.trace)
            speaks = self.rank == min(r for r in range(self.world) if self.running(r))
            self.leave(rank_left_line(row.phase, row.what, self.cfg, self.device.type == "cuda")
                       if speaks else None, None)
        if int(flag) == 0:
            rows = infra.all_gather_objects(row, group=self.control)
            self.rows.append(dataclasses.replace(combine(rows),
                                                 estimate=self.estimates.get(row.phase)))
            return
        failures = [f for f in infra.all_gather_objects(failure, group=self.control) if f]
        if self.rank == 0:
            if self.rows:
                print(format_table(self.rows, self.device.type == "cuda"), flush=True)
            self.leave(failures[0].line, failures[0].trace, stop=False)
        self.clean_up()
        # without the interpreter's teardown: a process group torn down while another rank's ends
        # can abort (SIGABRT), which would read as a crash in torchrun's report
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def running(self, rank: int) -> bool:
        """Whether a rank's process still runs, as far as this host can tell (one on another
        host counts as running): /proc knows it, neither exiting (the kernel closes its sockets,
        which is how the others find it gone, while it exits) nor a zombie waiting for torchrun."""
        host, pid = self.processes[rank]
        if host != socket.gethostname():
            return True
        try:  # state and flags, the 3rd and 9th fields: after the command's closing parenthesis
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            return fields[0] not in "ZX" and not int(fields[6]) & PF_EXITING
        except (OSError, IndexError, ValueError):
            return False

    def leave(self, line: str | None, trace: str | None, stop: bool = True) -> None:
        """Print a failure's traceback (if any) and line; with `stop`, end this rank now, without a
        collective: the others may be stuck in one, and ending the job (torchrun stops the other
        ranks) is what frees them."""
        if trace:
            print(trace, file=sys.stderr, flush=True)
        if line:
            print(f"rank {self.rank}: {line}" if self.rank and stop else line, flush=True)
        if stop:
            self.clean_up(barrier=False)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def hold_scratch(self) -> None:
        """Rank 0: take the scratch folder's lock (infra.hold_out_dir) before anything in it goes,
        so that a second preflight into the same log.out_dir stops there, naming the holder, and
        the live one's checkpoint stays; then remove what a killed preflight left (all but the
        lock). It never holds a run's checkpoint."""
        if self.rank != 0:
            return
        scratch = Path(self.cfg.log.out_dir) / SCRATCH
        scratch.mkdir(parents=True, exist_ok=True)
        infra.hold_out_dir(scratch)
        self.holds_scratch = True
        for p in scratch.iterdir():
            if p.name != infra.LOCK_FILE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def clean_up(self, barrier: bool = True) -> None:
        """Remove the checkpoint's scratch folder (rank 0, if it holds its lock: another live
        preflight's stays), and log.out_dir if preflight made it and it is empty; then wait for
        rank 0 (`barrier`), so that no rank ends first (torchrun stops the others when one ends
        with an error) while it prints and cleans."""
        if self.rank == 0:
            out = Path(self.cfg.log.out_dir)
            if self.holds_scratch:
                shutil.rmtree(out / SCRATCH, ignore_errors=True)
            if self.made_out_dir:
                with contextlib.suppress(OSError):  # not empty: keep it
                    out.rmdir()
        if barrier:
            dist.barrier(group=self.control)

    def report(self, seconds: float) -> None:
        """Rank 0: the table, the lines on what a whole run needs, then one line."""
        if self.rank == 0:
            print(format_table(self.rows, self.device.type == "cuda"), flush=True)
            print("\n".join(self.lines), flush=True)
            print(f"preflight: {len(self.rows)} phases passed in {seconds:.0f} s at the config's "
                  f"largest sizes", flush=True)


# ==================================================================================================
# main: one of each phase, in a step's order
# ==================================================================================================

def main(argv: Sequence[str]) -> None:
    """`spell.py preflight [--config FILE ...] [--section.key=value ...]`: the run's arguments."""
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    paths, resume, overrides = infra.parse_args(argv)
    if resume:
        raise infra.ConfigError("spell.py preflight takes no --resume: it checks a config, and "
                                "never reads or writes a run's checkpoints")
    cfg = spell.load_config(paths, overrides)  # bad input stops here, as it stops a run
    t0 = time.perf_counter()
    rank, world, device = spell.init_distributed(cfg)
    run = Preflight(cfg, rank, world, device)
    on = (f"{torch.cuda.get_device_name(device)} "
          f"({torch.cuda.get_device_properties(device).total_memory / GiB:.1f} GiB)"
          if device.type == "cuda" else "cpu")
    infra.print0(f"preflight: {world} rank(s) on {on}, config {' + '.join(paths)}: "
                 f"prompts of {cfg.rollout.max_prompt_tokens:,} tokens, budgets "
                 f"{', '.join(f'{r} {spell.max_new_tokens(cfg, r):,}' for r in spell.ROLES)}, "
                 f"update rows of {row_tokens(cfg):,} tokens")
    live = infra.live_allocator_settings()  # after init_distributed's default
    for line in [infra.version_line(device), *infra.allocator_lines(live=live)]:
        infra.print0(f"preflight: {line}")
    with run.phase("launch checks", f"{world} ranks, the data, log.out_dir"):
        run.hold_scratch()  # first: a live preflight's scratch checkpoint is never touched
        corpus = spell.load_data(cfg)
        if (folder := infra.local_model_dir(cfg)) is not None:  # the lengths, if the model is here
            spell.check_lengths(cfg, folder)
        # the checkpoint's folder as log.out_dir: the run's own is never read (check_launch turns
        # engine.shared_prefix off for flash-attn in cfg.engine, which both configs share)
        infra.check_launch(run.scratch, corpus, resume=False)
        group, groups = infra.engine_groups(cfg, rank, world)
    with run.phase("start vLLM", f"context {spell.longest_sequence(cfg):,} tokens"):
        model_dir, tok, llm = spell.start_engine(cfg, rank, world, device, group, training=True)
        run.estimates = memory_estimates(cfg, model_dir, device, world)
    with run.phase("load policy", Path(model_dir).name):
        policy, optimizer = spell.load_policy(cfg, model_dir, device, world)
        infra.check_same_rope(llm, policy)
    # every group exists now: the policy's mesh and Ulysses groups, vLLM's, the pre-flight's own
    timeouts = [*infra.group_timeouts(policy), ("preflight", infra.group_timeout(run.control))]
    for line in timeout_lines(timeouts, cfg.engine.collective_timeout_min):
        infra.print0(f"preflight: {line}")
    timings = {}
    for role in spell.playing_roles(cfg):  # the roles whose phases a step runs
        budget = spell.max_new_tokens(cfg, role)
        with run.phase(spell.ROLES[role], f"samples of {budget:,} tokens") as row:
            prompt = (verifier_prompt_ids(tok, cfg, corpus) if role == "ver" else
                      long_prompt(tok, corpus, cfg.rollout.max_prompt_tokens))
            row.what = f"{len(prompt):,} + samples of {budget:,} tokens"
            outs, timings[role] = rollout(llm, cfg, role, prompt, group)
            row.what = f"{len(prompt):,} + {len(outs)} x {budget:,} tokens"
            row.prefill, row.decode = timings[role].prefill_s, timings[role].decode_s
    # the slowest rank's prefill and decode of each role (combine)
    timings = {role: timings[role]._replace(prefill_s=r.prefill, decode_s=r.decode)
               for role, r in zip(timings, run.rows[-len(timings):])}
    vllm_config = llm.llm_engine.vllm_config  # vLLM 0.32 records its KV cache's size there
    kv_tokens = getattr(vllm_config.cache_config, "kv_cache_size_tokens", None)
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    level = spell.sleep_level(cfg, device)
    with run.phase("sleep", f"level {level}" if level else "off"):
        spell.sleep_engine(llm, cfg, device)
    vocab = min(len(tok), policy.config.vocab_size)
    with run.phase("update", f"{row_tokens(cfg):,} tokens per row"):
        spell.update_policy(policy, optimizer, largest_row(cfg, vocab), cfg, world, device)
    with run.phase("compile", f"rows of 2, {ODD_ROW}, {row_tokens(cfg):,} tokens") as row:
        run.lines.append(compile_like_a_run(policy, cfg, device, vocab))
        if run.lines[-1].startswith("compile: nothing"):
            row.what = "nothing"
    mb = cfg.engine.sync_bucket_mb
    with run.phase("sync", f"buckets of {mb} MiB" if mb else "a tensor at a time"):
        spell.wake_and_sync(llm, policy, cfg, device, updated=True)
    parameters = sum(math.prod(shape) for _, shape in infra.full_weights(policy))
    run.lines.append(round_line(cfg, groups, timings, kv_tokens, max_seqs,
                                weight_tokens(policy.config, parameters), run.rows[-1].seconds))
    with run.phase("save") as row:
        rng = spell.generator(cfg, "engine", group)
        sampler = spell.ClusterSampler(cfg, corpus, list(range(group, len(corpus), groups)), rng,
                                       tok, device)
        state = spell.run_state(1, sampler, spell.HistoryMemory(cfg.rollout.history_size), rng,
                                recipes.AEPO(*cfg.train.aepo))
        path = spell.save_checkpoint(run.scratch, 1, policy, optimizer, state, rank, world)
        size = sum(f.stat().st_size for f in path.iterdir())
        row.what = f"{size / GiB:.2f} GiB"
    with run.phase("load", f"{size / GiB:.2f} GiB"):
        # as --resume finds and checks it, then reads it
        found = infra.resume_checkpoint(run.scratch, True, rank, world)
        spell.load_checkpoint(found, policy, optimizer, rank, world)
    run.clean_up()
    # the disk once the scratch checkpoint is gone; the export in the sync's dtype (spell.main)
    export = parameters * spell.sync_dtype(cfg, device).itemsize
    run.lines.append(disk_line(cfg, size, export, free_bytes(Path(cfg.log.out_dir))))
    run.report(time.perf_counter() - t0)
