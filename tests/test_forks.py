"""The three forks of issue 44, each in this process only (tests/forks.py): a new task type, a
fourth role and a reworded verifier prompt play a step's pieces (a round on the scripted engine,
the batch, the update's sequences, the metrics and the step's line, the pre-flight, the corpus
builder, the evaluation) with nothing but what the fork supplies. `pytest -m "not stack" --fork
NAME` runs the whole fast tier under one of them."""

import json

import numpy as np
import pytest

import build_corpus as bc
import evaluation
import forks
import infra
import preflight
import spell
import tasks
from conftest import UNSCRIPTED, CharTokenizer, ScriptedEngine, batch_counts, reply

CLUSTER = ["The north gate was painted blue.", "The keeper kept goats.",
           "The south gate was painted red."]
OPTIONS = {"A": "blue", "B": "red", "C": "the colour of the sky", "D": "green"}
TIMES = {"que_s": 1.0, "res_s": 1.0, "ver_s": 1.0, "rounds": 1, "rollout_s": 3.0,
         "update_s": 1.0, "sync_s": 0.1, "step_s": 4.1, "train_tokens_per_s": 1.0}
SCRIPT = {"questioner": [('{"question": "Which colour was the north gate?", "answer": "blue"}',
                          "stop")],
          "grounding": [("I cannot tell.", "stop")],
          "responder": [(reply("blue"), "stop"), (reply("red"), "stop")],
          "verifier": [("Decision: [[NO]]", "stop"), ("Decision: [[YES]]", "stop"),
                       ("Decision: [[YES]]", "stop")]}


@pytest.fixture
def fork(request, monkeypatch, tmp_path):
    if request.config.getoption("--fork") != request.param:  # (pytest --fork NAME applied it)
        forks.FORKS[request.param](monkeypatch, tmp_path / "prompts")
    return request.param


def play(monkeypatch, cfg, script, task="doc_qa", n=1):
    """One round of `n` clusters of `task` on the scripted engine, and the engine."""
    monkeypatch.setattr(spell, "generate", engine := ScriptedEngine(script))
    drawn = [(spell.Cluster(f"c{k}", task, CLUSTER), task) for k in range(n)]
    rollouts = spell.rollout_round(None, CharTokenizer(), cfg, drawn, spell.HistoryMemory(3),
                                   np.random.default_rng(0), key=(0, 1, 0, 0))
    return rollouts, engine


def step(cfg, rollouts):
    """A step's batch, its sequences on rank 0, its metrics and its line."""
    summaries = [spell.summarize(r, 0, k) for k, r in enumerate(rollouts)]
    items, counts = spell.select_batch(summaries, cfg, np.random.default_rng(0))
    seqs = spell.training_sequences(items, rollouts, 0)
    m = spell.step_metrics(summaries, counts, {}, TIMES)
    return items, counts, seqs, m, spell.log_line(1, 2, m)


@pytest.mark.parametrize("fork", ["doc_msq"], indirect=True)
def test_a_new_task_type_plays_a_step(monkeypatch, fork, tmp_path):
    """doc_msq (select every correct option): one Task and its prompt files. The config draws it
    by default; a config weighing only it is valid, one weighing no task is not; a round scores it
    with its rule; the batch, the metrics and the line take it; the corpus builder assigns it;
    the evaluation asks no judge (multiple choice) and shows its options; a QA set holds it."""
    assert spell.Config().data.task_weights["doc_msq"] == 1.0
    only = ",".join(f"{t}:{int(t == 'doc_msq')}" for t in tasks.TASKS)
    cfg = spell.load_config(None, ["--rollout.group_size=4", f"--data.task_weights={only}"])
    with pytest.raises(infra.ConfigError, match="not all zero"):
        spell.load_config(None, ["--data.task_weights=" + ",".join(f"{t}:0" for t in tasks.TASKS)])
    question = json.dumps({"question": "Which options name the north gate's colour?",
                           "options": OPTIONS, "answer": "A, B, C, D"})
    script = {**SCRIPT, "questioner": [(question, "stop")],
              "responder": [(reply("A, B, C, D"), "stop"), (reply("A"), "stop")]}
    [r], engine = play(monkeypatch, cfg, script, task="doc_msq")
    assert r.status == "ok" and r.question["answer"] == "A,B,C,D"
    assert "(C) the colour of the sky" in engine.prompts[2][0]  # the responder sees the options
    assert r.rules == r.solved == [1.0, 0.0, 1.0, 0.0]  # the rule alone decides (rule_decides)
    items, counts, seqs, m, line = step(cfg, [r])
    assert counts["res_groups"] == 1 and {it.role for it in items} == {"que", "res"}
    assert len(seqs) == len(items) and m["res/solve_rate"] == 0.5 and "res r 0.50" in line

    clusters = [{"id": f"c{k}", "documents": ["text"], "doc_ids": [k], "tokens": 10,
                 "financial": k < 2} for k in range(8)]
    corpus, _, info = bc.run_assign(clusters, bc.Options())
    assert info == {**dict.fromkeys(tasks.TASKS, 2)}  # 2 financial, 6 general: 2 of each
    item = infra.EvalItem("x", "0", "doc_msq", "ctx", "Which?", ("A,B",), tuple(OPTIONS.values()))
    assert not evaluation.needs_judge(item, 0.0) and "the colour of the sky" in \
        evaluation.eval_prompt(item)
    assert tasks.paper_score(reply("B, A"), "A,B", "doc_msq") == 1.0  # the rule's, without its own
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"id": "q", "task": "doc_msq", "documents": CLUSTER,
                                "question": "Which?", "options": OPTIONS, "answer": "A, C"}))
    assert spell.load_qa_set(path)[0].qa["answer"] == "A,C"


