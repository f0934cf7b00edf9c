"""The page's generation controls and the tree controls: the ``Controls`` a reply reads when it
starts, the sampling presets (the model's chat defaults; greedy for the exactness demo), the tree
dropdown's choices, and the custom-tree check (paper 2.1.2: a tree is a list of paths of head ranks).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import gradio as gr

from medusa_core import CHAIN_SOURCES, CHAT_PRESET, DRAFT_SOURCES, SAMPLING_MODES, TREE_PRESETS, MedusaModel, SamplingConfig

from ..engine import Engine
from ..settings import AppSettings
from ..stats import DRAFT_LABELS
from .views import Updates

CUSTOM_TREE = "custom"  # the tree dropdown's entry that selects the custom-tree textbox


@dataclass(frozen=True)
class Controls:
    """The page's generation controls, read when a reply starts (a change applies to the next reply)."""

    medusa: bool
    drafts: str  # where candidates come from (medusa_core.DRAFT_SOURCES): hybrid, heads or ngram
    temperature: float
    top_k: int  # 0 = off; this and top-p, min-p matter when temperature > 0
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    repetition_penalty: float  # 1 = off; applies at temperature 0 too
    sampling: str  # "typical" or "exact" (medusa_core.SAMPLING_MODES); matters when temperature > 0
    posterior_threshold: float  # ε
    posterior_alpha: float  # δ
    tree: str | None  # a tree name, CUSTOM_TREE, or None for the model's default tree
    custom_tree: str  # JSON list of paths, used when tree == CUSTOM_TREE
    max_new_tokens: int
    seed: int | None  # None: a fresh seed per reply (only matters when temperature > 0)
    system_prompt: str
    highlight: bool  # highlight the tokens accepted from the heads

    @classmethod
    def from_settings(cls, settings: AppSettings, model: MedusaModel | None = None) -> "Controls":
        """The controls as the page first shows them (``model``: None while it loads; see ``chat_defaults``)."""
        return cls(
            medusa=True,
            drafts=drafts_default(settings, model),
            **sampling_fields(chat_defaults(settings, model)),
            sampling=settings.sampling,
            posterior_threshold=settings.posterior_threshold,
            posterior_alpha=settings.posterior_alpha,
            tree=settings.tree,
            custom_tree="",
            max_new_tokens=settings.max_new_tokens,
            seed=None,
            system_prompt=settings.system_prompt,
            highlight=False,
        )


CONTROL_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Controls))


@dataclass(frozen=True)
class Range:
    """What a numeric control accepts: its label on the page, its bounds and whether it takes whole numbers.
    The page's slider or number box is built from it (``app.ui``), and ``read_controls`` checks it."""

    label: str
    minimum: float
    maximum: float | None  # None: no upper bound
    integer: bool = False
    note: str = ""  # what a special value means, e.g. "−1 = a fresh seed per reply"

    def allowed(self) -> str:
        """The allowed values in words, e.g. "a number from 0 to 2" or "a whole number ≥ −1 (−1 = ...)"."""
        kind = "a whole number" if self.integer else "a number"
        bounds = f"from {self.minimum:g} to {self.maximum:g}" if self.maximum is not None else f"≥ {self.minimum:g}"
        return f"{kind} {bounds}" + (f" ({self.note})" if self.note else "")


#: The numeric controls' ranges. ε, δ > 0: at 0 the threshold min(ε, δ·exp(−H)) is 0 and every candidate would be accepted.
CONTROL_RANGES: dict[str, Range] = {
    "temperature": Range("Temperature", 0.0, 2.0, note="0 = greedy"),
    "top_k": Range("Top-k", 0, None, integer=True, note="0 = off"),
    "top_p": Range("Top-p", 0.01, 1.0, note="1 = off"),
    "min_p": Range("Min-p", 0.0, 1.0, note="0 = off"),
    "repetition_penalty": Range("Repetition penalty", 0.5, 2.0, note="1 = off"),
    "posterior_threshold": Range("ε posterior threshold", 0.01, 0.5),
    "posterior_alpha": Range("δ posterior alpha", 0.01, 1.0),
    "max_new_tokens": Range("Max new tokens", 1, 2048, integer=True),
    "seed": Range("Seed", -1, None, integer=True, note="−1 = a fresh seed per reply"),
}
#: The choice controls: label and allowed values.
CONTROL_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "drafts": ("Drafts", tuple(DRAFT_SOURCES)),
    "sampling": ("Sampling", tuple(SAMPLING_MODES)),
}
CONTROL_FLAGS = {"medusa": "Medusa", "highlight": "Highlight drafted tokens"}
CONTROL_TEXTS = {"tree": "Tree", "custom_tree": "Custom tree", "system_prompt": "System prompt"}


