"""The block policy (fixed and auto, one row or many), the drafter's context window and prompt
reuse: the choices the engine asks the policy for, and losslessness whatever it chooses."""

import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tiny import OracleDrafter, PolicyRow, ScriptedPolicy

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, PromptCache, stream_generate
from dflash_mlx.cache.context import ContextCache
from dflash_mlx.cache.layout import pair_digest
from dflash_mlx import costs as costs_module
from dflash_mlx.costs import Costs, RowCosts, StepCosts, calibrate, costs
from dflash_mlx.copying import Copy
from dflash_mlx.policy import BlockPolicy, Plan, make_policy

# Step cost in units of one plain decoding step, one row.
STEEP = StepCosts({1: RowCosts({1: 1.0, 2: 1.9, 4: 3.7, 8: 7.4, 16: 15.0}, {1: 0.0, 2: 0.3, 16: 0.6})})
FLAT = StepCosts({1: RowCosts({1: 1.0, 16: 1.3}, {1: 0.0, 2: 0.1, 16: 0.15})})
# A step's cost as timed on this CPU after 4k and 8k tokens of context, the context already in it.
AFTER_4K = StepCosts({1: RowCosts({1: 1.0, 2: 1.24, 4: 1.7, 8: 2.4, 16: 3.7}, {1: 0.0, 2: 0.05, 16: 0.1})})
AFTER_8K = StepCosts({1: RowCosts({1: 1.0, 2: 1.32, 4: 1.86, 8: 2.75, 16: 4.37}, {1: 0.0, 2: 0.05, 16: 0.1})})
# After a short prompt: a verify row costs little more than the first (this CPU, a 128-token context).
SHORT = StepCosts({1: RowCosts({1: 1.0, 2: 1.2, 4: 1.35, 8: 1.5, 16: 1.65}, {1: 0.0, 2: 0.05, 16: 0.1})})


def rows(policy: BlockPolicy, n: int = 1, **kwargs) -> list[PolicyRow]:
    return [PolicyRow(policy.acceptance(), **kwargs) for _ in range(n)]


def observe(rows: list[PolicyRow], accepted_fraction: float, steps: int = 40, block: int = 16) -> None:
    for r in rows:
        for _ in range(steps):
            n = round(accepted_fraction * (block - 1))
            r.acceptance.drafter.observe(min(n + 1, block - 1), n)


def sizes(policy: BlockPolicy, rs: list[PolicyRow], steps: int) -> list[int]:
    return [policy.plan(rs).block_size for _ in range(steps)]


def test_steep_cost_and_low_acceptance_decode_plainly():
    policy = BlockPolicy(16, STEEP, probe_every=8)
    rs = rows(policy)
    observe(rs, 0.1)
    planned, expected_plain = [], []
    for _ in range(64):
        expected_plain.append(policy.expects_plain(rs))
        planned.append(policy.plan(rs).block_size)
    # Plain decoding, with a speculative probe now and then to notice recoveries; each probe
    # after which plain decoding still wins doubles the wait for the next.
    assert [i for i, b in enumerate(planned) if b > 1] == [0, 16, 48]
    assert expected_plain == [b == 1 for b in planned]  # the engine starts plain steps early on this
    # A drafter that becomes right again is drafted on its merits, which resets the wait.
    observe(rs, 1.0)
    assert policy.plan(rs).block_size > 1
    observe(rs, 0.0, steps=80)
    assert sizes(policy, rs, 8).count(1) == 7


def test_high_acceptance_uses_large_blocks():
    for table in (FLAT, STEEP):  # even a steep curve pays off when every proposal is accepted
        policy = BlockPolicy(16, table)
        rs = rows(policy)
        observe(rs, 1.0)
        assert policy.plan(rs).block_size == 16 if table is FLAT else policy.plan(rs).block_size > 1


def test_policy_grows_the_block_when_everything_is_accepted():
    # Costs as measured on a CPU: the prior alone makes block 2 look best at first.
    table = StepCosts({1: RowCosts({1: 1.0, 2: 1.0, 4: 2.0, 8: 1.8, 16: 2.6}, {1: 0.0, 2: 0.04, 16: 0.1})})
    policy = BlockPolicy(16, table)
    (r,) = rows(policy)
    planned = []
    for _ in range(20):
        planned.append(policy.plan([r]).block_size)
        r.acceptance.drafter.observe(planned[-1] - 1, planned[-1] - 1)
    assert planned[0] < 16 and planned[-5:] == [16] * 5


def test_policy_recovers_from_an_unlucky_first_step():
    table = StepCosts({1: RowCosts({1: 1.0, 2: 1.2, 4: 1.3, 8: 1.7, 16: 2.0}, {1: 0.0, 2: 0.1, 16: 0.3})})
    policy = BlockPolicy(16, table)
    (r,) = rows(policy)
    r.acceptance.drafter.observe(3, 2)  # rejected at position 2 once...
    planned = []
    for _ in range(20):  # ... but the drafter is really right 8 times in a row, wrong on the 9th
        planned.append(policy.plan([r]).block_size)
        n = min(planned[-1] - 1, 8)
        r.acceptance.drafter.observe(min(n + 1, planned[-1] - 1), n)
    assert planned[-5:] == [9] * 5  # exactly the useful block: 8 proposals and the bonus


