"""The prefill training pipeline: feature shards (resumable), the resumable data stream, on-path loss
masks, the benchmark dedupe, and the teacher-forced evaluator == serving τ exactly (fp64 targets)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.core import SamplingParams
from specserve.train.accept_eval import teacher_forced_meta
from specserve.train.corpus import _conversation, _shingles, _words, is_contaminated
from specserve.train.data import Sequence
from specserve.train.shards import Labeler, ShardSet, epochs, extract
from tests.drafter_setup import _spec_llm
from tests.tiny import reference_greedy, tiny_model

META = ("spec_verify_ct", "spec_accepted_tokens", "spec_draft_tokens", "spec_accepted_per_pos")


@pytest.mark.parametrize("algo,opts", [
    ("dspark", {}), ("dspark", {"speculative_num_draft_tokens": 3}), ("dflash", {}),
    ("eagle3", {"speculative_num_draft_tokens": 4}), ("eagle3", {"speculative_num_draft_tokens": 6}),
    ("mtp", {"speculative_num_draft_tokens": 4}),
])
def test_teacher_forced_tau_equals_engine(trained: dict, algo: str, opts: dict) -> None:
    """One prefill over prompt + greedy output and drafts from every anchor reproduce the engine's
    acceptance counters request by request (length- and stop-token-terminated requests). The evaluator
    replays the fixed window policy (DSPARK's default is confidence windows): pin it."""
    llm = _spec_llm(trained, algo, speculative_window="fixed", **opts)
    rng = random.Random(3)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(5, 40)) for _ in prompts]
    stop = reference_greedy(llm.engine.model, prompts[0], 20)[12]
    params[0] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])  # ends on a stop token
    outs = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    net = llm.engine.drafter.net
    lab = Labeler(llm.engine.model, net.cfg.aux_layer_ids, 128)
    k = llm.engine.num_draft_tokens
    accepted = 0
    for p, sp, o in zip(prompts, params, outs):
        got = teacher_forced_meta(net, lab, p, list(o.token_ids), sp.max_tokens, k)
        assert {m: got[m] for m in META[:3]} == {m: o.meta_info[m] for m in META[:3]}
        assert got["spec_accepted_per_pos"][: len(o.meta_info[META[3]])] == o.meta_info[META[3]]
        accepted += got["spec_accepted_tokens"]
    assert accepted > 0  # a trained drafter: the comparison is not between two zeros


def _items(n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(5, 30)
        out.append(([rng.randrange(97) for _ in range(L)], [i >= L // 3 for i in range(L)]))
    return out


def test_shards_hold_features_and_argmax_labels_and_resume(tmp_path: Path) -> None:
    model = tiny_model(layers=4)
    lab = Labeler(model, (1, 3), 64)
    items = _items(12)
    d = {"target": "tiny"}
    extract(lab, lambda i: items[i], len(items), tmp_path / "a", 60, d)
    # interrupted after ~100 tokens, then resumed: the same shards
    extract(lab, lambda i: items[i], len(items), tmp_path / "b", 60, d, max_tokens=100)
    extract(lab, lambda i: items[i], len(items), tmp_path / "b", 60, d)
    a, b = ShardSet(tmp_path / "a"), ShardSet(tmp_path / "b")
    assert len(a) == len(b) == len(items)
    for i, (ids, mask) in enumerate(items):
        s = a[i]
        assert s.ids.tolist() == ids and s.loss_mask.tolist() == mask
        assert torch.equal(s.feats, b[i].feats) and torch.equal(s.labels, b[i].labels)
        feats, labels = lab(ids)
        assert torch.equal(s.feats, feats.half().float())
        assert s.labels[0] == -1
        for p in range(1, len(ids)):  # labels[p] = the target's greedy token after ids[:p]
            assert s.labels[p] == reference_greedy(model, ids[:p], 1)[0]
    with pytest.raises(ValueError, match="features made with"):
        extract(lab, lambda i: items[i], len(items), tmp_path / "a", 60, {"target": "other"})
    part = ShardSet(tmp_path / "a", max_tokens=50)
    assert 50 <= part.tokens < 50 + 30 and part.token_counts(97).sum() < a.token_counts(97).sum()


def test_data_stream_resumes_at_the_same_batch() -> None:
    seqs = [Sequence(torch.arange(n), torch.ones(n, dtype=torch.bool)) for n in range(3, 40)]
    gen, pos = torch.Generator().manual_seed(0), {}
    stream = epochs(seqs, 50, gen, pos)
    for _ in range(23):  # past an epoch boundary
        next(stream)
    saved_gen, saved_pos = gen.get_state(), dict(pos)
    want = [[len(s.ids) for s in next(stream)] for _ in range(10)]
    gen2 = torch.Generator()
    gen2.set_state(saved_gen)
    stream2 = epochs(seqs, 50, gen2, dict(saved_pos))
    assert [[len(s.ids) for s in next(stream2)] for _ in range(10)] == want
    assert pos["epoch"] >= 1


def test_block_loss_ignores_positions_off_the_greedy_path() -> None:
    """With offpath weight 0, the labels after the first disagreement of text and target cannot change
    the block loss of anchors before it; with weight 1 they do."""
    from specserve.drafters.dspark import DSparkNet
    from specserve.drafters.nets import DrafterConfig
    from specserve.train.losses import block_loss

    model = tiny_model(layers=4, dtype=torch.float32)
    net = DSparkNet(DrafterConfig.for_target("dspark", model.cfg, draft_vocab_size=97, block_size=4))
    net.bind(model)
    torch.nn.init.normal_(net.markov_out.weight, std=0.1)
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0], labels[5] = -1, (ids[5] + 1) % 97  # the text leaves the greedy path at position 5
    feats = torch.randn(12, 3, 32, generator=torch.Generator().manual_seed(2))
    t2d = torch.arange(97)
    seq = lambda lab: Sequence(ids, torch.ones(12, dtype=torch.bool), feats, lab)  # noqa: E731
    other = labels.clone()
    other[6:8] = (labels[6:8] + 7) % 97  # labels only offsets reached through position 5

    def loss(lab: torch.Tensor, w: float) -> float:  # anchors 3 and 4: offsets past position 5 are off-path
        out, _ = block_loss(net, seq(lab), t2d, 0, 4.0, torch.Generator(), w, anchors=torch.tensor([3, 4]))
        return float(out.detach())

    assert loss(labels, 0.0) == pytest.approx(loss(other, 0.0), abs=1e-6)
    assert loss(labels, 1.0) != pytest.approx(loss(other, 1.0), abs=1e-6)


def test_sharegpt_conversations_and_benchmark_dedupe() -> None:
    ok = _conversation({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    assert ok == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert _conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}) is None
    assert _conversation({"conversations": [{"from": "gpt", "value": "a"}]}) is None
    bench = "Write a python function that returns the sum of the squares of the first n natural numbers please"
    sh = _shingles(_words(bench))
    conv = [{"role": "user", "content": "Hey! " + bench.upper() + " thanks"}, {"role": "assistant", "content": "x"}]
    assert is_contaminated(conv, sh)
    assert not is_contaminated([{"role": "user", "content": "Write a python function"}], sh)
    assert np.all(np.array([len(s.split()) for s in sh]) == 13)