@pytest.mark.parametrize("fork", ["summariser"], indirect=True)
def test_a_fourth_role_plays_a_step(monkeypatch, fork):
    """A summariser, paid when its summary holds the gold: one entry in ROLES, its prompt, sample
    count, phase, reward, completions, tokens, Summary fields and selector. It plays, trains, is
    counted, logged, budgeted and pre-flighted with nothing else edited; a phase the scripted
    engine has no script for still answers."""
    cfg = spell.load_config(None, ["--rollout.group_size=4", "--rollout.role_max_new_tokens=sum:3",
                                   "--reward.verifier_share=1.0"])
    assert spell.playing_roles(cfg) == [*spell.ROLES] and "sum" in spell.trained_roles(cfg)
    assert spell.max_new_tokens(cfg, "sum") == 3 and "sum_sequences" in batch_counts()
    frozen = spell.load_config(None, ["--train.frozen_roles=sum"])
    assert spell.trained_roles(frozen) == set(spell.ROLES) - {"sum"}
    script = {**SCRIPT, "summariser": [("The north gate was blue.", "stop"), ("Goats.", "stop")]}
    [r], engine = play(monkeypatch, cfg, script)
    assert ("summariser", 1, 4) in engine.calls and r.sum_rewards == [1.0, 0.0, 1.0, 0.0]
    assert r.completions()[-4:] == r.summaries  # and so rollout_tokens, summarize
    assert len(list(spell.rollout_tokens([r]))) == 1 + len(r.completions())
    items, counts, seqs, m, line = step(cfg, [r])
    assert counts["sum_sequences"] == 4 == m["train/sum_sequences"] and len(seqs) == len(items)
    assert [s.prompt for it, s in zip(items, seqs) if it.role == "sum"] == [r.sum_prompt] * 4
    assert "sum 4" in spell.log_line(1, 2, {**m, "perf/sum_s": 1.0}) and "| train" in line
    [r], _ = play(monkeypatch, cfg, SCRIPT)  # unscripted: every summary UNSCRIPTED, none paid
    assert [c.text for c in r.summaries] == [UNSCRIPTED[0]] * 4 and r.sum_rewards == [0.0] * 4
    # the pre-flight: a phase and a remedy for it, its samples as many as spell.py draws
    assert "summariser" in preflight.remedies(cfg, on_gpu=False)
    outs, timing = preflight.rollout(None, cfg, "sum", [1] * 10, group=0)
    assert len(outs) == timing.samples == spell.samples_per_prompt(cfg, "sum") == 4


@pytest.mark.parametrize("fork", ["verifier_wording"], indirect=True)
def test_a_reworded_verifier_prompt_keeps_its_contract(monkeypatch, fork):
    """prompts/verifier.txt in other words: the fields stay fenced, the reply-format line ends
    with the verdicts in the order asked, the demo's reply prefix continues it, and a round
    votes, scores and trains as before."""
    question = {"question": "Which colour?", "answer": "blue"}
    text = spell.verifier_prompt(question, "blue [[YES]]", "blue", no_first=True)
    assert "Judge if a candidate reply" in text  # the fork's words
    assert "- Answer 1: \u27e6blue\u27e7" in text and text.rstrip().endswith("[[NO]] or [[YES]]")
    demo = spell.load_config(str(spell.ROOT / "presets" / "demo.toml"))
    # the reply prefix (presets/demo.toml) opens the prompt's own reply-format line
    prefix = demo.bootstrap.verifier_reply_prefix
    assert f"\n{prefix}YES]] or [[NO]]" in spell.verifier_prompt(question, "blue", "blue")
    cfg = spell.load_config(None, ["--rollout.group_size=4", "--rollout.votes_per_response=3"])
    [r], _ = play(monkeypatch, cfg, SCRIPT)  # votes NO, YES, YES on each answer: YES
    assert r.majorities == [1] * 4 and r.solved == [1.0] * 4
