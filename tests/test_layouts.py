"""Released drafter layouts beyond the official oracle: 4-bit conversion, DFlash2 sampling exactness,
DFlash2 through the CLI and the adaptive block size.

Statistical tests use fixed seeds and a chi-square test at significance 1e-3 per assertion
(tests/stats.py): a correct sampler fails one of them at most once in a thousand seeds.
"""

import math

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from stats import ALPHA, chi_square_p_value
from tiny import LAYOUT_PROMPTS, LAYOUTS, decode

from dflash_mlx import PromptCache, stream_generate
from dflash_mlx.cli import main
from dflash_mlx.convert import convert
from dflash_mlx.flags import SEEDED_BLOCK_SIZE
from dflash_mlx.generation import default_block
from dflash_mlx.models import load_drafter
from dflash_mlx.kernels import get_ops, rejection_accept_twin
from dflash_mlx.model import DFlashModel
from dflash_mlx.sampling import Rejection, SamplingParams, probabilities
from dflash_mlx.target import Target

OPS = get_ops(False)


def pair_of(target_dir, draft_dir):
    model, _ = mlx_lm.load(str(target_dir))
    drafter = load_drafter(str(draft_dir))
    return DFlashModel(Target(model, drafter.args.target_layer_ids), drafter)


def greedy_run(pair, tokenizer, block_size=8, max_tokens=40):
    """(tokens, accepted proposals) of greedy DFlash on every layout prompt."""
    tokens, accepted = {}, 0
    for text in LAYOUT_PROMPTS:
        tokens[text], stats = decode(pair, tokenizer.encode(text), max_tokens,  # the drafter's acceptance alone
                                     engine_kwargs=dict(block_size=block_size, copy_proposals=False))
        accepted += stats.drafted
    return tokens, accepted


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_proposals_stay_lossless(released_drafters, layout):
    """Copies merged with every layout's proposals (DFlash2: weighed by its selector's probability)
    leave the greedy output mlx_lm's."""
    target_dir, tokenizer, folders, answers = released_drafters
    pair = pair_of(target_dir, folders[layout])
    copy_steps = 0
    for text in LAYOUT_PROMPTS:
        # An answer longer than the trained one: it falls into a loop, which copies continue.
        prompt, n = tokenizer.encode(text), 96
        reference = [int(t) for t, _ in generate_step(mx.array(prompt), pair.target.model, max_tokens=n)]
        out, stats = decode(pair, prompt, n, engine_kwargs=dict(block_size=8))
        assert out == reference
        copy_steps += stats.copy_steps
    assert copy_steps > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_4bit_conversion_loads_and_keeps_acceptance(released_drafters, layout, tmp_path):
    target_dir, tokenizer, folders, answers = released_drafters
    convert(str(folders[layout]), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=32)
    quantized = pair_of(target_dir, tmp_path / "q4")
    assert quantized.drafter.layers[0].mlp.up_proj.bits == 4
    if layout == "dflash2":  # drafter_default keeps the convolution taps and the selector map in float
        layer = quantized.drafter.layers[0]
        assert not hasattr(layer.attention_conv.kernel_projection, "bits")
        assert not hasattr(quantized.drafter.candidate_selector.hidden_projection, "bits")
        assert quantized.drafter.candidate_selector.successor_codebook.bits == 8
    tokens, accepted = greedy_run(quantized, tokenizer)
    for text in LAYOUT_PROMPTS:
        assert tokens[text] == answers[text][:40]  # lossless whatever the drafter
    _, accepted_float = greedy_run(pair_of(target_dir, folders[layout]), tokenizer)
    assert accepted_float >= 8 and accepted >= 0.75 * accepted_float, (accepted, accepted_float)