def test_one_lucky_run_is_explored_one_position_deeper_not_to_the_end():
    """Optimism tests a run one position past the deepest it reached: one run of five accepted
    copies does not buy a 16-row block at what verify rows cost after a long context here."""
    policy = BlockPolicy(16, AFTER_4K)
    (r,) = rows(policy, copy=Copy(list(range(15)), match=4))
    r.acceptance.copy_rates(r.copy).observe(5, 5)
    plan = policy.plan([r])
    assert not plan.draft and 1 < plan.block_size <= 8


def test_a_seldom_right_copy_source_is_not_bet_long_blocks_on():
    """A source right about one time in six, for a few tokens each time, has few observations past
    its first position, all from its hits: its optimism shrinks with its runs, so after a hit it is
    tried on short blocks, not on long ones at what verify rows cost after 8k tokens here."""
    policy = BlockPolicy(16, AFTER_8K)
    (r,) = rows(policy, copy=Copy(list(range(15)), match=2))
    observe([r], 0.0, steps=20)
    rates, runs, planned = r.acceptance.copy_rates(r.copy), iter([2, 5, 3, 6, 4, 2, 5]), []
    for i in range(42):
        n = next(runs) if i % 6 == 0 else 0
        rates.observe(n + 1, n)
        planned.append(policy.plan([r]).block_size)
    assert max(planned[12:]) <= 3 and planned.count(1) > 20


def test_a_source_right_half_the_time_is_tried_again_after_a_few_misses():
    """The drafter's run rates are EMAs remembering about (1 + decay) / (1 - decay) runs, so its
    optimism never shrinks below what that many runs are worth, however many there were: a drafter
    right half the time for a hundred steps, then wrong four times running, is tried again, not
    left idle while the text turns predictable again (copy classes keep the shrinking bonus)."""
    policy = BlockPolicy(8, SHORT)
    (r,) = rows(policy)
    for i in range(100):
        r.acceptance.drafter.observe(2 - i % 2, 1 - i % 2)
    for _ in range(4):
        r.acceptance.drafter.observe(1, 0)
    assert all(policy.plan([r]).draft for _ in range(5))


def test_more_rows_take_smaller_blocks():
    """With the verify cost growing in rows x block, more rows mean a smaller block."""
    table = StepCosts({
        1: RowCosts({1: 1.0, 4: 1.05, 8: 1.1}, {1: 0.0, 8: 0.05}),  # one row: nearly flat
        8: RowCosts({1: 8.0, 2: 8.8, 4: 12.0, 8: 24.0}, {1: 0.0, 8: 0.8}),  # 8 rows: compute-bound
    })
    # Every row accepts each proposal with probability 0.8 (no optimism: the rates as they are).
    policy = BlockPolicy(8, table, prior=0.8, optimism=0.0)
    assert policy.plan(rows(policy, 1)).block_size == 8
    assert policy.plan(rows(policy, 8)).block_size == 4
    assert policy.plan(rows(policy, 4)).block_size in (4, 5, 6)  # interpolated between 1 and 8 rows


def test_a_drafted_step_is_valued_as_the_tree_it_becomes():
    """Where steps grow draft trees, a drafted step is worth what the row's recent trees were
    (``Acceptance.grew``), at the price of a tree's nodes and the drafter's whole block, not what
    its top chain alone would accept."""
    policy = BlockPolicy(8, SHORT, probe_every=1000, optimism=0.0)
    rs = rows(policy)
    observe(rs, 0.0, block=8)  # the top chain keeps missing
    assert not policy.plan(rs).plain  # the first plain step probes
    assert policy.plan(rs).plain and policy.plan(rs, trees=True).plain
    # Its trees found the target's token off the top chain: 1.75 tokens with 7 nodes, 2 with 8.
    rs[0].acceptance.grew(np.minimum(np.arange(16) * 0.25, 2.0))
    plan = policy.plan(rs, trees=True)
    assert plan == Plan(9, True, tree=True)  # (1 + 2) / (1.5 + 0.07) beats (1 + 1.75) / 1.5 and plain's 1 / 1
    assert policy.plan(rs).plain  # a chain is still worth a chain
    assert policy.step_seconds(rs, plan) == pytest.approx(SHORT.step_seconds(1, 9, False, 128)
                                                          + SHORT.step_seconds(1, 8, True, 128) - SHORT.step_seconds(1, 8, False, 128))
    # Trees that are worth less than the chain leave the chain's value.
    rs[0].acceptance.grew(np.zeros(16))
    observe(rs, 1.0, block=8)
    assert policy.plan(rs, trees=True).block_size >= 8


