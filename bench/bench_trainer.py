"""Throughput, MFU and peak memory of spell.update_policy on one GPU, without vLLM
(issue #13, item 2).

    python bench/bench_trainer.py               # GPU: Qwen2.5-7B-shaped policy, as many layers
                                                #      as fit, micro-batches of 16K and 32K tokens,
                                                #      sdpa|flex x torch|triton
    python bench/bench_trainer.py --check       # GPU: bf16 FSDP gradients vs the CPU fp32 path,
                                                #      small model
    python bench/bench_trainer.py --smoke       # any machine: tiny model, proves the script runs
                                                #      (CPU ok)
    python bench/bench_trainer.py --layers 8 --tokens 32768 --attn flex_attention --impl triton \\
        --repeats 5

What runs is main()'s trainer, piece for piece: spell.init_distributed (a world of one on a free
local port, nccl on GPU, gloo on CPU), a Qwen2ForCausalLM with fp32 master weights and random init
(Qwen2.5-7B's shapes: H 3584, MLP 18944, 28 query and 4 KV heads of 128, V 152064, untied head;
--layers of its 28), spell.shard_policy (FSDP2, bf16 compute, fp32 gradient reduction, gradient
checkpointing), AdamW with the recipe's lr and weight decay, and
spell.update_policy(policy, optimizer, seqs, cfg, 1, device) with cfg = spell.Config() but for
engine.micro_batch_tokens, engine.logprob_impl and engine.attn_implementation (resolved by
infra.attention_implementation, as main() does). seqs are what spell.training_sequences returns,
(prompt ids, completion ids, advantage, weight): random tokens, sequences of irregular lengths
that fill --micro-batches micro-batches of exactly T tokens, ~90 % prompt (long context, short
answers), weights from spell.LOSS_NORMS.

Reported per case: seconds per update (median of --repeats after one warm-up update, which holds
FlexAttention's compilation and AdamW's state allocation), tokens/s (prompt + completion tokens
through forward and backward), MFU, and torch.cuda.max_memory_allocated over the timed updates
(weights, AdamW state and all). MFU counts model FLOPs, not what the GPU executes (no credit for the
recomputation of gradient checkpointing or of the LM-head kernels): 6 x (decoder parameters) per
token, 6 H V per completion token (the LM head runs only there), and causal attention
6 L (heads x head_dim) n^2 per sequence of n tokens; divided by the bf16 dense matmul peak measured
in the same run (a large torch.mm). The optimizer step is inside the timed update; with only
--micro-batches micro-batches per update its share is larger than in a real step
(the paper's batch, 128 groups x 8 responses of up to 20K tokens, is tens of 32K micro-batches
per rank on 8 GPUs).

--check compares the step of the GPU's bf16 FSDP path with that of the CPU fp32 path (what spell.py
runs on CPU) on a small model, for every attention x log-prob choice. Without a GPU it compares
bf16 and fp32 FSDP on the CPU.
Needs torch, transformers, triton (GPU); no vLLM, no flash-attn, no network.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: import spell

import infra  # noqa: E402
import spell  # noqa: E402

GiB = 1 << 30
FULL_LAYERS = 28  # Qwen2.5-7B
# Qwen2.5-7B-Instruct's config.json (what tests/test_infra.py's QWEN25_7B holds), less the depth
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                 rms_norm_eps=1e-6, rope_theta=1e6)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, tie_word_embeddings=False)  # --smoke: head_dim 32
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1024, tie_word_embeddings=False)  # --check: head_dim 64


def model_config(shape: dict, layers: int, max_tokens: int) -> Qwen2Config:
    return Qwen2Config(**shape, num_hidden_layers=layers,
                       max_position_embeddings=max(32768, max_tokens))


def build_policy(config: Qwen2Config, cfg: spell.Config, mesh, param_dtype: torch.dtype,
                 init_on: torch.device, seed: int = 0):
    """main()'s policy: fp32 masters, the attention infra.attention_implementation picks,
    shard_policy. Random weights drawn on `init_on`: main() loads its checkpoint on the CPU and
    FSDP2 moves it to the mesh's device, as it does here for init_on = cpu (the same weights on
    every device: --check); init_on = the GPU draws 7B-shaped weights in seconds."""
    attn = infra.attention_implementation(cfg, on_gpu=mesh.device_type == "cuda")
    torch.manual_seed(seed)
    with init_on:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                 dtype=torch.float32)
    return spell.shard_policy(model, mesh, param_dtype=param_dtype,
                              gradient_checkpointing=cfg.engine.gradient_checkpointing,
                              compile_layers=cfg.engine.compile_layers)


def update_batch(T: int, micro_batches: int, vocab: int, cfg: spell.Config, seed: int,
                 prompt_share: float = 0.9) -> list[tuple]:
    """spell.training_sequences' tuples for `micro_batches` packed rows of exactly T tokens each.

    Each row holds 3 to 6 sequences of irregular lengths (0.4x to 1.6x their mean); each sequence is
    prompt_share prompt (+-5 points) and the rest completion. Redrawn until spell.plan_micro_batches
    (first-fit, longest first) packs them back into exactly `micro_batches` full rows.
    """
    g = torch.Generator().manual_seed(seed)
    for _ in range(1000):
        lengths = []
        for _ in range(micro_batches):
            k = int(torch.randint(3, 7, (1,), generator=g))
            w = 0.4 + 1.2 * torch.rand(k, generator=g)
            row = (w / w.sum() * T).long().clamp(min=2)
            row[-1] += T - row.sum()  # the rounding goes to the last sequence
            lengths += row.tolist()
        if len(spell.plan_micro_batches(lengths, T)) == micro_batches and min(lengths) >= 2:
            break
    else:
        raise RuntimeError(f"no draw of sequences packs into {micro_batches} rows of {T} tokens")
    share = prompt_share + 0.1 * (torch.rand(len(lengths), generator=g) - 0.5)
    completions = [max(1, min(n - 1, round(n * (1 - s)))) for n, s in zip(lengths, share.tolist())]
    # a responder group of G sequences per group id; the advantages' values do not change the cost
    groups = [i // cfg.rollout.group_size for i in range(len(lengths))]
    weights = spell.LOSS_NORMS[cfg.train.loss_norm](completions, groups, ["res"] * len(lengths),
                                                    cfg.rollout.max_new_tokens)
    advantages = torch.randn(len(lengths), generator=g).tolist()
    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    return [spell.Seq(ids(n - c), ids(c), a, w)
            for n, c, a, w in zip(lengths, completions, advantages, weights)]


def model_flops(config: Qwen2Config, seqs: list[tuple]) -> float:
    """Model FLOPs of one update (forward + backward = 3 x forward; no recomputation counted)."""
    H, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    decoder = L * infra.parameter_counts(config)["layer"]  # embedding lookups and the head excluded
    total = sum(len(p) + len(c) for p, c, *_ in seqs)
    completion = sum(len(c) for _, c, *_ in seqs)  # the LM head runs on completion positions only
    # causal: half of 12 L q n^2
    attention = 6 * L * q * sum((len(p) + len(c)) ** 2 for p, c, *_ in seqs)
    return 6 * decoder * total + 6 * H * V * completion + attention


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Measured dense matmul TFLOP/s of an n x n x n torch.mm in `dtype` (best of 5 x 20 calls)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):  # the first round warms up clocks and cuBLAS
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 20)
    return 2 * n**3 / best / 1e12


def layers_that_fit(T: int, device_gib: float) -> tuple[int, float]:
    """The most decoder layers (<= 28) whose update, by infra.memory_estimate at T tokens, fits in
    85 % of the device less 2 GiB (CUDA context, allocator slack)
    and SDPA's dense (T, T) bool mask."""
    cfg = spell.Config()
    # the larger LM-head scratch
    cfg.engine.micro_batch_tokens, cfg.engine.logprob_impl = T, "triton"
    budget = 0.85 * device_gib - 2 - T * T / GiB
    for layers in range(FULL_LAYERS, 0, -1):
        est = infra.memory_estimate(cfg, model_config(QWEN25_7B, layers, T), world=1,
                                    device_gib=device_gib, longest=spell.longest_sequence(cfg))
        if est["update_phase"] <= budget:  # no vLLM beside it (sleep_level 1 leaves it out anyway)
            return layers, est["update_phase"]
    raise SystemExit(f"not even one decoder layer fits at T = {T} on {device_gib:.0f} GiB; "
                     "lower --tokens")


