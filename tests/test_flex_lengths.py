"""FlexAttention over many row lengths in one process, with no torch._dynamo.reset() between them
(issue #36, finding F3 of shared/notes/gpu-path-review.md).

Every micro-batch brings a new row length T. FlexAttention is fused only where torch.compile
traces it; where dynamo gives up on a call (past its recompile limit) it runs torch's eager flex,
which builds the dense (B, H, T, T) scores: 112 GiB at 32K tokens on Qwen2.5-7B. The tests here
run the trainer's own pattern (spell.update_policy: a no_grad pass over the micro-batches for the
old log-probs, then the update with gradients) over ten rows of ten lengths, shared-prefix and
plain, the 2-token row of a rank without data among them, and count every call of torch's dense
flex: `_math_attention_inner` is where its eager forward and its eager backward make the scores,
and it runs only on real tensors, never while dynamo or inductor traces. The count does not
depend on timing or memory, so it holds on CPU and on GPU alike.

torch 2.13 has no FlexAttention backward on CPU (flex_attention raises NotImplementedError when
q, k or v need a gradient): on CPU the update pass runs with gradients on and the parameters
frozen, which sets the same grad-mode guard as the update, forward only; on a GPU it runs the
backward too.

Slow tier (`stack`): the first two tests compile FlexAttention or its BlockMask builder, 20-60 s
each on 2 CPU cores (less with inductor's on-disk cache warm).
"""

import importlib

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import infra
import spell
from conftest import TEMPERATURE, tiny_llama

# torch's dense FlexAttention (its eager path); a name that `torch._higher_order_ops` also gives
# to the operator, hence the import by module path
DENSE = importlib.import_module("torch._higher_order_ops.flex_attention")

# (row length, shared prompt): irregular lengths, two inside one 128-token block (dynamo
# specialises a block count of 1), one a multiple of the block, 129 just past it, and 2, the dummy
# row (spell.dummy_sequence) a rank without data trains on
ROWS = [(301, True), (2, False), (97, True), (640, False), (389, True), (1000, False), (129, True),
        (777, False), (1203, True), (555, False)]

# flex against SDPA, both fp32 on the same weights: they differ only in summation order. Measured
# 9.5e-7 at these lengths; a log-prob's own rounding is ~5e-6 a side (test_spell.py,
# PACKED_ATTENTION_ATOL), and attention over 1203 keys adds sqrt(1203) u32 ~ 2e-6 relative
ATOL = 2e-5


def row(length: int, shared: bool, seed: int) -> dict:
    """A packed row of exactly `length` tokens through spell.pack_sequences: a prompt and three
    answers sharing it, or two plain sequences; length 2 is the dummy row."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 1000, (n,), generator=g).tolist()  # noqa: E731
    if length == 2:
        dummy = spell.dummy_sequence()
        return spell.pack_sequences([(dummy.prompt, dummy.completion)])
    if shared:
        p = length // 3
        c = (length - p) // 3
        prompt = ids(p)
        pairs = [(prompt, ids(c)), (prompt, ids(c)), (prompt, ids(length - p - 2 * c))]
    else:
        a = length // 2
        pairs = [(ids(a // 2), ids(a - a // 2)), (ids(3), ids(length - a - 3))]
    packed = spell.pack_sequences(pairs, shared=shared)
    assert packed["input_ids"].shape[1] == length and packed["shared"] == shared
    return packed


def variants(fn) -> int:
    """Compiled variants dynamo holds for fn's code object."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.fixture
