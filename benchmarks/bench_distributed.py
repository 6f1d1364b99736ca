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

with c(R) the compute of a forward of R rows, k(R) = n * (alpha + R * H * bytes / bw)
the model's n collectives per forward, d the drafter forward and o the order message
plus, pipelined, the tap gather. The compute comes from a single-process benchmark of
the same pair (``--compute-from``: tau, c(1), c(B), d), because two ranks on one
machine's cores distort it far more than a link would; it is scaled so that a plain
token costs ``--mac-token-ms`` of one Mac's compute, halved for tensor parallelism
(each Mac holds half of every layer), kept whole for pipelining (the stages run one
after the other). n is counted in the sharded model's graph (pipeline: send/recv and
all_gather; tensor: an all_sum after every attention and every MLP, 2 per layer), and
alpha and bw are the assumed links in ``LINKS``.

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
LINKS = [("Thunderbolt bridge", 80e-6, 2.5e9), ("10 GbE", 150e-6, 1.1e9)]
RESULTS = Path(__file__).resolve().parent / "results"


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


def compute_shape(path: Path, dataset: str) -> dict:
    """tau and the step's compute from a single-process ``dflash-mlx benchmark --output`` JSON.

    Measured without communication or a second rank on the cores, which on this
    shared machine distort the sharded run's own times far more than any link would.
    """
    report = json.loads(path.read_text())
    row = next(r for r in report["results"] if r["dataset"] == dataset)
    return {"source": str(path), "tau": row["tau"], "block_size": report["block_size"],
            "token_s": 1 / row["baseline_tps"], "verify_s": row["verify_ms_per_step"] / 1e3,
            "draft_s": row["draft_ms_per_step"] / 1e3}


def two_mac(shape: dict, mode: str, collectives: int, row_bytes: int, gather_bytes: int, token_ms: float,
            link: tuple[str, float, float]) -> dict:
    """Plain and DFlash tok/s of a target sharded over two Macs, and the speedup (module docstring).

    Compute is scaled so that a plain token costs ``token_ms`` on one Mac's worth of
    compute; tensor parallelism halves it (each Mac holds half of every layer),
    pipelining does not (the stages run one after the other).
    """
    _, alpha, bw = link
    B = shape["block_size"]
    scale = token_ms / 1e3 / shape["token_s"] / (2 if mode == "tensor" else 1)
    k = lambda rows: collectives * (alpha + rows * row_bytes / bw)  # noqa: E731
    orders = alpha + (alpha + B * gather_bytes / bw if gather_bytes else 0.0)
    plain = scale * shape["token_s"] + k(1)
    step = scale * (shape["draft_s"] + shape["verify_s"]) + k(B) + orders
    return {"plain_tps": 1 / plain, "dflash_tps": shape["tau"] / step, "speedup": shape["tau"] * plain / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Target folder (default: the built-in pair's, rewritten as qwen2)")
    p.add_argument("--draft", default=None, help="Drafter folder (default: the built-in drafter)")
    p.add_argument("--pipeline", action="store_true", help="Pipeline parallel (implied by the default pair)")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--mac-token-ms", type=float, nargs="+", default=[20.0, 60.0],
                   help="Assumed compute of one plain token of the target on one Mac's worth of compute")
    p.add_argument("--compute-from", type=Path, default=RESULTS / "default_pair_b4.json",
                   help="A single-process `dflash-mlx benchmark --output` JSON of the pair: tau and step compute")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.model is None:
        target_dir, built_in_drafter = default_pair()
        args.draft = args.draft or built_in_drafter
        args.model, args.pipeline = str(qwen2_copy(Path(target_dir))), True
    prompts = load_dataset(args.dataset, args.num_prompts)
    model, tokenizer = load(args.model, args.draft, pipeline=args.pipeline)  # rank 0 only returns
    run_args = argparse.Namespace(max_tokens=args.max_tokens, temp=0.0, seed=0, block_size=args.block_size,
                                  profile_prompts=args.num_prompts)
    summary = benchmark_dataset(model, tokenizer, args.dataset, prompts, run_args).summary(True)
    target = model.target
    print(f"{summary['sharding']} over {target.shards.size} ranks, {args.dataset} x{args.num_prompts}, "
          f"{args.max_tokens} tokens, block {args.block_size}")
    print(f"{'mlx_lm tok/s':>13}{'DFlash tok/s':>14}{'speedup':>9}{'tau':>6}{'draft ms':>10}{'verify ms':>11}"
          f"{'comm ms/step':>14}  match")
    print(f"{summary['baseline_tps']:>13.2f}{summary['dflash_tps']:>14.2f}{summary['speedup']:>8.2f}x{summary['tau']:>6.2f}"
          f"{summary['draft_ms_per_step']:>10.1f}{summary['verify_ms_per_step']:>11.1f}"
          f"{summary['communication_ms_per_step']:>14.2f}  {summary['match']}")
    lat = ", ".join(f"{r} rows {1e3 * t:.2f} ms" for r, t in target.latency.items())
    print(f"the model's collectives per forward: {target.collectives}; all_sum latency here: {lat}")

    shape = compute_shape(args.compute_from, args.dataset)
    row_bytes = target.hidden_size * mx.zeros((), target.dtype).itemsize
    layers = len(target.layers)
    # The run's own mode with its counted collectives; the other mode with the count it would have.
    pipelined = target.shards.pipeline
    modes = {"pipeline": (target.collectives if pipelined else 2,
                          len(target.remote_ids) if pipelined else len(target.layer_ids) // 2),
             "tensor": (target.collectives if not pipelined else 2 * layers, 0)}
    print(f"two Macs, from the compute of {shape['source']} (tau {shape['tau']}, block {shape['block_size']}):")
    predictions = []
    for mode, (n, gathered) in modes.items():
        for token_ms in args.mac_token_ms:
            for link in LINKS:
                r = two_mac(shape, mode, n, row_bytes, gathered * row_bytes, token_ms, link)
                predictions.append(dict(mode=mode, collectives=n, token_ms=token_ms, link=link[0], **r))
                print(f"  {mode:>8} ({n:>3} collectives/forward), {token_ms:>4g} ms/token compute, {link[0]:<20} "
                      f"plain {r['plain_tps']:6.1f} tok/s, DFlash {r['dflash_tps']:6.1f} tok/s, {r['speedup']:.2f}x")
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                           "collectives_per_forward": target.collectives,
                                           "collective_latency_s": target.latency, "compute_shape": shape,
                                           "two_mac": predictions}, indent=2) + "\n")


if __name__ == "__main__":
    main()
