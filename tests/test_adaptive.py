"""Adaptive block size, drafter context window and prefix reuse: choices and losslessness."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from tiny import OracleDrafter, ScriptedPolicy

import dflash_mlx
from dflash_mlx import DFlashModel, stream_generate
from dflash_mlx.adaptive import AdaptiveBlockSize, make_policy
from dflash_mlx.step_costs import CostCurve, calibrate, cost_curve
from dflash_mlx.decode import DecodeCache, speculative_decode
from dflash_mlx.kernels import get_ops
from dflash_mlx.sampling import SamplingParams, make_strategy
from dflash_mlx.cache.window import ContextWindowCache

# Step cost in units of one plain decoding step.
STEEP = CostCurve(verify={1: 1.0, 2: 1.9, 4: 3.7, 8: 7.4, 16: 15.0}, draft={1: 0.0, 2: 0.3, 16: 0.6})
FLAT = CostCurve(verify={1: 1.0, 16: 1.3}, draft={1: 0.0, 2: 0.1, 16: 0.15})


def observe(policy, accepted_fraction, steps=40, block=16):
    for _ in range(steps):
        policy.observe(block, round(accepted_fraction * (block - 1)))


def test_steep_cost_and_low_acceptance_decode_plainly():
    policy = AdaptiveBlockSize(STEEP, 16, probe_every=8)
    observe(policy, 0.1)
    assert policy.best() == 1
    sizes, expected_plain = [], []
    for _ in range(64):
        expected_plain.append(policy.expects_plain())
        sizes.append(policy.next_block_size())
    # Plain decoding, with a speculative probe now and then to notice recoveries; each probe
    # after which plain decoding still wins doubles the wait for the next.
    probes = [i for i, b in enumerate(sizes) if b > 1]
    assert probes == [0, 16, 48]
    assert expected_plain == [b == 1 for b in sizes]  # the loop starts plain steps early on this
    # A drafter that becomes right again is drafted on its merits, which resets the wait.
    observe(policy, 1.0)
    assert policy.next_block_size() > 1
    observe(policy, 0.0, steps=80)
    sizes = [policy.next_block_size() for _ in range(8)]
    assert sizes.count(1) == 7 and sizes[-1] > 1


def test_high_acceptance_uses_large_blocks():
    policy = AdaptiveBlockSize(FLAT, 16)
    observe(policy, 1.0)
    assert policy.best() == 16 and policy.next_block_size() == 16
    # Even a steep curve pays off when every proposal is accepted.
    policy = AdaptiveBlockSize(STEEP, 16)
    observe(policy, 1.0)
    assert policy.best() > 1


def test_policy_grows_the_block_when_everything_is_accepted():
    # Costs measured on this machine: the prior alone makes block 2 look best at first.
    curve = CostCurve(verify={1: 1.0, 2: 1.0, 4: 2.0, 8: 1.8, 16: 2.6}, draft={1: 0.0, 2: 0.04, 16: 0.1})
    policy = AdaptiveBlockSize(curve, 16)
    sizes = []
    for _ in range(20):
        sizes.append(policy.next_block_size())
        policy.observe(sizes[-1], sizes[-1] - 1)
    assert sizes[0] < 16 and sizes[-5:] == [16] * 5


def test_policy_recovers_from_an_unlucky_first_step():
    curve = CostCurve(verify={1: 1.0, 2: 1.2, 4: 1.3, 8: 1.7, 16: 2.0}, draft={1: 0.0, 2: 0.1, 16: 0.3})
    policy = AdaptiveBlockSize(curve, 16)
    policy.observe(policy.next_block_size(), 2)  # rejected at position 2 once...
    sizes = []
    for _ in range(20):  # ... but the drafter is really right 8 times in a row, wrong on the 9th
        sizes.append(policy.next_block_size())
        policy.observe(sizes[-1], min(sizes[-1] - 1, 8))
    assert sizes[-5:] == [9] * 5  # exactly the useful block: 8 proposals and the bonus


def test_acceptance_that_dies_after_a_few_positions_gives_a_small_block():
    policy = AdaptiveBlockSize(FLAT, 16)
    for _ in range(40):
        policy.observe(16, 3)  # always the first three proposals, never the fourth
    assert 2 <= policy.best() <= 5
    assert policy.expected_tokens(16) == pytest.approx(policy.expected_tokens(4), abs=0.1)


def test_observed_step_times_override_the_calibration():
    policy = AdaptiveBlockSize(FLAT, 16, timed=True)
    policy.observe(1, 0, seconds=FLAT.step_seconds(1))
    for _ in range(40):  # an untried size counts as calibrated (no dearer), so each gets one try
        B = policy.next_block_size()
        # Speculation costs 8x what was calibrated (e.g. a long context), plain decoding as measured.
        policy.observe(B, min(B - 1, 2), seconds=FLAT.step_seconds(B) * (8 if B > 1 else 1))
    assert policy.best() == 1
    assert policy.step_seconds(16) > 7 * FLAT.step_seconds(16)


def test_cost_curve_interpolates():
    assert STEEP.step_seconds(1) == 1.0
    assert STEEP.step_seconds(3) == pytest.approx((1.9 + 3.7) / 2 + 0.3 + 0.3 / 14)
    assert STEEP.step_seconds(16) == pytest.approx(15.6)


def test_window_cache_keeps_start_and_recent_rows():
    cache = ContextWindowCache(keep=2, recent=5)
    rows = lambda a, b: mx.arange(a, b, dtype=mx.float32).reshape(1, 1, -1, 1)  # noqa: E731
    pos = 0
    for n in (3, 1, 4, 2, 6, 1):  # context rows per step, then a 4-row block trimmed off
        k, _ = cache.update_and_fetch(rows(pos, pos + n + 4), rows(pos, pos + n + 4))
        assert k.shape[2] <= 2 + 5 + n + 4
        cache.trim(4)
        pos += n
        stored = cache.keys[0, 0, :, 0].tolist()
        assert cache.offset == pos
        assert stored == [0, 1] + list(range(max(2, pos - 5), pos))
    cache.trim(3)  # a shorter shared prefix on the next turn
    assert cache.offset == pos - 3 and cache.keys[0, 0, :, 0].tolist() == [0, 1, 12, 13]
    cache.trim(10)  # past the stored tail: only start rows survive
    assert cache.offset == 4 and cache.keys[0, 0, :, 0].tolist() == [0, 1]


@pytest.fixture(scope="module")
def setup(tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model.target.model, max_tokens=40)]
    return model, tokenizer, prompt, ref


def tokens(model, tokenizer, prompt, n=40, **kwargs):
    responses = list(stream_generate(model, tokenizer, prompt, n, **kwargs))
    return [r.token for r in responses], responses[-1].stats


def test_calibration_measures_every_block_size(setup):
    model = setup[0]
    curve = calibrate(model, max_block_size=8, context=32, repeats=1)
    # Verify timed up to the largest copy-only block, the drafter up to its block.
    assert sorted(curve.verify) == [1, 2, 4, 8, 12, 16] and all(t > 0 for t in curve.verify.values())
    assert curve.draft[1] == 0 and all(curve.draft[b] > 0 for b in (2, 4, 8))


@pytest.mark.parametrize("drafter", ["random", "oracle"])
@pytest.mark.parametrize("curve", ["steep", "flat", "measured"])
def test_adaptive_greedy_equals_mlx_lm(setup, drafter, curve):
    model, tokenizer, prompt, ref = setup
    d = OracleDrafter(model.drafter, prompt + ref, wrong_every=7) if drafter == "oracle" else model.drafter
    pair = DFlashModel(model.target, d)
    # Fake curves stand as measured (untimed policy); "measured" is what --block-size auto does.
    policy = {"steep": AdaptiveBlockSize(STEEP, 16), "flat": AdaptiveBlockSize(FLAT, 16)}.get(curve, "auto")
    out, stats = tokens(pair, tokenizer, prompt, block_size=policy)
    assert out == ref[: len(out)]
    assert stats.adaptive and len(stats.block_sizes) == len(stats.acceptance_lengths)
    if curve == "steep" and drafter == "random":
        assert stats.plain_fraction > 0.5  # speculation does not pay: mostly plain decoding
    if curve == "flat" and drafter == "oracle":
        assert stats.speculative and stats.tau > 3


@pytest.mark.parametrize("window", [(0, 8), (4, 16)])
@pytest.mark.parametrize("block_size", [4, 16, "auto"])
def test_drafter_window_greedy_equals_mlx_lm(setup, window, block_size):
    model, tokenizer, prompt, ref = setup
    oracle = DFlashModel(model.target, OracleDrafter(model.drafter, prompt + ref, wrong_every=5))
    if block_size == "auto":
        block_size = AdaptiveBlockSize(FLAT, 16)
    out, stats = tokens(oracle, tokenizer, prompt, block_size=block_size, draft_window=window)
    assert out == ref[: len(out)]
    assert stats.tau > 2  # absolute positions survive the window: the oracle still lines up


def test_prefix_reuse_equals_fresh_run(setup):
    model, tokenizer, prompt, ref = setup
    cache = DecodeCache.new(model.target, model.drafter, (4, 32))
    first, _ = tokens(model, tokenizer, prompt, 20, prompt_cache=cache)
    assert cache.tokens[: len(prompt)] == prompt
    follow = prompt + first + tokenizer.encode(" Again:")
    fresh, _ = tokens(model, tokenizer, follow, 30)
    assert cache.reuse(follow, model.target) >= len(prompt)
    reused, _ = tokens(model, tokenizer, follow, 30, prompt_cache=cache)
    assert reused == fresh
    # A different conversation through the same cache: trimmed to the shared prefix.
    other = tokenizer.encode("Something else entirely")
    assert tokens(model, tokenizer, other, 20, prompt_cache=cache)[0] == tokens(model, tokenizer, other, 20)[0]


def test_a_turn_stopped_while_running_ahead_leaves_a_reusable_cache(setup):
    model, tokenizer, prompt, ref = setup
    cache = DecodeCache.new(model.target, model.drafter)
    first = []
    greedy = make_strategy(SamplingParams(), None, get_ops())
    for step in speculative_decode(mx.array(prompt), model.target, model.drafter, greedy, max_tokens=40,
                                   block_size=ScriptedPolicy([3, 1, 1]), prompt_cache=cache):
        first += step.tokens
        if step.block_size == 1 and len(first) >= 10:  # the caller stops with the next anchor's
            break  # forward started: the cache holds that anchor already
    assert first == ref[: len(first)] and cache.tokens == prompt + first
    follow = prompt + first + tokenizer.encode(" Again:")
    assert tokens(model, tokenizer, follow, 30, prompt_cache=cache)[0] == tokens(model, tokenizer, follow, 30)[0]


def test_make_policy_calibrates_once(setup):
    model = DFlashModel(setup[0].target, setup[0].drafter)
    policy = make_policy(model, max_block_size=4)
    assert policy.max_block_size == 4
    assert make_policy(model).curve is policy.curve is cost_curve(model)
    # Another pair object over the same models is calibrated on its own.
    assert cost_curve(DFlashModel(model.target, model.drafter)) is not policy.curve


def test_a_policy_object_can_be_passed_as_block_size(setup):
    model, tokenizer, prompt, ref = setup
    policy = make_policy(model, max_block_size=4, timed=True, probe_every=2)
    out, stats = tokens(model, tokenizer, prompt, block_size=policy)
    assert out == ref[: len(out)]
    assert stats.adaptive and stats.block_size == 4 and max(stats.block_sizes) <= 4
