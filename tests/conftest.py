import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import dflash_mlx  # noqa: E402,F401  (loads OpenBLAS before anything imports mlx.core)
import pytest  # noqa: E402

from tiny import (  # noqa: E402
    LAYOUT_PROMPTS,
    LAYOUTS,
    TARGETS,
    drafter_config,
    layout_config,
    make_drafter,
    save_drafter,
    save_released,
    save_target,
    train_drafter,
    with_layers_of,
)


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """The user cache folder (builds, kept calibrations) of this session's processes, in-process and
    spawned: what tests keep there neither comes from nor outlives the session."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("user-cache")
        patch.setenv("DFLASH_MLX_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Folders of a tiny target and a random drafter for it, per family."""
    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def make(family: str = "qwen3") -> tuple[Path, Path]:
        if family not in cache:
            target = save_target(root / family, family)
            draft = save_drafter(root / f"{family}-draft", drafter_config(TARGETS[family]))
            cache[family] = (target, draft)
        return cache[family]

    return make


@pytest.fixture(scope="session")
def pair(tiny_pair):
    """The tiny qwen3 pair's (target, drafter) folders as strings, as the server tests pass them."""
    return tuple(map(str, tiny_pair("qwen3")))


@pytest.fixture(scope="session")
def released_drafters(tiny_pair, tmp_path_factory):
    """(target folder, tokenizer, {layout: folder}, {prompt: mlx_lm's greedy answer}): a drafter
    for the tiny qwen3 target in every released layout (tiny.layout_config), all with the weights
    of one drafter trained on those answers, so that they accept a fair share of proposals."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from dflash_mlx.target import Target

    target_dir = tiny_pair("qwen3")[0]
    model, tokenizer = mlx_lm.load(str(target_dir))
    base = drafter_config(TARGETS["qwen3"], num_hidden_layers=2, target_layer_ids=[0, 1, 2, 3, 4, 5])
    sequences, answers = [], {}
    for text in LAYOUT_PROMPTS:
        prompt = tokenizer.encode(text)
        answers[text] = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=48)]
        sequences.append((prompt + answers[text], len(prompt)))
    mx.random.seed(0)
    target = Target(model, base["dflash_config"]["target_layer_ids"])
    trained = train_drafter(make_drafter(layout_config(base, "2026")), target, sequences, steps=300)
    root = tmp_path_factory.mktemp("released")
    folders = {}
    for layout in LAYOUTS:
        config = layout_config(base, layout)
        folders[layout] = save_released(root / layout, with_layers_of(make_drafter(config), trained), config)
    return target_dir, tokenizer, folders, answers
