"""The policy update's layout on a small world (issue #29, item 1): FSDP2 against its neighbours.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/torchrun --standalone --nproc_per_node=2 \
        bench/bench_update_layout.py               # demo.toml's shapes, 4 micro-batches, 3 repeats
    ... bench/bench_update_layout.py --prompt-tokens 100 150 --answer-tokens 10 20 \
        --micro-batch-tokens 256 --repeats 1       # a quick check that it runs
    ... bench/bench_update_layout.py --layouts fsdp replica    # a subset (the first: the reference)

Two ranks, the same micro-batches, the same starting weights, one full optimiser step each
(forward and backward over the rank's micro-batches, the gradient's reduction over the ranks,
the clip at train.grad_clip, AdamW at train.lr), in four layouts:
  fsdp             spell.shard_policy as main() runs it (spell.load_policy): fully_shard per decoder
                   layer and the root over the mesh infra.policy_mesh makes at
                   engine.fsdp_shard_size = 0, one step of spell.update_policy. Per micro-batch
                   every layer's weights are all-gathered for the forward and again for the
                   backward, and its gradient reduce-scattered.
  fsdp_no_reshard  the same, then FSDPModule.set_reshard_after_forward(False) on the root and every
                   layer (shard_policy has no switch for it; the runtime setter is equivalent to
                   fully_shard(..., reshard_after_forward=False)): the weights gathered for the
                   forward stay gathered for the backward, one all-gather a layer per micro-batch
                   fewer, and a rank holds the whole model while its micro-batch runs.
  hsdp1            engine.fsdp_shard_size = 1 through shard_policy: the mesh (2, 1), shard groups of
                   one rank, so each rank holds a full replica (nothing to all-gather), and
                   update_policy has FSDP2 all-reduce every layer's gradient across the replicas
                   once a step, in the last micro-batch's backward (set_requires_all_reduce).
  hsdp1_each       the same, all-reducing after every micro-batch, as update_policy did before
                   2026-11-25 (its set_requires_all_reduce calls ignored).
  replica          no FSDP: each rank a plain HF model (completion_logprobs attached as a method,
                   as bench_sp_cpu.py does), gradients accumulated locally over the micro-batches
                   and all-reduced ONCE a step as one flat fp32 bucket that every .grad is a view
                   of (DDP's gradient_as_bucket_view, without DDP's overlap).
                   update_policy cannot run this layout: nothing would reduce the gradient, so
                   replica_step here repeats its loop (spell.plan_update, spell.micro_batch_loss
                   and (loss * world).backward() per micro-batch), reduces the bucket itself
                   (sum / world, FSDP's mean), then clips and steps as update_policy does.

Micro-batches as the CPU quickstart (demo.toml) makes them: SmolLM2-135M-Instruct's real weights
from .cache/ in fp32, SDPA, engine.gradient_checkpointing, engine.micro_batch_tokens, lr and clip
from demo.toml; responder groups of one prompt and rollout.group_size answers, shared-prefix packed
(engine.shared_prefix), prompts of 1,200-1,500 tokens and answers of 60-190 (drawn until a group
fits one micro-batch), both cut from the demo corpus's documents tokenised (real text, not model
samples), the advantages standardised random numbers per group, the weights train.loss_norm's.
The --groups groups are dealt to the ranks in turn (2 each by default: 2 micro-batches a rank).

Reported per layout, over --repeats interleaved steps (fsdp, fsdp_no_reshard, hsdp1, replica,
fsdp, ...) after one warm-up step each: the seconds of the step (best and median; a step's time is
the slower rank's), the bytes each rank passed to write-like system calls during the step
(/proc/self/io wchar: gloo's socket writes), and, from the warm-up step (every layout's first, from
the same weights and inputs), the largest absolute difference of the gradient to the first
layout's, with that gradient's largest absolute value, the scale: "reduced", after the reduction
over the ranks, as the clip gets it (the bench stands in for torch.nn.utils.clip_grad_norm_ in
that step to read it), and "clipped", as the optimiser gets it (DTensors gathered with
full_tensor); and the global norm each layout's clip computed. The bound is the parity test's
(test_update_policy_on_two_ranks_equals_one_rank, AdamW with an active clip):
8 sqrt(L) u32 scale, L the longest sum in the gradient, the LM head's V = 49,152 terms here (the
test's V = 1000), u32 = 2^-24. The layouts sum the same per-rank gradients in another order (per
micro-batch over ranks, then over micro-batches; or the reverse) and the clip's global norm in
other pieces, so they should differ by a few roundings, far inside it.

Left out: rollouts and weight sync; loading and sharding the model (before the steps); and the
memory side, except one peak RSS per rank for all layouts together (they live in both processes
at once so that their steps can interleave): fsdp_no_reshard holds a full gathered model while a
micro-batch runs; hsdp1 holds the full weights and AdamW's two moments on each rank, its gradient
during a step (3-4 x the model's fp32 bytes, 0.54 GB for SmolLM2-135M), replica the same with its
bucket kept between steps (4 x); FSDP2 over 2 ranks half of that. replica overlaps nothing: its
one all-reduce waits for the last backward (DDP would start buckets during it). Two cores shared
by two ranks, one thread each: the times are those of a busy laptop-class machine, compare them
only within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import infra  # noqa: E402
import spell  # noqa: E402

MODEL_DIR = ROOT / ".cache" / "SmolLM2-135M-Instruct"
CPU = torch.device("cpu")
CLIP = torch.nn.utils.clip_grad_norm_


def wchar() -> int:
    """Bytes this process has passed to write-like system calls (its sockets among them)."""
    return int(Path("/proc/self/io").read_text().split("wchar:")[1].split()[0])


# ---- the layouts: each builds the policy on this rank, from the same weights


def load_model(cfg):
    """SmolLM2-135M-Instruct as spell.load_policy loads it: fp32 masters, the config's attention."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config, _ = infra.model_config(str(MODEL_DIR), cfg.model.rope_scaling)
    return transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, config=config, dtype=torch.float32,
        attn_implementation=infra.attention_implementation(cfg, False))


