"""Tests of infra.py, the machine room beside spell.py: config mechanics, the memory estimate, the
embedded model's export, bucketed weight sync, tensor-parallel helpers, rebalancing and checkpoint
integrity. Tolerances follow from the arithmetic (see test_spell.py's docstring).
"""

import copy
import datetime
import errno
import json
import math
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import infra
import spell
import tasks
from conftest import (FIXTURE_FILES, FIXTURES, GOOD_CLUSTER, REPO, TEMPERATURE, add_model_files,
                      all_fixture_items, deadline, end_worker, held_out_metrics, logged_metrics,
                      metrics, mutated_fixture, run_worker, snapshot, torchrun, worker_mesh)


# ------------------------------------------------------------------------------------------------
# Config mechanics: stacking, coercion, unreadable files
# ------------------------------------------------------------------------------------------------

def test_config_files_stack_later_ones_winning(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[train]\nsteps = 7\nlr = 0.5\n")
    b.write_text("[train]\nlr = 0.25\n")
    paths, _, rest = infra.parse_args(["--config", str(a), f"--config={b}", "--train.seed=3"])
    assert paths == [str(a), str(b)] and rest == ["--train.seed=3"]
    cfg = spell.load_config(paths, rest)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.seed) == (7, 0.25, 3)
    assert infra.parse_args([])[0] == [str(spell.ROOT / "config.toml")]


@pytest.mark.parametrize("text", ["0.6,0.9", "[0.6, 0.9]", " (0.6,0.9) "])
def test_tuples_from_the_command_line(tmp_path, text):
    cfg = spell.load_config(None, [f"--reward.verifier_agreement={text}"])
    assert cfg.reward.verifier_agreement == (0.6, 0.9)


@pytest.mark.parametrize("text", ["fin_math:2,doc_mc:0.5", "{fin_math = 2, doc_mc = 0.5}",
                                  "fin_math=2, doc_mc=0.5"])
def test_tables_from_the_command_line_merge_with_the_defaults(tmp_path, text):
    """A table key (data.task_weights) takes named values; the names it leaves out keep theirs, in
    TOML files as on the command line, so stacked files override key by key."""
    every = dict.fromkeys(tasks.TASKS, 1.0)
    cfg = spell.load_config(None, [f"--data.task_weights={text}"])
    assert cfg.data.task_weights == {**every, "fin_math": 2.0, "doc_mc": 0.5}
    toml = tmp_path / "w.toml"
    toml.write_text("[data]\ntask_weights = { doc_mc = 0.0 }\n")
    cfg = spell.load_config(str(toml), ["--data.task_weights=doc_qa:3"])
    assert cfg.data.task_weights == {**every, "doc_qa": 3.0, "doc_mc": 0.0}


@pytest.mark.parametrize("argv, message", [
    (["--data.task_weights=doc_qa:1,essay:1"], "data.task_weights: unknown name 'essay' (known: "),
    (["--data.task_weights=doc_qa"], "data.task_weights.doc_qa: expected float like 1.0, got None"),
    (["--data.task_weights=doc_qa:x"], "data.task_weights.doc_qa: expected float"),
    (["--reward.questioner_floor=2"], "unknown key reward.questioner_floor"),
    (["--reward.questioner_floor=2"], "did you mean bootstrap.questioner_floor?"),
    (["--reward.verifier_reply_prefix=x"], "did you mean bootstrap.verifier_reply_prefix?"),
])
def test_config_errors_name_the_key_and_a_moved_key_s_new_place(argv, message):
    with pytest.raises(infra.ConfigError, match=re.escape(message)):
        spell.load_config(None, argv)


@pytest.mark.parametrize("old", sorted(infra.MOVED_KEYS))
def test_a_key_that_moved_to_engine_names_its_new_place(tmp_path, old):
    """Every key that moved into [engine] is refused under its old name, in a config file and on
    the command line, with an error naming the new key; the new key is a field of the config."""
    new = infra.MOVED_KEYS[old]
    section, key = new.split(".")
    assert hasattr(getattr(spell.Config(), section), key)
    value = json.dumps(getattr(getattr(spell.Config(), section), key))
    toml = tmp_path / "old.toml"
    toml.write_text(f"[{old.split('.')[0]}]\n{old.split('.')[1]} = {value.lower()}\n")
    for paths, argv in ((str(toml), []), (None, [f"--{old}={value}"])):
        with pytest.raises(infra.ConfigError, match=re.escape(f"{old} is now {new}")):
            spell.load_config(paths, argv)


def test_how_a_step_is_computed_may_change_on_resume_what_it_computes_may_not():
    """The engine's keys that change how a step runs, not what the run is (vLLM's precision, the
    split of a row over ranks), resume as engine.rollout_dtype and fsdp_shard_size do; the
    algorithm's keys stay in the fingerprint."""
    fingerprint = infra.run_fingerprint(spell.Config())
    for key in ("engine.cpu_bf16", "engine.sequence_parallel", "engine.rollout_dtype",
                "engine.fsdp_shard_size", "engine.micro_batch_tokens"):
        assert key not in fingerprint, key
    for key in ("rollout.group_size", "reward.no_majority", "train.lr",
                "engine.tensor_parallel_size"):
        assert key in fingerprint, key


def test_a_checkpoint_saved_under_the_old_key_names_compares_them_under_the_new():
    """A run saved before the keys moved resumes: its fingerprint's old names are read as the new
    ones, so a real change still shows and a moved key alone does not."""
    now = infra.run_fingerprint(spell.Config())
    saved = {infra.MOVED_KEYS.get(k, k) if k not in infra.MOVED_KEYS.values() else
             next(o for o, n in infra.MOVED_KEYS.items() if n == k): v for k, v in now.items()}
    assert saved != now and "engine.tensor_parallel_size" not in saved
    assert infra.fingerprint_changes(saved, now) == []
    saved["rollout.tensor_parallel_size"] = 2
    assert infra.fingerprint_changes(saved, now) == [
        "engine.tensor_parallel_size (saved 2, now 1)"]


@pytest.mark.parametrize("content, message", [
    (None, "c.toml: cannot read the config file (No such file or directory)"),
    (b"[train]\nlr = 1e-6  # d\xe9faut\n", "c.toml: not UTF-8 text (byte 22)"),
    (b"[train]\nlr = [1e-6\n", "c.toml: not valid TOML"),
    (b"[train]\nsteps = " + b"9" * 5000 + b"\n",
     "c.toml: not valid TOML: Exceeds the limit (4300 digits) for integer string conversion: "
     "value has 5000 digits"),
    (b"[train]\nsteps = " + b"9" * 4000 + b"\n",
     "train.steps must have at most 18 digits, got " + "9" * 60 + "... (4000 characters)"),
    (b"[train]\nsteps = " + b"9" * 19 + b"\n",
     "train.steps must have at most 18 digits, got 9999999999999999999"),
    (b"[train]\nsteps = " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
     "c.toml: not valid TOML: nested deeper than Python's recursion limit"),
])
def test_unreadable_config_file_fails_before_writing_anything(tmp_path, content, message):
    config = tmp_path / "c.toml"
    if content is not None:
        config.write_bytes(content)
    with pytest.raises(infra.ConfigError, match=re.escape(message)):
        spell.main(["--config", str(config), f"--log.out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# Benchmark files: native layouts, inference of the benchmark, errors naming file / position / field
# ------------------------------------------------------------------------------------------------

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
    with pytest.raises(infra.EvalDataError, match=re.escape(where)):
        infra.load_benchmark(str(path))


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_fixtures_load_with_inferred_benchmark(name):
    bench, count = FIXTURE_FILES[name]
    items = infra.load_benchmark(str(FIXTURES / name))
    assert len(items) == count
    assert ({it.benchmark for it in items} == {bench}
            and {it.task for it in items} == {infra.BENCHMARKS[bench]})
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
    assert frames.context == (
        "Orchard Quartet\nThe Orchard Quartet is a string quartet founded in 1974.\n"
        "Glass Pavilion\nThe Glass Pavilion is an exhibition hall that opened in 1961.")
    assert frames.question.startswith("How many years") and frames.answers == ("13 years",)
    doc = [items["docmath", f"simpshort-testmini-fixture-{i}"] for i in range(3)]
    assert [d.answers for d in doc] == [("25",), ("600",), ("0.28",)]  # 25.0 is written as "25"
    assert doc[0].context.split("\n")[0] == "Selected financial data (in thousands of dollars):"
    assert "| Revenue | 1,200 | 1,500 |" in doc[0].context and doc[0].task == "fin_math"


@pytest.mark.parametrize("filename, expected", [
    ("LongBench-v2.json", "longbench_v2"), ("longbench_v2_data.jsonl", "longbench_v2"),
    ("hotpotqa_e.jsonl", "hotpotqa"), ("2wikimqa.jsonl", "2wikimqa"),
    ("MuSiQue.parquet", "musique"), ("frames_test.jsonl", "frames"),
    ("docmath.json", "docmath"), ("complong_testmini.json", "docmath"),
])
def test_infer_benchmark_from_filename(filename, expected):
    assert infra.infer_benchmark(f"/data/{filename}", first=None) == expected


def test_infer_benchmark_from_fields_when_name_says_nothing(tmp_path):
    # LongBench-V2's native file is data.json: the first record's fields tell
    shutil.copy(FIXTURES / "longbench_v2.json", tmp_path / "data.json")
    assert ({it.benchmark for it in infra.load_benchmark(str(tmp_path / "data.json"))}
            == {"longbench_v2"})
    shutil.copy(FIXTURES / "musique.jsonl", tmp_path / "test.jsonl")
    assert ({it.benchmark for it in infra.load_benchmark(str(tmp_path / "test.jsonl"))}
            == {"musique"})
    shutil.copy(FIXTURES / "simpshort_testmini.json", tmp_path / "x.json")
    assert infra.load_benchmark(str(tmp_path / "x.json"))[0].benchmark == "docmath"
    # ambiguous name, fields decide
    shutil.copy(FIXTURES / "frames.jsonl", tmp_path / "hotpotqa_vs_musique.jsonl")
    assert (infra.load_benchmark(str(tmp_path / "hotpotqa_vs_musique.jsonl"))[0].benchmark
            == "frames")
    (tmp_path / "mystery.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(infra.EvalDataError,
                       match=r"mystery\.jsonl: cannot tell which benchmark.*BENCHMARK:PATH"):
        infra.load_benchmark(str(tmp_path / "mystery.jsonl"))


def test_explicit_benchmark_name_and_pooling(tmp_path):
    # a ':' in the path itself
    shutil.copy(FIXTURES / "hotpotqa.jsonl", tmp_path / "some:file.jsonl")
    items = infra.load_eval_data([f"musique:{FIXTURES / 'hotpotqa.jsonl'}",
                            str(tmp_path / "some:file.jsonl"), str(FIXTURES / "hotpotqa.jsonl")])
    assert [it.benchmark for it in items] == ["musique"] * 4 + ["hotpotqa"] * 8
    with pytest.raises(infra.EvalDataError, match="unknown benchmark 'trivia'"):
        infra.load_benchmark(str(FIXTURES / "hotpotqa.jsonl"), "trivia")


@pytest.mark.parametrize("name, index, mutate, where, field, words", [
    ("hotpotqa.jsonl", 1, lambda r: r.update(answers="cello"), "line 2", "answers",
     "list of non-empty strings"),
    ("hotpotqa.jsonl", 2, lambda r: r.pop("input"), "line 3", "input", "it is missing"),
    ("2wikimqa.jsonl", 0, lambda r: r.update(answers=[]), "line 1", "answers", "non-empty list"),
    ("musique.jsonl", 2, lambda r: r.update(context=None), "line 3", "context", "non-empty string"),
    ("musique.jsonl", 0, lambda r: r.pop("_id"), "line 1", "_id", "an id"),
    ("longbench_v2.json", 1, lambda r: r.update(answer="E"), "item 1", "answer", "A, B, C, D"),
    ("longbench_v2.json", 3, lambda r: r.pop("choice_C"), "item 3", "choice_C", "missing"),
    ("frames.jsonl", 1, lambda r: r.pop("wiki_items"), "line 2", "wiki_items",
     "Tongyi-Zhiwen/frames"),
    ("frames.jsonl", 0, lambda r: r["wiki_items"][1].pop("text"), "line 1, wiki_items[1]", "text",
     "missing"),
    ("frames.jsonl", 2, lambda r: r.update(Answer=""), "line 3", "Answer", "non-empty string"),
    ("simpshort_testmini.json", 2, lambda r: r.update(ground_truth=None), "item 2", "ground_truth",
     "testmini"),
    ("simpshort_testmini.json", 1, lambda r: r.update(ground_truth="n/a"), "item 1", "ground_truth",
     "a number"),
    ("simpshort_testmini.json", 0, lambda r: r.update(paragraphs=["ok", 3]), "item 0", "paragraphs",
     "strings"),
])
def test_loader_errors_name_file_position_and_field(tmp_path, name, index, mutate, where, field,
                                                    words):
    path = mutated_fixture(tmp_path, name, index, mutate)
    with pytest.raises(infra.EvalDataError) as err:
        infra.load_benchmark(path)
    message = str(err.value)
    assert message.startswith(f"{path}, {where}, field {field!r}: expected"), message
    assert words in message


@pytest.mark.parametrize("name, index, mutate, where, message", [
    ("hotpotqa.jsonl", 1, lambda r: r.update(answers=["Hamburg", "<your answer>"]),
     "line 2, field 'answers[1]'", "'<your answer>' is a template's placeholder, not a text"),
    ("frames.jsonl", 0, lambda r: r.update(Answer="<answer>"), "line 1, field 'Answer'",
     "'<answer>' is a template's placeholder"),
    ("musique.jsonl", 2, lambda r: r.update(context="\u200b\u200b\u2060\n"),
     "line 3, field 'context'", "holds only invisible characters"),
    ("longbench_v2.json", 2, lambda r: r.update({f"choice_{x}": "Same" for x in "ABCD"}),
     "item 2, field 'choice_", "the same text as the answer, choice_"),
    ("hotpotqa.jsonl", 3, lambda r: r.update(_id="hotpotqa-fixture-0001"), "line 4",
     "id 'hotpotqa-fixture-0001' repeats ({path}, line 2)"),
])
def test_eval_items_nothing_can_be_scored_against_are_refused(tmp_path, name, index, mutate,
                                                              where, message):
    """Items that load but cannot be used: a gold that is a template's placeholder, a context of
    zero-width characters, four identical options (every letter right), an id that repeats (the
    question counts twice in pass@k). The file, the place and the field are named."""
    path = mutated_fixture(tmp_path, name, index, mutate)
    with pytest.raises(infra.EvalDataError) as e:
        infra.load_eval_data([path])
    assert str(e.value).startswith(f"{path}, {where}"), e.value
    assert message.format(path=path) in str(e.value), e.value


def test_the_same_eval_file_twice_is_refused(tmp_path):
    """A benchmark file given twice (under another name too) would count every question twice; the
    same file read as two benchmarks pools apart, and loads."""
    path = str(FIXTURES / "hotpotqa.jsonl")
    shutil.copy(path, tmp_path / "hotpotqa.jsonl")
    (tmp_path / "again.jsonl").symlink_to(tmp_path / "hotpotqa.jsonl")
    for specs in ([path, path], [str(tmp_path / "hotpotqa.jsonl"), str(tmp_path / "again.jsonl")],
                  [path, f"hotpotqa:{path}"]):
        with pytest.raises(infra.EvalDataError) as e:
            infra.load_eval_data(specs)
        assert str(e.value) == f"{specs[1]}: the same hotpotqa file as {specs[0]}, given twice"
    assert len(infra.load_eval_data([path, f"musique:{path}"])) == 8


@pytest.mark.parametrize("name, content, message", [
    ("hotpotqa.jsonl", '{"_id": "a"}\n{"_id": ' + "9" * 5000 + "}\n",
     "hotpotqa.jsonl, line 2: not valid JSON (Exceeds the limit (4300 digits)"),
    ("hotpotqa.jsonl", '{"_id": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
     "hotpotqa.jsonl, line 2: not valid JSON (nested deeper than Python's recursion limit)"),
    ("musique.json", '[{"_id": ' + "9" * 5000 + "}]",
     "musique.json: not valid JSON (Exceeds the limit (4300 digits)"),
    ("musique.json", "[" * 100_000 + "]" * 100_000,
     "musique.json: not valid JSON (nested deeper than Python's recursion limit)"),
    ("frames.tsv", "Prompt\tAnswer\nshort\tx\n" + "y" * 131_073 + "\tx\n",
     "frames.tsv, row 1: not a TSV row (field larger than field limit (131072))"),
])
def test_eval_files_beyond_python_s_limits_are_one_line(tmp_path, name, content, message):
    """An integer of 5000 digits (int's limit), "[[[[..." (the recursion limit) and a Frames cell
    over csv's field limit: an infra.EvalDataError naming the file and place, not a traceback."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(infra.EvalDataError) as e:
        infra.load_benchmark(str(path))
    assert str(e.value).startswith(f"{tmp_path}/{message}"), e.value
    assert "\n" not in str(e.value)


def test_loader_errors_for_broken_files(tmp_path):
    bad_json = tmp_path / "hotpotqa.jsonl"
    lines = (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()
    bad_json.write_text(lines[0] + "\n" + lines[1][:-5] + "\n")
    with pytest.raises(infra.EvalDataError, match=r"hotpotqa\.jsonl, line 2: not valid JSON"):
        infra.load_benchmark(str(bad_json))
    (tmp_path / "musique.json").write_text('{"data": []}')
    with pytest.raises(infra.EvalDataError,
                       match=r"musique\.json: expected a JSON list of records, got a dict"):
        infra.load_benchmark(str(tmp_path / "musique.json"))
    (tmp_path / "frames.json").write_text('[["Prompt", "Answer"]]')
    with pytest.raises(infra.EvalDataError,
                       match=r"frames\.json, item 0: expected an object of fields, got list"):
        infra.load_benchmark(str(tmp_path / "frames.json"))
    (tmp_path / "musique.csv").write_text("input,answers\n")
    with pytest.raises(infra.EvalDataError, match="unknown file type '.csv'"):
        infra.load_benchmark(str(tmp_path / "musique.csv"))
    (tmp_path / "2wikimqa.jsonl").write_text("\n\n")
    with pytest.raises(infra.EvalDataError, match="holds no records"):
        infra.load_benchmark(str(tmp_path / "2wikimqa.jsonl"))
    with pytest.raises(infra.EvalDataError, match="no such file"):
        infra.load_benchmark(str(tmp_path / "nope.jsonl"))
    with pytest.raises(infra.EvalDataError, match="no benchmark files given"):
        infra.load_eval_data([])


def test_jsonl_named_json_still_loads(tmp_path):
    shutil.copy(FIXTURES / "musique.jsonl", tmp_path / "musique.json")  # HF exports often do this
    assert len(infra.load_benchmark(str(tmp_path / "musique.json"))) == 3


def test_raw_frames_tsv_asks_for_wiki_items(tmp_path):
    # google/frames-benchmark test.tsv: links to Wikipedia, no article texts
    path = tmp_path / "frames_test.tsv"
    path.write_text("\tPrompt\tAnswer\twikipedia_link_1\treasoning_types\n"
                    "0\tWho won?\tAda\thttps://en.wikipedia.org/wiki/Ada\tMultiple constraints\n")
    with pytest.raises(infra.EvalDataError,
                       match=r"frames_test\.tsv, row 0, field 'wiki_items': expected the article "
                             r"texts .* raw google/frames-benchmark TSV"):
        infra.load_benchmark(str(path))


def test_parquet(tmp_path):
    recs = [json.loads(line) for line in (FIXTURES / "musique.jsonl").read_text().splitlines()]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "musique.parquet").write_bytes(b"PAR1")
        with pytest.raises(infra.EvalDataError, match="reading parquet needs pyarrow"):
            infra.load_benchmark(str(tmp_path / "musique.parquet"))
        return
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "musique.parquet")
    assert (infra.load_benchmark(str(tmp_path / "musique.parquet"))
            == infra.load_benchmark(str(FIXTURES / "musique.jsonl")))


@pytest.mark.parametrize("name, index, mutate, where, field", [
    ("hotpotqa.jsonl", 1, lambda r: r.update(context=r["context"] + "\ud800"), "line 2", "context"),
    ("hotpotqa.jsonl", 0, lambda r: r.update(answers=["ok", "\udfff"]), "line 1", "answers[1]"),
    ("hotpotqa.jsonl", 2, lambda r: r.update(input="Who\ud83d?"), "line 3", "input"),
    ("musique.jsonl", 0, lambda r: r.update(_id="m\ud800"), "line 1", "_id"),
    ("frames.jsonl", 0, lambda r: r["wiki_items"][0].update(text="\ud800"), "line 1, wiki_items[0]",
     "text"),
    ("longbench_v2.json", 1, lambda r: r.update(choice_B="\udc00"), "item 1", "choice_B"),
    ("simpshort_testmini.json", 0, lambda r: r.update(paragraphs=["ok", "\ud800"]), "item 0",
     "paragraphs[1]"),
])
def test_eval_loaders_refuse_lone_surrogates(tmp_path, name, index, mutate, where, field):
    src = FIXTURES / name
    if name.endswith(".jsonl"):
        recs = [json.loads(line) for line in src.read_text().splitlines()]
        mutate(recs[index])
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        recs = json.loads(src.read_text())
        mutate(recs[index])
        (tmp_path / name).write_text(json.dumps(recs))
    path = str(tmp_path / name)
    message = f"{path}, {where}, field {field!r}: expected text without a lone surrogate"
    with pytest.raises(infra.EvalDataError, match=re.escape(message)):
        infra.load_benchmark(path)
    with pytest.raises(infra.CorpusError, match=re.escape(message)):  # data.qa reads benchmarks too
        spell.load_qa_set(path)


# ------------------------------------------------------------------------------------------------
# Memory estimate
# ------------------------------------------------------------------------------------------------

# Qwen2.5-7B-Instruct's config.json, the numbers the memory estimate reads
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, vocab_size=152064, intermediate_size=18944,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def test_parameter_counts_match_the_hf_models():
    """parameter_counts' formula against the parameters of the HF classes, built on the meta device
    (no memory)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    small = dict(hidden_size=128, num_hidden_layers=3, vocab_size=1000, intermediate_size=352,
                 num_attention_heads=4, num_key_value_heads=2)
    configs = [Qwen2Config(**QWEN25_7B), Qwen2Config(**small, tie_word_embeddings=True),
               LlamaConfig(**small, tie_word_embeddings=False),
               LlamaConfig(**small, attention_bias=True, mlp_bias=True, head_dim=64)]
    for config in configs:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert (infra.parameter_counts(config)["total"]
                == sum(p.numel() for p in model.parameters())), config
    # the published size of Qwen2.5-7B: 7.61B parameters
    assert infra.parameter_counts(configs[0]) == {"layer": 233_057_792, "root": 1_089_998_336,
                                                  "total": 7_615_616_512}


def test_memory_estimate_qwen25_7b():
    """The paper's recipe (config.toml: Qwen2.5-7B, 32768-token micro-batches,
    vLLM at 0.75) on 8 GPUs of 80 GiB, against values worked out by hand from the config numbers."""
    from transformers import Qwen2Config

    cfg = spell.load_config(str(spell.ROOT / "config.toml"))
    P, layer, root, S, H, I, V, L = (7_615_616_512, 233_057_792, 1_089_998_336, 32768, 3584,
                                     18944, 152064, 28)
    est = infra.memory_estimate(cfg, Qwen2Config(**QWEN25_7B), world=8, device_gib=80.0,
                                longest=spell.longest_sequence(cfg))
    GiB = 2**30
    # bytes a layer saves a token: 12 H + 10 q + 8 Hq + 4 D + 8 I = 43008 + 35840 + 224 + 512 +
    # 151552 = 231136; at its backward's peak 4 I + 2 H = 82944 more: 314080
    a_peak = 231136 + 4 * I + 2 * H
    c = 2 * S * H  # a layer's checkpoint (0.219 GiB)
    hand = {
        # 3.546, 3.546, 7.093; the fused AdamW step (spell.make_optimizer's) allocates nothing
        "weights": 4 * P / 8 / GiB, "grads": 4 * P / 8 / GiB, "adamw": 8 * P / 8 / GiB,
        "adamw_step": 0.0,
        # bf16 root, the layer and the next: 2.899
        "gathered": (2 * root + 4 * layer) / GiB,
        # the LM head's bf16 gradient, the layer's, the previous layer's fp32 one: 2.317
        "reduce": (2 * V * H + 6 * layer) / GiB,
        # 6.125 of checkpoints + 9.585 for the recomputed layer = 15.710
        "activations": (L * c + S * a_peak) / GiB,
        # an fp32 and a bf16 dW, the Triton kernel's 384 MiB workspace (config.toml's
        # logprob_impl = "triton"; kernels.logprob.DEFAULT_WORKSPACE_BYTES): 3.420
        "lm_head": 6 * V * H / GiB + 0.375,
        "tree_mask": 0.0,  # FlexAttention's BlockMask: no (T, T) tensor
        # 14.185 + 1.094 of KV cache
        "vllm_minimum": (2 * P + 2 * 2 * L * 512 * (16384 + 4096)) / GiB,
        "vllm": 60.0,
    }
    # sleep_level 2: vLLM sleeps in the update, whose peak is a layer's backward: 20.93 above the
    # weights, AdamW and every gradient shard (a step accumulates over many micro-batches: from
    # the second on, all of them are alive); the root's reduce-scatter holds less, 6R + 4R/8:
    # 6.60, and the step (fused) nothing
    layer_moment = hand["gathered"] + hand["reduce"] + hand["activations"]
    assert layer_moment > (6 * root + 4 * root / 8) / GiB
    held = hand["weights"] + hand["adamw"] + hand["grads"]
    hand["update_backward"] = held + layer_moment
    hand["update_step"] = held
    # start-up: the weights and both moments (create_optimizer_state), vLLM awake: 70.64
    hand["start_phase"] = hand["weights"] + hand["adamw"] + 60.0
    hand["rollout_phase"] = hand["start_phase"]
    hand["update_phase"] = hand["update_backward"]
    hand["peak"] = max(hand["start_phase"], hand["update_phase"])
    assert est.keys() == hand.keys()
    # the same few float64 operations in another order: 1e-12 relative is ~1e4 ulps
    for key in hand:
        assert est[key] == pytest.approx(hand[key], rel=1e-12), key
    assert est["activations"] == 15.7099609375 and round(est["peak"], 2) == 70.64
    assert round(est["update_phase"], 2) == 35.11
    infra.check_memory(cfg, est, 80.0, 8)  # fits, with UNCOUNTED_GIB to spare: no error
    line = infra.memory_line(est, 80.0)
    assert line.startswith("memory: estimate 70.6 of 80.0 GiB per GPU (start-up and rollouts "
                           "70.6, update 35.1: backward 35.1, optimiser step 14.2; 4.0 kept for "
                           "the CUDA context, NCCL, vLLM's CUDA graphs and fragmentation; GiB: "
                           "weights 3.5, grads 3.5, adamw 7.1, gathered 2.9") and "\n" not in line


def test_memory_estimate_divides_the_row_over_sequence_parallel_ranks():
    """engine.sequence_parallel = k: a rank holds 1/k of a 128K-prompt row (the longest sequence,
    131072 + 4096 tokens, above k x 32768), its checkpoints and its recomputed layer; Ulysses adds
    per token k and v of max(4, k) heads beside q and one more copy of the attention output;
    nothing else changes."""
    from transformers import Qwen2Config

    mc, GiB, H, L = Qwen2Config(**QWEN25_7B), 2**30, 3584, 28

    def estimate(k: int) -> dict:
        cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
            "--rollout.max_prompt_tokens=131072", f"--engine.sequence_parallel={k}"])
        return infra.memory_estimate(cfg, mc, world=8, device_gib=80.0,
                                     longest=spell.longest_sequence(cfg))

    one, two, four = estimate(1), estimate(2), estimate(4)
    # 2 q + 4 Hk D = 7168 + 2048 bytes a token at SP 2 and 4 (Hk = max(4, k) = 4)
    for k, est, extra in ((1, one, 0), (2, two, 9216), (4, four, 9216)):
        S = 135168 // k
        # 314080 bytes a token for the recomputed layer (test_memory_estimate_qwen25_7b)
        assert est["activations"] == pytest.approx(
            (L * 2 * S * H + S * (314080 + extra)) / GiB, rel=1e-12), k
        for key in ("weights", "grads", "adamw", "gathered", "reduce", "lm_head", "vllm_minimum"):
            assert est[key] == one[key], (k, key)
    # 84.2 GiB at SP 1 (refused: the message names engine.sequence_parallel), 52.4 at SP 2
    assert round(one["update_phase"], 1) == 84.2 and round(two["update_phase"], 1) == 52.4
    cfg = spell.load_config(str(spell.ROOT / "config.toml"), ["--rollout.max_prompt_tokens=131072"])
    with pytest.raises(infra.ConfigError, match="raise engine.sequence_parallel"):
        infra.check_memory(cfg, one, 80.0, 8)


