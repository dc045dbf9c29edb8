"""A simulated 8-GPU node in one CPU process: per-rank peak memory, by category, and FLOPs of the
project's update step on a Qwen2.5-7B-shaped policy at 16K-128K prompts, beside
infra.memory_estimate; and bench/gpu_check.py's update in a world of one, beside the H200's.

    python bench/simulate_node.py --quick --sp 1,2,4       # 1 layer, a 1K prompt: seconds
    python bench/simulate_node.py --gpu-check 16384,32768 --layers 8 --foreach   # the H200's rows
    python bench/simulate_node.py --sp 2 --prompts 131072 --save rows.jsonl   # one 28-layer row
    python bench/simulate_node.py --table rows.jsonl       # the saved rows as bench/RESULTS.md's
    python bench/simulate_node.py --trust                  # the tracker against the CPU allocator

What runs. PyTorch's fake tensors (FakeTensorMode: shapes, dtypes and devices, no data) and its fake
process group (world 8; every collective returns at once with outputs of the right shape) carry
the project's own code: spell.shard_policy (FSDP2 per decoder layer and at the root, fp32 masters,
bf16 compute, gradient checkpointing) and spell.update_policy (shared-prefix packing, the packed
forward with the chunked torch LM head, the GRPO loss, backward, gradient clipping, AdamW) on a
Qwen2ForCausalLM built on the meta device. One case is one responder group: a prompt of P tokens
and G answers of A tokens, packed as one row of P + G A tokens, one micro-batch per data-parallel
group. With sequence parallelism of degree k (engine.sequence_parallel; spell.load_policy's
infra.enable_sequence_parallel over infra.sp_group, groups of k consecutive ranks) the k ranks of
a group share that row, each 1/k of its tokens (engine.micro_batch_tokens is set so that
spell.row_budget, k times it, holds the row). This process plays the group's last rank
(simulated_rank): it holds the completions, hence the most LM-head work. AdamW's state is made
before any step, as spell.load_policy makes it (infra.create_optimizer_state). The tracker
(torch.distributed._tools.mem_tracker.MemTracker) watches the second update, after a warm-up one
(FSDP2 initialises itself in its first forward); it labels FSDP2's gathered parameters and its
gradients by what they hold (Tracker), and splits the update's peak into the forwards' and
backwards' (before_step) and the optimiser step's. torch.utils.flop_counter.FlopCounterMode
counts the warm-up's FLOPs, every update's: never under the tracker, because the counter's module
hooks keep module outputs alive.

gpu_check_case runs bench/gpu_check.py's update instead, in a world of one: 8 of Qwen2.5-7B's
layers, config.toml with engine.micro_batch_tokens = T, and gpu_check's own batch
(bench_trainer.update_batch: 2 micro-batches of exactly T tokens, 3-6 sequences of irregular
lengths each, ~90 % prompt), one optimiser step. With the foreach AdamW it lands within 0.3 % of
the H200's measured peaks (55.21 GiB at 16K: the step; 59.97 at 32K: the second micro-batch's
backward, which runs beside the 4P bytes of gradient shards the first left: the ~5 GiB issue #41
could not place; bench/RESULTS.md, test_simulate_node.py).

CPU, not CUDA: FSDP2 asks the CUDA runtime for the current device, and a CPU-only torch has none,
so the fake tensors sit on "cpu". They count the same bytes (the tracker rounds a CUDA tensor up to
the caching allocator's 512-byte blocks, which is immaterial at these sizes).

The fake process group needs no stand-in for Ulysses: dist.new_group makes fake subgroups of the
requested ranks (infra.sp_group runs as written), and its all-to-all copies the input into the
output buffer the caller allocated (torch.distributed.nn's all_to_all_single allocates it, as on
NCCL), so the bytes a rank holds are those of a real exchange; FakeRun adds up what each rank
sends, which test_simulate_node.py pins to infra.exchange_elements.

Stand-ins. A fake tensor has no values, and a few CPU code paths allocate differently from the GPU
ones. Each stand-in makes the simulation allocate what the GPU path allocates (fake_tensors and
gpu_paths install them, and restore everything on exit):
 1. Values read back to the host (the loss, the finiteness assert, the logged entropy and rollout
    sums, the gradient norm) do not exist: FakeRun answers True / 0 / 0.0. Only logging and that
    assert read them; no allocation depends on them. Tensors built from Python lists of up to the
    micro-batch's completion tokens (targets, lengths, per-token weights) keep their values
    (FakeTensorMode's constants, its limit raised from 1 element), so the loss bookkeeping and
    kernels' target-range check see real numbers; the row's (T,) tensors stay value-free. AdamW's
    step counters, which infra.create_optimizer_state makes as zeros, are remade as such constants
    (0.0): the foreach and loop implementations read them on the host for the bias correction.
 2. FlexAttention, the project's GPU attention for shared-prefix rows
    (infra.attention_implementation). torch refuses its backward on CPU before any kernel runs,
    and HF and torch compile it; under fake tensors no kernel runs, so the refusal is lifted and
    flex_attention runs uncompiled. Its fake rule allocates what the fused kernel writes: out
    (bf16, q's shape), the logsumexp and max score (fp32 per head and token); autograd saves q,
    k, v, out and the logsumexp, and the backward allocates dq, dk, dv. transformers 5.19 repeats
    k and v to all heads before calling flex_attention when the head count is not a power of two
    (Qwen2.5-7B: 28), on GPU as well, so k and v are held at 28 heads, not 4.
 3. The BlockMask: infra.tree_attention_mask builds it with infra.mask_builder, on GPU a compiled
    create_block_mask, which never holds a (T, T) mask; run eagerly, as on CPU after dynamo's
    trace, it evaluates all T^2 pairs at once. block_mask_by_stripes
    evaluates the same mask_mod one 128-row stripe at a time and reduces it with torch's own
    conversion: the same BlockMask (test_simulate_node.py pins it to create_block_mask).
 4. The LM head: on CUDA kernels/reference.py multiplies bf16 operands into an fp32 result
    (torch.mm out_dtype); CPU builds lack that and upcast the whole [V, H] head to fp32 (2 GiB at
    Qwen2.5-7B). The simulation gives kernels.reference the CUDA answer (its _FP32_OUT_OK cache).
 5. None for AdamW: the simulation builds spell.make_optimizer's (fused; one kernel, whose fake
    rule allocates nothing, as the CUDA kernel writes in place). project_api(foreach=True)
    builds torch's foreach implementation instead, CUDA's default before spell named one (its
    step holds an fp32 copy of every second moment): the H200's rows of issue #41 ran it.
 6. The SP group's sequences: spell.sequence_parallel_batch gathers them from the group's ranks
    (an all_gather_objects, which the fake group cannot carry); here the rank is handed the
    responder group, which is what that gather gives every rank of the group.
 7. Likewise infra.sp_gather_row, where the project has it (whole-row per-token statistics under
    SP, gathered as pickled host copies): gathered_row returns the (N,) row with this rank's values
    in place, the real result's size.
transformers 5.19 builds a dense (1, 1, T, T) mask from packed position_ids for SDPA; with a
BlockMask it passes the mask on as it is: FakeRun records the largest tensor of the step to show it.

Not simulated: the Triton LM head (engine.logprob_impl = "triton", config.toml's choice): a Triton
launch has no fake rule (the interpreter reads the data) and FlopCounterMode sees no aten op in it,
so the rows use the torch twin (its fp32 dW and 256 MiB scratch), and memory_estimate is asked
about the same twin. The kernel's GEMMs are the twin's (8 n H V FLOPs for n targets: the logits,
their recompute, dX and dW; kernels/logprob.py); its fused-loss path would save 2 n H V (at most
about 1 % of a row's FLOPs here). Also not counted: the CUDA context and NCCL buffers, NCCL's own
all-to-all scratch, and the caching allocator's fragmentation. A degree the model's heads refuse
(infra.check_heads: Qwen2.5-7B's 28 query heads over 8 ranks) is reported, not run.

--trust checks the tracker itself: a tiny Qwen2 in a world of one on the CPU path (SDPA, dense tree
mask), the same update on real tensors, where the tracker's peak is compared with the CPU
allocator's own running total (torch.profiler with profile_memory=True reports it with every
allocation), and on fake tensors, where the tracker should read the same bytes.

Results: bench/RESULTS.md ("A simulated 8-GPU node").
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORLD = 8  # ranks of the simulated node
GiB, MiB = 2**30, 2**20
# Qwen2.5-7B-Instruct's config.json: the shape is all the simulation needs
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                 tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6,
                 max_position_embeddings=32768)
# the trust check's model: every dimension a multiple of 8, head_dim 64
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=4096, tie_word_embeddings=False, head_dim=64)
PROMPTS = (16384, 32768, 65536, 131072)


# ==================================================================================================
# Every call into spell.py and infra.py: adapt this one function when their APIs change
# ==================================================================================================

def project_api(world: int, device_gib: float = 80.0, foreach: bool = False) -> SimpleNamespace:
    """The project's functions this script runs, bound to a world of `world` ranks; `foreach`: AdamW
    in torch's foreach implementation (stand-in 5) instead of spell.make_optimizer's."""
    import infra
    import spell

    def optimizer(policy, cfg):
        """spell.load_policy's AdamW and its state, made before any step
        (infra.create_optimizer_state)."""
        made = (torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr,
                                  weight_decay=cfg.train.weight_decay, foreach=True)
                if foreach else spell.make_optimizer(policy, cfg))
        infra.create_optimizer_state(made)
        for state in made.state.values():  # stand-in 1: the step counters keep their values
            state["step"] = torch.tensor(0.0, device=state["step"].device)
        return made

    # what memory_estimate is told: the implementation `optimizer` builds (spell.make_optimizer's
    # read from one it makes for a single parameter)
    implementation = adamw_implementation(
        optimizer(SimpleNamespace(parameters=lambda: [torch.nn.Parameter(torch.zeros(1))]),
                  spell.Config()))

    def config(prompt: int, group: int, answer: int, attention: str, sp: int = 1):
        """config.toml (the paper's 7B recipe) with this case's lengths: one group per micro-batch
        (a row of k x micro_batch_tokens under sequence parallelism k), the torch LM head (a
        Triton launch cannot run on fake tensors), the given attention."""
        row = prompt + group * answer
        cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
            f"--rollout.max_prompt_tokens={prompt}", f"--rollout.max_new_tokens={answer}",
            f"--rollout.group_size={group}", f"--engine.sequence_parallel={sp}",
            f"--engine.micro_batch_tokens={-(-row // sp)}",
            "--engine.logprob_impl=torch", f"--engine.attn_implementation={attention}"])
        assert spell.row_budget(cfg) >= row, "the responder group must fit one row"
        return cfg

    def shard(model, mesh, cfg, dtype):
        """spell.load_policy's steps after loading: FSDP2, then Ulysses (collective: new_group)."""
        policy = spell.shard_policy(model, mesh, param_dtype=dtype,
                                    gradient_checkpointing=cfg.engine.gradient_checkpointing)
        if (k := cfg.engine.sequence_parallel) > 1:
            attention = infra.attention_implementation(cfg, on_gpu=True)
            infra.enable_sequence_parallel(policy, infra.sp_group(world, k), attention)
        return policy

    return SimpleNamespace(
        config=config,
        shard=shard,
        # the heads Ulysses needs (raises ConfigError otherwise)
        check_heads=infra.check_heads,
        # one layer's forward all-to-all elements per rank
        exchange_elements=infra.exchange_elements,
        optimizer=optimizer,
        sequence=lambda prompt, completion, advantage, weight: spell.Seq(
            prompt, completion, advantage, weight),
        update=lambda policy, optimizer, seqs, cfg: spell.update_policy(
            policy, optimizer, seqs, cfg, world, torch.device("cpu")),
        # the update phase: the trainer while vLLM sleeps (config.toml's engine.sleep_level 1),
        # for the optimizer this api builds; `longest` (spell.longest_sequence's by default): the
        # longest sequence, whose row may exceed engine.micro_batch_tokens
        estimate=lambda cfg, mc, longest=None: infra.memory_estimate(
            cfg, mc, world, device_gib, longest or spell.longest_sequence(cfg),
            optimizer=implementation),
    )


def adamw_implementation(optimizer: torch.optim.Optimizer) -> str:
    """Which of torch's AdamW implementations `optimizer` runs, by infra.ADAMW_STEP_BYTES' names;
    one that names neither (the device's default: foreach on CUDA, a loop on CPU) is refused."""
    for name in ("fused", "foreach"):
        if optimizer.defaults.get(name):
            return name
    raise ValueError("an AdamW that names no implementation runs the device's default: "
                     "name fused or foreach")


# ==================================================================================================
# Fake tensors and the stand-ins (module docstring, 1-5)
# ==================================================================================================

@contextlib.contextmanager
def swapped(owner, name: str, value):
    """owner.name = value inside the block, the old value back after it."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def host_read_stand_in(t: torch.Tensor):
    """What a read of a fake tensor's value returns (stand-in 1): every check passes, every count
    and sum is zero."""
    if t.dtype == torch.bool:
        return True
    return 0.0 if t.is_floating_point() else 0


class FakeRun(TorchDispatchMode):
    """Answers reads of fake values with host_read_stand_in, lets reads of constants through,
    remembers the largest tensor any op made (a (T, T) mask would show here), and adds up the bytes
    this rank puts into all-to-alls (Ulysses' exchanges; the fake process group copies them into
    the output buffer the caller allocated, as NCCL writes into it)."""
    supports_higher_order_operators = True  # flex_attention is a higher-order operator

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.largest = (0, ())  # bytes, shape
        self.all_to_all_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._local_scalar_dense.default
                and getattr(args[0], "constant", None) is None):
            return host_read_stand_in(args[0])
        if func is torch.ops.c10d.alltoall_base_.default:  # (output, input, group, ...)
            self.all_to_all_bytes += args[1].nbytes
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.nbytes > self.largest[0]:
                self.largest = (t.nbytes, tuple(t.shape))
        return out


@contextlib.contextmanager
def fake_tensors(constant_elements: int = 1 << 13):
    """FakeTensorMode with stand-in 1: a tensor built from Python data of at most
    `constant_elements` elements keeps its values. Give it the micro-batch's completion tokens N:
    the loss bookkeeping reads (N,) tensors, and the (T,) row tensors must stay value-free, or the
    BlockMask's stripes (T elements each) are computed for real, and torch keeps those copies.
    Non-fake inputs are allowed because the policy's meta parameters become fake in to_empty."""
    from torch._subclasses import fake_tensor

    watch = FakeRun()
    with (swapped(fake_tensor, "CONSTANT_NUMEL_LIMIT", constant_elements),
          fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), watch):
        yield watch


