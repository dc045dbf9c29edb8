"""The SPELL loop on CPU, two settings side by side in one run: the quickstart as it was
(2 rounds of 2 questions per rank, no bootstrapping) against today's demo.toml,
on the same machine and corpus.

    .venv/bin/python bench/bench_cpu_loop.py                 # 2 steps each, 2 ranks (about 20 min)
    .venv/bin/python bench/bench_cpu_loop.py --steps 3 --nproc 2

Each setting runs `torchrun spell.py --config presets/demo.toml [overrides]` into its own folder
under runs/bench_cpu_loop/, then the table is built from the metrics.jsonl files. Per role:
questions or sequences generated, generated tokens per second (all ranks' tokens over rank 0's phase
time); then what trained: sequences per step and per minute of wall time (the whole step: rollout,
update, sync).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {  # name -> overrides of demo.toml
    "old quickstart": ["--rollout.clusters_per_round=4", "--rollout.max_rounds=2",
                       "--bootstrap.questioner_floor=0", "--bootstrap.responder_format_penalty=0",
                       "--engine.kv_cache_gb=1"],
    "demo.toml": [],
}


def run(name: str, overrides: list[str], steps: int, nproc: int, out: Path) -> float:
    """One setting to the end; returns its wall time in seconds (vLLM and model start included)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "spell.py", "--config", "presets/demo.toml",
           f"--log.out_dir={out}", f"--train.steps={steps}", f"--log.save_every={steps}",
           "--log.sample_every=0", *overrides]
    print(f"# {name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - t0


def summarise(out: Path) -> dict:
    """Sums and means over the steps of one run's metrics.jsonl."""
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    total = lambda key: sum(m.get(key, 0) for m in steps)  # noqa: E731
    step_s = total("perf/step_s")
    return {
        "steps": len(steps), "step_s": step_s / len(steps),
        "questions": total("que/questions"), "valid": total("res/groups"),
        "que_tok_s": total("perf/que_tokens_per_s") / len(steps),
        "res_tok_s": total("perf/res_tokens_per_s") / len(steps),
        "ver_tok_s": total("perf/ver_tokens_per_s") / len(steps),
        "rollout_s": total("perf/rollout_s") / len(steps),
        "update_s": total("perf/update_s") / len(steps),
        "trained": total("train/sequences"),
        "updates": sum(m.get("train/sequences", 0) > 0 for m in steps),
        "que": total("que/pos") + total("que/floor") + total("que/neg"),
        "res_groups": total("res/kept_groups"), "ver_groups": total("ver/kept_groups"),
        "trained_per_min": total("train/sequences") / (step_s / 60),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    rows = {}
    for name, overrides in SETTINGS.items():
        out = REPO / "runs" / "bench_cpu_loop" / name.replace(" ", "_").replace(".", "_")
        wall = run(name, overrides, args.steps, args.nproc, out)
        rows[name] = {**summarise(out), "wall_s": wall}
    cols = [("steps", "{:d}"), ("wall_s", "{:.0f}"), ("step_s", "{:.0f}"), ("rollout_s", "{:.0f}"),
            ("update_s", "{:.0f}"), ("questions", "{:d}"), ("valid", "{:d}"),
            ("que_tok_s", "{:.1f}"), ("res_tok_s", "{:.1f}"), ("ver_tok_s", "{:.1f}"),
            ("updates", "{:d}"), ("trained", "{:d}"), ("que", "{:d}"), ("res_groups", "{:d}"),
            ("ver_groups", "{:d}"), ("trained_per_min", "{:.2f}")]
    print(f"\n{args.nproc} ranks, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; "
          "step_s, rollout_s, update_s are means per step; "
          "que/res/ver_tok_s generated tokens per second of that phase; the rest are totals")
    print("| setting | " + " | ".join(c for c, _ in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, r in rows.items():
        cells = (fmt.format(int(r[c]) if fmt.endswith("d}") else r[c]) for c, fmt in cols)
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