def test_memory_estimate_counts_the_sdpa_tree_mask():
    """Shared prefixes under SDPA hold a dense bf16 (T, T) mask of the whole row for the
    micro-batch (infra.tree_attention_mask): 2 T^2 bytes, T = 135168 at a 128K prompt whatever the
    SP degree (each rank of a row builds the whole row's mask), 34.0 GiB; it adds to the update's
    peak moment. Under sequence parallelism every row has one, shared or not (full_row_mask).
    FlexAttention (auto on GPU) and unshared unsplit rows hold none. The mask is built in the
    compute dtype, bf16 on GPU, whatever the master weights' (infra.mask_dtype)."""
    from transformers import Qwen2Config

    mc = Qwen2Config(**QWEN25_7B)

    def estimate(*keys: str) -> dict:
        cfg = spell.load_config(str(spell.ROOT / "config.toml"),
                                ["--rollout.max_prompt_tokens=131072", *keys])
        return infra.memory_estimate(cfg, mc, world=8, device_gib=80.0,
                                     longest=spell.longest_sequence(cfg))

    for k in (1, 2, 4):
        flex = estimate(f"--engine.sequence_parallel={k}")
        sdpa = estimate(f"--engine.sequence_parallel={k}", "--engine.attn_implementation=sdpa")
        unshared = estimate(f"--engine.sequence_parallel={k}", "--engine.attn_implementation=sdpa",
                            "--engine.shared_prefix=false")
        assert flex["tree_mask"] == 0
        assert sdpa["tree_mask"] == 2 * 135168**2 / 2**30  # 34.03 GiB
        assert unshared["tree_mask"] == (sdpa["tree_mask"] if k > 1 else 0)
        assert sdpa["update_phase"] == pytest.approx(flex["update_phase"] + sdpa["tree_mask"],
                                                     rel=1e-12), k
    # the update at SP 4: 35.9 + 34.0 = 69.9 GiB; at SP 1: 84.2 + 34.0, refused, naming the fix
    sdpa = estimate("--engine.attn_implementation=sdpa")
    with pytest.raises(infra.ConfigError, match='engine.attn_implementation = "flex_attention"'):
        infra.check_memory(spell.load_config(str(spell.ROOT / "config.toml")), sdpa, 80.0, 8)
    assert "tree_mask 34.0" in infra.memory_line(sdpa, 80.0)
    assert "tree_mask" not in infra.memory_line(flex, 80.0)
    assert infra.mask_dtype(torch.device("cuda", 0), torch.float32) == torch.bfloat16
    assert infra.mask_dtype(torch.device("cpu"), torch.float32) == torch.float32


def test_memory_estimate_counts_the_largest_role_budget():
    """vLLM's minimum holds one sequence of the longest prompt plus the largest role's budget: a
    questioner budget of 8192 above config.toml's shared 4096 adds the KV cache of 4096 tokens
    (Qwen2.5-7B: K and V, 28 layers, 4 KV heads of 128, bf16); a verifier budget below it adds
    nothing."""
    from transformers import Qwen2Config

    mc, path = Qwen2Config(**QWEN25_7B), str(spell.ROOT / "config.toml")
    def minimum(*argv: str) -> float:
        cfg = spell.load_config(path, list(argv))
        return infra.memory_estimate(cfg, mc, world=8, device_gib=80.0,
                                     longest=spell.longest_sequence(cfg))["vllm_minimum"]

    shared = minimum()
    assert minimum("--rollout.role_max_new_tokens=ver:64") == shared
    assert minimum("--rollout.role_max_new_tokens=que:8192,ver:64") == pytest.approx(
        shared + 2 * 2 * 28 * 512 * 4096 / 2**30, rel=1e-12)


def test_check_memory_refusals():
    """A run that cannot fit stops with the keys to change, per phase."""
    from transformers import Qwen2Config

    mc = Qwen2Config(**QWEN25_7B)

    def refusal(world=8, **keys):
        cfg = spell.load_config(str(spell.ROOT / "config.toml"),
                                [f"--{k.replace('__', '.')}={v}" for k, v in keys.items()])
        with pytest.raises(infra.ConfigError) as e:
            infra.check_memory(cfg, infra.memory_estimate(cfg, mc, world, 80.0,
                                                          longest=spell.longest_sequence(cfg)),
                               80.0, world)
        return str(e.value)

    # vLLM's 0.15 x 80 = 12 GiB holds less than the 14.2 GiB of bf16 weights
    msg = refusal(engine__gpu_memory_utilization=0.15)
    assert "engine.gpu_memory_utilization" in msg and "15.3 GiB" in msg
    # one GPU: 28.4 + 56.7 GiB of weights and AdamW beside vLLM's 40
    msg = refusal(world=1)
    assert ("during rollouts" in msg and "engine.gpu_memory_utilization" in msg
            and "more GPUs" in msg)
    # 262144 tokens a micro-batch: 49.0 GiB of checkpoints (28 x 2 x 262144 x 3584 bytes) and
    # 76.7 for the recomputed layer (262144 x 314080 bytes): 125.7 GiB of activations
    msg = refusal(engine__micro_batch_tokens=262144)
    assert ("during the update" in msg
            and "engine.micro_batch_tokens (activations: 125.7 GiB)" in msg)
    assert "raise engine.sequence_parallel (now 1:" in msg
    assert "sleep_level" not in msg and "gradient_checkpointing" not in msg  # both already right
    msg = refusal(engine__sleep_level=0, engine__gradient_checkpointing="false",
                  engine__micro_batch_tokens=8192)
    assert "engine.sleep_level = 1" in msg and "engine.gradient_checkpointing = true" in msg


# Qwen2.5-32B-Instruct's config.json: 40 heads, 8 KV heads of 128
QWEN25_32B = dict(hidden_size=5120, num_hidden_layers=64, vocab_size=152064,
                  intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8,
                  tie_word_embeddings=False)


def test_memory_estimate_with_tensor_parallel_rollouts():
    """presets/qwen2.5-32b.toml on 2 nodes of 8 GPUs of 80 GiB: each vLLM engine needs its 61 GiB of
    bf16 weights with tensor parallel 1 (refused, naming the key), half of them with 2 (fits)."""
    from transformers import Qwen2Config

    mc = Qwen2Config(**QWEN25_32B)
    P, L = infra.parameter_counts(mc)["total"], 64
    paths = [str(spell.ROOT / "config.toml"), str(spell.ROOT / "presets" / "qwen2.5-32b.toml")]
    GiB, tokens = 2**30, 16384 + 4096
    # 16 > 8 KV heads: one a rank, replicated
    for k, kv_width in [(1, 8 * 128), (2, 4 * 128), (16, 1 * 128)]:
        cfg = spell.load_config(paths, [f"--engine.tensor_parallel_size={k}"])
        est = infra.memory_estimate(cfg, mc, world=16, device_gib=80.0,
                                    longest=spell.longest_sequence(cfg))
        assert est["vllm_minimum"] == pytest.approx(
            (2 * P / k + 2 * 2 * L * kv_width * tokens) / GiB, rel=1e-12), k
    one, two = (spell.load_config(paths, [f"--engine.tensor_parallel_size={k}"]) for k in (1, 2))
    with pytest.raises(infra.ConfigError, match="engine.tensor_parallel_size") as e:
        infra.check_memory(one, infra.memory_estimate(one, mc, 16, 80.0,
                                                      longest=spell.longest_sequence(one)),
                           80.0, 16)
    assert "1/1" in str(e.value) and "66.0 GiB" in str(e.value)  # 61.0 of weights + 5.0 of KV cache
    # 30.5 + 2.5 GiB: fits
    infra.check_memory(two, infra.memory_estimate(two, mc, 16, 80.0,
                                                  longest=spell.longest_sequence(two)), 80.0, 16)
    # this launch with vLLM at half the GPU (the figure docs/gpu.md and the preset quote); the
    # update's activations are those of one 20480-token sequence, above the 16384-token budget
    half = spell.load_config(paths, ["--engine.tensor_parallel_size=2",
                                     "--engine.gpu_memory_utilization=0.5"])
    estimate = infra.memory_estimate(half, mc, 16, 80.0, longest=spell.longest_sequence(half))
    assert infra.memory_line(estimate, 80.0).startswith(
        "memory: estimate 62.9 of 80.0 GiB per GPU (start-up and rollouts 62.9, update 60.6")


def test_hsdp_mesh_and_memory():
    """engine.fsdp_shard_size: the mesh shape (FSDP for 0 or the world, else replicate x shard),
    refused when it does not divide the world; the sharded terms of the memory estimate divide by
    the shard group, and a refusal names the key. HSDP's updates and weight sync run in
    test_fsdp_update_... and test_bucketed_sync_matches_unbucketed[hsdp-2x2]."""
    from transformers import Qwen2Config

    cfg = lambda s: spell.load_config(str(spell.ROOT / "config.toml"),  # noqa: E731
                                      [f"--engine.fsdp_shard_size={s}"])
    assert infra.mesh_shape(cfg(0), 16) == (16,) and infra.mesh_shape(cfg(16), 16) == (16,)
    assert infra.mesh_shape(cfg(8), 16) == (2, 8) and infra.mesh_shape(cfg(1), 4) == (4, 1)
    with pytest.raises(infra.ConfigError, match=re.escape(
            "engine.fsdp_shard_size = 3 must divide the number of ranks, 16")):
        infra.mesh_shape(cfg(3), 16)
    mc = Qwen2Config(**QWEN25_7B)
    fsdp, hsdp = (infra.memory_estimate(c, mc, 16, 80.0, longest=spell.longest_sequence(c))
                  for c in (cfg(0), cfg(8)))
    for key in ("weights", "grads", "adamw"):  # sharded over 8, not 16
        assert hsdp[key] == pytest.approx(2 * fsdp[key], rel=1e-12), key
    assert all(hsdp[k] == fsdp[k]
               for k in ("gathered", "activations", "lm_head", "vllm", "vllm_minimum"))
    small = cfg(1)  # every rank holds everything: 16 B x 7.6 B parameters = 113 GiB
    with pytest.raises(infra.ConfigError,
                       match=re.escape("113.5 GiB a GPU on 1, engine.fsdp_shard_size)")):
        infra.check_memory(small, infra.memory_estimate(small, mc, 16, 80.0,
                                                        longest=spell.longest_sequence(small)),
                           80.0, 16)


# bench/gpu_check.py's update on one H200 (issue #41): GiB allocated at the peak, by AdamW
# implementation and T tokens a micro-batch. foreach (CUDA's default before spell.make_optimizer
# named fused): ../shared/notes/gpu-run-2026-11-28.md, §2, at 4bac87c; fused: the H200 run at
# 7d7bb2e (bench/RESULTS.md)
H200_UPDATE_PEAKS = {("foreach", 16384): 55.21, ("foreach", 32768): 59.97,
                     ("fused", 16384): 54.30, ("fused", 32768): 59.96}


def gpu_check_estimate(T: int, optimizer: str, device_gib: float = 139.8, **keys) -> dict:
    """memory_estimate as bench/gpu_check.py's part b asks it: 8 of Qwen2.5-7B's 28 layers in one
    shard (a world of one), config.toml with engine.micro_batch_tokens = T (and `keys`), a batch
    whose longest sequence is at most T."""
    from transformers import Qwen2Config

    cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
        f"--engine.micro_batch_tokens={T}", *(f"--{k.replace('__', '.')}={v}"
                                              for k, v in keys.items())])
    return infra.memory_estimate(cfg, Qwen2Config(**{**QWEN25_7B, "num_hidden_layers": 8}),
                                 world=1, device_gib=device_gib, longest=T, optimizer=optimizer)


