"""`dflash-mlx generate`: a real run, and one-line errors (exit 1, no traceback) for bad input."""

import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from tiny import TARGETS, drafter_config, save_drafter

from dflash_mlx.cli import main


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_generate_runs_and_prints_stats(tiny_pair):
    target, draft = tiny_pair("qwen3")
    result = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "generate", "--model", str(target), "--draft", str(draft),
         "--prompt", "Hello", "--max-tokens", "20", "--block-size", "4"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for line in ("Prompt:", "Generation: 20 tokens", "Acceptance: tau", "Acceptance histogram", "Peak memory"):
        assert line in result.stdout


def test_prefill_step_size_reaches_the_prefill(tiny_pair, capsys, monkeypatch):
    from dflash_mlx.target import Target

    target, draft = tiny_pair("qwen3")
    chunks, prefill_rows = [], Target.prefill_rows
    monkeypatch.setattr(Target, "prefill_rows", lambda self, caches, rows: (
        chunks.append(max(map(len, rows))), prefill_rows(self, caches, rows))[1])
    outputs, longest = [], []
    for step in ("2048", "3"):
        code, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt", "Hello there",
                                 "--max-tokens", "12", "--block-size", "4", "--prefill-step-size", step, "--verbose", "0")
        assert code == 0, err
        outputs.append(out)
        longest.append(max(chunks))
        chunks.clear()
    assert longest[0] > 3 and longest[1] == 3 and outputs[0] == outputs[1]


def test_tree_budget_reaches_the_engine_and_the_stats_say_so(tiny_pair, capsys):
    target, draft = tiny_pair("qwen3")
    outputs = {}
    for budget in ("0", "4"):
        code, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt", "Hello there",
                                 "--max-tokens", "16", "--block-size", "8", "--tree-budget", budget)
        assert code == 0, err
        text, stats = out.split("==========", 1)
        outputs[budget] = text
        line = next(line for line in stats.splitlines() if line.startswith("Draft trees:"))
        assert ("none (tree_budget is 0)" in line) if budget == "0" else ("nodes per tree" in line)
    assert outputs["0"] == outputs["4"]  # greedy: the same text, tree or chain


def edited_drafter(tmp_path, family="qwen3", **overrides):
    config = drafter_config(TARGETS[family])
    dflash_overrides = overrides.pop("dflash_config", {})
    config.update(overrides)
    config["dflash_config"].update(dflash_overrides)
    return save_drafter(tmp_path / "draft", config)


@pytest.mark.parametrize(
    "make_draft, message",
    [
        (lambda t: edited_drafter(t, vocab_size=200), "drafter vocab size 200 does not match the target's"),
        (lambda t: edited_drafter(t, hidden_size=32), "drafter hidden size 32 does not match the target's 64"),
        (lambda t: edited_drafter(t, dflash_config={"target_layer_ids": [1, 9]}), "target_layer_ids [9] out of range"),
        (lambda t: edited_drafter(t, dflash_config={"mask_token_id": 500}), "mask_token_id 500 is outside"),
    ],
    ids=["vocab", "hidden", "layer_ids", "mask_token"],
)
def test_mismatched_drafter(tiny_pair, tmp_path, capsys, make_draft, message):
    target, _ = tiny_pair("qwen3")
    code, _, err = run_cli(capsys, "--model", str(target), "--draft", str(make_draft(tmp_path)))
    assert code != 0 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_inputs(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair("qwen3")

    def expect(message, *argv):
        code, _, err = run_cli(capsys, *argv)
        assert code != 0, argv
        assert message in err, err
        assert err.startswith("dflash-mlx generate: error:") and len(err.strip().splitlines()) == 1

    model = ["--model", str(target)]
    expect("model not found: /no/such/dir", "--model", "/no/such/dir", "--draft", str(draft))
    expect("drafter not found: ./missing", *model, "--draft", "./missing")
    expect("is not a DFlash drafter", *model, "--draft", str(target))
    expect("block size 40 is out of range", *model, "--draft", str(draft), "--block-size", "40")
    expect("block size 0 is out of range", *model, "--draft", str(draft), "--block-size", "0")
    expect("the prompt is empty", *model, "--draft", str(draft), "--prompt", "", "--ignore-chat-template")
    expect("-1 is not a tree budget", *model, "--draft", str(draft), "--tree-budget", "-1")
    expect("--temp -1.0: temperature must be in [0, 100]", *model, "--draft", str(draft), "--temp", "-1")

    no_keys = tmp_path / "no-keys"
    shutil.copytree(draft, no_keys)
    config = json.loads((no_keys / "config.json").read_text())
    del config["hidden_size"], config["num_target_layers"]
    (no_keys / "config.json").write_text(json.dumps(config))
    expect("drafter config.json is missing hidden_size, num_target_layers", *model, "--draft", str(no_keys))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(draft, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    expect("is not a readable safetensors file", *model, "--draft", str(corrupt))

    alien = tmp_path / "alien"
    shutil.copytree(target, alien)
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**config, "model_type": "alien_lm"}))
    expect("unsupported target architecture 'alien_lm'", "--model", str(alien), "--draft", str(draft))

    missing_config = tmp_path / "no-config"
    missing_config.mkdir()
    expect("has no config.json", "--model", str(missing_config), "--draft", str(draft))


