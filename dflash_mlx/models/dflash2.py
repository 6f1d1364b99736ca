"""The DFlash2 architecture (``DFlash2DraftModel``): DFlash plus block-local convolutions and a
candidate selector.

Each decoder layer wraps its attention and its MLP in a grouped *dynamic causal
convolution* over the block rows: the layer's normed input predicts, per row and
channel group, K kernel taps added to learned base taps, so row t mixes rows
t-K+1..t (zero before the anchor). The first kernel convolves the sublayer's
input, the second its output.

Proposals are not the argmax of each row: at every block position the
drafter's top-k tokens are rescored with a low-rank pairwise term between the
previous pick and each candidate, ``pred[prev] . (P h) . succ[candidate]``, and
picked in order from the anchor on. The drafter's distribution at a position is
therefore the selector's softmax over its k candidates given the previous pick,
and that is the q the rejection sampler must be given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .dflash import DecoderLayer, Drafter, DrafterArgs, config_error


@dataclass
class DFlash2Args(DrafterArgs):
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    def check(self, config: dict[str, Any]) -> None:
        super().check(config)
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, key) < 1:
                raise config_error(f"dflash_config.{key}", f"is {getattr(self, key) or 'missing'}: a DFlash2 drafter "
                                   "needs a positive value", f"set dflash_config.{key} as the checkpoint was trained")
        if self.hidden_size % self.conv_group_size:
            raise config_error("dflash_config.conv_group_size", f"({self.conv_group_size}) does not divide "
                               f"hidden_size ({self.hidden_size})")
        if self.selector_top_k > self.vocab_size:
            raise config_error("dflash_config.selector_top_k", f"({self.selector_top_k}) exceeds vocab_size")
        if self.draft_vocab_size:
            raise config_error("draft_vocab_size", "is set, but DFlash2 drafters select over the whole vocabulary",
                               "drop draft_vocab_size")


def causal_conv(x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
    """out[t] = sum over o < K of (base[o] + dynamic[t, o, group]) * x[t - o], x[<0] = 0.

    x: (B, L, H); dynamic: (B, L, K, H / G), one tap per group of G channels;
    base: (K, H).
    """
    K, H = base.shape
    taps = base.astype(x.dtype) + mx.repeat(dynamic, H // dynamic.shape[-1], axis=-1)
    L = x.shape[1]
    padded = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
    return sum(taps[:, :, o] * padded[:, K - 1 - o : K - 1 - o + L] for o in range(K))


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The convolved input, and the dynamic taps ``finish`` applies to the sublayer's output."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return causal_conv(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return causal_conv(x, dynamic, self.base_kernel[1])


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, args: DFlash2Args, layer: int):
        super().__init__(args, layer)
        self.attention_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x, context, cache, ops):
        h, taps = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cache, ops), taps)
        h, taps = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), taps)


# Picks from a row of scores (B, k): the chosen index (B,) and the distribution (B, k) or None.
Pick = Callable[[mx.array], tuple[mx.array, Any]]


class CandidateSelector(nn.Module):
    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.top_k = args.selector_top_k
        # Released checkpoints store these two without ".weight" (load_drafter renames).
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def __call__(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array, pick: Pick
    ) -> tuple[mx.array, mx.array, mx.array | None, mx.array]:
        """Tokens (B, P), candidates (B, P, k), each position's q over them (B, P, k) or None, and
        the selector's probability of each chosen token (B, P).

        hidden: (B, P, H) final-normed drafter states, logits: (B, P, V),
        anchor: (B,) the token before position 0. ``pick`` maps a row of scores
        (B, k) to the chosen candidate index (B,) and its distribution (B, k).
        """
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        # succ[candidate] * (P h): the pairwise term is its dot product with pred[prev].
        weighted = self.successor_codebook(candidates) * self.hidden_projection(hidden)[:, :, None]
        previous, tokens, qs, confidences = anchor, [], [], []
        for i in range(hidden.shape[1]):
            edges = (weighted[:, i] @ self.predecessor_codebook(previous)[:, :, None])[..., 0]
            scores = unary[:, i] + edges
            index, q = pick(scores)
            index = index[:, None].astype(mx.int32)
            previous = mx.take_along_axis(candidates[:, i], index, axis=-1)[:, 0]
            tokens.append(previous)
            qs.append(q)
            # Lazy: computed only when a copy proposal is weighed against this one.
            confidences.append(mx.exp(mx.take_along_axis(scores, index, axis=-1)[:, 0] - mx.logsumexp(scores, axis=-1)))
        q = None if qs[0] is None else mx.stack(qs, axis=1)
        return mx.stack(tokens, axis=1), candidates, q, mx.stack(confidences, axis=1)


class DFlash2Drafter(Drafter):
    """``DFlash2DraftModel``: each proposal is picked given the previous one by the selector."""

    architecture = "DFlash2DraftModel"
    decoder_layer = DFlash2DecoderLayer

    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)

    def propose(
        self,
        block_embeddings: mx.array,
        anchor: mx.array,
        context_hidden: mx.array,
        cache: list,
        lm_head: Callable[[mx.array], mx.array],
        strategy: Any,
    ) -> tuple[mx.array, mx.array | None, mx.array]:
        hidden = self.hidden(block_embeddings, context_hidden, cache, strategy.ops)
        logits = self.full_vocab(self.head_scores(hidden, lm_head))
        tokens, candidates, q, confidence = self.candidate_selector(hidden, logits, anchor, strategy.propose)
        if q is not None:  # the selector's distribution, placed in the vocabulary
            q = mx.put_along_axis(mx.zeros(logits.shape, q.dtype), candidates, q, axis=-1)
        return tokens, q, confidence
