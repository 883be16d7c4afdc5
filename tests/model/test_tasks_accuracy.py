"""acc and acc_norm of the multiple-choice evaluation (model/evaluation/tasks.accuracy) against
brute force: acc picks the candidate with the highest summed log-probability of its
completion's tokens, acc_norm the highest sum divided by the completion's length in characters
(lm-eval-harness's acc_norm). On fresh random log-probabilities and candidates, on a hand-made
example where the two pick different answers, and on a tiny model's scores of real text."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.evaluation.tasks import Example, accuracy, candidates, model_outputs
from teragram.model.gpt import GPT, GPTConfig

from tests.conftest import real_texts


def _brute(examples: list[Example], logprobs: list[list[float]], mask=None) -> dict:
    """acc and acc_norm one candidate at a time, in plain Python: logprobs[i] are candidate i's
    per-token log-probabilities, candidates in example order."""
    hits, hits_norm, i = [], [], 0
    for ex in examples:
        best = best_norm = None
        for j, comp in enumerate(ex.completions):
            total = math.fsum(logprobs[i])
            if best is None or total > best[0]:  # the first of equal scores, as argmax
                best = (total, j)
            chars = len(comp[1:] if comp.startswith(" ") else comp)  # the choice, without the joining space
            if best_norm is None or total / chars > best_norm[0]:
                best_norm = (total / chars, j)
            i += 1
        hits.append(best[1] == ex.label)
        hits_norm.append(best_norm[1] == ex.label)
    keep = [True] * len(examples) if mask is None else list(mask)
    n = sum(keep)
    return {
        "n": n,
        "acc": sum(h for h, k in zip(hits, keep, strict=True) if k) / n,
        "acc_norm": sum(h for h, k in zip(hits_norm, keep, strict=True) if k) / n,
    }


def _random_case(rng, n_examples: int):
    examples, logprobs = [], []
    for _ in range(n_examples):
        k = int(rng.integers(2, 6))
        comps = tuple(" " + "".join(rng.choice(list("abcdefgh "), int(rng.integers(1, 40)))) for _ in range(k))
        examples.append(Example(("ctx",) * k, comps, int(rng.integers(k))))
        # token counts independent of the character lengths, as a tokenizer makes them
        logprobs += [(-rng.exponential(1.5, int(rng.integers(1, 12)))).tolist() for _ in range(k)]
    return examples, logprobs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accuracy_against_brute_force_on_random_scores(seed):
    rng = np.random.default_rng(seed)
    examples, logprobs = _random_case(rng, 300)
    nll = [-np.array(lp) for lp in logprobs]
    got = accuracy(examples, nll)
    want = _brute(examples, logprobs)
    assert got["n"] == want["n"] and got["acc"] == pytest.approx(want["acc"]) and got["acc_norm"] == pytest.approx(want["acc_norm"])
    assert got["acc"] != got["acc_norm"]  # the normalization changed some answers
    mask = rng.random(len(examples)) < 0.4
    got, want = accuracy(examples, nll, mask), _brute(examples, logprobs, mask)
    assert got["n"] == want["n"] == mask.sum() and got["acc"] == pytest.approx(want["acc"])
    assert got["acc_norm"] == pytest.approx(want["acc_norm"])


def test_acc_and_acc_norm_pick_different_answers():
    """A short completion with the higher total, a long one with the higher total per character:
    acc takes the short one, acc_norm the long one (lengths count characters, not tokens)."""
    short, long = " yes", " it depends on the weather"  # 4 and 26 characters
    nll = [np.array([0.5] * 4), np.array([2.5] * 2)]  # totals -2.0 and -5.0; per character -0.5 and -0.19
    on_long = Example(("Q",) * 2, (short, long), 1)
    on_short = Example(("Q",) * 2, (short, long), 0)
    assert accuracy([on_long], nll) == {"n": 1, "acc": 0.0, "acc_norm": 1.0}
    assert accuracy([on_short], nll) == {"n": 1, "acc": 1.0, "acc_norm": 0.0}
    # per token (-0.5 against -2.5) the short one would win: the length is in characters
    r = accuracy([on_long, on_short, on_long], nll * 3, np.array([True, True, False]))
    assert r == {"n": 2, "acc": 0.5, "acc_norm": 0.5}


def test_acc_norm_divides_by_the_choice_without_its_leading_space():
    """lm-eval-harness (ConfigurableTask.process_results): completion_len = len(choice), the
    request's continuation being ' ' + choice. Totals -1.0 over ' ab' and -1.9 over ' abcd':
    per character of the choice -0.5 and -0.475 (the second wins), per character with the
    space -0.333 and -0.38 (the first wins)."""
    ex = Example(("Q",) * 2, (" ab", " abcd"), 1)
    assert accuracy([ex], [np.array([1.0]), np.array([1.9])])["acc_norm"] == 1.0


def test_accuracy_of_a_tiny_model_on_real_text(real_index):
    """Real contexts from data/default with their true continuation and three from other
    documents; each candidate's log-probabilities by one forward pass over EOS + its tokens
    (the completion's tokens: those past the context's), then the brute-force metric."""
    idx = Index(real_index)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=idx.vocab_size, block_size=64, use_index=False)).eval()
    texts = [t for _, t in real_texts(12, 4000)]
    rng = np.random.default_rng(5)
    examples = []
    for i, t in enumerate(texts):
        cut = t.index(" ", 120)
        others = [texts[(i + d) % len(texts)] for d in (3, 5, 7)]
        comps = [t[cut : cut + int(rng.integers(10, 120))]] + [o[cut : cut + int(rng.integers(10, 120))] for o in others]
        label = int(rng.integers(4))
        comps.insert(label, comps.pop(0))
        examples.append(Example((t[:cut],) * 4, tuple(comps), label))
    docs = candidates(examples, idx.tokenize)
    outs = model_outputs(model, docs, idx.eos_id, batch=7)
    logprobs = []
    for d, n_ctx in docs:
        seq = np.concatenate([[idx.eos_id], d])[-65:]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0].double(), -1).numpy()
        rows = np.arange(len(seq) - 1)[-(len(d) - n_ctx) :]
        logprobs.append(lp[rows, seq[1:][rows]].tolist())
    got = accuracy(examples, [o["nll"] for o in outs])
    want = _brute(examples, logprobs)
    assert got["n"] == want["n"] == len(examples)
    assert got["acc"] == pytest.approx(want["acc"]) and got["acc_norm"] == pytest.approx(want["acc_norm"])
