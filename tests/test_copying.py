"""Copy proposals: the index, the merge with drafts, and that output stays exact with copies on.

The statistical test uses a fixed seed and a chi-square test at significance ALPHA = 1e-3 (a
correct implementation fails it for at most one seed in a thousand; the seed is fixed, so the
outcome is reproducible).
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from stats import ALPHA, chi_square_p_value
from tiny import EOS_ID, TARGETS, OracleDrafter, PolicyRow, drafter_config, layout_config, make_drafter

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, PromptCache, stream_generate
from dflash_mlx.copying import CORPUS_MIN_MATCH, Copy, CopyIndex, common_run, corpus_index, merge
from dflash_mlx.costs import RowCosts, StepCosts
from dflash_mlx.kernels import rejection_accept_twin
from dflash_mlx.policy import BlockPolicy
from dflash_mlx.sampling import SamplingParams, probabilities


def test_index_finds_the_longest_recent_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    text = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    copy = CopyIndex(text).suggest(3)
    # "2 3" ends at 3 and 7; "1 2 3" (a longer match) only at 3: its continuation wins.
    assert copy == Copy([4, 9, 2], 3)
    index = CopyIndex(text[:6])
    assert index.suggest(2) is None or index.suggest(2).tokens != [4, 9]  # "9 2" had no earlier match
    index.extend(text[6:])  # incremental: the same answer as an index built at once
    assert index.suggest(3) == copy
    assert CopyIndex([1, 2]).suggest(4) is None and CopyIndex([5, 6, 7, 8]).suggest(4) is None


def test_a_loop_continues_itself():
    # A period-3 loop: the continuation runs past the end of the text into itself.
    copy = CopyIndex([7, 1, 2, 3, 1, 2, 3, 1]).suggest(8)
    assert copy.tokens == [2, 3, 1, 2, 3, 1, 2, 3] and copy.match == 4  # "1 2 3 1" matched
    assert CopyIndex([4, 4, 4]).suggest(5).tokens == [4] * 5


def test_a_corpus_match_is_proposed_where_it_is_longer():
    M = CORPUS_MIN_MATCH
    run = list(range(1, M + 1))
    corpus = corpus_index([50, *run, 60, 61, 62, 63])
    # The text's end matches the corpus for M tokens and the text itself for 2 ("5 6" at its start).
    text = [M - 1, M, 0, *run]
    assert CopyIndex(text, corpus).suggest(3) == Copy([60, 61, 62], M, from_corpus=True)
    # Past the corpus's end, the continuation repeats itself, so it has the length asked for.
    assert CopyIndex(text, corpus).suggest(6).tokens == [60, 61, 62, 63, 60, 61]
    # As long a match in the text itself wins: it is this text's own habit.
    assert CopyIndex([*run, 70, *run], corpus).suggest(2) == Copy([70, 1], M)
    # A corpus match shorter than CORPUS_MIN_MATCH is not proposed, even with nothing else.
    assert CopyIndex([99, *run[1:]], corpus).suggest(3) is None
    # The corpus is keyed on whole CORPUS_MIN_MATCH-grams: later, shorter matches of the last
    # tokens (here 20 of them) do not hide the one long match.
    crowded = corpus_index([50, *run, 60, 61] + [0, *run[-2:], 70] * 20)
    assert CopyIndex(text, crowded).suggest(2) == Copy([60, 61], M, from_corpus=True)


def test_a_drafter_folder_keeps_its_corpus(tiny_pair, tmp_path):
    from dflash_mlx.models import load_drafter, save_drafter

    drafter = load_drafter(str(tiny_pair("qwen3")[1]))
    assert drafter.corpus is None
    drafter.corpus = corpus_index([3, 1, 4, 1, 5, 9, 2, 6])
    save_drafter(drafter, tmp_path / "with")
    assert load_drafter(str(tmp_path / "with")).corpus.tokens == [3, 1, 4, 1, 5, 9, 2, 6]


def test_merge_keeps_agreement_and_never_switches_back():
    drafted, copied = mx.array([5, 6, 7, 8, 9]), mx.array([5, 6, 1, 2, 3])
    sure, unsure = mx.array([0.9] * 5), mx.array([0.1] * 5)
    tokens, from_copy = merge(drafted, unsure, copied, sure)
    assert tokens.tolist() == [5, 6, 1, 2, 3] and from_copy.tolist() == [False, False, True, True, True]
    tokens, from_copy = merge(drafted, sure, copied, unsure)
    assert tokens.tolist() == [5, 6, 7, 8, 9] and not from_copy.any().item()
    # Agreement everywhere: the common tokens, counted as the drafter's.
    tokens, from_copy = merge(drafted, unsure, drafted, sure)
    assert tokens.tolist() == drafted.tolist() and not from_copy.any().item()
    # The choice weighs the whole run after the split, not its first position alone.
    drafter_rates = mx.array([1.0, 1.0, 0.6, 0.6, 0.6])
    copy_rates = mx.array([1.0, 1.0, 0.7, 0.1, 0.1])
    assert merge(drafted, drafter_rates, copied, copy_rates)[1].sum().item() == 0


def test_common_run():
    assert common_run([1, 2, 3], [1, 2, 9]) == (3, 2)  # missed at the third
    assert common_run([1, 2], [1, 2, 3]) == (2, 2)  # every proposal right
    assert common_run([1, 2, 3], [1, 2]) == (2, 2)  # right as far as anything is known
    assert common_run([4], [1]) == (1, 0)


def test_policies_pick_the_source_that_is_accepted_further():
    def learn(policy, row, copy, committed, drafted=None):
        for _ in range(30):
            row.copy = copy
            policy.plan([row])
            row.acceptance.record(drafted, copy, committed)

    fixed = BlockPolicy(8)
    row = PolicyRow(fixed.acceptance())
    copy = Copy([1, 2, 3, 4, 5, 6, 7], match=9)
    learn(fixed, row, copy, [1, 2, 3, 4, 5, 6, 7, 8], [9] * 7)  # copies right every time, drafts never
    row.copy = copy
    plan = fixed.plan([row])
    assert plan.block_size == 8 and not plan.draft  # copy only: the drafter is skipped
    row.copy = None
    assert fixed.plan([row]).draft  # nothing to copy: draft

    flat = StepCosts({1: RowCosts({1: 1.0, 16: 1.3}, {1: 0.0, 2: 0.2, 16: 0.3})})
    adaptive = BlockPolicy(8, flat)
    row = PolicyRow(adaptive.acceptance())
    long = Copy(list(range(15)), match=9)
    learn(adaptive, row, long, list(range(16)))
    row.copy = long
    plan = adaptive.plan([row])
    assert plan.block_size == 16 and not plan.draft  # longer than the drafter's block: no drafter runs
    row.copy = None
    assert adaptive.plan([row]).draft or adaptive.plan([row]).plain

    # OpenBLAS on x86: 16 rows cost less than 12. A copy accepted for 11 tokens then takes 16 rows
    # (cheaper than 12, as many tokens); were 16 priced as 12, 8 rows would win.
    dip = StepCosts({1: RowCosts({1: 1.0, 8: 1.5, 12: 2.4, 16: 1.5}, {1: 0.0, 2: 0.2, 16: 0.3})})
    adaptive = BlockPolicy(8, dip)
    row = PolicyRow(adaptive.acceptance())
    learn(adaptive, row, long, list(range(11)) + [99])
    row.copy = long
    assert adaptive.plan([row]).block_size == 16
    adaptive.costs = StepCosts({1: RowCosts({1: 1.0, 8: 1.5, 12: 2.4, 16: 2.4}, dip.rows[1].draft)})
    assert adaptive.plan([row]).block_size == 8


def test_point_mass_rejection_is_exact():
    """A copied token under sampling: accepted with probability p(token), else the residual."""
    rng = np.random.default_rng(0)
    p = mx.array(rng.dirichlet(np.ones(6) * 0.7, size=3).astype(np.float32))
    copied = mx.array([2, 4])
    q = (mx.arange(6)[None] == copied[:, None]).astype(mx.float32)
    N = 40000
    uniforms = mx.random.uniform(shape=(N, 3), key=mx.random.key(1))
    tokens, n = mx.vmap(rejection_accept_twin, in_axes=(None, None, None, 0))(p, q, copied, uniforms)
    tokens, n, p = np.array(tokens), np.array(n), np.array(p)
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=6), p[0]) > ALPHA
    assert chi_square_p_value(np.bincount(tokens[n >= 1, 1], minlength=6), p[1]) > ALPHA
    assert abs((n >= 1).mean() - p[0, 2]) < 5 * np.sqrt(p[0, 2] * (1 - p[0, 2]) / N)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family(request, tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(request.param)
    # Half of tiny.py's weight scale: a target whose greedy answers fall into loops, as real
    # answers partly repeat themselves, so copies get accepted as well as rejected.
    looping = tmp_path_factory.mktemp("looping") / request.param
    shutil.copytree(target, looping)
    weights = mx.load(str(looping / "model.safetensors"))
    mx.save_safetensors(str(looping / "model.safetensors"),
                        {k: v * 0.5 if v.ndim == 2 and "embed" not in k else v for k, v in weights.items()})
    model, tokenizer = dflash_mlx.load(str(looping), str(draft))
    prompts = [tokenizer.encode(t) for t in ("abcabcabcabc", "one two one two one two", "x = [1, 2, 3, 1, 2, 3")]
    refs = [[int(t) for t, _ in generate_step(mx.array(p), model.target.model, max_tokens=40)] for p in prompts]
    return model, tokenizer, prompts, refs


@pytest.mark.parametrize("block_size", [4, 16, "auto"])
@pytest.mark.parametrize("drafter", ["random", "oracle-corrupt"])
def test_greedy_with_copies_matches_mlx_lm(family, block_size, drafter):
    model, tokenizer, prompts, refs = family
    copied = copy_steps = 0
    for prompt, ref in zip(prompts, refs):
        pair = model if drafter == "random" else DFlashModel(model.target, OracleDrafter(model.drafter, prompt + ref, 5))
        flat = StepCosts({1: RowCosts({1: 1.0, 16: 1.3}, {1: 0.0, 2: 0.1, 16: 0.2})})
        policy = BlockPolicy(16, flat) if block_size == "auto" else block_size
        responses = list(stream_generate(pair, tokenizer, prompt, 40, block_size=policy))
        out = [r.token for r in responses]
        assert out == ref[: len(out)] and (len(out) == 40 or out[-1] == 2)
        s = responses[-1].stats
        assert s.copied + s.drafted == sum(s.acceptance_lengths) - len(s.acceptance_lengths)
        copied, copy_steps = copied + s.copied, copy_steps + s.copy_steps
    # Copies were really proposed and accepted; but an oracle's draft trees, which auto values as
    # such, are worth more than a step of copies alone, and its confident candidates outscore them.
    if (drafter, block_size) != ("oracle-corrupt", "auto"):
        assert copied > 0 and copy_steps > 0


def test_greedy_with_a_corpus_matches_mlx_lm(family):
    """The drafter's corpus holds the answers with every 10th token changed: its copies are accepted
    for a while, then rejected; one at a time and batched, the output stays mlx_lm's."""
    model, tokenizer, prompts, refs = family
    corpus = [(t + 1) % model.target.vocab_size if i % 10 == 9 else t for ref in refs for i, t in enumerate(ref)]
    model.drafter.corpus = corpus_index(corpus)
    try:
        corpus_copied = 0
        for prompt, ref in zip(prompts, refs):
            responses = list(stream_generate(model, tokenizer, prompt, 40, block_size=8))
            assert [r.token for r in responses] == ref[: len(responses)]
            corpus_copied += responses[-1].stats.corpus_copied
            assert responses[-1].stats.corpus_tokens == len(corpus)
        assert corpus_copied > 0
        engine = Engine(model, block_size=8)
        uids = [engine.add(p, max_tokens=40, stop_tokens=[2]) for p in prompts]
        events = {}
        while not engine.idle:
            for e in engine.step():
                events.setdefault(e.uid, []).append(e)
        assert [[e.token for e in events[u]] for u in uids] == [ref[: len(events[u])] for u, ref in zip(uids, refs)]
        assert sum(events[u][-1].stats.corpus_copied for u in uids) > 0
    finally:
        model.drafter.corpus = None