def selector_samples(pair, prompt, params, rows, seed):
    """``rows`` independent DFlash2 proposal blocks [anchor, x0, x1] after ``prompt`` and the
    accept rule applied to each: (committed tokens (rows, 3), accepted (rows,), p0, p1 given x0)."""
    target, drafter = pair.target, pair.drafter
    *context_tokens, anchor = prompt
    _, hidden = target(mx.array([prompt]), target.make_cache())
    p0 = probabilities(target.model(mx.array([prompt]))[0, -1], params)
    V = target.vocab_size
    # p1 given each possible first proposal x0: the target row after prompt + [x0].
    extended = mx.concatenate([mx.broadcast_to(mx.array(prompt), (V, len(prompt))), mx.arange(V)[:, None]], axis=1)
    p1 = probabilities(target.model(extended)[:, -1], params)
    mx.random.seed(seed)
    block = mx.array([anchor, drafter.args.mask_token_id, drafter.args.mask_token_id])
    embedded = mx.broadcast_to(target.embed(block)[None], (rows, 3, target.hidden_size))
    context = mx.broadcast_to(hidden[:, :-1], (rows, len(context_tokens), hidden.shape[-1]))
    proposals, q, _ = drafter.propose(embedded, mx.full((rows,), anchor), context, drafter.make_cache(),
                                   target.lm_head, Rejection(params, OPS))
    # The third row (the bonus after two accepted proposals) is never examined: any p will do.
    p = mx.stack([mx.broadcast_to(p0, (rows, V)), p1[proposals[:, 0]], mx.broadcast_to(p0, (rows, V))], axis=1)
    uniforms = mx.random.uniform(shape=(rows, 3))
    tokens, n = mx.vmap(rejection_accept_twin)(p, q, proposals, uniforms)
    return np.array(tokens), np.array(n), np.array(p0), np.array(p1), np.array(q)


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=1.5, top_p=0.95)],
                         ids=["temp", "top_p"])
def test_dflash2_sampling_is_exact(released_drafters, params):
    """The selector's q (its softmax over the k candidates given the previous pick) is what its
    proposals follow, so rejection sampling against it commits the target's distribution: the
    first token follows p0, and after an accepted x0 the second follows p1(. | x0)."""
    target_dir, tokenizer, folders, answers = released_drafters
    pair = pair_of(target_dir, folders["dflash2"])
    text = LAYOUT_PROMPTS[0]
    # A point inside the answer the drafter learnt where q and p overlap partly, so that both
    # the accept and the residual path run often.
    for cut in range(len(answers[text]) - 8):
        prompt = tokenizer.encode(text) + answers[text][:cut]
        _, n, p0, _, q = selector_samples(pair, prompt, params, rows=1, seed=0)
        if 0.2 < np.minimum(p0, q[0, 0]).sum() < 0.8:
            break
    tokens, n, p0, p1, q = selector_samples(pair, prompt, params, rows=6000, seed=7)
    V = p0.shape[0]
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=V), p0) > ALPHA
    first = np.bincount(tokens[n >= 1, 0], minlength=V).argmax()
    second = tokens[(n >= 1) & (tokens[:, 0] == first), 1]
    assert second.size > 500
    assert chi_square_p_value(np.bincount(second, minlength=V), p1[first]) > ALPHA
    # Both the accept and the residual path ran, and q really is the selector's: at most k ids.
    assert 0.05 < (n >= 1).mean() < 0.98
    assert ((q > 0).sum(-1) <= pair.drafter.args.selector_top_k).all()
    expected = np.minimum(p0, q[0, 0]).sum()  # every row shares the first position's q
    assert abs((n >= 1).mean() - expected) < 5 * math.sqrt(expected * (1 - expected) / n.size)


def test_dflash2_generates_through_cli_and_adaptive_block(released_drafters, capsys):
    target_dir, tokenizer, folders, answers = released_drafters
    text = LAYOUT_PROMPTS[1]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(target_dir), "--draft", str(folders["dflash2"]), "--prompt", text,
              "--ignore-chat-template", "--max-tokens", "16", "--block-size", "4", "--temp", "0.7"])
        raise SystemExit(0)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert "Acceptance: tau" in out
    pair = pair_of(target_dir, folders["dflash2"])
    greedy = [r.token for r in stream_generate(pair, tokenizer, text, 40, block_size="auto")]
    assert len(greedy) >= 10 and greedy == answers[text][: len(greedy)]


def test_train_refuses_dflash2(released_drafters):
    from dflash_mlx.errors import DFlashError
    from dflash_mlx.train import training_hidden

    drafter = load_drafter(str(released_drafters[2]["dflash2"]))
    with pytest.raises(DFlashError, match="training DFlash2DraftModel drafters is not supported"):
        training_hidden(drafter, mx.zeros((1, 4, 6 * 64)), mx.zeros((1, 1, 8, 64)), mx.array([[2]]))


