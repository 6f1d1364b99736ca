"""`dflash-mlx generate`: a real run, and one-line errors (exit 1, no traceback) for bad input."""

import json
import os
import shutil
import subprocess
import sys

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