def test_a_closed_batch_drafts_for_its_slowest_row():
    """With requests waiting, a row that finishes sooner frees its place for one: a plan is worth
    every row's tokens. A batch with none waiting ends when its slowest row does: one row the
    drafter cannot predict makes it decode plainly, unless that row is about to end anyway."""
    row_costs = RowCosts({1: 1.0, 2: 1.2}, {1: 0.0, 2: 0.05})
    policy = BlockPolicy(2, StepCosts({1: row_costs, 8: row_costs}), prior=0.6, optimism=0.0,
                         timed=False)
    rs = rows(policy, 8)
    for _ in range(20):  # the drafter keeps missing this row's first proposal
        rs[0].acceptance.drafter.observe(1, 0)
    assert policy.plan(rs, waiting=True).block_size == 2  # 8 + 7 x 0.6 tokens for 1.25 s against 8 for 1 s
    assert policy.plan(rs).block_size == 1  # the slowest row gains nothing from a block of 2
    rs[0].room = 1
    assert policy.plan(rs).block_size == 2  # it ends next step: the others are the slowest now


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("table", [FLAT, STEEP], ids=["flat", "steep"])
def test_one_row_plans_alike_with_or_without_requests_waiting(fraction, table):
    """A single request is its own slowest row: both values rank its plans alike."""

    def planned(waiting: bool) -> list:
        policy = BlockPolicy(16, table, probe_every=4)
        rs = rows(policy, room=40)
        observe(rs, fraction)
        return [policy.plan(rs, waiting=waiting) for _ in range(12)]

    assert planned(waiting=False) == planned(waiting=True)


def test_a_long_context_takes_smaller_blocks():
    """A verify row's cost grows with the keys it attends to: the same acceptance buys a large block
    after a short prompt and a small one (or none) after a long one."""
    table = StepCosts({1: RowCosts({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}, {1: 0.0, 8: 0.1})},  # per context token:
                      {costs_module.SHORT_CONTEXT: {1: 0.0001, 2: 0.0004, 4: 0.001, 8: 0.0025}})
    policy = BlockPolicy(8, table, prior=0.6, optimism=0.0)
    short, long = policy.plan(rows(policy)).block_size, policy.plan(rows(policy, context=4096)).block_size
    assert short >= 4 and long < short


def test_timed_policy_follows_observed_step_times():
    """A calibration that has 8 rows' blocks of 2 cheap: once they are seen at 1.35x its figure,
    plain steps (untried, so taken as calibrated) win; a run of plain steps that started each
    next forward early is timed as a whole; a step after rows joined or left is not timed; one row
    is never timed."""
    table = StepCosts({1: RowCosts({1: 1.0, 2: 1.05}, {1: 0.0, 2: 0.05}),
                       8: RowCosts({1: 1.0, 2: 1.05}, {1: 0.0, 2: 0.05})})
    policy = BlockPolicy(2, table, prior=0.25, optimism=0.0)
    rs = rows(policy, 8)
    assert policy.plan(rs).block_size == 2  # 1.25 tokens per row for 1.1 s against 1 for 1.0 s
    two, one = policy.plan(rs), type(policy.plan(rs))(1, False)
    policy.observe(rs, two, 9.0)  # the first step after the rows joined: not timed
    assert policy.drift.ratios == {}
    policy.observe(rs, two, 1.1 * 1.35)
    assert policy.drift.ratios[2] == pytest.approx(1.35) and policy.plan(rs).block_size == 1
    for seconds, ahead in [(2.0, True), (1.0, True), (0.0, False)]:  # each waits for the next forward
        policy.observe(rs, one, seconds, ahead)
    assert policy.drift.ratios[1] == pytest.approx(1.0)
    policy.observe(rs[:7], one, 5.0)  # a row left: its cache was filtered in this step
    policy.observe(rs[:1], one, 5.0)  # one row: not timed
    assert policy.drift.ratios[1] == pytest.approx(1.0)


def test_a_step_whose_anchors_ran_ahead_pays_a_second_forward_for_its_proposals():
    """With plain steps expected, the engine runs a step's anchors with the step before; a copy
    that turns up since is verified in a second forward. A copy worth a block from scratch is then
    worth it only if it goes far, and the step is timed against both forwards."""
    row_costs = RowCosts({1: 1.0, 2: 1.1, 8: 1.4, 16: 2.0}, {1: 0.0, 2: 0.1, 8: 0.2})
    policy = BlockPolicy(8, StepCosts({1: row_costs, 8: row_costs}), optimism=0.0)
    for n in (1, 8):
        rs = rows(policy, n, copy=Copy(list(range(7)), match=4))
        for r in rs:
            for _ in range(20):  # the drafter misses; copies are taken at their prior, 0.5 a token
                r.acceptance.drafter.observe(1, 0)
        assert not policy.plan(rs).plain  # 1.99 tokens per row for 1.4 s against 1 for 1 s
        assert policy.plan(rs, head_start=True).plain  # 1.99 for 1 + 1.35 s
        for r in rs:
            for _ in range(20):
                r.acceptance.copy_rates(r.copy).observe(7, 7)
        assert policy.plan(rs, head_start=True) == Plan(8, False)  # 8 tokens for 2.35 s
    policy.observe(rs, Plan(8, False), 5.0)  # 8 rows: timed from the next step on
    policy.observe(rs, Plan(8, False), 2.35, head_start=True)
    assert policy.drift.ratios[8] == pytest.approx(1.0)


def test_step_costs_interpolate():
    assert STEEP.step_seconds(1, 1) == 1.0
    assert STEEP.step_seconds(1, 3) == pytest.approx((1.9 + 3.7) / 2 + 0.3 + 0.3 / 14)
    assert STEEP.step_seconds(1, 16) == pytest.approx(15.6)
    assert STEEP.step_seconds(1, 16, draft=False) == pytest.approx(15.0)


