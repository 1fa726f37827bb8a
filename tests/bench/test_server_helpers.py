"""``--elastic-env`` as the server benchmarks read it: ``ELASTICKV_X=VALUE`` items, the last
of a repeated name winning; anything else is refused with what was typed."""

from __future__ import annotations

import argparse

import pytest

from elastickv.bench.vllm_server import add_elastic_env_option, elastic_settings


def test_elastic_env_items_become_settings() -> None:
    parser = argparse.ArgumentParser()
    add_elastic_env_option(parser)
    args = parser.parse_args(
        ["--elastic-env", "ELASTICKV_BUDGET=1M", "--elastic-env", "ELASTICKV_BUDGET=2M=x"]
    )
    assert elastic_settings(args.elastic_env) == {"ELASTICKV_BUDGET": "2M=x"}
    assert elastic_settings([]) == {}


@pytest.mark.parametrize("item", ["BUDGET=1M", "ELASTICKV_BUDGET", "VLLM_X=1"])
def test_other_items_are_refused(item: str) -> None:
    with pytest.raises(ValueError, match=f"got {item!r}"):
        elastic_settings([item])
