"""Data checks before step 1: each split must be able to feed the layout."""
import pytest

from trainer.config import ConfigError, load_config
from trainer.run import check_splits


def test_validation_smaller_than_dp_and_training_smaller_than_a_batch_are_refused():
    cfg = load_config(None, ["train.batch_size=8", "train.eval_every=10"])
    check_splits(cfg, 8, 2, dp=2)  # just enough of both
    with pytest.raises(ConfigError, match=r"validation split has 1 sequence\(s\).*2 data-parallel"
                                          r".*data.val_fraction=0.05.*train.eval_every=0"):
        check_splits(cfg, 100, 1, dp=2)
    with pytest.raises(ConfigError, match="training split has 7 sequences.*train.batch_size=8"):
        check_splits(cfg, 7, 100, dp=1)
    no_eval = load_config(None, ["train.batch_size=8", "train.eval_every=0"])
    check_splits(no_eval, 100, 1, dp=2)  # nothing evaluates: a tiny validation split is fine