def test_a_calibration_figure_is_moved_by_no_single_round():
    plain = [1.0, 1.0, 1.6, 1.0, 1.0, 0.9, 1.0]  # round 3 slowed as a whole, round 6 ran fast
    eight = [1.5, 1.5, 2.4, 1.2, 1.5, 1.35, 3.0]  # and one lucky and one busy timing of its own
    assert costs_module.typical(eight, plain) == pytest.approx(1.5)
    assert min(eight) / min(plain) != pytest.approx(1.5)  # what the fastest round of each said
    with pytest.raises(ValueError):  # a timing from another number of rounds is a bug
        costs_module.typical(eight[:-1], plain)


def test_a_larger_block_never_gets_a_gentler_context_slope():
    contexts = (128, 4096, 8192)
    short = RowCosts({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0}, {1: 0.0, 8: 0.1})
    # The 2-row step timed faster after 4k tokens than the 1-row one: noise.
    slopes = {1: 0.4, 2: 0.3, 4: 0.8, 8: 0.6}
    at_4k = RowCosts({b: t + slopes[b] * 3968 for b, t in short.verify.items()}, short.draft)
    at_8k = RowCosts({b: t + 2 * slopes[b] * 4096 for b, t in at_4k.verify.items()}, short.draft)
    per_key = costs_module.context_slopes(contexts, [short, at_4k, at_8k])
    assert per_key == {128: pytest.approx({1: 0.4, 2: 0.4, 4: 0.8, 8: 0.8}),
                       4096: pytest.approx({1: 0.8, 2: 0.8, 4: 1.6, 8: 1.6})}
    table = StepCosts({1: short}, per_key)
    assert table.step_seconds(1, 2, False, 8192) > table.step_seconds(1, 1, False, 8192)


def test_step_costs_follow_each_stretch_of_context_timed():
    """Priced linearly between the contexts timed and past the last along the last stretch: a
    verify that grows faster after 4k tokens is priced at 8k as timed there, not along the line
    through 128 and 4k."""
    table = StepCosts({1: RowCosts({1: 1.0, 2: 1.1}, {1: 0.0, 2: 0.05})},
                      {128: {1: 1e-4, 2: 1.5e-4}, 4096: {1: 1e-4, 2: 2e-4}})
    assert table.step_seconds(1, 2, False, 64) == pytest.approx(1.1)
    assert table.step_seconds(1, 2, False, 4096) == pytest.approx(1.1 + 3968 * 1.5e-4)
    assert table.step_seconds(1, 2, False, 8192) == pytest.approx(1.1 + 3968 * 1.5e-4 + 4096 * 2e-4)
    assert table.step_seconds(2, 1, False, 12288) == pytest.approx(1.0 + 2 * (3968 + 8192) * 1e-4)


def test_context_cache_keeps_start_and_recent_rows():
    cache = ContextCache(keep=2, recent=5)
    rows_ = lambda a, b: mx.arange(a, b, dtype=mx.float32).reshape(1, 1, -1, 1)  # noqa: E731
    pos = 0
    for n in (3, 1, 4, 2, 6, 1):  # context rows per step, then a 4-row block trimmed off
        k, _ = cache.update_and_fetch(rows_(pos, pos + n + 4), rows_(pos, pos + n + 4))
        assert k.shape[2] <= 2 + 5 + n + 4
        cache.trim(4)
        pos += n
        stored = cache.keys[0, 0, : cache.lengths[0], 0].tolist()
        assert cache.positions == [pos] and cache.offset == pos
        assert stored == [0, 1] + list(range(max(2, pos - 5), pos))
    # A shorter shared prefix on the next turn: the rows before it.
    taken = cache.take(0, pos - 3)
    assert taken.positions == [pos - 3] and taken.keys[0, 0, : taken.lengths[0], 0].tolist() == [0, 1, 12, 13]
    taken = cache.take(0, 4)  # past the stored tail: only start rows survive
    assert taken.positions == [4] and taken.keys[0, 0, : taken.lengths[0], 0].tolist() == [0, 1]


@pytest.fixture(scope="module")
def setup(tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model.target.model, max_tokens=40)]
    return model, tokenizer, prompt, ref


def tokens(model, tokenizer, prompt, n=40, **kwargs):
    responses = list(stream_generate(model, tokenizer, prompt, n, **kwargs))
    return [r.token for r in responses], responses[-1].stats


