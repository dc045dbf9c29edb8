"""Tests for spell.py. CPU-runnable; the sections follow spell.py top to bottom.

Run: .venv/bin/python -m pytest test_spell.py -q
"""

import json
import math
import re

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
