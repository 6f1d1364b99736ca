"""Sharded targets over two local ranks (``mlx.launch -n 2 --backend ring``), as in CI.

Each launch loads one tiny target sharded over two ranks and runs every case on it
(loading dominates the time): plain distributed mlx_lm greedy decoding of the same
shards (``Driver.on_all_ranks``), DFlash greedy at block sizes 4 and 16 with a
drafter that knows the answer but errs every 5th position (long accepted runs and
partial rejections, so rollback runs on every rank), two requests batched on rank 0,
seeded sampling twice, and the public ``stream_generate`` path for the stats (at block size auto,
calibrating sharded, in the qwen3 and pipeline launches). Tensor parallel: qwen3; qwen3_5
(hybrid; its untied head is split by vocabulary, so rank 0 drafts with a whole copy);
llama with sliding-window layers. Pipeline parallel: qwen3_5, whose tapped layers
live on both ranks.

The serve and fault tests start the two ranks by hand with the environment
``mlx.launch`` gives them, so that no launcher cleans up after a dead rank: the
survivors must end on their own, within 30 s, with one line of error.

This file is also the ranks' program: ``python test_distributed.py SPEC_JSON``.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROMPT = [40, 73, 80, 77, 87, 5, 69, 82, 85, 5, 80, 73, 69, 86, 5, 71, 83, 82]  # longer than the prefill chunk
MAX_TOKENS = 32
PREFILL_STEP = 8
SAMPLING_SEED, TEMP = 7, 0.8


# ---- the ranks' program ---------------------------------------------------------------


def plain_greedy(model, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx_lm's own greedy decoding; every rank runs it on its shard."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def dflash_tokens(pair, block_size: int, temp: float = 0.0) -> tuple[list[int], list[tuple[int, int]]]:
    """One request through the engine: its tokens, and (block size, accepted proposals) per step."""
    from tiny import decode

    tokens, stats = decode(pair, PROMPT, MAX_TOKENS, engine_kwargs=dict(block_size=block_size,
                           prefill_step_size=PREFILL_STEP), temp=temp)
    return tokens, [(b, n - 1) for b, n in zip(stats.block_sizes, stats.acceptance_lengths)]


def batched_tokens(pair) -> list[list[int]]:
    """Two requests decoded together (rows of different lengths), each one's tokens."""
    from dflash_mlx import Engine

    engine = Engine(pair, block_size=4, max_rows=2, prefill_step_size=PREFILL_STEP)
    uids = [engine.add(prompt, max_tokens=MAX_TOKENS) for prompt in (PROMPT, PROMPT[:7])]
    out = {uid: [] for uid in uids}
    while not engine.idle:
        for event in engine.step():
            out[event.uid].append(event.token)
    assert engine.stats.batched and max(engine.stats.rows) == 2
    return [out[uid] for uid in uids]


def rank_main(spec: dict) -> None:
    import mlx.core as mx
    from tiny import OracleDrafter

    import dflash_mlx
    from dflash_mlx import DFlashModel
    from dflash_mlx.stats import format_stats

    pair, tokenizer = dflash_mlx.load(spec["target"], spec["draft"], pipeline=spec["pipeline"])
    print("LOADED", dflash_mlx.__file__, os.environ.get("MLX_RANK"), flush=True)  # rank 0 only gets here
    if spec.get("forever"):  # for the fault tests: busy until a rank dies
        while True:
            for _ in dflash_mlx.stream_generate(pair, tokenizer, PROMPT, 1000, block_size=4):
                pass
    ref = pair.target.on_all_ranks(plain_greedy, PROMPT, MAX_TOKENS)
    oracle = DFlashModel(pair.target, OracleDrafter(pair.drafter, PROMPT + ref, wrong_every=5))
    out = {"mlx_lm": ref, "mlx_lm_short": pair.target.on_all_ranks(plain_greedy, PROMPT[:7], MAX_TOKENS)}
    for block_size in (4, 16):
        out[f"block{block_size}"] = dflash_tokens(oracle, block_size)
    out["batched"] = batched_tokens(oracle)
    for run in range(2 if spec.get("sampling", True) else 0):
        mx.random.seed(SAMPLING_SEED)
        out[f"sampled{run}"] = dflash_tokens(oracle, 4, TEMP)[0]
    response = None
    # block size auto: calibration (its long context stretched on every rank, Driver.stretch) runs
    # sharded; it costs a launch about 4 s, so two of the four launches skip it (spec "calibrate")
    block_size = "auto" if spec.get("calibrate", True) else 4
    for response in dflash_mlx.stream_generate(pair, tokenizer, PROMPT, 12, block_size=block_size, prefill_step_size=PREFILL_STEP):
        pass
    out["stats"] = format_stats(response)
    print("RESULT " + json.dumps(out), flush=True)