@contextlib.contextmanager
def gpu_paths():
    """Stand-ins 2-4 and 7: FlexAttention's training path uncompiled on fake CPU tensors, the
    BlockMask built a stripe at a time, the LM head's bf16 x bf16 -> fp32 GEMM, and an SP group's
    per-token values gathered without pickling fake tensors."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention import flex_attention as flex

    import infra
    import kernels.reference

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex.flex_attention(query, key, value, **kwargs)

    cuda_gemm = dict(kernels.reference._FP32_OUT_OK)
    cuda_gemm[("cpu", None, torch.bfloat16)] = True
    # infra.sp_gather_row, where the project has it (stand-in 7)
    row_gather = (swapped(infra, "sp_gather_row", gathered_row) if hasattr(infra, "sp_gather_row")
                  else contextlib.nullcontext())
    with (swapped(flex, "_validate_device", lambda query, key, value: None),
          swapped(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True),
          swapped(hf_flex, "compile_friendly_flex_attention", uncompiled),
          swapped(flex, "create_block_mask", block_mask_by_stripes),
          swapped(infra, "mask_builder", lambda device: block_mask_by_stripes),
          swapped(kernels.reference, "_FP32_OUT_OK", cuda_gemm), row_gather):
        yield


def gathered_row(values: torch.Tensor, which: torch.Tensor, total: int, group) -> torch.Tensor:
    """infra.sp_gather_row without its gather (stand-in 7): the (total,) row of per-token values
    with this rank's at `which`; the other ranks' places keep zeros. The result is the real one's
    size; the gather itself moves pickled host copies, and pickling a fake tensor fails."""
    row = values.new_zeros(total)
    row[which.to(row.device)] = values
    return row


def block_mask_by_stripes(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, **kwargs):
    """create_block_mask for one batch row and all heads (B, H in {None, 1}), as its compiled form
    holds memory: the mask evaluated one stripe of query blocks at a time, (BLOCK, KV_LEN), then
    torch's own reduction to partial and full blocks."""
    from torch.nn.attention import flex_attention as flex

    assert B in (None, 1) and H in (None, 1), "one batch row, one mask for all heads"
    assert not kwargs.get("compute_dq_write_order"), "not needed by the project"
    q_block, kv_block = (BLOCK_SIZE,) * 2 if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    b = h = torch.zeros((), dtype=torch.long, device=device)
    kv = torch.arange(KV_LEN, device=device)[None]  # (1, KV_LEN)
    partial, full = [], []
    for q0 in range(0, Q_LEN, q_block):
        q = torch.arange(q0, min(q0 + q_block, Q_LEN), device=device)[:, None]  # (BLOCK, 1)
        stripe = mask_mod(b, h, q, kv)[None, None]  # (1, 1, BLOCK, KV_LEN)
        p, f = flex._convert_mask_to_block_mask(stripe, q_block, kv_block,
                                                 separate_full_blocks=True)
        partial.append(p)
        full.append(f)
    return flex._create_sparse_block_from_block_mask(
        (torch.cat(partial, dim=2), torch.cat(full, dim=2)), mask_mod, (Q_LEN, KV_LEN),
        q_block, kv_block)