def sharded(cfg, world: int):
    """spell.shard_policy over infra.policy_mesh: FSDP2, or HSDP with engine.fsdp_shard_size."""
    return spell.shard_policy(load_model(cfg), infra.policy_mesh(cfg, "cpu", world),
                              param_dtype=spell.compute_dtype(CPU),
                              gradient_checkpointing=cfg.engine.gradient_checkpointing)


def sharded_no_reshard(cfg, world: int):
    """shard_policy's FSDP2, its gathered weights kept from the forward to the backward."""
    policy = sharded(cfg, world)
    policy.set_reshard_after_forward(False)  # the root and, recursively, every decoder layer
    return policy


def sharded_reduce_each(cfg, world: int):
    """shard_policy's HSDP as update_policy ran it before it deferred the all-reduce across
    replicas to each step's last micro-batch: its calls to set_requires_all_reduce are ignored, so
    every micro-batch's backward all-reduces every layer's gradient."""
    policy = sharded(cfg, world)
    policy.set_requires_all_reduce = lambda *args, **kwargs: None  # on this instance only
    return policy


def replica(cfg, world: int):
    """A plain model: what shard_policy does to it but the sharding; its gradients live in one
    flat bucket, (P,) fp32, each parameter's .grad a view of it (DDP's gradient_as_bucket_view):
    the backward accumulates into it in place, and the bucket is what is all-reduced."""
    model = load_model(cfg)
    if cfg.engine.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    infra.train_mode_without_dropout(model)
    model.completion_logprobs = types.MethodType(infra.completion_logprobs, model)
    params = list(model.parameters())  # the tied embedding once
    model.grad_bucket = torch.zeros(sum(p.numel() for p in params))  # (P,)
    for p, view in zip(params, model.grad_bucket.split([p.numel() for p in params])):
        p.grad = view.view_as(p)
    return model


