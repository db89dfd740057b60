"""eval.ruler's samples: task contents against RULER's, exact length targeting, reproducibility, the haystack
search, RULER's metrics and summaries (tokenized by the micro checkpoint's tokenizer; no model runs)."""
from __future__ import annotations

import collections
import json
import re

import pytest

from longstride.eval.ruler.fit import DoesNotFit, make_sample, prompt_ids
from longstride.eval.ruler.score import postprocess, sample_score, string_match_all, string_match_part, summarize
from longstride.eval.ruler.tasks import NEEDLE, SYNTHETIC, TASKS, Sampler, load_qa
from longstride.eval.ruler.words import common_words

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tok(ruler_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ruler_checkpoint)


def _check_contents(name, sampler, text, answers):
    p = TASKS[name].params
    if TASKS[name].kind == "niah":
        type_v = p["value"]
        for key, values in zip(sampler.keys, sampler.values):  # every needle is in the haystack once
            for v in values:
                assert text.count(NEEDLE.format(type_v=type_v, key=key, value=v)) == 1
        assert all(q in text.rsplit("\n", 1)[-1] for q in sampler.queries), "the question names the queried keys"
        assert len(answers) == p["q"] * p["v"]
        for a in answers:
            assert re.search(rf"for ({'|'.join(map(re.escape, sampler.queries))}) is: {re.escape(a)}\.", text)
    elif name == "vt":
        body = text.split("\n\n", 1)[1]  # after the one-shot example
        value = sampler.chains[0][1][0].split("=")[-1].strip()
        chain = [f"VAR {answers[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(answers, answers[1:])]
        positions = [body.index(s) for s in chain]
        assert positions == sorted(positions), "the chain is laid out in order"
        assert body.rstrip().endswith(f"assigned the value {value} in the text above.")
    elif name == "cwe":
        listed = re.findall(r"\d+\. ([^\s]+)", text.rsplit("Question:", 2)[1])
        counts = collections.Counter(listed)
        top = [w for w, _ in counts.most_common(10)]
        assert sorted(top) == sorted(answers) and min(counts[a] for a in answers) > max(
            [c for w, c in counts.items() if w not in answers] or [0])
    elif name == "fwe":
        counts = collections.Counter(text.split("coded words. ", 1)[1].split("\nQuestion")[0].split())
        ranked = [w for w, _ in counts.most_common() if w != "..."]
        assert ranked[:3] == answers and counts[answers[2]] > counts[ranked[3]]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_samples_hold_their_answers_fit_exactly_and_repeat(tok, name):
    tok.chat_template = CHAT
    for length in (1536, 2048):
        sample = make_sample(TASKS[name], length, 1, tok, seed=7)
        assert len(sample.prompt_ids) + sample.max_new_tokens <= length
        sampler = Sampler(TASKS[name], length, 7, 1)
        bigger = sampler.render(sample.units + 1)
        if sampler.cap is None or sample.units < sampler.cap:  # one more haystack unit no longer fits
            assert len(prompt_ids(tok, bigger.content, bigger.answer_prefix, True)) + sample.max_new_tokens > length
        r = sampler.render(sample.units)
        assert prompt_ids(tok, r.content, r.answer_prefix, True) == sample.prompt_ids
        text = tok.decode(sample.prompt_ids)
        assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n" + r.answer_prefix)
        _check_contents(name, sampler, r.content, sample.answers)
        # identical across runs and independent of the order samples are made in
        again = [make_sample(TASKS[name], length, i, tok, seed=7) for i in (2, 1)][1]
        assert again.prompt_ids == sample.prompt_ids and again.answers == sample.answers
        assert make_sample(TASKS[name], length, 2, tok, seed=7).prompt_ids != sample.prompt_ids
    tok.chat_template = None


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_1", "niah_multivalue", "vt"])
def test_haystack_search_finds_the_largest_fitting_size_in_few_tokenizations(tok, name, monkeypatch):
    """The size make_sample finds for a task whose tokens grow with its size is the largest that fits (checked
    by tokenizing every size around it), first sample without a guess, the next ones from the previous size;
    a guessed sample costs at most 4.5 full tokenizations on average (with the GPU recipe's tokenizer at 3K and 64K
    tokens: 2.0-4.1 by task, where the galloping search before it took 2.0-6.0), the first one at most 12 (was 30+)."""
    sizes = []
    render = Sampler.render
    monkeypatch.setattr(Sampler, "render", lambda self, units: sizes.append(units) or render(self, units))
    length, guess, counts = 3000, None, []
    for i in range(6):
        sizes.clear()
        s = make_sample(TASKS[name], length, i, tok, guess=guess)
        counts.append(len([u for u in sizes if u > 1]))
        guess = s.units
        sampler = Sampler(TASKS[name], length, 42, i)
        fit = [len(prompt_ids(tok, r.content, r.answer_prefix, True)) + s.max_new_tokens <= length
               for r in (sampler.render(u) for u in range(s.units - 3, s.units + 4))]
        assert fit == [True] * 4 + [False] * 3, (name, i, s.units, fit)
    assert counts[0] <= 12 and sum(counts[1:]) / len(counts[1:]) <= 4.5, counts


def test_haystack_search_edge_cases_against_a_scan():
    """_largest_fitting against a scan over every size, on made-up token counts that never fall (steady, with
    plateaus, with jumps, flat): every guess (none, out of range, at either end, near and far), caps next to the
    smallest size; the largest fitting size every time, and within the rounds it allows."""
    import random

    from longstride.eval.ruler.fit import _largest_fitting

    rng = random.Random(0)
    for case in range(3000):
        lo = rng.choice([1, 2, 5])
        cap = lo + rng.choice([0, 1, 2, 3, 50, 700])
        steps = [rng.choice([0, 0, 1, 2, 3, 20]) if case % 3 else rng.choice([3, 4]) for _ in range(cap + 2)]
        counts = [10 + sum(steps[:u]) for u in range(cap + 2)]
        budget = rng.randint(counts[lo], counts[-1] + 5)
        truth = max(u for u in range(lo, cap + 1) if counts[u] <= budget)
        guess = rng.choice([None, lo - 1, lo, cap, cap + 1, truth, truth + 1, truth - 3, rng.randint(lo, cap + 1)])
        tokens = {}

        def fits(u):
            assert lo <= u <= cap, (u, lo, cap)
            tokens[u] = counts[u]
            return counts[u] <= budget

        fits(lo)
        assert _largest_fitting(fits, tokens, lo, cap, budget, guess) == truth, (case, lo, cap, budget, guess)


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_ids_are_the_tokenizers_own_ids(tok, chat, monkeypatch):
    """The search's fast tokenization gives exactly the ids of the tokenizer's own call, for every task's prompt
    with and without a chat template, on a tokenizer with a BOS post-processor, a normalizer and its chat tags as
    special tokens; a tokenizer whose call would change its Rust tokenizer (truncation set in tokenizer.json,
    special tokens split) or a subclass that encodes its own way takes the call itself."""
    import copy

    from tokenizers import normalizers, processors

    from longstride.eval.hf_adapter import encode

    rich = copy.deepcopy(tok)
    rich.add_special_tokens({"bos_token": "<s>", "additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    rich.backend_tokenizer.normalizer = normalizers.NFKC()
    bos = rich.bos_token_id
    rich.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    monkeypatch.setattr(rich, "chat_template", CHAT if chat else None)
    for name in SYNTHETIC:
        r = Sampler(TASKS[name], 1024, 42, 0).render(8)
        text = (rich.apply_chat_template([{"role": "user", "content": r.content}], tokenize=False,
                                         add_generation_prompt=True) if chat else r.content) + r.answer_prefix
        want = rich(text, add_special_tokens=not chat)["input_ids"]
        assert prompt_ids(rich, r.content, r.answer_prefix, chat) == want, name
        assert (want[0] == bos) != chat and (rich.convert_tokens_to_ids("<|user|>") in want) == chat
    text = r.content + tok.eos_token
    truncating = copy.deepcopy(tok)
    truncating.backend_tokenizer.enable_truncation(32)
    got = encode(truncating, text, True)
    assert len(got) > 32 and got == tok(text)["input_ids"]
    splitting = copy.deepcopy(tok)
    splitting.split_special_tokens = True
    got = encode(splitting, text, True)
    assert got == splitting(text)["input_ids"] != tok(text)["input_ids"]

    class Marked(type(tok)):  # a subclass with its own encoding (as CodeLlama's splits at <FILL_ME>)
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.replace("e", "E"), *args, **kwargs)

    marked = copy.deepcopy(tok)
    marked.__class__ = Marked
    assert encode(marked, text, True) == marked(text)["input_ids"] != tok(text)["input_ids"]


def test_a_prompt_never_ends_in_the_eos_a_tokenizer_appends(tok):
    """A tokenizer whose post-processor appends EOS to text (add_eos_token-style) would end a prompt without chat
    template in EOS after the answer prefix; prompts open as training's documents do (bos_prefix) instead."""
    import copy

    from tokenizers import processors

    appending = copy.deepcopy(tok)
    eos = appending.eos_token_id
    appending.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {appending.eos_token}", special_tokens=[(appending.eos_token, eos)])
    assert appending("a")["input_ids"][-1] == eos
    r = Sampler(TASKS["niah_single_1"], 1024, 42, 0).render(8)
    got = prompt_ids(appending, r.content, r.answer_prefix, chat=False)
    assert got == appending(r.content + r.answer_prefix, add_special_tokens=False)["input_ids"] and got[-1] != eos
    assert make_sample(TASKS["niah_single_1"], 1024, 0, appending, chat=False).prompt_ids[-1] != eos


def test_without_chat_template_and_qa_sample(tok, squad):
    qa = load_qa("squad", squad)
    assert len(qa.questions) == 60 and len(qa.docs) == 60, "unanswerable questions are dropped"
    s = make_sample(TASKS["qa_1"], 1024, 0, tok, qa=qa)
    text = tok.decode(s.prompt_ids)
    assert text.endswith("Answer:") and not text.startswith("<|user|>")
    assert s.answers[0] in text and text.count("Document ") == s.units


def test_too_short_length_names_the_minimum(tok):
    with pytest.raises(DoesNotFit, match=r"vt does not fit in 256 tokens: .* use lengths >= \d+"):
        make_sample(TASKS["vt"], 256, 0, tok)


def test_metrics_follow_ruler_definitions():
    refs = [["7248817", "Port Alpha"], ["abc"]]
    preds = [" 7248817 and port alpha.", "nothing"]
    assert string_match_all(preds, refs) == pytest.approx(50.0)  # (2/2 + 0/1) / 2
    assert string_match_part(preds, refs) == pytest.approx(50.0)
    assert string_match_all(["7248817 only"], [["7248817", "1111111"]]) == pytest.approx(50.0)
    assert string_match_part(["7248817 only"], [["7248817", "1111111"]]) == pytest.approx(100.0)
    assert sample_score("ABC", ["abc"], "all") == 1.0, "case-insensitive"
    assert postprocess("  a\x00b\tc \n") == "a\nb\nc"
    with pytest.raises(ValueError, match="unknown metric"):
        sample_score("a", ["a"], "exact")


def test_the_depth_heatmap_holds_the_single_needle_tasks_only():
    from longstride.eval.ruler.report import depth_grid

    recs = [{"task": "niah_single_2", "length": 1024, "depth": 5.0, "score": 1.0},
            {"task": "niah_multikey_2", "length": 1024, "depth": 5.0, "score": 0.0},  # its first needle's depth
            {"task": "synth_kv", "length": 1024, "depth": 5.0, "score": 0.0},
            {"task": "vt", "length": 1024, "depth": None, "score": 0.0}]
    grid = depth_grid(recs, [1024])
    assert grid[0] == [100.0] and all(row == [None] for row in grid[1:])


def test_summary_weighted_averages_and_effective_length():
    records = [{"task": t, "length": L, "score": s} for t, L, s in [
        ("a", 1024, 1.0), ("a", 2048, 1.0), ("a", 4096, 0.5), ("b", 1024, 1.0), ("b", 2048, 0.8),
        ("b", 4096, 0.0), ("c", 1024, 1.0)]]
    out = summarize(records, threshold=85.6)
    assert out["table"]["a"] == {1024: 100.0, 2048: 100.0, 4096: 50.0}
    assert out["tasks_in_mean"] == ["a", "b"], "a task missing at some length stays out of the mean"
    assert out["mean"] == {1024: 100.0, 2048: 90.0, 4096: 25.0}
    assert out["wavg_inc"] == pytest.approx((1 * 100 + 2 * 90 + 3 * 25) / 6)
    assert out["wavg_dec"] == pytest.approx((3 * 100 + 2 * 90 + 1 * 25) / 6)
    assert out["effective_length"] == 2048
    assert summarize(records, threshold=95)["effective_length"] == 1024
    assert summarize(records, threshold=101)["effective_length"] is None


def test_qa_distractors_come_from_the_gold_article_first_and_questions_hold_across_lengths(tok, tmp_path):
    """RULER's qa_1: distractor paragraphs are drawn from the gold paragraph's own SQuAD article first (harder than
    random ones), then from other articles once the article is used up; question `index` is the same at every
    length, so a score against length holds the questions fixed."""
    articles = [{"title": f"a{a}", "paragraphs": [
        {"context": f"Article {a} paragraph {p}: the {w} stands in the square of town {a}.",
         "qas": [{"question": f"What stands in the square of town {a}, paragraph {p}?",
                  "answers": [{"text": f"the {w}"}]}]}
        for p, w in enumerate(common_words()[a * 5:a * 5 + 5])]} for a in range(12)]
    path = tmp_path / "squad.json"
    path.write_text(json.dumps({"data": articles}))
    qa = load_qa("squad", str(path))
    article_of = {d: int(text.split()[1]) for d, text in enumerate(qa.docs)}
    asked = set()
    for length in (256, 512, 1024):
        for index in range(3):
            s = make_sample(TASKS["qa_1"], length, index, tok, qa=qa)
            sampler = Sampler(TASKS["qa_1"], length, 42, index, qa=qa)  # make_sample's default seed
            gold = article_of[sampler.question["docs"][0]]
            chosen = [article_of[d] for d in sampler.question["docs"] + sampler.distractors[:s.units - 1]]
            same = sum(a == gold for a in chosen)
            assert same == min(s.units, 5), (length, index, chosen)  # the article first, all of it when needed
            asked.add((index, sampler.question["query"]))
            assert sampler.question["query"] in tok.decode(s.prompt_ids)
    assert len(asked) == 3, "each index asks one question at every length"


def test_cwe_fills_lengths_past_its_word_list():
    """cwe at a length that needs more distinct words than the 8,166-word list (about 120K tokens with a 50K-150K
    vocabulary): the list goes on with compound words in a fixed order, as RULER switches to a larger list, so the
    haystack has the size asked for instead of stopping at the list's end; the ten common words are still the
    answer."""
    from longstride.eval.ruler.words import cwe_words

    n = len(common_words()) + 1000
    words = cwe_words(n)
    assert len(words) >= n and len(set(words)) == len(words) and words[:len(common_words())] == common_words()
    assert cwe_words(n) is words and cwe_words(100) == common_words()
    sampler = Sampler(TASKS["cwe"], 200_000, 0, 0)
    r = sampler.render(n)
    body = r.content.rsplit("Below is a numbered list", 1)[1].split("\n")[1]  # the list asked about, not the shot's
    listed = collections.Counter(w for w in re.split(r"(?:^| )\d+\. ", body) if w)
    assert len(listed) == n and set(r.answers) == {w for w, _ in listed.most_common(10)}


class _WordTok:
    """One token per whitespace-separated word: a tokenizer under which cwe's 8,166-word list fits in ~25K tokens."""

    chat_template = bos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * len(text.split())}


def test_cwe_searches_within_its_word_list_first_and_past_it_only_when_the_list_fits():
    """Below the list's size the search is the one it always was (capped at the list), so those samples do not
    change; a length where the whole list fits goes on past it with compound words and fills its budget."""
    from longstride.eval.ruler.fit import _doubled

    tok, n = _WordTok(), len(common_words())
    short = make_sample(TASKS["cwe"], 12_000, 0, tok)
    sampler = Sampler(TASKS["cwe"], 12_000, 42, 0)

    def fits(units):
        r = sampler.render(units)
        return len(prompt_ids(tok, r.content, r.answer_prefix, False)) <= 12_000 - TASKS["cwe"].max_new_tokens

    assert short.units < n and short.units == _doubled(fits, TASKS["cwe"].params["num_cw"], n)
    long = make_sample(TASKS["cwe"], 80_000, 0, tok)  # about 6 words a unit: the list fills about 49K
    assert long.units > n and len(long.prompt_ids) + long.max_new_tokens <= 80_000
    bigger = Sampler(TASKS["cwe"], 80_000, 42, 0).render(long.units + 1)
    assert len(prompt_ids(tok, bigger.content, bigger.answer_prefix, False)) + long.max_new_tokens > 80_000


def test_a_chat_template_that_prints_the_date_gets_a_fixed_one(tok):
    """A Llama 3.x template prints today's date where no `date_string` is given, so prompts (and the haystack that
    fits) changed with the day: the prompt is made with a fixed one; a template that calls strftime_now without
    reading date_string is named in the note, as is the chat template itself (RULER scores base models without)."""
    import copy

    from longstride.eval.ruler.fit import CHAT_DATE, chat_template_note

    llama = copy.deepcopy(tok)
    llama.chat_template = ("{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
                           "{%- endif %}Today Date: {{ date_string }}\n{% for m in messages %}{{ m['content'] }}"
                           "{% endfor %}")
    assert llama.decode(prompt_ids(llama, "hi", "A:", True)).startswith(f"Today Date: {CHAT_DATE}\nhi")
    assert chat_template_note(llama, True).startswith("chat=true: prompts go through the tokenizer's chat template")
    assert "today's date" not in chat_template_note(llama, True) and chat_template_note(llama, False) == ""
    undated = copy.deepcopy(tok)
    undated.chat_template = "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert "it prints today's date, which no setting pins" in chat_template_note(undated, True)