def test_memory_estimate_holds_the_h200_update_rows():
    """Issue #41, item 2. gpu_check's update (2 micro-batches of T tokens, one optimiser step) on
    8 of Qwen2.5-7B's layers, P = 8 x 233,057,792 + 1,089,998,336 = 2,954,460,672 in one shard,
    measured 55.21 GiB at 16K and 59.97 at 32K with foreach AdamW. Worked by hand: the weights,
    both moments and the gradients (all of them: the second micro-batch's backward runs beside
    the first's gradient shards) are 16P = 44.02 GiB. On top: foreach's step, a copy of the second
    moments, 4P (the 16K peak: 20P = 55.03); a layer's backward, 2R + 4Λ gathered, 2VH + 6Λ of
    gradients waiting, 8 checkpoints of 2TH and the recomputed layer's 314,080 bytes a token (the
    32K peak: 60.58); the root's reduction, 6R and its reduced shard 4R (world 1), below both. The
    estimate lies within 3 % of the GPU (-0.3 % at 16K, +1.0 % at 32K). With the fused AdamW
    (spell.make_optimizer's) the step adds nothing and the 16K peak is the backward's, 54.91
    against the 54.30 measured (+1.1 %; 32K: 60.58 against 59.96, +1.0 %). The estimate of issue
    #41 read 50.1 and 54.3: no gradients beside the backward, no step."""
    P, layer, root, H, I, V = 2_954_460_672, 233_057_792, 1_089_998_336, 3584, 18944, 152064
    assert P == 8 * layer + root
    GiB = 2**30
    for T in (16384, 32768):
        foreach, fused = gpu_check_estimate(T, "foreach"), gpu_check_estimate(T, "fused")
        backward = (16 * P + 2 * root + 4 * layer + 2 * V * H + 6 * layer
                    + 8 * 2 * T * H + T * 314080) / GiB
        assert backward > (16 * P + 10 * root) / GiB  # the root's reduction: 54.18
        assert foreach["update_backward"] == pytest.approx(backward, rel=1e-12)
        assert foreach["update_step"] == pytest.approx(20 * P / GiB, rel=1e-12)
        assert fused["update_step"] == pytest.approx(16 * P / GiB, rel=1e-12)
        assert foreach["update_phase"] == max(backward, 20 * P / GiB)
        assert fused["update_phase"] == pytest.approx(backward, rel=1e-12)
        for name, est in (("foreach", foreach), ("fused", fused)):
            measured = H200_UPDATE_PEAKS[name, T]
            assert abs(est["update_phase"] / measured - 1) <= 0.03, (name, T, est["update_phase"])
    assert round(gpu_check_estimate(16384, "foreach")["update_phase"], 2) == 55.03  # the step
    assert round(gpu_check_estimate(32768, "foreach")["update_phase"], 2) == 60.58  # a backward
    assert round(gpu_check_estimate(16384, "fused")["update_phase"], 2) == 54.91
    # the root's reduction is the largest backward moment when the rows are short: 1K tokens
    short = gpu_check_estimate(1024, "fused")
    assert short["update_phase"] == pytest.approx((16 * P + 10 * root) / GiB, rel=1e-12)


def test_start_up_holds_the_weights_and_both_moments_beside_vllm():
    """Issue #41, item 2: start-up is the policy's fp32 weights and the AdamW moments that
    create_optimizer_state makes (12P/s), vLLM awake at engine.gpu_memory_utilization. config.toml
    on 8 x 80 GB (79.2 GiB as torch reports the card), P = 7,615,616,512: 10.64 + 0.75 x 79.2 =
    70.04 GiB. Before issue #41 the state was made by a step on zero gradients, foreach's: the
    estimate's optimiser-step moment with foreach, 20P/8 + vLLM = 77.13. The qwen2.5-32b preset
    on 8 H200s (139.8 GiB), P = 32,763,876,352: 122.66 now, 153.17 then. Each old start leaves
    less than infra.UNCOUNTED_GIB of the device; each new one fits with it."""
    from transformers import Qwen2Config

    GiB = 2**30
    cases = ((["config.toml"], QWEN25_7B, 7_615_616_512, 79.2, 0.75, 70.04, 77.13),
             (["config.toml", "presets/qwen2.5-32b.toml"], QWEN25_32B, 32_763_876_352, 139.8,
              0.55, 122.66, 153.17))
    for files, shape, P, device_gib, share, now, then in cases:
        cfg = spell.load_config([str(spell.ROOT / f) for f in files])
        assert cfg.engine.gpu_memory_utilization == share
        mc = Qwen2Config(**shape)
        new, old = (infra.memory_estimate(cfg, mc, 8, device_gib, spell.longest_sequence(cfg),
                                          optimizer=o) for o in ("fused", "foreach"))
        assert new["start_phase"] == pytest.approx(12 * P / 8 / GiB + share * device_gib,
                                                   rel=1e-12)
        assert round(new["start_phase"], 2) == now
        assert round(old["update_step"] + old["vllm"], 2) == then  # the step on zero gradients
        infra.check_memory(cfg, new, device_gib, 8)  # fits, with UNCOUNTED_GIB to spare
        # the old start left less than the allowance (80 GB) or did not fit at all (H200)
        assert then > device_gib - infra.UNCOUNTED_GIB


def test_check_memory_keeps_room_for_what_the_estimate_leaves_out():
    """check_memory refuses a phase that fits the device but not with infra.UNCOUNTED_GIB (4 GiB:
    the CUDA context, NCCL, vLLM's CUDA graphs, fragmentation) to spare, and says which moment of
    the update is the largest."""
    from transformers import Qwen2Config

    assert infra.UNCOUNTED_GIB == 4.0
    cfg = spell.load_config(str(spell.ROOT / "config.toml"))
    mc = Qwen2Config(**QWEN25_7B)
    # 7B on 8 GPUs of 56 GiB: 10.64 + 0.75 x 56 = 52.64 GiB at start-up, under 56, over 52
    est = infra.memory_estimate(cfg, mc, 8, 56.0, spell.longest_sequence(cfg))
    assert 52.0 < est["start_phase"] < 56.0
    with pytest.raises(infra.ConfigError, match=re.escape(
            "52.6 GiB per GPU at start-up and during rollouts (the fp32 weights and AdamW's "
            "moments beside vLLM) > 56.0 GiB less 4.0 for what the estimate leaves out")):
        infra.check_memory(cfg, est, 56.0, 8)
    infra.check_memory(cfg, infra.memory_estimate(cfg, mc, 8, 58.6, spell.longest_sequence(cfg)),
                       58.6, 8)  # 10.64 + 43.95 = 54.59 <= 54.6
    # gpu_check's 8 layers in one shard at 4K-token micro-batches on 57 GiB, vLLM at 0.2: the
    # update's largest moment is foreach's step (55.03 GiB), the root's reduction with fused (54.18)
    keys = dict(engine__gpu_memory_utilization=0.2)
    for optimizer, moment, gib in (("foreach", "its optimiser step", 55.0),
                                   ("fused", "its backward", 54.2)):
        est = gpu_check_estimate(4096, optimizer, 57.0, **keys)
        cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
            "--engine.micro_batch_tokens=4096", "--engine.gpu_memory_utilization=0.2"])
        with pytest.raises(infra.ConfigError, match=re.escape(
                f"estimated {gib:.1f} GiB per GPU during the update (at {moment}) > 57.0 GiB")):
            infra.check_memory(cfg, est, 57.0, 1)


def test_memory_estimate_models_spells_adamw_and_what_its_step_allocates():
    """memory_estimate's default optimizer is the implementation spell.make_optimizer builds
    (fused), and each implementation's step allocates, beside the state, the bytes a parameter
    infra.ADAMW_STEP_BYTES gives it (fused 0, foreach 4: its copy of the second moments), as the
    tracker counts on CPU; an implementation it does not model is refused."""
    import inspect

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    P = sum(p.numel() for p in model.parameters())
    built = spell.make_optimizer(model, spell.Config())
    default = inspect.signature(infra.memory_estimate).parameters["optimizer"].default
    assert [name for name in infra.ADAMW_STEP_BYTES if built.defaults.get(name)] == [default]
    for name, per_parameter in infra.ADAMW_STEP_BYTES.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                      **{name: True})
        infra.create_optimizer_state(optimizer)
        model(torch.randn(8, 64)).square().sum().backward()
        assert allocated_peak(optimizer.step, model, optimizer) == per_parameter * P, name
        optimizer.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="optimizer 'loop', not one of fused, foreach"):
        gpu_check_estimate(1024, "loop")


# ------------------------------------------------------------------------------------------------
# The embedded model's export
# ------------------------------------------------------------------------------------------------

@pytest.mark.stack
def test_export_loads_in_transformers(embedded_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # idempotent: a second call finds the complete folder and does nothing
    t0 = time.perf_counter()
    assert infra.export_embedded_model(embedded_dir) == embedded_dir
    assert time.perf_counter() - t0 < 1.0
    assert "already complete" in capsys.readouterr().out

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(embedded_dir)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert not hasattr(model.config, "quantization_config")

    # real weights, not a random init: a plain English sentence is far more likely than uniform
    # (ln V = 10.8)
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin.",
              return_tensors="pt").input_ids
    with torch.no_grad():
        nll = model.float()(input_ids=ids, labels=ids).loss.item()
    assert nll < 5.0, f"mean NLL {nll:.2f}: the exported weights look wrong"

    # the chat template survived and the model answers and stops with <|im_end|>
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt[-3:] == tok("<|im_start|>assistant\n").input_ids[-3:]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=48,
                         do_sample=False)[0, len(prompt):]
    text = tok.decode(out, skip_special_tokens=True)
    print(f"HF answer: {text!r}")
    assert text.strip() and out[-1].item() == tok.eos_token_id


def test_rollout_precision_rule(monkeypatch):
    """engine.rollout_dtype "auto": bf16 on GPU; on CPU fp32, or bf16 with engine.cpu_bf16 on an AMX
    CPU only. vLLM on CPU runs eagerly but in bf16, which it compiles (its eager bf16 decodes wrong
    tokens); an explicit enforce_eager wins."""
    assert infra.rollout_dtype("auto", on_gpu=True) == "bfloat16"
    assert infra.rollout_dtype("float16", on_gpu=False, cpu_bf16=True) == "float16"
    for amx, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(infra, "cpu_has_amx", lambda: amx)
        assert infra.rollout_dtype("auto", on_gpu=False) == "float32"
        assert infra.rollout_dtype("auto", on_gpu=False, cpu_bf16=True) == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    eager = {dtype: infra.vllm_platform_kwargs(512, dtype, False, None, {})["enforce_eager"]
             for dtype in ("float32", "bfloat16", "float16")}
    assert eager == {"float32": True, "bfloat16": False, "float16": True}
    assert infra.vllm_platform_kwargs(512, "bfloat16", False, True, {})["enforce_eager"] is True


@pytest.mark.stack
@pytest.mark.parametrize("cpu_bf16", ["false", "true"])
def test_export_runs_in_vllm(embedded_dir, cpu_bf16):
    """In both of the CPU's rollout settings: fp32 eager (the default) and engine.cpu_bf16, the
    quickstart's (bf16 through torch.compile where the CPU has AMX: a minute or more to start)."""
    if cpu_bf16 == "true" and not infra.cpu_has_amx():
        pytest.skip("engine.cpu_bf16 is fp32, as tested above, on a CPU without AMX")
    output = torchrun(1, __file__, "export-smoke", embedded_dir, cpu_bf16).stdout
    print("\n".join(line for line in output.splitlines()
                    if line.startswith(("METRIC", "vLLM answer"))))
    m = metrics(output)
    assert m["export_vllm_answer_ok"] == 1.0


# ------------------------------------------------------------------------------------------------
# A model's weights in one host buffer (the frozen judge's)
# ------------------------------------------------------------------------------------------------

def test_flat_layout_starts_each_tensor_at_a_multiple_of_64_bytes():
    # 10 bytes, then 64 from 64, 3 from 128, 8 from 192 (131 rounded up): 200 in all
    assert infra.flat_layout([10, 64, 3, 8]) == ([0, 64, 128, 192], 200)
    assert infra.flat_layout([]) == ([], 0) and infra.flat_layout([0, 5]) == ([0, 0], 5)


def test_host_weights_page_lock_the_buffer_once_at_its_exact_size(monkeypatch):
    """On a GPU the buffer is page-locked where it lies (cudaHostRegister), once, for exactly its
    bytes, and unlocked when it is freed; pin_memory() would have rounded it up to 2^k. Here CUDA's
    two calls are recorded (this machine has none); the GPU test below makes them for real."""
    calls = []
    cudart = types.SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: calls.append(("lock", ptr, size)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unlock", ptr)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "check_error", lambda result: None)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7, bias=False))
    buffer, views = infra.host_weights(model, spell.gathered_state_dict(model, torch.bfloat16),
                                       torch.bfloat16, pin=True)
    # 30, 6 and 42 bytes of bf16, from 0, 64 and 128
    assert buffer.nbytes == 170 and [v.data_ptr() - buffer.data_ptr() for _, v in views] == \
        [0, 64, 128]
    ptr = buffer.data_ptr()
    assert calls == [("lock", ptr, 170)]
    del buffer, views
    assert calls == [("lock", ptr, 170), ("unlock", ptr)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_weights_on_a_gpu_are_page_locked_outside_the_caching_host_allocator():
    """The buffer is page-locked (is_pinned), and CUDA's caching host allocator, which rounds each
    block up to a power of two, holds none of it."""
    model = torch.nn.Linear(1000, 3000).cuda()
    held = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    buffer, views = infra.host_weights(model, spell.gathered_state_dict(model, torch.bfloat16),
                                       torch.bfloat16, pin=True)
    assert buffer.is_pinned() and all(v.is_pinned() for _, v in views)
    assert buffer.nbytes == 6_000_000 + 6_000 and torch.equal(views[0][1].cuda(),
                                                              model.weight.bfloat16())
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == held


# ------------------------------------------------------------------------------------------------
# Bucketed weight sync
# ------------------------------------------------------------------------------------------------

def test_sync_buckets_bound():
    """Consecutive, in order, every item once;
    a bucket exceeds the bound only as a lone oversized item."""
    assert infra.sync_buckets([], 10) == []
    assert infra.sync_buckets([4, 4, 2, 5, 5, 10, 11, 1], 10) == [[0, 1, 2], [3, 4], [5], [6], [7]]
    assert infra.sync_buckets([3, 3], 0) == [[0], [1]]  # bound 0: one tensor a bucket
    assert infra.sync_buckets([3, 3], 10**9) == [[0, 1]]
    g = np.random.default_rng(0)
    for bound in (1, 7, 50, 1000):
        sizes = g.integers(1, 100, size=200).tolist()
        buckets = infra.sync_buckets(sizes, bound)
        assert [i for b in buckets for i in b] == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in b) <= bound or len(b) == 1 for b in buckets)
        # greedy: the next bucket's first item did not fit into the one before
        assert all(sum(sizes[i] for i in a) + sizes[b[0]] > bound
                   for a, b in zip(buckets, buckets[1:]))


@pytest.mark.stack
@pytest.mark.parametrize("nproc, shard_size", [(2, 0), (4, 2)], ids=["fsdp-2", "hsdp-2x2"])
def test_bucketed_sync_matches_unbucketed(tmp_path, nproc, shard_size):
    """FSDP2 on 2 ranks, and HSDP on 4 (two shard groups of 2; each gathers within its group), gloo:
    the bucketed gather yields gathered_state_dict's (name, tensor) sequence, bit for bit, with one
    all-gather per bucket, buckets within the bound, and bucket k+1 issued before bucket k is handed
    out only when asked to (ahead = 1)."""
    out = tmp_path / "buckets.json"
    torchrun(nproc, __file__, "buckets", str(out), str(shard_size))
    results = json.loads(out.read_text())
    assert len(results) == nproc * 3 * 2  # ranks x bounds x ahead
    for r in results:
        where = f"rank {r['rank']}, bound {r['bound']}, ahead {r['ahead']}"
        # bit-equal: a gather copies, it does not round
        assert r["same_names"] and r["equal"], where
        sizes = [size for bucket in r["buckets"] for size in bucket]
        assert len(sizes) == r["n_tensors"], where
        assert all(sum(b) <= r["bound"] or len(b) == 1 for b in r["buckets"]), where
        assert r["collectives"] == len(r["buckets"]), where
        # ahead 0: bucket k+1 is issued after bucket k's last tensor was taken; ahead 1:
        # before its first
        assert r["issued_before_handed_out"] == ([r["ahead"] == 1] * (len(r["buckets"]) - 1)), where
    assert {r["bound"] for r in results if len(r["buckets"]) == 1} == {10**9}
    # an oversized tensor
    assert any(len(b) == 1 and b[0] > r["bound"] for r in results for b in r["buckets"])


# ------------------------------------------------------------------------------------------------
# The HF export
# ------------------------------------------------------------------------------------------------

EXPORT_LLAMA = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                    tie_word_embeddings=False)  # 32.3 M parameters: 123 MiB in fp32


@pytest.mark.parametrize("shard_bytes, files", [(2 << 30, 1), (300_000, 3)])
def test_the_export_writes_shards_of_the_bound_that_transformers_loads(tmp_path, shard_bytes,
                                                                       files):
    """infra.export_hf on an unsharded model: one model.safetensors, or shards of at most
    shard_bytes (a larger tensor alone) with their index, which transformers loads into the
    model's weights in the export's dtype, bit for bit (a cast rounds once: the same rounding as
    .to(bf16)), with its config and generation config; the folder counts as complete."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import SMOLLM2, tiny_llama

    model = tiny_llama()  # tied: the embedding once, as in an HF checkpoint
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.5
    out = tmp_path / "hf"
    infra.export_hf(model, AutoTokenizer.from_pretrained(SMOLLM2), out, 0,
                    spell.gathered_state_dict(model, torch.bfloat16), torch.bfloat16,
                    shard_bytes=shard_bytes)
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(weights) == files and infra.export_is_complete(str(out))
    assert not (tmp_path / "hf.tmp").exists()
    if files > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == weights
        assert index["metadata"]["total_size"] == sum(
            t.numel() * 2 for _, t in spell.gathered_state_dict(model, torch.float32))
        for name in weights:
            with safe_open(str(out / name), "pt") as f:
                sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            nbytes = sum(math.prod(shape) * 2 for shape in sizes)
            assert nbytes <= shard_bytes or len(sizes) == 1, (name, nbytes)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert loaded.config.dtype == torch.bfloat16 and loaded.generation_config.temperature == 0.5
    want = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name].bfloat16()), name


def export_before_41(policy, tokenizer, out_dir: Path, rank: int) -> None:
    """infra.export_hf as it was before issue #41 (commit 4bac87c): the baseline the new export's
    host peak is measured against. Rank 0 received the whole fp32 state dict, built a second model
    from the config (fp32: the trainer loads fp32 masters), loaded it and saved it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if rank == 0:
        config = policy.config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(full)
        model.to(config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32)
        model.generation_config = policy.generation_config
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    infra.barrier()


