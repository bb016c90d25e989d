"""``bench.frontdoor``'s large bodies: the size asked for, made of the structure named."""

from __future__ import annotations

import json

import pytest

from bench.frontdoor import SHAPES, large_body


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_is_a_json_body_of_about_the_size_asked_for(shape):
    body = large_body(shape, 0.5)
    assert 0.45e6 <= len(body) <= 0.6e6, len(body)
    parsed = json.loads(body)
    where = {"text": ("prompt", str), "members": ("logit_bias", dict), "batch": ("prompt", list),
             "arrays": ("response_format", dict), "kept": ("prompt", str), "kept-word": ("prompt", str)}[shape]
    assert isinstance(parsed[where[0]], where[1])
    if shape.startswith("kept"):
        assert parsed["truncate_prompt_tokens"] == -1 and (" " in parsed["prompt"]) == (shape == "kept")
    if shape == "arrays":
        assert parsed["response_format"]["json_schema"]["schema"]["x"][:2] == [[], []]
    with pytest.raises(ValueError, match="unknown shape"):
        large_body("nested", 0.1)
