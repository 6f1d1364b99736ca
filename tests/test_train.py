"""Drafter training: the training forward is the inference forward, learning works, resume works."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import EOS_ID, TARGETS, drafter_config, save_target, save_tokenizer

from dflash_mlx import kernels
from dflash_mlx import train
from dflash_mlx.train import data
from dflash_mlx.errors import DFlashError
from dflash_mlx.models import Drafter, DrafterArgs, load_drafter
from dflash_mlx.target import Target
from dflash_mlx.train import training_hidden


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_forward_matches_inference(tiny_pair, family):
    """Every block of one batched training forward equals a separate Drafter.__call__."""
    target_path, _ = tiny_pair(family)
    model, _ = mlx_lm.load(str(target_path))
    mx.random.seed(3)
    drafter = Drafter(DrafterArgs.from_config(drafter_config(TARGETS[family], block_size=6)))
    target = Target(model, drafter.args.target_layer_ids)
    tokens = mx.array([[5 + (7 * i) % 60 for i in range(30)], [9 + (3 * i) % 50 for i in range(30)]])
    _, hidden = target(tokens, None)
    B, mask_id = 6, drafter.args.mask_token_id
    anchors = mx.array([[0, 4, 11, 23], [2, 3, 17, 29]])
    first = mx.take_along_axis(tokens, anchors, axis=1)
    block = mx.concatenate([first[..., None], mx.full((2, 4, B - 1), mask_id, mx.int32)], axis=-1)
    logits = target.lm_head(training_hidden(drafter, hidden, target.embed(block), anchors))
    ops = kernels.get_ops(False)
    for s in range(2):
        for j in range(4):
            a = anchors[s, j].item()
            expected = drafter(target.embed(block[s, j])[None], hidden[s : s + 1, :a], drafter.make_cache(),
                               target.lm_head, ops)
            assert mx.allclose(logits[s, j], expected, atol=1e-4).item(), (s, j)


def _train(tmp_path: Path, target: Path, out: Path, steps: int, *extra: str) -> None:
    prompts = tmp_path / "prompts.txt"
    # Random tiny targets fall into short greedy loops: predictable from the context,
    # so a drafter trained briefly on some prompts must beat tau 1 on others.
    prompts.write_text("\n".join(f"{w} {i}" for i, w in enumerate(["abc", "hello", "xyz", "def", "qq", "the"] * 8)))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    train.run(parser.parse_args(["--model", str(target), "--out", str(out), "--prompts", str(prompts), "--num-prompts", "40",
          "--eval-prompts", "6", "--max-response-tokens", "48", "--gen-batch-size", "8", "--block-size", "8",
          "--steps", str(steps), "--batch-seqs", "4", "--anchors", "16", "--lr", "3e-3", "--save-every", "20",
          "--eval-max-tokens", "40", "--seed", "0", *extra]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    # Halving tiny.py's weight scale makes a target whose greedy answers settle into
    # runs of one token: predictable from context, as real answers partly are.
    target = save_target(tmp / "target", "qwen3")
    weights = mx.load(str(target / "model.safetensors"))
    weights = {k: v * 0.5 if v.ndim == 2 and "embed" not in k else v for k, v in weights.items()}
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    out = tmp / "drafter"
    _train(tmp, target, out, 100, "--draft-vocab-size", "48")
    return tmp, target, out


def test_micro_drafter_learns(trained):
    tmp, target, out = trained
    result = json.loads((out / "train_result.json").read_text())
    drafter = load_drafter(str(out))  # the released checkpoint layout
    assert drafter.args.block_size == 8
    assert drafter.vocab_rows.size == 48
    model, tokenizer = mlx_lm.load(str(target))
    prompts = (tmp / "prompts.txt").read_text().splitlines()[40:46]  # the held-out ones
    untrained = Drafter(drafter.args)
    untrained.draft_vocab = drafter.vocab_rows
    baseline = train.evaluate_tau(Target(model, drafter.args.target_layer_ids), untrained, tokenizer, prompts, 40)
    assert result["held_out"]["tau"] > 1.8, result
    assert result["held_out"]["tau"] > baseline["tau"] + 0.5, (result, baseline)


def test_resume_continues_the_same_run(trained, tmp_path, monkeypatch):
    """A run killed after its step-20 checkpoint and resumed ends with the weights of an uninterrupted run."""
    tmp, target, first = trained
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        out.mkdir()
        (out / "data.jsonl").write_text((first / "data.jsonl").read_text())  # skip regeneration
    _train(tmp, target, straight, 40, "--eval-prompts", "0")

    save = train.save_checkpoint

    def save_then_die(out, drafter, optimizer, step, config):
        save(out, drafter, optimizer, step, config)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp, target, resumed, 40, "--eval-prompts", "0")
    monkeypatch.setattr(train, "save_checkpoint", save)
    assert json.loads((resumed / "trainer_state.json").read_text())["step"] == 20
    with pytest.raises(DFlashError, match="--resume"):
        _train(tmp, target, resumed, 40, "--eval-prompts", "0")
    _train(tmp, target, resumed, 40, "--eval-prompts", "0", "--resume")
    a = mx.load(str(straight / "model.safetensors"))
    b = mx.load(str(resumed / "model.safetensors"))
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-5), k


def test_init_from_a_trained_drafter_continues_it(tiny_pair, tmp_path):
    """``--init DRAFTER``: training starts from that drafter's weights, architecture and draft
    vocabulary (at learning rate 0 it comes out unchanged); flags that would reshape it are refused."""
    target, first = tiny_pair("qwen3")
    out = tmp_path / "continued"
    _train(tmp_path, target, out, 2, "--num-prompts", "4", "--eval-prompts", "0", "--init", str(first), "--lr", "0",
           "--block-size", "4")
    before, after = load_drafter(str(first)), load_drafter(str(out))
    assert after.args.block_size == 4 != before.args.block_size
    assert after.args.num_hidden_layers == before.args.num_hidden_layers
    assert after.args.draft_vocab_size == before.args.draft_vocab_size
    ours = dict(tree_flatten(after.parameters()))  # the draft vocabulary, when there is one, among them
    assert set(ours) == {k for k, _ in tree_flatten(before.parameters())}
    for k, v in tree_flatten(before.parameters()):
        assert mx.array_equal(ours[k], v).item(), k
    with pytest.raises(DFlashError, match="drop --num-layers --draft-vocab-size"):
        _train(tmp_path, target, tmp_path / "refused", 2, "--init", str(first), "--num-layers", "2", "--draft-vocab-size", "8")
    assert not (tmp_path / "refused").exists()


def test_skip_prompts_trains_on_the_next_ones(tiny_pair, tmp_path):
    """``--skip-prompts N`` answers the prompts after the first N of the same mixed order."""
    target, _ = tiny_pair("qwen3")
    out = tmp_path / "skipped"
    _train(tmp_path, target, out, 1, "--skip-prompts", "30", "--num-prompts", "4", "--eval-prompts", "0")
    _, tokenizer = mlx_lm.load(str(target))
    expected = data.load_prompts([str(tmp_path / "prompts.txt")], 34)[30:]
    written = data.read_records(out / "data.jsonl")
    records = sorted(written, key=lambda r: r["id"])
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in expected]
    assert [r["prompt_ids"] for r in records] == chat
    # The drafter copies from the answers it was trained on (in the order they were written).
    assert load_drafter(str(out)).corpus.tokens == [t for r in written for t in r["response_ids"]]


def test_init_from_target_reproduces_the_last_target_layer(tiny_pair):
    """``--init target``: the drafter's context keys/values start as the target's last layer computes them."""
    target_path, _ = tiny_pair("qwen3")
    model, _ = mlx_lm.load(str(target_path))
    config = json.loads((target_path / "config.json").read_text())
    L = config["num_hidden_layers"]
    args = train.make_drafter_args(Target(model, []), num_layers=1, block_size=4, target_layer_ids=[0, L - 2], mask_token_id=0)
    drafter = Drafter(args)
    target = Target(model, args.target_layer_ids)
    train.init_from_target(drafter, target)
    _, hidden = target(mx.array([[3, 14, 15, 9, 26, 5]]), None)
    last = model.layers[-1]
    H = config["hidden_size"]
    expected = last.self_attn.k_proj(last.input_layernorm(hidden[..., H:]))
    ours = drafter.layers[0].self_attn.k_proj(drafter.hidden_norm(drafter.fc(hidden)))
    assert mx.allclose(ours, expected, atol=1e-5).item()
    assert mx.array_equal(drafter.norm.weight, model.model.norm.weight).item()
    with pytest.raises(DFlashError, match="--init random"):
        wide = train.make_drafter_args(Target(model, []), num_layers=1, block_size=4, target_layer_ids=[L - 2], mask_token_id=0,
                                       intermediate_size=2 * config["intermediate_size"])
        train.init_from_target(Drafter(wide), target)


def test_bad_target_is_one_line_and_leaves_nothing(tmp_path, capsys):
    from dflash_mlx import cli

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--model", str(tmp_path / "missing"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 1 and len(err.splitlines()) == 1 and "missing" in err
    assert not out.exists()


def test_hidden_cache_runs_the_target_only_over_new_sequences(tiny_pair, tmp_path, monkeypatch):
    target_path, _ = tiny_pair("qwen3")
    model, _ = mlx_lm.load(str(target_path))
    target = Target(model, [0, 1])
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(3, 60, size=n).astype(np.int32), 2) for n in (7, 12, 9, 15, 11)]
    folder = tmp_path / "cache"
    computed = []
    real = data.compute_hidden

    def counting(t, s, **kw):
        if len(computed) == 2 and kw.get("fail"):
            raise RuntimeError("interrupted")
        computed.append(len(s))
        return real(t, s, progress=kw.get("progress"))

    monkeypatch.setattr(data, "compute_hidden", counting)
    first, _ = data.cached_hidden(folder, target, seqs[:2])
    asked = seqs[:4] + seqs[:1]  # two new sequences (and a repeat)
    both, labels = data.cached_hidden(folder, target, asked)
    again, _ = data.cached_hidden(folder, target, seqs[3::-1])  # all cached, other order
    assert labels == [None] * len(asked)  # the target's own answers are their own labels
    assert computed == [2, 2]
    for got, (tokens, _) in zip(both, asked):
        _, expected = target(mx.array(tokens[None]), None)
        assert mx.allclose(got.astype(mx.float32), expected[0], rtol=2e-2, atol=2e-2).item()  # bfloat16 storage
    assert all(mx.array_equal(a, b).item() for a, b in zip(first, both[:2]))
    assert all(mx.array_equal(a, b).item() for a, b in zip(again, both[3::-1]))

    other = Target(model, [1])  # other taps: nothing reused; an interrupted pass keeps its whole shards
    monkeypatch.setattr(data, "compute_hidden", lambda t, s, **kw: counting(t, s, fail=True, **kw))
    computed.clear()
    with pytest.raises(RuntimeError, match="interrupted"):
        data.cached_hidden(folder, other, seqs, shard_size=2)
    assert computed == [2, 2] and not list(folder.glob("tmp-*"))
    monkeypatch.setattr(data, "compute_hidden", counting)
    data.cached_hidden(folder, other, seqs, shard_size=2)
    assert computed == [2, 2, 1]


def test_hub_id_target_with_nested_text_config(tmp_path):
    """A target given as a Hub id (served from a local Hub cache, offline) whose config nests its
    text model under text_config (qwen3_5): train reads the geometry from the loaded model."""
    from test_hybrid import CONFIGS, build

    snapshot = tmp_path / "hub" / "models--tiny--qwen3_5" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--tiny--qwen3_5" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--qwen3_5" / "refs" / "main").write_text("0" * 40)
    mx.save_safetensors(str(snapshot / "model.safetensors"), dict(tree_flatten(build("qwen3_5").parameters())))
    (snapshot / "config.json").write_text(json.dumps({**CONFIGS["qwen3_5"], "eos_token_id": EOS_ID}))
    save_tokenizer(snapshot)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\nhello\nxyz\n")
    out = tmp_path / "drafter"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "train", "--model", "tiny/qwen3_5", "--out", str(out), "--prompts", str(prompts),
         "--num-prompts", "3", "--eval-prompts", "0", "--max-response-tokens", "12", "--block-size", "4", "--steps", "2",
         "--init", "random", "--anchors", "4"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    text = CONFIGS["qwen3_5"]["text_config"]
    assert (config["hidden_size"], config["num_target_layers"]) == (text["hidden_size"], text["num_hidden_layers"])
    assert config["num_attention_heads"] == text["num_attention_heads"] and config["head_dim"] == text["head_dim"]
    assert config["rope_theta"] == text["rope_parameters"]["rope_theta"]


def test_windowed_training_forward_is_the_drafter_on_the_window_alone(tiny_pair):
    """With --draft-window (keep, recent), every block of the training forward over ``make_batch``'s
    cut context equals the inference drafter run on the first keep and the last recent context rows
    before its anchor alone, each at its own position (rows between them never entered)."""
    target_path, _ = tiny_pair("qwen3")
    model, _ = mlx_lm.load(str(target_path))
    mx.random.seed(5)
    drafter = Drafter(DrafterArgs.from_config(drafter_config(TARGETS["qwen3"], block_size=4)))
    target = Target(model, drafter.args.target_layer_ids)
    seqs = [(np.array([3 + (5 * i) % 50 for i in range(40)], np.int32), 22),
            (np.array([7 + (11 * i) % 40 for i in range(33)], np.int32), 20)]
    hidden = [target(mx.array(t)[None], None)[1][0] for t, _ in seqs]
    keep, recent, B = 3, 6, 4
    context, tail_start, first, anchors, _, _ = data.make_batch(seqs, hidden, [0, 1], np.random.default_rng(1), 5, B,
                                                                (keep, recent))
    assert context.shape[1] < 40  # rows no block sees were left out
    block = train.block_tokens(first, B, drafter.args.mask_token_id)
    logits = target.lm_head(training_hidden(drafter, context, target.embed(block), anchors, (keep, recent), tail_start))
    ops = kernels.get_ops(False)
    for s in range(2):
        for j in range(anchors.shape[1]):
            a = anchors[s, j].item()
            window = drafter.make_cache()  # unbounded: only what is put in
            drafter.absorb(hidden[s][None, :keep], window)  # sink rows at 0..keep-1
            for c in window:
                c.skip([a - recent - keep])
            drafter.absorb(hidden[s][None, a - recent : a], window)  # the last recent rows
            expected = drafter(target.embed(block[s, j])[None], hidden[s][None, a:a], window, target.lm_head, ops)
            assert mx.allclose(logits[s, j], expected[0], atol=1e-4).item(), (s, j)


def test_draft_window_is_trained_and_recorded(tiny_pair, tmp_path):
    """``--draft-window`` lands in the checkpoint's dflash_config.draft_window; continuing that drafter
    (``--init``) keeps it, and the held-out evaluation decodes with it."""
    target, first = tiny_pair("qwen3")
    out = tmp_path / "windowed"
    _train(tmp_path, target, out, 2, "--num-prompts", "4", "--eval-prompts", "0", "--draft-window", "2:16")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["draft_window"] == [2, 16]
    assert load_drafter(str(out)).args.context_window() == (2, 16)
    again = tmp_path / "continued"
    _train(tmp_path, target, again, 2, "--num-prompts", "4", "--eval-prompts", "0", "--init", str(out))
    assert json.loads((again / "config.json").read_text())["dflash_config"]["draft_window"] == [2, 16]


def test_long_prompt_sources_hold_out_the_benchmark_ones(tmp_path):
    """docs: manual pages outside the held-out sections, each an excerpt within LONG_PROMPT_CHARS with a
    question; code: refuses held-out packages; both are deterministic."""
    root = tmp_path / "_sources"
    line = "A line of the manual that explains a feature in plain words.\n"
    for section in ("library", "reference", "howto", "tutorial"):
        (root / section).mkdir(parents=True)
        for i in range(2):
            (root / section / f"page{i}.rst.txt").write_text(f"{section} {i}\n" + line * 600)
    trained = data.doc_files(root)
    assert {p.parent.name for p in trained} == {"library", "reference"}
    assert {p.parent.name for p in data.doc_files(root, held_out=True)} == set(data.LONG_HELD_OUT["docs"])
    prompts = data.load_prompts([f"docs:{root}"], 10)
    assert len(prompts) == 4 and prompts == data.load_prompts([f"docs:{root}"], 10)
    for p in prompts:
        excerpt, question = p.rsplit("\n```\n\n", 1)
        assert question in data.DOC_QUESTIONS and 500 <= len(excerpt) <= data.LONG_PROMPT_CHARS + 4
        assert "howto" not in excerpt and "tutorial" not in excerpt
    with pytest.raises(DFlashError, match="held out for the long-context benchmark"):
        data.load_prompts(["code:tqdm,click"], 3)
    with pytest.raises(DFlashError, match="python3.11-doc"):
        data.load_prompts([f"docs:{tmp_path / 'none'}"], 3)


def test_conversation_prompts_are_read_through_the_chat_template(tiny_pair):
    """A multi-turn prompt (a message list, as the chats source gives) is tokenized as one conversation
    ending with the generation prompt; a string is one user message."""
    target, _ = tiny_pair("qwen3")
    _, tokenizer = mlx_lm.load(str(target))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert data.prompt_ids(tokenizer, "hi") == tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True)
    assert data.prompt_ids(tokenizer, chat) == tokenizer.apply_chat_template(chat, add_generation_prompt=True)


def test_texts_are_labelled_with_the_targets_greedy_continuation(tiny_pair, tmp_path, monkeypatch):
    """A text the target did not write (``--texts``) is learned teacher-forced: one pass in chunks
    gives its hidden states and the target's greedy token after every position, as an uncached pass
    does; a block's labels are the target's greedy continuation of its anchor, valid up to the
    first position where the text departs from it; the pass is cached like the answers'."""
    target_path, _ = tiny_pair("qwen3")
    model, _ = mlx_lm.load(str(target_path))
    target = Target(model, [0, 1])
    tokens = [5, 9, 13, 7]
    for _ in range(12):  # the target's own greedy continuation...
        tokens.append(target(mx.array([tokens]), None)[0][0, -1].argmax().item())
    nxt = target(mx.array([tokens]), None)[0][0, -1].argmax().item()
    tokens += [(nxt + 1) % 60 + 3, 11, 4, 21, 30, 8]  # ...then a departure from it
    text = np.array(tokens, np.int32)

    logits, expected = target(mx.array(text[None]), None)
    hidden, greedy = data.teacher_forced(target, text, chunk=5)
    assert mx.allclose(hidden.astype(mx.float32), expected[0], rtol=2e-2, atol=2e-2).item()
    assert np.array_equal(np.array(greedy), np.array(logits[0].argmax(-1)))

    passes = []
    monkeypatch.setattr(data, "teacher_forced", lambda t, s: passes.append(len(s)) or (hidden, greedy))
    for _ in range(2):
        cached, labels = data.cached_hidden(tmp_path / "cache", target, [(text, 1)], texts=True)
    assert passes == [len(text)] and np.array_equal(labels[0], np.array(greedy))

    B, T = 6, len(text)
    _, _, _, anchors, got, valid = data.make_batch([(text, 1)], cached, [0], np.random.default_rng(0), T - 2, B,
                                                   greedy=labels)
    g = np.array(greedy)
    for j, a in enumerate(np.array(anchors)[0]):
        for k in range(B - 1):
            follows = all(text[a + 1 + m] == g[a + m] for m in range(k))  # the text so far is the target's
            assert bool(valid[0, j, k]) == (a + k + 1 < T and follows), (a, k)
            if valid[0, j, k]:
                assert got[0, j, k].item() == g[a + k], (a, k)
    departure = 16  # the first token the target would not have written
    a = list(np.array(anchors)[0]).index(departure - 2)
    assert np.array(valid[0, a]).tolist() == [True, True] + [False] * (B - 3)
    assert got[0, a, 1].item() == nxt != text[departure]

    # The draft vocabulary holds what the drafter is asked for, the target's tokens, not the text's.
    asked = set(g[:-1].tolist())
    assert asked != set(text[1:].tolist())
    vocab = data.draft_vocabulary([(text, 1)], len(asked), logits.shape[-1], labels)
    assert set(np.array(vocab).tolist()) == asked