def test_drafter_config_with_a_string_for_a_number(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair("qwen3")
    bad = tmp_path / "bad"
    shutil.copytree(draft, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_attention_heads": "4"}))
    code, _, err = run_cli(capsys, "--model", str(target), "--draft", str(bad))
    assert code == 1
    assert "num_attention_heads is '4', not an integer" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def edited_target(tmp_path, target, name, edit):
    folder = tmp_path / name
    shutil.copytree(target, folder)
    edit(folder)
    return folder


def truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def raising_template(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + config["chat_template"]
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def drop_config_key(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["tie_word_embeddings"], config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, argv, message", [
    (truncate, [], "target weights {m}/model.safetensors are not usable: it is truncated"),
    (lambda f: (f / "config.json").write_text("{oops"), [], "config.json is not valid JSON"),
    (drop_config_key, [], "could not load the target from {m} (TypeError:"),
    (raising_template, ["--system", "be brief"],
     "the chat template failed on these messages (TemplateError: System role not supported); fix: drop --system"),
    (None, ["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (at character 3)"),
    (None, ["--system", "\udcff"], "--system is not valid UTF-8"),
    (None, ["--seed", str(2**64)], "argument --seed: seed 18446744073709551616 is outside the 64-bit integer range"),
    (None, ["--seed", "x"], "argument --seed: 'x' is not an integer"),
    (None, ["--temp", "nan"], "argument --temp: 'nan' is not a finite number"),
    (None, ["--temp", "1e-40"], "--temp 1e-40: temperature=1e-40 is too small to compute in float32"),
    (None, ["--top-p", "0"], "--top-p 0.0: top_p must be in (0, 1]"),
    (None, ["--top-k", "-1"], "argument --top-k: -1 is negative"),
    (None, ["--max-tokens", "0"], "argument --max-tokens/-m: 0 is not a positive integer"),
    (None, ["--prefill-step-size", "0"], "argument --prefill-step-size: 0 is not a positive integer"),
    (None, ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
], ids=["truncated-weights", "config-json", "config-key", "template-raises", "prompt-utf8", "system-utf8", "seed-range",
        "seed-type", "temp-nan", "temp-underflow", "top-p", "top-k", "max-tokens", "prefill-step", "unknown-flag"])
def test_bad_input_is_one_line(tiny_pair, tmp_path, capsys, edit, argv, message):
    target, draft = tiny_pair("qwen3")
    model = edited_target(tmp_path, target, "edited", edit) if edit else target
    code, _, err = run_cli(capsys, "--model", str(model), "--draft", str(draft), "--max-tokens", "3", *argv)
    assert code == 1 and message.format(m=model) in err, err
    assert err.startswith("dflash-mlx generate: error:") and len(err.strip().splitlines()) == 1


def test_drafter_given_as_model(tiny_pair, capsys):
    _, draft = tiny_pair("qwen3")
    code, _, err = run_cli(capsys, "--model", str(draft), "--draft", str(draft))
    assert code == 1 and f"{draft} is a DFlash drafter, not a target: pass it with --draft" in err
    assert len(err.strip().splitlines()) == 1


def test_stdin_prompt(tiny_pair, capsys, monkeypatch):
    target, draft = tiny_pair("qwen3")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    code, _, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt", "-")
    assert code == 1 and "the prompt on stdin is not valid UTF-8 (byte 0xe9 at offset 3)" in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café au lait".encode())))
    code, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt", "-", "--max-tokens", "3")
    assert code == 0 and "Generation: 3 tokens" in out, err


@pytest.mark.parametrize("seed", ["-1", str(-(2**63)), str(2**63 - 1)])
def test_any_64_bit_seed(tiny_pair, capsys, seed):
    target, draft = tiny_pair("qwen3")
    argv = ["--model", str(target), "--draft", str(draft), "--temp", "1", "--max-tokens", "8", "--verbose", "false"]
    runs = [run_cli(capsys, *argv, "--seed", seed) for _ in range(2)]
    assert runs[0][0] == 0 and runs[0] == runs[1]  # a seed, not an error, and the same seed twice gives one text


def test_stale_build_folders_are_removed(tiny_pair, tmp_path):
    from dflash_mlx.default import _materialize

    _, draft = tiny_pair("qwen3")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".built.tmp-{gone.pid}-x1"  # its build process was killed
    running = tmp_path / f".built.tmp-{os.getpid()}-x2"  # a build in progress
    old = tmp_path / ".built.k3j4h5g6"  # named by an earlier version, untouched for two hours
    recent = tmp_path / ".built.q1w2e3r4"
    for folder in (stale, running, old, recent):
        folder.mkdir()
        (folder / "weights").write_bytes(b"x" * 1000)
    os.utime(old, (time.time() - 7200,) * 2)
    _materialize(tmp_path / "built", lambda out: shutil.copytree(draft, out))
    assert (tmp_path / "built" / "config.json").is_file()
    assert not stale.exists() and not old.exists() and running.exists() and recent.exists()


def test_corrupt_cached_build_is_rebuilt(tiny_pair, tmp_path, caplog):
    from dflash_mlx.default import _materialize
    from dflash_mlx.models import load_drafter

    _, draft = tiny_pair("qwen3")
    built, builds = tmp_path / "built", []

    def build(out):
        builds.append(out)
        shutil.copytree(draft, out)

    _materialize(built, build)
    _materialize(built, build)
    assert len(builds) == 1  # a complete copy is used as it is
    truncate(built)
    _materialize(built, build)
    assert len(builds) == 2 and "is unusable (model.safetensors: it is truncated" in caplog.text
    (built / "config.json").write_text("{")
    _materialize(built, build)
    assert len(builds) == 3 and "config.json is unreadable" in caplog.text
    load_drafter(str(built))  # the rebuilt copy is whole
    assert [p.name for p in tmp_path.iterdir()] == ["built"]  # no build folder left behind
