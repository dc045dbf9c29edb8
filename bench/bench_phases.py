"""One quickstart step, phase by phase, against this machine's roofline (issue #29, item 4).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_phases.py       # before and after, ~10 min
    ... bench/bench_phases.py --settings after                     # one of them

Each setting runs the first step of `torchrun --nproc_per_node=2 spell.py --config
presets/demo.toml` (the real main() for one step; its checkpoint and export at the end are outside
every timed phase) with three of spell.py's functions wrapped to write down what they did on each
rank: start_vllm (the dtype and whether vLLM compiled), generate (per call: its prompts' lengths, n,
each completion's length, the seconds) and update_policy (the sequences and the seconds). The
settings:
  before   the quickstart when issue #29 was filed: vLLM in fp32, eager; FSDP2 over both ranks
           (--engine.cpu_bf16=false --engine.fsdp_shard_size=0)
  after    presets/demo.toml as shipped: vLLM in bf16 through torch.compile on an AMX CPU (fp32
           elsewhere); full replicas on each rank (engine.fsdp_shard_size = 1)

First the machine's ceilings, on one thread (each rank of the quickstart owns one core): the
matmul peak in fp32 and in bf16 (a 2048^3 torch.mm, best of 5) and the read bandwidth (the sum of
a 1 GiB fp32 tensor, best of 5). Then, per phase and rank, the roofline: the least time the phase's
work could take at those ceilings, and its share of the measured time. For SmolLM2-135M: N the
parameters every token passes through but the LM head (the decoder layers), E the head's (tied
embedding, 576 x 49,152), L = 30 layers, h = 9 x 64 query width, kv = 2 x 3 x 64 x L values a
token's K and V take in the cache, b the bytes of vLLM's dtype.
  prefill  per distinct prompt of p tokens (a call's n completions share its prefill):
           2 N p + 2 L h p^2 FLOPs (causal attention's QK^T and AV) + 2 E (the last token's
           logits), at the matmul peak in vLLM's dtype
  decode   per generated token at context c: 2 (N + E) + 4 L h c FLOPs, and kv b c bytes of cache
           read; per engine step the weights, (N + E) b bytes, once for the whole batch; the steps
           are the call's longest completion (every request of a call is in one batch, as
           vLLM's max_num_seqs allows here). The decode bound is the larger of FLOPs / peak and
           bytes / bandwidth
  update   the tokens the shared-prefix rows encode (each distinct prompt once, every completion):
           6 N T + 6 E T_c (the head on the completions, the only positions with a log-prob) +
           3 x (2 L h p^2 per prompt + 4 L h c_i (p + c_i / 2) per completion), at the fp32 peak
           (the CPU trainer computes in fp32; forward + backward = 3 forwards; no recompute,
           engine.gradient_checkpointing is off in demo.toml)
Left out of the roofline: the sampler (top-p's sort, bench_top_p.py), the grounding check's and the
phases' Python, the weight sync (its own row, no bound), the update's optimiser step and its
all-reduce/all-gathers (bench_update_layout.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = {
    "before": ["--engine.cpu_bf16=false", "--engine.fsdp_shard_size=0"],
    "after": [],
}
PHASES = {"questioner": "que", "grounding": "ground", "responder": "res", "verifier": "ver"}


# --------------------------------------------------------------------------------------------------
# the worker: one rank of one setting
# --------------------------------------------------------------------------------------------------
def worker(out: Path, overrides: list[str]) -> None:
    """spell.main for one step, its vLLM start, generate calls and update written down."""
    import spell

    rank = int(os.environ["RANK"])
    record = {"engine": {}, "calls": [], "update": {}}
    real_start, real_generate, real_update = spell.start_vllm, spell.generate, spell.update_policy

    def start_vllm(model_dir, **kw):
        t0 = time.perf_counter()
        llm = real_start(model_dir, **kw)
        vllm_config = llm.llm_engine.vllm_config
        record["engine"] = {"dtype": kw["dtype"],
                            "eager": bool(vllm_config.model_config.enforce_eager),
                            "start_s": time.perf_counter() - t0,
                            "max_num_seqs": vllm_config.scheduler_config.max_num_seqs}
        return llm

    def generate(llm, prompts, *, n, desc="generate", **kw):
        t0 = time.perf_counter()
        outs = real_generate(llm, prompts, n=n, desc=desc, **kw)
        record["calls"].append({"desc": desc, "seconds": time.perf_counter() - t0, "n": n,
                                "prompts": [len(p) for p in prompts],
                                "completions": [[len(c.token_ids) for c in cs] for cs in outs]})
        return outs

    def update_policy(policy, optimizer, seqs, *args, **kw):
        t0 = time.perf_counter()
        stats = real_update(policy, optimizer, seqs, *args, **kw)
        prompts = {}
        for s in seqs:
            prompts.setdefault(tuple(s.prompt), []).append(len(s.completion))
        record["update"] = {"seconds": time.perf_counter() - t0,
                            "rows": [[len(p), cs] for p, cs in prompts.items()]}
        return stats

    spell.start_vllm, spell.generate, spell.update_policy = start_vllm, generate, update_policy
    spell.main(["--config", "presets/demo.toml", "--train.steps=1", "--log.sample_every=0",
                f"--log.out_dir={out}", *overrides])
    (out / f"phases_rank{rank}.json").write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------------
# the ceilings and the roofline
# --------------------------------------------------------------------------------------------------
def ceilings() -> dict:
    """One thread's matmul peak (FLOP/s) in fp32 and bf16 and its read bandwidth (bytes/s)."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        torch.mm(a, b)
        best = min(timed(lambda: torch.mm(a, b)) for _ in range(5))
        out[str(dtype).removeprefix("torch.")] = 2 * 2048 ** 3 / best
    x = torch.ones(2 ** 28)  # 1 GiB of fp32
    x.sum()
    out["read_bytes_per_s"] = x.numel() * 4 / min(timed(x.sum) for _ in range(5))
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def model_shape() -> dict:
    """N, E, L, h, kv of the quickstart's model (its config.json in .cache/)."""
    import spell

    cfg = spell.load_config(str(REPO / "presets" / "demo.toml"))
    import infra

    config, _ = infra.model_config(infra.resolve_model(cfg, 0), cfg.model.rope_scaling)
    d, L = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    E = config.vocab_size * d
    per_layer = (d * head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads)
                 + config.num_attention_heads * head_dim * d + 3 * d * config.intermediate_size
                 + 2 * d)
    return {"N": L * per_layer + d, "E": E, "L": L, "h": config.num_attention_heads * head_dim,
            "kv": 2 * config.num_key_value_heads * head_dim * L}