@contextlib.contextmanager
def flop_counter():
    """FlopCounterMode that also counts flex_attention run eagerly: torch registers its FLOP
    formulas (dense: every query-key pair) but its dispatch mode applies them to traced graphs
    only, and refuses the operator otherwise."""
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
    from torch.utils import flop_counter as fc

    other_operators = fc._FlopCounterMode._handle_higher_order_ops

    def handle(mode, func, types, args, kwargs):
        if func in (flex_attention, flex_attention_backward):
            return mode.counter._count_flops(func, func(*args, **kwargs), args, kwargs)
        return other_operators(mode, func, types, args, kwargs)

    def addmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        """torch's addmm formula, which takes the fp32-output overload's out_dtype (kernels'
        dW accumulation, stand-in 4) for an output shape."""
        return fc.mm_flop(a_shape, b_shape)

    with (swapped(fc._FlopCounterMode, "_handle_higher_order_ops", handle),
          fc.FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm: addmm})
          as counter):
        yield counter


class Tracker(MemTracker):
    """MemTracker that lets flex_attention (a higher-order operator) through, and labels FSDP2's
    tensors by what they hold rather than by when they were made (MemTracker's rule: made in the
    forward = activation, in the backward = temporary): the gathered bf16 parameters count as
    parameters, the unsharded bf16 gradients and the sharded fp32 gradients (views of FSDP2's
    reduce-scatter output) as gradients. The labels move bytes between columns, never the total."""
    supports_higher_order_operators = True

    def track_fsdp(self, policy) -> None:
        """Label every FSDP2 unsharded parameter (its storage persists, resized between 0 and full
        around each use) and, through a hook, its gradient."""
        def label_grad(param) -> None:
            self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)

        self._fsdp_hooks = []
        for module in policy.modules():
            group = getattr(module, "_get_fsdp_state", lambda: None)()
            for fsdp_param in getattr(group and group._fsdp_param_group, "fsdp_params", ()):
                unsharded = fsdp_param._unsharded_param
                self._update_and_maybe_create_winfos(unsharded, _MemRefType.PARAM)
                self._fsdp_hooks.append(unsharded.register_post_accumulate_grad_hook(label_grad))

    def untrack_fsdp(self) -> None:
        for hook in self._fsdp_hooks:
            hook.remove()

    def _pre_fw_hook(self, module, inputs) -> None:
        """MemTracker refuses a second forward of a top-level module in one tracked region; an
        update of several micro-batches makes one per micro-batch. The modules' own statistics
        restart there (the last micro-batch's are kept); the device's totals and peak carry on."""
        name = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        """MemTracker's, and where a new peak of the device falls: the modules running then, and
        whether in the backward."""
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_at = (sorted(self._mod_tracker.parents), self._mod_tracker.is_bw)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.c10d._reduce_scatter_base_.default:  # (output, input, ...)
            self._update_and_maybe_create_winfos(args[0], _MemRefType.GRAD)
        return out