def test_calibration_times_every_block_size_and_rows_once(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(costs_module, "calibration_dir", lambda: tmp_path)  # none kept yet
    model = DFlashModel(setup[0].target, setup[0].drafter)
    table, longer = calibrate(model, max_block_size=8, contexts=(32, 64), repeats=1)
    # Verify timed up to the largest copy-only block, the drafter up to its block.
    assert sorted(table.verify) == [1, 2, 4, 8, 12, 16] and all(t > 0 for t in table.verify.values())
    assert table.draft[1] == 0 and all(table.draft[b] > 0 for b in (2, 4, 8))
    assert sorted(longer.verify) == sorted(table.verify)  # and again after a longer context
    pair_costs = costs(model)
    assert costs(model) is pair_costs and set(pair_costs.table.rows) == {1}
    assert set(pair_costs.ready(3).rows) == {1, 2, 4}  # the row counts a step of 3 rows needs
    for B in (1, 2, 4):  # more rows never cost less
        assert 0 < pair_costs.table.step_seconds(1, B) <= pair_costs.table.step_seconds(2, B) <= pair_costs.table.step_seconds(4, B)
    # Another pair object over the same models is calibrated on its own.
    assert costs(DFlashModel(model.target, model.drafter)) is not pair_costs
    assert isinstance(make_policy(model, "auto").costs, Costs)


@pytest.fixture
def kept(setup, tmp_path, monkeypatch):
    """A calibration folder of its own and a stand-in for the timing (what is kept is under test,
    not the timing): returns (pair, folder, calls), calls counting calibrations."""
    calls = []

    def calibrate(model, rows=1, use_metal=None, contexts=(costs_module.SHORT_CONTEXT,), **_):
        calls.append(rows)
        sizes = costs_module.timed_sizes(model.block_size)
        return [RowCosts({b: 1e-3 * b * rows * (1 + c / 1e3) for b in sizes},
                         {b: 1e-4 * b * rows for b in sizes if b <= model.block_size}) for c in contexts]

    monkeypatch.setattr(costs_module, "calibrate", calibrate)
    monkeypatch.setattr(costs_module, "calibration_dir", lambda: tmp_path / "calibration")
    return DFlashModel(setup[0].target, setup[0].drafter), tmp_path / "calibration", calls


def test_a_calibration_is_kept_for_the_next_process(kept, monkeypatch):
    model, folder, calls = kept
    first = Costs(model)
    assert first.source.startswith("measured in") and f"kept in {first.path}" in first.source
    assert first.path.parent == folder and calls == [1]
    first.ready(2)  # row counts timed later are kept too
    assert calls == [1, 2] and first.source.endswith("; 2 rows measured in 0.0 s")
    # The next process: a new pair object over the same weights reads the file and times nothing.
    again = Costs(DFlashModel(model.target, model.drafter))
    assert again.source == f"read from {first.path}" and calls == [1, 2]
    assert again.table == first.table and set(again.table.rows) == {1, 2}
    again.ready(4)
    assert calls == [1, 2, 4] and set(Costs(model).table.rows) == {1, 2, 4}
    # Another machine (or kernel path, or version) has a key of its own: measured anew, both kept.
    monkeypatch.setattr(costs_module, "_machine", lambda use_metal: {"machine": "another"})
    other = Costs(model)
    assert other.source.startswith("measured in") and other.path != first.path and calls == [1, 2, 4, 1]
    assert len(list(folder.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "not json", "another key", "another format", "NaN", "negative",
                                    "no single row", "other block sizes", "a list"])
def test_a_damaged_or_foreign_calibration_is_skipped_and_replaced(kept, damage, caplog):
    import json

    model, folder, calls = kept
    path = Costs(model).path
    text = path.read_text()
    data = json.loads(text)
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "not json":
        text = "\x00\x01 garbage"
    else:
        if damage == "another key":
            data["key"] = "0" * 64
        elif damage == "another format":
            data["format"] = "dflash-mlx step costs 0"
        elif damage in ("NaN", "negative"):
            data["rows"]["1"]["verify"]["2"] = float("nan") if damage == "NaN" else -1.0
        elif damage == "no single row":
            data["rows"] = {"2": data["rows"]["1"]}
        elif damage == "other block sizes":
            del data["rows"]["1"]["verify"]["4"]
        else:
            data = [data]
        text = json.dumps(data)
    path.write_text(text)
    with caplog.at_level("WARNING", logger="dflash_mlx.costs"):
        fresh = Costs(DFlashModel(model.target, model.drafter))
    assert calls == [1, 1] and fresh.source.startswith("measured in")  # not loaded: timed again
    assert "skipping the step costs in" in caplog.text and str(path) in caplog.text
    assert Costs(model).source == f"read from {path}" and calls == [1, 1]  # and replaced by a sound one


def test_a_calibration_that_cannot_be_kept_says_so(kept, tmp_path, monkeypatch):
    model, _, calls = kept
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(costs_module, "calibration_dir", lambda: tmp_path / "a file" / "calibration")
    table = Costs(model)
    assert table.source.startswith("measured in") and "not kept (could not write" in table.source
    assert table.ready(2).rows.keys() == {1, 2} and calls == [1, 2]


def test_the_stats_say_where_step_costs_and_prefill_chunks_came_from(tiny_pair, capsys, tmp_path, monkeypatch):
    from dflash_mlx.cli import main

    target, draft = tiny_pair("qwen3")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    said = []
    for _ in range(2):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", str(target), "--draft", str(draft), "--prompt", "Hello there",
                  "--max-tokens", "8", "--block-size", "auto"])
            raise SystemExit(0)
        out = capsys.readouterr().out
        assert exit_info.value.code == 0
        said.append([next(line for line in out.splitlines() if line.startswith(what))
                     for what in ("Step costs:", "Prefill chunks:")])
    kept_files = set((tmp_path / "calibration").glob("*.json"))
    for (first, again), what in zip(zip(*said), ("Step costs: ", "Prefill chunks: ")):
        (path,) = [p for p in kept_files if f"kept in {p}" in first]
        assert first.startswith(what) and "measured in" in first
        assert again.startswith(what) and again.endswith(f"read from {path})" if "chunks" in what else f"read from {path}")
    assert len(kept_files) == 2


