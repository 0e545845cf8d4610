from __future__ import annotations

import pytest
import torch

from hicache.kernels import MHAGeometry, MLAGeometry, parse_geometry


def test_bytes_per_token():
    assert MHAGeometry(32, 8, 128, torch.bfloat16).bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert MLAGeometry(61, 512, 64, torch.float8_e4m3fn).bytes_per_token == 61 * 576 * 1
    assert MHAGeometry(2, 1, 4, torch.float32).bytes_per_token == 64


@pytest.mark.parametrize(
    "spec", ["mha:32:8:128:bfloat16", "mla:61:512:64:float8_e4m3fn", "mha:1:1:1:float8_e5m2"]
)
def test_spec_round_trip(spec):
    assert parse_geometry(spec).spec() == spec
    assert parse_geometry(spec) == parse_geometry(spec)


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("mha:32:8:128", "5 fields"),
        ("gqa:32:8:128:float16", "kind"),
        ("mha:x:8:128:float16", "layers must be an int"),
        ("mla:4:512:rope:float16", "qk_rope_head_dim must be an int"),
        ("mha:32:8:128:int8", "unknown KV dtype"),
        ("mha:-1:8:128:float16", "layers must be an int >= 0"),
        ("mha:2:0:128:float16", "heads must be a positive int"),
    ],
)
def test_bad_specs_name_the_problem(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_geometry(spec)


def test_geometry_is_frozen():
    g = MHAGeometry(2, 2, 2, torch.float16)
    with pytest.raises(AttributeError):
        g.layers = 3  # type: ignore[misc]