# ---- the tests ----------------------------------------------------------------------------


def _free_ports(n: int = 2) -> int:
    """A port p with p .. p + n - 1 free (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n < 65536 and all(_free(port + i) for i in range(n)):
            return port
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _rank_env(**extra) -> dict:
    # Two ranks share the machine's cores: one BLAS thread each, or their pools oversubscribe them.
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", **extra)


def _launch(spec: dict) -> dict:
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launcher, "-n", "2", "--backend", "ring", "-p", str(_free_ports()), "--",
           sys.executable, str(Path(__file__).resolve()), json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=HERE, env=_rank_env())
    results = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(results) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    loaded = [line.split() for line in done.stdout.splitlines() if line.startswith("LOADED")]
    # Only rank 0 returns from load, and it ran this checkout's package.
    assert [rank for _, _, rank in loaded] == ["0"], loaded
    assert Path(loaded[0][1]).resolve().is_relative_to(HERE.parent), loaded
    return json.loads(results[0])


def _single_process(target: Path, draft: Path, ref: list[int]) -> dict:
    """The same cases without sharding, for comparison."""
    import mlx.core as mx
    from tiny import OracleDrafter

    import dflash_mlx

    pair, _ = dflash_mlx.load(str(target), str(draft))
    out = {"mlx_lm": plain_greedy(pair.target.model, None, PROMPT, MAX_TOKENS)}
    oracle = dflash_mlx.DFlashModel(pair.target, OracleDrafter(pair.drafter, PROMPT + ref, wrong_every=5))
    for block_size in (4, 16):
        out[f"block{block_size}"] = dflash_tokens(oracle, block_size)[0]
    mx.random.seed(SAMPLING_SEED)
    out["sampled"] = dflash_tokens(oracle, 4, TEMP)[0]
    return out


def _check_lossless(out: dict, mode: str) -> None:
    ref = out["mlx_lm"]
    assert len(ref) == MAX_TOKENS and len(set(ref)) > 5, ref  # a varied continuation, a real test
    for block_size in (4, 16):
        tokens, steps = out[f"block{block_size}"]
        assert tokens == ref, (block_size, tokens, ref)
        accepted = [a for b, a in steps]
        assert max(accepted) >= 3, steps  # long runs accepted ...
        assert any(a < b - 1 for b, a in steps), steps  # ... and blocks rejected part-way: rollbacks ran
    # Batched on rank 0: each row its own greedy decoding (the short prompt's stops at the eos token).
    short = out["mlx_lm_short"]
    assert out["batched"][0] == ref and out["batched"][1] == short[: len(out["batched"][1])]
    if "sampled0" in out:
        assert out["sampled0"] == out["sampled1"], "seeded sampling is not reproducible"
        assert out["sampled0"] != ref, "sampling drew the greedy tokens: temp had no effect"
    assert re.search(rf"Sharded: {mode} over 2 ranks; communication [\d.]+ ms/step", out["stats"]), out["stats"]


def _qwen3_5_folder(root: Path, index: bool) -> tuple[Path, Path]:
    """A tiny qwen3_5 (hybrid) target folder; pipeline loading needs the weight index."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes
    from test_hybrid import CONFIGS, H
    from tiny import EOS_ID, VOCAB, drafter_config, save_drafter, save_tokenizer

    config = dict(CONFIGS["qwen3_5"])
    config["text_config"] = dict(config["text_config"], vocab_size=VOCAB)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    folder = root / "qwen3_5"
    folder.mkdir()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    if index:
        weight_map = {k: "model.safetensors" for k in weights}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(config, eos_token_id=EOS_ID)))
    save_tokenizer(folder)
    layers = config["text_config"]["num_hidden_layers"]
    draft = drafter_config(dict(hidden_size=H, vocab_size=VOCAB, rope_theta=10000.0, num_hidden_layers=layers),
                           target_layer_ids=[0, 2])  # rank 1 holds layer 0, rank 0 layer 2
    return folder, save_drafter(root / "qwen3_5-draft", draft)


