"""A small GPT (decoder-only, characters) trained on Python's own standard library, pipelined.

    mpxrun -n 4 -- python examples/train_gpt.py                   # 2 stages x 2 replicas, async
    mpxrun -n 2 -- python examples/train_gpt.py --schedule 1f1b   # 2 stages
    python examples/train_gpt.py                                  # one process (one stage)

The corpus ships with Python: the standard library's own ``.py`` files
(``sysconfig.get_paths()["stdlib"]``, sorted by name, concatenated up to
``--corpus-chars``), so nothing is downloaded. Characters outside printable
ASCII become ``?``; the last tenth is held out for validation.

The model is an ``nn.Sequential`` of one tensor in, one tensor out::

    ids (b, T) -> Embedding -> Block x --blocks -> Head -> logits (b, T, vocab)
                  token+position  causal attention + MLP    LayerNorm + Linear

Each block makes its causal mask itself (``is_causal=True``), so only the
residual stream crosses a stage border and the model pipelines as it is.
Ranks = stages x replicas (``--stages``, default 2 when the rank count is
even, else one stage per rank): rank = replica * stages + stage, gradients
averaged across replicas (``data_parallel_comm``). ``--schedule async`` (the
default) steps every ``--step-every`` micro-batches (default ``--chunks``:
one step per batch, like the synchronous schedules) on weights stashed per
micro-batch.

Rank 0 prints a progress line every ``--log-every`` steps and a final
summary line (``final: train loss ..., validation loss ...``); the loss curve
goes to ``--plot`` (default ``gpt_loss.png``).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

from mpx.collectives import Communicator, allreduce, broadcast, world
from mpx.pipeline import SCHEDULES, Pipeline

__all__ = ["Block", "Embedding", "Head", "gpt", "load_corpus"]

# Printable ASCII and newline; everything else is mapped to "?".
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = ALPHABET.index("?")


def load_corpus(max_chars: int) -> torch.Tensor:
    """The standard library's source as character ids (the same on every rank)."""
    lookup = torch.full((128,), UNKNOWN, dtype=torch.long)
    for i, ch in enumerate(ALPHABET):
        lookup[ord(ch)] = i
    text, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        text.append(source)
        size += len(source)
        if size >= max_chars:
            break
    joined = "".join(text)[:max_chars].replace("\t", "    ")
    codes = torch.tensor([min(ord(c), 127) for c in joined], dtype=torch.long)
    return lookup[codes]


class Embedding(nn.Module):
    """Token and learned position embeddings: ids (b, T) -> (b, T, width)."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens: torch.Tensor = self.token(ids)
        return tokens + self.position[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, both residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (z.view(b, t, self.heads, width // self.heads).transpose(1, 2) for z in (q, k, v))
        # The causal mask is made here, from the sequence length, rather than
        # passed in: the stage borders then carry the residual stream alone.
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(att.transpose(1, 2).reshape(b, t, width)))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary: (b, T, width) -> logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


def gpt(
    vocab: int, width: int, blocks: int, heads: int, context: int, dropout: float = 0.0
) -> nn.Sequential:
    """The whole model; build it with the same seed on every rank."""
    return nn.Sequential(
        Embedding(vocab, width, context),
        *[Block(width, heads, dropout) for _ in range(blocks)],
        Head(width, vocab),
    )


def next_char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def windows(
    ids: torch.Tensor, count: int, length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random windows: inputs (count, length) and the next characters."""
    starts = torch.randint(0, len(ids) - length - 1, (count,), generator=gen)
    rows = torch.stack([ids[s : s + length + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="async")
    parser.add_argument("--stages", type=int, default=0, help="default: 2 if ranks even")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step, all replicas")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--step-every", type=int, default=0, help="async (default: --chunks)")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-chars", type=int, default=2_000_000)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--plot", default="gpt_loss.png", help="PNG of the loss curve")
    return parser.parse_args()


def layout(args: argparse.Namespace, comm: Communicator) -> tuple[int, int]:
    """(stages, replicas) for this many ranks."""
    stages = args.stages or (2 if comm.size % 2 == 0 else comm.size)
    if comm.size % stages:
        raise SystemExit(f"--stages {stages} must divide the {comm.size} ranks")
    replicas = comm.size // stages
    if args.batch % (replicas * args.chunks):
        raise SystemExit(
            f"--batch {args.batch} must be divisible by replicas x chunks = "
            f"{replicas} x {args.chunks}"
        )
    if stages > args.blocks + 2:
        raise SystemExit(f"{stages} stages but the model has only {args.blocks + 2} layers")
    return stages, replicas


def balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible; the last stages take the extra
    (the first stage's embedding is cheap, the blocks are not)."""
    return [layers // stages + (1 if s >= stages - layers % stages else 0) for s in range(stages)]


def plot(steps: list[int], losses: list[float], validation: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, marker="o", label="training loss (mean since last point)")
    ax.axhline(validation, color="tab:red", linestyle="--", label="final validation loss")
    ax.axhline(math.log(len(ALPHABET)), color="gray", linestyle=":", label="uniform guess")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    args = parse_args()
    # One thread per rank by default: ranks usually fill the cores already, and
    # intra-op threads fighting over a core slow every rank down.
    torch.set_num_threads(args.threads)
    comm = world()
    stages, replicas = layout(args, comm)
    stage, replica = comm.rank % stages, comm.rank // stages
    # rank = replica * stages + stage: the pipeline = one replica's ranks, the
    # data-parallel group = one stage's ranks across replicas.
    stage_comm = comm.split(replica)
    replica_comm = comm.split(stage)
    assert stage_comm is not None
    assert replica_comm is not None

    ids = load_corpus(args.corpus_chars)
    cut = len(ids) * 9 // 10
    train, held_out = ids[:cut], ids[cut:]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = gpt(len(ALPHABET), args.width, args.blocks, args.heads, args.context, args.dropout)
    async_opts = {}
    if args.schedule == "async":
        async_opts = {"step_every": args.step_every or args.chunks}
    pipe = Pipeline(
        model,
        balance=balance(len(model), stages),
        comm=stage_comm,
        chunks=args.chunks,
        schedule=args.schedule,
        seed=args.seed,
        data_parallel_comm=replica_comm if replicas > 1 else None,
        **async_opts,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    params = torch.tensor([float(sum(p.numel() for p in pipe.parameters()))])
    allreduce(params, comm=replica_comm)  # replicas hold the same stage: count once
    allreduce(params, comm=stage_comm)
    params /= replicas
    if comm.rank == 0:
        print(
            f"gpt: {len(ids):,} characters of {sysconfig.get_paths()['stdlib']}, vocabulary "
            f"{len(ALPHABET)}; {args.blocks} blocks, width {args.width}, context "
            f"{args.context}, {params[0] / 1e6:.2f} M parameters; {comm.size} rank(s) = "
            f"{stages} stage(s) x {replicas} replica(s), balance {pipe.balance}, "
            f"{args.schedule}, {args.chunks} micro-batches",
            flush=True,
        )

    # Every rank draws the same batches; a replica takes its share of each.
    gen = torch.Generator().manual_seed(args.seed + 1)
    mine = slice(replica * args.batch // replicas, (replica + 1) * args.batch // replicas)
    logged_steps: list[int] = []
    logged_loss: list[float] = []
    window: list[float] = []
    start = tick = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = windows(train, args.batch, args.context, gen)
        loss = pipe.step(x[mine], y[mine], next_char_loss, opt)
        if not math.isnan(loss):  # async: each call returns the previous one's loss
            window.append(loss)
        if step == args.steps and args.schedule == "async":
            window.append(pipe.flush(opt))
        if step % args.log_every == 0 or step == args.steps:
            mean = sum(window) / max(len(window), 1)
            logged_steps.append(step)
            logged_loss.append(mean)
            now = time.perf_counter()
            if comm.rank == 0:
                tokens = len(window) * args.batch * args.context / (now - tick)
                print(
                    f"step {step:5d}/{args.steps}  loss {mean:.4f}  "
                    f"{tokens:,.0f} chars/s  ({now - start:.1f} s)",
                    flush=True,
                )
            window, tick = [], now

    # Validation: the last stage of each replica scores its share of the held-out windows.
    pipe.eval()
    vx, vy = windows(held_out, args.batch, args.context, torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = pipe(vx[mine])
    score = torch.zeros(2, dtype=torch.float64)
    if logits is not None:
        score += torch.tensor([float(next_char_loss(logits, vy[mine])), 1.0])
    allreduce(score, comm=comm)
    validation = float(score[0] / score[1])
    if comm.rank == 0:
        wall = time.perf_counter() - start
        print(
            f"final: train loss {logged_loss[-1]:.4f}, validation loss {validation:.4f} "
            f"(uniform guess {math.log(len(ALPHABET)):.2f}); {args.steps} steps in {wall:.1f} s; "
            f"plot {args.plot}",
            flush=True,
        )
        title = f"GPT on the stdlib: {stages} stage(s) x {replicas} replica(s), {args.schedule}"
        plot(logged_steps, logged_loss, validation, args.plot, title)
    broadcast(torch.zeros(1), 0, comm=comm)  # leave together


if __name__ == "__main__":
    main()
