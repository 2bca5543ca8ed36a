"""`store_steps`' arguments and parts (its whole run: test_cli.py's `store` test)."""

from __future__ import annotations

import ggml_kernels_integration  # noqa: F401  (installed by nox: missing, these tests fail, not skip)
import pytest
import torch
from ggml_kernels_integration import packaged_steps, store


def test_cache_lengths_are_those_a_compiled_generate_takes():
    assert store.check_positions([512, 256, 256]) == (256, 512)
    assert store.check_positions((4096,), context=4096) == (4096,)
    for bad, message in (([300], "300 is not a cache length"), ([128], "128 is not a cache length"),
                         ([], "at least one"), ([8192], "beyond the model's 4,096 positions")):
        with pytest.raises(ValueError, match=message):
            store.check_positions(bad, context=4096)


def test_a_generate_stops_once_its_sequences_are_long_enough():
    stop = store._AfterTokens(6)
    assert stop(torch.zeros(2, 5, dtype=torch.long), None).tolist() == [False, False]
    assert stop(torch.zeros(2, 6, dtype=torch.long), None).tolist() == [True, True]


def test_nothing_is_stored_where_step_packages_are_off(monkeypatch):
    monkeypatch.setenv(packaged_steps.ENV, "0")
    assert "step packages are off here" in store.why_not()
    with pytest.raises(RuntimeError, match="step packages are off here"):
        store.store_steps(torch.nn.Linear(1, 1))
    monkeypatch.delenv(packaged_steps.ENV)
    assert (store.why_not() is None) == packaged_steps.enabled()
