"""Reading a Medusa checkpoint's files: the folder ("demo", a path or a Hub id), its JSON files, the head file
(safetensors, or a ``.pt`` read only with ``weights_only=True``), a Medusa-2 model's ``medusa_head.*`` tensors, and the
heads they make (``heads_from_state_dict``). The layouts: ``medusa_core.loading``; MEDUSA_FACTS.md."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..errors import MedusaCheckpointError
from ..heads import MedusaHeads

#: The shipped demo model (``load_medusa_model("demo")``).
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent.parent / "assets" / "demo"
HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
#: The one extra tensor of root-conditioned heads (layout "root" of ``medusa_core.heads``).
ROOT_KEY = "root_weight"
_HEAD_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def heads_from_state_dict(
    state: dict[str, torch.Tensor], backbone: nn.Module, *, source: str = "state dict"
) -> MedusaHeads:
    """Build ``MedusaHeads`` from reference head-only keys, checked against the backbone.

    The number of heads K and blocks L are inferred from the keys; a state without ``{i}.{L}.weight``
    projections is a "version 2" checkpoint and shares the backbone's LM head; a state with ``root_weight``
    ([K, H, H], layout "root" of ``medusa_core.heads``) gives root-conditioned heads that read the
    backbone's input embedding.
    Raises ``MedusaCheckpointError`` naming ``source``, the key, the expected and the found shape.
    """
    lm_head = backbone.get_output_embeddings()
    vocab, hidden = lm_head.out_features, lm_head.in_features
    blocks: dict[int, set[int]] = {}
    for key in state:
        if key == ROOT_KEY:
            continue
        m = _HEAD_KEY.match(key)
        if not m:
            raise MedusaCheckpointError(f"{source}: unexpected key {key!r} (expected '{{i}}.{{j}}.linear.weight' ...)")
        blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not blocks:
        raise MedusaCheckpointError(f"{source}: no Medusa head tensors found")
    num_heads = max(blocks) + 1
    if sorted(blocks) != list(range(num_heads)):
        raise MedusaCheckpointError(f"{source}: head indices {sorted(blocks)} are not 0..{num_heads - 1}")
    num_layers = sum(1 for j in blocks[0] if f"0.{j}.linear.weight" in state)
    shared = f"0.{num_layers}.weight" not in state
    root_embedding = backbone.get_input_embeddings() if ROOT_KEY in state else None
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, shared_lm_head=lm_head if shared else None,
                        root_embedding=root_embedding)
    expected = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    for key, shape in expected.items():
        if key not in state:
            raise MedusaCheckpointError(f"{source}: missing tensor {key!r} of shape {list(shape)}")
        if tuple(state[key].shape) != shape:
            raise MedusaCheckpointError(
                f"{source}: tensor {key!r} has shape {list(state[key].shape)}, expected {list(shape)} "
                f"for a backbone with hidden size {hidden} and vocabulary {vocab}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise MedusaCheckpointError(f"{source}: unexpected tensors {extra[:5]} for {num_heads} heads of {num_layers} blocks")
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return heads


def local_folder(name_or_path: str | Path) -> Path:
    """A local folder for ``"demo"``, a path, or a Hub id (downloaded or taken from the cache)."""
    if str(name_or_path) == "demo":
        if not (DEMO_MODEL_DIR / "config.json").exists():
            raise MedusaCheckpointError(f"the demo model is missing: expected it in {DEMO_MODEL_DIR}")
        return DEMO_MODEL_DIR
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise MedusaCheckpointError(f"{path} has no config.json: not a Medusa checkpoint folder")
        return path
    if path.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") != 1:
        raise MedusaCheckpointError(f"{name_or_path}: no such folder, and not a Hub id of the form 'owner/name'")
    return _hub_snapshot(str(name_or_path))


def _hub_snapshot(repo_id: str) -> Path:
    """The local folder of Hub repo ``repo_id``'s checkpoint files (downloaded, or from the cache when offline).
    Raises ``MedusaCheckpointError`` when it is not cached and the Hub cannot be reached, or the download fails."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "medusa_lm_head.pt", "*.model", "*.txt"]))
    except LocalEntryNotFoundError as e:
        raise MedusaCheckpointError(
            f"{repo_id} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(offline?): download it once with network access, or pass a local folder ({e})"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise MedusaCheckpointError(f"could not fetch {repo_id} from the Hugging Face Hub: {e}") from e


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``MedusaCheckpointError`` naming the file if it is missing or not one."""
    if not path.exists():
        raise MedusaCheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MedusaCheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        raise MedusaCheckpointError(f"{path} holds a JSON {kind}, expected an object ({{...}})")
    return data


def read_ranking(path: Path, vocab_size: int) -> torch.Tensor:
    """The token ids [R] of a ``DRAFT_RANKING_FILE``, most frequent first. Raises ``MedusaCheckpointError`` unless
    the file is ``{"ranked_ids": [...]}`` with distinct ids in 0..vocab_size−1."""
    ids = read_json(path).get("ranked_ids")
    valid = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)
    if not valid or len(set(ids)) != len(ids):
        raise MedusaCheckpointError(f"{path}: 'ranked_ids' must be a non-empty list of distinct token ids in 0..{vocab_size - 1}")
    return torch.tensor(ids, dtype=torch.long)


def read_head_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a head file; ``MedusaCheckpointError`` naming it when it is damaged or holds more."""
    if path.suffix == ".safetensors":
        try:
            return load_file(path)
        except (SafetensorError, OSError) as e:
            raise MedusaCheckpointError(f"{path} could not be read (truncated or not a safetensors file?): {e}") from e
    # Pickled checkpoints load only as plain tensors: never execute code from a file.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise MedusaCheckpointError(f"{path} holds more than tensors and was not loaded (weights_only=True): {e}") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise MedusaCheckpointError(f"{path} could not be read (truncated or not a PyTorch file?): {e}") from e
    if not isinstance(state, dict):
        raise MedusaCheckpointError(f"{path} holds a {type(state).__name__}, expected a state_dict")
    return state


def read_full_checkpoint_heads(folder: Path) -> dict[str, torch.Tensor]:
    """``medusa_head.*`` tensors from a Medusa-2 model folder's safetensors or .bin shards."""
    prefix = "medusa_head."
    state: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    for shard in shards:
        try:
            if shard.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(shard, framework="pt") as f:
                    for key in f.keys():
                        if key.startswith(prefix):
                            state[key[len(prefix):]] = f.get_tensor(key)
            else:
                tensors = torch.load(shard, map_location="cpu", weights_only=True)
                state.update({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        except (SafetensorError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
            raise MedusaCheckpointError(f"{shard} could not be read (truncated, or more than tensors?): {e}") from e
    if not state:
        raise MedusaCheckpointError(
            f"no Medusa heads in {folder}: its weights hold no medusa_head.* tensors and there is no "
            f"{' or '.join(HEAD_FILES)}"
        )
    return state