@pytest.mark.stack
def test_the_exports_host_peak_is_a_shard_not_the_model(tmp_path, monkeypatch):
    """Issue #41 (G6): the export of an FSDP2 policy on 2 ranks, rank 0's peak resident memory
    beyond what it held before (Linux's VmHWM, reset first; the C library made to give freed
    blocks back at once, MALLOC_MMAP_THRESHOLD_, so a block freed earlier is not silently
    reused), against the export before #41 in the same processes. Before: the gathered fp32 state
    dict and a second fp32 model, 2 x 123 MiB, plus its writing. Now: a shard (16 MiB here) held,
    twice at most (an older safetensors copies it into bytes to write it; 0.8 does not), a
    gathered tensor and its local shard (the largest, the embedding: 7.8 MiB in bf16, and half of
    it), within 8 MiB of slack (resident pages of gloo and the allocator). Measured on the 2-core
    CPU machine: 16-20 MiB now, 238-240 before; a plant holding the whole model in one shard:
    59 MiB, over the bound. The export, in bf16, loads in transformers with the
    weights of the old export's fp32 model cast to bf16 and its logits when both load in bf16, bit
    for bit, and the same config but its dtype."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import SMOLLM2

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    torchrun(2, __file__, "export-peak", str(tmp_path), str(SMOLLM2))
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    print(f"METRIC export_peak_new_mib={peaks['new'] / 2**20:.1f}")
    print(f"METRIC export_peak_before_mib={peaks['before'] / 2**20:.1f}")
    embedding = EXPORT_LLAMA["vocab_size"] * EXPORT_LLAMA["hidden_size"] * 2  # bf16
    assert peaks["new"] <= 2 * (16 << 20) + embedding * 3 / 2 + (8 << 20), peaks
    assert peaks["new"] < peaks["before"] / 4, peaks
    new, before = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d), dtype=torch.bfloat16)
                   for d in ("new", "before"))
    want = {k: v.bfloat16() for k, v in load_file(str(tmp_path / "before" / "model.safetensors"))
            .items()}  # fp32 as written
    for name, tensor in new.state_dict().items():
        assert torch.equal(tensor, want[name]) and torch.equal(tensor, before.state_dict()[name])
    ids = torch.randint(0, EXPORT_LLAMA["vocab_size"], (2, 37), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        assert torch.equal(new(ids).logits, before(ids).logits)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("new", "before")]
    assert [c.pop("dtype") for c in configs] == ["bfloat16", "float32"]
    assert configs[0] == configs[1]
    assert LlamaConfig.from_pretrained(tmp_path / "new").num_hidden_layers == 8


# ------------------------------------------------------------------------------------------------
# Tensor-parallel rollouts and rebalancing
# ------------------------------------------------------------------------------------------------

def test_tensor_parallel_owners():
    """Tensor-parallel rollouts: groups named by an engine's first rank spread over that engine's
    ranks, whole, most tokens first to the least loaded; with k = 1 nothing moves."""
    ranks, lengths = [0, 0, 2, 0, 0, 0], [3, 5, 7, 1, 4, 3]
    groups = ["a", "b", "c", "d", "e", "f"]  # one sequence each: as sequences, longest first
    # engine 0 (ranks 0, 1): 5 -> 0, 4 -> 1, 3 -> 1, 3 -> 0, 1 -> 1 (loads 8 and 8);
    # engine 1: 7 -> rank 2
    assert infra.tensor_parallel_owners(ranks, lengths, groups, 2) == [1, 0, 2, 1, 1, 0]
    assert infra.tensor_parallel_owners([0, 1, 3], [3, 5, 2], "xyz", 1) == [0, 1, 3]
    # groups a (3 + 1 + 3 = 7 tokens) and b (5 + 4 = 9): b -> 0, a -> 1, each whole
    assert infra.tensor_parallel_owners(ranks, lengths, ["a", "b", "c", "a", "b", "a"], 2) == \
        [1, 0, 2, 1, 0, 1]
    with pytest.raises(AssertionError, match="a group spans engines"):
        infra.tensor_parallel_owners([0, 2], [1, 1], ["a", "a"], 2)


def test_token_fingerprint_and_group_check():
    """The per-step CRC the ranks of a tensor-parallel engine compare: any token or status that
    differs changes it, and a group that disagrees stops every rank with the ranks named."""
    base = infra.token_fingerprint(["ok", [1, 2, 3], [4, 5], "ok", []])
    assert base == infra.token_fingerprint(["ok", [1, 2, 3], [4, 5], "ok", []])
    for other in (["ok", [1, 2, 4], [4, 5], "ok", []], ["format", [1, 2, 3], [4, 5], "ok", []],
                  ["ok", [1, 2, 3], [4, 5]], []):
        assert infra.token_fingerprint(other) != base
    # each group agrees within; groups differ, as they should
    infra.check_groups_agree([base, base, 5, 5], 2)
    infra.check_groups_agree([1, 2, 3], 1)
    with pytest.raises(RuntimeError, match="ranks 2-3 share a tensor-parallel vLLM engine "
                                           "but sampled different"):
        infra.check_groups_agree([base, base, 5, 6], 2)


def test_engine_groups_follow_vllm_and_refuse_what_it_cannot_split(tmp_path):
    """Groups of consecutive ranks, as vLLM's external launcher makes them (start_vllm checks that
    at run time); a size that does not divide the world or the model's heads stops before
    vLLM starts."""
    from transformers import LlamaConfig, Qwen2Config

    cfg = lambda k: spell.load_config(str(REPO / "config.toml"),  # noqa: E731
                                      [f"--engine.tensor_parallel_size={k}"])
    assert [infra.engine_groups(cfg(1), r, 4) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [infra.engine_groups(cfg(2), r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(infra.ConfigError, match=re.escape(
            "tensor_parallel_size = 3 must divide the number of ranks, 4")):
        infra.engine_groups(cfg(3), 0, 4)
    # without tensor parallelism the model's folder is not read
    # (a hub name need not resolve offline)
    assert infra.engine_groups(cfg(1), 1, 2, str(tmp_path / "no_such_model")) == (1, 2)

    # engine_groups reads the model folder's config.json, as main() passes it
    def saved(config, name):
        config.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    qwen7b = saved(Qwen2Config(**QWEN25_7B), "qwen7b")  # 28 heads, 4 KV heads
    for k in (2, 4):
        assert infra.engine_groups(cfg(k), 5, 8, qwen7b) == (5 // k, 8 // k)
    with pytest.raises(infra.ConfigError, match="must divide the model's 28 attention heads"):
        # 8 KV copies would do (replicated), 28 / 8 heads would not
        infra.engine_groups(cfg(8), 0, 8, qwen7b)
    smollm2 = saved(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3),
                    "smollm2")  # SmolLM2-135M
    assert infra.engine_groups(cfg(3), 0, 3, smollm2) == (0, 1)
    with pytest.raises(infra.ConfigError, match="9 attention heads"):
        infra.engine_groups(cfg(2), 0, 2, smollm2)
    kv = saved(LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6), "kv6")
    # 4 splits 12 heads, neither divides 6 nor is a multiple
    with pytest.raises(infra.ConfigError, match="6 key/value heads"):
        infra.engine_groups(cfg(4), 0, 4, kv)


def test_plan_rebalance():
    """Surplus sequences move, longest first, to the least loaded rank;
    a balanced batch stays put."""
    moves = infra.plan_rebalance([[1500, 1400, 1000, 600, 600], []])
    assert moves == [(0, 1, 1), (0, 3, 1), (0, 4, 1)]  # rank 0 keeps 1500 + 1000, rank 1 gets 2600
    assert infra.plan_rebalance([[5, 5], [5, 5]]) == [] and infra.plan_rebalance([[], []]) == []
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = [rng.integers(1, 3000, size=rng.integers(0, 12)).tolist()
                   for _ in range(rng.integers(1, 9))]
        moves = infra.plan_rebalance(lengths)
        # each sequence moves at most once
        assert len({(src, i) for src, i, _ in moves}) == len(moves)
        assert all(src != dst and 0 <= i < len(lengths[src]) for src, i, dst in moves)
        load = [sum(x) for x in lengths]
        for src, i, dst in moves:
            load[src] -= lengths[src][i]
            load[dst] += lengths[src][i]
        longest = max((x for lens in lengths for x in lens), default=0)
        # LPT over what each rank could not keep: no rank ends more than one sequence above the mean
        assert max(load) <= sum(load) / len(load) + longest


# ------------------------------------------------------------------------------------------------
# Long context: model.rope_scaling, the same for vLLM and the trainer, and the context bound
# ------------------------------------------------------------------------------------------------

# Qwen2.5-7B-Instruct's config.json: 32K positions, theta 1e6 (its card adds YaRN x 4 for 128K)
QWEN25_7B_CONTEXT = dict(QWEN25_7B, max_position_embeddings=32768, rope_theta=1000000.0)


def saved_config(tmp_path: Path, name: str, **fields) -> str:
    """A folder holding only a Qwen2 config.json (what infra.model_config reads)."""
    from transformers import Qwen2Config

    Qwen2Config(**{**QWEN25_7B_CONTEXT, **fields}).save_pretrained(tmp_path / name)
    return str(tmp_path / name)


@pytest.mark.parametrize("text", ["yarn", "yarn:", "yarn:1", "yarn:0.5", "yarn:-4", "yarn:nan",
                                  "yarn:inf", "yarn:2000", "yarn:four", ":4", "linear:2",
                                  "YARN:4", "yarn=4"])
def test_rope_scaling_key_takes_type_and_factor(text):
    """model.rope_scaling is "" or TYPE:FACTOR, a type both engines compute alike and a factor in
    (1, 1024]; anything else is one error line naming the key, from a file or the command line."""
    assert infra.parse_rope_scaling("") is None
    assert infra.parse_rope_scaling("yarn:4") == ("yarn", 4.0)
    assert infra.parse_rope_scaling("yarn:2.5") == ("yarn", 2.5)
    assert spell.load_config(None, ["--model.rope_scaling=yarn:4"]).model.rope_scaling == "yarn:4"
    with pytest.raises(infra.ConfigError, match=r"^model\.rope_scaling must be \"\" or "
                                                r"TYPE:FACTOR .*, got " + re.escape(repr(text))):
        spell.load_config(None, [f"--model.rope_scaling={text}"])


def test_rope_overrides_are_one_dict_for_vllm_and_the_trainer(tmp_path):
    """"yarn:4" on Qwen2.5-7B's config.json: YaRN x 4 over its 32K positions, its theta kept, and
    131072 positions (vLLM 0.32 reads a YaRN model's context from max_position_embeddings as it
    stands). The trainer's config carries exactly the dict vLLM gets as hf_overrides."""
    qwen = saved_config(tmp_path, "qwen")
    config, overrides = infra.model_config(qwen, "yarn:4")
    assert overrides == {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                             "original_max_position_embeddings": 32768},
                         "max_position_embeddings": 131072}
    assert infra.rope_view(config) == overrides
    # the trainer holds its own copy: vLLM's dict cannot change under it
    assert config.rope_parameters is not overrides["rope_parameters"]
    # transformers builds YaRN from it: attention scaled by 0.1 ln(4) + 1 (its formula), no warning
    # that the factor contradicts 131072 / 32768
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    _, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert scaling == pytest.approx(0.1 * math.log(4) + 1, rel=1e-12)
    # "" leaves the model's config.json as it is
    plain, none = infra.model_config(qwen, "")
    assert none == {} and infra.rope_view(plain) == {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "max_position_embeddings": 32768}


