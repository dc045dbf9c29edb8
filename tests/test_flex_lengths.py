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
def test_flex_attention_stays_fused_over_ten_row_lengths(dense_calls, monkeypatch):
    """Ten row lengths, the no_grad pass then the update pass, in one process: every call fused
    (no dense call), at most 4 compiled variants of flex_attention whatever the lengths (grad on
    or off x one block or several), and each row's log-probs those of SDPA with the dense tree
    mask."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flex, sdpa = tiny_llama(attn="flex_attention").to(device), tiny_llama().to(device)
    # these models are plain fp32 on every device; on a GPU infra.mask_dtype builds SDPA's dense
    # mask in bf16, the compute dtype of FSDP2's policy, which SDPA refuses beside fp32 queries
    monkeypatch.setattr(infra, "mask_dtype", lambda device, weight_dtype: weight_dtype)
    backward = device.type == "cuda"  # torch 2.13: no FlexAttention backward on CPU
    flex.requires_grad_(backward)
    rows = [row(length, shared, seed) for seed, (length, shared) in enumerate(ROWS)]
    before, builders = variants(flex_attention), variants(create_block_mask)
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
    # the variants the mechanism allows (infra.FLEX_RECOMPILE_LIMIT's comment): flex_attention,
    # 2 grad modes x one block or several; the BlockMask builder, always without grad, the blocks
    grown = variants(flex_attention) - before
    assert variants(flex_attention) >= 1 and grown <= 2 * 2, \
        f"flex_attention compiled {grown} variants for {len(ROWS)} lengths x 2 grad modes"
    assert variants(create_block_mask) >= 1 and variants(create_block_mask) - builders <= 2


@pytest.mark.stack
def test_compiled_block_mask_builder_over_ten_row_lengths():
    """The BlockMask builder the GPU runs (infra.compiled_flex(create_block_mask)), here on CPU
    with inductor: the eager builder's blocks at each of the ten lengths, from at most 2 compiled
    variants (one block or several), in either grad mode (tree_attention_mask builds without)."""
    build, before = infra.compiled_flex(create_block_mask), variants(create_block_mask)
    for seed, (length, shared) in enumerate(ROWS):
        packed = row(length, shared, seed)
        group, segment = packed["group_ids"], packed["segment_ids"]

        def mask_mod(b, h, q, k):
            return infra.tree_visible(group[q], segment[q], q, group[k], segment[k], k)

        with torch.set_grad_enabled(seed % 2 == 0), torch.no_grad():
            built = build(mask_mod, 1, None, length, length, device="cpu")
        eager = create_block_mask(mask_mod, 1, None, length, length, device="cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(built, name), getattr(eager, name)), (length, name)
    # dynamo keeps the variants on the function's code, those of other tests' compiles too
    assert 1 <= variants(create_block_mask) - before <= 2


@pytest.mark.stack
def test_flex_past_its_recompile_limit_is_an_error(dense_calls, monkeypatch):
    """Past infra.FLEX_RECOMPILE_LIMIT compiled variants the project's flex raises instead of
    running the dense path (torch.compile's default would run it, with one log line). A limit of
    1 and two head counts no other test uses: the second needs a variant past the limit."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    # the mask first, under the real limit: before torch 2.13 the limit is dynamo's global one,
    # which the builder's variants from other tests would meet too (compiled_flex)
    packed = row(301, True, 0)
    mask = infra.tree_attention_mask(packed, "flex_attention", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(infra, "FLEX_RECOMPILE_LIMIT", 1)
    infra.compiled_flex.cache_clear()  # the next compile takes the limit above
    # dynamo's own setting is restored afterwards (compiled_flex sets it before torch 2.13)
    limit = torch._dynamo.config.recompile_limit
    try:
        with (torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad(),
              pytest.raises(FailOnRecompileLimitHit)):
            for heads in (3, 5):
                q, k, v = torch.randn(3, 1, heads, 301, 64)  # (1, H, T, D) each
                infra.flex_attention_forward(None, q, k, v, mask)
    finally:
        infra.compiled_flex.cache_clear()  # later calls compile under the real limit
    assert dense_calls == []


# ---- the torch of the lent GPU machine (2.11): no recompile_limit in torch.compile


def compile_of_torch_2_11(real):
    """torch.compile with torch 2.11's keywords (no recompile_limit), calling the real one."""
    def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None,
                options=None, disable=False):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                    options=options, disable=disable)
    return compile


@pytest.mark.stack
def test_the_compiled_flex_calls_run_under_torch_2_11s_compile(monkeypatch, dense_calls):
    """Both calls the trainer compiles (the BlockMask builder, flex_attention) under torch 2.11's
    torch.compile, which the lent GPU machine has: its limit goes to dynamo's global setting.
    Watched fail on 4bac87c's compiled_flex ("compile() got an unexpected keyword argument
    'recompile_limit'", the first GPU run's error). ~20 s: one CPU compile of flex."""
    monkeypatch.setattr(torch, "compile", compile_of_torch_2_11(torch.compile))
    assert not infra.compile_takes_recompile_limit()
    infra.compiled_flex.cache_clear()
    try:
        with torch._dynamo.config.patch(recompile_limit=3):  # restored afterwards
            packed = row(389, True, 0)
            mask = infra.tree_attention_mask(packed, "flex_attention", torch.device("cpu"),
                                             torch.float32)
            q, k, v = torch.randn(3, 1, 4, 389, 64)  # (1, H, T, D) each: inductor (2.11)
            with torch.no_grad():                      # refuses one buffer as all three
                out, _ = infra.flex_attention_forward(None, q, k, v, mask)
            assert out.shape == (1, 389, 4, 64) and out.isfinite().all()
            assert torch._dynamo.config.recompile_limit == infra.FLEX_RECOMPILE_LIMIT
    finally:
        infra.compiled_flex.cache_clear()  # later tests compile with torch's own compile
    assert dense_calls == []
