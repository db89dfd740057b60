"""A bare training loop for issue 17's open question: when does the tiny model learn to copy a planted value?

Outside the recipe on purpose: one synthetic kv document per row (padded, no packing, no document masking),
transformers' own loss, AdamW at a constant learning rate, the recipe's tiny model (recipe=tiny_retrieval's
model config) and a given tokenizer. Every `--probe-every` steps it prints the teacher-forced accuracy of the
answer's tokens on 60 held-out documents (chance is about 0.1 for a digit). Bisect from here towards the
recipe (packing, masking, mixture, schedule) once a setting here shows the phase change.

    python -m benchmarks.retrieval_bare_loop --tokenizer DIR [--steps 1800] [--rows 16] [--words 15 60]
"""
from __future__ import annotations

import argparse
import time

import torch


def answer_accuracy(model, tok, words: tuple[int, int], n: int = 60) -> float:
    """Teacher-forced accuracy of the answer tokens of n held-out kv documents (seed 99)."""
    from longstride.data.synthetic import document

    model.eval()
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
    model.train()
    return hits / total


def batch(tok, pad: int, start: int, rows: int, words: tuple[int, int]):
    from longstride.data.synthetic import document

    docs = [tok(document(1, start + j, *words, {"kv": 1.0}, 0.0), add_special_tokens=False)["input_ids"]
            for j in range(rows)]
    width = max(map(len, docs))
    ids = torch.full((rows, width), pad)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for j, d in enumerate(docs):
        ids[j, :len(d)] = torch.tensor(d)
        mask[j, :len(d)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def main(argv=None) -> None:
    from hydra import compose, initialize_config_module
    from transformers import AutoTokenizer

    from longstride.model.build import build_model
    from longstride.recipes.schema import to_schema

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a local HF tokenizer dir (e.g. a recipe checkpoint's)")
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--rows", type=int, default=16, help="documents per step")
    p.add_argument("--words", type=int, nargs=2, default=(15, 60), help="filler words per document (min max)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--probe-every", type=int, default=200)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with initialize_config_module("longstride.configs", version_base="1.3"):
        cfg = to_schema(compose("config", overrides=["recipe=tiny_retrieval"]))
    model = build_model(cfg.model, rope_theta=1e4, seq_len=512, vocab_size=len(tok), eos_id=tok.eos_token_id,
                        pad_id=pad, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, mask, labels = batch(tok, pad, step * args.rows, args.rows, tuple(args.words))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.probe_every == 0:
            acc = answer_accuracy(model, tok, tuple(args.words))
            print(f"step {step}  loss {loss.item():.3f}  answer-token accuracy {acc:.3f}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
