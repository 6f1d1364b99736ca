"""The drafter: its math, its cache, and every checkpoint form it loads from."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import TARGETS, drafter_config, save_drafter

from dflash_mlx.models import default_target_layer_ids, load_drafter
from dflash_mlx.kernels import get_ops

OPS = get_ops(False)
H = 64


def rope(x, positions, base):
    """Plain split-half RoPE on (heads, rows, D) at explicit positions."""
    d = x.shape[-1] // 2
    freqs = base ** (-mx.arange(d) / d)
    angles = positions[:, None] * freqs[None]
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., :d], x[..., d:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def reference_forward(drafter, block_emb, context_hidden, lm_head):
    """Written from the paper's description, with no cache and explicit positions."""
    a = drafter.args
    ctx = drafter.hidden_norm(drafter.fc(context_hidden[0]))
    n, L = ctx.shape[0], block_emb.shape[1]
    kv_pos, q_pos = mx.arange(n + L).astype(mx.float32), mx.arange(n, n + L).astype(mx.float32)
    h = block_emb[0]
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        kv_in = mx.concatenate([ctx, x])
        q = attn.q_norm(attn.q_proj(x).reshape(L, a.num_attention_heads, -1)).transpose(1, 0, 2)
        k = attn.k_norm(attn.k_proj(kv_in).reshape(n + L, a.num_key_value_heads, -1)).transpose(1, 0, 2)
        v = attn.v_proj(kv_in).reshape(n + L, a.num_key_value_heads, -1).transpose(1, 0, 2)
        q, k = rope(q, q_pos, a.rope_theta), rope(k, kv_pos, a.rope_theta)
        groups = a.num_attention_heads // a.num_key_value_heads
        k, v = mx.repeat(k, groups, axis=0), mx.repeat(v, groups, axis=0)
        scores = (q @ k.transpose(0, 2, 1)) * a.head_dim**-0.5
        window, causal = a.sliding_window_of(i), a.is_causal_layer(i)
        # Context rows within the window of each block row's position; block rows up
        # to the row itself in causal layers, all of them otherwise.
        context_key = kv_pos[None] < n
        sees_context = context_key & ((q_pos[:, None] - kv_pos[None] < window) if window else True)
        sees_block = ~context_key & ((kv_pos[None] <= q_pos[:, None]) if causal else True)
        scores = mx.where(sees_context | sees_block, scores, -mx.inf)
        out = (mx.softmax(scores, axis=-1) @ v).transpose(1, 0, 2).reshape(L, -1)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return lm_head(drafter.norm(h)[1:])[None]


@pytest.fixture
def head():
    mx.random.seed(5)
    return nn.Linear(H, 100, bias=False)


@pytest.mark.parametrize("sliding", [False, True])
def test_forward_matches_reference_and_cache_is_incremental(tmp_path, head, sliding):
    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if sliding else {}
    drafter = load_drafter(str(save_drafter(tmp_path / "d", drafter_config(TARGETS["qwen3"], **extra))))
    mx.random.seed(0)
    context = mx.random.normal((1, 11, 2 * H))
    block = mx.random.normal((1, 8, H))
    expected = reference_forward(drafter, block, context, head)

    cache = drafter.make_cache()
    at_once = drafter(block, context, cache, head, OPS)
    assert cache[0].offset == 11  # only the context stays cached
    np.testing.assert_allclose(np.array(at_once), np.array(expected), atol=1e-4, rtol=1e-4)

    # The same context fed over two steps (as the decode loop does) gives the same block.
    cache = drafter.make_cache()
    drafter(block, context[:, :7], cache, head, OPS)
    in_steps = drafter(block, context[:, 7:], cache, head, OPS)
    np.testing.assert_allclose(np.array(in_steps), np.array(expected), atol=1e-4, rtol=1e-4)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's released drafter
    assert default_target_layer_ids(28, 1) == [14]
    config = drafter_config(TARGETS["qwen3"], num_hidden_layers=3)
    assert "target_layer_ids" not in config["dflash_config"]


def test_released_bf16_sharded_checkpoint_loads(tmp_path, head):
    config = drafter_config(TARGETS["qwen3"])
    fp32 = load_drafter(str(save_drafter(tmp_path / "fp32", config)))
    bf16 = save_drafter(tmp_path / "bf16", config, dtype=mx.bfloat16)
    # Split into two shards the way sharded releases are laid out.
    weights = mx.load(str(bf16 / "model.safetensors"))
    names = sorted(weights)
    (bf16 / "model.safetensors").unlink()
    for i, part in enumerate([names[::2], names[1::2]]):
        mx.save_safetensors(str(bf16 / f"model-0000{i + 1}-of-00002.safetensors"), {k: weights[k] for k in part})
    drafter = load_drafter(str(bf16), dtype=mx.float32)
    assert drafter.fc.weight.dtype == mx.float32
    mx.random.seed(0)
    context, block = mx.random.normal((1, 6, 2 * H)), mx.random.normal((1, 4, H))
    a = fp32(block, context, fp32.make_cache(), head, OPS)
    b = drafter(block, context, drafter.make_cache(), head, OPS)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=0.1)  # bf16 weight rounding only


