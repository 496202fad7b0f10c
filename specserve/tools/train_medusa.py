"""specserve train-medusa: Medusa heads for a frozen target (specserve/methods/medusa.py).

The target reads text; head i, on the target's last hidden state at position t, learns the
target's own distribution of the token at t + i + 2 (self-distillation: KL(target ‖ head) at
temperature 1, the target's distribution taken from the same teacher-forced forward at
position t + i + 1). What the heads learn is what the verifier will check them against.

Text: --data files and directories (every .py, .txt and .md file under each); none given,
the Python standard library's files (without test packages), as the demo pair's corpus. A
file is held out when the demo's split rule says so (sha1 of its relative path, 1 in 20):
the held-out files score the heads and are never trained on.

The heads train for --tokens of target context in batches of --batch x --seq-len tokens,
on --positions positions per sequence (the LM head is the dear part of a step; a target
forward gives every position's context at once). A checkpoint is written every
--checkpoint-minutes (in the out directory's work/) and on SIGTERM; a rerun with the same
flags resumes from it, and a finished run removes it. The out
directory gets the heads (config.json, model.safetensors), loss_curves.png and
training_report.json: each head's held-out top-1 and top-5 agreement with the target's
greedy token, and the tokens a greedy round would keep, replayed on the target's own greedy
continuations of held-out text.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.methods.medusa import MedusaConfig, MedusaHeads, save_heads
from specserve.model.gguf import is_named, resolve_model
from specserve.paths import DEMO_MODELS, DEMO_TARGET, REPO_ROOT
from specserve.tools import train_demo as recipe

log = logging.getLogger("specserve.tools.train_medusa")
TEXT_SUFFIXES = (".py", ".txt", ".md")


@dataclass(frozen=True)
class MedusaRecipe:
    """The flags a checkpoint must match, and what recipe.train reads of a config."""

    target: str
    heads: int = 4
    tokens: int = 2_000_000
    seq_len: int = 512
    batch_seqs: int = 8
    positions: int = 128
    lr: float = 1e-3
    warmup_steps: int = 30
    log_every: int = 10
    eval_every: int = 100
    checkpoint_minutes: float = 5.0
    seed: int = 1234

    @property
    def tokens_per_step(self) -> int:
        return self.batch_seqs * self.seq_len

    @property
    def total_steps(self) -> int:
        return max(1, self.tokens // self.tokens_per_step)


def read_texts(data: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) texts of the files under data (the standard library when empty; the
    installed packages' descriptions for PACKAGES)."""
    if not data:
        train, heldout = recipe.load_corpus(recipe.stdlib_root(), 0)
        return list(train.values()), list(heldout.values())
    if data == [PACKAGES]:
        return package_descriptions()
    train, heldout = [], []
    for entry in map(Path, data):
        if not entry.exists():
            raise SystemExit(f"--data {entry}: no such file or directory")
        files = [entry] if entry.is_file() else sorted(p for p in entry.rglob("*") if p.suffix in TEXT_SUFFIXES)
        for path in files:
            text = recipe.read_source(path) if path.is_file() else None
            if text:
                rel = path.relative_to(entry).as_posix() if entry.is_dir() else path.name
                (heldout if recipe.is_heldout(rel) else train).append(text)
    if not train:
        raise SystemExit(f"--data {' '.join(data)}: no text files to train on")
    if not heldout and len(train) > 1:  # too few files for the rule to pick one: hold out the last
        heldout.append(train.pop())
    return train, heldout


PACKAGES = "packages"  # --data value: the installed packages' descriptions


