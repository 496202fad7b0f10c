"""specserve train-eagle: an EAGLE head for a frozen target (specserve/methods/eagle.py).

Text: the target's own answers (transformers, batched, bfloat16; greedy, or sampled at
--temperature) to chat questions made from templates and its tokenizer's words
(specserve.tools.workloads.chat_questions), or, with --text code (the default where the
tokenizer has no chat template), its continuations of code cut from installed Python files
(workloads.training_code_contexts), so that the head learns what the model writes when it
serves, and no dataset is needed. They are kept in OUT/work/answers.jsonl: a rerun reuses
them. One answer in 25 is held out.

Training: the target reads each answer once (its normed last hidden states, from the
prompt's last position on); the head learns, at entry t, KL(target || head) over its
vocabulary of the target's distribution of token t + 2, plus a smooth L1 to the target's
hidden state f_{t+1}; with --unroll also the second step of a chain, fed its own guess.

Report: OUT/training_report.json and a table: at every position of the held-out answers the
head drafts a greedy chain of --k tokens, and a round keeps them up to the first that
differs from the answer (what a greedy verify would keep): the share of rounds keeping at
least j drafts, and the tokens a round of K drafts would make; and, sampled, the chance that
the exact rule keeps a first draft drawn from the head (REPORT_TEMPERATURES).

    specserve train-eagle --target smollm2 --data-minutes 16 --train-minutes 10
    specserve train-eagle --target models/demo/target --out demo-eagle --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.methods.eagle import EagleConfig, EagleHead, attend, save_head
from specserve.model.gguf import is_named, resolve_model
from specserve.paths import REPO_ROOT

log = logging.getLogger("specserve.tools.train_eagle")
HELD_OUT = 25  # one answer in this many
REPORT_TEMPERATURES = (0.8, 1.0)  # the report's sampled acceptance


@dataclass(frozen=True)
class EagleRecipe:
    target: str
    out: str
    questions: int = 20000
    data_minutes: float = 16.0
    max_new_tokens: int = 200
    temperature: float = 0.0  # of the answers: 0 greedy (what greedy requests see), else sampled
    text: str = ""  # what the target is asked: chat questions or code prompts ("": chat where it has a chat template)
    batch: int = 128
    train_minutes: float = 10.0
    max_steps: int = 0  # 0: as many as train_minutes allow
    lr: float = 2e-3
    vocab: int = 8192
    unroll: bool = True
    k: int = 4
    heldout: int = 50
    seed: int = 0


def asked_prompts(tokenizer, recipe: EagleRecipe) -> list[list[int]]:
    """What the target answers, as token ids: chat questions through its chat template, or
    code prompts (the context before a cut in an installed Python file) as they are."""
    from specserve.tools.workloads import chat_questions, training_code_contexts

    if text_of(recipe, tokenizer) == "code":
        return [tokenizer(text)["input_ids"] for text in training_code_contexts(recipe.questions, recipe.seed)]
    return [prompt_ids(tokenizer, q) for q in chat_questions(tokenizer, recipe.questions, recipe.seed)]


def text_of(recipe: EagleRecipe, tokenizer) -> str:
    return recipe.text or ("chat" if getattr(tokenizer, "chat_template", None) else "code")


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as the model is asked it: its chat template where it has one."""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(question + "\n")["input_ids"]


def make_answers(model, tokenizer, recipe: EagleRecipe, path: Path) -> list[dict]:
    """The target's answers, greedy or at recipe.temperature (cached in path, JSON lines of
    prompt and answer ids)."""
    from tqdm import tqdm

    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    asked = asked_prompts(tokenizer, recipe)
    rows, started, eos = [], time.monotonic(), model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with tqdm(total=len(asked), desc="answers", unit="answer") as bar:
        while len(rows) < len(asked) and time.monotonic() - started < 60 * recipe.data_minutes:
            batch = asked[len(rows) : len(rows) + recipe.batch]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                made = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=recipe.max_new_tokens, pad_token_id=min(eos),
                    do_sample=recipe.temperature > 0, temperature=recipe.temperature or None, top_k=0, top_p=1.0,
                )[:, width:].tolist()  # fmt: skip
            for prompt, answer in zip(batch, made):
                end = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
                rows.append({"prompt": prompt, "answer": answer[:end]})
            bar.update(len(batch))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


