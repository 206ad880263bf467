"""dtcp.config from the environment: every variable sets its setting, read once by
Config.from_env, and a value that does not parse or check raises naming the variable."""

from __future__ import annotations

import pytest

from dtcp.config import _ENVIRONMENT, Config

GOOD = {
    "DTCP_TIMEOUT": ("12.5", "timeout_s", 12.5),
    "DTCP_CHECK_EVERY_CALL": ("yes", "check_every_call", True),
    "DTCP_TRANSPORT": (" NCCL ", "transport", "nccl"),
    "DTCP_HIGH_PRIORITY_RING": ("0", "high_priority_ring", False),
    "DTCP_MERGE": ("Torch", "merge", "torch"),
    "DTCP_MERGE_SLOTS_BYTES": ("0", "merge_slots_bytes", 0),
    "DTCP_COST_OBJECTIVE": ("device", "cost_objective", "device"),
    "DTCP_LAYER_FLOPS_PER_TOKEN": ("1.3e9", "layer_flops_per_token", 1.3e9),
    "DTCP_RING_STEPS_PER_LAUNCH": ("AUTO", "ring_steps_per_launch", "auto"),
    "DTCP_KERNEL_REPLAY": ("off", "kernel_replay", False),
    "DTCP_ALLGATHER_EXCHANGE": ("0", "allgather_exchange", False),
    "DTCP_ATTENTION_HEADS": ("32, 8,128", "attention_heads", (32, 8, 128)),
    "DTCP_AUTO_PLACEMENT": ("Fastest", "auto_placement", "fastest"),
}
BAD = {
    "DTCP_TIMEOUT": ("soon", "could not convert"),
    "DTCP_CHECK_EVERY_CALL": ("maybe", "use 1 or 0"),
    "DTCP_TRANSPORT": ("p2p", "must be one of"),
    "DTCP_HIGH_PRIORITY_RING": ("2", "use 1 or 0"),
    "DTCP_MERGE": ("cuda", "must be one of"),
    "DTCP_MERGE_SLOTS_BYTES": ("-5", "must be an int >= 0"),
    "DTCP_COST_OBJECTIVE": ("wall", "must be one of"),
    "DTCP_LAYER_FLOPS_PER_TOKEN": ("-1", "must be a positive number"),
    "DTCP_RING_STEPS_PER_LAUNCH": ("0", "must be an int >= 1"),
    "DTCP_KERNEL_REPLAY": ("sometimes", "use 1 or 0"),
    "DTCP_ALLGATHER_EXCHANGE": ("partly", "use 1 or 0"),
    "DTCP_ATTENTION_HEADS": ("32,5,128", "query heads a multiple of the key/value heads"),
    "DTCP_AUTO_PLACEMENT": ("best", "must be one of"),
}


def test_every_variable_is_covered():
    assert {variable for variable, _, _ in _ENVIRONMENT} == set(GOOD) == set(BAD)


@pytest.fixture
def clean_environment(monkeypatch):
    """No DTCP_ variable set, whatever the shell running the tests has."""
    for variable, _, _ in _ENVIRONMENT:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable", sorted(GOOD))
def test_variable_sets_its_setting(clean_environment, variable):
    raw, name, want = GOOD[variable]
    clean_environment.setenv(variable, raw)
    cfg, defaults = Config.from_env(), Config()
    assert getattr(cfg, name) == want
    assert all(getattr(cfg, other) == getattr(defaults, other) for _, other, _ in _ENVIRONMENT if other != name)


@pytest.mark.parametrize("variable", sorted(BAD))
def test_bad_value_names_the_variable(clean_environment, variable):
    raw, why = BAD[variable]
    clean_environment.setenv(variable, raw)
    with pytest.raises(ValueError) as e:
        Config.from_env()
    message = str(e.value)
    assert f"environment variable {variable}={raw!r}" in message, message
    assert f"dtcp.config.{GOOD[variable][1]}" in message and why in message, message