class ClockedTarget:
    """A target whose prefill forward of n tokens advances ``clock`` by ``cost(n)`` seconds."""

    vocab_size = 100

    def __init__(self, cost):
        self.cost, self.clock, self.forwards = cost, [0.0], []

    def make_cache(self, rows):
        return []

    def prefill_rows(self, caches, chunks):
        n = len(chunks[0])
        self.forwards.append(n)
        self.clock[0] += self.cost(n)
        return [(mx.zeros((1, 4)), mx.zeros((1, n, 2)))]


@pytest.mark.parametrize("shape", ["cpu-like", "gpu-like"])
def test_prefill_chunks_are_timed_up_to_where_they_grow_dear(shape, monkeypatch):
    # cpu-like: masked attention grows a token's cost with the chunk; gpu-like: a forward's fixed
    # cost (the weights) spread over more tokens, a little attention growth after.
    cost = (lambda n: n * (1 + n / 1024)) if shape == "cpu-like" else (lambda n: 300 + n * (1 + n / 8192))
    target = ClockedTarget(cost)
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: target.clock[0])
    timed = costs_module.time_prefill_chunks(type("Pair", (), {"target": target})())
    per_token = {n: cost(n) / n for n in timed}
    assert timed == per_token
    if shape == "cpu-like":  # 128: 1.125, 256: 1.25, 512: 1.5 (over 1.25x the best: timing stops)
        assert list(timed) == [128, 256, 512]
        assert target.forwards == [128, 128, 256, 512, 128, 256]  # warm-up, a round, those that may still win
    else:
        assert list(timed) == list(costs_module.PREFILL_CHUNKS)
        assert target.forwards[-1] == 2048 and target.forwards.count(2048) == 2


@pytest.mark.parametrize("damage", [None, "truncated", "another key", "negative", "other sizes", "a list"])
def test_prefill_chunks_are_chosen_kept_and_read(setup, damage, tmp_path, monkeypatch, caplog):
    import json

    calls = []
    table = {128: 1.0e-3, 256: 1.08e-3, 512: 1.3e-3}  # 256 is within 10% of the best: fewer forwards

    def timed(model):
        calls.append(model)
        return dict(table)

    monkeypatch.setattr(costs_module, "time_prefill_chunks", timed)
    monkeypatch.setattr(costs_module, "calibration_dir", lambda: tmp_path)
    model = DFlashModel(setup[0].target, setup[0].drafter)
    first = costs_module.PrefillChunks(model)
    assert first.size == 256 and calls == [model] and first.source.endswith(f"kept in {first.path}")
    assert first.describe().startswith("256 tokens (ms per token by chunk size 128: 1, 256: 1.08, 512: 1.3;")
    if damage:
        data = json.loads(first.path.read_text())
        text = {"truncated": first.path.read_text()[:20], "another key": json.dumps({**data, "key": "0" * 64}),
                "negative": json.dumps({**data, "per_token": {"128": -1.0}}),
                "other sizes": json.dumps({**data, "per_token": {"100": 1.0}}), "a list": json.dumps([data])}[damage]
        first.path.write_text(text)
    with caplog.at_level("WARNING", logger="dflash_mlx.costs"):
        again = costs_module.PrefillChunks(DFlashModel(model.target, model.drafter))
    assert again.size == 256 and again.per_token == table
    if damage:
        assert len(calls) == 2 and again.source.startswith("measured in")  # skipped, timed again
        assert "skipping the prefill timings in" in caplog.text
        assert costs_module.PrefillChunks(model).source == f"read from {first.path}"  # and replaced
    else:
        assert len(calls) == 1 and again.source == f"read from {first.path}"
        # Kept for the target alone: a pair with another drafter over it reads them too.
        changed = type(model.drafter)(model.drafter.args)
        assert pair_digest(DFlashModel(model.target, changed)) != pair_digest(model)
        assert costs_module.PrefillChunks(DFlashModel(model.target, changed)).source == f"read from {first.path}"
        assert len(calls) == 1


def test_an_engine_prefills_in_the_measured_chunks_unless_given_a_size(setup, tmp_path, monkeypatch):
    from dflash_mlx.target import Target

    model, tokenizer, prompt, ref = setup
    long_prompt = prompt * 8  # over 300 tokens: several 128-token chunks
    monkeypatch.setattr(costs_module, "calibration_dir", lambda: tmp_path / "first")
    monkeypatch.setattr(costs_module, "_chunks", weakref.WeakKeyDictionary())  # this target's, timed anew
    monkeypatch.setattr(costs_module, "time_prefill_chunks", lambda model: {128: 1e-3, 256: 2e-3})
    chunks, prefill_rows = [], Target.prefill_rows
    monkeypatch.setattr(Target, "prefill_rows", lambda self, caches, rows: (
        chunks.append([len(r) for r in rows]), prefill_rows(self, caches, rows))[1])
    pair = DFlashModel(model.target, model.drafter)
    expected = [int(t) for t, _ in generate_step(mx.array(long_prompt), model.target.model, max_tokens=12)]
    for given, size in ((None, 128), (200, 200)):
        out, stats = tokens(pair, tokenizer, long_prompt, 12, block_size=4, prefill_step_size=given)
        assert out == expected
        assert max(map(max, chunks)) == size and sum(map(sum, chunks)) == len(long_prompt)
        assert stats.prefill.startswith(f"{size} tokens (") and stats.prefill.endswith("(given)" if given else ")")
        chunks.clear()
    # Requests sharing a forward take a measured chunk each (the forward holds up to PREFILL_STEP_SIZE).
    engine = Engine(pair, block_size=4, max_rows=2)
    uids = [engine.add(p, max_tokens=12) for p in (long_prompt, long_prompt[5:])]
    out = []
    while not engine.idle:
        out += [e.token for e in engine.step() if e.uid == uids[0]]
    assert out == expected and chunks[0] == [128, 128]


