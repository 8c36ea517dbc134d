"""Each numeric bound of the [memory] section (and parallel.bucket_mb) accepts its smallest valid value and refuses the
next one down."""

import pytest
from helpers import tiny_config

from trickles.errors import ConfigError


@pytest.mark.parametrize("key", ["memory.loss_scale_growth_interval", "memory.loss_scale_hysteresis"])
def test_loss_scaler_counts_start_at_one(tmp_path, key):
    assert tiny_config(tmp_path, f"{key}=1").validate(1).world_size == 1
    with pytest.raises(ConfigError, match="must be at least 1"):
        tiny_config(tmp_path, f"{key}=0").validate(1)


def test_loss_scale_may_equal_its_minimum_but_not_fall_below(tmp_path):
    assert tiny_config(tmp_path, "memory.loss_scale=4", "memory.loss_scale_min=4").validate(1).world_size == 1
    for bad in (
        ["memory.loss_scale=2", "memory.loss_scale_min=4"],
        ["memory.loss_scale_min=0"],
        ["memory.loss_scale_min=-1"],
        ["memory.loss_scale=0", "memory.loss_scale_min=0"],
    ):
        with pytest.raises(ConfigError, match="loss_scale >= loss_scale_min"):
            tiny_config(tmp_path, *bad).validate(1)


def test_bucket_size_may_be_a_fraction_of_a_megabyte_or_zero_but_not_negative(tmp_path):
    for mb in ("0", "0.05"):  # 0: one bucket per parameter group; small buckets, as the layout tests use
        assert tiny_config(tmp_path, f"parallel.bucket_mb={mb}").validate(1).world_size == 1
    with pytest.raises(ConfigError, match="parallel.bucket_mb must not be negative"):
        tiny_config(tmp_path, "parallel.bucket_mb=-0.5").validate(1)


def test_collective_timeout_may_be_under_a_second_but_must_be_positive(tmp_path):
    assert tiny_config(tmp_path, "parallel.timeout_s=0.5").validate(1).world_size == 1
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="parallel.timeout_s must be positive"):
            tiny_config(tmp_path, f"parallel.timeout_s={bad}").validate(1)
