"""Distributed mlx_lm vs distributed DFlash on a target sharded over local ranks, and a model for two Macs.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_distributed.py \
        [--model M --draft D] [--pipeline] [--num-prompts 4] [--max-tokens 64] [--block-size 4] [--output r.json]

Default pair: the built-in SmolLM2-135M target and its trained drafter. Its 9 attention
heads do not split over 2 ranks and mlx_lm pipelines qwen2 but not llama, so by default
every rank rewrites the llama checkpoint as qwen2 (the same network: qwen2 adds q/k/v
biases, here zero; the greedy match column checks it) and the target is pipelined.

Rank 0 measures, interleaved prompt by prompt (``dflash-mlx benchmark``'s loop): plain
mlx_lm decoding run on every rank at once, as mlx_lm runs sharded, against DFlash with
a profiled pass for the draft and verify time per step; the communication per step
comes from the stats (orders and tap gather timed, the model's collectives counted in
its graph times their latency calibrated at load).

The model. A plain token costs ``c(1) + k(1)`` and a DFlash step ``d + c(B) + k(B) + o``
and commits tau tokens, so the speedup of DFlash over plain sharded decoding is

    S = tau * (c(1) + k(1)) / (d + c(B) + k(B) + o)

with c(R) the compute of a forward of R rows (measured time minus its communication),
k(R) = n * (alpha + R * H * bytes / bw) the model's n collectives per forward, d the
drafter forward and o the order message plus the tap gather. For two Macs the script
keeps tau and the ratios c(B) / c(1) and d / c(1) measured here, scales compute so that
a plain token costs ``--mac-token-ms`` there, and puts each assumed link's alpha and
bw into k and o.

On one machine, give each rank one BLAS thread (``mlx.launch --env OPENBLAS_NUM_THREADS=1``):
two ranks with a thread pool each oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx

from dflash_mlx.benchmark import benchmark_dataset, load_dataset
from dflash_mlx.default import _materialize, cache_dir, default_pair
from dflash_mlx.model import load

# Assumed links for the two-Mac model: (name, per-collective latency in seconds, bytes/s).
# MLX's ring backend is TCP: Thunderbolt as an IP bridge, or Ethernet.
LINKS = [("Thunderbolt 4 bridge", 60e-6, 2.5e9), ("10 GbE", 120e-6, 1.1e9), ("1 GbE", 200e-6, 0.11e9)]


def qwen2_copy(llama: Path) -> Path:
    """The llama checkpoint as qwen2 (zero q/k/v biases) with a weight index, built once in the cache."""
    return _materialize(cache_dir() / f"{llama.name}-as-qwen2", lambda out: _write_qwen2(llama, out))


def _write_qwen2(llama: Path, out: Path) -> None:
    out.mkdir(parents=True)
    config = json.loads((llama / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    weights = mx.load(str(llama / "model.safetensors"))
    for k in list(weights):
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            weights[k[: -len("weight")] + "bias"] = mx.zeros((weights[k].shape[0],), weights[k].dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (llama / name).is_file():
            (out / name).write_bytes((llama / name).read_bytes())


def fit(target, summary: dict, block_size: int, hidden_bytes: int) -> dict:
    """The step's parts measured in this run, communication split off: the two-Mac model's inputs.

    A plain token's time is 1 / mlx_lm tok/s; a DFlash step's verify time comes from
    the profiled pass and holds its communication (orders, tap gather, collectives).
    """
    comm = summary["communication_ms_per_step"] / 1e3
    collectives = target.collective_seconds(block_size)
    return {
        "tau": summary["tau"], "block_size": block_size,
        "compute_1_s": 1 / summary["baseline_tps"] - target.collective_seconds(1),
        "compute_B_s": summary["verify_ms_per_step"] / 1e3 - comm,
        "draft_s": summary["draft_ms_per_step"] / 1e3,
        "order_and_gather_s": comm - collectives,
        "collectives_per_forward": target.collectives, "collective_latency_s": target.latency,
        "hidden_bytes_per_row": hidden_bytes, "tap_gather": bool(target.remote_ids),
    }


def two_mac(f: dict, token_ms: float, link: tuple[str, float, float], order_messages: int = 1) -> float:
    """Predicted DFlash speedup over plain sharded decoding on two Macs (see the module docstring)."""
    _, alpha, bw = link
    B, n, H = f["block_size"], f["collectives_per_forward"], f["hidden_bytes_per_row"]
    scale = token_ms / 1e3 / f["compute_1_s"]  # the Macs' compute against this machine's
    k = lambda r: n * (alpha + r * H / bw)  # noqa: E731
    o = order_messages * alpha + f["tap_gather"] * (alpha + B * H / bw)
    step = scale * (f["draft_s"] + f["compute_B_s"]) + k(B) + o
    return f["tau"] * (scale * f["compute_1_s"] + k(1)) / step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Target folder (default: the built-in pair's, rewritten as qwen2)")
    p.add_argument("--draft", default=None, help="Drafter folder (default: the built-in drafter)")
    p.add_argument("--pipeline", action="store_true", help="Pipeline parallel (implied by the default pair)")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--mac-token-ms", type=float, nargs="+", default=[20.0, 80.0],
                   help="Assumed compute per plain token of the sharded target on the two Macs")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.model is None:
        target_dir, args.draft = default_pair()
        args.model, args.pipeline = str(qwen2_copy(Path(target_dir))), True
    prompts = load_dataset(args.dataset, args.num_prompts)
    model, tokenizer = load(args.model, args.draft, pipeline=args.pipeline)  # rank 0 only returns
    run_args = argparse.Namespace(max_tokens=args.max_tokens, temp=0.0, seed=0, block_size=args.block_size,
                                  profile_prompts=args.num_prompts)
    summary = benchmark_dataset(model, tokenizer, args.dataset, prompts, run_args).summary(True)
    hidden_bytes = model.target.hidden_size * mx.zeros((), model.target.dtype).itemsize
    f = fit(model.target, summary, args.block_size, hidden_bytes)
    print(f"{summary['sharding']} over {model.target.shards.size} ranks, {args.dataset} x{args.num_prompts}, "
          f"{args.max_tokens} tokens, block {args.block_size}")
    print(f"{'mlx_lm tok/s':>13}{'DFlash tok/s':>14}{'speedup':>9}{'tau':>6}{'draft ms':>10}{'verify ms':>11}"
          f"{'comm ms/step':>14}  match")
    print(f"{summary['baseline_tps']:>13.2f}{summary['dflash_tps']:>14.2f}{summary['speedup']:>8.2f}x{summary['tau']:>6.2f}"
          f"{summary['draft_ms_per_step']:>10.1f}{summary['verify_ms_per_step']:>11.1f}"
          f"{summary['communication_ms_per_step']:>14.2f}  {summary['match']}")
    lat = ", ".join(f"{r} rows {1e3 * t:.2f} ms" for r, t in f["collective_latency_s"].items())
    print(f"fit: compute {1e3 * f['compute_1_s']:.2f} ms per plain token, {1e3 * f['compute_B_s']:.2f} ms per verify "
          f"of {args.block_size} rows, draft {1e3 * f['draft_s']:.2f} ms; {f['collectives_per_forward']} collectives "
          f"per forward at {lat}; orders + tap gather {1e3 * f['order_and_gather_s']:.2f} ms/step")
    predictions = {}
    for token_ms in args.mac_token_ms:
        for link in LINKS:
            predictions[f"{link[0]}, {token_ms:g} ms/token"] = s = two_mac(f, token_ms, link)
            print(f"two Macs, {link[0]}, plain compute {token_ms:g} ms/token: expected DFlash speedup {s:.2f}x")
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                           "fit": f, "two_mac": predictions}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