def test_tensor_parallel_qwen3(tiny_pair, tmp_path):
    """The drafter taps the last layer too: its collectives must run on every rank alike."""
    from tiny import TARGETS, drafter_config, save_drafter

    target, _ = tiny_pair("qwen3")
    last = TARGETS["qwen3"]["num_hidden_layers"] - 1
    draft = save_drafter(tmp_path / "draft", drafter_config(TARGETS["qwen3"], target_layer_ids=[1, last]))
    out = _launch({"target": str(target), "draft": str(draft), "pipeline": False})
    _check_lossless(out, "tensor parallel")


def test_tensor_parallel_qwen3_5_split_head(tmp_path):
    target, draft = _qwen3_5_folder(tmp_path, index=False)
    out = _launch({"target": str(target), "draft": str(draft), "pipeline": False, "sampling": False, "calibrate": False})
    _check_lossless(out, "tensor parallel")


def test_tensor_parallel_sliding_window_llama(tmp_path):
    """Alternating sliding-window layers (window 6, shorter than the prompt) roll back on every rank."""
    from tiny import TARGETS, drafter_config, save_drafter, save_target

    layers = TARGETS["llama"]["num_hidden_layers"]
    target = save_target(tmp_path / "llama", "llama", layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                         sliding_window=6)
    draft = save_drafter(tmp_path / "llama-draft", drafter_config(TARGETS["llama"]))
    out = _launch({"target": str(target), "draft": str(draft), "pipeline": False, "sampling": False, "calibrate": False})
    _check_lossless(out, "tensor parallel")


def test_pipeline_qwen3_5_matches_single_process(tmp_path):
    target, draft = _qwen3_5_folder(tmp_path, index=True)
    out = _launch({"target": str(target), "draft": str(draft), "pipeline": True})
    _check_lossless(out, "pipeline parallel")
    # Pipelining splits the layers, not the arithmetic: bit-identical to one process,
    # down to the sampled tokens (rank 0 draws the same random numbers in the same order).
    single = _single_process(target, draft, out["mlx_lm"])
    assert single["mlx_lm"] == out["mlx_lm"]
    assert single["block4"] == single["block16"] == out["mlx_lm"]
    assert single["sampled"] == out["sampled0"]