# ==================================================================================================
# One case
# ==================================================================================================

def tokens_per_rank(row_tokens: int, sp: int = 1) -> int:
    """Tokens of a packed row that one rank holds: under Ulysses sequence parallelism of degree sp
    the row, padded to a multiple of sp, is split evenly over the sp ranks (infra.shard_row)."""
    return -(-row_tokens // sp)


def simulated_rank(sp: int) -> int:
    """The rank this process plays: the last of the first SP group (rank 0 at SP 1). It holds the
    row's last tokens, the completions, so it runs the most LM-head work; every other per-token
    tensor and the attention (Hq/sp heads over the whole row) are the same size on every rank."""
    return sp - 1


@contextlib.contextmanager
def process_group(backend: str, world: int, rank: int = 0):
    """A world of `world` ranks in this process, which plays `rank` (the fake backend, or gloo for
    a world of one), and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def responder_group(api, prompt: int, group: int, answer: int, vocab: int, seed: int = 0) -> list:
    """One responder group: a random prompt, G random answers, advantages +-1, Eq. 12's weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    return [api.sequence(x, torch.randint(0, vocab, (answer,), generator=g).tolist(),
                         1.0 if i % 2 else -1.0, 1.0 / (group * answer)) for i in range(group)]


def by_category(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot of one device as bytes per column of the table."""
    kinds = {str(k).split(".")[-1]: v for k, v in snapshot.items()}
    return {"params": kinds["PARAM"] + kinds["BUFFER"], "buffers": kinds["BUFFER"],
            "grads": kinds["GRAD"],
            "optimizer": kinds["OPT"], "activations": kinds["ACT"], "temporaries": kinds["TEMP"],
            "other": kinds["OTH"], "total": kinds["Total"]}


def counted_step(api, policy, optimizer, seqs: list, cfg) -> dict:
    """One update under the FLOP counter: its FLOPs, and those of the attention operators. Never
    under the tracker: the counter's module hooks keep module inputs and outputs alive."""
    with flop_counter() as counter:
        api.update(policy, optimizer, seqs, cfg)
    flops = counter.get_flop_counts()["Global"]
    attention = sum(n for op, n in flops.items() if "attention" in str(op))
    return {"flops": sum(flops.values()), "attention_flops": attention}


def measured_step(api, policy, optimizer, seqs: list, cfg) -> dict:
    """One update under the tracker: the peak by category, that peak's two parts (before the
    optimizer step: the forwards and backwards; the step itself), and the categories when the
    update starts, when the last micro-batch's backward reaches the decoder (every checkpoint is
    alive then) and when the optimizer step starts (every sharded gradient exists then)."""
    tracker = Tracker()
    tracker.track_external(policy, optimizer)
    tracker.track_fsdp(policy)
    at_step, before_step, where = [], [], []
    tracker.peak_at = ([], False)

    def step_starts(*_) -> None:
        """Keep the peak so far, then let the tracker's peak restart from here: the step's own."""
        at_step.append(tracker.get_tracker_snapshot())
        before_step.append(tracker.get_tracker_snapshot("peak"))
        where.append(tracker.peak_at)
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()
        tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}

    hook = optimizer.register_step_pre_hook(step_starts)
    start = tracker.get_tracker_snapshot()
    with tracker:
        api.update(policy, optimizer, seqs, cfg)
    hook.remove()
    tracker.untrack_fsdp()
    (device, step), = tracker.get_tracker_snapshot("peak").items()
    step, before = by_category(step), by_category(before_step[0][device])
    # when the gradient reaches the decoder's output (the LM head's backward is done)
    decoder = tracker.memory_tracking[policy.model].snapshots[_ModState.PRE_BW][-1]
    # the modules running at the peak before the step (the step's: none), and whether backward
    modules, backward = where[0] if before["total"] >= step["total"] else ([], False)
    return {"peak": max(before, step, key=lambda c: c["total"]), "before_step": before,
            "peak_at": {"modules": modules, "backward": backward},
            "step": step, "at_step": by_category(at_step[0][device]),
            "start": by_category(start[device]), "backward_start": by_category(decoder[device])}


