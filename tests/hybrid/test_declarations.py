"""docs/hybrid.md's declaration of each family by its model layers ("Declaring a model by its
layers"), run as written: every one is accepted, and equals what transformers' config of that
family names layer by layer (`config.layer_types`, no weights built)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hicache.config import ConfigError
from hicache.hybrid import FullAttention, HybridModel, NoCache, Recurrent

transformers = pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"


def doc_block() -> dict[str, Any]:
    """The section's Python block, executed: its names (`declare`, `FAMILIES`, ...)."""
    text = DOC.read_text()
    section = text.split("## Declaring a model by its layers", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "docs/hybrid.md: the section has no Python block"
    names: dict[str, Any] = {}
    exec(compile(block.group(1), str(DOC), "exec"), names)  # the doc's own code, run as written
    return names


def configs() -> dict[str, Any]:
    """Each family's transformers config: its defaults, or the layout the doc gives beside."""
    t = transformers
    return {
        "Gemma 2": t.Gemma2Config(),
        "Gemma 3": t.Gemma3TextConfig(),
        "GPT-OSS": t.GptOssConfig(),
        "Cohere2": t.Cohere2Config(),
        "Bamba": t.BambaConfig(attn_layer_indices=[9, 18, 27]),
        "Jamba": t.JambaConfig(),
        "Qwen3-Next": t.Qwen3NextConfig(),
        "Falcon-H1": t.FalconH1Config(),
        "Zamba2": t.Zamba2Config(),
        "Nemotron-H": t.NemotronHConfig(hybrid_override_pattern="M-M-M-M*-M-M-M-M*-"),
        "LFM2": t.Lfm2Config(num_hidden_layers=16, full_attn_idxs=[2, 5, 8, 10, 12, 14]),
    }


NAMES = doc_block()
CONFIGS = configs()


def test_every_family_the_doc_declares_is_checked_here():
    assert set(NAMES["FAMILIES"]) == set(CONFIGS)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_family_declared_by_model_layer_is_what_its_config_names(family):
    config = CONFIGS[family]
    declared = NAMES["FAMILIES"][family]
    assert isinstance(declared, HybridModel)
    window = (
        getattr(config, "sliding_window", None)
        if "sliding_attention" in (config.layer_types)
        else None
    )
    assert declared == NAMES["declare"](config.layer_types, window=window)
    layers = len(config.layer_types)
    named = {i for g in declared.groups for i in g.layers}
    assert named == set(range(layers))  # every model layer, none past the model


def test_the_three_families_that_failed_before_are_accepted_as_they_are():
    families = NAMES["FAMILIES"]
    falcon, zamba, nemotron = families["Falcon-H1"], families["Zamba2"], families["Nemotron-H"]
    assert falcon.pool_layers == tuple(range(32)) and falcon.recurrent[0].layers == tuple(range(32))
    assert zamba.pool_layers == (6, 12, 18, 24, 30, 36, 42, 47, 51)
    assert 1 in zamba.recurrent[0].layers and 6 in zamba.recurrent[0].layers
    assert nemotron.pool_layers == (7, 16) and isinstance(nemotron.groups[2], NoCache)


def test_a_mistake_in_a_family_declaration_is_still_refused():
    s, g = NAMES["S"], NAMES["G"]
    with pytest.raises(ConfigError, match=r"layers \[1\] are in no group"):  # MLP left out
        HybridModel((FullAttention((0, 2)), Recurrent((0, 2), s, g)), 64)
    with pytest.raises(ConfigError, match="layer 2 is in two groups that both hold its state"):
        HybridModel(
            (FullAttention((0, 1, 2)), Recurrent((0, 1, 2), s, g), Recurrent((2,), s, g)), 64
        )
    with pytest.raises(ConfigError, match="layer 1 is in NoCache and in FullAttention"):
        HybridModel((FullAttention((0, 1)), Recurrent((0,), s, g), NoCache((1,))), 64)
