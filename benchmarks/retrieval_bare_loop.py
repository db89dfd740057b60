"""A bare training loop for issue 17's open question: when does the tiny model learn to copy from its context?

Outside the recipe on purpose: transformers' own loss, AdamW at a constant learning rate, the recipe's tiny
model (recipe=tiny_retrieval's model config). Two tasks:

  copy  rows of 80 tokens: p random tokens, a 24-token span, q random tokens, the span again (p, q drawn in
        0..16, so the distance varies and only content-based copying, an induction head, solves it). Tokens are
        uniform over 4,096 ids, or (--words) one-token identifiers of the standard library in a given tokenizer.
        Accuracy: the repeat's tokens predicted from the previous one (chance about 0).
  kv    one synthetic kv document per row (padded, no packing); accuracy of the answer's tokens on 60 held-out
        documents (chance about 0.1 for a digit).

--loss targets trains only on the tokens the task can predict (the repeat; the question and answer);
--loss all on every token, as plain language modelling does.

    python -m benchmarks.retrieval_bare_loop --task copy --loss targets [--steps 800]
    python -m benchmarks.retrieval_bare_loop --task kv --tokenizer DIR [--steps 1800] [--rows 16] [--words 15 60]
"""
from __future__ import annotations

import argparse
import time

import torch

SPAN, GAP, ROW = 24, 16, 80


def copy_rows(g: torch.Generator, pool: torch.Tensor, rows: int,
              targets_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, loss mask): each row has a span and, after a random gap, the span again; the mask is the repeat
    after its first token, or (targets_only False) every token."""
    draw = lambda k: pool[torch.randint(0, len(pool), (k,), generator=g)]  # noqa: E731
    ids, mask = torch.empty(rows, ROW, dtype=torch.long), torch.full((rows, ROW), not targets_only)
    for r in range(rows):
        p, q = (int(torch.randint(0, GAP + 1, (1,), generator=g)) for _ in range(2))
        span = draw(SPAN)
        row = torch.cat([draw(p), span, draw(q), span])
        ids[r] = torch.cat([row, draw(ROW - len(row))])
        mask[r, p + SPAN + q + 1:p + 2 * SPAN + q] = True
    return ids, mask


def copy_accuracy(model, g: torch.Generator, pool: torch.Tensor) -> float:
    ids, mask = copy_rows(g, pool, 32)
    with torch.no_grad():
        pred = model(ids).logits.argmax(-1)
    return (pred[:, :-1] == ids[:, 1:])[mask[:, 1:]].float().mean().item()


def kv_accuracy(model, tok, words: tuple[int, int], n: int = 60) -> float:
    """Teacher-forced accuracy of the answer tokens of n held-out kv documents (seed 99)."""
    from longstride.data.synthetic import document

    hits = total = 0
    with torch.no_grad():
        for i in range(n):
            doc = document(99, i, *words, {"kv": 1.0}, 0.0).rstrip()
            answer = doc.split()[-1]
            prefix = tok(doc[:-len(answer)], add_special_tokens=False)["input_ids"]
            target = tok(doc, add_special_tokens=False)["input_ids"][len(prefix):]
            logits = model(torch.tensor([prefix + target])).logits[0]
            pred = logits[len(prefix) - 1:len(prefix) + len(target) - 1].argmax(-1).tolist()
            hits += sum(p == t for p, t in zip(pred, target))
            total += len(target)
    return hits / total


def kv_rows(tok, pad: int, start: int, rows: int, words: tuple[int, int], targets_only: bool):
    """(ids, loss mask) of one padded kv document per row; the mask is the question and answer (the recipe's
    synthetic.loss_on=qa, through its own tokenize function), or (targets_only False) every token."""
    from longstride.data.batch import context_only
    from longstride.data.synthetic import document_parts
    from longstride.data.tokenizer import tokenize_fn

    parts = [document_parts(1, start + j, *words, {"kv": 1.0}, 0.0) for j in range(rows)]
    batch = {"text": [b + q for b, q in parts], "loss_from": [len(b) if targets_only else 0 for b, _ in parts]}
    docs = [torch.tensor(d[:-1]) for d in tokenize_fn(tok)(batch)["input_ids"]]  # without the EOS
    width = max(map(len, docs))
    ids = torch.full((rows, width), pad)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for j, d in enumerate(docs):
        ids[j, :len(d)] = torch.where(d < 0, context_only(d), d)
        mask[j, :len(d)] = d >= 0
    return ids, mask


def main(argv=None) -> None:
    from hydra import compose, initialize_config_module
    from transformers import AutoTokenizer

    from longstride.model.build import build_model
    from longstride.recipes.config.schema import to_schema

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("copy", "kv"), default="copy")
    p.add_argument("--loss", choices=("targets", "all"), default="targets")
    p.add_argument("--tokenizer", help="a local HF tokenizer dir (kv; copy with --words)")
    p.add_argument("--words", action="store_true", help="copy: spans of one-token identifiers, not random ids")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--filler", type=int, nargs=2, default=(15, 60), help="kv: filler words (min max)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--probe-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.task == "kv" or args.words) and not args.tokenizer:
        p.error("--tokenizer is needed for --task kv and for --words")
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    vocab = len(tok) if tok else 4096
    pad = (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id) if tok else 0
    with initialize_config_module("longstride.configs", version_base="1.3"):
        cfg = to_schema(compose("config", overrides=["recipe=tiny_retrieval"]))
    model = build_model(cfg.model, rope_theta=1e4, seq_len=512, vocab_size=vocab, eos_id=pad, pad_id=pad, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    pool = torch.arange(vocab)
    if args.words:
        from longstride.data.synthetic import identifiers

        one = [tok(" " + w, add_special_tokens=False)["input_ids"] for w in identifiers()]
        pool = torch.tensor(sorted({ids[0] for ids in one if len(ids) == 1}))
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        targets_only = args.loss == "targets"
        if args.task == "copy":
            ids, mask = copy_rows(g, pool, args.rows, targets_only)
        else:
            ids, mask = kv_rows(tok, pad, step * args.rows, args.rows, tuple(args.filler), targets_only)
        labels = ids.masked_fill(~mask, -100)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.probe_every == 0:
            model.eval()
            acc = copy_accuracy(model, g, pool) if args.task == "copy" else kv_accuracy(model, tok, tuple(args.filler))
            model.train()
            print(f"step {step}  copy/answer-token accuracy {acc:.3f}  {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
