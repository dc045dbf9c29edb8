"""Ulysses sequence parallelism's own cost on CPU: SP 1 against SP 2 on the same micro-batches.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/torchrun --standalone --nproc_per_node=2 \
        bench/bench_sp_cpu.py                        # 2 rows of 2048 tokens, 3 repeats
    ... bench/bench_sp_cpu.py --tokens 512 --repeats 2    # a quick check that it runs
    ... bench/bench_sp_cpu.py --sharding fsdp             # the policy under FSDP2, as main() has it

Two ranks, the same rows, the same total tokens, one step of spell.update_policy each:
  SP 1  data parallel: each rank trains its own packed row (one micro-batch a step).
  SP 2  the two ranks one Ulysses group (infra.enable_sequence_parallel): both train every row,
        each encoding half of it, heads traded around attention by two all-to-alls a layer
        (two micro-batches a step, each half a row per rank).
A row is one group as the quickstart makes them: a prompt of 3/4 of --tokens and 4 answers of
1/16 each (1536 + 4 x 128 at the default 2048), shared-prefix packed (engine.shared_prefix).

Model: a LlamaForCausalLM of SmolLM2-135M's size, random weights, fp32, SDPA, gradient
checkpointing on (--checkpointing off turns it off; demo.toml runs the CPU demo without it).
SmolLM2-135M itself cannot take SP 2: its 9 query heads do not divide by 2 (infra.check_heads), so
the model here has 8 query heads and 2 KV heads of 64 (hidden 512) in place of 9 and 3 (hidden
576); the 30 layers, MLP 1536, vocabulary 49152 (tied), RoPE theta 1e5 are SmolLM2's.

Reported per configuration, over --repeats interleaved steps (SP 1, SP 2, SP 1, ...) after one
warm-up step each: the seconds of the update step (best and median; a step's time is the slower
rank's), the bytes each rank passed to write-like system calls during the step (/proc/self/io
wchar, as test_infra.py's test_sp_exchange_traffic: gloo's socket writes), the all-to-all calls
(infra.exchange) a step, and the all-to-all bytes one rank puts in per layer per forward
(4 x infra.exchange_elements). Predicted writes a step: that x layers x rows x passes (forward,
backward, and the checkpointing's recompute) x (k - 1)/k, the share that leaves the rank.

Left out: rollouts, weight sync, the optimiser's cost (SGD at lr 0: the step's clip and update are
timed but nearly free), and with --sharding none (the default) any gradient synchronisation: the
model is replicated on each rank and its gradients are not reduced, so what differs between the
two configurations is sequence parallelism alone. With --sharding fsdp the policy is
spell.shard_policy's over both ranks: its all-gathers and reduce-scatters run once per
micro-batch, so SP 2 (two micro-batches a step) pays them twice; they dominate the bytes. The
all_gather_objects of spell.sequence_parallel_batch (the rows' token ids to the group) runs once,
before the steps. Two cores shared by two ranks: the times are those of a busy laptop-class
machine, compare them only within one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infra  # noqa: E402
import spell  # noqa: E402

# SmolLM2-135M's shape with 8 query and 2 KV heads (9 and 3 cannot split over 2 ranks)
SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=30, intermediate_size=1536, vocab_size=49152,
             max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
ANSWERS = 4  # a group's answers (demo.toml's rollout.group_size)


def wchar() -> int:
    """Bytes this process has passed to write-like system calls (its sockets among them)."""
    return int(Path("/proc/self/io").read_text().split("wchar:")[1].split()[0])


def build_model():
    """The random-weight Llama, the same weights on every rank and for every configuration."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).float()
    infra.check_heads(config.num_attention_heads, config.num_key_value_heads, 2)
    return model


def make_policy(checkpointing: bool, sharding: str, world: int):
    """The policy as spell.load_policy makes it (shard_policy), or replicated: the same
    checkpointing, train mode and completion_logprobs method, without FSDP2."""
    model = build_model()
    if sharding == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        return spell.shard_policy(model, init_device_mesh("cpu", (world,)),
                                  param_dtype=torch.float32, gradient_checkpointing=checkpointing)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    infra.train_mode_without_dropout(model)
    model.completion_logprobs = types.MethodType(infra.completion_logprobs, model)
    return model


def make_rows(rows: int, tokens: int) -> list[list[spell.Seq]]:
    """`rows` groups of one prompt and ANSWERS answers, each exactly `tokens` tokens packed."""
    g = torch.Generator().manual_seed(1)
    answer = tokens // 16
    prompt = tokens - ANSWERS * answer
    vocab = SHAPE["vocab_size"]
    weight = 1.0 / (rows * ANSWERS * answer)  # Eq. 12 with one normaliser for the batch
    out = []
    for _ in range(rows):
        p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        out.append([spell.Seq(p, torch.randint(0, vocab, (answer,), generator=g).tolist(),
                              advantage=float(torch.randn(1, generator=g)), weight=weight)
                    for _ in range(ANSWERS)])
    return out