@torch.inference_mode()
def features(model, rows: list[dict], batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row, from the prompt's last token on: (tokens [T], the target's normed last hidden
    states [T, hidden])."""
    from tqdm import tqdm

    out = []
    for start in tqdm(range(0, len(rows), batch), desc="hidden states", unit="batch"):
        chunk = [row["prompt"] + row["answer"] for row in rows[start : start + batch]]
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(c) for c in chunk], batch_first=True)
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(c) for c in chunk])[:, None]).long()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for j, row in enumerate(rows[start : start + batch]):
            first = len(row["prompt"]) - 1
            out.append((ids[j, first : len(chunk[j])].clone(), hidden[j, first : len(chunk[j])].float().clone()))
    return out


def collate(rows, embed: torch.Tensor):
    """Entries (f_t, e(x_{t+1})), their targets f_{t+1}, where a target is, and x_{t+1}."""
    size = max(len(ids) for ids, _ in rows) - 1
    feature = torch.zeros(len(rows), size, embed.shape[1])
    target, nexts = torch.zeros_like(feature), torch.zeros(len(rows), size, dtype=torch.long)
    mask = torch.zeros(len(rows), size, dtype=torch.bool)
    for j, (ids, hidden) in enumerate(rows):
        n = len(ids) - 1
        feature[j, :n], nexts[j, :n], target[j, : n - 1], mask[j, : n - 1] = hidden[:n], ids[1:], hidden[1:n], True
    return feature, embed[nexts], target, mask, nexts


def second_entries(head: EagleHead, guessed, nexts, embed, keys):
    """Every entry's second chain step at once: entry t + 1 from its own guess g_t and token
    t + 2, attending over the true entries up to t and itself."""
    size = guessed.shape[1]
    x, q, k, v = head.entries(guessed[:, :-1], embed[nexts[:, 1:]], torch.arange(1, size))
    k, v = torch.cat([keys[0][:, :-1], k], 1), torch.cat([keys[1][:, :-1], v], 1)
    mask = torch.cat([torch.ones(size - 1, size - 1).tril().bool(), torch.eye(size - 1, dtype=torch.bool)], 1)
    return head.finish(x, attend(q, k, v, mask))


def loss_of(guessed, target, mask, lm_rows) -> tuple[torch.Tensor, float]:
    """KL(target || head) over the head's vocabulary, plus a smooth L1 on the features; and
    how often the two argmaxes agree."""
    logits = (guessed[mask] @ lm_rows.T).float().log_softmax(-1)
    with torch.no_grad():
        teacher = (target[mask] @ lm_rows.T).float().log_softmax(-1)
    kl = F.kl_div(logits, teacher, log_target=True, reduction="batchmean")
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
    return kl + F.smooth_l1_loss(guessed[mask].float(), target[mask].float()), agree


def train(head: EagleHead, data, embed: torch.Tensor, recipe: EagleRecipe) -> list[dict]:
    """Trains head in place (cosine schedule over the minutes or steps); the loss history."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
    started, step, history = time.monotonic(), 0, []
    while True:
        done = (
            step / recipe.max_steps if recipe.max_steps else (time.monotonic() - started) / (60 * recipe.train_minutes)
        )
        if done >= 1:
            return history
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * min(1, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * done))
        feature, embedding, target, mask, nexts = collate(random.sample(data, min(16, len(data))), embed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            guessed, keys = head(feature, embedding)
            loss, agree = loss_of(guessed, target, mask, head.lm_rows)
            if recipe.unroll and guessed.shape[1] > 2:
                second = second_entries(head, guessed, nexts, embed, keys)
                loss = loss + loss_of(second, target[:, 1:], mask[:, 1:], head.lm_rows)[0]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        history.append({"step": step, "loss": loss.item(), "top1": agree})
        if step % 50 == 0:
            log.info(
                "%.0f s, step %d: loss %.3f, top-1 agreement %.3f", time.monotonic() - started, step, loss.item(), agree
            )


def _first_guesses(head: EagleHead, ids: torch.Tensor, hidden: torch.Tensor, embed: torch.Tensor):
    """The head over an answer's true entries: (each entry's guess but the last's [size - 1,
    hidden], entry t guessing token t + 2; the entries' keys and values [1, size, ...])."""
    size = len(ids) - 1
    x, q, keys, values = head.entries(hidden[None, :size], embed[ids[1:]][None], torch.arange(size))
    return head.finish(x, attend(q, keys, values, causal=True))[0, :-1], keys, values


@torch.inference_mode()
def replay(head: EagleHead, data, embed: torch.Tensor, k: int) -> torch.Tensor:
    """Per held-out position, how many of the head's greedy chain of k drafts match the answer."""
    kept = []
    for ids, hidden in data:
        size = len(ids) - 1
        if size < 3:
            continue
        guessed, keys, values = _first_guesses(head, ids, hidden, embed)
        starts = torch.arange(size - 1)
        drafts, own = [head.vocabulary[(guessed @ head.lm_rows.T).argmax(-1)]], ([], [])
        for depth in range(1, k):
            x, q, key, value = head.entries(guessed[:, None], embed[drafts[-1]][:, None], (starts + depth)[:, None])
            own[0].append(key[:, 0])
            own[1].append(value[:, 0])
            visible = torch.arange(size)[None] <= starts[:, None]  # the true entries a row may see
            mask = torch.cat([visible, torch.ones(len(starts), depth, dtype=torch.bool)], 1)[:, None, None]
            every = [
                torch.cat([t[0, :size].expand(len(starts), -1, -1, -1), torch.stack(o, 1)], 1)
                for t, o in zip((keys, values), own)
            ]
            guessed = head.finish(x, attend(q, *every, mask))[:, 0]
            drafts.append(head.vocabulary[(guessed @ head.lm_rows.T).argmax(-1)])
        later = starts[:, None] + 2 + torch.arange(k)[None]
        truth = ids[later.clamp(max=len(ids) - 1)]
        kept.append(((torch.stack(drafts, 1) == truth) & (later < len(ids))).int().cumprod(1).sum(1))
    return torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int)