def test_mlx_quantized_checkpoint_loads(tmp_path, head):
    config = drafter_config(TARGETS["qwen3"])
    src = save_drafter(tmp_path / "fp32", config)
    drafter = load_drafter(str(src))
    nn.quantize(drafter, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    out = tmp_path / "q8"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    (out / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}}))
    loaded = load_drafter(str(out))
    assert isinstance(loaded.layers[0].mlp.up_proj, nn.QuantizedLinear)
    mx.random.seed(0)
    context, block = mx.random.normal((1, 6, 2 * H)), mx.random.normal((1, 4, H))
    reference = load_drafter(str(src))
    a = reference(block, context, reference.make_cache(), head, OPS)
    b = loaded(block, context, loaded.make_cache(), head, OPS)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=0.05)


def test_weights_not_matching_config_are_refused(tmp_path):
    from dflash_mlx.errors import DFlashError

    src = save_drafter(tmp_path / "d", drafter_config(TARGETS["qwen3"]))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(DFlashError, match="do not match its config.json"):
        load_drafter(str(bad))


def test_embedding_scale_multiplier_and_softcap(tmp_path, head):
    base = drafter_config(TARGETS["qwen3"])
    plain = load_drafter(str(save_drafter(tmp_path / "plain", base)))
    scaled_config = {**base, "dflash_config": {**base["dflash_config"], "input_embedding_scale": 2.0,
                                               "output_multiplier": 0.5, "final_logit_softcapping": 0.3}}
    scaled = load_drafter(str(save_drafter(tmp_path / "scaled", scaled_config)))
    mx.random.seed(0)
    context, block = mx.random.normal((1, 6, 2 * H)), mx.random.normal((1, 4, H))
    a = plain(2.0 * block, context, plain.make_cache(), head, OPS)
    b = scaled(block, context, scaled.make_cache(), head, OPS)
    np.testing.assert_allclose(np.array(b), np.array(mx.tanh(0.5 * a / 0.3) * 0.3), atol=1e-5)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(hidden_size="64"), "hidden_size is '64', not an integer"),
        (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps is '1e-6', not a number"),
        (lambda c: c["dflash_config"].update(block_size=[16]), "dflash_config.block_size is [16], not an integer"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, "4"]), "target_layer_ids is [1, '4'], not a list of integers"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
        (lambda c: c.update(layer_types=["full_attention", "linear_attention"], sliding_window=4),
         "unknown layer types ['linear_attention']"),
        (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "sliding_window is missing"),
        (lambda c: c.update(is_causal="yes"), "is_causal is 'yes', not true or false or null"),
        (lambda c: c.update(num_key_value_heads=3), "num_attention_heads (4) is not a multiple of"),
        (lambda c: c.update(block_size=0), "block_size is 0, not a positive integer"),
        (lambda c: c.update(architectures=["EagleDraftModel"]), "architectures is ['EagleDraftModel'], not one drafter"),
        (lambda c: c.update(rope_parameters={"rope_type": "nope", "rope_theta": 1e4}), "rope_parameters is not a RoPE"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "dflash_config.conv_kernel_size is missing"),
        (lambda c: c["dflash_config"].update(draft_window="16:256"), "dflash_config.draft_window is '16:256', not a list"),
        (lambda c: c["dflash_config"].update(draft_window=[256]), "dflash_config.draft_window is [256], not [keep, recent]"),
        (lambda c: c["dflash_config"].update(draft_window=[16, 0]), "dflash_config.draft_window is [16, 0], not [keep, recent]"),
        (lambda c: c["dflash_config"].update(draft_window=[-1, 64]), "dflash_config.draft_window is [-1, 64], not [keep, recent]"),
        (lambda c: (c.update(architectures=["DFlash2DraftModel"]), c["dflash_config"].update(
            conv_kernel_size=2, conv_group_size=24, selector_rank=4, selector_top_k=4)),
         "conv_group_size (24) does not divide hidden_size (64)"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path, edit, message):
    from dflash_mlx.errors import DFlashError

    src = save_drafter(tmp_path / "d", drafter_config(TARGETS["qwen3"]))
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError) as e:
        load_drafter(str(src))
    assert message in str(e.value) and "fix:" in str(e.value) and "\n" not in str(e.value)