def visible_fraction(prompt: int, group: int, answer: int) -> float:
    """Share of the row's (query, key) pairs the tree mask lets through: the prompt causally, each
    answer over the prompt and causally over itself. The FLOP counter counts flex_attention as
    dense; its kernel skips the blocks with no visible pair."""
    pairs = prompt * (prompt + 1) // 2 + group * (answer * prompt + answer * (answer + 1) // 2)
    return pairs / (prompt + group * answer) ** 2


def simulate_case(api, mesh, shape: dict, prompt: int, group: int, answer: int,
                  attention: str = "flex_attention", sp: int = 1, micro_batches: int = 1) -> dict:
    """One responder group's update on `mesh` (fake ranks; this process plays
    simulated_rank(sp)), with Ulysses sequence parallelism of degree sp: the measured step, beside
    memory_estimate for the same case. Every rank of an SP group trains the group's sequences
    (spell.sequence_parallel_batch gathers them; here they are handed over: stand-in 6). With
    `micro_batches` > 1, as many groups (other draws), one a micro-batch, in one optimiser step:
    each micro-batch after the first runs beside the gradients of those before, as in a run."""
    from transformers import Qwen2Config

    t0 = time.perf_counter()
    row_tokens = prompt + group * answer
    mc = Qwen2Config(**{**shape, "max_position_embeddings": max(shape.get(
        "max_position_embeddings", 0), row_tokens)}, attn_implementation=attention)
    cfg = api.config(prompt, group, answer, attention, sp)
    seqs = [s for seed in range(micro_batches)
            for s in responder_group(api, prompt, group, answer, mc.vocab_size, seed)]
    row = simulate_update(api, mesh, mc, cfg, seqs)
    fraction = visible_fraction(prompt, group, answer)
    visible = row["flops"] - row["attention_flops"] * (1 - fraction)
    head_dim = mc.hidden_size // mc.num_attention_heads
    # one layer's forward exchanges, bf16 (infra.exchange_elements); none without SP
    exchange = 0 if sp == 1 else 2 * api.exchange_elements(
        row_tokens, sp, mc.num_attention_heads, mc.num_key_value_heads, head_dim)
    return {**row, "prompt": prompt, "sp": sp, "tokens": tokens_per_rank(row_tokens, sp),
            "micro_batches": micro_batches, "visible_flops": visible, "exchange_bytes": exchange,
            "seconds": time.perf_counter() - t0, "rss": max_rss()}


