"""Logging follows `sys.stderr` as it is when a line is logged: code that set logging up while a
caller had swapped stderr (a test capturing output, then closing its stream) leaves later lines
working, not raising on a closed file."""

from __future__ import annotations

import io
import sys

import pytest

from pipelinerl.common.log import configure_logging, get_logger


def test_a_line_logged_after_the_stream_logging_was_set_up_with_is_closed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    borrowed = io.StringIO()
    with monkeypatch.context() as swapped:
        swapped.setattr(sys, "stderr", borrowed)
        configure_logging("test")
        get_logger("test").info("first")
    borrowed.close()
    get_logger("test").info("second")
    assert "second" in capsys.readouterr().err