def test_layout_keys_are_read_where_each_layout_puts_them(tmp_path):
    """2026: block_size in dflash_config, RoPE in rope_parameters; Gemma scalings at the top level
    as well as in dflash_config (dflash_config wins), as the authors' PyTorch loader reads them."""
    from tiny import layout_config

    config = layout_config(drafter_config(TARGETS["qwen3"]), "2026")
    assert "rope_theta" not in config and "block_size" not in config
    config["dflash_config"]["block_size"] = 12
    config.update(input_embedding_scale=3.0, output_multiplier=0.5)
    config["dflash_config"]["output_multiplier"] = 0.25
    a = load_drafter(str(save_drafter(tmp_path / "d", config))).args
    assert a.block_size == 12 and a.rope_theta == TARGETS["qwen3"]["rope_theta"]
    assert a.rope_scaling["rope_type"] == "yarn" and a.is_causal is True
    assert a.input_embedding_scale == 3.0 and a.output_multiplier == 0.25
    assert [a.is_causal_layer(i) for i in range(2)] == [True, True]
    a.is_causal = None  # the official default: causal in sliding-window layers only
    assert [a.is_causal_layer(i) for i in range(2)] == [True, False]


def test_sliding_window_cache_keeps_the_last_rows_in_position_order():
    from dflash_mlx.cache.context import ContextCache

    cache = ContextCache(keep=0, recent=4)  # a sliding window of 5 holds the last 4 rows
    rows = lambda a, b: mx.arange(a, b, dtype=mx.float32).reshape(1, 1, -1, 1)  # noqa: E731
    pos = 0
    for n in (3, 1, 1, 2, 1):  # context rows per step (1: a step that accepted nothing), then a 3-row block
        k, _ = cache.update_and_fetch(rows(pos, pos + n + 3), rows(pos, pos + n + 3))
        assert k[0, 0, :, 0].tolist() == list(range(max(0, pos - 4), pos + n + 3))  # position order, always
        cache.trim(3)
        pos += n
        assert cache.positions == [pos] and cache.keys[0, 0, : cache.lengths[0], 0].tolist() == list(range(max(0, pos - 4), pos))
    cache.skip([6])  # rows no block row can see: positions only
    assert cache.positions == [pos + 6] and cache.offset == pos + 6



def test_draft_window_is_read_written_and_defaulted(tmp_path):
    """dflash_config.draft_window (written by ``train``) is the drafter's default context window; without
    it, a drafter whose every layer slides reads (0, window - 1), any other the documented default."""
    from dflash_mlx.models import DEFAULT_DRAFT_WINDOW, save_drafter as save, drafter_config as written

    config = drafter_config(TARGETS["qwen3"])
    config["dflash_config"]["draft_window"] = [8, 128]
    drafter = load_drafter(str(save_drafter(tmp_path / "a", config)))
    assert drafter.args.draft_window == [8, 128] and drafter.args.context_window() == (8, 128)
    assert written(drafter)["dflash_config"]["draft_window"] == [8, 128]
    save(drafter, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dflash_config"]["draft_window"] == [8, 128]
    assert load_drafter(str(tmp_path / "b")).args.context_window() == (8, 128)

    released = load_drafter(str(save_drafter(tmp_path / "c", drafter_config(TARGETS["qwen3"])))).args
    assert released.draft_window is None and released.context_window() == DEFAULT_DRAFT_WINDOW
    assert "draft_window" not in written(load_drafter(str(tmp_path / "c")))["dflash_config"]
    sliding = drafter_config(TARGETS["qwen3"], layer_types=["sliding_attention"] * 2, sliding_window=48)
    assert load_drafter(str(save_drafter(tmp_path / "d", sliding))).args.context_window() == (0, 47)
    mixed = drafter_config(TARGETS["qwen3"], layer_types=["sliding_attention", "full_attention"], sliding_window=48)
    assert load_drafter(str(save_drafter(tmp_path / "e", mixed))).args.context_window() == DEFAULT_DRAFT_WINDOW


def test_a_drafter_computes_in_its_targets_dtype(tiny_pair, tmp_path):
    """A float16 drafter beside a float32 target is loaded in float32: mixed, MLX would widen its
    weights at every forward."""
    import dflash_mlx
    from dflash_mlx.models import save_drafter as save

    target, draft = tiny_pair("qwen3")
    half = tmp_path / "half"
    save(load_drafter(str(draft)), half, mx.float16)
    assert load_drafter(str(half)).fc.weight.dtype == mx.float16
    model, _ = dflash_mlx.load(str(target), str(half))
    dtypes = {v.dtype for _, v in tree_flatten(model.drafter.parameters())}
    assert model.target.dtype == mx.float32 and mx.float16 not in dtypes and mx.float32 in dtypes