def package_descriptions() -> tuple[list[str], list[str]]:
    """(train, held-out) descriptions of the installed Python packages (each distribution's
    METADATA body: its README, mostly English prose with some code and lists), split by the
    demo's held-out rule on the package's name. Text a package ships, for a target that is
    not a code model (a chat model's heads learn its prose)."""
    from importlib.metadata import distributions

    train, heldout = [], []
    for distribution in sorted(distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = distribution.metadata.get_payload() if hasattr(distribution.metadata, "get_payload") else ""
        if isinstance(body, str) and len(body) > 200:
            (heldout if recipe.is_heldout(distribution.metadata["Name"] or "") else train).append(body)
    if not train:
        raise SystemExit("the installed packages carry no descriptions to train on: give --data")
    return train, heldout


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """The texts as one token stream [tokens], each followed by the tokenizer's EOS (where it has one)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return np.asarray([t for row in ids for t in (*row, *eos)], dtype=np.int64)


def head_losses(target, heads: MedusaHeads, ids: torch.Tensor, positions: int, generator: torch.Generator):
    """Per-head KL(target ‖ head) [heads] on `positions` random positions of each row of ids."""
    n = heads.config.num_heads
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=recipe.cpu_has_bf16()):
        hidden = target.model(ids).last_hidden_state.float()  # [B, T, H], after the final norm
        teacher = target.lm_head(hidden).float().log_softmax(-1)  # [B, T, V]
    usable = ids.shape[1] - n - 1  # t + n + 1 must lie in the row
    picks = torch.stack([torch.randperm(usable, generator=generator)[:positions] for _ in range(ids.shape[0])])
    rows = torch.arange(ids.shape[0])[:, None]
    logits = heads.logits(hidden[rows, picks], target.lm_head.weight.detach())  # [n, B, P, V]
    losses = []
    for i in range(n):
        want = teacher[rows, picks + i + 1]  # the target's log p of the token at t + i + 2
        got = logits[i].log_softmax(-1)
        losses.append((want.exp() * (want - got)).sum(-1).mean())
    return torch.stack(losses)


@torch.no_grad()
def agreement(target, heads: MedusaHeads, seqs: np.ndarray, batch: int = 4) -> dict:
    """Each head's held-out top-1 and top-5 agreement with the target's greedy token."""
    n = heads.config.num_heads
    hits1, hits5, total = torch.zeros(n), torch.zeros(n), 0
    for start in range(0, len(seqs), batch):
        ids = recipe.as_batch(seqs[start : start + batch])
        hidden = target.model(ids).last_hidden_state
        greedy = target.lm_head(hidden).argmax(-1)  # [B, T]: the target's token after each position
        top = heads.logits(hidden[:, : -n - 1], target.lm_head.weight).topk(5, dim=-1).indices  # [n, B, T', 5]
        for i in range(n):
            want = greedy[:, i + 1 : i + 1 + top.shape[2]]
            hits1[i] += (top[i, ..., 0] == want).sum()
            hits5[i] += (top[i] == want[..., None]).any(-1).sum()
        total += top.shape[1] * top.shape[2]
    return {"top1": (hits1 / total).tolist(), "top5": (hits5 / total).tolist(), "positions": total}


@torch.no_grad()
def replay_rounds(target, heads: MedusaHeads, prompts: list[torch.Tensor], new_tokens: int, top_k: int) -> dict:
    """Greedy rounds replayed on the target's own continuations: each round's candidates are
    each head's top_k tokens (a full tree of top_k children per depth, depth = heads); a round
    keeps the bonus token and the longest run of heads whose candidates hold the target's
    token. Returns the mean tokens a round for top_k 1 (a chain) and top_k."""
    kept = {1: [], top_k: []}
    for prompt in prompts:
        sequence = target.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)[0]
        hidden = target.model(sequence[None]).last_hidden_state[0]
        top = heads.logits(hidden, target.lm_head.weight).topk(top_k, dim=-1).indices  # [n, T, k]
        for k in kept:
            j = len(prompt) - 1  # the round reads the hidden state of the last kept position
            while j + 1 < len(sequence):
                accepted = 0
                for i in range(heads.config.num_heads):
                    if j + 2 + i >= len(sequence) or int(sequence[j + 2 + i]) not in top[i, j, :k].tolist():
                        break
                    accepted += 1
                kept[k].append(1 + accepted)
                j += 1 + accepted
    return {f"top{k}": float(np.mean(v)) for k, v in kept.items()}


def plot(history: dict, per_head: list[tuple[int, list[float]]], path: Path) -> None:
    """Each head's training loss (this sitting's steps, a moving mean) and the held-out top-1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if per_head:
        steps = np.array([step for step, _ in per_head])
        losses = np.array([row for _, row in per_head])
        window = max(1, len(steps) // 50)
        kernel = np.ones(window) / window
        for i in range(losses.shape[1]):
            left.plot(steps[window - 1 :], np.convolve(losses[:, i], kernel, "valid"), label=f"head {i} (t+{i + 2})")
        left.legend()
    left.set(xlabel="step", ylabel="KL(target ‖ head), nats", title="training loss")
    evals = history["eval"]
    right.plot([row["step"] for row in evals], [row["mean top-1"] for row in evals], marker="o")
    right.set(xlabel="step", ylabel="agreement", title="held-out top-1, mean over heads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    cfg = MedusaRecipe(str(Path(args.target).resolve()), args.heads, args.tokens, args.seq_len, args.batch,
                       args.positions, args.lr, checkpoint_minutes=args.checkpoint_minutes)  # fmt: skip
    out = Path(args.out)
    torch.manual_seed(cfg.seed)
    target = recipe.load_model(Path(args.target)).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    train_texts, heldout_texts = read_texts(args.data)
    train_seqs = recipe.to_sequences(encode(tokenizer, train_texts), cfg.seq_len)
    heldout_seqs = recipe.to_sequences(encode(tokenizer, heldout_texts), cfg.seq_len)[: args.eval_seqs]
    if not len(train_seqs):
        raise SystemExit(f"the training text makes no sequence of {cfg.seq_len} tokens: give more --data")
    log.info("%d training sequences of %d tokens, %d held-out", len(train_seqs), cfg.seq_len, len(heldout_seqs))
    heads = MedusaHeads(MedusaConfig.for_target(args.target, cfg.heads))
    generator = torch.Generator().manual_seed(cfg.seed)
    per_head: list[tuple[int, list[float]]] = []  # this sitting's steps

    def loss_at(step: int) -> torch.Tensor:
        rows = recipe.batch_rows(len(train_seqs), cfg.batch_seqs, step, cfg.seed)
        generator.manual_seed(cfg.seed * 100_003 + step)  # the same positions when a run resumes
        losses = head_losses(target, heads, recipe.as_batch(train_seqs[rows]), cfg.positions, generator)
        per_head.append((step, losses.tolist()))
        return losses.sum()

    def evaluate() -> float:
        return float(np.mean(agreement(target, heads, heldout_seqs)["top1"])) if len(heldout_seqs) else 0.0

    job = recipe.TrainingJob("medusa", heads, loss_at, evaluate, "mean top-1", cfg.total_steps, cfg.lr,
                             out / "work", fingerprint=asdict(cfg))  # fmt: skip
    history, wall_s = recipe.train(job, cfg)
    evaluated = time.monotonic()
    heads.eval()
    save_heads(heads, out)
    shutil.rmtree(out / "work")  # the checkpoint: a finished run needs none
    plot(history, per_head, out / "loss_curves.png")
    prompts = [recipe.as_batch(row[: args.replay_prefix]) for row in heldout_seqs[: args.replay_prompts]]
    report = {
        "recipe": {**asdict(cfg), "target": heads.config.target_name},  # not this machine's path
        "target_fingerprint": heads.config.target_fingerprint,
        "train_sequences": len(train_seqs),
        "wall_s": wall_s,
        "heldout": agreement(target, heads, heldout_seqs) if len(heldout_seqs) else {},
        "greedy_tokens_per_round": replay_rounds(target, heads, prompts, args.replay_tokens, 4) if prompts else {},
        "eval_wall_s": time.monotonic() - evaluated,
    }
    recipe.write_json(out / "training_report.json", report)
    log.info("heads in %s: held-out top-1 %s; greedy tokens a round %s", out,
             " ".join(f"{x:.2f}" for x in report["heldout"].get("top1", [])),
             report["greedy_tokens_per_round"])  # fmt: skip
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve train-medusa", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument(
        "--target", default=str(DEMO_TARGET), help="the target model: a directory (Llama family) or a named model"
    )
    parser.add_argument(
        "--out", default=None, help="where the heads go (default: models/demo/medusa, or models/NAME/medusa)"
    )
    parser.add_argument(
        "--data",
        nargs="*",
        default=None,
        help=f"text files or directories, or {PACKAGES} (the installed packages' descriptions) "
        f"(default: the standard library for the demo target, else {PACKAGES})",
    )
    parser.add_argument("--heads", type=int, default=4, help="heads: tokens t+2 .. t+heads+1")
    parser.add_argument("--tokens", type=int, default=2_000_000, help="tokens of target context to train on")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens a sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--positions", type=int, default=128, help="positions a sequence the heads train on")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine decay)")
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0, help="minutes between checkpoints")
    parser.add_argument("--eval-seqs", type=int, default=24, help="held-out sequences scored")
    parser.add_argument("--replay-prompts", type=int, default=12, help="held-out prompts the greedy replay continues")
    parser.add_argument("--replay-prefix", type=int, default=128, help="tokens of each replay prompt")
    parser.add_argument("--replay-tokens", type=int, default=64, help="tokens each replay generates")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.heads < 1 or args.heads > 16:
        raise SystemExit("--heads must lie in 1..16")
    if args.seq_len < args.heads + 3 or args.positions < 1 or args.batch < 1 or args.tokens < 1:
        raise SystemExit("--seq-len must exceed --heads + 2, and --positions, --batch and --tokens be >= 1")
    named = is_named(args.target)
    if args.out is None:
        args.out = str(REPO_ROOT / "models" / args.target / "medusa" if named else DEMO_MODELS / "medusa")
    try:
        args.target = resolve_model(args.target)
    except ValueError as error:  # a named model whose package is missing
        raise SystemExit(f"--target: {error}") from None
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no config.json there (a Hugging Face model directory)")
    if args.data is None:
        args.data = [] if Path(args.target).resolve() == DEMO_TARGET.resolve() else [PACKAGES]
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