def simulate_update(api, mesh, mc, cfg, seqs: list, flops: bool = True,
                    longest: int | None = None) -> dict:
    """spell.update_policy of `seqs` on `mesh` (fake ranks) for the model config `mc`: a warm-up
    update (under the FLOP counter with `flops`; FSDP2 initialises itself in it), then the measured
    one, beside memory_estimate's terms for the same config (and `longest`, the longest sequence
    it allows: spell.longest_sequence(cfg) by default)."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):  # fp32 masters, never materialised
        model = Qwen2ForCausalLM(mc)
    policy = api.shard(model, mesh, cfg, torch.bfloat16)
    # stand-in 1: the loss bookkeeping's (N,) tensors keep their values, the rows' (T,) ones not
    completions = max(len(s.completion) for s in seqs) * cfg.rollout.group_size
    with fake_tensors(completions) as watch, gpu_paths():
        policy.to_empty(device="cpu")
        optimizer = api.optimizer(policy, cfg)
        # the warm-up update; its FLOPs are every update's
        if flops:
            row = counted_step(api, policy, optimizer, seqs, cfg)
        else:
            api.update(policy, optimizer, seqs, cfg)
            row = {}
        watch.reset()
        row.update(measured_step(api, policy, optimizer, seqs, cfg))
    est = api.estimate(cfg, mc, longest)
    return {**row, "layers": mc.num_hidden_layers, "estimate": est["update_phase"] * GiB,
            "estimate_terms": est, "largest": watch.largest,
            "all_to_all_bytes": watch.all_to_all_bytes,
            "optimizer": adamw_implementation(optimizer),
            "parameters": sum(p.numel() for p in policy.parameters())}


def gpu_check_case(api, mesh, T: int, layers: int = 8, flops: bool = False,
                   shape: dict | None = None) -> dict:
    """bench/gpu_check.py's part b, simulated: `layers` of Qwen2.5-7B's 28 (or of `shape`, a
    bench_trainer shape), config.toml's recipe with engine.micro_batch_tokens = T, and its own
    batch, bench_trainer.update_batch's sequences of irregular lengths packed into 2 micro-batches
    of exactly T tokens (3-6 sequences each, ~90 % prompt), in one update (one optimiser step).
    The torch LM head, as every simulated row."""
    import bench_trainer
    import spell

    t0 = time.perf_counter()
    mc = bench_trainer.model_config(shape or bench_trainer.QWEN25_7B, layers, 32768)
    mc._attn_implementation = "flex_attention"
    cfg = spell.load_config(str(spell.ROOT / "config.toml"), [
        f"--engine.micro_batch_tokens={T}", "--engine.logprob_impl=torch",
        "--engine.attn_implementation=flex_attention"])
    seqs = bench_trainer.update_batch(T, 2, mc.vocab_size, cfg, seed=T)
    # as gpu_check asks memory_estimate: the batch's longest sequence, not the recipe's
    longest = max(len(s.prompt) + len(s.completion) for s in seqs)
    row = simulate_update(api, mesh, mc, cfg, seqs, flops=flops, longest=longest)
    return {**row, "T": T, "tokens": sum(len(s.prompt) + len(s.completion) for s in seqs),
            "sequences": len(seqs), "seconds": time.perf_counter() - t0, "rss": max_rss()}


def max_rss() -> int:
    """This process's peak resident memory, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ==================================================================================================
# The trust check: the tracker on real tensors against the CPU allocator, and on fake ones
# ==================================================================================================

def allocator_peak(profiler) -> int:
    """Highest running total of the CPU allocator in a torch.profiler window (profile_memory=True):
    every allocation event carries the allocator's total of the window's allocations."""
    from torch._C._profiler import _EventType

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    tree = profiler.profiler.kineto_results.experimental_event_tree()
    return max((e.extra_fields.total_allocated for e in walk(tree)
                if e.tag == _EventType.Allocation), default=0)


def tiny_update(api, mesh, prompt: int, group: int, answer: int, fake: bool):
    """The tiny model's warm-up step, then the measured step; with `fake`, on fake tensors. The
    CPU path both times (SDPA with the dense tree mask, the head upcast to fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mc = Qwen2Config(**TINY, attn_implementation="sdpa")
    cfg = api.config(prompt, group, answer, "sdpa")
    torch.manual_seed(0)
    with torch.device("meta" if fake else "cpu"):
        model = Qwen2ForCausalLM(mc)
    policy = api.shard(model, mesh, cfg, torch.bfloat16)
    seqs = responder_group(api, prompt, group, answer, mc.vocab_size)
    with fake_tensors(group * answer) if fake else contextlib.nullcontext():
        if fake:
            policy.to_empty(device="cpu")
        optimizer = api.optimizer(policy, cfg)
        api.update(policy, optimizer, seqs, cfg)
        if fake:
            return measured_step(api, policy, optimizer, seqs, cfg), None
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            row = measured_step(api, policy, optimizer, seqs, cfg)
        return row, allocator_peak(profiler)


def trust_check(prompt: int = 384, group: int = 4, answer: int = 64) -> dict:
    """The tracker's peak on real tensors, the allocator's, and the tracker's on fake tensors."""
    api = project_api(world=1)
    with process_group("gloo", 1) as mesh:
        real, allocator = tiny_update(api, mesh, prompt, group, answer, fake=False)
    with process_group("fake", 1) as mesh:
        fake, _ = tiny_update(api, mesh, prompt, group, answer, fake=True)
    return {"real": real, "fake": fake, "allocator_growth": allocator,
            "tracked_growth": real["peak"]["total"] - real["start"]["total"],
            "case": (prompt, group, answer)}


