"""Tiny models the tests build themselves: tokenizer, mlx_lm targets, drafters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from dflash_mlx.copying import Copy
from dflash_mlx.policy import PLAIN, Acceptance, BlockPolicy, Plan
from dflash_mlx.models import Drafter, drafter_classes

SPECIALS = ["<pad>", "<s>", "</s>", "<mask>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
VOCAB = len(SPECIALS) + len(CHARS)
NO_EOS = {"2": -100.0}  # a request's logit_bias that keeps a tiny model talking: long, predictable outputs
EOS_ID, MASK_ID = 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TARGETS = {
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
# Families mlx_lm runs through the same attention as these (qwen2: with biases; mistral: llama's class)
TARGETS["qwen2"] = {**{k: v for k, v in TARGETS["qwen3"].items() if k != "head_dim"}, "model_type": "qwen2"}
TARGETS["mistral"] = dict(TARGETS["llama"], model_type="mistral")


def save_tokenizer(path: Path) -> None:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def save_target(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """An mlx_lm model of ``family`` (config entries replaced by ``overrides``) with random fp32
    weights, as a model folder."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    config = dict(TARGETS[family], eos_token_id=EOS_ID, **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Default init gives a near-constant output; larger matrices make the random
    # model "chatty" (varied, peaked next-token choices), a harder test.
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    save_tokenizer(path)
    return path