def test_copies_off_proposes_none(family):
    model, tokenizer, prompts, refs = family
    responses = list(stream_generate(model, tokenizer, prompts[0], 40, block_size=8, copy_proposals=False))
    assert [r.token for r in responses] == refs[0][: len(responses)]
    assert responses[-1].stats.copied == 0 and "copy proposals off" in dflash_mlx.generation.format_stats(responses[-1])


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_sampling_with_copies_is_exact(tiny_pair, rule):
    """The second generated token follows the target's exact marginal while copy-only steps run,
    copying from the text itself or from the drafter's corpus (coupled: a fresh seed per run)."""
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    target = model.target.model
    params = SamplingParams(temp=1.0)
    # Ends with "x"; "x" + c occurs in the prompt for half the characters c, and the corpus holds
    # the prompt's last CORPUS_MIN_MATCH - 1 tokens + c for the others: whatever the first token,
    # the text's end was seen, so the second step copies.
    from tiny import CHARS

    half = len(CHARS) // 2
    prompt = tokenizer.encode("x" + "x".join(CHARS[:half]) + "x")
    tail = prompt[1 - CORPUS_MIN_MATCH :]
    others = tokenizer.encode("".join(CHARS[half:]), add_special_tokens=False)
    model.drafter.corpus = corpus_index([t for c in others for t in (*tail, c, EOS_ID)])
    first = np.array(probabilities(target(mx.array([prompt]))[0, -1:], params))[0]
    second = np.array(probabilities(target(mx.array([prompt + [t] for t in range(len(first))]))[:, -1], params))
    expected = first @ second

    # Rejection sampling is the rule of DFlash2 drafters (their selector's picks are not coupled).
    pair = model if rule == "coupled" else DFlashModel(model.target, make_drafter(layout_config(
        drafter_config(TARGETS["qwen3"]), "dflash2")))
    pair.drafter.corpus = model.drafter.corpus
    mx.random.seed(4321)
    runs = 600
    # 64 runs decoded together; after the first prefill each run prefills one token (prompt cache).
    engine = Engine(pair, block_size=4, max_rows=64, prompt_cache=PromptCache())
    uids = []
    for run in range(runs):
        uids.append(engine.add(prompt, max_tokens=4, temp=params.temp, seed=run if rule == "coupled" else None))
        # Copy only whenever there is something to copy (the rates say copies always win).
        acceptance = engine.pending[-1].acceptance
        acceptance.drafter.rates = [0.0] * len(acceptance.drafter.rates)
        for rates in acceptance.copies + acceptance.corpus_copies:
            rates.rates = [1.0] * len(rates.rates)
    events = {uid: [] for uid in uids}
    while not engine.idle:
        for event in engine.step():
            events[event.uid].append(event)
    runs_events = [events[uid] for uid in uids]
    counts = np.bincount([e[1].token for e in runs_events], minlength=len(first))
    copy_steps = sum(e[-1].stats.copy_steps > 0 for e in runs_events)
    accepted = sum(e[1].from_draft for e in runs_events)
    # what each run's second step was offered
    offered = [CopyIndex(prompt + [e[0].token], pair.drafter.corpus).suggest(3) for e in runs_events]
    from_corpus = sum(copy is not None and copy.from_corpus for copy in offered)
    assert runs_events[-1][-1].stats.sampling == rule
    assert chi_square_p_value(counts, expected) > ALPHA
    assert copy_steps > 0.8 * runs and 0 < accepted < copy_steps  # copies ran, some accepted, some rejected
    assert 0.2 * runs < from_corpus < 0.8 * runs  # from both sources
