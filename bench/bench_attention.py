"""Peak memory and time of packed attention: SDPA's dense mask vs FlexAttention's BlockMask.

    python bench/bench_attention.py            # GPU: Qwen2.5-7B-shaped decoder layer, bf16,
                                               # rows of 16K/32K/64K
    python bench/bench_attention.py --smoke    # any machine: a tiny layer, rows of 256/512 tokens
                                               # (does it run?)
    python bench/bench_attention.py --layers 2 --tokens 16384 32768 --seqs 8 --repeats 5

The trainer packs several sequences into one row with position_ids restarting at 0
(spell.pack_sequences), and HF attention finds the sequence boundaries there
(infra.attention_implementation):
  sdpa               builds a dense (T, T) block-diagonal causal mask: O(T^2) memory (4 GiB at 64K)
  flex_attention     builds a BlockMask from the sequence ids and runs torch's
                     FlexAttention (compiled)
  flash_attention_2  flash-attn varlen over cu_seqlens, benchmarked only when
                     flash-attn is installed

What runs: forward + backward of an HF Qwen2Model (random weights, Qwen2.5-7B shapes: H 3584,
28 query and 4 KV heads of 128, MLP 18944, RoPE theta 1e6) on one packed row of T tokens cut into
S sequences of irregular lengths; the loss is the sum of squares of the last hidden state. The
vocabulary is 1024, so the embedding is negligible and what is measured is the decoder layers.
Time is the median of --repeats runs after one warm-up (which holds FlexAttention's compilation);
peak memory is the highest allocation during a run above what was allocated before it (weights
excluded, their gradients and the mask included). Before timing, each choice is compared with SDPA
on a short row.

On a CPU, FlexAttention has no backward (torch 2.13), so there every choice is timed forward only
(and SDPA forward + backward as well), and memory is not measured.
Needs torch, transformers (and triton on a GPU); no network, no vLLM.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2Model

GiB = 1 << 30


def qwen_layers(layers: int, smoke: bool, max_tokens: int) -> Qwen2Config:
    """Qwen2.5-7B-Instruct's decoder shapes
    (or a tiny model with the same head layout for --smoke)."""
    if smoke:
        # 7 query heads per KV head, as in Qwen2.5-7B (28 / 4), and a non-power-of-two head count
        shape = dict(hidden_size=224, intermediate_size=512, num_attention_heads=7,
                     num_key_value_heads=1)
    else:
        shape = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_key_value_heads=4)
    return Qwen2Config(**shape, num_hidden_layers=layers, vocab_size=1024,
                       max_position_embeddings=max_tokens,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=False)


def packed_row(tokens: int, seqs: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and position_ids (1, T) of `seqs` sequences of irregular lengths
    (0.5x to 1.5x the mean)."""
    g = torch.Generator().manual_seed(tokens)
    weights = 0.5 + torch.rand(seqs, generator=g)
    lengths = (weights / weights.sum() * tokens).long().clamp(min=1)
    lengths[-1] += tokens - lengths.sum()  # the rounding goes to the last sequence
    # restarts at 0 per sequence
    position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()])
    input_ids = torch.randint(0, vocab, (tokens,), generator=g)
    return input_ids[None].to(device), position_ids[None].to(device)


def step(model, input_ids, position_ids, backward: bool) -> torch.Tensor:
    """One forward (+ backward of the output's sum of squares); returns the output (1, T, H)."""
    with torch.set_grad_enabled(backward):
        out = model(input_ids=input_ids, position_ids=position_ids,
                    use_cache=False).last_hidden_state
        # the gradient 2 out is dense and differs per token, and needs no extra (T, H) buffer
        if backward:
            out.square().sum().backward()
    return out.detach()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def agreement(model, impl, input_ids, position_ids, backward: bool) -> str:
    """Max |difference| with SDPA of the output and of the parameter gradients, each relative to
    SDPA's largest entry. bf16 rounds at 2^-8 = 4e-3 relative, so a few 1e-3 to 1e-2 is agreement;
    a sequence that attends across a boundary shows as O(1)."""
    results = []
    for attn in ("sdpa", impl):
        model.set_attn_implementation(attn)
        model.zero_grad(set_to_none=True)
        out = step(model, input_ids, position_ids, backward).float()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (ref, ref_grads), (out, grads) = results
    text = f"out {((out - ref).abs().max() / ref.abs().max()).item():.1e}"
    if backward:
        worst = max(((grads[n] - g).abs().max() / g.abs().max()).item()
                    for n, g in ref_grads.items())
        text += f", grads {worst:.1e}"
    model.zero_grad(set_to_none=True)
    return text


def measure(model, input_ids, position_ids, backward: bool, repeats: int,
            device) -> tuple[float, float | None]:
    """(median milliseconds, peak GiB above the allocation before the call, None on CPU)
    of `step`."""
    model.zero_grad(set_to_none=True)
    step(model, input_ids, position_ids, backward)  # warm-up: FlexAttention compiles here
    times, peak = [], None
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        step(model, input_ids, position_ids, backward)
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
    model.zero_grad(set_to_none=True)
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny layer and rows: proves the script runs (CPU ok)")
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="row lengths T (default 16384 32768 65536)")
    ap.add_argument("--seqs", type=int, default=6, help="sequences per packed row")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=2048,
                    help="row length of the agreement check")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or ([256, 512] if args.smoke else [16384, 32768, 65536])
    check_tokens = min(args.check_tokens, min(tokens))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = ["sdpa", "flex_attention"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")

    config = qwen_layers(args.layers, args.smoke, max(tokens))
    torch.manual_seed(0)
    with device:
        model = Qwen2Model(config).to(dtype)
    model.train()  # as the trainer runs it (dropout is 0 in Qwen2 configs)
    name = (torch.cuda.get_device_name() if device.type == "cuda"
            else f"CPU ({torch.get_num_threads()} threads)")
    print(f"# Packed attention: {name}, {datetime.date.today()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"# {args.layers} decoder layer(s), H {config.hidden_size}, "
          f"heads {config.num_attention_heads}/{config.num_key_value_heads} "
          f"of {config.hidden_size // config.num_attention_heads}, MLP {config.intermediate_size}, "
          f"{dtype}, {args.seqs} sequences per row, median of {args.repeats}\n")

    for impl in impls[1:]:
        # FlexAttention: no CPU backward
        backward = device.type == "cuda" or impl != "flex_attention"
        ids, pos = packed_row(check_tokens, args.seqs, config.vocab_size, device)
        print(f"{impl} vs sdpa at T = {check_tokens}: {agreement(model, impl, ids, pos, backward)}")

    # on a GPU every choice runs forward + backward; on a CPU all run forward only
    # (comparable rows), and those with a CPU backward run forward + backward too
    print("\n| attention | T | pass | ms | peak GiB |\n|---|---:|---|---:|---:|")
    for t in tokens:
        ids, pos = packed_row(t, args.seqs, config.vocab_size, device)
        for impl in impls:
            model.set_attn_implementation(impl)
            passes = ([True] if device.type == "cuda"
                      else [False] + ([True] if impl != "flex_attention" else []))
            for backward in passes:
                try:
                    ms, peak = measure(model, ids, pos, backward, args.repeats, device)
                    row = f"{ms:.1f} | {'n/a' if peak is None else f'{peak:.2f}'}"
                except torch.OutOfMemoryError:
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    row = "OOM | OOM"
                print(f"| {impl} | {t} | {'fwd+bwd' if backward else 'fwd'} | {row} |", flush=True)


if __name__ == "__main__":
    main()