def header(args, world: int) -> str:
    """Date, CPU, cores, versions, load: what the times depend on."""
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "?")
    return (f"# {datetime.datetime.now().isoformat(timespec='seconds')} | {model} | "
            f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable) | torch "
            f"{torch.__version__}, transformers {transformers.__version__} | load (1 min) "
            f"{os.getloadavg()[0]:.2f} | {world} ranks x {torch.get_num_threads()} threads\n"
            f"# model: Llama of SmolLM2-135M's size with 8 query / 2 KV heads of 64 (hidden 512; "
            f"SmolLM2's 9 heads do not split over 2), 30 layers, fp32, SDPA, checkpointing "
            f"{args.checkpointing}, sharding {args.sharding}; {args.rows} rows of {args.tokens} "
            f"tokens ({args.tokens - ANSWERS * (args.tokens // 16)} prompt + {ANSWERS} x "
            f"{args.tokens // 16}), {args.repeats} repeats")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of one packed row")
    ap.add_argument("--rows", type=int, default=2, help="packed rows a step (a multiple of 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--checkpointing", choices=("on", "off"), default="on")
    ap.add_argument("--sharding", choices=("none", "fsdp"), default="none",
                    help="none: replicated, no gradient sync; fsdp: spell.shard_policy")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run under torchrun --nproc_per_node=2"
    assert args.rows % world == 0 and args.tokens % 32 == 0, "rows by 2, tokens by 32"
    checkpointing = args.checkpointing == "on"
    infra.print0(header(args, world))

    calls = {"n": 0, "bytes": 0}  # infra.exchange's calls and buffer bytes, as the test counts
    exchange = infra.exchange

    def counting(x, group):
        calls["n"] += 1
        calls["bytes"] += x.numel() * x.element_size()
        return exchange(x, group)

    infra.exchange = counting
    rows = make_rows(args.rows, args.tokens)
    setups = {}
    for k in (1, 2):
        policy = make_policy(checkpointing, args.sharding, world)
        if k > 1:  # collective: every rank, the same point (as load_policy)
            infra.enable_sequence_parallel(policy, infra.sp_group(world, k), "sdpa")
        cfg = spell.Config()
        cfg.engine.shared_prefix, cfg.engine.sequence_parallel = True, k
        cfg.engine.micro_batch_tokens = args.tokens // k  # row_budget = one row of --tokens
        cfg.train.grad_clip = 1e9
        # this rank's rows, dealt as whole groups; under SP 2 the group gathers them (main())
        mine = [s for row in rows[rank::world] for s in row]
        seqs = spell.sequence_parallel_batch(mine, policy)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        setups[k] = (policy, optimizer, seqs, cfg)

    def step(k: int) -> tuple[float, int, int]:
        """One update_policy step of configuration k: (seconds, bytes written, exchange calls)."""
        policy, optimizer, seqs, cfg = setups[k]
        dist.barrier()
        calls.update(n=0, bytes=0)
        before, t0 = wchar(), time.perf_counter()
        spell.update_policy(policy, optimizer, seqs, cfg, world, torch.device("cpu"))
        seconds, written = time.perf_counter() - t0, wchar() - before
        return seconds, written, calls["n"]

    results = {k: [] for k in setups}
    for k in setups:  # warm-up, untimed
        step(k)
    for r in range(args.repeats):
        for k in setups:
            results[k].append(infra.all_gather_objects(step(k)))  # every rank's
            infra.print0(f"# repeat {r + 1}: SP {k} {max(s for s, _, _ in results[k][-1]):.2f} s")
    infra.exchange = exchange

    if rank == 0:
        layers, passes = SHAPE["num_hidden_layers"], 3 if checkpointing else 2
        q, kv, d = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
        print("\n| config | rows a rank encodes a step | s/step best | s/step median | "
              "written/step rank 0, rank 1 (MB) | all-to-all calls/step | all-to-all in, "
              "predicted (MB/layer/forward) | predicted written/step (MB) | written / predicted |")
        print("|---|---|---|---|---|---|---|---|---|")
        times = {}
        for k, runs in results.items():
            times[k] = [max(s for s, _, _ in per_rank) for per_rank in runs]
            written = [statistics.median(w[i][1] for w in runs) for i in range(world)]
            n_calls = runs[-1][0][2]
            per_layer = 4 * infra.exchange_elements(args.tokens, k, q, kv, d) if k > 1 else 0
            predicted = per_layer * layers * passes * args.rows * (k - 1) / k
            share = f"{args.rows // world} whole" if k == 1 else f"{args.rows} halves"
            print(f"| SP {k} | {share} ({args.tokens * args.rows // world} tokens) | "
                  f"{min(times[k]):.2f} | {statistics.median(times[k]):.2f} | "
                  f"{written[0] / 1e6:.2f}, {written[1] / 1e6:.2f} | {n_calls} | "
                  f"{per_layer / 1e6:.2f} | {predicted / 1e6:.2f} | "
                  f"{f'{written[0] / predicted:.4f}' if predicted else '-'} |")
        ratio = statistics.median(times[2]) / statistics.median(times[1])
        print(f"\n# SP 2 / SP 1, median step time: {ratio:.2f}; load (1 min) at the end "
              f"{os.getloadavg()[0]:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