@pytest.mark.parametrize("device", ["gpu-like", "cpu-like"])
def test_running_ahead_is_kept_only_where_the_forward_runs_on_after_async_eval(device, monkeypatch):
    """Overlap times a pair's first runs ahead to their end: where async_eval hands the work over at
    once (a GPU queue) running ahead stays on; where it returns only as the work ends (MLX's CPU
    backend) it is turned off, and says why."""
    import time

    work = 0.2  # long against a loaded machine's scheduling delays (at 0.02 s a busy CPU failed it)
    # The time async_eval blocks and the time left after it, per device.
    blocked, left = (0.0, work) if device == "gpu-like" else (work, 0.0)
    monkeypatch.setattr(costs_module.mx, "async_eval", lambda *a: time.sleep(blocked))
    monkeypatch.setattr(costs_module.mx, "eval", lambda *a: time.sleep(left))
    overlap = costs_module.Overlap()
    for _ in range(costs_module.OVERLAP_SAMPLES):
        assert overlap.frees_host and overlap.describe() == "on (its payoff not measured yet)"
        overlap.start([])
    assert overlap.frees_host == (device == "gpu-like")
    assert all(share > 0.9 if device == "gpu-like" else share < 0.1 for share in overlap.shares)
    said = overlap.describe()
    assert said.startswith("on (") if device == "gpu-like" else said.startswith("off (") and "not free the host" in said
    overlap.start([])  # measured: no more waiting
    assert len(overlap.shares) == costs_module.OVERLAP_SAMPLES


def test_plain_steps_run_ahead_only_where_it_frees_the_host(setup):
    model, tokenizer, prompt, ref = setup
    model = DFlashModel(model.target, model.drafter)
    for measured, expected in ((0.9, "on (90%"), (0.1, "off (10%")):
        policy = make_policy(model, 1)
        policy.overlap.shares = [measured] * costs_module.OVERLAP_SAMPLES
        engine = Engine(model, block_size=policy)
        uid, ahead = engine.add(prompt, max_tokens=24), []
        events = []
        while not engine.idle:
            events += engine.step()
            ahead.append(engine.ahead is not None)
        assert [e.token for e in events] == ref[:24]  # lossless either way
        assert any(ahead) == (measured > 0.5)
        assert events[-1].stats.run_ahead.startswith(expected) and uid == events[-1].uid
    assert policy.overlap is make_policy(model, "auto").overlap  # measured once per pair


def test_a_stretched_cache_attends_like_a_context_that_long(setup):
    """Calibration times long contexts on a short one's keys repeated: the verify after it must
    see as many keys, at the positions a real context that long would give it."""
    target = setup[0].target
    tokens = mx.arange(40, dtype=mx.int32)[None] % 50
    stretched, real = target.make_cache(), target.make_cache()
    target(tokens[:, :8], stretched)
    target.stretch(stretched, 30)
    target(tokens[:, :30], real)
    assert target.lengths(stretched) == target.lengths(real) == [30]
    ragged = [c for c in stretched if hasattr(c, "stretch")]
    assert ragged and all(c.keys.shape[2] == 30 for c in ragged)
    k = ragged[0].keys
    assert mx.array_equal(k[..., 8:16, :], k[..., :8, :]) and mx.array_equal(k[..., 24:30, :], k[..., :6, :])
    # The next forward continues at position 30 on both, with a mask over all 30 + 4 keys.
    for cache in (stretched, real):
        logits, _ = target(tokens[:, 30:34], cache)
        assert logits.shape[1] == 4 and target.lengths(cache) == [34]
        target.rollback(cache, 4)
        assert target.lengths(cache) == [30]


@pytest.mark.parametrize("drafter", ["random", "oracle"])
@pytest.mark.parametrize("table", ["steep", "flat", "measured"])
def test_adaptive_greedy_equals_mlx_lm(setup, drafter, table):
    model, tokenizer, prompt, ref = setup
    d = OracleDrafter(model.drafter, prompt + ref, wrong_every=7) if drafter == "oracle" else model.drafter
    pair = DFlashModel(model.target, d)
    # Fake tables stand as measured; "measured" is what block_size="auto" does.
    policy = {"steep": BlockPolicy(16, STEEP), "flat": BlockPolicy(16, FLAT)}.get(table, "auto")
    out, stats = tokens(pair, tokenizer, prompt, block_size=policy)
    assert out == ref[: len(out)]
    assert stats.adaptive and len(stats.block_sizes) == len(stats.acceptance_lengths)
    if table == "steep" and drafter == "random":
        assert stats.block_sizes.count(1) > 0.5 * len(stats.block_sizes)  # speculation does not pay: mostly plain
    if table == "flat" and drafter == "oracle":
        assert stats.speculative and stats.tau > 3


