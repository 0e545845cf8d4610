"""Credits: a pure counter that bounds commands in flight."""

import pytest

from hicache.runtime import Credits


def test_take_until_exhausted_then_give_back():
    credits = Credits("writer", 2)
    assert credits.try_take() and credits.try_take()
    assert not credits.try_take()
    assert (credits.in_flight, credits.available) == (2, 0)
    credits.give_back()
    assert credits.available == 1
    credits.check_integrity()


def test_give_back_without_credit_and_bad_limit_raise():
    with pytest.raises(RuntimeError, match="without a credit"):
        Credits("x", 1).give_back()
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        Credits("x", 0)