def test_a_single_process_imports_nothing_distributed(tiny_pair):
    target, draft = tiny_pair("qwen3")
    code = (
        "import sys, dflash_mlx\n"
        f"pair, _ = dflash_mlx.load({str(target)!r}, {str(draft)!r})\n"
        "assert type(pair.target).__name__ == 'Target', type(pair.target)\n"
        "assert not {'dflash_mlx.distributed', 'dflash_mlx.distributed.control'} & set(sys.modules), 'imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow  # ~10 s: serving, not what the ranks compute (the default run's sharded tests prove that)
def test_serve_on_rank_0(tiny_pair, tmp_path):
    """Rank 0 serves HTTP, rank 1 follows inside load; when rank 0 is stopped (SIGTERM), it says goodbye
    and rank 1 ends cleanly with it."""
    import mlx_lm

    target, draft = tiny_pair("qwen3")
    ranks = _start_ranks(tmp_path, ["-m", "dflash_mlx", "serve", "--model", str(target), "--draft", str(draft),
                                    "--port", "0"])
    try:
        port = next(int(m.group(1)) for line in ranks[0].stderr
                    if (m := re.search(r"serving .* on http://[\d.]+:(\d+)", line)))
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         json.dumps({"prompt": "hello", "max_tokens": 12}).encode(),
                                         {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        model, tokenizer = mlx_lm.load(str(target))
        assert reply["choices"][0]["text"] == mlx_lm.generate(model, tokenizer, "hello", max_tokens=12)
        assert ranks[1].poll() is None  # still following
        ranks[0].terminate()
        codes = [r.wait(timeout=30) for r in ranks]
        errors = [r.stderr.read() for r in ranks]
        assert codes == [0, 0], f"exit codes {codes}\nrank 0:\n{errors[0][-2000:]}\nrank 1:\n{errors[1][-2000:]}"
        assert "Traceback" not in errors[1]
    finally:
        for r in ranks:
            r.kill()
            r.wait()


@pytest.mark.slow  # ~10 s: training, outside the default run's decoding proofs
def test_two_ranks_train_the_weights_one_process_trains(tiny_pair, tmp_path):
    """``mlx.launch -n 2 -- dflash-mlx train``: each rank trains on half of every batch and the ranks
    average their gradients, so the drafter equals the one a single process trains on whole
    batches; rank 0 alone generates the answers, shows progress and writes, and both ranks end."""
    import mlx.core as mx
    import numpy as np

    target, _ = tiny_pair("qwen3")
    prompts = tmp_path / "prompts.txt"
    # 23 answers in batches of 4: each epoch ends on a batch of 3, which two ranks split unevenly.
    prompts.write_text("\n".join(f"{w} {i}" for i, w in enumerate(["abc", "hello", "xyz", "def"] * 6)))

    def train(out: Path, *launch: str) -> subprocess.CompletedProcess:
        argv = ["-m", "dflash_mlx", "train", "--model", str(target), "--out", str(out), "--prompts", str(prompts),
                "--num-prompts", "23", "--eval-prompts", "0", "--max-response-tokens", "32", "--block-size", "4",
                "--steps", "12", "--batch-seqs", "4", "--anchors", "8", "--lr", "3e-3", "--seed", "0"]
        done = subprocess.run([*launch, sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=HERE,
                              env=_rank_env())
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done

    train(tmp_path / "one")
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    done = train(tmp_path / "two", launcher, "-n", "2", "--backend", "ring", "-p", str(_free_ports()), "--")
    assert done.stdout.count("drafter written to") == 1, done.stdout  # rank 0 alone reports
    assert json.loads((tmp_path / "two" / "train_result.json").read_text())["ranks"] == 2
    assert (tmp_path / "one" / "data.jsonl").read_text() == (tmp_path / "two" / "data.jsonl").read_text()
    one, two = (mx.load(str(tmp_path / run / "model.safetensors")) for run in ("one", "two"))
    assert one.keys() == two.keys()
    for name in one:
        assert np.allclose(np.array(one[name]), np.array(two[name]), atol=2e-5), name


def test_a_rank_that_cannot_see_rank_0s_data_stops_the_run(tiny_pair, tmp_path):
    """Ranks on machines without a shared --out: rank 1 says so in one line, and both end."""
    target, _ = tiny_pair("qwen3")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\nhello\n")

    def argv(out: str) -> list[str]:
        return ["-m", "dflash_mlx", "train", "--model", str(target), "--out", str(tmp_path / out), "--prompts",
                str(prompts), "--num-prompts", "2", "--eval-prompts", "0", "--max-response-tokens", "8", "--steps", "2"]

    ranks = _start_ranks(tmp_path, argv("rank0"), argv("rank1"))
    try:
        codes = [r.wait(timeout=120) for r in ranks]
        errors = [r.stderr.read() for r in ranks]
    finally:
        for r in ranks:
            r.kill()
            r.wait()
    assert codes[0] != 0 and codes[1] == 1, (codes, errors)
    assert errors[1].strip().splitlines() == [
        f"dflash-mlx train: error (rank 1): rank 1 does not see {tmp_path / 'rank1' / 'data.jsonl'}, which rank 0 wrote: "
        "give every rank the same --out, on one machine or a shared disk"], errors[1]
    assert not (tmp_path / "rank1" / "data.jsonl").exists()


def test_ranks_split_each_batch_into_disjoint_shares():
    import mlx.core as mx

    from dflash_mlx.train.ranks import share

    batch = (mx.arange(24).reshape(4, 6), mx.arange(4) > 0)
    shares = [share(batch, rank, 2) for rank in range(2)]
    for whole, first, second in zip(batch, *shares):
        assert first.shape[0] == second.shape[0] == 2
        assert mx.array_equal(mx.concatenate([first, second]), whole)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_short_batch_is_padded_with_rows_that_carry_no_labels(rows):
    """An epoch's last batch, fewer rows than split evenly: no row is dropped, no rank is left empty."""
    import mlx.core as mx

    from dflash_mlx.train.ranks import share

    batch = (mx.arange(rows * 6).reshape(rows, 6), mx.ones((rows, 2), mx.bool_))
    shares = [share(batch, rank, 2) for rank in range(2)]
    assert all(part.shape[0] == shares[0][0].shape[0] > 0 for ranked in shares for part in ranked)
    gathered = [mx.concatenate(parts) for parts in zip(*shares)]
    assert mx.array_equal(gathered[0][:rows], batch[0]) and mx.array_equal(gathered[1][:rows], batch[1])
    assert not gathered[1][rows:].any()  # the padding has no labels


# ---- faults ---------------------------------------------------------------------------------


def _start_ranks(folder: Path, argv: list[str], rank1_argv: list[str] | None = None) -> list[subprocess.Popen]:
    """Two ranks of ``python argv`` started as mlx.launch starts them locally, without the launcher
    (rank 1 runs ``rank1_argv`` if given)."""
    port = _free_ports()
    hostfile = folder / f"hosts-{port}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return [
        subprocess.Popen([sys.executable, *(rank1_argv if rank and rank1_argv else argv)], cwd=HERE, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_rank_env(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile)))
        for rank in range(2)
    ]


def _forever(target: Path, draft: Path) -> list[str]:
    spec = {"target": str(target), "draft": str(draft), "pipeline": False, "forever": True}
    return [str(Path(__file__).resolve()), json.dumps(spec)]


def _wait_loaded(rank0: subprocess.Popen) -> None:
    line = rank0.stdout.readline()
    assert line.startswith("LOADED"), line + rank0.stderr.read()
    time.sleep(1.0)  # well into decoding


def _ended_within(process: subprocess.Popen, seconds: float) -> tuple[int, str]:
    tic = time.monotonic()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"rank still running {seconds:.0f} s after the fault")
    elapsed = time.monotonic() - tic
    err = process.stderr.read()
    # MLX's ring threads write to the same stderr unsynchronized ("[ring] Socket 3 was closed by
    # the peer"), so our one line may start after a partial line of theirs.
    ours = [line[line.index("dflash-mlx: error:"):] for line in err.splitlines() if "dflash-mlx: error:" in line]
    assert process.returncode == 1 and len(ours) == 1 and "Traceback" not in err, err
    return elapsed, ours[0]


