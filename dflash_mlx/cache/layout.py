"""What a prompt cache entry holds, and the key naming the model pair and software that computed it.

An entry's caches mean something only to the pair that computed them, laid out as this version of
the package lays them out. ``Layout.key`` is a digest of everything that decides their contents: the
target's and the drafter's configs and weights (every parameter's name, shape, dtype and an evenly
strided sample of its values, so a fine-tune or another quantization differs), each layer's cache
kind and window, the drafter's context window, ``FORMAT`` and the mlx, mlx-lm and dflash-mlx
versions (a new kernel may round differently, and greedy output must stay mlx_lm's own). Entries
written under another key are never read.

``flatten``/``restore`` turn an entry's caches into named arrays plus a small JSON-able description
and back, for the files of the SSD tier; ``materialise`` makes an entry's arrays compact copies.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, is_dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from .ragged import RaggedKVCache

FORMAT = 1  # bump when what an entry's arrays mean changes
SAMPLES = 1024  # values per parameter in a weights fingerprint
_fingerprints: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def software() -> dict[str, str]:
    """The versions of the packages whose code decides what a model computes here."""
    return {p: _version(p) for p in ("mlx", "mlx-lm", "dflash-mlx")}


def raw(x: mx.array) -> mx.array:
    """``x`` as a dtype numpy can hold bit for bit (bfloat16 as uint16)."""
    return x.view(mx.uint16) if x.dtype == mx.bfloat16 else x


def _weights(module: Any) -> str:
    """A digest of a module's parameters: names, shapes, dtypes and ``SAMPLES`` strided values each."""
    samples = []
    for name, p in tree_flatten(module.parameters()):
        flat = p.reshape(-1)
        samples.append((name, p.shape, p.dtype, raw(flat[:: max(1, flat.size // SAMPLES)][:SAMPLES])))
    mx.eval([s for *_, s in samples])
    digest = hashlib.sha256()
    for name, shape, dtype, s in samples:
        digest.update(f"{name}{list(shape)}{dtype}".encode())
        digest.update(np.asarray(s).tobytes())
    return digest.hexdigest()


def _args(args: Any) -> Any:
    return asdict(args) if is_dataclass(args) else dict(vars(args))


def _target(target: Any) -> dict:
    policy = target.cache_policy
    return {"model_type": policy.model_type, "args": _args(target.args), "layers": len(target.layers),
            "layer_ids": target.layer_ids, "weights": _weights(target.model),
            "recurrent": sorted(policy.mixers), "windows": sorted(policy.windows.items())}


def _digest(described: dict) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def pair_digest(model: Any) -> str:
    """A digest of the pair's configs and weights (the pair's part of a key), computed once per
    ``DFlashModel``."""
    if model not in _fingerprints:
        drafter = model.drafter
        _fingerprints[model] = _digest({
            "target": _target(model.target),
            "drafter": {"architecture": drafter.architecture, "args": _args(drafter.args),
                        "weights": _weights(drafter)},
        })
    return _fingerprints[model]


def target_digest(target: Any) -> str:
    """A digest of the target's config and weights alone, for what does not depend on the drafter;
    computed once per ``Target``."""
    if target not in _fingerprints:
        _fingerprints[target] = _digest({"target": _target(target)})
    return _fingerprints[target]


@dataclass(frozen=True, eq=False)
class Layout:
    """One model pair's entries: their key, whether they can be cut, and how to rebuild their caches."""

    key: str
    cuts: bool  # an entry serves any prefix of its tokens (no recurrent layer holds a state after them all)
    model: Any  # the DFlashModel
    draft_window: tuple[int, int] | None

    @classmethod
    def of(cls, model: Any, draft_window: tuple[int, int] | None = None) -> "Layout":
        drafter_caches = [(c.keep, c.recent) for c in model.drafter.make_cache(draft_window)]
        described = [FORMAT, pair_digest(model), drafter_caches, software()]
        key = hashlib.sha256(json.dumps(described).encode()).hexdigest()
        return cls(key, not model.target.cache_policy.mixers, model, draft_window)

    def usable(self, n: int, length: int) -> bool:
        """Whether an entry of ``length`` tokens can serve the first ``n`` of them."""
        return n >= 1 and (self.cuts or n == length)

    def restore(self, arrays: dict[str, mx.array], layers: dict) -> tuple[list, list]:
        """Caches from ``flatten``'s output; ValueError if they do not fit this layout."""
        cache = self.model.target.make_cache()
        draft = self.model.drafter.make_cache(self.draft_window)
        if len(layers["target"]) != len(cache) or len(layers["drafter"]) != len(draft):
            raise ValueError("layer counts differ")
        length = layers["tokens"]
        for i, (c, described) in enumerate(zip(cache, layers["target"])):
            if isinstance(c, RaggedKVCache) and described["kind"] == "kv":
                _fill(c, arrays, f"t{i}", described["length"])
                if c.lengths[0] not in (0, length):
                    raise ValueError(f"target layer {i} holds {c.lengths[0]} of {length} tokens")
            elif isinstance(c, ArraysCache) and described["kind"] == "state" and len(described["present"]) <= len(c.cache):
                for j in described["present"]:
                    c[j] = arrays[f"t{i}.{j}"]
            else:
                raise ValueError(f"target layer {i} is not a {described['kind']} cache here")
        for i, (c, described) in enumerate(zip(draft, layers["drafter"])):
            _fill(c, arrays, f"d{i}", described["length"])
            c.dropped = [described["dropped"]]
            if c.positions[0] != length:
                raise ValueError(f"drafter layer {i} holds {c.positions[0]} of {length} positions")
        return cache, draft


def _fill(c: RaggedKVCache, arrays: dict[str, mx.array], name: str, length: int) -> None:
    if length:
        c.keys, c.values = arrays[f"{name}.k"], arrays[f"{name}.v"]
        if c.keys.shape[2] != length or c.values.shape[2] != length:
            raise ValueError(f"{name} holds {c.keys.shape[2]} rows, not {length}")
    c._set_lengths([length])


def materialise(cache: list, draft: list) -> None:
    """Make one-row caches hold compact copies of their arrays (evaluated), not views of a batch's
    buffers: a view would keep the whole buffer alive, and the engine's in-place updates would copy
    a buffer an entry shares."""
    arrays = []
    for c in [*cache, *draft]:
        if isinstance(c, RaggedKVCache):
            if c.keys is not None:
                n = c.lengths[0]
                c.keys, c.values = mx.array(c.keys[:, :, :n]), mx.array(c.values[:, :, :n])
                arrays += [c.keys, c.values]
        else:
            c.cache = [None if a is None else mx.array(a) for a in c.cache]
            arrays += [a for a in c.cache if a is not None]
    mx.eval(arrays)


def flatten(tokens: int, cache: list, draft: list) -> tuple[dict[str, mx.array], dict]:
    """An entry's caches (materialised) as named arrays and a JSON-able description of its layers."""
    arrays, target_layers, drafter_layers = {}, [], []
    for i, c in enumerate(cache):
        if isinstance(c, RaggedKVCache):
            if c.keys is not None:
                arrays[f"t{i}.k"], arrays[f"t{i}.v"] = c.keys, c.values
            target_layers.append({"kind": "kv", "length": c.lengths[0] if c.keys is not None else 0})
        else:
            present = [j for j, a in enumerate(c.cache) if a is not None]
            arrays.update({f"t{i}.{j}": c.cache[j] for j in present})
            target_layers.append({"kind": "state", "present": present})
    for i, c in enumerate(draft):
        if c.keys is not None:
            arrays[f"d{i}.k"], arrays[f"d{i}.v"] = c.keys, c.values
        drafter_layers.append({"length": c.lengths[0] if c.keys is not None else 0, "dropped": c.dropped[0]})
    return arrays, {"tokens": tokens, "target": target_layers, "drafter": drafter_layers}


def nbytes(cache: list, draft: list) -> int:
    return sum(c.nbytes for c in [*cache, *draft])

