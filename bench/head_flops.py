"""FLOPs of one update micro-batch with the LM head in two passes and in one (spell.fused_head),
on a Qwen2.5-7B-shaped policy (H 3584, V 152064, 28 layers), one packed row of T = 16K-128K tokens.

    python bench/head_flops.py                      # T = 16K, 32K, 64K, 128K (about a minute)
    python bench/head_flops.py --tokens 4096 --layers 2

What is counted, and how. The decoder runs the project's own code (infra.packed_logprobs on a
packed row, then the backward of a weighted sum of the log-probs, gradient checkpointing on as in
spell.shard_policy) under fake tensors (shapes only: no memory, no values) and
torch.utils.flop_counter.FlopCounterMode. The LM head in that run is the chunked torch twin, whose
GEMMs the counter sees: 8 N H V for N targets (2 forward, 2 recompute, 4 for dX and dW). The
Triton head, on either path, is invisible to the counter (it sees no Triton kernel), so its FLOPs
come from the kernels' formulas (kernels/logprob.py): two passes 8 N H V, like the twin; one pass
6 N H V (the logits of the forward feed dZ directly, no recompute). The decoder's count is the
twin run's minus the twin's 8 N H V, which the script also counts alone and checks.

Attention: on the CPU, SDPA runs torch's CPU flash kernel, for which the counter has no formula, so
the counted decoder has no attention FLOPs; they are added from the causal formula, per layer
2 T^2 Hq d in the forward (Q K^T and P V over the T (T + 1) / 2 visible pairs), twice that in the
backward, and the forward again when checkpointing recomputes it: 8 T^2 Hq d per layer in all.
(FlashAttention's backward also recomputes Q K^T, which model-FLOP counts leave out, as here.)

The row: one sequence, a 1-token prompt and T - 1 completion tokens, so the head runs on N = T - 1
targets: the most the one-pass head can save. In a self-play row most tokens are the prompt's
documents and only the G answers' tokens reach the head: the saving is 2 N H V for those N.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import infra  # noqa: E402
import kernels  # noqa: E402
import spell  # noqa: E402

# Qwen2.5-7B-Instruct (config.toml's model)
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
               rope_theta=1e6, tie_word_embeddings=False)


def counted(fn) -> int:
    """FLOPs torch's counter sees while fn() runs, the in-place addmm_ included (the twin's dW
    accumulation; the counter knows only the out-of-place addmm)."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # (m, k) @ (k, n)

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        fn()
    return counter.get_total_flops()


def micro_batch_flops(tokens: int, layers: int) -> dict:
    """The counted FLOPs of one micro-batch's forward and backward through the torch twin head, and
    of that head alone, on a fake Qwen2.5-7B shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**QWEN_7B, "num_hidden_layers": layers,
                            "max_position_embeddings": max(tokens, 131072)},
                         attn_implementation="sdpa")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Qwen2ForCausalLM(config)  # fp32: FLOPs do not depend on the dtype
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        infra.train_mode_without_dropout(model)
        packed = spell.pack_sequences([([0], [1] * (tokens - 1))])
        n = len(packed["targets"])
        weights = torch.full((n,), 1.0 / n)

        def step():
            logp = infra.packed_logprobs(model, packed, 0.7, "torch")[0]  # (N,)
            (-(weights * logp).sum()).backward()

        total = counted(step)
        hidden = torch.zeros(n, config.hidden_size, requires_grad=True)
        head_weight = model.lm_head.weight

        def head():
            logp = kernels.chunked_logprob(hidden, head_weight, packed["targets"], 0.7)[0]
            (weights * logp).sum().backward()

        head_alone = counted(head)
    return {"total": total, "head": head_alone, "n": n, "config": config}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="16384,32768,65536,131072")
    parser.add_argument("--layers", type=int, default=QWEN_7B["num_hidden_layers"])
    args = parser.parse_args()
    print("| T | N | decoder linear TF (counted) | attention TF (causal formula) | "
          "head two-pass 8NHV TF | head one-pass 6NHV TF | micro-batch two-pass TF | "
          "one-pass TF | saved |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in map(int, args.tokens.split(",")):
        r = micro_batch_flops(tokens, args.layers)
        c, n = r["config"], r["n"]
        h, v = c.hidden_size, c.vocab_size
        assert r["head"] == 8 * n * h * v, (r["head"], 8 * n * h * v)  # the twin's GEMMs, seen
        decoder = r["total"] - r["head"]
        head_dim = c.hidden_size // c.num_attention_heads
        attention = 8 * tokens ** 2 * c.num_attention_heads * head_dim * c.num_hidden_layers
        two, one = decoder + attention + 8 * n * h * v, decoder + attention + 6 * n * h * v
        tf = lambda x: f"{x / 1e12:,.1f}"  # noqa: E731
        print(f"| {tokens:,} | {n:,} | {tf(decoder)} | {tf(attention)} | {tf(8 * n * h * v)} | "
              f"{tf(6 * n * h * v)} | {tf(two)} | {tf(one)} | {100 * (two - one) / two:.1f}% |")


if __name__ == "__main__":
    main()