def drafter_config(target_config: dict, **overrides) -> dict:
    """A config.json in the released DFlash layout for a target."""
    n_layers = overrides.pop("num_hidden_layers", 2)
    layer_ids = overrides.pop("target_layer_ids", [1, 4][:n_layers] if n_layers <= 2 else None)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_config["hidden_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": target_config["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": target_config["rope_theta"],
        "max_position_embeddings": 4096,
        "block_size": 16,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": MASK_ID},
    }
    if layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = layer_ids
    config.update(overrides)
    return config


def make_drafter(config: dict) -> Drafter:
    """A randomly initialised drafter of the architecture ``config`` names."""
    args_class, model_class = drafter_classes(config)
    return model_class(args_class.from_config(config))


def save_drafter(path: Path, config: dict, seed: int = 1, dtype=mx.float32) -> Path:
    """Random drafter weights saved like the released PyTorch checkpoints."""
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = make_drafter(config)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass
class PolicyRow:
    """What the block policy reads of a running request (``request.Row``), for driving it alone."""

    acceptance: Acceptance
    copy: Copy | None = None
    block_cap: int | None = None
    room: int = 1000
    context: int = 128
    merges: bool = True


class ScriptedPolicy(BlockPolicy):
    """A block policy that plays ``sizes`` over and over (1: a plain step, else a drafted block) and
    always says a plain step comes next: the engine then runs each plain step's successor ahead,
    so a drafted block after it verifies its proposals after an anchor that already ran."""

    def __init__(self, sizes: list[int]):
        super().__init__(max(sizes), prior=0.5, optimism=0.0)
        self.sizes, self.step = sizes, 0

    def plan(self, rows, waiting: bool = False, head_start: bool = False, trees: bool = False) -> Plan:
        B, self.step = self.sizes[self.step % len(self.sizes)], self.step + 1
        return PLAIN if B == 1 else Plan(B, True, tree=trees)

    def expects_plain(self, rows, waiting: bool = False, trees: bool = False) -> bool:
        return True


def decode(model, prompt: list[int], max_tokens: int, *, engine_kwargs: dict | None = None, **request):
    """One request through the engine alone: its tokens (the stop token included) and its stats."""
    from dflash_mlx import Engine

    engine = Engine(model, max_rows=1, **(engine_kwargs or {}))
    engine.add(prompt, max_tokens=max_tokens, **request)
    events = []
    while not engine.idle:
        events += engine.step()
    return [e.token for e in events], events[-1].stats


class _Oracle:
    """A drafter that knows the answer: the target's own continuation.

    It still runs the real drafter forward (so cache bookkeeping is exercised) but replaces its
    scores with a peak on the reference token (none where a draft vocabulary lacks it), corrupting
    every ``wrong``-th position (0: never) so some blocks are rejected part-way. Every row drafts
    ``reference``; with ``engine`` set, row r drafts ``refs[uid]`` of request ``engine.uids[r]``
    (prompt + the target's continuation), wrong every ``wrong[uid]``-th position. A DFlash2
    selector picks the peak too (it dwarfs the selector's pairwise term).
    """

    def hidden(self, block_embeddings, context_hidden, cache, ops):
        out = super().hidden(block_embeddings, context_hidden, cache, ops)
        self._starts = list(cache[0].positions)  # the anchors' positions: context rows are 0..start-1
        return out

    def head_scores(self, hidden, lm_head):
        scores = super().head_scores(hidden, lm_head)
        R, L = hidden.shape[:2]
        rows = []
        for r in range(R):
            uid = self.engine.uids[r] if self.engine is not None else None
            ref = self.refs[uid] if uid is not None else self.reference
            every = self.wrong[uid] if uid is not None else self.wrong_every
            for pos in range(self._starts[r] + 1, self._starts[r] + L + 1):
                tok = ref[pos] if pos < len(ref) else 0
                rows.append((tok + 1) % self.args.vocab_size if every and pos % every == 0 else tok)
        ids = mx.arange(self.args.vocab_size) if self.vocab_rows is None else self.vocab_rows
        hot = ids == mx.array(rows).reshape(R, L, 1)
        # Depends on the real scores, so that the forward runs.
        return mx.depends(mx.where(hot, 1000.0, 0.0), scores)


def OracleDrafter(drafter: Drafter, reference: list[int] | None = None, wrong_every: int = 0) -> Drafter:
    """``drafter`` (DFlash or DFlash2, its weights shared) turned into an oracle (``_Oracle``)."""
    oracle = type(f"Oracle{type(drafter).__name__}", (_Oracle, type(drafter)), {})(drafter.args)
    oracle.update(drafter.parameters())
    oracle.reference, oracle.wrong_every = reference, wrong_every
    oracle.refs, oracle.wrong, oracle.engine = {}, {}, None
    return oracle


# -- released checkpoint layouts ---------------------------------------------------

SLIDING_WINDOW = 8
LAYOUTS = ["original", "2026", "gemma", "dflash2"]
# Longer than twice the window; released_drafters (conftest) trains on the target's answers to them.
LAYOUT_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n# now subtract\n"]
TRANSFORMERS_5_KEYS = {"transformers_version": "5.0.0", "use_cache": True, "attention_bias": False,
                       "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": False}


def layout_config(original: dict, layout: str) -> dict:
    """A drafter config.json in one of the layouts z-lab has released, from an original-layout one.

    - ``original``: ``block_size`` and ``rope_theta`` at the top level, ``torch_dtype``.
    - ``2026``: ``block_size`` in ``dflash_config``, YaRN RoPE in ``rope_parameters`` and no
      top-level ``rope_theta``, ``dtype``, sliding-window layers but the last, ``is_causal``,
      transformers-5 keys.
    - ``gemma``: the Gemma-target scalings (in ``dflash_config``; the softcap at the top level).
    - ``dflash2``: the DFlash2 architecture in the 2026 layout, every layer sliding.
    """
    c = json.loads(json.dumps(original))
    if layout in ("2026", "dflash2"):
        n = c["num_hidden_layers"]
        c["dflash_config"]["block_size"] = c.pop("block_size")
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0}
        c.pop("rope_scaling", None)
        c["dtype"] = c.pop("torch_dtype", "float32")
        c["sliding_window"] = SLIDING_WINDOW
        c.update(TRANSFORMERS_5_KEYS)
        if layout == "2026":
            c["layer_types"] = ["sliding_attention"] * (n - 1) + ["full_attention"]
            c["is_causal"] = True
        else:
            c["layer_types"] = ["sliding_attention"] * n
            c["architectures"] = ["DFlash2DraftModel"]
            c["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=4)
    elif layout == "gemma":
        c["dflash_config"].update(input_embedding_scale=1.25, output_multiplier=0.8)
        c["final_logit_softcapping"] = 8.0
    return c


def save_released(path: Path, drafter: Drafter, config: dict) -> Path:
    """``drafter``'s weights under the released names (DFlash2 codebooks without ``.weight``)."""
    path.mkdir(parents=True, exist_ok=True)
    weights = {k.removesuffix(".weight") if "_codebook." in k else k: v for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def train_drafter(drafter: Drafter, target, sequences: list[tuple[list[int], int]], steps: int, seed: int = 0) -> Drafter:
    """A few hundred Adam steps on the target's own greedy answers, one random block per step.

    ``sequences`` are (prompt + answer tokens, prompt length); ``target`` a dflash_mlx
    Target. Drafters must really draft in the equality tests (a random one accepts
    nothing and would hide a wrong forward); memorising the test prompts' answers is
    enough for that and takes seconds.
    """
    import mlx.nn as nn
    import mlx.optimizers as optim

    from dflash_mlx.kernels import get_ops

    rng, ops, B = np.random.default_rng(seed), get_ops(False), 8
    hidden = [target(mx.array([s]), None)[1] for s, _ in sequences]
    mask = drafter.args.mask_token_id

    def loss(model, tokens, anchor, context):
        block = mx.array([tokens[anchor]] + [mask] * (B - 1))
        logits = model(target.embed(block)[None], context[:, :anchor], model.make_cache(), target.lm_head, ops)[0]
        return nn.losses.cross_entropy(logits, mx.array(tokens[anchor + 1 : anchor + B])).mean()

    step, optimizer = nn.value_and_grad(drafter, loss), optim.Adam(3e-3)
    for _ in range(steps):
        i = rng.integers(len(sequences))
        tokens, prompt_len = sequences[i]
        _, grads = step(drafter, tokens, int(rng.integers(prompt_len - 1, len(tokens) - B)), hidden[i])
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)
    return drafter


def with_layers_of(drafter: Drafter, trained: Drafter, seed: int = 0) -> Drafter:
    """``drafter`` (any layout of the same shape) with ``trained``'s weights. DFlash2 extras start
    near neutral: convolutions near the identity, the selector's codebooks small and random, so
    they change some picks but not most."""
    drafter.load_weights(list(tree_flatten(trained.parameters())), strict=False)
    mx.random.seed(seed)
    for layer in drafter.layers:
        for conv in (layer.get("attention_conv"), layer.get("mlp_conv")):
            if conv is not None:
                conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
                conv.kernel_projection.weight = 0.02 * mx.random.normal(conv.kernel_projection.weight.shape)
    selector = drafter.get("candidate_selector")
    if selector is not None:
        for book in (selector.predecessor_codebook, selector.successor_codebook):
            book.weight = 0.5 * mx.random.normal(book.weight.shape)
        selector.hidden_projection.weight = 0.3 * mx.random.normal(selector.hidden_projection.weight.shape)
    mx.eval(drafter.parameters())
    return drafter


def async_evaluations(monkeypatch) -> list[list[mx.array]]:
    """Record the arrays of every ``mx.async_eval`` call from now on, one list per call."""
    calls, real = [], mx.async_eval

    def recording(*args):
        calls.append([a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)])
        return real(*args)

    monkeypatch.setattr(mx, "async_eval", recording)
    return calls