def time_updates(policy, optimizer, seqs, cfg, device,
                 repeats: int) -> tuple[float, float | None, dict]:
    """(median seconds per update, peak GiB allocated or None on CPU, last stats)
    after one warm-up."""
    # FlexAttention compiles, AdamW allocates
    spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        stats = spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
    return statistics.median(times), peak, stats


def bench(args) -> None:
    _, world, device = spell.init_distributed(spell.Config())  # the default collective timeout
    assert world == 1, "one GPU: run with python, not torchrun"
    on_gpu = device.type == "cuda"
    if not on_gpu and not args.smoke:
        raise SystemExit("no GPU: a 7B-shaped update does not belong on a CPU; "
                         "--smoke runs a tiny model here")
    tokens = args.tokens or ([256, 512] if args.smoke else [16384, 32768])
    # flex: no CPU backward
    attns = args.attn or (["sdpa", "flex_attention"] if on_gpu else ["sdpa"])
    # triton on CPU is an emulator
    impls = args.impl or (["torch", "triton"] if on_gpu else ["torch"])
    # main(): bf16 compute on GPU, fp32 on CPU
    param_dtype = torch.bfloat16 if on_gpu else torch.float32
    if args.smoke:
        layers, shape, depth = args.layers or 2, TINY, "tiny model"
    else:
        device_gib = torch.cuda.get_device_properties(device).total_memory / GiB
        layers, est = ((args.layers, None) if args.layers
                       else layers_that_fit(max(tokens), device_gib))
        shape = QWEN25_7B
        depth = (f"{layers} of {FULL_LAYERS} layers of Qwen2.5-7B"
                 + (f" (as many as fit: memory_estimate {est:.1f} GiB at T = {max(tokens)} "
                    f"of {device_gib:.0f} GiB)" if est else " (--layers)"))
    config = model_config(shape, layers, max(tokens))
    name = (torch.cuda.get_device_name(device) if on_gpu
            else f"CPU ({torch.get_num_threads()} threads)")
    print(f"# spell.update_policy on one {'GPU' if on_gpu else 'CPU'}: {name}, "
          f"{datetime.date.today()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"# model: Qwen2ForCausalLM, random init, {depth}: H {config.hidden_size}, "
          f"MLP {config.intermediate_size}, "
          f"heads {config.num_attention_heads}/{config.num_key_value_heads}, "
          f"V {config.vocab_size}, untied; "
          f"{infra.parameter_counts(config)['total'] / 1e9:.3g}B parameters; "
          f"FLOPs count these {layers} layers")
    print(f"# FSDP2 world 1, params fp32, compute {str(param_dtype).removeprefix('torch.')}, "
          f"gradient checkpointing; AdamW; {args.micro_batches} micro-batches of T tokens "
          f"per update, ~90 % prompt; median of {args.repeats}")
    peak = None
    if on_gpu and not args.smoke:
        peak = matmul_peak(device, torch.bfloat16)
        print(f"# measured bf16 dense matmul peak (torch.mm 8192^3): {peak:.0f} TFLOP/s; "
              "MFU is against it")
    else:
        print("# no MFU: smoke run" if args.smoke else "# no MFU on CPU")
    print("\n| attention | logprob | T | seqs | s/update | tokens/s | TFLOP/s | MFU | peak GiB |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    mesh = init_device_mesh(device.type, (world,))
    for attn in attns:
        cfg = spell.Config()
        cfg.engine.attn_implementation = attn
        policy = build_policy(config, cfg, mesh, param_dtype, init_on=device)
        optimizer = spell.make_optimizer(policy, cfg)  # as spell.load_policy
        for T in tokens:
            seqs = update_batch(T, args.micro_batches, config.vocab_size, cfg, seed=T)
            n_tokens, flops = sum(len(p) + len(c) for p, c, *_ in seqs), model_flops(config, seqs)
            for impl in impls:
                cfg.engine.micro_batch_tokens, cfg.engine.logprob_impl = T, impl
                try:
                    sec, mem, stats = time_updates(policy, optimizer, seqs, cfg, device,
                                                   args.repeats)
                except torch.OutOfMemoryError:
                    policy.reshard()  # FSDP2: drop what the failed forward or backward had gathered
                    optimizer.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    print(f"| {attn} | {impl} | {T} | {len(seqs)} | OOM | | | | |", flush=True)
                    continue
                assert stats["micro_batches"] == args.micro_batches, stats
                tflops = flops / sec / 1e12
                mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
                print(f"| {attn} | {impl} | {T} | {len(seqs)} | {sec:.3f} | "
                      f"{n_tokens / sec:,.0f} | {tflops:.3g} | {mfu} | "
                      f"{'n/a' if mem is None else f'{mem:.1f}'} |", flush=True)
        del policy, optimizer
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# --check: the bf16 FSDP path's gradient against the fp32 one
# --------------------------------------------------------------------------------------------------

def sgd_step(config, cfg, seqs, device, param_dtype, mesh) -> dict[str, torch.Tensor]:
    """-(the step) of spell.update_policy with SGD at lr 1 and no clipping: the gradient,
    fp32 on CPU."""
    # same draw everywhere
    policy = build_policy(config, cfg, mesh, param_dtype, init_on=torch.device("cpu"))
    before = {n: p.full_tensor().detach().float().cpu().clone()
              for n, p in policy.named_parameters()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    spell.update_policy(policy, optimizer, seqs, cfg, 1, device)
    return {n: before[n] - p.full_tensor().detach().float().cpu()
            for n, p in policy.named_parameters()}


def check(args) -> None:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    # a world of one on a free local port, as spell.init_distributed makes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if on_gpu:
        torch.cuda.set_device(device)
    # both paths in one process: gloo for the CPU mesh's collectives, nccl for the GPU's
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    T, micro_batches, layers = 512, 2, 2
    config = model_config(SMALL, layers, T)
    cfg = spell.Config()
    # unclipped: the step is the gradient
    cfg.engine.micro_batch_tokens, cfg.train.grad_clip = T, math.inf
    seqs = update_batch(T, micro_batches, config.vocab_size, cfg, seed=1)
    cfg.engine.attn_implementation, cfg.engine.logprob_impl = "sdpa", "torch"
    ref = sgd_step(config, cfg, seqs, torch.device("cpu"), torch.float32,
                   init_device_mesh("cpu", (1,)))
    ref_max = max(g.abs().max().item() for g in ref.values())
    # Tolerance. bf16 keeps 8 significant bits: every rounding is off by at most u = 2^-8 = 3.9e-3
    # relative. The bf16 path rounds the weights once (FSDP's param_dtype) and every activation a
    # decoder layer makes, ~8 per layer forward (norm, q/k/v, attention, o_proj, residual, norm,
    # gate*up, down) and as many gradients backward, plus the embedding, final norm and logits:
    # k = 16 L + 4 roundings on a weight gradient's path; matmuls accumulate in fp32, so sum lengths
    # add nothing. To first order the relative errors add; independent ones add in quadrature,
    # sqrt(k) u. The maximum over ~10^6 entries sits a few of those deviations out, so we allow
    # 4 sqrt(k) u of max |grad|: 0.094 for 2 layers. On the dev CPU (bf16 FSDP against fp32, sdpa,
    # torch) the difference was 6.7e-3; with a packing bug planted (position ids that do not
    # restart, so sequences attend across their boundaries) it was 0.68.
    k = 16 * layers + 4
    tol = 4 * math.sqrt(k) * 2**-8
    heads = (f"{config.num_attention_heads}/{config.num_key_value_heads} of "
             f"{config.hidden_size // config.num_attention_heads}")
    print(f"# --check: {'GPU ' + torch.cuda.get_device_name(device) if on_gpu else 'CPU'}, "
          f"{datetime.date.today()}, torch {torch.__version__}; Qwen2 {layers} layers, "
          f"H {config.hidden_size}, heads {heads}, V {config.vocab_size}; "
          f"{len(seqs)} sequences in {micro_batches} micro-batches of {T}")
    print(f"# reference: CPU, FSDP2 fp32, sdpa, torch log-probs; max |grad| = {ref_max:.3e}; "
          f"tolerance 4 sqrt(16 L + 4) 2^-8 = {tol:.3f}")
    print("\n| device | compute | attention | logprob | max abs diff / max abs grad "
          "| worst tensor (own max) | ok |\n"
          "|---|---|---|---|---:|---|---|")
    # every fast path against the slow twins; on a CPU only the twins run
    # (FlexAttention has no CPU backward)
    cases = ([(a, i) for a in ("sdpa", "flex_attention") for i in ("torch", "triton")]
             if on_gpu else [("sdpa", "torch")])
    failed = False
    for attn, impl in cases:
        case = copy.deepcopy(cfg)
        case.engine.attn_implementation, case.engine.logprob_impl = attn, impl
        step = sgd_step(config, case, seqs, device, torch.bfloat16,
                        init_device_mesh(device.type, (1,)))
        rel = max((step[n] - g).abs().max().item() for n, g in ref.items()) / ref_max
        own = {n: (step[n] - g).abs().max().item() / g.abs().max().item() for n, g in ref.items()}
        worst = max(own, key=own.get)
        failed |= rel > tol
        print(f"| {device.type} | bf16 | {attn} | {impl} | {rel:.2e} | {worst} {own[worst]:.2e} | "
              f"{'yes' if rel <= tol else 'NO'} |", flush=True)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"gradient check failed: some path is further than {tol:.3f} "
                         "from the fp32 reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model and rows: proves the script runs (CPU ok)")
    ap.add_argument("--check", action="store_true",
                    help="bf16 FSDP gradients vs the CPU fp32 path, small model")
    ap.add_argument("--layers", type=int,
                    help="decoder layers of 28 (default: as many as fit at the largest T)")
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="micro-batch sizes T (default 16384 32768)")
    ap.add_argument("--micro-batches", type=int, default=2, help="full micro-batches per update")
    ap.add_argument("--attn", nargs="+", choices=["sdpa", "flex_attention", "flash_attention_2"])
    ap.add_argument("--impl", nargs="+", choices=["torch", "triton"], help="engine.logprob_impl")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed updates per case (after one warm-up)")
    args = ap.parse_args()
    check(args) if args.check else bench(args)


if __name__ == "__main__":
    main()