def replica_step(policy, optimizer, seqs: list[spell.Seq], cfg, world: int,
                 device: torch.device) -> dict:
    """spell.update_policy's step for plain replicas: its micro-batch loop, then one all-reduce of
    the accumulated gradient before its clip and optimiser step."""
    t = cfg.train
    assert t.ppo_epochs == 1 and t.mini_batches == 1, "one on-policy step, as in demo.toml"
    plans, _ = spell.plan_update(seqs, cfg, device)
    for mb in plans[0]:
        loss, _, _ = spell.micro_batch_loss(policy, mb or [spell.dummy_sequence()], None, cfg,
                                            device)
        assert torch.isfinite(loss), f"non-finite loss {loss.item()}"
        (loss * world).backward()  # as update_policy: the mean over ranks is then the sum
    bucket = policy.grad_bucket  # (P,): every .grad a view of it (replica)
    assert all(p.grad.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
               for p in policy.parameters()), "the backward replaced a .grad: not in the bucket"
    dist.all_reduce(bucket)  # a sum: gloo has no mean
    bucket /= world  # FSDP's mean of (loss * world)'s gradients: the global loss's
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
    optimizer.step()
    bucket.zero_()  # zero_grad, keeping the views
    return {"grad_norm": float(grad_norm)}


# name -> (engine.fsdp_shard_size, how the policy is built, its update step)
LAYOUTS = {
    "fsdp": (0, sharded, spell.update_policy),
    "fsdp_no_reshard": (0, sharded_no_reshard, spell.update_policy),
    "hsdp1": (1, sharded, spell.update_policy),
    "hsdp1_each": (1, sharded_reduce_each, spell.update_policy),
    "replica": (0, replica, replica_step),
}


def full_grads(policy, keep: bool) -> dict[str, torch.Tensor]:
    """name -> the full gradient (a DTensor's gathered: a collective, every rank calls it); kept
    only where `keep` (rank 0)."""
    out = {}
    for name, p in policy.named_parameters():
        # a copy: with nothing to gather (HSDP's shard groups of one rank) full_tensor returns
        # the local gradient itself, which the clip then scales in place
        g = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        if keep:
            out[name] = g
    return out


class Recorder:
    """The warm-up step's optimiser, wrapping the layout's own: keeps the full gradient at the
    clip (after the reduction: clip stands in for torch.nn.utils.clip_grad_norm_ meanwhile) and
    at the step (after the clip)."""

    def __init__(self, optimizer, policy, keep: bool):
        self.optimizer, self.policy, self.keep = optimizer, policy, keep
        self.before, self.after = {}, {}

    def clip(self, parameters, max_norm, *args, **kwargs):
        self.before = full_grads(self.policy, self.keep)
        return CLIP(parameters, max_norm, *args, **kwargs)

    def step(self) -> None:
        self.after = full_grads(self.policy, self.keep)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


# ---- the batch


def corpus_tokens(need: int) -> list[int]:
    """The demo corpus's documents, tokenised end to end: at least `need` tokens of real text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    stream = []
    with open(ROOT / "data" / "demo_corpus.jsonl") as f:
        for line in f:
            for doc in json.loads(line)["documents"]:
                stream += tok(doc + "\n\n", add_special_tokens=False)["input_ids"]
            if len(stream) >= need:
                return stream
    raise SystemExit(f"the demo corpus has {len(stream)} tokens, {need} needed")


def make_groups(args, cfg) -> list[list[spell.Seq]]:
    """--groups groups of one prompt and rollout.group_size answers, each fitting one micro-batch
    shared-prefix packed, cut in turn from the corpus, with train.loss_norm's weights."""
    g = torch.Generator().manual_seed(0)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    G, budget = cfg.rollout.group_size, cfg.engine.micro_batch_tokens
    assert args.prompt_tokens[0] + G * args.answer_tokens[0] <= budget, "no group would fit"
    shapes = []
    for _ in range(args.groups):
        while True:
            prompt, answers = draw(*args.prompt_tokens), [draw(*args.answer_tokens)
                                                          for _ in range(G)]
            if prompt + sum(answers) <= budget:  # else plan_update would split the group
                break
        shapes.append((prompt, answers))
    stream = corpus_tokens(sum(p + sum(a) for p, a in shapes))
    groups, at = [], 0
    for prompt, answers in shapes:
        ids = stream[at:at + prompt]
        at += prompt
        rows = []
        for n in answers:
            rows.append((ids, stream[at:at + n]))
            at += n
        groups.append(rows)
    lengths = [len(c) for rows in groups for _, c in rows]
    ids = [k for k, rows in enumerate(groups) for _ in rows]
    weights = spell.LOSS_NORMS[cfg.train.loss_norm](lengths, ids, ["res"] * len(lengths),
                                                   cfg.rollout.max_new_tokens)
    out, w = [], iter(weights)
    for rows in groups:
        a = torch.randn(len(rows), generator=g)
        a = (a - a.mean()) / a.std()  # a group's advantages: z-scores, as the rewards' would be
        out.append([spell.Seq(p, c, advantage=float(x), weight=next(w)) for (p, c), x in
                    zip(rows, a)])
    return out


