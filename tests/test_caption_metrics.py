"""BLEU-1..4 and CIDEr-D torchmetrics: known answers, corpus level, merging and DDP-style sync."""

from __future__ import annotations

import math

import pytest
import torch
from torchmetrics.utilities.data import dim_zero_cat

from vitpipe.metrics import CaptionScores, CocoBLEU, CocoCIDErD, normalize

REFS = [["a red circle left of a blue square", "a blue square right of a red circle"],
        ["a small green triangle", "there is a small green triangle"],
        ["a large yellow square above a purple circle"],
        ["two dogs play in the park", "dogs playing on grass"]]
PREDS = ["a red circle left of a blue square", "a green triangle", "a yellow square above a circle", "a dog"]


def scores(preds, refs, metric_cls=CaptionScores, **kw):
    m = metric_cls(**kw)
    m.update(preds, refs)
    return m.compute()


def test_identical_captions_score_one():
    refs = [[r] for r in ("the cat sat on the mat", "a red circle left of a blue square", "two dogs in a park")]
    bleu = scores([r[0] for r in refs], refs, CocoBLEU)
    torch.testing.assert_close(bleu, torch.ones(4, dtype=torch.float64))


def test_bleu_known_answer():
    # 1-grams: 5/6 match, 2-grams 3/5, 3-grams 1/4, 4-grams 0/3; equal lengths, so no brevity penalty
    bleu = scores(["the cat sat on the mat"], [["the cat is on the mat"]], CocoBLEU)
    assert bleu[0].item() == pytest.approx(5 / 6, abs=1e-6)
    assert bleu[1].item() == pytest.approx(math.sqrt(5 / 6 * 3 / 5), abs=1e-6)
    assert bleu[2].item() == pytest.approx((5 / 6 * 3 / 5 * 1 / 4) ** (1 / 3), abs=1e-6)
    assert bleu[3].item() < 1e-3
    # brevity penalty exp(1 - r/c): a 2-word hypothesis against a 6-word reference
    short = scores(["the cat"], [["the cat sat on the mat"]], CocoBLEU)
    assert short[0].item() == pytest.approx(math.exp(1 - 6 / 2), abs=1e-6)


def test_bleu_is_corpus_level_not_a_mean_of_sentences():
    # pooled 1-gram matches (4 + 1) / (4 + 2), where the mean of sentence BLEU-1 would be (1 + 0.5) / 2
    bleu = scores(["a b c d", "x y"], [["a b c d"], ["x z"]], CocoBLEU, n=1)
    assert bleu.item() == pytest.approx(5 / 6, abs=1e-6)


def test_cider_d_known_answer_and_ordering():
    # disjoint vocabularies: every n-gram has idf log(3) > 0, so a hypothesis equal to its only
    # reference has cosine 1 at every n and no length penalty: 10 x mean over n of 1
    refs = [["alpha beta gamma delta"], ["red green blue yellow"], ["one two three four"]]
    cider = scores([r[0] for r in refs], refs, CocoCIDErD)
    assert cider.item() == pytest.approx(10.0, abs=1e-6)
    # a better caption scores higher; a longer one pays the Gaussian length penalty
    worse = scores(["alpha beta", "red green blue yellow", "one two three four"], refs, CocoCIDErD)
    padded = scores(["alpha beta gamma delta delta delta", "red green blue yellow", "one two three four"], refs,
                    CocoCIDErD)
    assert worse.item() < cider.item() and padded.item() < cider.item()
    out = scores(PREDS, REFS)
    better = scores(["a red circle left of a blue square", "a small green triangle",
                     "a large yellow square above a purple circle", "dogs play in the park"], REFS)
    assert better["cider"] > out["cider"] and better["bleu4"] > out["bleu4"]


def test_normalisation_matches_coco_practice():
    assert normalize("A Red, circle.") == "a red circle"
    assert normalize("it's a dog's life!") == "it's a dog's life"
    bleu = scores(["A red circle, left of a blue square."], [["a red circle left of a blue square"]], CocoBLEU)
    assert bleu[3].item() == pytest.approx(1.0)


def test_merge_state_equals_one_pass_over_everything():
    whole = scores(PREDS, REFS)
    a, b = CaptionScores(), CaptionScores()
    a.update(PREDS[:2], REFS[:2])
    b.update(PREDS[2:3], REFS[2:3])
    b.update(PREDS[3:], REFS[3:])
    halves = [scores(PREDS[:2], REFS[:2])["cider"], scores(PREDS[2:], REFS[2:])["cider"]]
    a.merge_state(b)
    merged = a.compute()
    for k in whole:
        torch.testing.assert_close(merged[k], whole[k])
    # CIDEr-D's idf comes from the whole corpus: the mean of the halves' scores is not the answer
    assert abs(sum(halves) / 2 - whole["cider"]) > 1e-3


def fake_world(shards):
    """One CaptionScores per simulated rank, whose sync gathers every rank's states the way
    torchmetrics' all_gather would (each state pre-concatenated; an empty rank sends a float tensor([]))."""
    metrics = []
    gathered = {}

    def sync_fn(attr_order):
        order = iter(attr_order)
        return lambda tensor, group=None: gathered[next(order)]

    for preds, refs in shards:
        m = CaptionScores(distributed_available_fn=lambda: True)
        if preds:
            m.update(preds, refs)
        metrics.append(m)
    attrs = list(metrics[0]._reductions)
    for a in attrs:
        gathered[a] = [dim_zero_cat(getattr(m, a)) if getattr(m, a) else torch.tensor([]) for m in metrics]
    for m in metrics:
        m.dist_sync_fn = sync_fn(attrs)
    return metrics


@pytest.mark.filterwarnings("ignore:.*was called before the ``update``")
def test_sync_across_ranks_scores_the_whole_corpus():
    whole = scores(PREDS, REFS)
    # three ranks with ragged shares, one of them empty
    ranks = fake_world([(PREDS[:3], REFS[:3]), ([], []), (PREDS[3:], REFS[3:])])
    for m in ranks:
        out = m.compute()
        for k in whole:
            torch.testing.assert_close(out[k], whole[k])
    # compute() unsyncs again: each rank keeps only its own captions afterwards
    assert len(ranks[0].corpus()[1]) == 3 and len(ranks[2].corpus()[1]) == 1


def test_non_ascii_text_survives_the_byte_states():
    m = CaptionScores()
    m.update(["un café près du lac"], [["un café près du lac", "le lac"]])
    gts, res = m.corpus()
    assert res == {0: ["un café près du lac"]} and gts[0] == ["un café près du lac", "le lac"]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="2 predictions but 1"):
        CaptionScores().update(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="at least one reference"):
        CaptionScores().update(["a"], [[]])