def read_controls(values: Mapping[str, Any]) -> Controls:
    """``Controls`` from the control components' raw values (as the browser or an API client sends them).

    Raises ``ValueError`` naming the control, the value and what it allows: a value out of range, not a
    number (a string, NaN, infinity), a fraction where a whole number is needed, or a choice not offered.
    A tree name is checked against the model when the reply starts (``tree_argument``).
    """
    fields: dict[str, Any] = {}
    for name in CONTROL_NAMES:
        value = values.get(name)
        if name in CONTROL_RANGES:
            fields[name] = _number(CONTROL_RANGES[name], value)
        elif name in CONTROL_CHOICES:
            label, choices = CONTROL_CHOICES[name]
            if value not in choices:
                raise ValueError(f"{label}: {value!r} is not a choice; allowed: {', '.join(choices)}")
            fields[name] = value
        elif name in CONTROL_FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"{CONTROL_FLAGS[name]}: {value!r} is not allowed; allowed: true or false")
            fields[name] = value
        else:
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{CONTROL_TEXTS[name]}: {value!r} is not allowed; allowed: text")
            fields[name] = value or ("" if name != "tree" else None)
    fields["seed"] = None if fields["seed"] < 0 else fields["seed"]
    return Controls(**fields)


def _number(limits: Range, value: Any) -> float | int:
    """``value`` checked against ``limits``; ValueError naming the control and the allowed values."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{limits.label}: {value!r} {why}; allowed: {limits.allowed()}")

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse("is not a number")
    if not math.isfinite(value):
        raise refuse("is not a finite number")
    if limits.integer and value != int(value):
        raise refuse("is not a whole number")
    if value < limits.minimum or (limits.maximum is not None and value > limits.maximum):
        raise refuse("is out of range")
    return int(value) if limits.integer else float(value)
#: The "greedy (exactness demo)" preset: argmax decoding with nothing else on, so Medusa's reply equals
#: plain greedy decoding and HF ``generate`` token for token (top-k, top-p, min-p do nothing at T = 0).
GREEDY_PRESET = {"temperature": 0.0, "repetition_penalty": 1.0}


def chat_defaults(settings: AppSettings, model: MedusaModel | None) -> SamplingConfig:
    """The sampling settings a chat starts with: the model's (its generation config's sampling values,
    else ``CHAT_PRESET``; ``CHAT_PRESET`` while no model is loaded), overridden by those set in ``settings``."""
    base = model.chat_defaults if model is not None else CHAT_PRESET
    names = [f.name for f in dataclasses.fields(SamplingConfig)]
    return dataclasses.replace(base, **{n: getattr(settings, n) for n in names if getattr(settings, n) is not None})


def drafts_default(settings: AppSettings, model: MedusaModel | None) -> str:
    """The Drafts control's first value: the settings' ``drafts``, else ``"eagle"`` (drafter + corpus) for a model
    with an EAGLE-style drafter, the fastest drafts on the demo at the chat preset and at greedy (README, Speed), else
    ``"corpus"`` (heads + corpus) for a model with a corpus of its own replies, else ``"heads"`` (also while no model
    is loaded)."""
    if settings.drafts is not None:
        return settings.drafts
    if model is None:
        return "heads"
    return "eagle" if model.has_drafter else "corpus" if model.has_corpus else "heads"


def ready_controls(controls: Controls, settings: AppSettings, model: MedusaModel) -> Controls:
    """``controls`` as read while the model loaded, with the values the page gives them once it is ready
    (``page_status``): the model's default drafts (``drafts_default``) and ``chat_values``. A message sent during the
    load is answered with them."""
    return dataclasses.replace(controls, drafts=drafts_default(settings, model), **chat_values(settings, model))


def chat_values(settings: AppSettings, model: MedusaModel | None) -> dict[str, Any]:
    """The sampling controls' values at ``chat_defaults``, with the settings' verification mode."""
    return sampling_fields(chat_defaults(settings, model)) | {"sampling": settings.sampling}


def sampling_fields(config: SamplingConfig) -> dict[str, float | int]:
    """``config`` as ``Controls`` field values."""
    return dataclasses.asdict(config)


def sampling_config(controls: Controls) -> SamplingConfig:
    """The ``SamplingConfig`` of the controls; ``ValueError`` names a value out of range (a typed number box)."""
    return SamplingConfig(**{n: getattr(controls, n) for n in sampling_fields(SamplingConfig())})


#: The component of each sampling control, and what it does when active (HF generate semantics).
SAMPLING_CONTROLS = {"temperature": gr.Slider, "top_k": gr.Number, "top_p": gr.Slider, "min_p": gr.Slider,
                     "repetition_penalty": gr.Slider, "sampling": gr.Radio}
FILTER_INFO = {
    "top_k": "sample among the k most likely tokens only (0 = off)",
    "top_p": "sample among the most likely tokens holding this much probability (1 = off)",
    "min_p": "drop tokens less likely than min-p × the most likely one (0 = off)",
}


def greedy_preset() -> Updates:
    """The "greedy (exactness demo)" button: temperature 0 and no repetition penalty (``GREEDY_PRESET``)."""
    return {name: SAMPLING_CONTROLS[name](value=value) for name, value in GREEDY_PRESET.items()}


def chat_preset(engine: Engine, settings: AppSettings) -> Updates:
    """The "chat defaults" button (and the page once the model is ready): every sampling control at
    ``chat_defaults`` and the verification mode of the settings."""
    return {name: SAMPLING_CONTROLS[name](value=value) for name, value in chat_values(settings, engine.model).items()}


TREE_INFO = "the candidate tree verified at each step: the model's own trees first"
MEDUSA_OFF_INFO = "inactive: Medusa is off (plain decoding, one token per step)"
DRAFTS_INFO = ("where each step's candidates come from: heads = the heads only (the paper's Medusa); hybrid = the heads' tree "
               "plus a chain copied from the conversation (prompt lookup), both verified in one pass; n-gram = the copied chain only; "
               "heads + corpus = the heads' tree, or where the model's corpus of its own replies is confident a chain from it; "
               "drafter + corpus = the corpus's chain, else a chain from the model's EAGLE-style drafter (a model that ships one). "
               "The heads' tree is shaped per step by the model's tuned τ (Model panel: tree shaping)")
PUBLISHED_TREE_NODES = 64  # the Medusa paper's published trees: 63 candidates + root, tuned for 7B–33B models on GPUs


def tree_choices(model: MedusaModel) -> list[tuple[str, str]]:
    """(label, value) pairs for the tree dropdown, each with its node count, in three groups: the
    model's own trees (calibrated, machine-tuned); trees sized for small models and CPUs (presets,
    chain and dense trees); the published 63-node trees, marked as sized for 7B–33B models on GPUs.
    Then the custom tree."""
    k = model.num_heads
    names = model.tree_names()
    names += [f"chain_{d}" for d in range(1, k + 1) if f"chain_{d}" not in names]
    dense = {"dense_4x2": 2, "dense_3x2x2": 3, "dense_2x2x2x2": 4, "dense_3x3x2x2x1": 5}
    names += [n for n, depth in dense.items() if depth <= k]
    groups: tuple[list[tuple[str, str]], ...] = ([], [], [])
    for name in names:
        try:
            nodes = len(model.resolve_tree(name)[1]) + 1
        except ValueError:  # a model tree deeper than its heads: not offered
            continue
        if name in model.trees:
            tuned_at = [t.preset for t in model.tuned.values() if t.tree == name]
            note = f" · tuned at {' and '.join(tuned_at)}" if tuned_at else ""
            default = " · the default: each reply's settings take their tuned tree" if name == model.default_tree and model.tuned else ""
            groups[0].append((f"{name} ({nodes} nodes · this model's own{note}{default})", name))
        elif name in TREE_PRESETS and nodes >= PUBLISHED_TREE_NODES:
            groups[2].append((f"{name} ({nodes} nodes · published, sized for 7B–33B models on GPUs)", name))
        else:
            groups[1].append((f"{name} ({nodes} nodes)", name))
    return [*groups[0], *groups[1], *groups[2], ("custom (JSON paths below)", CUSTOM_TREE)]


def explain_controls(medusa: bool, temperature: float, sampling: str = "typical", drafts: str = "heads") -> Updates:
    """Grey out the controls that do nothing for the next reply, saying why: the tree, drafts, ε and δ with
    Medusa off; the tree with drafts that are a chain alone (drafter + corpus, n-gram only: ``generate`` verifies
    the chain, not the heads' tree); ε and δ at temperature 0 (greedy decoding accepts exact matches only) and with
    exact sampling (rejection sampling has no thresholds); top-k, top-p and min-p at temperature 0. The values
    arrive unchecked (a number typed out of range is still being edited): a temperature that is not a
    number changes nothing."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        return {"tree": gr.skip()}
    greedy = "inactive at temperature 0: greedy takes the most likely token (the repetition penalty still applies)"
    updates = {name: SAMPLING_CONTROLS[name](interactive=temperature > 0, info=greedy if temperature <= 0 else info)
               for name, info in FILTER_INFO.items()}
    if not medusa:
        typical = {"interactive": False, "info": MEDUSA_OFF_INFO}
    elif temperature <= 0:
        typical = {"interactive": False, "info": "inactive at temperature 0: greedy decoding accepts exact matches only"}
    elif sampling == "exact":
        typical = {"interactive": False, "info": "inactive with exact sampling: rejection sampling uses no thresholds"}
    else:
        typical = {"interactive": True, "info": "accept a candidate when its probability > min(ε, δ·exp(−entropy))"}
    tree = tree_state(medusa, drafts)
    source = {"interactive": True, "info": DRAFTS_INFO} if medusa else {"interactive": False, "info": MEDUSA_OFF_INFO}
    return updates | {"tree": gr.Dropdown(**tree), "drafts": gr.Radio(**source), "posterior_threshold": gr.Slider(**typical), "posterior_alpha": gr.Slider(**typical)}


def tree_state(medusa: bool, drafts: str) -> dict[str, Any]:
    """The tree control's ``interactive`` and ``info`` for these controls (``explain_controls``, and the page once the
    model is ready): inactive with Medusa off and with drafts that are a chain alone (``CHAIN_SOURCES``)."""
    if not medusa:
        return {"interactive": False, "info": MEDUSA_OFF_INFO}
    if drafts in CHAIN_SOURCES:
        return {"interactive": False, "info": f"inactive with {DRAFT_LABELS[drafts]} drafts: each step verifies a chain, not the heads' tree"}
    return {"interactive": True, "info": TREE_INFO}


def tree_argument(model: MedusaModel, tree: str | None, custom_tree: str) -> str | list[list[int]] | None:
    """The ``tree`` for ``model.generate`` from the tree controls; ValueError with the validator's message.
    The model's default tree stands for the tree tuned at the reply's settings (None: ``MedusaModel.tuned_for``)."""
    if tree != CUSTOM_TREE:
        if tree:
            model.resolve_tree(tree)
        return None if tree == model.default_tree else tree or None
    try:
        paths = json.loads(custom_tree)
    except json.JSONDecodeError as e:
        raise ValueError(f"the custom tree is not valid JSON ({e.msg}); write paths like [[0], [1], [0, 0]]") from e
    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        raise ValueError("the custom tree must be a JSON list of paths, e.g. [[0], [1], [0, 0]]")
    model.resolve_tree(paths)
    return paths


def medusa_notice(engine: Engine, temperature: float, drafts: str) -> Updates:
    """The note beside the Medusa toggle: where ``bench tune`` measured the drafts in use (the drafter's tuned chain
    for ``drafts="eagle"``, else the tree tuned for the settings preset of ``temperature``) slower than the plain loop
    on this machine (``TunedSettings.slower_than_plain``), it says so, so that Medusa on does not slow the reply
    silently; otherwise no note. The temperature arrives unchecked (a number typed out of range is still being
    edited): one that is not a number ≥ 0 changes nothing."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        return {"medusa": gr.skip()}
    tuned = engine.model.tuned_for(SamplingConfig(temperature=temperature)) if engine.model is not None else None
    if tuned is None or not tuned.slower_than_plain(drafts):
        return {"medusa": gr.Checkbox(info="")}
    where = f"on {tuned.device_name}" if tuned.device_name else "on this machine"
    return {"medusa": gr.Checkbox(info=f"⚠ Medusa ({DRAFT_LABELS.get(drafts, drafts)}) measured {tuned.speedup(drafts):.2f}× the "
                                       f"plain loop at these settings ({tuned.preset} preset) {where}: plain decoding is faster here")}


def check_tree(engine: Engine, tree: str | None, custom_tree: str) -> Updates:
    """The tree status line: for a custom tree its node count and depth, or the validator's message."""
    if engine.model is None or tree != CUSTOM_TREE:
        return {"tree_status": ""}
    if not custom_tree.strip():
        return {"tree_status": "Write the tree as a JSON list of paths, e.g. `[[0], [1], [0, 0], [0, 0, 0]]`."}
    try:
        name, choices = engine.model.resolve_tree(tree_argument(engine.model, tree, custom_tree))
    except ValueError as e:
        return {"tree_status": f"⚠ {html.escape(str(e))}"}
    return {"tree_status": f"✓ `{name}`: {len(choices) + 1} nodes, depth {max(map(len, choices))}"}