# ---- the run


def header(args, cfg, world: int, groups) -> str:
    """Date, CPU, cores, versions, load: what the times depend on; and the batch."""
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "?")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    shapes = "; ".join(f"{len(rows[0].prompt)} + {'/'.join(str(len(s.completion)) for s in rows)}"
                       for rows in groups)
    return (f"# {datetime.datetime.now().isoformat(timespec='seconds')} | {model} | "
            f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable) | torch "
            f"{torch.__version__}, transformers {transformers.__version__} | load averages at "
            f"start {load} | {world} ranks x {torch.get_num_threads()} threads\n"
            f"# model: SmolLM2-135M-Instruct (real weights), fp32, {cfg.engine.attn_implementation}"
            f" -> {infra.attention_implementation(cfg, False)}, checkpointing "
            f"{cfg.engine.gradient_checkpointing}; micro_batch_tokens "
            f"{cfg.engine.micro_batch_tokens}, lr {cfg.train.lr}, grad_clip {cfg.train.grad_clip}, "
            f"loss_norm {cfg.train.loss_norm}; {args.repeats} repeats\n"
            f"# groups (prompt + answers, tokens), dealt to ranks in turn: {shapes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "presets" / "demo.toml"),
                    help="the quickstart's settings")
    ap.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS),
                    help="the first is the gradient's reference")
    ap.add_argument("--groups", type=int, default=4, help="groups (micro-batches) a step")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(1200, 1500),
                    metavar=("LO", "HI"))
    ap.add_argument("--answer-tokens", type=int, nargs=2, default=(60, 190),
                    metavar=("LO", "HI"))
    ap.add_argument("--micro-batch-tokens", type=int, help="override engine.micro_batch_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per layout")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run under torchrun --nproc_per_node=2"
    assert args.groups % world == 0, "--groups must divide among the ranks"
    extra = ([f"--engine.micro_batch_tokens={args.micro_batch_tokens}"]
             if args.micro_batch_tokens else [])
    cfg = spell.load_config(args.config, extra)
    groups = make_groups(args, cfg)  # the same on every rank (seeded); each takes its share
    mine = [s for rows in groups[rank::world] for s in rows]
    infra.print0(header(args, cfg, world, groups))

    setups = {}
    for name in args.layouts:
        shard_size, build, step = LAYOUTS[name]
        lcfg = spell.load_config(args.config, extra + [f"--engine.fsdp_shard_size={shard_size}"])
        policy = build(lcfg, world)
        optimizer = spell.make_optimizer(policy, lcfg)  # as spell.load_policy
        setups[name] = (policy, optimizer, step, lcfg)

    def run(name: str, optimizer=None) -> tuple[float, int, float]:
        """One step of `name`: (seconds, bytes written, the gradient's norm before the clip)."""
        policy, own, step, lcfg = setups[name]
        dist.barrier()
        before, t0 = wchar(), time.perf_counter()
        stats = step(policy, optimizer or own, mine, lcfg, world, CPU)
        return time.perf_counter() - t0, wchar() - before, stats["grad_norm"]

    # warm-up: every layout's first step, from the same weights, its gradients kept (rank 0)
    reference, checks = None, {}
    for name in setups:
        recorder = Recorder(setups[name][1], setups[name][0], keep=rank == 0)
        torch.nn.utils.clip_grad_norm_ = recorder.clip  # read at the call, in both step functions
        try:
            seconds, _, norm = run(name, recorder)
        finally:
            torch.nn.utils.clip_grad_norm_ = CLIP
        infra.print0(f"# warm-up: {name} {seconds:.2f} s (rank 0), gradient norm {norm:.7g}")
        if rank == 0:
            grads = {"before": recorder.before, "after": recorder.after}
            reference = reference or grads
            checks[name] = {when: (max((g[n] - reference[when][n]).abs().max().item()
                                       for n in g),
                                   max(t.abs().max().item() for t in reference[when].values()))
                            for when, g in grads.items()}
            checks[name]["norm"] = norm
            if name == args.layouts[0]:  # the exact norm, to tell whose rounding is whose
                checks["norm64"] = math.sqrt(sum(t.double().square().sum().item()
                                                 for t in grads["before"].values()))
            del grads
        del recorder
    reference = None
    # the kept gradients' memory back to the system before the timed steps (2 x 0.5 GB a model)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)

    results = {name: [] for name in setups}
    for r in range(args.repeats):
        for name in setups:
            results[name].append(infra.all_gather_objects(run(name)))  # every rank's
            infra.print0(f"# repeat {r + 1}: {name} "
                         f"{max(s for s, _, _ in results[name][-1]):.2f} s")

    peak = infra.all_gather_objects(int(Path("/proc/self/status").read_text()
                                        .split("VmHWM:")[1].split()[0]) * 1024)
    if rank == 0:
        vocab = setups[args.layouts[0]][0].config.vocab_size
        u32 = 2.0 ** -24
        first = args.layouts[0]
        print(f"\n| layout | s/step best | s/step median | written/step rank 0, rank 1 (MB) | "
              f"grad max abs diff to {first}, reduced / clipped | grad scale (max abs), reduced"
              f" / clipped | diff / scale, reduced / clipped | within 8 sqrt(V) u32 scale |")
        print("|---|---|---|---|---|---|---|---|")
        times = {}
        for name, runs in results.items():
            times[name] = [max(s for s, _, _ in per_rank) for per_rank in runs]
            written = [statistics.median(w[i][1] for w in runs) for i in range(world)]
            (d0, s0), (d1, s1) = checks[name]["before"], checks[name]["after"]
            ok = all(d <= 8 * math.sqrt(vocab) * u32 * s for d, s in ((d0, s0), (d1, s1)))
            print(f"| {name} | {min(times[name]):.2f} | {statistics.median(times[name]):.2f} | "
                  f"{written[0] / 1e6:.1f}, {written[1] / 1e6:.1f} | {d0:.3g} / {d1:.3g} | "
                  f"{s0:.3g} / {s1:.3g} | {d0 / s0:.3g} / {d1 / s1:.3g} | "
                  f"{'yes' if ok else 'NO'} |")
        base = statistics.median(times[first])
        ratios = ", ".join(f"{n} {statistics.median(t) / base:.2f}" for n, t in times.items())
        norms = ", ".join(f"{n} {checks[n]['norm']:.9g}" for n in results)
        print(f"\n# bound 8 sqrt(V) u32 = {8 * math.sqrt(vocab) * u32:.3g} x the scale "
              f"(V = {vocab}, u32 = 2^-24)")
        print(f"# median step time / {first}'s: {ratios}")
        print(f"# gradient norm before the clip (warm-up step, as each layout computed it): "
              f"{norms}; in float64 from {first}'s gradient: {checks['norm64']:.9g}")
        print(f"# peak RSS (all layouts alive) rank 0, rank 1: "
              f"{peak[0] / 2**30:.2f}, {peak[1] / 2**30:.2f} GiB")
        print(f"# load averages at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
