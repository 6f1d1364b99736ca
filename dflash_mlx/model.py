"""The model pair: a target (anything mlx_lm loads) and the DFlash drafter that speculates for it.

A leaf of the package: loading, pairing and the pair object, used by generation,
the adaptive policy, training, the server and the benchmark alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.nn as nn
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .checkpoint import check_weights, read_config, resolve
from .models import Drafter, is_drafter_config, load_drafter
from .errors import DFlashError, one_line
from .target import Target

MAX_BLOCK_SIZE = 32
# Set in every rank's environment by mlx.launch, mpirun or the jaccl launcher.
LAUNCHER_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "MLX_JACCL_COORDINATOR")


@dataclass(eq=False)  # identity, not value: the adaptive policy keys its calibration on the pair
class DFlashModel:
    """A target and the drafter that speculates for it."""

    target: Target
    drafter: Drafter

    @property
    def block_size(self) -> int:
        return self.drafter.args.block_size


def check_pair(target: Target, drafter: Drafter) -> None:
    """Refuse a drafter trained for another target, with the fix in the message."""
    a = drafter.args
    if a.hidden_size != target.hidden_size:
        raise DFlashError(
            f"drafter hidden size {a.hidden_size} does not match the target's {target.hidden_size}: "
            "use the drafter trained for this target"
        )
    if a.vocab_size != target.vocab_size:
        raise DFlashError(
            f"drafter vocab size {a.vocab_size} does not match the target's {target.vocab_size}: "
            "use the drafter trained for this target"
        )
    if not 0 <= a.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"drafter mask_token_id {a.mask_token_id} is outside the target vocabulary "
            f"(size {target.vocab_size}): fix dflash_config.mask_token_id in the drafter config"
        )


def load_target(path_or_repo: str, chat_template: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """``mlx_lm.load`` with one-line errors (a local folder or a Hub id); ``chat_template`` replaces the model's."""
    path = resolve(str(path_or_repo), "model")
    config = read_config(path)
    if is_drafter_config(config):
        raise DFlashError(f"{path} is a DFlash drafter, not a target: pass it with --draft and the target model with --model")
    check_weights(path, "target")
    try:
        return mlx_lm.load(str(path), tokenizer_config={"chat_template": chat_template} if chat_template else None)
    except ValueError as e:
        if "not supported" in str(e):
            raise DFlashError(
                f"unsupported target architecture {config.get('model_type')!r}: "
                "mlx_lm cannot load it; upgrade mlx-lm or pick another model"
            ) from None
        raise DFlashError(f"could not load the target from {path}: {one_line(e)}") from None
    except (FileNotFoundError, TypeError, KeyError, RuntimeError) as e:
        # A config that does not fit its model_type, missing files, unreadable weights.
        raise DFlashError(f"could not load the target from {path} ({type(e).__name__}: {one_line(e)})") from None


def load(model: str, draft: str, chat_template: str | None = None, pipeline: bool = False) -> tuple[DFlashModel, TokenizerWrapper]:
    """Load a target (folder or Hub id, anything mlx_lm loads) and its DFlash drafter.

    ``chat_template`` (Jinja source) replaces the target's own template. Under
    ``mlx.launch`` with two or more ranks the target is sharded across them
    (``distributed.py``): tensor parallel where mlx_lm can, or by layers with
    ``pipeline``. Then this returns on rank 0 only; the other ranks follow rank 0
    inside this call and end their process when rank 0 ends. The drafter computes in the
    target's dtype: it reads the target's hidden states, and weights of another dtype would be
    widened at every forward (a float16 drafter beside a float32 target drafts 1.6x slower on CPU).
    """
    shards = None
    if pipeline or any(name in os.environ for name in LAUNCHER_VARIABLES):
        from .distributed import Shards  # only then: a single process imports nothing distributed

        shards = Shards.join(pipeline)
    target_model, tokenizer = shards.load(model, chat_template) if shards else load_target(model, chat_template)
    drafter = load_drafter(draft)
    target = (shards.target if shards else Target)(target_model, drafter.args.target_layer_ids)
    check_pair(target, drafter)
    drafter.set_dtype(target.dtype)  # its floating-point parameters only: quantized codes stay as they are
    return DFlashModel(target, drafter), tokenizer
