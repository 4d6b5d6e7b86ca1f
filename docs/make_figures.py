"""Draws the figures of docs/choosing.md from the tables in BENCHMARKS.md.

``python docs/make_figures.py`` (after ``nox -s bench``) writes
``docs/figures/*.png``. Nothing is invented here: every point is a number of
a benchmark table, and a figure whose table is missing is skipped with a note.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures"


def tables(section: str) -> list[list[dict[str, str]]]:
    """The markdown tables of one ``<!-- bench:NAME -->`` section, rows as dicts."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    found = re.search(
        rf"<!-- bench:{re.escape(section)} begin -->(.*?)<!-- bench:{re.escape(section)} end -->",
        text,
        re.DOTALL,
    )
    if not found:
        return []
    result: list[list[dict[str, str]]] = []
    lines = found[1].splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(head, cells, strict=False)))
                i += 1
            result.append(rows)
        else:
            i += 1
    return result


def _number(text: str) -> float:
    match = re.search(r"[-+]?\d*\.?\d+(?:e[-+]?\d+)?", text.replace(",", ""))
    return float(match[0]) if match else float("nan")


def _size_bytes(label: str) -> float:
    value = _number(label)
    return value * (1 << 20) if "MiB" in label else value * (1 << 10)


def allreduce_bandwidth() -> str:
    found = tables("collectives/bench_allreduce")
    if not found:
        return "collectives table missing"
    rows = [r for r in found[0] if r.get("op") == "allreduce" and r.get("ranks") == "2"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        mine = [r for r in rows if r["implementation"] == impl]
        ax.plot(
            [_size_bytes(r["size"]) for r in mine],
            [_number(r["busbw (GB/s)"]) for r in mine],
            marker="o",
            label=impl,
        )
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title="float32 allreduce, 2 ranks, one node")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "allreduce_bandwidth.png", dpi=100)
    return "allreduce_bandwidth.png"


def pipeline_bubble() -> str:
    found = tables("pipeline/bench_pipeline")
    if not found:
        return "pipeline table missing"
    rows = [r for r in found[0] if r.get("config", "").startswith("mpx gpipe")]
    if not rows:
        return "no gpipe rows"
    m = [_number(r["micro-batches m"]) for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(m, [_number(r["measured bubble"]) for r in rows], marker="o", label="measured")
    ax.plot(
        m, [_number(r["theory (p-1)/(m+p-1)"]) for r in rows], marker="x", label="(p-1)/(m+p-1)"
    )
    ax.set(xlabel="micro-batches m", ylabel="idle fraction (bubble)",
           title="GPipe on 2 stages")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "pipeline_bubble.png", dpi=100)
    return "pipeline_bubble.png"


def compression_speedup() -> str:
    found = tables("quantize/bench_quantize")
    runs = [t for t in found if t and "4-bit mpx.quantize (ms)" in t[0]]
    if not runs:
        return "quantize allreduce tables missing"
    labels = ["shared memory", "1 Gbit/s link"][: len(runs)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in zip(labels, runs, strict=False):
        ax.plot(
            [r["size"] for r in rows],
            [1.0 / _number(r["÷ MPI"]) for r in rows],
            marker="o",
            label=label,
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="allreduce size (float32)", ylabel="speed-up of 4-bit over MPI Allreduce",
           title="Compression pays when the link is slow (2 ranks)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "compression_speedup.png", dpi=100)
    return "compression_speedup.png"


def layer_parallel_scaling() -> str:
    found = tables("mgrit/bench_mgrit")
    rows = next((t for t in found if t and "ranks" in t[0]), None)
    if rows is None:
        return "mgrit scaling table missing"
    ranks = [_number(r["ranks"]) for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ranks, [_number(r["layer-parallel (ms)"]) for r in rows], marker="o",
            label="layer-parallel (MGRIT)")  # fmt: skip
    ax.plot(ranks, [_number(r["serial (ms)"]) for r in rows], marker="x", label="serial network")
    ax.set(xlabel="ranks (2 cores: 3 is oversubscribed)", ylabel="forward + backward (ms)",
           title="Layer-parallel ResNet, 32 steps")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "layer_parallel_scaling.png", dpi=100)
    return "layer_parallel_scaling.png"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for draw in (allreduce_bandwidth, pipeline_bubble, compression_speedup, layer_parallel_scaling):
        print(f"{draw.__name__}: {draw()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
