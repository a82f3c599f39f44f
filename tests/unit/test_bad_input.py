"""Bad input that must end in one error naming what is wrong, with nothing on disk changed."""

import pytest

from colocate.config import load_config
from tests.disk import snapshot


@pytest.mark.parametrize("flag, field", [("--rollout.n-samples-per-prompt", "rollout.n_samples_per_prompt"),
                                         ("--rollout.rollout-batch-size", "rollout.rollout_batch_size")])
def test_a_zero_batch_size_is_a_range_error_not_a_division_by_zero(flag, field, tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        load_config([flag, "0"])
    assert str(info.value) == f"command line: {field} must be >= 1, got 0"
    assert snapshot(tmp_path) == before
