"""Trees tuned per machine and per sampling settings (paper 2.3.3): the entries of ``medusa_tuned.json``.

``python -m medusa_core.bench tune`` measures each tree size on this machine at a settings preset
(``TUNED_PRESETS``: greedy, and the chat preset the app starts with) and writes one entry per device,
precision and preset under ``tuned_key``: ``"cpu/gguf@chat"``, or ``"cpu+amx/gguf@chat"`` for a gguf backbone whose
4-bit product runs on AMX tiles (``machine_class``: a tree row costs a few percent of a pass there, up to a third of
one on AVX512-BF16 dot products, so such a CPU keeps trees of its own and falls back to the device's entry without
one). Files written before entries were per settings hold one entry per device and precision (``"cpu/gguf"``),
measured greedy; they are still read, as the greedy entry and as the tree of any preset that has no entry of its own.
A reply's settings pick an entry through ``settings_preset``: greedy at temperature 0, chat otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .processors import SamplingConfig
from .quant.layers import Int4Linear

#: The settings ``bench tune`` measures at: greedy (the exactness demo) and the chat preset (the app's defaults).
TUNED_PRESETS = ("greedy", "chat")


def machine_class(device: torch.device, quantization: str | None) -> str:
    """``"cpu+amx"`` for a gguf backbone (``Int4Linear`` layers) on a CPU whose 4-bit product runs on AMX tiles
    (``Int4Linear.kernel_name``, set when the lean extension loads), else ``device.type``: the first part of this
    machine's ``tuned_key`` for that precision."""
    amx = device.type == "cpu" and quantization == "gguf" and Int4Linear.kernel_name == "amx"
    return "cpu+amx" if amx else device.type


def tuned_key(device: torch.device, quantization: str | None, preset: str | None = None, machine: str | None = None) -> str:
    """Key of a tuned entry in ``medusa_tuned.json``: ``"<machine>/<quantization>@<preset>"`` (``machine``: the
    device's type unless given, e.g. ``machine_class(device, quantization)``), or without ``preset`` the key of files
    written before entries were per settings (``"cpu/gguf"``). Raises ``ValueError`` for a preset not in
    ``TUNED_PRESETS``."""
    if preset is not None and preset not in TUNED_PRESETS:
        raise ValueError(f"preset must be one of {TUNED_PRESETS}, got {preset!r}")
    base = f"{machine or device.type}/{quantization or 'none'}"
    return base if preset is None else f"{base}@{preset}"


def settings_preset(config: SamplingConfig) -> str:
    """The tuned preset whose entry serves ``config``: ``"greedy"`` at temperature 0, else ``"chat"``."""
    return "greedy" if config.greedy else "chat"


@dataclass(frozen=True)
class TunedSettings:
    """What ``bench tune`` chose for one preset on this machine.

    Attributes:
        preset: the settings the entry serves (``TUNED_PRESETS``).
        tree: name of the tuned tree among the model's trees.
        min_head_probability: τ, the path probability a head node needs to be verified (0 = every node).
        measured_at: the preset the entry was measured at: ``preset``, or ``"greedy"`` for an entry read
            from a file written before entries were per settings and used for another preset.
        measured_speedup: the tuned tree's tokens/s ÷ the plain loop's in the tuner's confirming benchmark
            (None when the entry does not say).
        device_name: the processor the entry was measured on (None when the entry does not say).
        chain_depth, chain_threshold: the EAGLE-style drafter's chain ``bench tune`` chose (the most drafts a step,
            the chain probability a draft needs; ``DraftConfig``), None when the entry has none.
        chain_measured_speedup: that chain's tokens/s ÷ the plain loop's in the tuner's run (None: not measured).
    """

    preset: str
    tree: str
    min_head_probability: float
    measured_at: str
    measured_speedup: float | None = None
    device_name: str | None = None
    chain_depth: int | None = None
    chain_threshold: float | None = None
    chain_measured_speedup: float | None = None

    def speedup(self, drafts: str) -> float | None:
        """What the entry measured at its own preset for ``generate(drafts=...)``: the drafter's chain's speedup over the
        plain loop for ``"eagle"``, the tree's for the other sources; None when not measured (or measured at another
        preset)."""
        if self.measured_at != self.preset:
            return None
        return self.chain_measured_speedup if drafts == "eagle" else self.measured_speedup

    def slower_than_plain(self, drafts: str) -> bool:
        """True when the entry measured ``drafts`` (``speedup``) slower than the plain loop at its own preset."""
        speedup = self.speedup(drafts)
        return speedup is not None and speedup < 1


def tuned_entries(data: Mapping[str, Any], device: torch.device, quantization: str | None) -> dict[str, tuple[str, Any, str]]:
    """This device and precision's entries of a tuned file's ``data``: preset -> (key, entry, measured_at).

    A preset's own entry for this machine class (``machine_class``) first, then for the device's type, else the
    entry of a file written before entries were per settings (measured greedy). Presets with none are left out.
    """
    legacy = tuned_key(device, quantization)
    found = {}
    for preset in TUNED_PRESETS:
        own = tuned_key(device, quantization, preset, machine_class(device, quantization))
        key = own if own in data else tuned_key(device, quantization, preset)
        if key in data:
            found[preset] = (key, data[key], preset)
        elif legacy in data:
            found[preset] = (legacy, data[legacy], "greedy")
    return found