def print_trust(t: dict) -> None:
    prompt, group, answer = t["case"]
    print(f"Trust check: Qwen2 {TINY['num_hidden_layers']} layers, hidden {TINY['hidden_size']}, "
          f"vocab {TINY['vocab_size']}; one rank (gloo), SDPA + dense tree mask; prompt {prompt}, "
          f"G = {group} answers of {answer}; the step after a warm-up step")
    print(f"  growth above the step's start, real tensors: tracker {t['tracked_growth']:,} B, "
          f"CPU allocator (torch.profiler) {t['allocator_growth']:,} B, ratio "
          f"{t['tracked_growth'] / max(t['allocator_growth'], 1):.4f}")
    print(f"  tracker's peak total: real tensors {t['real']['peak']['total']:,} B, "
          f"fake tensors {t['fake']['peak']['total']:,} B")


# ==================================================================================================
# The table
# ==================================================================================================

COLUMNS = ("params", "grads", "optimizer", "activations", "temporaries", "total")


def refused_case(api, shape: dict, prompt: int, group: int, answer: int, attention: str,
                 sp: int) -> dict | None:
    """The row of a case Ulysses refuses (infra.check_heads), with memory_estimate's figure;
    None if it runs."""
    from transformers import Qwen2Config

    import infra

    try:
        api.check_heads(shape["num_attention_heads"], shape["num_key_value_heads"], sp)
        return None
    except infra.ConfigError as e:
        cfg = api.config(prompt, group, answer, attention, sp)
        est = api.estimate(cfg, Qwen2Config(**shape))
        return {"prompt": prompt, "sp": sp, "tokens": tokens_per_rank(prompt + group * answer, sp),
                "layers": shape["num_hidden_layers"], "refused": str(e),
                "estimate": est["update_phase"] * GiB, "estimate_terms": est}


def case_estimate(api, row: dict, group: int, answer: int, attention: str) -> dict:
    """memory_estimate's update phase for a row's case, bytes, and its terms, GiB."""
    from transformers import Qwen2Config

    cfg = api.config(row["prompt"], group, answer, attention, row["sp"])
    est = api.estimate(cfg, Qwen2Config(**{**QWEN25_7B, "num_hidden_layers": row["layers"]}))
    return {"estimate": est["update_phase"] * GiB, "estimate_terms": est}


def print_table(rows: list[dict], group: int, answer: int) -> None:
    print(f"\nQwen2.5-7B shape, {rows[0]['layers']} layers; {WORLD} simulated ranks (fake process "
          f"group), FSDP2, fp32 masters, bf16 compute, gradient checkpointing, shared-prefix "
          f"packing, FlexAttention; one responder group (G = {group} answers of {answer} tokens) "
          "per micro-batch per SP group; Ulysses sequence parallelism of degree SP over groups of "
          "SP consecutive ranks. Memory in GiB per rank at the tracker's peak, by its categories, "
          "on the SP group's last rank. CPU fake tensors: FSDP2 cannot take fake CUDA tensors on "
          "a CPU-only torch; CPU fake tensors count the same bytes.")
    print("| prompt | SP | tokens per rank | params | grads | optimizer | activations "
          "| temporaries | peak total | estimate | estimate / peak | TFLOPs per step | TFLOPs, "
          "flex visible | all-to-all MiB per layer (fwd) | largest tensor GiB | seconds |")
    print("|" + "---:|" * 16)
    for r in rows:
        head = f"| {r['prompt']:,} | {r['sp']} | {r['tokens']:,} | "
        if "refused" in r:
            print(head + " | ".join(["refused"] * 6 + [f"{r['estimate'] / GiB:.2f}"] + [""] * 6)
                  + " |")
            continue
        gib = [r["peak"][c] / GiB for c in COLUMNS]
        print(head + " | ".join(f"{v:.2f}" for v in gib)
              + f" | {r['estimate'] / GiB:.2f} | {r['estimate'] / r['peak']['total']:.3f} | "
              f"{r['flops'] / 1e12:.1f} | {r['visible_flops'] / 1e12:.1f} | "
              f"{r['exchange_bytes'] / MiB:.0f} | {r['largest'][0] / GiB:.2f} | "
              f"{r['seconds']:.0f} |")
    for sp, why in sorted({(r["sp"], r["refused"]) for r in rows if "refused" in r}):
        print(f"SP {sp}: {why}")
    print("params: the fp32 shards and the bf16 copies FSDP2 has gathered at that moment; grads: "
          "the fp32 shards reduced so far and the bf16 unsharded gradients alive; activations: "
          "made in the forward or a checkpoint's recompute; temporaries: made in the backward "
          "(FSDP2's fp32 reduce-scatter input among them). estimate: infra.memory_estimate's "
          "update phase (trainer only; vLLM sleeps) for the same config. TFLOPs: FlopCounterMode "
          "over one step, per rank, checkpoint recompute included; it counts flex_attention as "
          "dense, the 'flex visible' column scales attention to the pairs the tree mask lets "
          "through. all-to-all: the bf16 bytes a rank sends into one layer's two forward "
          "exchanges (infra.exchange_elements); a step moves three times that (forward, "
          "recompute, backward). largest tensor: the biggest one the step made (no (T, T) mask). "
          "seconds: the whole case, on a shared 2-core machine.")