@pytest.mark.slow  # a fault test that waits on timeouts, outside the default run
def test_killed_rank_stops_the_other(tiny_pair, tmp_path):
    target, draft = tiny_pair("qwen3")
    ranks = _start_ranks(tmp_path, _forever(target, draft))
    try:
        _wait_loaded(ranks[0])
        ranks[1].kill()
        elapsed, line = _ended_within(ranks[0], 30)
        assert re.search(r"rank 0: .*(rank 1 closed its connection|collective .* failed)", line), line
        assert elapsed < 30
    finally:
        for r in ranks:
            r.kill()
            r.wait()


@pytest.mark.slow  # a fault test that waits on timeouts, outside the default run
def test_stalled_rank_stops_the_other(tiny_pair, tmp_path):
    """A suspended rank keeps its sockets open: the heartbeat catches it, then rank 1 sees rank 0 go."""
    target, draft = tiny_pair("qwen3")
    ranks = _start_ranks(tmp_path, _forever(target, draft))
    try:
        _wait_loaded(ranks[0])
        ranks[1].send_signal(signal.SIGSTOP)
        elapsed, line = _ended_within(ranks[0], 30)
        assert "rank 0: no heartbeat from rank 1" in line, line
        ranks[1].send_signal(signal.SIGCONT)
        _, line = _ended_within(ranks[1], 30)
        assert re.search(r"rank 1: .*(rank 0 closed its connection|collective|cannot follow)", line), line
    finally:
        for r in ranks:
            r.kill()
            r.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import dflash_mlx  # noqa: F401  (OpenBLAS before mlx.core)

    rank_main(json.loads(sys.argv[1]))