def reads_apart_from_next_forward(calls: list[list[mx.array]]) -> bool:
    """Whether some step's accepted count (a scalar) was queued for evaluation, and never together
    with a forward's logits (3-d): reading it then waits for its own step alone, not the next."""
    return (any(any(a.ndim == 0 for a in call) for call in calls)
            and not any(any(a.ndim == 0 for a in call) and any(a.ndim == 3 for a in call) for call in calls))


# -- servers --------------------------------------------------------------------------------------------


def start_server(*argv: str):
    """``dflash-mlx serve`` in this process, on a free port of 127.0.0.1 (close it with server.close)."""
    import argparse
    import threading

    from dflash_mlx.server import add_arguments, make_server

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = make_server(parser.parse_args(["--port", "0", *argv]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def metric(port: int, name: str) -> float:
    """One unlabelled value of the server's /metrics."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def leave_mid_answer(port: int, path: str, body: dict, stream: bool) -> None:
    """Send a request on a raw socket, and close the connection once it is being answered: once a streamed
    event arrived, or (not streaming) once the worker is generating."""
    import socket
    import time

    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), len(data), data))
        if stream:
            received = b""
            while b"data: " not in received:
                received += sock.recv(4096)
        else:
            while metric(port, "dflash_requests_active") < 1:
                time.sleep(0.05)


# -- a scripted tool-calling pair (the server's tool, thinking and API tests) --

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", CALL, "<think>", "</think>"]
TOOL_TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}assistant: {% for tool_call in m.tool_calls %}"
    "{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{%- endfor %}\n"
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% if tools and messages[-1].role != 'tool' %}~{% else %} {% endif %}"
    "{%- endif %}"
)
# What follows each token: with tools the prompt ends in "~" (the model calls a tool), without them or after
# a tool result in " " (it answers).
TOOL_CHAINS = [["~", "<think>", "h", "m", "</think>", "O", "K", "<tool_call>", CALL, "</tool_call>", "</s>"], [" ", "y", "o", "</s>"]]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def save_scripted_pair(root: Path) -> tuple[str, str]:
    """A tool-calling pair: a target that writes TOOL_CHAINS greedily, its tokenizer, and a random drafter.

    The target is a tiny llama whose layers add nothing (o_proj and down_proj
    are zero), so each next token depends on the last token alone; its head is
    built so that, after the tool-aware generation prompt, greedy decoding
    writes ``<think>hm</think>OK<tool_call>{...}</tool_call>`` and then EOS. The
    chat template renders tools and mentions ``<tool_call>`` and
    ``tool_call.name``, so mlx_lm infers its json_tools parser, as it does for
    Qwen-style templates.
    """
    from mlx_lm.models import llama

    target = root / "scripted"
    target.mkdir(parents=True)
    save_tokenizer(target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
    tok.save(str(target / "tokenizer.json"))
    config_file = target / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TOOL_TEMPLATE}))
    vocab = {t: i for i, t in enumerate(SPECIALS + [chr(i) for i in range(32, 127)] + ["\n"])}
    vocab.update({t: VOCAB + i for i, t in enumerate(TOOL_TOKENS)})
    config = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB + len(TOOL_TOKENS), max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=EOS_ID,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    embed = mx.random.normal((config["vocab_size"], 64))
    x = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True))  # what reaches the head
    head = mx.zeros_like(embed)
    for chain in TOOL_CHAINS:
        for a, b in zip(chain, chain[1:]):
            head[vocab[b]] = head[vocab[b]] + x[vocab[a]]  # after a, b scores |x|^2 = 64; others ~N(0, 64)
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head})
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps(config))
    draft = save_drafter(root / "scripted-draft", drafter_config(config, target_layer_ids=[0, 1]))
    return str(target), str(draft)