def test_rope_scaling_agrees_with_or_contradicts_the_models_own(tmp_path):
    """A config.json that already scales RoPE (Qwen2.5's card: add YaRN x 4, positions left at
    32K): the same key completes it (131072 positions, so vLLM 0.32 allows 128K); another type or
    factor is an error naming both; a YaRN config.json's own pretrained length is kept."""
    card = saved_config(tmp_path, "card", rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    config, overrides = infra.model_config(card, "yarn:4")
    assert overrides["max_position_embeddings"] == 131072
    assert overrides["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                            "original_max_position_embeddings": 32768}
    assert infra.context_bound(config) == 131072
    # the card's file alone: vLLM 0.32 derives 32K, and a 128K rollout stops before vLLM starts
    own, _ = infra.model_config(card, "")
    assert infra.context_bound(own) == 32768
    with pytest.raises(infra.ConfigError, match=re.escape(
            f"128K = 131072 tokens, beyond the 32768-token context of the model {card} (its "
            f"config.json); lower them, or scale RoPE (model.rope_scaling = \"yarn:4\"")):
        infra.check_context(card, 131072, "128K")
    infra.check_context(card, 131072, "128K", "yarn:4")
    # Yarn-Llama-2's layout: positions already scaled, its own pretrained length
    llama = saved_config(tmp_path, "llama", max_position_embeddings=65536, rope_scaling={
        "type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096})
    assert infra.model_config(llama, "yarn:16")[1]["max_position_embeddings"] == 65536
    for fields, own_text in [
            (dict(rope_scaling={"type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": 32768}),
             "yarn with factor 2.0"),
            (dict(rope_scaling={"type": "linear", "factor": 4.0}), "linear with factor 4.0")]:
        other = saved_config(tmp_path, own_text.split()[0] + "2", **fields)
        with pytest.raises(infra.ConfigError, match=re.escape(
                f"model.rope_scaling = 'yarn:4' contradicts the model's config.json, whose RoPE "
                f"scaling is {own_text}")):
            infra.model_config(other, "yarn:4")


def test_context_bound_derives_what_vllm_derives(tmp_path):
    """Worked cases of vLLM 0.32's rule (pinned to vLLM itself in
    test_rope_scaling_reaches_vllm_and_the_trainer_alike): the smallest length key, times the
    factor of a scaling whose length is unscaled (linear), not YaRN's."""
    from transformers import LlamaConfig, Qwen2Config

    qwen = Qwen2Config(**QWEN25_7B_CONTEXT)
    assert infra.context_bound(qwen) == 32768
    yarn = Qwen2Config(**QWEN25_7B_CONTEXT, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert infra.context_bound(yarn) == 32768  # older vLLM: 131072
    linear = LlamaConfig(max_position_embeddings=4096,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert infra.context_bound(linear) == 8192
    smallest = Qwen2Config(**QWEN25_7B_CONTEXT, max_seq_len=16384)
    assert infra.context_bound(smallest) == 16384


def test_check_context_counts_the_longest_rollout(tmp_path):
    """The longest prompt plus the largest role budget (spell.longest_sequence) must fit; with
    "yarn:4", Qwen2.5-7B holds 131072 and not one token more."""
    qwen = saved_config(tmp_path, "qwen")
    cfg = spell.load_config(None, ["--rollout.max_prompt_tokens=122880",
                                   "--rollout.role_max_new_tokens=que:4096,res:8192,ver:2048"])
    infra.check_context(qwen, spell.longest_sequence(cfg), "longest", "yarn:4")
    cfg.rollout.role_max_new_tokens["ver"] = 8193
    with pytest.raises(infra.ConfigError, match=re.escape(
            f"longest = 131073 tokens, beyond the 131072-token context of the model {qwen} (its "
            f"config.json, model.rope_scaling 'yarn:4' applied)")):
        infra.check_context(qwen, spell.longest_sequence(cfg), "longest", "yarn:4")


def test_long_context_preset_fills_the_scaled_context(tmp_path):
    """presets/long-128k.toml stacked on config.toml, with Qwen2.5-7B's config.json: the longest
    rollout is exactly the 131,072 positions of YaRN x 4 (and stops before vLLM without the key), a
    responder group shared fits one sequence-parallel row, the SP size splits the model's heads,
    and the start-up estimate fits 8 GPUs of 78 GiB. Whether the questioner's (L + 1) m documents
    and the responder's whole cluster fit max_prompt_tokens depends on the corpus: not checked."""
    from transformers import Qwen2Config

    cfg = spell.load_config([str(REPO / "config.toml"), str(REPO / "presets" / "long-128k.toml")])
    qwen = saved_config(tmp_path, "qwen")
    config, _ = infra.model_config(qwen, cfg.model.rope_scaling)
    longest = spell.longest_sequence(cfg)
    assert longest == infra.context_bound(config) == 131072
    infra.check_context(qwen, longest, "longest", cfg.model.rope_scaling)
    with pytest.raises(infra.ConfigError, match=r"beyond the 32768-token context .*yarn:4"):
        infra.check_context(qwen, longest, "longest")
    answers = cfg.rollout.group_size * spell.max_new_tokens(cfg, "res")
    group = cfg.rollout.max_prompt_tokens + answers
    assert group <= spell.row_budget(cfg), (group, spell.row_budget(cfg))
    heads = QWEN25_7B["num_attention_heads"], QWEN25_7B["num_key_value_heads"]
    infra.check_heads(*heads, cfg.engine.sequence_parallel)
    with pytest.raises(infra.ConfigError, match="must divide the model's 28 query heads"):
        infra.check_heads(*heads, 8)  # why the preset's SP is 4, not 8
    estimate = infra.memory_estimate(cfg, Qwen2Config(**QWEN25_7B), 8, 78.0, longest)
    infra.check_memory(cfg, estimate, 78.0, 8)


def test_check_same_rope_names_both_sides(tmp_path):
    """vLLM's config (llm.llm_engine.model_config.hf_config) against the trainer's (policy.config):
    equal passes; any difference in the RoPE or the positions stops, naming both."""
    qwen = saved_config(tmp_path, "qwen")
    scaled, _ = infra.model_config(qwen, "yarn:4")
    plain, _ = infra.model_config(qwen, "")

    def llm(config):
        engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config))
        return types.SimpleNamespace(llm_engine=engine)

    policy = types.SimpleNamespace(config=infra.model_config(qwen, "yarn:4")[0])
    infra.check_same_rope(llm(scaled), policy)
    with pytest.raises(infra.ConfigError, match=r"vLLM's RoPE \{'rope_parameters': \{'rope_theta': "
                                                r"1000000.0, 'rope_type': 'default'\}.* and the "
                                                r"trainer's .*'rope_type': 'yarn'.* differ"):
        infra.check_same_rope(llm(plain), policy)
    positions = copy.deepcopy(scaled)
    positions.max_position_embeddings = 32768
    with pytest.raises(infra.ConfigError, match="differ"):
        infra.check_same_rope(llm(positions), policy)


def test_rope_scaling_reaches_vllm_and_the_trainer_alike(tiny_dir, tmp_path):
    """The tiny model (2048 positions) with model.rope_scaling = "yarn:4", started as main() starts
    it (spell.start_engine, spell.load_policy): vLLM's rotary tables over all 8192 positions equal
    the trainer's, and so do the sampled tokens' log-probs on prompts past 2048; a trainer without
    the key is stopped; prefix caching changes no sampled token; context_bound is vLLM's own
    max_model_len rule on four configs."""
    out = tmp_path / "rope.json"
    output = torchrun(1, __file__, "rope", tiny_dir, str(out), str(tmp_path)).stdout
    r = json.loads(out.read_text())
    print({k: v for k, v in r.items() if k != "bounds"}, r["bounds"])
    assert r["max_model_len"] == 8192, output[-3000:]
    # cos and sin of the same fp32 angles, times the same YaRN scale 0.1 ln 4 + 1: an angle
    # p x inv_freq <= 8192 rounds to half an ulp of 8192 (4.9e-4) on either side, so the tables
    # may differ by 2 x 4.9e-4 x 1.14 = 1.1e-3 at most (measured: 0.0, the same computation)
    assert r["cos_max_diff"] < 1.2e-3 and r["sin_max_diff"] < 1.2e-3
    assert r["mismatch_stopped"], "a trainer without model.rope_scaling went unnoticed"
    # as test_spell.py's parity test: fp32 both sides, the log-sum-exp over V = 49152 dominates the
    # rounding, sqrt(V) u32 = 1.3e-5 typically; 1e-4 is 8x that
    assert r["trainer_vllm_max_diff"] < 1e-4
    assert r["timeout_after_regroup"] == 7 * 60  # eval's new process group kept the run's timeout
    # the same prompts under the plain RoPE read differently (measured 1.1)
    assert r["plain_trainer_vllm_max_diff"] > 1e-2
    # the prefix cache reuses the prompt's KV blocks, computed by the same kernels: the tokens
    # sampled with the same request seeds are the same, the log-probs equal within the rounding
    # above (a different batch layout sums in another order)
    assert r["cached_tokens_equal"] and r["uncached_tokens_equal"]
    assert r["cached_max_diff"] < 1e-4 and r["uncached_max_diff"] < 1e-4
    # vLLM starts at context_bound and refuses one token more, and reads the trainer's RoPE, for
    # each config
    assert r["bounds"] == [[name, bound, True, False, True] for name, bound, *_ in r["bounds"]]
    assert [b[:2] for b in r["bounds"]] == [["plain", 2048], ["yarn:4", 8192],
                                            ["config.json yarn x4", 2048],
                                            ["config.json linear x2", 4096]]


# ------------------------------------------------------------------------------------------------
# Checkpoint integrity
# ------------------------------------------------------------------------------------------------

def tiny_checkpoint(out_dir: Path, step: int = 1, cfg: spell.Config | None = None) -> Path:
    """A real one-rank checkpoint (DCP shard, .metadata, rank0.pt, meta.json)
    of a Linear and its AdamW moments, saved by a run of `cfg` (default: the defaults)."""
    cfg = cfg or spell.Config()
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
    assert infra.check_checkpoint(path, world=1)["step"] == 1


def test_a_save_on_a_full_disk_stops_in_one_line_and_frees_its_temporary(tmp_path, monkeypatch):
    """A disk that fills during a save: before, the OSError's traceback ended the run and
    step_N.tmp stayed, holding the space the next try needed. Now one line names the checkpoint,
    the reason and the free space; the temporary folder is gone; the last checkpoint and `latest`
    are as they were, and resume from it."""
    out_dir = tmp_path / "run"
    first = tiny_checkpoint(out_dir, step=1)
    before = snapshot(out_dir)
    real_save = torch.save

    def fill_the_disk(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(".pt"):  # the rank's own state
            Path(f).write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", fill_the_disk)
    with pytest.raises(infra.CheckpointError) as e:
        tiny_checkpoint(out_dir, step=2)
    second = first.parent / "step_000002"
    assert str(e.value).startswith(f"{second}: cannot be saved (No space left on device; "), e.value
    assert str(e.value).endswith(f"); its temporary folder is removed, and "
                                 f"{first.parent / 'latest'} still names the last checkpoint "
                                 "saved"), e.value
    assert snapshot(out_dir) == before and not second.with_name("step_000002.tmp").exists()
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    assert infra.resume_checkpoint(cfg, resume=True, rank=0, world=1) == first


def flip_middle_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    # e.g. an exponent bit of an Adam moment: same size, silently wrong
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda step: flip_middle_byte(step / "__0_0.distcp"), "__0_0.distcp is corrupted (CRC-32 "),
    (lambda step: flip_middle_byte(step / ".metadata"), ".metadata is corrupted"),
    (lambda step: (step / "rank0.pt").write_bytes((step / "rank0.pt").read_bytes()[:-1]),
     "rank0.pt has "),
    (lambda step: (step / "__0_0.distcp").unlink(),
     "not a complete checkpoint (missing __0_0.distcp)"),
])
def test_damaged_checkpoint_is_refused_before_anything_starts(tmp_path, monkeypatch, damage,
                                                              message):
    """The checkpoint's own record catches a flipped byte, a cut file, a lost file: before the
    process group, vLLM or the model (init_distributed is never reached), and nothing in the
    run changes."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(GOOD_CLUSTER) + "\n")
    out_dir = tmp_path / "run"
    step = tiny_checkpoint(out_dir)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    damage(step)
    before = snapshot(out_dir)
    monkeypatch.setattr(spell, "init_distributed",
                        lambda cfg: pytest.fail("the run started on a damaged checkpoint"))
    with pytest.raises(infra.CheckpointError, match=re.escape(f"{step}: {message}")):
        spell.main(["--config", str(REPO / "presets" / "demo.toml"), f"--data.corpus={corpus}",
                    f"--log.out_dir={out_dir}", "--resume"])
    assert snapshot(out_dir) == before


def test_the_collective_timeout_reaches_the_process_group():
    """engine.collective_timeout_min is the process group's timeout (NCCL's default of 10 minutes
    would kill a rank that waits for a slower one: issue #36). A world of one in its own process."""
    code = ("import spell, infra; cfg = spell.Config(); cfg.engine.collective_timeout_min = 7.5; "
            "spell.init_distributed(cfg); print(infra.group_timeout().total_seconds())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) == 7.5 * 60


def test_each_rank_checksums_the_files_it_wrote(tmp_path):
    """Resuming ranks share the reading: rank r checks the sizes of all files but the CRC-32 only of
    its own (__r_*.distcp, rank{r}.pt; rank 0 also .metadata)."""
    step = tmp_path / "step_000001"
    step.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "rank0.pt",
                 "rank1.pt"):
        (step / name).write_bytes(name.encode() * 100)
    assert ([infra.checkpoint_file_rank(p.name) for p in sorted(step.iterdir())]
            == [0, 0, 1, 1, 0, 1])
    files = {**infra.seal_files(step, 0), **infra.seal_files(step, 1)}
    assert len(files) == 6
    (step / "meta.json").write_text(json.dumps(infra.sealed_meta({"step": 1, "world": 2,
                                                                  "files": files})))
    flip_middle_byte(step / "__1_1.distcp")
    infra.check_checkpoint(step, world=2, ranks=[0])
    for ranks in ([1], None):
        with pytest.raises(infra.CheckpointError, match=re.escape("__1_1.distcp is corrupted")):
            infra.check_checkpoint(step, world=2, ranks=ranks)
    (step / "rank1.pt").write_bytes(b"")  # a size is checked on every rank
    with pytest.raises(infra.CheckpointError,
                       match=re.escape("rank1.pt has 0 bytes, 800 were saved")):
        infra.check_checkpoint(step, world=2, ranks=[0])


def test_checkpoint_without_checksums_is_refused(tmp_path):
    """Without meta.json's sizes and checksums (an older spell.py's, or the key deleted) nothing
    can be verified, so nothing is resumed; nor with a file of the checkpoint left out of them."""
    step = tmp_path / "step_000001"
    step.mkdir()
    for name in (".metadata", "__0_0.distcp", "rank0.pt"):
        (step / name).write_bytes(b"x")
    files = infra.seal_files(step, rank=0)
    # what spell.py wrote before sizes and checksums
    (step / "meta.json").write_text('{"step": 1, "world": 1}')
    with pytest.raises(infra.CheckpointError,
                       match=re.escape(f"{step}: meta.json records no file sizes or checksums")):
        infra.check_checkpoint(step, world=1)
    for name in files:
        (step / "meta.json").write_text(json.dumps(
            {"step": 1, "world": 1, "files": {n: r for n, r in files.items() if n != name}}))
        with pytest.raises(infra.CheckpointError,
                           match=re.escape(f"meta.json records no size or checksum of {name}")):
            infra.check_checkpoint(step, world=1)


def set_files(step: Path, **files: dict) -> None:
    """Change the files that step's meta.json records, as a forger would: with meta.json's own
    checksum made anew."""
    meta = json.loads((step / "meta.json").read_text())
    meta["files"].update(files)
    (step / "meta.json").write_text(json.dumps(infra.sealed_meta(meta)))


def test_meta_json_names_only_files_of_the_checkpoint(tmp_path):
    """meta.json's file names are plain names inside the folder: "/dev/zero" would make --resume
    hang (checksummed for ever) and "../" would read outside the run; both are refused at once."""
    step = tiny_checkpoint(tmp_path / "run")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the run's")
    record = infra.seal_files(tmp_path, rank=0)["outside.bin"]
    for name, rec in [("/dev/zero", {"size": 0, "crc32": "00000000"}),
                      ("../../outside.bin", record), ("sub/rank0.pt", record), ("..", record)]:
        set_files(step, **{name: rec})
        with deadline(10), pytest.raises(infra.CheckpointError) as e:
            infra.check_checkpoint(step, world=1)
        assert str(e.value) == (f"{step}: meta.json names {name!r}, "
                                "not a file of the checkpoint folder"), e.value
        meta = json.loads((step / "meta.json").read_text())
        del meta["files"][name]
        (step / "meta.json").write_text(json.dumps(infra.sealed_meta(meta)))
    assert infra.check_checkpoint(step, world=1)["step"] == 1


def test_checkpoint_files_that_are_links_or_devices_are_refused(tmp_path):
    """A checkpoint's files are plain files: a link to /dev/zero in rank0.pt's place (its size
    recorded as 0) or in meta.json's, or a FIFO that never delivers, is refused without reading."""
    step = tiny_checkpoint(tmp_path / "run")
    (step / "rank0.pt").unlink()
    (step / "rank0.pt").symlink_to("/dev/zero")
    set_files(step, **{"rank0.pt": {"size": 0, "crc32": "00000000"}})
    with deadline(10), pytest.raises(infra.CheckpointError,
                                     match=re.escape(f"{step}: rank0.pt is not a plain file")):
        infra.check_checkpoint(step, world=1)
    (step / "meta.json").unlink()
    (step / "meta.json").symlink_to("/dev/zero")
    with deadline(10), pytest.raises(infra.CheckpointError, match=re.escape(
            f"{step}: not a complete checkpoint (meta.json: a symbolic link, not a plain file)")):
        infra.check_checkpoint(step, world=1)
    (step / "meta.json").unlink()
    os.mkfifo(step / "meta.json")
    with deadline(10), pytest.raises(infra.CheckpointError, match=re.escape(
            f"{step}: not a complete checkpoint (meta.json: not a plain file)")):
        infra.check_checkpoint(step, world=1)


@pytest.mark.parametrize("latest", ["../../elsewhere/checkpoints/step_000001",
                                    "{tmp}/elsewhere/checkpoints/step_000001",
                                    "step_000001/../../../elsewhere/checkpoints/step_000001",
                                    "step_1", "link:/dev/zero", "link:step_000002"])
def test_latest_names_only_a_step_folder_of_the_run(tmp_path, latest):
    """`latest` names a step_NNNNNN folder of checkpoints/, no path, and is a plain file; the folder
    it names is no link. Each of these pointed --resume at a (valid) checkpoint of another run, or
    read /dev/zero."""
    cfg = spell.load_config(None, [f"--log.out_dir={tmp_path / 'run'}"])
    tiny_checkpoint(tmp_path / "run")
    elsewhere = tiny_checkpoint(tmp_path / "elsewhere")
    pointer = tmp_path / "run" / "checkpoints" / "latest"
    pointer.unlink()
    kind, _, target = latest.partition(":")
    if kind == "link" and target == "/dev/zero":
        pointer.symlink_to(target)
        message = f"{pointer}: cannot be read (a symbolic link, not a plain file)"
    elif kind == "link":  # a step folder that is a link to another run's checkpoint
        (pointer.parent / target).symlink_to(elsewhere)
        pointer.write_text(target)
        message = f"{pointer.parent / target}: a symbolic link, not a checkpoint folder of the run"
    else:
        pointer.write_text(latest.format(tmp=tmp_path))
        message = (f"{pointer}: names {infra.shown(latest.format(tmp=tmp_path))}, not a "
                   f"step_NNNNNN folder of {pointer.parent}")
    with deadline(10), pytest.raises(infra.CheckpointError) as e:
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert str(e.value) == message, e.value


def test_write_atomic_does_not_follow_a_planted_link(tmp_path):
    """A link planted where write_atomic puts its temporary file must not be written through:
    the temporary is made anew, and the link's target is left alone."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json.tmp").symlink_to(victim)
    infra.write_atomic(run / "config.json", "new")
    assert victim.read_text() == "precious"
    assert (run / "config.json").read_text() == "new" and not (run / "config.json").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_resume_refuses_a_run_whose_config_or_data_changed(tmp_path, monkeypatch):
    """meta.json holds the run's fingerprint: the keys that change what it samples or trains and
    its data's size and CRC-32. A changed corpus, group size or model must not resume silently:
    --resume names each key that differs, before anything starts. The keys of
    infra.RESUMABLE_KEYS, [log] and [eval] may change, and the corpus may move."""
    corpus, moved = tmp_path / "corpus.jsonl", tmp_path / "moved.jsonl"
    corpus.write_text(json.dumps(GOOD_CLUSTER) + "\n")
    shutil.copy(corpus, moved)
    out_dir = tmp_path / "run"
    demo, run = str(REPO / "presets" / "demo.toml"), f"--log.out_dir={out_dir}"
    config = lambda *extra: spell.load_config(  # noqa: E731
        demo, [run, f"--data.corpus={corpus}", *extra])
    step = tiny_checkpoint(out_dir, cfg=config())
    resume = lambda *extra: infra.resume_checkpoint(config(*extra), True, 0, 1)  # noqa: E731
    assert resume("--train.steps=5000", "--log.sample_every=0", "--eval.n=2",
                  "--engine.gpu_memory_utilization=0.3", "--engine.micro_batch_tokens=1024",
                  "--rollout.max_rounds=3", "--engine.logprob_impl=triton") == step
    # the remedy after a collective's timeout: wait longer for the slowest rank
    assert resume("--engine.collective_timeout_min=600") == step
    assert resume(f"--data.corpus={moved}") == step
    for extra, change in [
            (["--rollout.group_size=3"], "rollout.group_size (saved 4, now 3)"),
            (["--model.path=other/model"], "model.path (saved 'embedded', now 'other/model')"),
            (["--reward.format_penalty=-0.5"], "reward.format_penalty (saved -1.0, now -0.5)"),
            (["--train.seed=1", "--train.lr=0.5"],
             "train.lr (saved 1e-05, now 0.5); train.seed (saved 42, now 1)")]:
        with pytest.raises(infra.CheckpointError) as e:
            resume(*extra)
        assert str(e.value).startswith(f"{step}: saved by a run with another {change}. Resume "
                                       "with its values"), e.value
    saved = json.loads((step / "meta.json").read_text())["fingerprint"]["data.corpus"]
    corpus.write_text(json.dumps({**GOOD_CLUSTER, "id": "edited"}) + "\n")
    now = infra.data_fingerprint(str(corpus))
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(infra.CheckpointError, match=re.escape(
            f"another data.corpus (saved {saved!r}, now {now!r}). Resume")):
        spell.main(["--config", demo, run, f"--data.corpus={corpus}", "--resume"])


def test_checkpoint_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Every file and the folder reach the disk before the rename publishes them; the rename and the
    `latest` pointer reach it after: a power cut leaves the old or the new checkpoint, never a
    torn one."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync",
                        lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                    real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename",
                        lambda a, b: (events.append(("rename", str(a), str(b))),
                                      real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace",
                        lambda a, b: (events.append(("rename", str(a), str(b))),
                                      real_replace(a, b))[1])
    final = tiny_checkpoint(tmp_path / "run")
    tmp, latest = f"{final}.tmp", final.parent / "latest"
    i = events.index(("rename", tmp, str(final)))
    # paths whose data is on disk, followed through renames (meta.json.tmp -> meta.json)
    synced_before = set()
    for kind, path, *to in events[:i]:
        if kind == "fsync":
            synced_before.add(path)
        elif path in synced_before:
            synced_before.add(to[0])
    assert {f"{tmp}/{p.name}" for p in final.iterdir()} | {tmp} <= synced_before
    j = events.index(("rename", f"{latest}.tmp", str(latest)))
    assert ("fsync", f"{latest}.tmp") in events[i:j] and ("fsync", str(final.parent)) in events[i:j]
    assert ("fsync", str(final.parent)) in events[j:]


def checkpoint_names(out_dir: Path) -> list[str]:
    return sorted(p.name for p in (out_dir / "checkpoints").iterdir())


def test_pruning_keeps_exactly_n_checkpoints_and_resume_takes_the_newest(tmp_path):
    """log.keep_checkpoints = 2 over five saves: the two newest stay, `latest` names the newest and
    --resume continues from it. A folder being written (.tmp), a later step left by an earlier
    branch of the run and the HF export are never candidates; 0 keeps every checkpoint.
    Watched fail before pruning existed: five step folders."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}", "--log.keep_checkpoints=2"])
    (out_dir / "hf").mkdir(parents=True)
    (out_dir / "hf" / "config.json").write_text("{}")
    (out_dir / "checkpoints" / "step_000009.tmp").mkdir(parents=True)  # another save's, midway
    (out_dir / "checkpoints" / "step_000040").mkdir()  # a later step of an earlier branch
    for step in range(1, 6):
        tiny_checkpoint(out_dir, step, cfg)
        # the first save has no older one to delete; every later one keeps two
        kept = [f"step_{s:06d}" for s in range(max(1, step - 1), step + 1)]
        assert checkpoint_names(out_dir) == sorted(["latest", *kept, "step_000009.tmp",
                                                    "step_000040"])
    assert (out_dir / "checkpoints" / "latest").read_text() == "step_000005"
    assert (out_dir / "hf" / "config.json").read_text() == "{}"
    assert infra.resume_checkpoint(cfg, True, 0, 1) == out_dir / "checkpoints" / "step_000005"
    every = spell.load_config(None, [f"--log.out_dir={tmp_path / 'all'}",
                                     "--log.keep_checkpoints=0"])
    for step in range(1, 4):
        tiny_checkpoint(tmp_path / "all", step, every)
    assert checkpoint_names(tmp_path / "all") == ["latest", "step_000001", "step_000002",
                                                  "step_000003"]


class Killed(BaseException):
    """A kill: nothing of the run's code catches it (not an Exception), as nothing runs after a
    SIGKILL."""


@pytest.mark.parametrize("where", ["mid-write", "mid-prune"])
def test_a_kill_during_a_save_never_deletes_the_last_complete_checkpoint(tmp_path, monkeypatch,
                                                                         where):
    """log.keep_checkpoints = 1, the tightest: a kill while step 2 is written leaves step 1 whole
    and named by `latest`; a kill while step 1 is deleted (step 2 published) leaves step 2 whole
    and named. Either way --resume continues from a complete checkpoint. Watched fail with the
    pruning moved before save_atomically (the kill mid-write then finds step 1 gone)."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}", "--log.keep_checkpoints=1"])
    tiny_checkpoint(out_dir, 1, cfg)
    if where == "mid-write":  # the rank's own state is the last file a save writes
        real = torch.save

        def kill(obj, f, *args, **kwargs):
            if not isinstance(f, Path):  # DCP's own objects, into memory
                return real(obj, f, *args, **kwargs)
            f.write_bytes(b"torn")
            raise Killed
        monkeypatch.setattr(torch, "save", kill)
        survivor = "step_000001"
    else:
        real = shutil.rmtree

        def kill(path, *args, **kwargs):
            if Path(path).name == "step_000001":  # one file gone, then the kill
                (Path(path) / "meta.json").unlink()
                raise Killed
            return real(path, *args, **kwargs)
        monkeypatch.setattr(shutil, "rmtree", kill)
        survivor = "step_000002"
    with pytest.raises(Killed):
        tiny_checkpoint(out_dir, 2, cfg)
    monkeypatch.undo()
    assert (out_dir / "checkpoints" / "latest").read_text() == survivor
    assert infra.check_checkpoint(out_dir / "checkpoints" / survivor, world=1)["step"] == \
        int(survivor[5:])
    assert infra.resume_checkpoint(cfg, True, 0, 1) == out_dir / "checkpoints" / survivor
    # the next save cleans up: step 2 (again, or anew), then only it
    tiny_checkpoint(out_dir, 2, cfg)
    assert checkpoint_names(out_dir) == ["latest", "step_000002"]


def test_trim_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # torn by a crash
    path.write_text('{"step": 1, "x": 0.5}\n{"step": 2}\n\n{"step": 3}\n{"step": 4, "x":')
    assert infra.trim_metrics(path, 2) == 2
    assert path.read_text() == '{"step": 1, "x": 0.5}\n{"step": 2}\n'
    assert infra.trim_metrics(path, 2) == 0 and infra.trim_metrics(tmp_path / "none.jsonl", 2) == 0
    # no temporary left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    # a step that is no whole number is no step of ours (JSON's true is Python's 1)
    path.write_text('{"step": 1}\n{"step": true}\n{"step": 1.5}\n{"step": "1"}\n')
    assert infra.trim_metrics(path, 2) == 3 and path.read_text() == '{"step": 1}\n'


def test_a_metrics_line_nested_past_the_recursion_limit_is_dropped_on_resume(tmp_path):
    """--resume drops the metrics lines it cannot read as a step (torn, not ours): one nested
    deeper than Python's recursion limit raised RecursionError, a traceback, instead."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"step": 2}\n[1]\n')
    assert infra.trim_metrics(path, 1) == 3 and path.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("edit, reseal, message", [
    # a number too large for a float reads as inf, which int() refuses with an OverflowError
    (('"world": 1', '"world": 1e999'), False, "not a complete checkpoint (meta.json: cannot "
     "convert float infinity to integer)"),
    (('"step": 1', '"step": -1e999'), False, "not a complete checkpoint (meta.json: cannot "
     "convert float infinity to integer)"),
    # a config that is not the table of sections a run saves (its checksum made anew)
    ({"config": ["a", "list"]}, True, "meta.json's config is ['a', 'list'], not the table of "
     "sections a run saves"),
    ({"config": {"engine": [1]}}, True, "meta.json's config is {'engine': [1]}, not the table of "
     "sections a run saves"),
])
def test_meta_json_values_no_run_writes_stop_the_resume_in_one_line(tmp_path, edit, reseal,
                                                                   message):
    """meta.json's numbers and config as no run writes them: before, an OverflowError or an
    AttributeError traceback; now one CheckpointError line, the run's files untouched."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    step = tiny_checkpoint(out_dir, cfg=copy.deepcopy(cfg))
    if reseal:
        edit_meta(step, True, **edit)
    else:
        text = (step / "meta.json").read_text()
        assert text.count(edit[0]) == 1
        (step / "meta.json").write_text(text.replace(*edit))
    before = snapshot(out_dir)
    with pytest.raises(infra.CheckpointError) as e:
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert str(e.value) == f"{step}: {message}", e.value
    assert snapshot(out_dir) == before


def test_resume_on_a_full_disk_keeps_metrics_and_leaves_no_temporary(tmp_path, monkeypatch):
    """--resume rewrites metrics.jsonl without the lines after its checkpoint; on a full disk that
    write fails (here the temporary's fsync says ENOSPC, as a nearly full disk does): one line
    naming the file and the disk, metrics.jsonl as it was, and no metrics.jsonl.tmp left."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    out_dir.mkdir()
    metrics_file = out_dir / "metrics.jsonl"
    metrics_file.write_text('{"step": 1}\n{"step": 2}\n')

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(infra.CheckpointError) as e:
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert re.fullmatch(
        re.escape(f"{metrics_file}: cannot drop the 2 line(s) logged after step 0 (No space left "
                  "on device; ") + r"[0-9.]+ [KMGT]?i?B free on the disk mounted at /.*"
        + re.escape("); the file is left as it was"), str(e.value)), e.value
    assert metrics_file.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert not (out_dir / "metrics.jsonl.tmp").exists()


def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path, capsys):
    """A run that logged step 2 and died before saving it resumes at step 1 and logs step 2 again:
    the old step-2 line goes first, so metrics.jsonl never holds a step twice."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    # no checkpoint: a fresh start
    assert infra.resume_checkpoint(cfg, resume=True, rank=0, world=1) is None
    assert (out_dir / "metrics.jsonl").read_text() == ""
    step = tiny_checkpoint(out_dir)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert infra.resume_checkpoint(cfg, resume=True, rank=0, world=1) == step
    assert (out_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert "dropped 1 line(s) of metrics.jsonl logged after step 1" in capsys.readouterr().out


def test_step_folders_without_latest_are_refused_and_the_metrics_kept(tmp_path):
    """`latest` is written last: a run whose pointer is gone (a crash just before it, a stray rm)
    still holds its checkpoints. --resume used to start over and drop every metrics line; now it
    names the newest folder and changes nothing."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    for step in (1, 2):
        tiny_checkpoint(out_dir, step=step)
    pointer = out_dir / "checkpoints" / "latest"
    pointer.unlink()
    (out_dir / "checkpoints" / "step_000003.tmp").mkdir()  # a save cut short: not a checkpoint
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = snapshot(out_dir)
    with pytest.raises(infra.CheckpointError) as e:
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert str(e.value) == (f"{pointer}: missing, though {pointer.parent} holds 2 step folder(s), "
                            f"the newest step_000002; write the one to continue into it (echo "
                            f"step_000002 > {pointer}), or start a new run in another "
                            "log.out_dir"), e.value
    assert snapshot(out_dir) == before
    pointer.write_text("step_000002")  # as the message says
    assert (infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
            == pointer.parent / "step_000002")


