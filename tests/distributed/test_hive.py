"""The hivemind plumbing peers and SWARM share (atomc.distributed.hive)."""

from __future__ import annotations

import logging
import sys

import pytest

pytest.importorskip("hivemind")

from atomc.distributed.hive import import_hivemind


def test_a_failure_hivemind_recovers_from_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind logs a state download cut short (the next peer is tried) with its traceback:
    a peer's user reads one line that names the exception."""
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")
    import_hivemind()
    from hivemind.utils.logging import get_logger

    logger = get_logger("hivemind.averaging.averager")
    handlers = logging.getLogger("hivemind").handlers
    assert handlers
    try:
        raise RuntimeError("shape '[275241]' is invalid for input of size 65536")
    except RuntimeError as e:
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1,
                                   f"Failed to download state - {e!r}", None, sys.exc_info())
    for handler in handlers:
        assert handler.filter(record)
        text = handler.format(record)
        assert "Traceback" not in text and len(text.splitlines()) == 1, text
        assert "Failed to download state - RuntimeError(" in text, text