@torch.inference_mode()
def sampled_kept(head: EagleHead, data, embed: torch.Tensor, lm_head: torch.Tensor, temperature: float) -> float:
    """The chance that a chain's first draft, sampled from the head at temperature, is kept by
    the exact rule (the sum over tokens of min(p, q), p the target's distribution at the same
    temperature), over every position of data."""
    kept, positions = 0.0, 0
    for ids, hidden in data:
        size = len(ids) - 1
        if size < 3:
            continue
        guessed = _first_guesses(head, ids, hidden, embed)[0]
        drafted = (guessed @ head.lm_rows.T / temperature).softmax(-1)
        target = (hidden[1:size] @ lm_head.T / temperature).softmax(-1)[:, head.vocabulary]
        kept += float(torch.minimum(drafted, target).sum())
        positions += size - 1
    return kept / max(1, positions)


def new_head(target_dir: str, lm_head: torch.Tensor, trained, size: int) -> EagleHead:
    """An untrained head drafting among the size commonest tokens of the trained answers."""
    counts = Counter(int(t) for ids, _ in trained for t in ids[1:])
    vocabulary = torch.tensor(sorted(token for token, _ in counts.most_common(size)))
    head = EagleHead(EagleConfig.for_target(target_dir, len(vocabulary)))
    head.vocabulary.copy_(vocabulary)
    head.lm_rows.copy_(lm_head[vocabulary].float())
    return head


