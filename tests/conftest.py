import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import dflash_mlx  # noqa: E402,F401  (loads OpenBLAS before anything imports mlx.core)
import pytest  # noqa: E402

from tiny import TARGETS, drafter_config, save_drafter, save_target  # noqa: E402


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
