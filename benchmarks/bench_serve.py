"""Concurrent clients against real servers: ours batched, ours one at a time, mlx_lm.server.

    python benchmarks/bench_serve.py [--concurrency 1 2 4 8] [--max-tokens 64] [--rounds 1] [--sessions 1]
        [--system batched chains serial previous mlx_lm] [--baseline CHECKOUT]

Servers run side by side on the built-in pair's target (``dflash_mlx.default``):

- ``batched``: ``dflash-mlx serve --decode-concurrency C`` (C the largest concurrency; defaults);
- ``chains``: the same with ``--tree-budget 0`` (draft chains, no trees);
- ``serial``: ``dflash-mlx serve --decode-concurrency 1`` (one request at a time; always started: it
  answers every question alone once, the reference of ``exact``, and is raced when named);
- ``previous``: a previous release's ``serve`` from ``--baseline`` (a git checkout), as batched;
- ``mlx_lm``: ``mlx_lm.server`` on the target alone: plain decoding, batched, with OpenBLAS loaded
  first exactly as dflash-mlx loads it, so both use the same BLAS.

At each concurrency c, c clients send c MT-Bench questions at once (chat completions, greedy,
``--max-tokens`` each, end of text suppressed so every request generates the same count) and wait
for their answers; the questions are a window that slides by one each round, so one client meets a
different prompt every round. The systems take turns for every (round, c), the order rotated by one
each round (a busy spell on this shared machine falls on all of them alike). Every server is started
afresh ``--sessions`` times, in an order rotated each session, and warmed up at every concurrency
before its ``--rounds`` rounds: a server's start-up (its place in the start order, its calibration of
step costs) is one draw that every round of the session shares, so one session's comparison carries
it; over sessions it averages out. Two systems compare by the median over rounds of their per-round
ratio (``paired``: the two ran back to back on the same questions) and by best round against best
round. Aggregate tokens/s is every generated token over the wall time from the first request to the
last answer; latency is each request's time to its last token, p50 and p95. The table goes to stdout
and, with ``--out``, JSON (every round's tokens/s and ratios). Run it with ``--baseline`` this
checkout (A/A) to see what it resolves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dflash_mlx  # its BLAS is the servers' BLAS: they run this Python with the same libraries
from dflash_mlx.benchmark import load_dataset
from dflash_mlx.default import default_pair
from side_by_side import free_port, rotated

MLX_LM_SERVER = "import dflash_mlx, sys; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
SYSTEMS = ("batched", "chains", "serial", "previous", "mlx_lm")


def start(name: str, argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """Start a server on a free port; return it once the port answers /v1/models."""
    port = free_port()
    process = subprocess.Popen(argv + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env)
    deadline = time.monotonic() + 900
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {name} server did not start: {' '.join(argv)}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return process, port
        except OSError:
            time.sleep(0.5)


def ask(port: int, question: str, max_tokens: int, eos: int) -> tuple[str, int, float]:
    body = {"model": "default_model", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "logit_bias": {str(eos): -100.0}}
    tic = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=3600).read())
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], time.perf_counter() - tic


def measure(port: int, questions: list[str], max_tokens: int, eos: int) -> dict:
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda q: ask(port, q, max_tokens, eos), questions))
    wall = time.perf_counter() - tic
    latencies = sorted(a[2] for a in answers)
    return dict(texts=[a[0] for a in answers], tokens=sum(a[1] for a in answers), seconds=wall,
                tokens_per_second=sum(a[1] for a in answers) / wall, p50=statistics.median(latencies),
                p95=latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))])


def ratios(mine: list[dict], theirs: list[dict]) -> list[float]:
    """Per-round tokens/s ratios of two systems: each round's pair ran back to back on the same questions."""
    return [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(mine, theirs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", default="auto", help="our servers' --block-size")
    p.add_argument("--rounds", type=int, default=1, help="rounds per session")
    p.add_argument("--sessions", type=int, default=1,
                   help="times every server is started afresh (in a rotated order) to run --rounds rounds")
    p.add_argument("--system", nargs="+", default=["batched", "serial", "mlx_lm"], choices=SYSTEMS,
                   help="servers to race (the serial server always runs: it answers the reference of 'exact')")
    p.add_argument("--baseline", type=Path, default=None,
                   help="a checkout of a previous release, served as 'previous' (with --decode-concurrency as batched)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    print(f"BLAS: {dflash_mlx.BLAS}", flush=True)  # figures taken on the reference BLAS compare with nothing
    target, draft = default_pair()
    ours = [sys.executable, "-m", "dflash_mlx", "serve", "--model", target, "--draft", draft, "--block-size",
            args.block_size]
    batched = ["--decode-concurrency", str(max(args.concurrency))]
    commands = {
        "batched": ours + batched,
        "chains": ours + batched + ["--tree-budget", "0"],
        "serial": ours + ["--decode-concurrency", "1"],
        "previous": ours + batched,
        "mlx_lm": [sys.executable, "-c", MLX_LM_SERVER, "--model", target],
    }
    raced = list(dict.fromkeys(args.system))
    commands = {name: commands[name] for name in dict.fromkeys(["serial"] + raced)}
    environments = {"previous": dict(os.environ, PYTHONPATH=str(args.baseline))} if args.baseline else {}
    if "previous" in commands and not args.baseline:
        raise SystemExit("--system previous needs --baseline (a checkout of the previous release)")
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    eos = load_tokenizer(Path(target)).eos_token_id
    questions = load_dataset("mt-bench", max(args.concurrency) + args.sessions * args.rounds - 1)
    reference: dict[str, str] = {}  # question -> the serial server's answer, asked alone
    runs: dict[tuple[int, str], list[dict]] = {}
    for session in range(args.sessions):
        servers = {}
        try:
            for name in rotated(list(commands), session):
                servers[name] = start(name, commands[name], environments.get(name))
            for _, port in servers.values():  # warm up: first requests compile, fill allocator pools, and
                for c in args.concurrency:  # calibrate the block policy at each row count (done on first use)
                    measure(port, questions[:c], 8, eos)
            for round_ in range(session * args.rounds, (session + 1) * args.rounds):
                for c in args.concurrency:
                    asked = questions[round_:round_ + c]  # a window sliding by one question per round
                    for q in asked:
                        if q not in reference:
                            reference[q] = ask(servers["serial"][1], q, args.max_tokens, eos)[0]
                    for name in rotated(raced, round_):
                        run = measure(servers[name][1], asked, args.max_tokens, eos)
                        run["exact"] = run.pop("texts") == [reference[q] for q in asked]
                        runs.setdefault((c, name), []).append(run)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait()
    results = []
    others = [o for o in ("mlx_lm", "serial", "previous") if o in raced]
    print(f"{'clients':>7} {'system':>8} {'tok/s':>7} {'p50 s':>7} {'p95 s':>7} {'exact':>6}"
          + "".join(f" {'vs ' + o + ' best/paired':>25}" for o in others))
    for c in args.concurrency:
        best = {o: max(x["tokens_per_second"] for x in runs[(c, o)]) for o in others}
        for name in raced:
            rounds = runs[(c, name)]
            r = max(rounds, key=lambda x: x["tokens_per_second"])
            paired = {o: ratios(rounds, runs[(c, o)]) for o in others}
            results.append(dict(clients=c, system=name, exact=all(x["exact"] for x in rounds),
                                median_tokens_per_second=statistics.median(x["tokens_per_second"] for x in rounds),
                                rounds=[round(x["tokens_per_second"], 2) for x in rounds],
                                paired_ratios={o: [round(x, 4) for x in paired[o]] for o in others if o != name},
                                **{k: v for k, v in r.items() if k != "exact"}))
            print(f"{c:>7} {name:>8} {r['tokens_per_second']:>7.2f} {r['p50']:>7.2f} {r['p95']:>7.2f}"
                  f" {str(results[-1]['exact']):>6}"
                  + "".join(f" {r['tokens_per_second'] / best[o]:>17.3f}x/{statistics.median(paired[o]):.3f}x"
                            for o in others))
    if args.out:
        args.out.write_text(json.dumps(dict(max_tokens=args.max_tokens, block_size=args.block_size,
                                            sessions=args.sessions, rounds_per_session=args.rounds,
                                            blas=dflash_mlx.BLAS, load=os.getloadavg(), results=results), indent=1))


if __name__ == "__main__":
    main()