@pytest.mark.parametrize("window", [(0, 8), (4, 16)])
@pytest.mark.parametrize("block_size", [4, 16, "auto"])
def test_drafter_window_greedy_equals_mlx_lm(setup, window, block_size):
    model, tokenizer, prompt, ref = setup
    oracle = DFlashModel(model.target, OracleDrafter(model.drafter, prompt + ref, wrong_every=5))
    if block_size == "auto":
        block_size = BlockPolicy(16, FLAT)
    out, stats = tokens(oracle, tokenizer, prompt, block_size=block_size, draft_window=window, prefill_step_size=16)
    assert out == ref[: len(out)]
    assert stats.tau > 2  # absolute positions survive the window: the oracle still lines up


def test_prompt_cache_reuse_equals_a_fresh_run(setup):
    model, tokenizer, prompt, ref = setup
    cache = PromptCache()
    first, _ = tokens(model, tokenizer, prompt, 20, prompt_cache=cache, draft_window=(4, 32))
    follow = prompt + first + tokenizer.encode(" Again:")
    fresh, _ = tokens(model, tokenizer, follow, 30)
    engine = Engine(model, prompt_cache=cache, draft_window=(4, 32))
    uid = engine.add(follow, max_tokens=30)
    assert engine.cached_tokens(uid) == len(prompt) + len(first) - 1
    reused, _ = tokens(model, tokenizer, follow, 30, prompt_cache=cache, draft_window=(4, 32))
    assert reused == fresh
    # A different conversation through the same cache: cut to the shared prefix.
    other = tokenizer.encode("Something else entirely")
    assert tokens(model, tokenizer, other, 20, prompt_cache=cache)[0] == tokens(model, tokenizer, other, 20)[0]


def test_a_prompt_sent_again_drafts_as_a_fresh_prefill_does(setup):
    """The same prompt again hits the entry of prompt + reply, cut back to the prompt. Its windowed
    drafter context dropped rows while the reply grew, so the cut goes back by the window too and
    prefills it again: the drafter sees what a fresh prefill leaves."""
    model, tokenizer, prompt, ref = setup
    window, kwargs = (4, 8), {"block_size": 4, "copy_proposals": False}
    fresh_out, fresh = tokens(model, tokenizer, prompt, 30, draft_window=window, **kwargs)
    cache = PromptCache()
    tokens(model, tokenizer, prompt, 30, draft_window=window, prompt_cache=cache, **kwargs)
    (entry,) = cache.entries.values()
    assert not all(c.holds_window(0, len(prompt) - 1) for c in entry.draft_cache)  # rows were dropped
    engine = Engine(model, prompt_cache=cache, draft_window=window)
    assert engine.cached_tokens(engine.add(prompt, max_tokens=30)) == len(prompt) - 1 - window[1]
    again_out, again = tokens(model, tokenizer, prompt, 30, draft_window=window, prompt_cache=cache, **kwargs)
    assert again_out == fresh_out == ref[:30] and again.acceptance_lengths == fresh.acceptance_lengths
    # A prompt sharing fewer tokens than the window's recent rows has nothing left to reuse: a miss.
    hits, misses = cache.ram_hits, cache.misses
    engine = Engine(model, prompt_cache=cache, draft_window=window)
    assert engine.cached_tokens(engine.add(prompt[:6] + [7] * 20, max_tokens=4)) == 0
    assert (cache.ram_hits, cache.misses) == (hits, misses + 1)
    # Unwindowed, nothing is dropped: the cut stays at the prompt.
    whole = PromptCache()
    tokens(model, tokenizer, prompt, 30, draft_window=None, prompt_cache=whole, **kwargs)
    engine = Engine(model, prompt_cache=whole, draft_window=None)
    assert engine.cached_tokens(engine.add(prompt, max_tokens=30)) == len(prompt) - 1


def test_a_generation_stopped_while_running_ahead_leaves_a_reusable_cache(setup):
    model, tokenizer, prompt, ref = setup
    cache, first = PromptCache(), []
    for response in stream_generate(model, tokenizer, prompt, 40, block_size=ScriptedPolicy([3, 1, 1]),
                                    prompt_cache=cache):
        first.append(response.token)
        if len(response.stats.block_sizes) > 1 and response.stats.block_sizes[-1] == 1 and len(first) >= 10:
            break  # the caller stops with the next anchor's forward started
    assert first == ref[: len(first)] and cache.entries
    follow = prompt + first + tokenizer.encode(" Again:")
    assert tokens(model, tokenizer, follow, 30, prompt_cache=cache)[0] == tokens(model, tokenizer, follow, 30)[0]


def test_a_policy_object_can_be_passed_as_block_size(setup):
    model, tokenizer, prompt, ref = setup
    policy = make_policy(model, "auto", probe_every=2)
    out, stats = tokens(model, tokenizer, prompt, block_size=policy)
    assert out == ref[: len(out)]
    assert stats.adaptive and stats.block_size == model.block_size and max(stats.block_sizes) <= 16