# bench/gpu_check.py's update rows on one H200 (8 of Qwen2.5-7B's layers, world 1): GiB allocated
# at the peak, by AdamW implementation and T (issue #41; bench/RESULTS.md: foreach at 4bac87c,
# fused at 7d7bb2e)
H200_GIB = 139.8  # the H200's memory as torch reports it
H200_UPDATE_PEAKS = {("foreach", 16384): 55.21, ("foreach", 32768): 59.97,
                     ("fused", 16384): 54.30, ("fused", 32768): 59.96}


def print_gpu_check(rows: list[dict]) -> None:
    """gpu_check_case's rows: the peak, where it falls, its categories, beside memory_estimate's
    moments and the H200's measured peak."""
    print(f"\nbench/gpu_check.py's update simulated in a world of one: {rows[0]['layers']} of "
          f"Qwen2.5-7B's layers (P = {rows[0]['parameters']:,} in one shard), config.toml, 2 "
          f"micro-batches of T tokens (bench_trainer.update_batch), FlexAttention, the torch LM "
          f"head, AdamW {rows[0]['optimizer']}. GiB.")
    print("| T | peak | before the step | at the step's start | step | params | grads | "
          "optimizer | activations | temporaries | estimate (backward, step) | estimate / peak "
          "| H200 | peak / H200 | seconds |")
    print("|" + "---:|" * 15)
    for r in rows:
        peak, gib = r["peak"]["total"], lambda b: f"{b / GiB:.2f}"  # noqa: E731
        est, measured = r["estimate_terms"], H200_UPDATE_PEAKS.get((r["optimizer"], r["T"]))
        print(f"| {r['T']:,} | {gib(peak)} | {gib(r['before_step']['total'])} | "
              f"{gib(r['at_step']['total'])} | {gib(r['step']['total'])} | "
              + " | ".join(gib(r["peak"][c]) for c in COLUMNS[:-1])
              + f" | {est['update_phase']:.2f} ({est['update_backward']:.2f}, "
              f"{est['update_step']:.2f}) | {r['estimate'] / peak:.3f} | "
              + (f"{measured:.2f} | {peak / GiB / measured:.3f}" if measured else " | ")
              + f" | {r['seconds']:.0f} |")


def main(argv=None) -> None:
    import json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=QWEN25_7B["num_hidden_layers"])
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)),
                    help="comma-separated prompt lengths, tokens")
    ap.add_argument("--sp", default="1", help="comma-separated sequence-parallel degrees")
    ap.add_argument("--group", type=int, default=8, help="G answers per prompt")
    ap.add_argument("--answer", type=int, default=1024, help="tokens per answer")
    ap.add_argument("--attention", default="flex_attention", choices=("flex_attention", "sdpa"),
                    help="sdpa: the CPU path's dense (T, T) tree mask, for comparison")
    ap.add_argument("--quick", action="store_true", help="1 layer, a 1,024-token prompt, G = 4 "
                    "answers of 256 tokens")
    ap.add_argument("--save", help="append each row to this JSON Lines file")
    ap.add_argument("--table", help="only print the table of the rows saved in this file")
    ap.add_argument("--trust", action="store_true", help="only the tracker's trust check")
    ap.add_argument("--gpu-check", metavar="TOKENS",
                    help="comma-separated T: bench/gpu_check.py's update in a world of one "
                    "(--layers of Qwen2.5-7B's, 2 micro-batches of T tokens) instead of the node")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="responder groups per rank, one a micro-batch, in one optimiser step")
    ap.add_argument("--foreach", action="store_true",
                    help="AdamW's foreach implementation (CUDA's default) instead of "
                    "spell.make_optimizer's fused one")
    args = ap.parse_args(argv)
    # infra.exchange's all_to_all_single warns of its deprecation at every call
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated")
    if args.trust:
        return print_trust(trust_check())
    if args.table:  # memory_estimate asked again: the rows keep the case, not the estimate
        rows = [json.loads(line) for line in Path(args.table).read_text().splitlines()]
        for r in rows:
            r.update(case_estimate(project_api(WORLD), r, args.group, args.answer,
                                   args.attention))
        return print_table(rows, args.group, args.answer)
    if args.gpu_check:
        api, rows = project_api(1, device_gib=H200_GIB, foreach=args.foreach), []
        for T in map(int, args.gpu_check.split(",")):
            with process_group("fake", 1) as mesh:
                rows.append(gpu_check_case(api, mesh, T, args.layers))
            if args.save:
                with open(args.save, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
        return print_gpu_check(rows)
    if args.quick:
        args.layers, args.prompts, args.group, args.answer = 1, "1024", 4, 256
    shape = {**QWEN25_7B, "num_hidden_layers": args.layers}
    api, rows = project_api(WORLD, foreach=args.foreach), []
    for sp in map(int, args.sp.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            r = refused_case(api, shape, prompt, args.group, args.answer, args.attention, sp)
            if r is None:
                with process_group("fake", WORLD, simulated_rank(sp)) as mesh:
                    r = simulate_case(api, mesh, shape, prompt, args.group, args.answer,
                                      args.attention, sp, args.micro_batches)
                print(f"prompt {prompt}, SP {sp}: peak {r['peak']['total'] / GiB:.2f} GiB per "
                      f"rank, {r['seconds']:.0f} s, process max RSS {r['rss'] / GiB:.2f} GiB",
                      flush=True)
            rows.append(r)
            if args.save:
                with open(args.save, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print_table(rows, args.group, args.answer)


if __name__ == "__main__":
    main()
