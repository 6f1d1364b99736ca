"""The batch engine: every row exact, whatever the rows around it accept, join or cancel.

Oracle drafters make the rows of one step accept different numbers of
proposals; the tests assert such steps happened. The sampling test is
statistical: chi-square at significance ALPHA (1e-3) per checked distribution,
two distributions, fixed seeds, so a correct engine fails it with probability
at most 2e-3 over seeds, and the outcome is reproducible.
"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ConcatenateKVCache
from mlx_lm.sample_utils import make_repetition_penalty
from stats import ALPHA, chi_square_p_value
from test_hybrid import build, make_drafter
from tiny import EOS_ID, MASK_ID, OracleDrafter, ScriptedPolicy, async_evaluations, reads_apart_from_next_forward

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, PromptCache, batch_generate, stream_generate
from dflash_mlx.errors import DFlashError
from dflash_mlx.kernels import get_ops
from dflash_mlx.models import Drafter
from dflash_mlx.policy import BlockPolicy
from dflash_mlx.sampling import SamplingParams, probabilities
from dflash_mlx.cache.ragged import RaggedKVCache
from dflash_mlx.target import Target, even_groups

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "A",
    "Once upon a time, in a land far away,",
]
WRONG_EVERY = [3, 0, 5, 2, 7]  # per request: how often its oracle proposal is wrong (0: never)
MAX_TOKENS = [40, 24, 40, 33, 17]


def reference(model, prompt, max_tokens, **kwargs):
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, **kwargs):
        out.append(int(t))
        if out[-1] == EOS_ID:
            break
    return out


def step(engine, events: dict) -> None:
    """One engine step; its events appended to each uid's list."""
    for e in engine.step():
        events.setdefault(e.uid, []).append(e)