def report_of(kept: torch.Tensor, recipe: EagleRecipe, trained, history: list[dict], sampled: dict) -> dict:
    at_least = [float((kept >= depth).float().mean()) if len(kept) else 0.0 for depth in range(1, recipe.k + 1)]
    return {
        "recipe": asdict(recipe),
        "answers_trained": len(trained),
        "tokens_trained": sum(len(ids) - 1 for ids, _ in trained),
        "steps": len(history),
        "final_top1_train": history[-1]["top1"] if history else None,
        "positions_replayed": len(kept),
        "kept_at_least": at_least,
        "tokens_per_round": {f"K={k}": 1 + sum(at_least[:k]) for k in range(1, recipe.k + 1)},
        "sampled_first_draft_kept": sampled,  # by temperature
    }


def run(recipe: EagleRecipe) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)
    target = resolve_model(recipe.target)
    out = Path(recipe.out)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    rows = [r for r in make_answers(model, tokenizer, recipe, out / "work" / "answers.jsonl") if len(r["answer"]) > 2]
    if not rows:
        raise SystemExit(f"specserve train-eagle: the target gave no answer of 3 tokens or more ({out / 'work'})")
    log.info("reading %d answers through the target", len(rows))
    data = features(model, rows)
    held = [row for i, row in enumerate(data) if i % HELD_OUT == 0]
    trained = [row for i, row in enumerate(data) if i % HELD_OUT != 0] or held
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    head = new_head(target, lm_head, trained, recipe.vocab)
    history = train(head, trained, embed, recipe)
    head.eval()
    sampled = {str(t): sampled_kept(head, held[: recipe.heldout], embed, lm_head, t) for t in REPORT_TEMPERATURES}
    kept = replay(head, held[: recipe.heldout], embed, recipe.k).float()
    report = report_of(kept, recipe, trained, history, sampled)
    save_head(head, out)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve train-eagle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="the target: a directory, or a named model")
    parser.add_argument(
        "--out", default=None, help="the head's directory (default: models/NAME/eagle for a named target)"
    )
    defaults = EagleRecipe("", "")
    for name in (
        "questions",
        "data_minutes",
        "max_new_tokens",
        "temperature",
        "batch",
        "train_minutes",
        "max_steps",
        "lr",
        "vocab",
        "k",
        "heldout",
        "seed",
    ):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument(
        "--text",
        choices=("chat", "code"),
        default="",
        help="what the target answers: chat questions, or code prompts from installed Python files "
        "(default: chat where the target's tokenizer has a chat template, else code)",
    )
    parser.add_argument("--no-unroll", dest="unroll", action="store_false", help="train the first chain step only")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("questions", "max_new_tokens", "batch", "vocab", "k", "heldout"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_steps < 0 or args.lr <= 0 or args.temperature < 0:
        parser.error("--max-steps must not be negative, --lr must be positive, --temperature not negative")
    if args.data_minutes <= 0 or args.train_minutes <= 0:
        parser.error("--data-minutes and --train-minutes must be positive")
    if args.out is None:
        if not is_named(args.target):
            raise SystemExit("specserve train-eagle: pass --out DIR (the default is for a named target only)")
        args.out = str(REPO_ROOT / "models" / args.target / "eagle")
    fields = {name: value for name, value in vars(args).items() if name in EagleRecipe.__dataclass_fields__}
    report = run(EagleRecipe(**fields))
    print("| K | tokens a round | rounds keeping at least K |\n|---|---|---|")
    for k, share in enumerate(report["kept_at_least"], start=1):
        print(f"| {k} | {report['tokens_per_round'][f'K={k}']:.2f} | {share:.3f} |")
    for temperature, kept in report["sampled_first_draft_kept"].items():
        print(f"sampled at T = {temperature}: a first draft is kept with probability {kept:.3f}")
    print(f"the head is in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
