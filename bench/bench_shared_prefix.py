"""Shared-prefix packing (engine.shared_prefix) against the unshared row, on CPU: row tokens,
forward + backward time and peak memory of one responder group; and memory_estimate's peak per GPU
for the paper's 7B recipe at long prompts, with and without sharing.

    python bench/bench_shared_prefix.py                      # the table: 2 models x P 2K/4K x G 4/8
    python bench/bench_shared_prefix.py --prompts 512 --groups 4 --models tiny   # a quick look
    python bench/bench_shared_prefix.py --memory             # the 7B recipe's memory estimate

One group: a prompt of P random tokens and G answers of 128..256 tokens (seeded). Both sides
compute the answers' log-probs with infra.packed_logprobs and backpropagate a weighted sum of them
through a random Llama:
  unshared  each (prompt, y_i) as its own sequence, one row per sequence (plain causal SDPA, which
            skips the masked half: the cheapest exact way on CPU, and the attention work
            flash-attn varlen does on a GPU); all G forwards run before the one backward, so the
            activations of all G (P + C) tokens are alive, as in one packed micro-batch.
  shared    spell.pack_sequences(shared=True): [prompt, y_1..y_G] with the dense (T, T) tree mask
            through SDPA, the CPU path. SDPA computes every (query, key) pair of the row, masked or
            not; FlexAttention on a GPU visits only the blocks with visible pairs ("pairs" counts
            those).
Peak memory is the process's high-water RSS during the step above the RSS before it (the kernel's
VmHWM, reset through /proc/self/clear_refs); the script re-executes itself with a fixed glibc mmap
threshold so that freed tensors go back to the OS and each step starts from a fair baseline.
Weights are excluded, their gradients and the mask included. Time: the least CPU time (all threads)
of --repeats steps, after a short warm-up step; wall time would count waiting on a shared machine.
The vocabulary is 1000: the LM head scores the same answer tokens on both sides.

Results: bench/RESULTS.md ("Shared-prefix packing").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # before torch allocates anything
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infra  # noqa: E402
import spell  # noqa: E402

MODELS = {  # name: (layers, hidden, intermediate, query heads, KV heads); head_dim 64
    "tiny": (2, 128, 256, 2, 1),
    "small": (4, 256, 512, 4, 2),
}
MiB = 1 << 20


def model(name: str, max_tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, heads, kv = MODELS[name]
    config = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=64, max_position_embeddings=max_tokens,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def rss_kib(field: str) -> int:
    """VmRSS or VmHWM of this process, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(step, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(least CPU time s, peak RSS above the start MiB, the step's log-probs) of `step`. CPU time
    (all threads) rather than wall time: on a shared machine, waiting for a core is not work."""
    best, peak = float("inf"), 0.0
    for _ in range(repeats):
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = rss_kib("VmRSS")
        t0 = time.process_time()
        values = step()
        best = min(best, time.process_time() - t0)
        peak = max(peak, (rss_kib("VmHWM") - before) / 1024)
    return best, peak, values


def unshared_step(m, prompt, answers, weights):
    """Today's layout: one row per (prompt, y_i), all forwards first, then one backward."""
    m.zero_grad(set_to_none=True)
    values = []
    for y in answers:
        values.append(infra.packed_logprobs(m, spell.pack_sequences([(prompt, y)]), 1.0)[0])
    values = torch.cat(values)  # (N,)
    (weights * values).sum().backward()
    return values.detach()


def shared_step(m, prompt, answers, weights):
    """The shared row with the dense tree mask."""
    m.zero_grad(set_to_none=True)
    packed = spell.pack_sequences([(prompt, y) for y in answers], shared=True)
    values = infra.packed_logprobs(m, packed, 1.0)[0]  # (N,), answers in order
    (weights * values).sum().backward()
    return values.detach()


# Qwen2.5-7B-Instruct's config.json, the numbers memory_estimate reads (test_infra.QWEN25_7B)
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, vocab_size=152064, intermediate_size=18944,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def memory_table(answer_tokens: int = 1024, group: int = 8) -> None:
    """config.toml (the paper's 7B recipe) on 8 GPUs of 80 GiB at longer prompts: memory_estimate's
    update phase with sequence parallelism 1, 2 and 4 (Ulysses: a row of k x micro_batch_tokens
    over k ranks; 8 does not divide Qwen2.5-7B's 28 query heads), the peak of both phases at
    SP 1, and the tokens one responder group costs the update, unshared and shared."""
    from transformers import Qwen2Config

    import infra

    degrees = (1, 2, 4)
    print(f"Qwen2.5-7B, config.toml, 8 x 80 GiB; a responder group of G = {group} answers of "
          f"{answer_tokens} tokens; rollout.max_new_tokens 4096; vLLM asleep in the update")
    print(f"{'prompt':>7} | {'longest micro-batch':>19} | {'update GiB at SP':>20} | "
          f"{'peak GiB':>8} | {'fits':>4} | {'update tokens / group':>29}")
    print(f"{'':>7} | {'tokens':>19} | " + " ".join(f"{k:>6}" for k in degrees)
          + f" | {'(SP 1)':>8} | {'':>4} | {'unshared':>9} {'shared':>9} {'x':>9}")
    for prompt in (16384, 32768, 65536, 131072):
        est = {}
        for k in degrees:
            cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
                f"--rollout.max_prompt_tokens={prompt}", f"--engine.sequence_parallel={k}"])
            est[k] = infra.memory_estimate(cfg, Qwen2Config(**QWEN25_7B), world=8,
                                           device_gib=80.0, longest=spell.longest_sequence(cfg))
        longest = max(cfg.engine.micro_batch_tokens, prompt + cfg.rollout.max_new_tokens)
        unshared, shared = group * (prompt + answer_tokens), prompt + group * answer_tokens
        print(f"{prompt:7d} | {longest:19d} | "
              + " ".join(f"{est[k]['update_phase']:6.1f}" for k in degrees)
              + f" | {est[1]['peak']:8.1f} | {'yes' if est[1]['peak'] <= 80 else 'no':>4} | "
              f"{unshared:9d} {shared:9d} {unshared / shared:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--prompts", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--groups", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); with 1, CPU time is free of OpenMP's "
                    "spin-waiting on a busy machine")
    ap.add_argument("--checkpointing", action="store_true",
                    help="HF gradient checkpointing, as the trainer")
    ap.add_argument("--memory", action="store_true",
                    help="only the 7B recipe's memory estimate at 16K-128K prompts, SP 1-4")
    args = ap.parse_args()
    if args.memory:
        return memory_table()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, SDPA, "
          f"gradient checkpointing {'on' if args.checkpointing else 'off'}")
    print(f"{'model':6} {'P':>5} {'G':>2} {'answer':>6} | {'row tokens':>13} | {'pairs (M)':>11} | "
          f"{'fwd+bwd cpu s':>15} | {'peak MiB':>17} | {'mask':>4} | {'max|dlp|':>8}")
    print(f"{'':6} {'':>5} {'':>2} {'tokens':>6} | {'unsh':>6} {'shared':>6} | "
          f"{'unsh':>5} {'shr':>5} | "
          f"{'unsh':>5} {'shr':>5} {'x':>3} | {'unsh':>5} {'shr':>5} {'x':>5} | {'MiB':>4} |")
    for name in args.models:
        for P in args.prompts:
            m = model(name, P + 256)
            if args.checkpointing:
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
                m.train()
            warm = torch.randint(0, 1000, (64,)).tolist()  # first calls pay one-off set-up costs
            shared_step(m, warm, [warm[:8]] * 2, torch.ones(16))
            unshared_step(m, warm, [warm[:8]] * 2, torch.ones(16))
            for G in args.groups:
                g = torch.Generator().manual_seed(P * 100 + G)
                prompt = torch.randint(0, 1000, (P,), generator=g).tolist()
                lengths = torch.randint(128, 257, (G,), generator=g).tolist()
                answers = [torch.randint(0, 1000, (c,), generator=g).tolist() for c in lengths]
                N = sum(lengths)
                weights = torch.randn(N, generator=g)
                t_u, m_u, v_u = measure(lambda: unshared_step(m, prompt, answers, weights),
                                        args.repeats)
                t_s, m_s, v_s = measure(lambda: shared_step(m, prompt, answers, weights),
                                        args.repeats)
                T_u, T_s = G * P + N, P + N
                pairs_u = sum((P + c) * (P + c + 1) // 2 for c in lengths)
                pairs_s = P * (P + 1) // 2 + sum(c * P + c * (c + 1) // 2 for c in lengths)
                print(f"{name:6} {P:5d} {G:2d} {N:6d} | {T_u:6d} {T_s:6d} | {pairs_u / 1e6:5.1f} "
                      f"{pairs_s / 1e6:5.1f} | {t_u:5.2f} {t_s:5.2f} {t_u / t_s:3.1f} | {m_u:5.0f} "
                      f"{m_s:5.0f} {m_u / m_s:5.1f} | {T_s * T_s / MiB:4.0f} | "
                      f"{float((v_u - v_s).abs().max()):.1e}", flush=True)


if __name__ == "__main__":
    main()