@pytest.mark.parametrize("kind", ["FIFO", "folder", "link"])
@pytest.mark.parametrize("resume", [True, False])
def test_metrics_file_that_is_not_a_plain_file_is_refused(tmp_path, kind, resume):
    """metrics.jsonl is where every step's line goes: a FIFO hung --resume (the trim reads it for
    ever), a folder raised IsADirectoryError, a link to /dev/null swallowed every step. Refused
    with one line, before anything starts, with or without --resume."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    tiny_checkpoint(out_dir)
    path = out_dir / "metrics.jsonl"
    {"FIFO": os.mkfifo, "folder": os.mkdir, "link": lambda p: p.symlink_to("/dev/null")}[kind](path)
    before = snapshot(out_dir)
    name = {"FIFO": "a FIFO", "folder": "a folder", "link": "a symbolic link"}[kind]
    with deadline(10), pytest.raises(infra.ConfigError) as e:
        infra.resume_checkpoint(cfg, resume=resume, rank=0, world=1)
    assert str(e.value) == (f"{path}: {name}, not a plain file; the run appends its metrics there "
                            "(move it away, or choose another log.out_dir)"), e.value
    assert snapshot(out_dir) == before and os.path.lexists(path)


def edit_meta(folder: Path, reseal: bool, **changes) -> None:
    """Change keys of a checkpoint's meta.json by hand; `reseal` also makes its own checksum anew,
    as a forger would."""
    meta = {**json.loads((folder / "meta.json").read_text()), **changes}
    (folder / "meta.json").write_text(json.dumps(infra.sealed_meta(meta) if reseal else meta))


@pytest.mark.parametrize("changes", [{"step": 2}, {"step": -3}, {"fingerprint": {}},
                                     {"world": 1, "step": 1}])
def test_edited_meta_json_is_refused(tmp_path, changes):
    """meta.json records its own CRC-32 (infra.meta_checksum): a step moved forward (resume trims
    the metrics after it) or negative (every line dropped), an emptied fingerprint (every config
    would resume), any edit at all is refused, metrics untouched. The same values with the checksum
    made anew meet the step and fingerprint checks; the last case (the saved values) changes
    nothing and resumes."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    step = tiny_checkpoint(out_dir, cfg=copy.deepcopy(cfg))
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    edit_meta(step, False, **changes)
    edited = changes != {"world": 1, "step": 1}
    if not edited:  # the same values: json.dumps wrote the same text
        assert infra.resume_checkpoint(cfg, resume=True, rank=0, world=1) == step
        return
    before = snapshot(out_dir)
    with pytest.raises(infra.CheckpointError, match=re.escape(
            f"{step}: meta.json was changed after it was saved (CRC-32 ")):
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    edit_meta(step, True)  # the forger's checksum
    message = (f"meta.json says step {changes['step']}, not the step of its folder's name"
               if "step" in changes else "meta.json records no run fingerprint")
    with pytest.raises(infra.CheckpointError, match=re.escape(f"{step}: {message}")):
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert snapshot(out_dir) == {**before, "checkpoints/step_000001/meta.json":
                                 (step / "meta.json").read_bytes()}


class RunsCode:
    """Unpickling this runs a shell command: what a planted checkpoint file could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def reseal_files(step: Path) -> None:
    """meta.json's records of every file made anew (sizes, CRC-32 and its own checksum): a planted
    file the size and checksum checks cannot tell from the run's own."""
    files = {k: v for k, v in infra.seal_files(step, 0).items() if k != "meta.json"}
    set_files(step, **files)


@pytest.mark.parametrize("where", [".metadata", "entry"])
def test_planted_pickle_in_a_checkpoint_is_refused_without_running(tmp_path, where):
    """torch.distributed.checkpoint unpickles .metadata and its non-tensor entries with plain
    pickle. With meta.json's records forged to match, the checksums cannot help: what stops the
    code is infra.checkpoint_reader, which admits DCP's own records and plain values only. Before
    it, both plants ran their command (measured: the marker file appeared)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    marker = tmp_path / "the_plant_ran"
    step = tiny_checkpoint(tmp_path / "run")
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    if where == ".metadata":
        (step / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
        message = (".metadata cannot be read safely (names 'posix.system', which no DCP "
                   "checkpoint holds)")
    else:  # the optimiser's learning rate, a non-tensor entry of a .distcp file
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
        state = get_optimizer_state_dict(model, optimizer)
        state["param_groups"][0]["lr"] = RunsCode(marker)
        for p in [*step.glob("*.distcp"), step / ".metadata"]:
            p.unlink()
        with warnings.catch_warnings():  # no process group: DCP says it saves as one process
            warnings.simplefilter("ignore")
            dcp.save({"model": get_model_state_dict(model), "optim": state},
                     checkpoint_id=str(step))
        message = ("cannot be read (_pickle.UnpicklingError: the entry optim.param_groups.0.lr "
                   "cannot be read safely (Trying to load unsupported GLOBAL posix.system")
    reseal_files(step)
    infra.check_checkpoint(step, world=1)  # every record matches: only the reader can refuse
    with pytest.raises(infra.CheckpointError, match=re.escape(f"{step}: {message}")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = torch.nn.Linear(64, 32)
            spell.load_checkpoint(step, fresh, torch.optim.AdamW(fresh.parameters()), 0, 1)
    assert not marker.exists()


def test_rank_state_of_another_step_is_refused(tmp_path):
    """A rank's own state (sampler, history, generators) must be the step meta.json names: a
    rank0.pt copied from another checkpoint would continue another step's walk."""
    step = tiny_checkpoint(tmp_path / "run")
    torch.save({"step": 5}, step / "rank0.pt")
    reseal_files(step)
    model = torch.nn.Linear(64, 32)
    with pytest.raises(infra.CheckpointError,
                       match=re.escape(f"{step}: rank0.pt holds step 5, meta.json 1")):
        spell.load_checkpoint(step, model, torch.optim.AdamW(model.parameters()), 0, 1)
    torch.save({"step": 1}, step / "rank0.pt")
    reseal_files(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert spell.load_checkpoint(step, model, torch.optim.AdamW(model.parameters()), 0, 1) \
            == {"step": 1}


@pytest.mark.parametrize("where", ["through a file", "5000 characters", "/proc"])
def test_out_dir_that_cannot_take_files_is_refused_at_launch(tmp_path, monkeypatch, where):
    """log.out_dir is tried at launch (infra.check_out_dir: a probe file written and removed),
    before the process group, vLLM or the model: each of these used to fail at the first write,
    after them. (The tests run as root, whom a folder's permission bits do not stop.)"""
    blocker = tmp_path / "a file"
    blocker.write_text("keep me")
    out_dir = {"through a file": blocker / "run", "5000 characters": tmp_path / ("x" * 5000),
               "/proc": Path("/proc/spell-run")}[where]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(GOOD_CLUSTER) + "\n")
    before = snapshot(tmp_path)
    monkeypatch.setattr(spell, "init_distributed", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(infra.ConfigError) as e:
        spell.main(["--config", str(REPO / "presets" / "demo.toml"), f"--data.corpus={corpus}",
                    f"--log.out_dir={out_dir}"])
    reason = {"through a file": "Not a directory", "5000 characters": "File name too long",
              "/proc": "No such file or directory"}[where]
    assert str(e.value) == f"log.out_dir {infra.shown(str(out_dir))}: cannot write there ({reason})"
    assert snapshot(tmp_path) == before


def test_out_dir_probe_leaves_nothing_behind(tmp_path):
    """A writable log.out_dir: created if missing, and the probe file gone again."""
    infra.check_out_dir(tmp_path / "new" / "run", rank=3)
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["run"]
    assert list((tmp_path / "new" / "run").iterdir()) == []


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    cfg = spell.load_config(None, [f"--log.out_dir={tmp_path / 'run'}"])
    (tmp_path / "run").write_text("not a folder")
    # without the check, the run would fail at mkdir after the model loads
    for resume in (False, True):
        with pytest.raises(infra.ConfigError, match="is a file, not a folder"):
            infra.resume_checkpoint(cfg, resume=resume, rank=0, world=1)


class Started(Exception):
    """Raised where the process group would start: every launch check has passed."""


def launch(tmp_path: Path, monkeypatch, *args: str, clusters: int = 1) -> None:
    """spell.main on the demo preset with a corpus of `clusters` clusters and log.out_dir
    tmp_path/run, stopped by Started where the process group would start."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({**GOOD_CLUSTER, "id": f"c{i}"}) + "\n"
                              for i in range(clusters)))

    def started(cfg):
        raise Started

    monkeypatch.setattr(spell, "init_distributed", started)
    spell.main(["--config", str(REPO / "presets" / "demo.toml"), f"--data.corpus={corpus}",
                f"--log.out_dir={tmp_path / 'run'}", *args])


def model_folder(tmp_path: Path, **config) -> Path:
    """A model folder holding a config.json (a Llama of 8,192 positions), a tokenizer and an empty
    weights file: what the launch checks read."""
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    LlamaConfig(max_position_embeddings=8192, **config).save_pretrained(folder)
    return add_model_files(folder)


def test_a_kv_cache_beyond_host_memory_stops_before_anything_starts(tmp_path, monkeypatch):
    """On CPU every rank's vLLM takes engine.kv_cache_gb GiB of host memory once its model has
    loaded; past the machine's memory, vLLM stopped in a ValueError traceback after the process
    group and the model had started. Now one line at launch, for the ranks on this machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    have = infra.host_memory_gib()
    gb = int(have // 2) + 1  # two ranks of it are beyond this machine, one is not
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(infra.ConfigError) as e:
        launch(tmp_path, monkeypatch, f"--engine.kv_cache_gb={gb}", clusters=2)
    assert str(e.value) == (f"engine.kv_cache_gb = {gb} GiB of KV cache a rank, {2 * gb} GiB for "
                            f"the 2 rank(s) on this machine, beyond its {have:.1f} GiB of memory; "
                            "lower engine.kv_cache_gb")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(Started):
        launch(tmp_path, monkeypatch, f"--engine.kv_cache_gb={gb}", clusters=2)


# a live run's rank 0, as far as the lock goes: an exclusive flock on <out_dir>/.lock, its holder
# written in it, held until the process ends
LIVE_RUN = ("import fcntl, os, socket, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")


def live_run(out_dir: Path) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(out_dir / ".lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_run_in_a_live_runs_out_dir_stops_and_a_killed_one_leaves_no_lock(
        tmp_path, monkeypatch):
    """Two runs in one log.out_dir race on the checkpoint's temporary folder: the second stops at
    launch, naming the key and the holder, before it writes anything. The lock dies with its
    process: once the first run is killed (SIGKILL, no clean-up), the next launch goes on."""
    import socket

    out_dir = tmp_path / "run"
    first = live_run(out_dir)
    try:
        before = snapshot(out_dir)
        for resume in ([], ["--resume"]):
            with pytest.raises(infra.ConfigError) as e:
                launch(tmp_path, monkeypatch, *resume)
            assert str(e.value) == (
                f"log.out_dir {infra.shown(str(out_dir))}: another run holds it (pid {first.pid} "
                f"on {socket.gethostname()}, lock file {out_dir / '.lock'}); wait for it to end, "
                "or choose another log.out_dir"), e.value
        assert snapshot(out_dir) == before
    finally:
        first.kill()
        first.wait()
    with pytest.raises(Started):
        launch(tmp_path, monkeypatch)
    assert (out_dir / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    infra.hold_out_dir(out_dir)  # this process holds it already: a second launch in it goes on


def test_an_out_dir_removed_and_made_anew_is_locked_anew(tmp_path):
    """A process that holds a folder's lock and then sees the folder removed and made again (a
    scratch folder, preflight's) locks the new one: its old lock is on a file no path reaches."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    infra.hold_out_dir(out_dir)
    shutil.rmtree(out_dir)
    out_dir.mkdir()
    infra.hold_out_dir(out_dir)
    other = subprocess.run([sys.executable, "-c", LIVE_RUN, str(out_dir / ".lock")], check=False,
                           capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and "BlockingIOError" in other.stderr


def test_a_file_system_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    """Some NFS and Lustre mounts refuse flock (ENOLCK, EOPNOTSUPP): a run there is not stopped
    for it, but told in one line that nothing guards its folder."""
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    infra.hold_out_dir(tmp_path)
    assert capsys.readouterr().out == (
        f"log.out_dir {tmp_path}: not locked, its file system takes no lock (No locks available); "
        "nothing stops a second run from writing there at the same time\n")


def test_only_rank_0_takes_the_out_dir_lock(tmp_path):
    """The lock is one run's, not one rank's: rank 0 takes it; the other ranks of a run (on this
    node or another that shares the folder) never try, or they would lock each other out."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    first = live_run(out_dir)
    try:
        assert infra.resume_checkpoint(cfg, resume=False, rank=1, world=2) is None
        with pytest.raises(infra.ConfigError, match="another run holds it"):
            infra.resume_checkpoint(cfg, resume=False, rank=0, world=2)
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("what, error", [("checkpoints", errno.EROFS),
                                         ("metrics.jsonl", errno.EPERM)])
def test_read_only_checkpoints_or_metrics_in_a_writable_out_dir_stop_the_resume(
        tmp_path, monkeypatch, what, error):
    """--resume writes into checkpoints/ (every rank its shard) and appends to metrics.jsonl: a
    read-only one of them (a read-only mount, an immutable file) inside a writable out_dir used to
    pass the launch and fail at the first save or step with a traceback. The tests run as root,
    whom permission bits do not stop, so os.open answers for the disk."""
    out_dir = tmp_path / "run"
    cfg = spell.load_config(None, [f"--log.out_dir={out_dir}"])
    tiny_checkpoint(out_dir)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(out_dir)
    refused, real_open = out_dir / what, os.open

    def read_only_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR) and str(path).startswith(str(refused)):
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    with pytest.raises(infra.ConfigError) as e:
        infra.resume_checkpoint(cfg, resume=True, rank=0, world=1)
    assert str(e.value) == {
        "checkpoints": f"log.out_dir's checkpoints folder {infra.shown(str(refused))}: cannot "
                       "write there (Read-only file system)",
        "metrics.jsonl": f"{refused}: cannot be appended to (Operation not permitted); the run "
                         "adds a line per step there (make it writable, or choose another "
                         "log.out_dir)"}[what], e.value
    assert snapshot(out_dir) == before


@pytest.mark.parametrize("heads, kv, refused", [
    (6, 2, "engine.sequence_parallel = 4 must divide the model's 6 query heads"),
    (8, 3, "engine.sequence_parallel = 4 must divide, or be a multiple of, the model's 3 KV heads"),
    (8, 2, None)])
def test_sequence_parallel_that_does_not_split_the_heads_stops_before_anything_starts(
        tmp_path, monkeypatch, heads, kv, refused):
    """engine.sequence_parallel against the model's heads, read from its config.json when the
    folder is on this machine: before, enable_sequence_parallel refused it only after vLLM and the
    model had loaded."""
    model = model_folder(tmp_path, num_attention_heads=heads, num_key_value_heads=kv,
                         hidden_size=64 * heads)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    args = (f"--model.path={model}", "--engine.sequence_parallel=4")
    if refused is None:
        with pytest.raises(Started):
            launch(tmp_path, monkeypatch, *args, clusters=4)
        return
    with pytest.raises(infra.ConfigError) as e:
        launch(tmp_path, monkeypatch, *args, clusters=4)
    assert str(e.value) == refused
    assert not (tmp_path / "run").exists()


def test_the_model_keys_are_checked_before_vllm_when_the_folder_was_not_here_at_launch(
        tmp_path, monkeypatch):
    """A hub name (or the embedded model before its first export) has no folder here at launch:
    its heads and vocabulary are checked once start_engine has resolved it, before the tokenizer
    and vLLM load (the folder here holds a config.json only; the tokenizer is a stand-in)."""
    import transformers

    model = model_folder(tmp_path, num_attention_heads=6, num_key_value_heads=2, hidden_size=384)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    cfg = spell.load_config([str(REPO / "presets" / "demo.toml")],
                            ["--model.path=some-org/some-model", "--engine.sequence_parallel=4"])
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # start_engine sets it on CPU
    monkeypatch.setattr(infra, "resolve_model", lambda cfg, rank: str(model))
    monkeypatch.setattr(spell, "start_vllm", lambda *args, **kwargs: pytest.fail("vLLM started"))
    with pytest.raises(infra.ConfigError, match="^engine.sequence_parallel = 4 must divide the "
                                                "model's 6 query heads$"):
        spell.start_engine(cfg, 0, 4, torch.device("cpu"), 0, training=True)


def test_aepo_high_beyond_the_models_largest_entropy_stops_before_anything_starts(
        tmp_path, monkeypatch):
    """train.aepo's high against ln V of the model's own vocabulary (config.json, V = 1000 here,
    ln V = 6.91): a batch entropy never exceeds it, so a high at or above it never masks."""
    model = model_folder(tmp_path, vocab_size=1000)
    with pytest.raises(infra.ConfigError) as e:
        launch(tmp_path, monkeypatch, f"--model.path={model}", "--train.aepo=0.1,7")
    assert str(e.value) == (
        f"train.aepo = [0.1, 7]: high must be below 6.91 nats, ln V of the model {model} "
        "(V = 1000 logits, its config.json): no batch entropy exceeds it, so masking would "
        "never start"), e.value
    assert not (tmp_path / "run").exists()
    with pytest.raises(Started):
        launch(tmp_path, monkeypatch, f"--model.path={model}", "--train.aepo=0.1,6.9")


@pytest.mark.parametrize("where, message", [
    ("missing", "no such folder, nor a model hub name (owner/name)"),
    ("empty", "a folder without config.json, not an HF model folder"),
    ("file", "a file, not an HF model folder")])
def test_a_model_path_that_holds_no_model_stops_before_anything_starts(
        tmp_path, monkeypatch, where, message):
    """model.path that names no model: one line naming the key and the path, before the process
    group (transformers' own traceback named neither). A hub name (owner/name) goes on to the
    hub."""
    path = {"missing": tmp_path / "no" / "model", "empty": tmp_path / "empty",
            "file": tmp_path / "weights.bin"}[where]
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(infra.ConfigError) as e:
        launch(tmp_path, monkeypatch, f"--model.path={path}")
    assert str(e.value) == f"model.path {infra.shown(str(path))}: {message}"
    assert not (tmp_path / "run").exists()
    with pytest.raises(Started):
        launch(tmp_path, monkeypatch, "--model.path=some-org/some-model")


def test_a_hub_name_the_hub_does_not_have_names_the_key(monkeypatch):
    """model.path as a hub name that neither the hub nor its cache (offline) holds: the first read
    of its config.json stops with one line naming the key, not transformers' traceback. Offline, as
    HF_HUB_OFFLINE=1 makes it (.ci/run sets it): where the hub is unreachable, asking waits 24 s."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(infra.ConfigError, match=r"^model\.path 'spell-tests/no-such-model': cannot "
                                                r"read its config\.json \(.+\)$"):
        infra.model_config("spell-tests/no-such-model", "")


# ------------------------------------------------------------------------------------------------
# Logging: the step line, metrics.jsonl, TensorBoard
# ------------------------------------------------------------------------------------------------

def test_run_log_writes_the_step_line_metrics_and_tensorboard(tmp_path, capsys):
    """RunLog.write on rank 0: the console line, one metrics.jsonl row per step, and with
    log.tensorboard every metric as a scalar that TensorBoard's own reader reads back per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = spell.Config()
    cfg.log.out_dir, cfg.log.sample_every = str(tmp_path), 0
    quiet = infra.RunLog(cfg, ["config.toml"], 1, 2, torch.device("cpu"))  # rank 1 writes nothing
    quiet.write(1, logged_metrics(1), "step 1")
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
    cfg.log.tensorboard = True
    log = infra.RunLog(cfg, ["config.toml"], 0, 2, torch.device("cpu"))
    # with the held-out verifier check's ver/gold_* (log.verify_every), as a step that ran it
    logged = [{**logged_metrics(step), **held_out_metrics()} for step in (1, 2)]
    for step, row in zip((1, 2), logged):
        log.write(step, {k: v for k, v in row.items() if k != "step"}, f"step {step}")
    log.board.close()
    out = capsys.readouterr().out
    assert "spell: 2 rank(s) on cpu; config config.toml" in out and out.count("\nstep ") == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == logged and "ver/gold_yes_on_wrong" in rows[0]
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert set(events.Tags()["scalars"]) == set(rows[0]) - {"step"}
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02))]  # float32: rel 1e-6 default


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (<run>/run-<id>.wandb): after a 7-byte header,
    LevelDB's log format (32 KiB blocks; a record is a 4-byte checksum, a 2-byte length, a type:
    1 whole, 2 first, 3 middle, 4 last part) around W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, rows, pos, parts = run_file.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        if (pos % 32768) + 7 > 32768:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding at a block's end
            pos += 32768 - pos % 32768
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(parts)
            parts = b""
            if record.HasField("history"):
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