def test_train_on_texts_alone(tiny_pair, tmp_path):
    """``--texts`` with no prompts: the drafter learns from the target's greedy tokens over the texts."""
    target, _ = tiny_pair("qwen3")
    out = tmp_path / "drafter"
    _train(tmp_path, target, out, 4, "--num-prompts", "0", "--texts", str(tmp_path / "prompts.txt"), "--num-texts", "6",
           "--eval-prompts", "0", "--draft-vocab-size", "8")
    result = json.loads((out / "train_result.json").read_text())
    assert result["answer_tokens"] == 0 and result["text_tokens"] > 6 * 3 and result["sequences"] == 6
    # Its draft vocabulary: the ids the target wrote most often over the texts (cached with their passes).
    greedy = [v for shard in (out / "cache").glob("hidden-*.safetensors") for k, v in mx.load(str(shard)).items()
              if k.endswith(".greedy")]
    counts = np.bincount(np.concatenate([np.array(g)[:-1] for g in greedy]))
    assert len(greedy) == 6
    drafter = load_drafter(str(out))
    assert np.array(drafter.draft_vocab).tolist() == sorted(np.lexsort((np.arange(len(counts)), -counts))[:8])
    assert isinstance(result["hidden_seconds"], float)  # the text passes are timed (data_seconds: the answers)
    assert drafter.args.block_size == 8
    with pytest.raises(DFlashError, match="nothing to train on"):
        _train(tmp_path, target, tmp_path / "empty", 4, "--num-prompts", "0")
    with pytest.raises(DFlashError, match="go together"):  # not silently no texts
        _train(tmp_path, target, tmp_path / "half", 4, "--texts", "docs")
    assert not (tmp_path / "half").exists()  # refused before anything is written