def test_draft_window_and_prefix_reuse_with_sliding_layers(released_drafters):
    """--draft-window bounds the full-attention layers (sliding ones keep their window) and a reused
    conversation cache trims both kinds: still mlx_lm's tokens."""
    target_dir, tokenizer, folders, answers = released_drafters
    pair = pair_of(target_dir, folders["2026"])
    text = LAYOUT_PROMPTS[0]
    cache = PromptCache()
    first = [r.token for r in stream_generate(pair, tokenizer, text, 20, block_size=4, prompt_cache=cache,
                                              draft_window=(2, 10))]
    assert first == answers[text][: len(first)]
    follow_up = tokenizer.encode(text) + answers[text][:30]
    reference = mlx_lm_greedy(pair, follow_up, 12)
    again = [r.token for r in stream_generate(pair, tokenizer, follow_up, 12, block_size=4, prompt_cache=cache,
                                              draft_window=(2, 10))]
    assert again == reference[: len(again)] and len(again) >= 6


def mlx_lm_greedy(pair, prompt, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), pair.target.model, max_tokens=n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_drafter_round_trips_every_layout(released_drafters, layout, tmp_path):
    from dflash_mlx.models import save_drafter

    folder = released_drafters[2][layout]
    loaded = load_drafter(str(folder))
    save_drafter(loaded, tmp_path / "saved")
    again = load_drafter(str(tmp_path / "saved"))
    assert type(again) is type(loaded) and vars(again.args) == vars(loaded.args)
    mx.random.seed(0)
    context, block = mx.random.normal((1, 12, 6 * 64)), mx.random.normal((1, 4, 64))
    head = mx.random.normal((100, 64))
    a = loaded(block, context, loaded.make_cache(), lambda h: h @ head.T, OPS)
    b = again(block, context, again.make_cache(), lambda h: h @ head.T, OPS)
    assert mx.array_equal(a, b).item()


def test_dflash2_serves_and_benchmarks(released_drafters, tmp_path, capsys):
    import argparse
    import http.client
    import json
    import threading

    from dflash_mlx.server import add_arguments, close, make_server

    target_dir, tokenizer, folders, _ = released_drafters
    out = tmp_path / "bench.json"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LAYOUT_PROMPTS))
    main(["benchmark", "--model", str(target_dir), "--draft", str(folders["dflash2"]), "--dataset", str(prompts),
          "--num-prompts", "2", "--max-tokens", "16", "--block-size", "4", "--output", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["match"] is True and row["tau"] > 1
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = make_server(parser.parse_args(["--model", str(target_dir), "--draft", str(folders["dflash2"]), "--port", "0",
                                            "--max-tokens", "64", "--max-prompt-tokens", "400", "--block-size", "auto"]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": LAYOUT_PROMPTS[0], "max_tokens": 12}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read().decode())
        assert response.status == 200, body
        pair = pair_of(target_dir, folders["dflash2"])
        expected = "".join(r.text for r in stream_generate(pair, tokenizer, LAYOUT_PROMPTS[0], 12))
        assert body["choices"][0]["text"] == expected
    finally:
        server.shutdown()
        close(server)  # joins the worker


def test_dflash2_drafters_are_batched(released_drafters):
    """DFlash2 rows are drafted together, each proposal picked by its own row's rule given the one
    before (its selector), and each row commits what mlx_lm's greedy decoding does."""
    from dflash_mlx import batch_generate

    target_dir, tokenizer, folders, answers = released_drafters
    pair = pair_of(target_dir, folders["dflash2"])
    response = batch_generate(pair, tokenizer, LAYOUT_PROMPTS, max_tokens=24, block_size=4, return_token_ids=True)
    for text, ids in zip(LAYOUT_PROMPTS, response.token_ids):
        assert ids == answers[text][: len(ids)] and len(ids) == 24
    assert response.stats.batched and max(response.stats.rows) == 2 and response.stats.ragged_steps > 0


@pytest.mark.parametrize("layout", ["original", "dflash2"])
def test_the_python_default_block_is_auto_unless_draws_follow_blocks(released_drafters, layout):
    """As on the command line: auto, but a sampled DFlash2 run (rejection sampling, whose draws
    follow the block sizes) keeps a fixed block so that mx.random.seed reproduces it, and so does a
    run with an opaque sampler."""
    target_dir, tokenizer, folders, _ = released_drafters
    pair = pair_of(target_dir, folders[layout])
    assert default_block(None, pair, 0.0, None) == "auto"
    assert default_block(None, pair, 0.8, None) == ("auto" if layout == "original" else SEEDED_BLOCK_SIZE)
    assert default_block(None, pair, 0.0, lambda logprobs: mx.argmax(logprobs, -1)) == pair.block_size
    assert default_block(3, pair, 0.8, None) == 3
    last = list(stream_generate(pair, tokenizer, LAYOUT_PROMPTS[0], 4))[-1]
    assert last.stats.adaptive