def collect(engine, events=None):
    """Step until idle; tokens per uid (stop tokens included) and each uid's final event."""
    events = events if events is not None else {}
    while not engine.idle:
        step(engine, events)
    return events


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family(request, tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair(request.param)))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    refs = [reference(model.target.model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    return model, tokenizer, prompts, refs


def oracle_engine(model, block_size=6, **kwargs):
    oracle = OracleDrafter(model.drafter)
    engine = Engine(DFlashModel(model.target, oracle), block_size=block_size, **kwargs)
    oracle.engine = engine
    return engine, oracle


def add(engine, oracle, prompt, ref, wrong, max_tokens, stop_tokens=(), **kwargs):
    uid = engine.add(prompt, max_tokens=max_tokens, stop_tokens=[EOS_ID, *stop_tokens], **kwargs)
    oracle.refs[uid], oracle.wrong[uid] = prompt + ref, wrong
    return uid


def test_greedy_rows_match_single_requests_and_mlx_lm(family):
    """Rows of different lengths accepting different counts: each equals its own decoding."""
    model, tokenizer, prompts, refs = family
    engine, oracle = oracle_engine(model, prefill_step_size=16)
    uids = [add(engine, oracle, p, r, w, n) for p, r, w, n in zip(prompts, refs, WRONG_EVERY, MAX_TOKENS)]
    events = collect(engine)
    for uid, prompt, ref, n in zip(uids, prompts, refs, MAX_TOKENS):
        out = [e.token for e in events[uid]]
        assert out == ref, uid
        single = [r.token for r in stream_generate(model, tokenizer, prompt, n, block_size=6)]
        assert out == single
        assert events[uid][-1].finish_reason == ("stop" if out[-1] == EOS_ID else "length")
        assert all(e.finish_reason is None for e in events[uid][:-1])
    stats = engine.stats
    assert stats.ragged_steps > 0, "no step in which rows accepted different counts"
    # The 16-token prefill budget spreads the prompts over steps: rows joined a running batch.
    assert max(stats.rows) >= 3 and len(stats.rows) > 2 and stats.batched
    never_wrong = events[uids[1]][-1].stats
    assert never_wrong.tau > 4  # whole blocks accepted while the neighbours were rejected


def test_rows_join_mid_run_and_cancelled_rows_leave(family):
    model, _, prompts, refs = family
    engine, oracle = oracle_engine(model, block_size=4)
    first = [add(engine, oracle, prompts[i], refs[i], WRONG_EVERY[i], MAX_TOKENS[i]) for i in (0, 2, 4)]
    events = {}
    for _ in range(3):
        step(engine, events)
    late = [add(engine, oracle, prompts[i], refs[i], WRONG_EVERY[i], MAX_TOKENS[i]) for i in (1, 3)]
    step(engine, events)
    cancelled = first[0]
    assert engine.cancel(cancelled) and cancelled not in engine.uids
    assert not engine.cancel(cancelled)
    collect(engine, events)
    assert events[cancelled][-1].finish_reason is None and len(events[cancelled]) < len(refs[0])
    for uid, i in zip(first + late, (0, 2, 4, 1, 3)):
        if uid != cancelled:
            assert [e.token for e in events[uid]] == refs[i]
    assert engine.idle and engine.cache is None


def test_a_long_prompt_takes_one_forward_a_step_and_may_be_cancelled_between(family):
    """With nothing decoding, a step still prefills one forward only: a server sees a cancelled
    request (or a shutdown) between a long prompt's forwards, not after all of them."""
    model, _, prompts, refs = family
    engine, oracle = oracle_engine(model, prefill_step_size=8)
    prompt = prompts[2]
    assert len(prompt) > 16
    dropped = add(engine, oracle, prompt, refs[2], 0, MAX_TOKENS[2])
    assert engine.step() == [] and engine.pending[0].prefilled == 8
    assert engine.cancel(dropped) and engine.idle
    kept = add(engine, oracle, prompt, refs[2], 3, MAX_TOKENS[2])
    events = {}
    steps = 0
    while not events:
        step(engine, events)
        steps += 1
    assert steps == -(-len(prompt) // 8)  # one forward a step, the first token with the last
    assert [e.token for e in collect(engine, events)[kept]] == refs[2]


def test_logits_processors_stops_and_logprobs_are_per_request(family):
    model, _, prompts, refs = family
    penalty = [make_repetition_penalty(1.5, 20)]
    penalised = reference(model.target.model, prompts[2], 30, logits_processors=penalty)
    engine, oracle = oracle_engine(model)
    plain = add(engine, oracle, prompts[0], refs[0], 4, 40, logprobs=True)
    proc = add(engine, oracle, prompts[2], penalised, 4, 30, logits_processors=penalty)
    # Stop on a two-token sequence that first appears part-way through the reference.
    ref = refs[4]
    k = next(i for i in range(3, len(ref) - 1) if (ref[i], ref[i + 1]) not in zip(ref[:i], ref[1 : i + 1]))
    assert EOS_ID not in ref[: k + 2]
    stopped = add(engine, oracle, prompts[4], ref, 0, 40, stop_tokens=[[ref[k], ref[k + 1]]])
    events = collect(engine)
    assert [e.token for e in events[proc]] == penalised
    assert [e.token for e in events[stopped]] == ref[: k + 2]
    assert events[stopped][-1].finish_reason == "stop"
    # logprobs: the target's log-softmax at each committed token.
    out = [e.token for e in events[plain]]
    logits = model.target.model(mx.array([prompts[0] + out[:-1]]))[0, len(prompts[0]) - 1 :]
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[np.arange(len(out)), out]
    assert np.allclose([e.logprobs[e.token].item() for e in events[plain]], expected, atol=1e-4)


def test_batch_generate_mirrors_mlx_lm(family):
    model, tokenizer, prompts, refs = family
    response = batch_generate(
        model, tokenizer, [PROMPTS[0], prompts[1], PROMPTS[3]], max_tokens=[40, 24, 33],
        return_token_ids=True, block_size=4,
    )
    for ids, text, ref in zip(response.token_ids, response.texts, [refs[0], refs[1], refs[3]]):
        assert ids == [t for t in ref if t != EOS_ID]
        assert text == tokenizer.decode(ids)
    assert response.caches is None and response.stats.generation_tokens > 0
    with pytest.raises(DFlashError, match="prompt_caches"):
        batch_generate(model, tokenizer, prompts[:1], return_prompt_caches=True)
    with pytest.raises(DFlashError, match="one per prompt"):
        batch_generate(model, tokenizer, prompts[:2], max_tokens=[3])


def test_bad_requests_are_refused(family):
    model = family[0]
    engine = Engine(model)
    for kwargs, message in [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[5], max_tokens=0), "max_tokens must be at least 1"),
        (dict(prompt=[5], seed=1, sampler=lambda lp: mx.argmax(lp, -1)), "seed cannot reach a custom sampler"),
        (dict(prompt=[5], temp=-1.0), "bad sampling settings"),
    ]:
        with pytest.raises(DFlashError, match=message):
            engine.add(**kwargs)
    with pytest.raises(DFlashError, match="block size"):
        Engine(model, block_size=0)


@pytest.mark.parametrize("causal", [False, True])
def test_ragged_drafter_rows_equal_single_rows(tiny_pair, causal):
    """One drafter forward over rows with different context lengths gives each row's own logits,
    for full-attention and sliding-window drafter layers, bidirectional or causal blocks."""
    model, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    target, ops = model.target, get_ops(False)
    args = replace(model.drafter.args, layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                   is_causal=causal)
    drafter = Drafter(args)
    drafter.update(model.drafter.parameters())
    head = target.head()
    mx.random.seed(3)
    contexts = [mx.random.normal((1, n, 2 * args.hidden_size)) for n in (9, 3, 6)]
    news = [mx.random.normal((1, n, 2 * args.hidden_size)) for n in (1, 4, 2)]
    blocks = target.embed(mx.array([[7, MASK_ID, MASK_ID, MASK_ID]] * 3))
    expected = []
    for ctx, new in zip(contexts, news):
        cache = drafter.make_cache()
        drafter(blocks[:1], ctx, cache, head, ops)
        expected.append(drafter(blocks[:1], new, cache, head, ops)[0])
    caches = None
    for ctx in contexts:
        row = drafter.make_cache()
        drafter.absorb(ctx, row)
        if caches is None:
            caches = row
        else:
            for batch, one in zip(caches, row):
                batch.extend(one)
    width = max(n.shape[1] for n in news)
    for c in caches:
        c.prepare([width - n.shape[1] for n in news])
    padded = mx.concatenate([mx.pad(n, [(0, 0), (width - n.shape[1], 0), (0, 0)]) for n in news])
    got = drafter(blocks, padded, caches, head, ops)
    for r in range(3):
        assert mx.allclose(got[r], expected[r], atol=1e-4).item(), r
    assert caches[0].positions == caches[1].positions == caches[1].lengths == [10, 7, 8]
    assert caches[0].lengths == [4, 4, 4]  # the sliding-window layer keeps what its window shows


def test_a_joining_request_does_not_hold_back_the_rows_decoding(family):
    """A prompt finished while no row decodes sends its first token at once, alone (its time to
    first token is its prefill's); one that joins decoding rows leaves them their step."""
    model, _, prompts, refs = family
    engine, oracle = oracle_engine(model, block_size=4)
    first = add(engine, oracle, prompts[0], refs[0], WRONG_EVERY[0], MAX_TOKENS[0])
    events = {}
    step(engine, events)
    assert [e.token for e in events[first]] == refs[0][:1]
    step(engine, events)
    before = len(events[first])
    late = add(engine, oracle, prompts[1], refs[1], WRONG_EVERY[1], MAX_TOKENS[1])
    step(engine, events)
    assert events[late][0].token == refs[1][0] and len(events[first]) > before
    collect(engine, events)
    assert [e.token for e in events[first]] == refs[0] and [e.token for e in events[late]] == refs[1]


def test_prefill_budget_holds_only_while_rows_decode(family):
    """A request joining running rows gets at most prefill_step_size prompt tokens per step (an idle
    engine's one forward a step: test_a_long_prompt_takes_one_forward_a_step_and_may_be_cancelled_between)."""
    model, _, prompts, refs = family
    engine, oracle = oracle_engine(model, block_size=4, prefill_step_size=4)
    first, then = (0, 1, 4), 2  # prompts of 5, 44 and 37 tokens; then one of 63
    uids = [add(engine, oracle, prompts[i], refs[i], 3, MAX_TOKENS[i]) for i in first]
    events = {}
    while engine.pending:
        step(engine, events)
    assert engine.rows  # still decoding when the next request comes
    late = add(engine, oracle, prompts[then], refs[then], 3, MAX_TOKENS[then])
    step(engine, events)
    assert engine.pending and engine.pending[0].prefilled == 4 < len(prompts[then])
    collect(engine, events)
    for uid, i in zip(uids + [late], first + (then,)):
        assert [e.token for e in events[uid]] == refs[i]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_hybrid_and_sliding_window_targets_are_batched(name):
    """Gated DeltaNet rows replay their own accepted steps; sliding-window rows mask by position."""
    model = build(name)
    pair = DFlashModel(Target(model, [0, 2]), make_drafter(model))
    prompts = [[5, 17, 9, 33, 2, 41, 8, 8, 60, 12, 27, 3], [40, 7], [11, 58, 31, 22, 44, 19, 6]]
    refs = [reference(model, p, 20) for p in prompts]
    engine, oracle = oracle_engine(pair, block_size=5, prefill_step_size=8)
    uids = [add(engine, oracle, p, r, w, 20) for p, r, w in zip(prompts, refs, (3, 0, 4))]
    events = collect(engine)
    for uid, ref in zip(uids, refs):
        assert [e.token for e in events[uid]] == ref
    assert engine.stats.batched and engine.stats.ragged_steps > 0


def test_joining_prompts_are_prefilled_together(family, monkeypatch):
    """Chunks of different lengths, some after a cached prefix, in as few forwards as keep pads under
    a quarter of the tokens: each row's logits, hidden states and caches as if it had been
    prefilled alone."""
    model, _, prompts, _ = family
    target = model.target
    # 12 and 10 tokens share a forward (4 pads of 22 tokens); a last token after a cached prompt
    # and a 2-token chunk go in their own (padding the 1 to 12 would be 11 pads for 1 token).
    cases = [(prompts[2][:8], prompts[2][8:20]), ([], prompts[2][:1]), (prompts[1][:6], prompts[1][6:8]),
             ([], prompts[2][:10])]
    assert even_groups([len(chunk) for _, chunk in cases]) == [[0, 3], [2], [1]]
    forwards, forward = [], type(target)._forward
    monkeypatch.setattr(type(target), "_forward", lambda self, rows, *a: (forwards.append(rows.shape),
                                                                          forward(self, rows, *a))[1])

    def caches(prefix):
        cache = target.make_cache()
        if prefix:
            target.prefill(mx.array(prefix), cache)
        return cache

    alone = [(c := caches(prefix), *target.prefill_rows([c], [chunk])[0]) for prefix, chunk in cases]
    rows = [caches(prefix) for prefix, _ in cases]
    forwards.clear()
    together = [(c, *out) for c, out in zip(rows, target.prefill_rows(rows, [chunk for _, chunk in cases]))]
    assert forwards == [(2, 12), (1, 2), (1, 1)]
    probe = mx.array([[5]])
    for (c1, logits1, hidden1), (c2, logits2, hidden2) in zip(alone, together):
        assert logits1.shape == logits2.shape and hidden1.shape == hidden2.shape
        # Batched matmuls round differently: close, not equal (hidden states reach |30|).
        assert mx.allclose(logits1, logits2, rtol=1e-4, atol=1e-3).item()
        assert mx.allclose(hidden1, hidden2, rtol=1e-4, atol=1e-3).item()
        assert [c.lengths for c in c1] == [c.lengths for c in c2]
        assert mx.allclose(target(probe, c1)[0], target(probe, c2)[0], rtol=1e-4, atol=1e-3).item()  # caches go on alike


def test_a_join_leaves_the_batch_room_for_its_next_forward(family, monkeypatch):
    """Rows prefilled together are taken at their exact lengths; joined, the batch gets room for its
    next forward, which would otherwise grow (and so copy) every layer's cache."""
    model, _, prompts, _ = family
    target = model.target
    rows = [target.make_cache() for _ in range(2)]
    target.prefill_rows(rows, [prompts[2][:12], prompts[2][:10]])
    assert {c.keys.shape[2] for row in rows for c in row} == {12, 10}  # taken at their lengths
    batch = rows[0]
    target.join(batch, rows[1])
    grown, reserve = [], RaggedKVCache._reserve

    def watched(self, keys, values, size):
        if size > self.keys.shape[2]:
            grown.append(size)
        return reserve(self, keys, values, size)

    monkeypatch.setattr(RaggedKVCache, "_reserve", watched)
    mx.eval(target(mx.array([[5, 6], [7, 8]]), batch))
    assert not grown


def run_ahead_case(pair, prompts, refs, max_tokens):
    """Rows join one by one and mid-run, one is cancelled, the rest finish at different steps."""
    engine, oracle = oracle_engine(pair, block_size=ScriptedPolicy([1, 1, 4, 1, 3]), prefill_step_size=64)
    uids = [add(engine, oracle, p, r, w, n) for p, r, w, n in zip(prompts[:3], refs, (3, 0, 4), max_tokens)]
    events = {}
    for _ in range(12):
        step(engine, events)
        if len(engine.rows) == 3 and engine.ahead is not None:
            break
    assert engine.ahead is not None  # the next step's forward has started: late requests arrive now
    uids += [add(engine, oracle, p, r, 2, n) for p, r, n in zip(prompts[3:], refs[3:], max_tokens[3:])]
    step(engine, events)
    assert engine.cancel(uids[0])
    collect(engine, events)
    for uid, ref in list(zip(uids, refs))[1:]:
        assert [e.token for e in events[uid]] == ref
    assert engine.stats.block_sizes[1] > 0 and engine.stats.ragged_steps > 0


def test_plain_steps_run_ahead_while_rows_join_and_leave(family):
    model, _, prompts, refs = family
    run_ahead_case(model, prompts, refs, MAX_TOKENS)


def test_a_plain_step_is_read_without_waiting_for_the_next_forward(family, monkeypatch):
    model, _, prompts, refs = family
    calls = async_evaluations(monkeypatch)
    engine, oracle = oracle_engine(model, block_size=BlockPolicy(1))  # runs ahead: no Overlap measured
    uids = [add(engine, oracle, p, r, w, n) for p, r, w, n in zip(prompts, refs, WRONG_EVERY, MAX_TOKENS)]
    events = collect(engine)
    assert [[e.token for e in events[u]] for u in uids] == refs
    assert reads_apart_from_next_forward(calls)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_hybrid_plain_steps_run_ahead(name):
    model = build(name)
    prompts = [[5, 17, 9, 33, 2, 41, 8, 8, 60, 12, 27, 3], [40, 7], [11, 58, 31, 22, 44, 19, 6], [9, 9, 1]]
    lengths = [20, 18, 24, 12]
    refs = [reference(model, p, n) for p, n in zip(prompts, lengths)]
    run_ahead_case(DFlashModel(Target(model, [0, 2]), make_drafter(model)), prompts, refs, lengths)


def test_target_the_engine_cannot_batch_is_served_one_at_a_time():
    """A Gated DeltaNet layer without per-row lengths: one row at a time, and the stats say why."""
    model = build("qwen3_5")
    mixers = [layer["linear_attn"] for layer in model.layers if "linear_attn" in layer]
    base = type(mixers[0])

    class NoLengths(base):  # what the engine sees of an mlx_lm layer without batched lengths
        def __call__(self, inputs, mask=None, cache=None):
            return base.__call__(self, inputs, mask, cache)

    for mixer in mixers:
        mixer.__class__ = NoLengths
    pair = DFlashModel(Target(model, [0, 2]), make_drafter(model))
    engine, oracle = oracle_engine(pair, block_size=4)
    prompts = [[5, 17, 9, 33, 2, 41], [40, 7, 12]]
    refs = [reference(model, p, 12) for p in prompts]
    uids = [add(engine, oracle, p, r, 3, 12) for p, r in zip(prompts, refs)]
    events = collect(engine)
    assert [[e.token for e in events[u]] for u in uids] == refs
    assert not engine.stats.batched and "per-row lengths" in engine.stats.reason
    assert set(engine.stats.rows) == {1}


def third_token_marginal(net, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """Exact distribution of the third sampled token, enumerated over the first two
    (the prompt's K/V computed once and copied to every continuation)."""
    cache = [ConcatenateKVCache() for _ in net.layers]
    p1 = np.array(probabilities(net(mx.array([prompt]), cache=cache)[0, -1:], params))[0]
    V = p1.size

    def copies(n):
        out = [ConcatenateKVCache() for _ in cache]
        for copy, c in zip(out, cache):
            copy.state = [mx.repeat(x, n, axis=0) for x in c.state]
        return out

    first = mx.arange(V)
    p2 = np.array(probabilities(net(first[:, None], cache=copies(V))[:, -1], params))
    pairs = mx.stack([mx.repeat(first, V), mx.tile(first, V)], axis=1)
    p3 = np.array(probabilities(net(pairs, cache=copies(V * V))[:, -1], params)).reshape(V, V, V)
    return np.einsum("a,ab,abv->v", p1, p2, p3)


def test_sampling_is_exact_per_row_under_batching(tiny_pair):
    """Third generated token of two requests with different settings and prompt lengths,
    decoded side by side with block 3 (rows accept 0, 1 or 2 proposals, so some roll
    back while their neighbours do not), against its exact marginal. Four tokens each, so that
    the first step after the prefill's token may verify a whole block."""
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    net = model.target.model
    settings = [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.9)]
    prompts = [tokenizer.encode("Once upon"), tokenizer.encode("The cat sat on")]
    expected = [third_token_marginal(net, p, s) for p, s in zip(prompts, settings)]
    engine, oracle = oracle_engine(model, block_size=3, max_rows=8)
    greedy = [prompt + reference(net, prompt, 3) for prompt in prompts]
    runs, uids = 250, [[], []]
    for i in range(runs):
        for k, (prompt, params) in enumerate(zip(prompts, settings)):
            uid = engine.add(prompt, max_tokens=4, temp=params.temp, top_p=params.top_p, seed=2 * i + k)
            oracle.refs[uid], oracle.wrong[uid] = greedy[k], 0
            uids[k].append(uid)
    events = collect(engine)
    for k in range(2):
        counts = np.bincount([events[u][2].token for u in uids[k]], minlength=expected[k].size)
        assert chi_square_p_value(counts, expected[k]) > ALPHA, k
    accepted = [sum(e.from_draft for e in events[u]) for u in uids[0] + uids[1]]
    assert {0, 1, 2} <= set(accepted)  # full, partial and no acceptance all occurred
    assert engine.stats.ragged_steps > 0 and max(engine.stats.rows) == 8


def test_seeded_request_is_independent_of_its_neighbours(tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    prompt = tokenizer.encode("Seeded")

    def run(neighbours, block_size):
        engine = Engine(model, block_size=block_size)
        for i in range(neighbours):
            engine.add(tokenizer.encode("x" * (i + 1)), max_tokens=8 + i, temp=1.0, seed=100 + i)
        uid = engine.add(prompt, max_tokens=20, temp=0.8, top_k=20, seed=7)
        return [e.token for e in collect(engine)[uid]]

    alone = run(0, 4)
    # Coupled sampling: the blocks may differ too (another engine's block size), the text may not.
    assert run(3, 4) == run(3, 2) == alone and len(alone) == 20


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_5"])
def test_next_turn_reuses_the_prompt_cache(name):
    """A request whose prompt extends a finished (or cancelled) one prefills only the new tokens and
    decodes exactly; recurrent targets cannot trim back to a prefix and reuse nothing."""
    model = build(name)
    pair = DFlashModel(Target(model, [0, 2]), make_drafter(model))
    engine, oracle = oracle_engine(pair, block_size=4, prefill_step_size=8, prompt_cache=PromptCache())
    first = [5, 17, 9, 33, 2, 41, 8, 8, 60, 12]
    ref = reference(model, first, 16)
    add(engine, oracle, first, ref, 3, 16)
    collect(engine)
    # The next turn: the conversation so far plus a new message; and a request that diverges early.
    follow = first + ref[:-1] + [44, 19, 6]
    other = first[:4] + [21, 22]
    uids = [add(engine, oracle, p, reference(model, p, 12), 2, 12) for p in (follow, other)]
    cached = [engine.cached_tokens(uid) for uid in uids]
    events = collect(engine)
    for uid, prompt in zip(uids, (follow, other)):
        assert [e.token for e in events[uid]] == reference(model, prompt, 12)
    # The whole first turn but its last token (the target never fed it back); of the other request
    # the shared 4 tokens, where attention layers can be cut there: a recurrent state cannot.
    assert cached == [len(first) + len(ref) - 1, 0 if name == "qwen3_5" else 4]
    # A cancelled request's caches are kept too (a recurrent target's as its prompt ended: the
    # prompt cache snapshots every prompt of such targets once prefilled).
    uid = add(engine, oracle, other + [7], reference(model, other + [7], 30), 0, 30)
    engine.step()
    engine.step()
    engine.cancel(uid)
    again = add(engine, oracle, other + [7, 3], reference(model, other + [7, 3], 5), 0, 5)
    assert engine.cached_tokens(again) == len(other) + 1
    assert [e.token for e in collect(engine)[again]] == reference(model, other + [7, 3], 5)


def looping_pair(tiny_pair, tmp_path):
    """The tiny qwen3 target at half weight scale: its greedy answers fall into loops, so copies of
    earlier text get accepted as well as rejected (as in test_copying)."""
    import shutil

    target, draft = tiny_pair("qwen3")
    looping = tmp_path / "looping"
    shutil.copytree(target, looping)
    weights = mx.load(str(looping / "model.safetensors"))
    mx.save_safetensors(str(looping / "model.safetensors"),
                        {k: v * 0.5 if v.ndim == 2 and "embed" not in k else v for k, v in weights.items()})
    return dflash_mlx.load(str(looping), str(draft))


def test_rows_merge_their_own_copies_and_stay_exact(tiny_pair, tmp_path):
    model, tokenizer = looping_pair(tiny_pair, tmp_path)
    prompts = [tokenizer.encode(t) for t in ("abcabcabcabc", "one two one two one two", "x = [1, 2, 3, 1, 2, 3")]
    refs = [reference(model.target.model, p, 40) for p in prompts]
    outputs = {}
    for copies in (True, False):
        engine = Engine(model, block_size=8, copy_proposals=copies)
        uids = [engine.add(p, max_tokens=40, stop_tokens=[EOS_ID]) for p in prompts]
        events = collect(engine)
        outputs[copies] = [[e.token for e in events[u]] for u in uids]
        stats = [events[u][-1].stats for u in uids]
        assert all(s.copy_proposals == copies for s in stats)
        copied = sum(s.copied for s in stats)
        assert copied > 0 if copies else copied == 0
        assert all(s.copied + s.drafted == sum(s.acceptance_lengths) - len(s.acceptance_lengths) for s in stats)
    assert outputs[True] == outputs[False] == refs


def test_sampled_rows_with_copies_are_exact(tiny_pair, tmp_path):
    """Third sampled token of rows whose proposals are copies, decoded eight at a time: its exact
    marginal. The rows' copy rates start high and the drafter's at nothing, so a step whose rows
    all have a match verifies copies alone; the prompt holds (its last token, x) for every x, so
    every first step has one. The first request prefills the prompt; the others start from its
    prompt cache."""
    model, tokenizer = looping_pair(tiny_pair, tmp_path)
    net = model.target.model
    params = SamplingParams(temp=1.0, top_p=0.95)
    V = model.target.vocab_size
    prompt = [v for x in range(V) for v in (40, x, (7 * x + 3) % V)] + [40]
    expected = third_token_marginal(net, prompt, params)
    # The whole context as the drafter's: a window would drop rows of the first request's entry,
    # and a hit cut back to the prompt then prefills the window's rows again (``PromptCache._cut``).
    engine = Engine(model, block_size=3, max_rows=8, prompt_cache=PromptCache(), draft_window=None)
    runs, uids, events = 300, [], {}
    for i in range(runs):
        uids.append(engine.add(prompt, max_tokens=4, temp=params.temp, top_p=params.top_p, seed=10_000 + i))
        acceptance = engine.pending[-1].acceptance
        acceptance.drafter.rates = [0.0] * len(acceptance.drafter.rates)
        for rates in acceptance.copies:
            rates.rates = [1.0] * len(rates.rates)
        if i == 0:
            collect(engine, events)
    assert engine.cached_tokens(uids[-1]) == len(prompt) - 1
    collect(engine, events)
    counts = np.bincount([events[u][2].token for u in uids], minlength=expected.size)
    assert chi_square_p_value(counts, expected) > ALPHA
    stats = [events[u][-1].stats for u in uids]
    # Nearly every row verified copies (a batch whose rows lack one drafts, and merges them in), and some were taken.
    assert sum(s.copy_steps >= 1 for s in stats) > 0.9 * runs and sum(s.copied for s in stats) > 0
    assert engine.stats.ragged_steps > 0
