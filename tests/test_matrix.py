"""Every path through the one engine, against mlx_lm: a pairwise matrix over

- path: one request alone, or three requests batched (prompts of different lengths, rows that
  accept different counts);
- decoding: greedy, coupled sampling (seeded; its plain reference draws each token from the
  position's own noise, test_coupled.plain_coupled), or an opaque sampler (verified by matching);
- proposals: the drafter's (an oracle that errs now and then), copies (a random drafter, and a
  corpus holding the answers with every 11th token wrong: copies accepted for a while, then not), or
  both;
- target family: qwen3, llama, a hybrid Gated DeltaNet target (qwen3_5) and a sliding-window one
  (gemma3_text);
- drafter architecture: DFlash, DFlash2 (whose sampling is the rejection rule, exact in
  distribution and checked statistically in test_layouts; here it decodes greedily or by matching);
- draft trees: a chain (budget 0), trees of 4 and 16 proposals, auto.

The default run holds a case for every pair of values of any two dimensions (a greedy covering, built
below); ``-m slow`` runs every other valid combination too, the whole product. Each case asserts token
identity with its reference.
"""

import itertools

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_coupled import plain_coupled
from test_hybrid import build as build_hybrid
from tiny import TARGETS, OracleDrafter, drafter_config, layout_config, make_drafter

import dflash_mlx
from dflash_mlx import DFlashModel, Engine
from dflash_mlx.copying import corpus_index
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target import Target

DIMENSIONS = {
    "path": ["single", "batched"],
    "decoding": ["greedy", "coupled", "sampler"],
    "proposals": ["drafter", "copies", "both"],
    "family": ["qwen3", "llama", "qwen3_5", "gemma3_text"],
    "drafter": ["dflash", "dflash2"],
    "tree_budget": [0, 4, 16, "auto"],
}
COUPLED = SamplingParams(temp=0.8, top_p=0.95)
MAX_TOKENS = 20


def valid(case: dict) -> bool:
    # DFlash2 drafters sample with the rejection rule: no per-seed reference (test_layouts checks it).
    return not (case["drafter"] == "dflash2" and case["decoding"] == "coupled")


def product(dimensions: dict) -> list[dict]:
    """Every valid combination of the dimensions' values."""
    cases = (dict(zip(dimensions, values)) for values in itertools.product(*dimensions.values()))
    return [c for c in cases if valid(c)]


def covering(dimensions: dict) -> list[dict]:
    """Cases in which every pair of values of two dimensions occurs: greedily, the valid case that
    covers the most pairs not yet covered, until none is left."""
    names = list(dimensions)
    everything = product(dimensions)

    def pairs(case):
        return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}

    left = set().union(*map(pairs, everything))
    cases = []
    while left:
        best = max(everything, key=lambda c: len(pairs(c) & left))
        cases.append(best)
        left -= pairs(best)
    return cases


CASES = covering(DIMENSIONS)


def case_id(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


PARAMS = [pytest.param(c, id=case_id(c), marks=() if c in CASES else pytest.mark.slow) for c in product(DIMENSIONS)]


@pytest.fixture(scope="module")
def targets(tiny_pair):
    """family -> (mlx_lm model, the drafter config.json for it)."""
    out = {}
    for family in ("qwen3", "llama"):
        model, _ = dflash_mlx.load(*map(str, tiny_pair(family)))
        out[family] = (model.target.model, drafter_config(TARGETS[family]))
    for family in ("qwen3_5", "gemma3_text"):
        model = build_hybrid(family)
        target = Target(model, [0, 2])
        out[family] = (model, drafter_config(dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                                  rope_theta=10000.0, num_hidden_layers=len(target.layers)),
                                             target_layer_ids=[0, 2]))
    return out


def prompts_for(case: dict, vocab: int) -> list[list[int]]:
    base = [[5, 17, 9, 33, 2, 41, 8, 27, 60, 12, 3], [40, 7, 21, 30, 16, 9, 1], [11, 58, 31, 22, 44, 19, 6, 50]]
    prompts = [[t % vocab for t in p] for p in base]
    return prompts if case["path"] == "batched" else prompts[:1]


def reference(model, prompt: list[int], case: dict, seed: int) -> list[int]:
    if case["decoding"] == "coupled":
        return plain_coupled(model, prompt, COUPLED, seed, MAX_TOKENS)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]


@pytest.mark.parametrize("case", PARAMS)
def test_engine_equals_its_reference(targets, case):
    model, config = targets[case["family"]]
    target = Target(model, config["dflash_config"]["target_layer_ids"])
    if case["drafter"] == "dflash2":
        config = layout_config(config, "dflash2")
    mx.random.seed(1)
    drafter = make_drafter(config)
    if case["proposals"] != "copies":
        drafter = OracleDrafter(drafter)
    prompts = prompts_for(case, target.vocab_size)
    refs = [reference(model, prompt, case, 100 + i) for i, prompt in enumerate(prompts)]
    if case["proposals"] != "drafter":
        drafter.corpus = corpus_index([t if j % 11 else (t + 1) % target.vocab_size
                                       for p, r in zip(prompts, refs) for j, t in enumerate(p + r)])
    engine = Engine(DFlashModel(target, drafter), block_size=8, max_rows=3, prefill_step_size=8,
                    copy_proposals=case["proposals"] != "drafter", tree_budget=case["tree_budget"])
    if case["proposals"] != "copies":
        drafter.engine = engine
    expected = {}
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        request = dict(max_tokens=MAX_TOKENS)
        if case["decoding"] == "coupled":
            request.update(temp=COUPLED.temp, top_p=COUPLED.top_p, seed=100 + i)
        elif case["decoding"] == "sampler":
            request.update(sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
        uid = engine.add(prompt, **request)
        expected[uid] = ref
        if case["proposals"] != "copies":
            drafter.refs[uid], drafter.wrong[uid] = prompt + ref, 3 + 2 * i
    out = {uid: [] for uid in expected}
    last = {}
    while not engine.idle:
        for event in engine.step():
            out[event.uid].append(event.token)
            last[event.uid] = event
    for uid, ref in expected.items():
        assert out[uid] == ref, (case, uid)
    stats = [last[uid].stats for uid in expected]
    assert any(s.drafted + s.copied > 0 for s in stats), "nothing was accepted: the case tests no rollback"
    if case["proposals"] == "drafter":
        assert all(s.copied == 0 for s in stats)
    elif case["proposals"] == "copies":  # (with the oracle beside them, a confident draft may win every merge)
        assert any(s.copied for s in stats)
    trees_allowed = case["tree_budget"] != 0 and case["drafter"] == "dflash" and case["decoding"] != "sampler"
    if not trees_allowed:
        assert all(s.tree_steps == 0 and s.trees for s in stats)  # chains, and the stats say why
    if case["path"] == "batched":
        assert engine.stats.batched and max(engine.stats.rows) > 1
