"""Every script in examples/ runs as a user would run it, on the tiny fixtures."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Each example starts its own processes: about 20 s together, so outside the default run.
pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The `dflash-mlx` command installed beside this interpreter, as a shell would find it.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def run(*argv, env=ENV, timeout=300) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("qwen3")
    return ["--model", str(target), "--draft", str(draft)]


def test_stream_generate(pair):
    out = run(sys.executable, str(EXAMPLES / "stream_generate.py"), *pair, "--max-tokens", "16")
    assert "tokens/s" in out and "tau" in out


def test_exact_sampling(pair):
    out = run(sys.executable, str(EXAMPLES / "exact_sampling.py"), *pair, "--max-tokens", "24")
    assert "identical to mlx_lm: True" in out and "custom sampler: tau" in out


def test_convert_4bit(pair, tmp_path):
    out = run(sys.executable, str(EXAMPLES / "convert_4bit.py"), *pair, "--out", str(tmp_path / "q4"), "--max-tokens", "12")
    assert "converted:" in out and "Acceptance: tau" in out
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4


def test_train_drafter(tiny_pair, tmp_path):
    target, _ = tiny_pair("qwen3")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"say {w}" for w in ["abc", "hello", "xyz", "def", "the sea", "one", "two", "blue"]))
    env = {**ENV, "PROMPTS": str(prompts), "NUM_PROMPTS": "6", "STEPS": "4", "TRAIN_EXTRA": "--gen-batch-size 4"}
    out = run("bash", str(EXAMPLES / "train_drafter.sh"), str(target), str(tmp_path / "drafter"), env=env)
    assert "held-out tau" in out and "Acceptance: tau" in out
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_client(pair):
    pytest.importorskip("openai")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "dflash_mlx", "serve", *pair, "--port", str(port)], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        out = run(sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", f"http://127.0.0.1:{port}/v1",
                  "--max-tokens", "12")
        assert "usage:" in out
    finally:
        server.terminate()
        server.wait(timeout=60)