def rollout_roofline(call: dict, shape: dict, flops_per_s: float, bytes_per_s: float,
                     b: int) -> dict:
    """The least seconds one generate call's prefill and decode could take (module docstring)."""
    N, E, L, h, kv = (shape[k] for k in ("N", "E", "L", "h", "kv"))
    prefill = sum(2 * N * p + 2 * L * h * p * p + 2 * E for p in call["prompts"])
    decode_flops = decode_bytes = 0.0
    for p, cs in zip(call["prompts"], call["completions"]):
        for c in cs:  # contexts p .. p + c - 1: their sum is c p + c (c - 1) / 2
            context = c * p + c * (c - 1) / 2
            decode_flops += 2 * (N + E) * c + 4 * L * h * context
            decode_bytes += kv * b * context
    steps = max((c for cs in call["completions"] for c in cs), default=0)
    decode_bytes += steps * (N + E) * b
    return {"prefill_s": prefill / flops_per_s,
            "decode_s": max(decode_flops / flops_per_s, decode_bytes / bytes_per_s),
            "prompt_tokens": sum(call["prompts"]),
            "new_tokens": sum(c for cs in call["completions"] for c in cs)}


def update_roofline(rows: list, shape: dict, flops_per_s: float) -> dict:
    N, E, L, h = (shape[k] for k in ("N", "E", "L", "h"))
    flops, tokens = 0.0, 0
    for p, cs in rows:
        tokens += p + sum(cs)
        flops += 6 * N * (p + sum(cs)) + 6 * E * sum(cs) + 3 * 2 * L * h * p * p
        flops += sum(3 * 4 * L * h * c * (p + c / 2) for c in cs)
    return {"bound_s": flops / flops_per_s, "tokens": tokens}


