"""`dflash-mlx train`: train a DFlash drafter for an mlx_lm target.

The recipe follows SpecForge's public one, which the DFlash paper's drafters were trained with:

1. Data: the target answers the training prompts itself (greedy), so the drafter
   learns the target's distribution; the target's hidden states at
   ``target_layer_ids`` over prompt + answer are computed once per sequence
   (cached in ``--out/cache``, so more prompts cost only their own pass) and kept in memory.
   Texts the target did not write (``--texts``) are learned teacher-forced instead: one target
   pass over a text gives its hidden states and the target's greedy token after every position,
   and a block's labels are those tokens up to the first position where the text departs from
   the target's own continuation: exact labels without generating answers (``data.make_batch``).
2. Each step samples random anchors in the answers. Every anchor ``a`` makes a
   block ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1``; all blocks of a
   sequence go through one drafter forward whose mask lets a block see the
   context rows strictly before its anchor and its own block, which is exactly
   what the block sees at inference (``Drafter.__call__``).
3. Loss: cross-entropy at block positions k = 1..B-1 (labels ``x_{a+k}``),
   weighted ``exp(-(k-1)/gamma)`` and normalised by the weight sum, because early
   positions decide how much of a block is accepted. The target's embedding and
   LM head are shared and frozen. AdamW, 4% warmup then cosine decay, grad clip 1.0.

Progress shows the loss, top-1 accuracy at block positions, and ``tau~``: the
acceptance length greedy verification would give on the same blocks
(1 + the number of leading correct positions), a cheap proxy of the real tau
that the held-out evaluation at the end measures with ``stream_generate``.

Under ``mlx.launch`` the ranks split every batch and average their gradients (``ranks``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..copying import corpus_index
from .data import cached_hidden, draft_vocabulary, generate_responses, load_prompts, make_batch, prompt_ids, sequences
from .ranks import Ranks
from ..models import Attention, Drafter, DrafterArgs, default_target_layer_ids, load_drafter, save_drafter
from ..errors import DFlashError
from ..flags import draft_window_arg
from ..model import check_pair, load_target
from ..target import Target

# Loss decay per block size from the paper; other sizes interpolate (B / 2.2).
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return GAMMA.get(block_size, round(block_size / 2.2, 1))


# ---------------------------------------------------------------------------------------------
# Training forward: the inference forward of Drafter, for many blocks at once


def context_positions(context_len: int, tail_start: mx.array, keep: int = 0) -> mx.array:
    """(S, C) positions of the context rows: the first ``keep`` are positions 0..keep-1, the rest
    run on from ``tail_start`` (S,) (0 and everything in one run without a window)."""
    rows = mx.arange(context_len)[None]
    return mx.where(rows < keep, rows, tail_start[:, None] + rows - keep)


def block_mask(anchors: mx.array, positions: mx.array, block_size: int,
               window: tuple[int, int] | None = None) -> mx.array:
    """(S, 1, N*B, C + N*B) boolean mask: block j sees the context rows before anchor j (with a
    ``window`` (keep, recent), only the first keep positions and the last recent before it) and itself."""
    S, N = anchors.shape
    before = anchors[:, :, None]
    pos = positions[:, None, :]  # (S, 1, C)
    sees_context = pos < before  # (S, N, C)
    if window is not None:
        keep, recent = window
        sees_context = sees_context & ((pos < keep) | (pos >= before - recent))
    sees_context = mx.repeat(sees_context, block_size, axis=1)  # (S, N*B, C)
    block_id = mx.arange(N * block_size) // block_size
    sees_block = block_id[:, None] == block_id[None, :]  # (N*B, N*B)
    sees_block = mx.broadcast_to(sees_block, (S, N * block_size, N * block_size))
    return mx.concatenate([sees_context, sees_block], axis=-1)[:, None]


def _attention(attn: Attention, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array,
               tail_start: mx.array, keep: int) -> mx.array:
    """``Attention.__call__`` for (S, N, B, H) blocks over (S, C, H) context rows (see ``context_positions``)."""
    S, N, B, _ = x.shape

    def heads(h, n, rows):  # -> (rows, n, len, head_dim)
        return h.reshape(rows, -1, n, h.shape[-1] // n).transpose(0, 2, 1, 3)

    def per_sequence(h):  # (S*N, n, B, d) -> (S, n, N*B, d)
        return h.reshape(S, N, h.shape[1], B, -1).transpose(0, 2, 1, 3, 4).reshape(S, h.shape[1], N * B, -1)

    # Block rows sit at absolute positions anchor..anchor+B-1; context rows as context_positions says.
    offsets = anchors.reshape(-1)
    xb = x.reshape(S * N, B, -1)
    q = attn.rope(attn.q_norm(heads(attn.q_proj(xb), attn.n_heads, S * N)), offset=offsets)
    kb = attn.rope(attn.k_norm(heads(attn.k_proj(xb), attn.n_kv_heads, S * N)), offset=offsets)
    vb = heads(attn.v_proj(xb), attn.n_kv_heads, S * N)
    kc = attn.k_norm(heads(attn.k_proj(context), attn.n_kv_heads, S))
    tail = attn.rope(kc[:, :, keep:], offset=tail_start)
    kc = mx.concatenate([attn.rope(kc[:, :, :keep]), tail], axis=2) if keep else tail
    vc = heads(attn.v_proj(context), attn.n_kv_heads, S)
    k = mx.concatenate([kc, per_sequence(kb)], axis=2)
    v = mx.concatenate([vc, per_sequence(vb)], axis=2)
    out = mx.fast.scaled_dot_product_attention(per_sequence(q), k, v, scale=attn.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(S, N, B, -1)
    return attn.o_proj(out)


def training_hidden(
    drafter: Drafter, context_hidden: mx.array, block_embeddings: mx.array, anchors: mx.array,
    window: tuple[int, int] | None = None, tail_start: mx.array | None = None,
) -> mx.array:
    """Final-normed drafter states (S, N, B-1, H) at block positions 1..B-1.

    context_hidden: (S, C, k*H) target hidden states of each sequence: all its rows from position
    0 on, or with ``window`` (keep, recent) its first keep rows followed by a run from ``tail_start``
    (S,) (``data.make_batch`` drops the rows no block can see);
    block_embeddings: (S, N, B, H) embeddings of ``[x_anchor, MASK...]``;
    anchors: (S, N) anchor positions. Same math as ``Drafter.__call__`` run once per block with
    the context rows before the anchor (within the window: the first keep and the last recent).
    """
    if drafter.architecture != Drafter.architecture:
        raise DFlashError(f"training {drafter.architecture} drafters is not supported yet: train a DFlashDraftModel")
    if any(layer.self_attn.sliding_window for layer in drafter.layers):
        raise DFlashError("training drafters with sliding-window layers is not supported: drop layer_types")
    S, _, B, _ = block_embeddings.shape
    keep, tail_start = window[0] if window else 0, mx.zeros((S,), mx.int32) if tail_start is None else tail_start
    context = drafter.hidden_norm(drafter.fc(context_hidden))
    mask = block_mask(anchors, context_positions(context.shape[1], tail_start, keep), B, window)
    h = block_embeddings
    for layer in drafter.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), context, anchors, mask, tail_start, keep)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)[:, :, 1:]


def label_weights(weights: mx.array, valid: mx.array, columns: mx.array) -> mx.array:
    """Each label's loss weight: its position's ``weights``, zero where invalid or, ``columns``
    -1, not in the draft vocabulary (unpredictable: no loss, and counted as a miss)."""
    return weights * (valid & (columns >= 0))


def loss_fn(drafter, target, head, context, tail_start, block_tokens, anchors, columns, valid, norm, weights, window):
    """The weighted cross-entropy of these rows over ``norm`` (the batch's weight sum; see ``ranks``)."""
    h = training_hidden(drafter, context, target.embed(block_tokens), anchors, window, tail_start)
    logits = head(h)
    w = label_weights(weights, valid, columns)
    loss = (nn.losses.cross_entropy(logits, mx.maximum(columns, 0)) * w).sum() / norm
    return loss, logits.argmax(-1) == columns


def label_columns(rows: mx.array | None, vocab_size: int) -> mx.array:
    """(V,) map from token id to its column in the drafter's head, -1 if absent."""
    if rows is None:
        return mx.arange(vocab_size, dtype=mx.int32)
    return mx.full((vocab_size,), -1, mx.int32).at[rows].add(mx.arange(rows.size, dtype=mx.int32) + 1)


def block_tokens(first: mx.array, block_size: int, mask_token_id: int) -> mx.array:
    S, N = first.shape
    masks = mx.full((S, N, block_size - 1), mask_token_id, mx.int32)
    return mx.concatenate([first[..., None], masks], axis=-1)


def acceptance_proxy(correct: np.ndarray, valid: np.ndarray) -> tuple[float, float]:
    """(top-1 accuracy, mean 1 + leading correct positions) over valid anchors."""
    hits = correct & valid
    accuracy = hits.sum() / max(valid.sum(), 1)
    run = np.cumprod(hits, axis=-1).sum(-1)
    anchors = valid[..., 0]
    return float(accuracy), float((1 + run)[anchors].mean()) if anchors.any() else 0.0


def batch_pools(lengths: list[int], num_answers: int, batch_seqs: int, text_share: float | None) -> list[list[list[int]]]:
    """Batches of sequence indices: one pool of all sequences, or with a ``text_share`` the answers
    (the first ``num_answers``) and the texts apart. Sequences of similar length share a batch (less padding)."""
    spans = [range(len(lengths))] if text_share is None else [range(num_answers), range(num_answers, len(lengths))]
    pools = []
    for span in spans:
        by_length = sorted(span, key=lambda i: lengths[i])
        pools.append([by_length[i : i + batch_seqs] for i in range(0, len(by_length), batch_seqs)])
    return pools


def step_batch(pools: list[list[list[int]]], text_share: float | None, seed: int, step: int) -> list[int]:
    """The batch of ``step``. Each pool goes through its batches in a new order every epoch, from
    (seed, pool, epoch). With a ``text_share`` the texts' pool takes the steps where
    ``floor(step * share)`` grows, so any number of texts fills that share of the steps."""
    pool, n = 0, step
    if text_share is not None:
        texts_before = int(step * text_share)
        if int((step + 1) * text_share) > texts_before:
            pool, n = 1, texts_before
        else:
            n = step - texts_before
    epoch, k = divmod(n, len(pools[pool]))
    order = np.random.default_rng([seed, epoch] if pool == 0 else [seed, 2, epoch]).permutation(len(pools[pool]))
    return pools[pool][order[k]]


# ---------------------------------------------------------------------------------------------
# Training checkpoints: the drafter in the released layout, plus optimizer state


def save_checkpoint(out: Path, drafter: Drafter, optimizer: optim.Optimizer, step: int, train_config: dict) -> None:
    save_drafter(drafter, out)
    # Not .safetensors: loaders read every safetensors file in a drafter folder.
    mx.savez(str(out / "optimizer.npz"), **dict(tree_flatten(optimizer.state)))
    (out / "trainer_state.json").write_text(json.dumps({"step": step, "train_config": train_config}, indent=2) + "\n")


def load_checkpoint(out: Path, drafter: Drafter, optimizer: optim.Optimizer) -> int:
    state = json.loads((out / "trainer_state.json").read_text())
    drafter.load_weights(str(out / "model.safetensors"))
    optimizer.state = tree_unflatten(list(mx.load(str(out / "optimizer.npz")).items()))
    return state["step"]


# ---------------------------------------------------------------------------------------------
# The run


def make_drafter_args(target: Target, *, num_layers: int, block_size: int, target_layer_ids: list[int] | None,
                      mask_token_id: int, intermediate_size: int | None = None) -> DrafterArgs:
    """A drafter with the loaded target's attention geometry (so RoPE and head sizes match),
    read from the model's own args: Hub ids and configs nested under text_config alike."""
    t, L = target.args, len(target.layers)
    heads = t.num_attention_heads
    return DrafterArgs(
        hidden_size=t.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
        intermediate_size=intermediate_size or t.intermediate_size,
        vocab_size=t.vocab_size,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        num_target_layers=L,
        rope_theta=getattr(t, "rope_theta", None) or 10000.0,
        max_position_embeddings=getattr(t, "max_position_embeddings", None) or 4096,
        block_size=block_size,
        target_layer_ids=target_layer_ids or default_target_layer_ids(L, num_layers),
        mask_token_id=mask_token_id,
    )


def init_from_target(drafter: Drafter, target: Target) -> None:
    """Start the drafter as the target's last layers instead of at random.

    Drafter layer i copies target layer ``L - n + i`` (same geometry by
    construction), the final norm copies the target's, and ``fc``/``hidden_norm``
    start by passing the deepest tapped layer through that first layer's input
    norm, so the context keys/values begin as the ones the target itself computes
    there. On small budgets this start learns faster than a random one (200-step
    pilot on SmolLM2: held-out loss 5.32 vs 5.58).
    """
    if target.final_norm is None:
        raise DFlashError("--init target found no final norm on this target: use --init random")
    n, H = len(drafter.layers), drafter.args.hidden_size
    for layer, source in zip(drafter.layers, target.layers[-n:]):
        weights = dict(tree_flatten(source.parameters()))
        ours = dict(tree_flatten(layer.parameters()))
        shared = [(k, v) for k, v in weights.items() if k in ours and ours[k].shape == v.shape]
        if len(shared) != len(weights):
            raise DFlashError("--init target needs target layers shaped like the drafter's: use --init random")
        layer.load_weights(shared, strict=False)
    fc = mx.zeros((H, len(drafter.args.target_layer_ids) * H))
    deepest = int(np.argmax(drafter.args.target_layer_ids))
    drafter.fc.weight = fc.at[:, deepest * H : (deepest + 1) * H].add(mx.eye(H))
    drafter.hidden_norm.weight = mx.array(target.layers[-n].input_layernorm.weight)
    drafter.norm.weight = mx.array(target.final_norm.weight)


def default_mask_token(tokenizer) -> int:
    """A token the target never writes in answers: pad/unk if distinct from EOS, else id 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.unk_token_id):
        if tid is not None and tid not in tokenizer.eos_token_ids:
            return tid
    return 0


def evaluate_tau(target: Target, drafter: Drafter, tokenizer, prompts: list[str | list[dict]], max_tokens: int,
                 progress=None, draft_window: tuple[int, int] | None = None) -> dict:
    """Real greedy DFlash generations on held-out prompts: tau = tokens / steps, of the drafter
    alone (one chain at its block size, no copies, no trees), so the figure is the same on every
    machine: the auto policy's choices follow the machine's measured costs."""
    from ..generation import stream_generate
    from ..model import DFlashModel

    model = DFlashModel(target, drafter)
    lengths: list[int] = []
    for prompt in prompts:
        prompt = prompt_ids(tokenizer, prompt)
        response = None
        for response in stream_generate(model, tokenizer, prompt, max_tokens, block_size=drafter.args.block_size,
                                        draft_window=draft_window, copy_proposals=False, tree_budget=0):
            pass
        lengths += response.stats.acceptance_lengths
        if progress is not None:
            progress.update(1)
    hist = {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))} if lengths else {}
    return {"tau": sum(lengths) / max(len(lengths), 1), "steps": len(lengths), "histogram": hist}


NEW_DRAFTER = ("target", "random")
ARCHITECTURE_FLAGS = ("num_layers", "intermediate_size", "target_layer_ids", "draft_vocab_size", "mask_token_id")


def trained_drafter(args: argparse.Namespace, model: nn.Module) -> Drafter:
    """``--init DRAFTER``: continue from a trained drafter (e.g. on new answers), keeping its
    architecture, taps and draft vocabulary, which flags could only contradict."""
    given = [f"--{k.replace('_', '-')}" for k in ARCHITECTURE_FLAGS if getattr(args, k) is not None]
    if given:
        raise DFlashError(f"--init {args.init} keeps that drafter's architecture: drop {' '.join(given)}")
    drafter = load_drafter(args.init, mx.float32)
    if any(k.endswith(".scales") for k, _ in tree_flatten(drafter.parameters())):
        raise DFlashError(f"--init {args.init} is quantized and cannot be trained: start from the float drafter")
    check_pair(Target(model, []), drafter)
    drafter.args.block_size = args.block_size or drafter.args.block_size
    return drafter


def new_drafter(args: argparse.Namespace, model: nn.Module, tokenizer) -> Drafter:
    """``--init target`` or ``--init random``: a drafter shaped by the flags and the target (its draft
    vocabulary is chosen once the target's labels are known)."""
    mask_id = default_mask_token(tokenizer) if args.mask_token_id is None else args.mask_token_id
    dargs = make_drafter_args(Target(model, []), num_layers=args.num_layers or 1, block_size=args.block_size or 16,
                              target_layer_ids=args.target_layer_ids, mask_token_id=mask_id,
                              intermediate_size=args.intermediate_size)
    if args.draft_vocab_size:
        dargs.draft_vocab_size = min(args.draft_vocab_size, dargs.vocab_size)
    drafter = Drafter(dargs)
    if args.init == "target":
        init_from_target(drafter, Target(model, dargs.target_layer_ids))
    return drafter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Target: mlx_lm model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", "-o", required=True, help="Output folder: drafter checkpoint, data cache, logs")
    p.add_argument("--prompts", nargs="+", default=["gsm8k", "stdlib", "sharegpt"],
                   help="Prompt sources: gsm8k[:PATH], sharegpt, stdlib, PATH.jsonl, PATH.txt (mixed round-robin)")
    p.add_argument("--num-prompts", type=int, default=1000, help="Training prompts (the target answers each)")
    p.add_argument("--skip-prompts", type=int, default=0,
                   help="Skip the first N prompts of the mixed order (those an earlier run with this seed used)")
    p.add_argument("--texts", nargs="+", default=[],
                   help="Text sources (the --prompts kinds) learned teacher-forced: the labels are the target's greedy "
                        "token at every position, from one target pass per text, no answers generated")
    p.add_argument("--num-texts", type=int, default=0, help="Texts drawn from --texts")
    p.add_argument("--max-text-tokens", type=int, default=4096, help="Texts are cut to this many tokens")
    p.add_argument("--text-share", type=float, default=None,
                   help="Fraction of the steps that train on texts, however many texts there are (default: "
                        "texts and answers batched as one pool, so the share is the texts' share of the sequences)")
    p.add_argument("--eval-prompts", type=int, default=12, help="Held-out prompts for the final tau evaluation")
    p.add_argument("--max-response-tokens", type=int, default=256, help="Target answer length cap")
    p.add_argument("--gen-batch-size", type=int, default=32, help="Batch size of the target's answer generation")
    p.add_argument("--num-layers", type=int, default=None, help="Drafter decoder layers (default: 1)")
    p.add_argument("--intermediate-size", type=int, default=None, help="Drafter MLP width (default: the target's)")
    p.add_argument("--init", default="target",
                   help="Drafter start: 'target' (copies of its last layers), 'random', or a drafter folder or "
                        "Hub id to continue training (its architecture and draft vocabulary are kept)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="Target layers fed to the drafter")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="Propose only the N most frequent answer tokens (faster drafts and training; default: all)")
    p.add_argument("--draft-window", type=draft_window_arg, default=None, metavar="KEEP:RECENT",
                   help="Blocks read the first KEEP and last RECENT context rows before them; recorded in the "
                        "checkpoint as its default (default: the --init drafter's, else the whole context)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="Longer prompts are left out (raise it for the long sources docs, code, chats)")
    p.add_argument("--block-size", type=int, default=None,
                   help="Draft block size B (anchor + B-1 proposals; default: the --init drafter's, else 16)")
    p.add_argument("--gamma", type=float, default=None, help="Loss decay over block positions (default: 7/5/4 for B 16/10/8)")
    p.add_argument("--mask-token-id", type=int, default=None, help="Mask token (default: pad/unk, else 0)")
    p.add_argument("--steps", type=int, default=600, help="Optimizer steps")
    p.add_argument("--batch-seqs", type=int, default=4, help="Sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="Random anchors (blocks) per sequence per step")
    p.add_argument("--lr", type=float, default=6e-4, help="Peak learning rate")
    p.add_argument("--warmup", type=float, default=0.04, help="Warmup fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--save-every", type=int, default=50, help="Checkpoint every N steps")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="Tokens per held-out generation")
    p.add_argument("--seed", type=int, default=0, help="Seed for prompts, init and anchors")
    p.add_argument("--resume", action="store_true", help="Continue from the checkpoint in --out")


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    out = Path(args.out)
    if not args.resume and (out / "trainer_state.json").exists():
        raise DFlashError(f"{out} already holds a training run: pass --resume to continue it or choose another --out")
    if args.block_size is not None and args.block_size < 2:
        raise DFlashError(f"--block-size {args.block_size} leaves nothing to draft: use 2 or more")
    if bool(args.texts) != bool(args.num_texts):
        raise DFlashError("--texts and --num-texts go together: give the sources and how many texts to read")
    if args.text_share is not None and not (args.texts and args.num_prompts and 0 < args.text_share < 1):
        raise DFlashError(f"--text-share {args.text_share} splits the steps between answers and texts: give "
                          "--num-prompts and --texts with a share between 0 and 1, or leave it out")
    ranks = Ranks(args.batch_seqs)
    model_path = args.model
    if model_path is None:
        from ..default import default_target

        model_path = str(default_target())
    model, tokenizer = load_target(model_path)  # one-line errors for a bad path or architecture
    trained = None if args.init in NEW_DRAFTER else trained_drafter(args, model)  # fails before the answers
    out.mkdir(parents=True, exist_ok=True)  # only once the target loaded: no empty folder on a bad --model
    mx.random.seed(args.seed)

    quiet = ranks.rank > 0  # rank 0 alone shows progress and writes to --out
    with ranks.rank0_first(out / "data.jsonl"):  # rank 0 makes the data; the other ranks then read it
        prompts = load_prompts(args.prompts, args.skip_prompts + args.num_prompts + args.eval_prompts, args.seed)
        prompts = prompts[args.skip_prompts :]
        train_prompts, eval_prompts = prompts[: args.num_prompts], prompts[args.num_prompts :]
        tic = time.perf_counter()
        with tqdm(desc="target answers", unit="prompt", dynamic_ncols=True, disable=quiet) as bar:
            records = generate_responses(model, tokenizer, train_prompts, out / "data.jsonl",
                                         max_tokens=args.max_response_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                         batch_size=args.gen_batch_size, progress=bar)
        records = [r for r in records if r["id"] < len(train_prompts)]
        data_seconds = time.perf_counter() - tic

        seqs = sequences(records, tokenizer.eos_token_id, args.max_response_tokens)
        num_tokens = sum(len(t) - a for t, a in seqs)
        texts = [(np.array(prompt_ids(tokenizer, t)[: args.max_text_tokens], np.int32), 1)
                 for t in load_prompts(args.texts, args.num_texts, args.seed)]
        texts = [(t, a) for t, a in texts if len(t) >= 3]  # an anchor needs a token before it and one after
        if not seqs and not texts:
            raise DFlashError("nothing to train on: give --num-prompts answers or --texts with --num-texts")
        if args.text_share is not None and not (seqs and texts):
            raise DFlashError(f"--text-share has no {'answers' if texts else 'texts'} to share the steps with: "
                              "check --max-prompt-tokens and the sources, or leave --text-share out")
        drafter = trained or new_drafter(args, model, tokenizer)
        # The answers it learns from are also the corpus it copies from (copying.py).
        earlier = drafter.corpus.tokens if drafter.corpus is not None else []
        drafter.corpus = corpus_index(earlier + [t for r in records for t in r["response_ids"]])
        dargs = drafter.args
        # Blocks see the context through the window the drafter reads at inference; the checkpoint records it.
        window = args.draft_window or (tuple(dargs.draft_window) if dargs.draft_window else None)
        dargs.draft_window = list(window) if window else None
        target = Target(model, dargs.target_layer_ids)
        model.freeze()
        # Beside the checkpoint, in shards a rerun with more prompts extends.
        tic = time.perf_counter()
        with tqdm(desc="target hidden states", unit="seq", dynamic_ncols=True, disable=quiet) as bar:
            hidden, greedy = cached_hidden(out / "cache", target, seqs, progress=bar)
        with tqdm(desc="texts, teacher-forced", unit="text", dynamic_ncols=True, disable=quiet or not texts) as bar:
            text_hidden, text_greedy = cached_hidden(out / "cache", target, texts, progress=bar, texts=True)
        hidden_seconds = time.perf_counter() - tic  # the target's passes over answers and texts (this run's)
    text_tokens = sum(len(t) for t, _ in texts)
    seqs, hidden, greedy = seqs + texts, hidden + text_hidden, greedy + text_greedy
    if trained is None and dargs.draft_vocab_size:
        drafter.draft_vocab = draft_vocabulary(seqs, dargs.draft_vocab_size, dargs.vocab_size, greedy)
    mx.eval(drafter.parameters())
    warmup = max(1, int(args.warmup * args.steps))
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, args.lr, warmup), optim.cosine_decay(args.lr, max(1, args.steps - warmup), 0.1 * args.lr)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=args.weight_decay)
    train_config = {k: v for k, v in vars(args).items() if k not in ("func", "resume")}
    step = load_checkpoint(out, drafter, optimizer) if args.resume and (out / "trainer_state.json").exists() else 0
    ranks.broadcast(drafter)

    B = dargs.block_size
    gamma = args.gamma or default_gamma(B)
    weights = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / gamma)
    head, columns = target.head(drafter.vocab_rows), label_columns(drafter.vocab_rows, dargs.vocab_size)
    grad_fn = nn.value_and_grad(drafter, lambda *a: loss_fn(drafter, target, head, *a, weights, window))

    def train_step(batch):
        """One update from the whole batch; this rank computes its rows' part (``ranks``)."""
        norm = label_weights(weights, batch[-1], columns[batch[-2]]).sum() / ranks.size
        context, tail_start, first, anchors, labels, valid = ranks.rows(batch)
        (loss, correct), grads = grad_fn(context, tail_start, block_tokens(first, B, dargs.mask_token_id), anchors,
                                         columns[labels], valid, norm)
        grads, _ = optim.clip_grad_norm(ranks.average(grads), 1.0)
        optimizer.update(drafter, grads)
        return ranks.mean(loss), ranks.gather(correct, len(batch[-1]))

    # Each step's anchors come from (seed, step), its batch from ``step_batch``: a resumed run
    # continues exactly where it stopped.
    pools = batch_pools([len(t) for t, _ in seqs], len(seqs) - len(texts), args.batch_seqs, args.text_share)
    tic = time.perf_counter()
    ema = None
    with tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True, disable=quiet) as bar:
        while step < args.steps:
            batch = make_batch(seqs, hidden, step_batch(pools, args.text_share, args.seed, step),
                               np.random.default_rng([args.seed, 1, step]), args.anchors, B,
                               window, greedy)
            loss, correct = train_step(batch)
            mx.eval(loss, correct, drafter.parameters(), optimizer.state)
            step += 1
            acc, tau = acceptance_proxy(np.array(correct), np.array(batch[-1]))
            now = np.array([loss.item(), acc, tau])
            ema = now if ema is None else 0.9 * ema + 0.1 * now
            bar.set_postfix(loss=f"{ema[0]:.3f}", acc=f"{ema[1]:.3f}", tau=f"{ema[2]:.2f}", lr=f"{schedule(step).item():.1e}")
            bar.update(1)
            if not quiet and (step % args.save_every == 0 or step == args.steps):
                save_checkpoint(out, drafter, optimizer, step, train_config)
    train_seconds = time.perf_counter() - tic
    if ranks.rank:
        ranks.follow()

    result = {"answer_tokens": num_tokens, "text_tokens": text_tokens, "sequences": len(seqs), "data_seconds": round(data_seconds, 1),
              "hidden_seconds": round(hidden_seconds, 1), "train_seconds": round(train_seconds, 1), "final_loss": None if ema is None else round(float(ema[0]), 4),
              "final_tau_proxy": None if ema is None else round(float(ema[2]), 3), "ranks": ranks.size}
    if eval_prompts:
        with tqdm(total=len(eval_prompts), desc="held-out tau", unit="prompt", dynamic_ncols=True) as bar:
            result["held_out"] = evaluate_tau(target, drafter, tokenizer, eval_prompts, args.eval_max_tokens, bar, window)
        print(f"held-out tau {result['held_out']['tau']:.2f} over {result['held_out']['steps']} steps "
              f"({len(eval_prompts)} prompts), histogram {result['held_out']['histogram']}")
    (out / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"drafter written to {out} ({num_tokens} answer tokens, {len(seqs)} sequences; "
          f"a copy corpus of {len(drafter.corpus.tokens)} tokens)")