def test_run_log_writes_every_metric_to_wandb_offline(tmp_path, monkeypatch):
    """log.wandb: every metric of every step reaches the W&B run (offline mode: no network, the
    run's records in <out_dir>/wandb), with the whole config; --resume continues the same run
    (its id kept in <out_dir>/wandb/run_id)."""
    pytest.importorskip("wandb", reason="log.wandb needs the wandb package (requirements-cpu.txt)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # W&B's console capture wraps sys.stdout, which pytest swaps between tests: off here
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    cfg = spell.Config()
    cfg.log.out_dir, cfg.log.sample_every, cfg.log.wandb = str(tmp_path / "demo"), 0, True
    Path(cfg.log.out_dir).mkdir()
    infra.RunLog(cfg, ["config.toml"], 1, 2, torch.device("cpu")).close()  # rank 1: no run
    assert not (tmp_path / "demo" / "wandb").exists()
    log = infra.RunLog(cfg, ["config.toml"], 0, 2, torch.device("cpu"))
    assert log.wandb.config["train"]["lr"] == cfg.train.lr and log.wandb.name == "demo"
    run_id = log.wandb.id
    logged = [logged_metrics(step) for step in (1, 2)]
    for step, row in zip((1, 2), logged):
        log.write(step, {k: v for k, v in row.items() if k != "step"}, f"step {step}")
    log.close()
    run_files = list((tmp_path / "demo" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files
    history = wandb_history(run_files[0])
    rows = [r for r in history if "train/loss" in r]
    assert [r["_step"] for r in rows] == [1, 2], history
    for row, want in zip(rows, logged):
        assert {k: row[k] for k in want if k != "step"} == {k: v for k, v in want.items()
                                                          if k != "step"}
    resumed = infra.RunLog(cfg, ["config.toml"], 0, 2, torch.device("cpu"))
    assert resumed.wandb.id == run_id
    resumed.close()


@pytest.mark.parametrize("stored, message", [
    (None, "log.wandb: W&B did not start the run (No API key configured. Use `wandb login` to log "
           "in.); `wandb login`, or WANDB_MODE=offline to keep it on disk, or log.wandb = false"),
    ("a/b\n", "log.wandb: {id_file} holds 'a/b', not a W&B run id (the id this run's first start "
               "kept; remove the file to start a new W&B run)"),
    ("\n", "log.wandb: {id_file} holds '', not a W&B run id"),
])
def test_wandb_that_cannot_start_its_run_stops_in_one_line(tmp_path, monkeypatch, stored,
                                                           message):
    """log.wandb without a login (online, no API key) or with a stored run id W&B refuses: before,
    wandb's UsageError traceback; now one line naming the key (and the file), what is wrong and
    how to go on. Nothing is written to the run's files."""
    pytest.importorskip("wandb", reason="log.wandb needs the wandb package (requirements-cpu.txt)")
    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no stored login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    if stored is not None:
        monkeypatch.setenv("WANDB_MODE", "offline")  # the id is refused before W&B sees it
    cfg = spell.Config()
    cfg.log.out_dir, cfg.log.wandb = str(tmp_path / "run"), True
    id_file = tmp_path / "run" / "wandb" / "run_id"
    id_file.parent.mkdir(parents=True)
    if stored is not None:
        id_file.write_text(stored)
    before = snapshot(tmp_path / "run")
    with deadline(60), pytest.raises(infra.ConfigError) as e:
        infra.RunLog(cfg, ["config.toml"], 0, 1, torch.device("cpu"))
    assert str(e.value).startswith(message.format(id_file=id_file)), e.value
    assert snapshot(tmp_path / "run") == before


# ------------------------------------------------------------------------------------------------
# Ulysses sequence parallelism: the pure pieces on worked cases, then 2 gloo ranks against one
# ------------------------------------------------------------------------------------------------

def test_shard_row_pads_and_keeps_global_positions():
    """Two sequences, 5 + 4 = 9 tokens, on k = 2: padded to 10, 5 tokens a rank, positions
    global, the padding in a group of its own."""
    packed = spell.pack_sequences([([1, 2], [3, 4, 5]), ([6], [7, 8, 9])])
    # row  0 1 2 3 4 | 5 6 7 8 (9 = padding); index 1 2 3 | 5 6 7 predict 3 4 5 | 7 8 9
    assert packed["index"].tolist() == [1, 2, 3, 5, 6, 7]
    first, second = (infra.shard_row(packed, 2, r) for r in (0, 1))
    assert first["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert second["input_ids"].tolist() == [[6, 7, 8, 9, 0]]
    assert first["position_ids"].tolist() == [[0, 1, 2, 3, 4]]
    assert second["position_ids"].tolist() == [[0, 1, 2, 3, 0]]  # global; the pad's is unused
    assert first["group_ids"].tolist() == second["group_ids"].tolist() == [0] * 5 + [1] * 4 + [-1]
    assert first["segment_ids"].tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1, 0]
    assert first["which"].tolist() == [0, 1, 2] and first["index"].tolist() == [1, 2, 3]
    assert second["which"].tolist() == [3, 4, 5] and second["index"].tolist() == [0, 1, 2]
    assert first["targets"].tolist() == [3, 4, 5] and second["targets"].tolist() == [7, 8, 9]


def test_boundary_target_stays_with_the_rank_that_predicts_it():
    """Shift before you split: a target whose predicting position is a shard's last token is
    computed on that rank, at that position; a shared prompt's last position predicts every answer's
    first token on one rank."""
    # one sequence of 3 + 5 tokens on k = 2: row 0..7, shards 0-3 | 4-7; position 3 predicts
    # target 14 (row position 4, the first token of rank 1's shard)
    packed = spell.pack_sequences([([10, 11, 12], [13, 14, 15, 16, 17])])
    assert packed["index"].tolist() == [2, 3, 4, 5, 6]
    first, second = (infra.shard_row(packed, 2, r) for r in (0, 1))
    assert first["which"].tolist() == [0, 1] and first["index"].tolist() == [2, 3]
    assert first["targets"].tolist() == [13, 14]
    assert second["which"].tolist() == [2, 3, 4] and second["index"].tolist() == [0, 1, 2]
    # shared prompt [5, 6] with answers [7, 8], [9], [4]: row 5 6 7 8 9 4, k = 3; position 1
    # predicts 7, 9 and 4, all on rank 0
    packed = spell.pack_sequences([([5, 6], [7, 8]), ([5, 6], [9]), ([5, 6], [4])], shared=True)
    assert packed["index"].tolist() == [1, 2, 1, 1]
    shards = [infra.shard_row(packed, 3, r) for r in range(3)]
    assert [s["which"].tolist() for s in shards] == [[0, 2, 3], [1], []]
    assert [s["index"].tolist() for s in shards] == [[1, 1, 1], [0], []]
    # every target once over the group, whatever k
    for k in (1, 2, 3, 4, 7):
        which = torch.cat([infra.shard_row(packed, k, r)["which"] for r in range(k)])
        assert sorted(which.tolist()) == list(range(4)), k


def test_row_shorter_than_the_group_and_the_padding_mask():
    """3 tokens on k = 4: one token a rank, the last rank only padding; in the full-row mask padding
    sees only padding (itself: no empty softmax row) and no real token sees padding."""
    packed = spell.pack_sequences([([1], [2, 3])])
    shards = [infra.shard_row(packed, 4, r) for r in range(4)]
    assert [s["input_ids"].tolist() for s in shards] == [[[1]], [[2]], [[3]], [[0]]]
    assert [s["which"].tolist() for s in shards] == [[0], [1], [], []]
    cpu = torch.device("cpu")
    mask = infra.full_row_mask(shards[0], "sdpa", cpu, torch.float32)[0, 0]  # (4, 4)
    visible = (mask == 0).int().tolist()
    assert visible == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    # two pads: causal among themselves, still apart from the row
    shards = [infra.shard_row(spell.pack_sequences([([1], [2])]), 4, r) for r in range(4)]
    mask = infra.full_row_mask(shards[0], "sdpa", torch.device("cpu"), torch.float32)[0, 0]
    assert (mask == 0).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_plain_row_mask_is_causal_within_each_sequence():
    """The full-row mask of a plain packed row (never shared) is block-diagonal causal: the rule
    HF derives from restarting position_ids, which SP cannot use on local shapes."""
    packed = spell.pack_sequences([([1, 2], [3]), ([4], [5, 6])])
    mask = infra.full_row_mask(infra.shard_row(packed, 1, 0), "sdpa", torch.device("cpu"),
                               torch.float32)
    starts = torch.tensor([0, 0, 0, 3, 3, 3])
    rows = torch.arange(6)
    want = (rows[None] <= rows[:, None]) & (rows[None] >= starts[:, None])
    assert torch.equal(mask[0, 0] == 0, want)


@pytest.mark.parametrize("num_q, num_kv, k, expected", [
    # Qwen2.5-7B: 28 query heads, 4 KV heads, on k = 4: one KV head a rank, its 7 query heads
    (28, 4, 4, [(list(range(7 * r, 7 * r + 7)), [r]) for r in range(4)]),
    # ... and on k = 2: two KV heads a rank (no replication)
    (28, 4, 2, [(list(range(14)), [0, 1]), (list(range(14, 28)), [2, 3])]),
    # 4 query heads, 1 KV head, k = 4: the KV head on every rank
    (4, 1, 4, [([r], [0]) for r in range(4)]),
    # 8 query heads, 2 KV heads, k = 4: KV head 0 on ranks 0 and 1, KV head 1 on ranks 2 and 3
    (8, 2, 4, [([0, 1], [0]), ([2, 3], [0]), ([4, 5], [1]), ([6, 7], [1])]),
])
def test_kv_heads_follow_their_query_heads(num_q, num_kv, k, expected):
    """GQA: query head h reads KV head h // (Hq/Hkv). Each rank's query heads (a contiguous block
    of Hq/k, as the all-to-all deals them) read exactly the KV heads that replicate_kv and the
    same all-to-all put on that rank."""
    per_group = num_q // num_kv
    kv_index = torch.arange(num_kv, dtype=torch.float32).view(1, num_kv, 1, 1)  # (1, Hkv, S, D)
    dealt = infra.replicate_kv(kv_index, k)[0, :, 0, 0].view(k, -1)  # (k, Hk/k): rank j's KV heads
    for r, (q_heads, kv_heads) in enumerate(expected):
        assert infra.rank_heads(num_q, num_kv, k, r) == (q_heads, kv_heads)
        assert dealt[r].long().tolist() == kv_heads
        assert sorted({h // per_group for h in q_heads}) == kv_heads


@pytest.mark.parametrize("num_q, num_kv, k, message", [
    (28, 4, 3, "must divide the model's 28 query heads"),
    (12, 4, 6, "must divide, or be a multiple of, the model's 4 KV heads"),
    (24, 6, 4, "must divide, or be a multiple of, the model's 6 KV heads")])
def test_head_counts_that_cannot_be_split_stop_with_a_clear_error(num_q, num_kv, k, message):
    with pytest.raises(infra.ConfigError, match=rf"engine.sequence_parallel = {k} {message}"):
        infra.check_heads(num_q, num_kv, k)
    infra.check_heads(28, 4, 4)
    infra.check_heads(28, 4, 2)
    infra.check_heads(4, 1, 4)


def test_group_size_and_attention_that_cannot_work_stop_with_a_clear_error():
    """k must divide the world (checked before any group is made); the inner attention must take
    the full row's mask (flash-attn's varlen kernel takes none)."""
    with pytest.raises(infra.ConfigError,
                       match="sequence_parallel = 4 must divide the number of ranks"):
        infra.sp_group(6, 4)
    with pytest.raises(infra.ConfigError,
                       match="needs engine.attn_implementation sdpa or flex_attention"):
        infra.enable_sequence_parallel(sp_tiny_model("llama"), None, "flash_attention_2")


def test_layout_and_volume_formula():
    """Groups of k consecutive ranks; the all-to-all volume on worked numbers."""
    assert [infra.sp_layout(r, 4) for r in range(8)] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                      (1, 0), (1, 1), (1, 2), (1, 3)]
    # Qwen2.5-7B (hidden 3584 = 28 x 128, 4 KV heads) at T = 131072 on k = 8: S = 16384, KV heads
    # replicated to 8: S D (2 28 + 2 8) = 16384 128 72 elements, below 4 T hidden / k (q, k, v,
    # out at full width) = 16384 128 112
    assert infra.exchange_elements(131072, 8, 28, 4, 128) == 16384 * 128 * 72
    assert 4 * 131072 * 3584 // 8 == 16384 * 128 * 112
    # no GQA: exactly 4 T hidden / k; a row of 9 on k = 2 pays for 10
    assert infra.exchange_elements(1024, 2, 2, 2, 64) == 4 * 1024 * 128 // 2
    assert infra.exchange_elements(9, 2, 2, 2, 64) == infra.exchange_elements(10, 2, 2, 2, 64)


# ------------------------------------------------------------------------------------------------
# 2 ranks, SP 2, against 1 rank (one torchrun launch; the tests read what it wrote)
# ------------------------------------------------------------------------------------------------

# Shapes of the two tiny models: (query heads, KV heads). Both: hidden 128, head_dim 64, 2 layers,
# MLP 256, vocabulary 1000, tied embeddings.
ARCHS = {"llama": (2, 1), "qwen2": (4, 2)}
BUGS = ("exchange_order", "positions_restart", "boundary_target")


def sp_tiny_model(arch: str, seed: int = 0):
    """Llama: 2 query heads, 1 KV head (fewer KV heads than k = 2: replication); Qwen2: q/k/v
    biases, 4 query heads, 2 KV heads. fp32, SDPA, deterministic given seed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    num_q, num_kv = ARCHS[arch]
    config = config_class(vocab_size=1000, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=num_q,
                          num_key_value_heads=num_kv, head_dim=64, max_position_embeddings=512,
                          tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config).float()


def sp_rows() -> list[dict]:
    """Three packed rows: sequences of irregular lengths, 45 tokens (not a multiple of 2; the
    shard boundary inside a completion); a shared-prefix group of 3 answers and another pair, 38
    tokens (the boundary inside the second answer); one sequence whose prompt fills rank 0's
    shard (rank 0 computes no target but still takes part in every all-to-all)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 1000, (n,), generator=g).tolist()  # noqa: E731
    plain = [(ids(p), ids(c)) for p, c in [(7, 5), (3, 11), (12, 2), (1, 4)]]
    prompt = ids(13)
    shared = [(prompt, ids(5)), (prompt, ids(9)), (prompt, ids(1)), (ids(4), ids(6))]
    return [spell.pack_sequences(plain), spell.pack_sequences(shared, shared=True),
            spell.pack_sequences([(ids(20), ids(3))])]


# Tolerance. SP and the 1-rank forward evaluate the same real numbers with the same operations;
# what differs is the order of some sums (attention over the padded row with masked keys, matrix
# products over S instead of T rows) and, in the backward, the gradient added up over the two
# ranks. A k-term sum in another order is off by typically sqrt(k) u sum|terms|, u = 2^-24 (fp32).
# Along the longest path from an embedding to a log-prob the sums have, per layer: RMSNorm H,
# q/k/v H, q.k D, softmax and p.v KEYS each, o_proj HQ, RMSNorm H, gate/up H, down I; then the
# final norm H, the logit H and the log-sum-exp V: K_FWD terms on the scale of the log-prob. The
# backward retraces that path and sums each weight's gradient over the row's tokens and then over
# the 2 ranks: K_BWD terms on the gradient's scale. Either side can be off by that much: the
# factor 2. This is test_spell.py's shared-prefix bound, with Qwen2's wider o_proj (HQ = 4 x 64).
H, HQ, D, I, LAYERS, V = 128, 256, 64, 256, 2, 1000
KEYS = ROW = 46  # the longest padded row
K_FWD = LAYERS * (H + H + D + 2 * KEYS + HQ + H + H + I) + H + H + V  # 3616
K_BWD = 2 * K_FWD + ROW + 2  # 7280
U32 = 2.0 ** -24


def rounding_bound(k: int, scale: float) -> float:
    """The typical gap between two fp32 evaluations of a chain of k summed terms on `scale`."""
    return 2 * math.sqrt(k) * U32 * scale  # K_BWD: 1e-5 of the scale; K_FWD: 5e-5 at -7


def logp_check(local: torch.Tensor, which: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(gap, bound) of this rank's log-probs against the 1-rank ones of the same targets."""
    gap = float((local - ref[which]).abs().max()) if len(which) else 0.0
    return gap, rounding_bound(K_FWD, float(ref.abs().max()))


def gradient_check(grads: dict, ref: dict) -> tuple[float, str]:
    """The worst gap / bound over the parameter tensors (each on its own scale), and its name."""
    worst = (0.0, "")
    for name, r in ref.items():
        gap = float((grads[name] - r).abs().max())
        worst = max(worst, (gap / rounding_bound(K_BWD, float(r.abs().max())), name))
    return worst


def sp_reference(arch: str, rows: list[dict], weights: list[torch.Tensor]):
    """The 1-rank forward: log-probs of every row and the gradients of sum(w * logp)."""
    model = sp_tiny_model(arch)
    logps = [infra.packed_logprobs(model, row, TEMPERATURE)[0] for row in rows]  # (N,) each
    sum((w * lp).sum() for w, lp in zip(weights, logps)).backward()
    return [lp.detach() for lp in logps], {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    """One torchrun of worker_sp_parity on 2 ranks: what rank 0 wrote, and the output."""
    out = tmp_path_factory.mktemp("sp") / "results.json"
    result = torchrun(2, __file__, "sp-parity", str(out))
    return json.loads(out.read_text()), result.stdout


@pytest.mark.stack
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sharding", ["replicated", "fsdp_checkpointed"])
def test_sp_matches_one_rank(sp_run, arch, sharding):
    """SP 2 on 2 ranks: every target computed on exactly one rank, with the 1-rank log-prob; the
    gradient of sum(w * logp) (summed over the ranks; FSDP2 reduces it) the 1-rank gradient,
    tensor by tensor. Under FSDP2 with checkpointing each layer's two all-to-alls run again in the
    backward (the recompute), so the forward's exchanges double. Measured: log-probs bit-identical
    to the 1-rank ones, gradients at most 0.03 x the bound (3e-7 of a tensor's scale)."""
    res = sp_run[0][sharding][arch]
    assert res["covered"], "the two ranks do not cover every target exactly once"
    for gap, bound in res["logp"]:
        assert gap <= bound, f"log-probs differ by {gap:.3g} > {bound:.3g}"
    assert res["grad"][0] <= 1.0, f"{res['grad'][1]}: gradient gap {res['grad'][0]:.3g} x bound"
    print(f"METRIC {sharding}_{arch}_logp_gap={max(g for g, _ in res['logp']):.3g} "
          f"grad_gap_over_bound={res['grad'][0]:.3g}")
    if sharding == "fsdp_checkpointed":
        calls = res["exchanges"]
        assert calls["backward"] == calls["forward"] == 2 * LAYERS * 3, calls


@pytest.mark.stack
@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_sp_planted_bug_is_caught(sp_run, bug, arch):
    """Each planted mistake moves some log-prob past the parity bound: the all-to-all's output read
    with ranks and tokens swapped, positions restarting at 0 on every shard (what HF does when no
    position_ids are given), a shard's first target computed at its own position instead of the
    previous rank's last (splitting before shifting). Measured: the smallest, positions restarting,
    moves a log-prob by 1e-2, 200 x the bound; the others by 1 or more."""
    gaps = sp_run[0]["bugs"][bug][arch]
    gap, bound = max(gaps)
    print(f"METRIC bug_{bug}_{arch}: gap {gap:.3g}, {gap / bound:.3g} x the bound")
    assert gap > bound


@pytest.mark.stack
def test_sp_exchange_traffic(sp_run):
    """Bytes the all-to-alls move per layer per forward against the formula (buffer sizes, as
    counted at the call), and what the process wrote to its sockets meanwhile (/proc/self/io
    wchar: gloo's writes; the other rank's half of each buffer leaves, the own half stays).
    Measured (Llama, T = 1024): 1,048,576 bytes a layer put in, 524,576 written."""
    for arch, t in sp_run[0]["traffic"].items():
        num_q, num_kv = ARCHS[arch]
        formula = 4 * infra.exchange_elements(t["tokens"], 2, num_q, num_kv, D)  # fp32 bytes
        assert t["buffer_bytes_per_layer"] == formula, (arch, t)
        # of each buffer the other rank's half crosses the socket, plus gloo's headers (measured:
        # 288 bytes a layer); 1 % leaves room for those, not for a third copy of anything
        assert formula // 2 <= t["written_bytes_per_layer"] <= 1.01 * formula // 2, (arch, t)
        print(f"METRIC traffic_{arch}: T={t['tokens']}, formula {formula} B/layer/rank, counted "
              f"{t['buffer_bytes_per_layer']}, written {t['written_bytes_per_layer']:.0f} "
              f"(expected (k-1)/k = {formula // 2})")


@pytest.mark.stack
def test_sp_flex_attention_forward_matches_one_rank(tmp_path):
    """With FlexAttention inside (the GPU path: a BlockMask of the whole padded row, passed through
    HF unchanged), SP 2 gives the 1-rank SDPA log-probs. Forward only: torch 2.13 has no
    FlexAttention backward on CPU. About a minute, most of it compiling FlexAttention for CPU."""
    out = tmp_path / "flex.json"
    torchrun(2, __file__, "sp-flex", str(out))
    for arch, checks in json.loads(out.read_text()).items():
        for gap, bound in checks:
            assert gap <= bound, f"{arch}: log-probs differ by {gap:.3g} > {bound:.3g}"
        print(f"METRIC flex_{arch}_logp_gap={max(g for g, _ in checks):.3g}")


# ------------------------------------------------------------------------------------------------
# torchrun workers (this file is also the script that torchrun starts)
# ------------------------------------------------------------------------------------------------

def worker_export_smoke(model_dir: str, cpu_bf16: str) -> None:
    """One rank: the exported SmolLM2 folder starts in vLLM, in the dtype the project samples in
    on this machine ("auto", with engine.cpu_bf16 as given), and answers a chat prompt right
    (Paris), stopping at <|im_end|>."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    t0 = time.perf_counter()
    llm = spell.start_vllm(model_dir, max_model_len=1024, seed=0,
                           dtype=infra.rollout_dtype("auto", torch.cuda.is_available(),
                                                     cpu_bf16 == "true"))
    print(f"METRIC export_vllm_start_s={time.perf_counter() - t0:.2f}")
    t0 = time.perf_counter()
    [[greedy]] = spell.generate(llm, [prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=32,
                                logprobs=False)
    [samples] = spell.generate(llm, [prompt], n=2, temperature=TEMPERATURE, top_p=0.95,
                               max_tokens=16, logprobs=True)
    dt = time.perf_counter() - t0
    n_tokens = len(greedy.token_ids) + sum(len(c.token_ids) for c in samples)
    print(f"vLLM answer: {greedy.text!r} ({greedy.finish_reason}); "
          f"sampled: {[c.text for c in samples]}")
    print(f"METRIC export_vllm_decode_tok_s={n_tokens / dt:.1f}")
    ok = ("Paris" in greedy.text and greedy.finish_reason == "stop"
          and greedy.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
          and all(len(c.logprobs) == len(c.token_ids) and max(c.logprobs) <= 0 for c in samples))
    print(f"METRIC export_vllm_answer_ok={int(ok)}")


def worker_export_peak(out_dir: str, tokenizer_dir: str) -> None:
    """FSDP2 on 2 ranks: an untied Llama of 123 MiB exported by infra.export_hf (bf16, shards of
    16 MiB) and by the export before #41; rank 0's peak resident memory beyond what it held before
    each goes to peaks.json."""
    import safetensors.torch  # noqa: F401  (imported before anything is measured)
    import torch.distributed as dist
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import preflight

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = spell.shard_policy(LlamaForCausalLM(LlamaConfig(**EXPORT_LLAMA)).float(),
                               worker_mesh("0", world), param_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out, peaks = Path(out_dir), {}
    for name, export in [
            ("new", lambda path: infra.export_hf(
                model, tok, path, rank, spell.gathered_state_dict(model, torch.bfloat16),
                torch.bfloat16, shard_bytes=16 << 20)),
            ("before", lambda path: export_before_41(model, tok, path, rank))]:
        dist.barrier()
        preflight.reset_host_peak()
        before = preflight.host_memory()[0]
        export(out / name)
        peaks[name] = (preflight.host_memory()[1] - before) * 2**30
    if rank == 0:
        (out / "peaks.json").write_text(json.dumps(peaks))
    end_worker()


def worker_buckets(out_file: str, shard_size: str = "0") -> None:
    """Each rank: a tiny Llama with odd row counts (padded shards) under FSDP2 (HSDP for a
    shard_size below the world); bucketed_state_dict against gathered_state_dict and the unsharded
    weights, for several bounds, dtypes and `ahead`; every rank's findings go to out_file
    (rank 0 writes)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=1001, hidden_size=128, intermediate_size=255,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).float()
    truth = {k: v.clone() for k, v in reference.state_dict().items()}
    model = spell.shard_policy(copy.deepcopy(reference), worker_mesh(shard_size, world),
                               param_dtype=torch.float32)
    real_start, real_gather = infra.start_bucket_gather, dist.all_gather_into_tensor

    # records each bucket's full sizes, which bucket each name is in, and when
    def start(entries, dtype):
        buckets.append([t.numel() * dtype.itemsize for _, t in entries])
        owner.update({name: len(buckets) - 1 for name, _ in entries})
        events.append(f"issue {len(buckets) - 1}")
        return real_start(entries, dtype)

    def gather(*args, **kw):
        calls.append(1)
        return real_gather(*args, **kw)

    infra.start_bucket_gather, dist.all_gather_into_tensor = start, gather
    findings = []
    for dtype, bound in [(torch.float32, 0), (torch.float32, 100_000), (torch.bfloat16, 10**9)]:
        for ahead in (0, 1):
            buckets, owner, events, calls, sent = [], {}, [], [], []
            for name, tensor in infra.bucketed_state_dict(model, dtype, bound, ahead=ahead):
                events.append(f"take {owner[name]}")
                sent.append((name, tensor))
            collectives = len(calls)
            expected = list(spell.gathered_state_dict(model, dtype))
            findings.append({
                "rank": rank, "bound": bound, "ahead": ahead, "buckets": buckets,
                "collectives": collectives, "n_tensors": len(expected),
                "issued_before_handed_out": [
                    events.index(f"issue {k + 1}") < events.index(f"take {k}")
                    for k in range(len(buckets) - 1)],
                "same_names": [n for n, _ in sent] == [n for n, _ in expected],
                "equal": all(torch.equal(a, b) and torch.equal(a, truth[n].to(dtype))
                             and a.dtype == dtype
                             for (n, a), (_, b) in zip(sent, expected)),
            })
    everyone = [None] * world
    dist.all_gather_object(everyone, findings)
    if rank == 0:
        Path(out_file).write_text(json.dumps([f for fs in everyone for f in fs]))
    end_worker()


def sp_planted(bug: str):
    """Monkeypatch infra's sequence parallelism with one mistake; returns the undo."""
    saved = dict(vars(infra))
    if bug == "exchange_order":  # (k, S, h, D) read as if it were (S, k, h, D)
        def tokens_to_heads(out, group):
            k, (_, t, h, d) = group.size(), out.shape
            received = infra.exchange(out[0].reshape(k, t // k, h, d), group)
            return received.reshape(1, t // k, k * h, d)
        infra.tokens_to_heads = tokens_to_heads
    elif bug == "positions_restart":
        def shard_row(packed, k, r):
            shard = saved["shard_row"](packed, k, r)
            return {**shard, "position_ids": torch.arange(shard["input_ids"].shape[1])[None]}
        infra.shard_row = shard_row
    elif bug == "boundary_target":  # targets dealt by their own position, then shifted locally
        def shard_row(packed, k, r):
            shard = saved["shard_row"](packed, k, r)
            s = shard["input_ids"].shape[1]
            index = packed["index"]
            which = ((index + 1 >= r * s) & (index + 1 < (r + 1) * s)).nonzero()[:, 0]
            return {**shard, "which": which, "targets": packed["targets"][which],
                    "index": (index[which] - r * s).clamp(min=0)}
        infra.shard_row = shard_row
    return lambda: vars(infra).update(saved)


def wchar() -> int:
    """Bytes this process has passed to write-like system calls (its sockets among them)."""
    return int(Path("/proc/self/io").read_text().split("wchar:")[1].split()[0])


def worker_sp_parity(out_file: str) -> None:
    """Each rank: SP 2 over the 2 ranks on sp_rows(), for both models: replicated, planted
    bugs, traffic, then FSDP2 + checkpointing; rank 0 writes the gaps and bounds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = infra.sp_group(world, 2)
    rows = sp_rows()
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(row["targets"]), generator=g) for row in rows]  # (N,) each

    def gather_all(x) -> list:  # every rank's x, in rank order
        parts = [None] * world
        dist.all_gather_object(parts, x)
        return parts

    def gather(x: list) -> list:  # every rank's list, concatenated
        return [y for part in gather_all(x) for y in part]

    calls = {"n": 0}
    exchange = infra.exchange

    def counting(x, grp):
        calls["n"] += 1
        calls["bytes"] = calls.get("bytes", 0) + x.numel() * x.element_size()
        return exchange(x, grp)

    infra.exchange = counting
    results = {"replicated": {}, "fsdp_checkpointed": {}, "bugs": {b: {} for b in BUGS},
               "traffic": {}}
    for arch in ARCHS:
        ref_logps, ref_grads = sp_reference(arch, rows, weights)
        model = sp_tiny_model(arch)
        infra.enable_sequence_parallel(model, group, "sdpa")
        forward = infra.completion_logprobs
        loss, checks, which_all = 0.0, [], []
        for row, w, ref in zip(rows, weights, ref_logps):
            lp, _, which, _ = infra.sp_completion_logprobs(model, row, TEMPERATURE,
                                                           forward=forward)
            checks.append(logp_check(lp.detach(), which, ref))
            which_all.append(gather(which.tolist()))
            loss = loss + (w[which] * lp).sum()  # this rank's share of the micro-batch loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for t in grads.values():  # each rank holds its tokens' share of every gradient
            dist.all_reduce(t, group=group)
        results["replicated"][arch] = {
            "logp": [max(c) for c in zip(*gather_all(checks))],  # per row, the worse rank
            "covered": all(sorted(w) == list(range(len(r["targets"])))
                           for w, r in zip(which_all, rows)),
            "grad": max(gather_all(gradient_check(grads, ref_grads)))}
        with torch.no_grad():
            for bug in BUGS:
                undo = sp_planted(bug)
                gaps = [logp_check(*infra.sp_completion_logprobs(model, row, TEMPERATURE,
                                                              forward=forward)[::2], ref)
                        for row, ref in zip(rows, ref_logps)]
                undo()
                results["bugs"][bug][arch] = gather(gaps)
            # traffic: one forward of a 1024-token row
            long_row = spell.pack_sequences([(list(range(1000)), list(range(24)))])
            calls.update(n=0, bytes=0)
            dist.barrier()
            before = wchar()
            infra.sp_completion_logprobs(model, long_row, TEMPERATURE, forward=forward)
            written = wchar() - before
            assert calls["n"] == 2 * LAYERS, calls
            results["traffic"][arch] = {"tokens": 1024,
                                        "buffer_bytes_per_layer": calls["bytes"] // LAYERS,
                                        "written_bytes_per_layer": written / LAYERS}
    # FSDP2 over the two ranks (DP degree world / k = 1: both train the same micro-batches)
    mesh = init_device_mesh("cpu", (world,))
    for arch in ARCHS:
        ref_logps, ref_grads = sp_reference(arch, rows, weights)
        policy = spell.shard_policy(sp_tiny_model(arch), mesh, param_dtype=torch.float32,
                                    gradient_checkpointing=True)
        infra.enable_sequence_parallel(policy, group, "sdpa")
        calls.update(n=0)
        loss, checks, which_all = 0.0, [], []
        for row, w, ref in zip(rows, weights, ref_logps):
            lp, _, which, _ = infra.sp_completion_logprobs(policy, row, TEMPERATURE)
            checks.append(logp_check(lp.detach(), which, ref))
            which_all.append(gather(which.tolist()))
            loss = loss + (w[which] * lp).sum()
        forward_calls = calls["n"]
        # FSDP2 averages gradients over its ranks: x world makes that the sum, as update_policy
        (loss * world).backward()
        grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
        results["fsdp_checkpointed"][arch] = {
            "logp": [max(c) for c in zip(*gather_all(checks))],
            "covered": all(sorted(w) == list(range(len(r["targets"])))
                           for w, r in zip(which_all, rows)),
            "grad": max(gather_all(gradient_check(grads, ref_grads))),
            "exchanges": {"forward": forward_calls, "backward": calls["n"] - forward_calls}}
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    end_worker()


def worker_sp_flex(out_file: str) -> None:
    """Each rank: SP 2 with FlexAttention inside, forward only, on sp_rows(); rank 0 writes
    every rank's (gap, bound) per row against the 1-rank SDPA forward."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = infra.sp_group(dist.get_world_size(), 2)
    results = {}
    for arch in ARCHS:
        ref, model = sp_tiny_model(arch), sp_tiny_model(arch)
        infra.enable_sequence_parallel(model, group, "flex_attention")
        checks = []
        with torch.no_grad():
            for row in sp_rows():
                lp, _, which, _ = infra.sp_completion_logprobs(model, row, TEMPERATURE,
                                                            forward=infra.completion_logprobs)
                checks.append(logp_check(lp, which, infra.packed_logprobs(ref, row,
                                                                          TEMPERATURE)[0]))
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, checks)
        results[arch] = [c for part in parts for c in part]
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(results))
    end_worker()


def worker_rope(tiny_dir: str, out_file: str, work: str) -> None:
    """One rank: test_rope_scaling_reaches_vllm_and_the_trainer_alike's measurements."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.config import ModelConfig

    import evaluation

    # a timeout other than gloo's default, which stop_vllm's new group must keep
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=7))
    cpu, r = torch.device("cpu"), {}
    # the tiny model's attention is near uniform (weights of scale 0.02), so positions hardly
    # matter; queries and keys 8x larger make it peaked, and a wrong RoPE visible
    sharp = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in sharp.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    source, tiny_dir = tiny_dir, str(Path(work) / "sharp")
    shutil.copytree(source, tiny_dir)  # the tokenizer's files
    sharp.save_pretrained(tiny_dir)  # and the sharper weights over the tiny model's
    cfg = spell.load_config(None, [f"--model.path={tiny_dir}", "--model.rope_scaling=yarn:4",
                                   "--rollout.max_prompt_tokens=7680",
                                   "--rollout.max_new_tokens=512",
                                   "--engine.rollout_dtype=float32"])
    model_dir, tok, llm = spell.start_engine(cfg, 0, 1, cpu, 0, training=True)
    policy, _ = spell.load_policy(cfg, model_dir, cpu, 1)
    infra.check_same_rope(llm, policy)  # as main() does
    r["max_model_len"] = llm.llm_engine.model_config.max_model_len
    # the rotary tables: vLLM's cache holds cos | sin x mscale for every position
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    cache = runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache  # (8192, head_dim)
    half = cache.shape[1] // 2
    cos, sin = policy.model.rotary_emb(torch.zeros(1, dtype=torch.float32),
                                       torch.arange(cache.shape[0])[None])  # (1, 8192, head_dim)
    r["cos_max_diff"] = (cache[:, :half] - cos[0, :, :half]).abs().max().item()
    r["sin_max_diff"] = (cache[:, half:] - sin[0, :, :half]).abs().max().item()
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    try:
        infra.check_same_rope(llm, plain)
        r["mismatch_stopped"] = False
    except infra.ConfigError:
        r["mismatch_stopped"] = True

    # sampled tokens' log-probs on prompts past the model's own 2048 positions
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (2500, 3500)]

    def sample(engine):
        # top_p 1: vLLM's log-probs are of the nucleus, renormalised (processed_logprobs)
        return spell.generate(engine, prompts, n=4, temperature=TEMPERATURE, top_p=1.0,
                              max_tokens=16, seeds=[1, 2], logprobs=True)

    def max_diff_to(model, outs) -> float:
        diffs = []
        for p, cs in zip(prompts, outs):  # one row a prompt: a dense SDPA mask of 3.5K^2 at most
            packed = spell.pack_sequences([(p, c.token_ids) for c in cs], shared=True)
            with torch.no_grad():
                lp = infra.packed_logprobs(model, packed, TEMPERATURE)[0]
            diffs += [(lp[s:e] - torch.tensor(c.logprobs)).abs().max().item()
                      for c, (s, e) in zip(cs, packed["spans"])]
        return max(diffs)

    first, cached = sample(llm), sample(llm)  # the second reads every full block from the cache
    r["trainer_vllm_max_diff"] = max_diff_to(policy, first)
    r["plain_trainer_vllm_max_diff"] = max_diff_to(plain, first)
    evaluation.stop_vllm(llm)
    r["timeout_after_regroup"] = infra.group_timeout().total_seconds()
    uncached = sample(spell.start_vllm(model_dir, max_model_len=8192, seed=0, dtype="float32",
                                       hf_overrides=infra.model_config(model_dir, "yarn:4")[1],
                                       enable_prefix_caching=False))

    def compare(a, b, name):
        pairs = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
        r[f"{name}_tokens_equal"] = all(x.token_ids == y.token_ids for x, y in pairs)
        r[f"{name}_max_diff"] = max(max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs))
                                    for x, y in pairs)
    compare(first, cached, "cached")
    compare(first, uncached, "uncached")

    # vLLM's own max_model_len rule against context_bound
    def folder(name, **fields):
        config = AutoConfig.from_pretrained(tiny_dir)
        for key, value in fields.items():
            setattr(config, key, value)
        path = Path(work) / name
        shutil.copytree(tiny_dir, path)
        config.save_pretrained(path)
        return str(path)

    cases = [("plain", tiny_dir, ""), ("yarn:4", tiny_dir, "yarn:4"),
             ("config.json yarn x4", folder("yarn", rope_parameters={
                 "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                 "rope_theta": 10000.0}), ""),
             ("config.json linear x2", folder("linear", rope_parameters={
                 "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "")]
    r["bounds"] = []
    for name, path, key in cases:
        config, overrides = infra.model_config(path, key)
        bound = int(infra.context_bound(config))
        starts = []
        for n in (bound, bound + 1):
            try:
                vllm_config = ModelConfig(model=path, max_model_len=n, hf_overrides=overrides)
                starts.append(True)
            except ValueError:  # pydantic's ValidationError is one
                starts.append(False)
        # and vLLM reads the RoPE the trainer's config holds (check_same_rope's comparison)
        same = infra.rope_view(vllm_config.hf_config) == infra.rope_view(config)
        r["bounds"].append([name, bound, *starts, same])
    Path(out_file).write_text(json.dumps(r))


if __name__ == "__main__":
    run_worker({"export-smoke": worker_export_smoke, "export-peak": worker_export_peak,
                "buckets": worker_buckets,
                "sp-parity": worker_sp_parity, "sp-flex": worker_sp_flex, "rope": worker_rope})


ADAMW_IMPLEMENTATIONS = {"fused": dict(fused=True), "foreach": dict(foreach=True),
                         "loop": dict(foreach=False)}


@pytest.mark.parametrize("impl", ADAMW_IMPLEMENTATIONS)
def test_optimizer_state_made_early_trains_exactly_as_made_late(impl):
    """infra.create_optimizer_state makes AdamW's moments before the first forward (on GPU, so
    they do not pin memory the first backward freed, which vLLM's wake-up needs) and leaves the run
    bit for bit as the lazy state would, in each of torch's implementations: the same counters
    (dtype and device too) and three steps of the same gradients end in the same weights and
    moments. The bias correction reads the step counter, so a counter left at 1 fails this."""
    torch.manual_seed(0)
    lazy_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    early_model = copy.deepcopy(lazy_model)
    lazy, early = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                                     **ADAMW_IMPLEMENTATIONS[impl])
                   for m in (lazy_model, early_model))
    infra.create_optimizer_state(early)
    assert all(torch.equal(p, q) for p, q in zip(lazy_model.parameters(),
                                                 early_model.parameters()))
    assert len(early.state) == 4 and all(p.grad is None for p in early_model.parameters())
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((lazy_model, lazy), (early_model, early)):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for p, q in zip(lazy_model.parameters(), early_model.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = lazy.state[p][key], early.state[q][key]
            assert torch.equal(a, b) and (a.dtype, a.device) == (b.dtype, b.device), key


def allocated_peak(fn, *tracked) -> int:
    """Bytes fn() allocates at its peak beyond what was alive when it began (torch's MemTracker,
    which counts every tensor storage made while it watches; `tracked`: modules and optimisers
    whose tensors existed before)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def total(snapshot: dict) -> int:
        (_, kinds), = snapshot.items()
        return kinds["Total"]

    tracker = MemTracker()
    tracker.track_external(*tracked)
    start = total(tracker.get_tracker_snapshot())
    with tracker:
        fn()
    return total(tracker.get_tracker_snapshot("peak")) - start


def test_the_optimiser_holds_its_two_moments_and_nothing_more_at_start_and_step():
    """Issue #41, item 1: the update's measured peak on an H200 was the optimiser step, 20P/s bytes
    (weights, gradients, two moments and the fp32 copy of every second moment that torch's
    foreach AdamW makes: CUDA's default), and start-up held gradients beside the moments while
    vLLM was awake. spell.make_optimizer names the fused implementation on every device and
    infra.create_optimizer_state makes the state without a step. Here the tracker counts, on CPU:
    start-up allocates the two fp32 moments (8P bytes) and a 4-byte counter per tensor; the step
    allocates nothing. The foreach path, forced, shows what the tracker would see (4P: its copy).
    Watched fail with the old start (a step on zero gradients: 12P) and with foreach named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    P = sum(p.numel() for p in model.parameters())
    cfg = spell.Config()
    for name, optimizer in (("spell", spell.make_optimizer(model, cfg)),
                            ("foreach", torch.optim.AdamW(model.parameters(), foreach=True))):
        start = allocated_peak(lambda: infra.create_optimizer_state(optimizer), model)
        assert start == 8 * P + 4 * len(optimizer.state), (name, start, P)
        model(torch.randn(8, 64)).square().sum().backward()
        step = allocated_peak(optimizer.step, model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if name == "spell":
            assert step == 0, f"the step allocated {step} bytes ({step / (4 * P):.2f} x 4P)"
        else:
            assert step >= 4 * P, step  # the tracker sees a temporary where there is one