def table(name: str, records: list[dict], peaks: dict, shape: dict) -> list[str]:
    """Rows per phase, the slower rank's seconds (the ranks wait for each other after a phase)."""
    lines = []
    engine = records[0]["engine"]
    b = 2 if engine["dtype"] == "bfloat16" else 4
    flops_per_s = peaks["bfloat16" if b == 2 else "float32"]
    per_phase = defaultdict(list)  # phase -> one dict per rank
    for rec in records:
        for desc, phase in PHASES.items():
            calls = [c for c in rec["calls"] if c["desc"] == desc]
            if not calls:
                continue
            roofs = [rollout_roofline(c, shape, flops_per_s, peaks["read_bytes_per_s"], b)
                     for c in calls]
            per_phase[phase].append({
                "seconds": sum(c["seconds"] for c in calls),
                **{k: sum(r[k] for r in roofs) for k in roofs[0]}})
        u = update_roofline(rec["update"]["rows"], shape, peaks["float32"])
        per_phase["update"].append({"seconds": rec["update"]["seconds"], **u})
    mode = "eager" if engine["eager"] else "compiled"
    # the decode roofline takes a call's requests as one batch: say whether they were
    largest = max(len(c["prompts"]) * c["n"] for rec in records for c in rec["calls"])
    lines.append(f"{name}: vLLM {engine['dtype']} {mode}, engine start "
                 + ", ".join(f"{r['engine']['start_s']:.0f}" for r in records) + " s; largest "
                 f"call {largest} sequences, max_num_seqs {engine['max_num_seqs']}")
    for phase, ranks in per_phase.items():
        slow = max(ranks, key=lambda r: r["seconds"])
        if phase == "update":
            bound = slow["bound_s"]
            lines.append(f"| {name} | update | {slow['seconds']:.1f} | {slow['tokens']:,} | | "
                         f"{slow['tokens'] / slow['seconds']:.0f} | | {bound:.1f} | "
                         f"{bound / slow['seconds']:.0%} |")
            continue
        bound = slow["prefill_s"] + slow["decode_s"]
        lines.append(f"| {name} | {phase} | {slow['seconds']:.1f} | {slow['prompt_tokens']:,} | "
                     f"{slow['new_tokens']:,} | {slow['prompt_tokens'] / slow['seconds']:.0f} | "
                     f"{slow['new_tokens'] / slow['seconds']:.1f} | {slow['prefill_s']:.1f} + "
                     f"{slow['decode_s']:.1f} | {bound / slow['seconds']:.0%} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the out dir, from the launcher
    args, rest = p.parse_known_args()
    if args.worker:
        return worker(Path(args.worker), rest)
    peaks = ceilings()
    fp32, bf16 = (peaks[k] / 1e9 for k in ("float32", "bfloat16"))
    bf16_digits = 0 if bf16 >= 10 else 1  # an emulated bf16 (no AVX512-BF16 or AMX) reads 0.3
    print(f"one thread: fp32 matmul {fp32:.0f} GFLOP/s, bf16 matmul {bf16:.{bf16_digits}f} "
          f"GFLOP/s, read {peaks['read_bytes_per_s'] / 1e9:.1f} GB/s")
    shape = model_shape()
    print(f"model: N {shape['N'] / 1e6:.1f}M, E {shape['E'] / 1e6:.1f}M, L {shape['L']}, "
          f"h {shape['h']}, kv {shape['kv']} values a token")
    lines = ["| setting | phase | seconds | prompt tokens | new tokens | prompt tok/s | new tok/s "
             "| roofline s (prefill + decode) | roofline share |", "|---|---|---:|---:|---:|---:|"
             "---:|---:|---:|"]
    heads = []
    for name in args.settings:
        out = REPO / "runs" / "bench_phases" / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, f"--worker={out}", *SETTINGS[name]]
        print(f"# {name}: {' '.join(cmd[3:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        print(f"# {name}: {time.perf_counter() - t0:.0f} s, vLLM and model start included")
        records = [json.loads((out / f"phases_rank{r}.json").read_text()) for r in range(2)]
        head, *rows = table(name, records, peaks, shape)
        heads.append(head)
        lines += rows
    print("\n".join(heads + [""] + lines))


if __name__ == "__main__":
    main()