def dense_calls(monkeypatch) -> list:
    """The q shape of every call of torch's dense FlexAttention (forward or backward)."""
    calls, inner = [], DENSE._math_attention_inner

    def counted(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return inner(query, *args, **kwargs)

    monkeypatch.setattr(DENSE, "_math_attention_inner", counted)
    return calls


@pytest.mark.stack
def test_flex_attention_stays_fused_over_ten_row_lengths(dense_calls):
    """Ten row lengths, the no_grad pass then the update pass, in one process: every call fused
    (no dense call), at most 4 compiled variants of flex_attention whatever the lengths (grad on
    or off x one block or several), and each row's log-probs those of SDPA with the dense tree
    mask."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flex, sdpa = tiny_llama(attn="flex_attention").to(device), tiny_llama().to(device)
    backward = device.type == "cuda"  # torch 2.13: no FlexAttention backward on CPU
    flex.requires_grad_(backward)
    rows = [row(length, shared, seed) for seed, (length, shared) in enumerate(ROWS)]
    before = variants(flex_attention)
    for grad in (False, True):  # the old log-probs, then the update (spell.update_policy)
        for packed in rows:
            with torch.set_grad_enabled(grad):
                logp = infra.packed_logprobs(flex, packed, TEMPERATURE)[0]  # (N,)
                if grad and backward:
                    flex.zero_grad(set_to_none=True)
                    logp.sum().backward()
                    assert all(p.grad is not None and p.grad.isfinite().all()
                               for p in flex.parameters())
            with torch.no_grad():
                ref = infra.packed_logprobs(sdpa, packed, TEMPERATURE)[0]
            torch.testing.assert_close(logp.detach(), ref, atol=ATOL, rtol=0)
        assert dense_calls == [], (f"{len(dense_calls)} FlexAttention calls fell back to the dense "
                                   f"(B, H, T, T) path (grad {grad}): {dense_calls}")
    grown = variants(flex_attention) - before
    assert variants(flex_attention) >= 1 and grown <= 4, \
        f"flex_attention compiled {grown} variants for {len(ROWS)} lengths x 2 grad modes"
    if device.type == "cuda":  # the BlockMask builder is compiled on GPU only (eager on CPU)
        assert 1 <= variants(create_block_mask) <= 4


@pytest.mark.stack
def test_compiled_block_mask_builder_over_ten_row_lengths():
    """The BlockMask builder the GPU runs (infra.compiled_flex(create_block_mask)), here on CPU:
    the eager builder's blocks at each of the ten lengths, from at most 2 compiled variants (one
    block or several)."""
    build = infra.compiled_flex(create_block_mask)
    for seed, (length, shared) in enumerate(ROWS):
        packed = row(length, shared, seed)
        group, segment = packed["group_ids"], packed["segment_ids"]

        def mask_mod(b, h, q, k):
            return infra.tree_visible(group[q], segment[q], q, group[k], segment[k], k)

        built = build(mask_mod, 1, None, length, length, device="cpu")
        eager = create_block_mask(mask_mod, 1, None, length, length, device="cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(built, name), getattr(eager, name)), (length, name)
    assert 1 <= variants(create_block_mask) <= 2


@pytest.mark.stack
def test_flex_past_its_recompile_limit_is_an_error(dense_calls, monkeypatch):
    """Past infra.FLEX_RECOMPILE_LIMIT compiled variants the project's flex raises instead of
    running the dense path (torch.compile's default would run it, with one log line). A limit of
    1 and two head counts no other test uses: the second needs a variant past the limit."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    monkeypatch.setattr(infra, "FLEX_RECOMPILE_LIMIT", 1)
    infra.compiled_flex.cache_clear()  # the next compile takes the limit above
    packed = row(301, True, 0)
    mask = infra.tree_attention_mask(packed, "flex_attention", torch.device("cpu"), torch.float32)
    try:
        with torch.no_grad(), pytest.raises(FailOnRecompileLimitHit):
            for heads in (3, 5):
                q = torch.randn(1, heads, 301, 64)  # (1, H, T, D)
                infra.flex_attention_forward(None, q, q, q, mask)
    finally:
        infra.compiled_flex.cache_clear()  # later calls compile under the real limit
    assert dense_calls == []


# ---- the trainer's compile workers beside vLLM's (finding F10)

# In a fresh interpreter, in spell's order: infra imported, then vLLM (which sets
# TORCHINDUCTOR_COMPILE_THREADS=1), then one compile through infra.compiled_flex, inductor's caches
# off so that it really compiles. Every worker count inductor asks for while compiling is recorded
# (get_compile_threads is where it asks). Prints, as JSON: inductor's global count after `import
# vllm`, the counts asked for during the compile, the global count after it.
COMPILE_PROBE = """
import json, torch
import infra
import vllm  # noqa: F401
import torch._inductor.async_compile as ac, torch._inductor.config as inductor  # after vLLM's
from torch.nn.attention.flex_attention import create_block_mask
after_vllm = inductor.compile_threads
asked, ask = [], ac.get_compile_threads
ac.get_compile_threads = lambda: asked.append(ask()) or asked[-1]
infra.compiled_flex(create_block_mask)(lambda b, h, q, k: q >= k, 1, None, 300, 300, device="cpu")
print(json.dumps([after_vllm, asked, inductor.compile_threads]))
"""


@pytest.mark.stack
@pytest.mark.parametrize("launched", [None, "3"])
def test_the_trainer_compiles_with_its_own_workers_after_vllm_set_one(launched):
    """`import vllm` sets inductor's compile workers to 1 for the whole process; compiled_flex's
    compiles still get trainer_compile_threads(): the TORCHINDUCTOR_COMPILE_THREADS the user
    launched with (3 here, on any machine), else this rank's share of the cores, at most 8.
    vLLM's own count stays 1. 10-20 s each (vLLM's import, one CPU compile)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    env.update(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", LOCAL_WORLD_SIZE="1",
               PYTHONPATH=str(infra.ROOT))
    if launched is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = launched
    done = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    after_vllm, asked, after = json.loads(done.stdout.strip().splitlines()[-1])
    want = int(launched) if launched else min(8, len(os.sched_getaffinity(0)))
    assert after_vllm == 1 and after == 1  # vLLM's setting, for vLLM's compiles
    assert asked and set(asked) == {want}, asked  # every time inductor asked, while compiling


def test_trainer_compile_threads_is_the_launch_value_or_a_share_of_the_cores(monkeypatch):
    """The rule of infra.trainer_compile_threads: the launch value wins (and a malformed one is a
    ConfigError naming the variable); else cores // ranks on this machine, between 1 and 8."""
    monkeypatch.setattr(infra, "_LAUNCH_COMPILE_THREADS", None)
    monkeypatch.setattr(infra.os, "sched_getaffinity", lambda pid: set(range(96)))
    for ranks, want in [("1", 8), ("8", 8), ("16", 6), ("96", 1), ("128", 1)]:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert infra.trainer_compile_threads() == want, ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for launched, want in [("1", 1), (" 12 ", 12)]:
        monkeypatch.setattr(infra, "_LAUNCH_COMPILE_THREADS", launched)
        assert infra.trainer_compile_threads() == want
    for launched in ("0", "-2", "four", ""):
        monkeypatch.setattr(infra, "_LAUNCH_COMPILE_THREADS", launched)
        with pytest.raises(infra.ConfigError, match="TORCHINDUCTOR_COMPILE_THREADS"):
            infra.trainer_compile_threads()