def test_text_share_sets_the_steps_that_train_on_texts():
    """Any number of texts takes the given share of the steps; each pool goes through all its
    batches each epoch; without a share, one pool in the order the runs before it had."""
    pools = train.batch_pools([5, 3, 9, 4, 7, 8, 30, 20, 40, 10], 6, 2, 0.25)
    assert pools == [[[1, 3], [0, 4], [5, 2]], [[9, 7], [6, 8]]]
    picked = [train.step_batch(pools, 0.25, 0, step) for step in range(48)]
    from_texts = [b for b in picked if b[0] >= 6]
    assert len(from_texts) == 12 and all(from_texts.count(b) == 6 for b in pools[1])
    assert all([b for b in picked if b[0] < 6].count(b) == 12 for b in pools[0])
    one = train.batch_pools([5, 3, 9, 4, 7, 8, 30, 20, 40, 10], 6, 2, None)
    assert one == [[[1, 3], [0, 4], [5, 2], [9, 7], [6, 8]]]
    order = np.random.default_rng([0, 1]).permutation(5)
    assert [train.step_batch(one, None, 0, step) for step in range(5, 10)] == [one[0][k] for k in order]


def test_text_share_in_a_run(tiny_pair, tmp_path, monkeypatch):
    target, _ = tiny_pair("qwen3")
    seen = []

    def recording(seqs, hidden, idx, *rest):
        seen.append({seqs[i][1] == 1 for i in idx})  # a text's labels start at its first token
        return data.make_batch(seqs, hidden, idx, *rest)

    monkeypatch.setattr(train, "make_batch", recording)
    _train(tmp_path, target, tmp_path / "shared", 8, "--texts", str(tmp_path / "prompts.txt"), "--num-texts", "6",
           "--eval-prompts", "0", "--text-share", "0.25")
    assert seen == [{False}] * 3 + [{True}] + [{False}] * 3 + [{True}]
    for bad in (["--text-share", "0.3"], ["--text-share", "1", "--texts", "docs", "--num-texts", "2"]):
        with pytest.raises(DFlashError, match="--text-share .* between 0 and 1"):
            _train(tmp_path, target, tmp_path / "bad", 4, *bad)
    assert not (tmp_path / "bad").exists()
