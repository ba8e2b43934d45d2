"""The fast lane (``pytest -m "not slow"``) stays fast: only tests marked ``slow`` may start DeepSpeed."""

from __future__ import annotations

import pytest

from tests.conftest import launch


def test_launch_refuses_in_a_test_not_marked_slow(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"mark this test .* pytest\.mark\.slow"):
        launch(tmp_path, "python", "--steps", "1")
    assert list(tmp_path.iterdir()) == [], "nothing was started"
