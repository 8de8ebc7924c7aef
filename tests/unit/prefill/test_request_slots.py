"""RequestSlots moves a readiness's counters one by one for a few requests and with numpy
fancy indexing for more: both ways give the same counters and the same quiet slots."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.prefill.send_steps import Announcement, RequestSlots


def _announcement(slots: list[int], main: list[int], indexer: list[int], few: bool) -> Announcement:
    ann = Announcement(0, 1, slots=np.array(slots, np.int64), main_blocks=np.array(main, np.int64),
                       indexer_blocks=np.array(indexer, np.int64))  # fmt: skip
    ann.few = list(zip(slots, main, indexer)) if few else None
    return ann


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_one_by_one_and_vectorized_agree(data: st.DataObject) -> None:
    one, many = RequestSlots(8), RequestSlots(8)
    many.FEW = -1  # always numpy
    live = [one.take() for _ in range(6)]
    assert [many.take() for _ in range(6)] == live
    for _ in range(data.draw(st.integers(1, 12))):
        slots = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=RequestSlots.FEW, unique=True))
        main = data.draw(st.lists(st.integers(0, 50), min_size=len(slots), max_size=len(slots)))
        indexer = data.draw(st.lists(st.integers(0, 50), min_size=len(slots), max_size=len(slots)))
        one.announced(_announcement(slots, main, indexer, True), 64, 16)
        many.announced(_announcement(slots, main, indexer, False), 64, 16)
        draining = data.draw(st.sampled_from(live))
        for table in (one, many):
            table.draining[draining] = True
        if data.draw(st.booleans()):
            owed = [s for s in live if one.unanswered[s] > 0]
            answered = data.draw(st.lists(st.sampled_from(owed), unique=True, max_size=RequestSlots.FEW)) if owed else []
            quiet = one.answered(np.array(answered, np.int64))
            assert quiet == many.answered(np.array(answered, np.int64))
            assert all(one.draining[s] and one.unanswered[s] == 0 for s in quiet)
        assert np.array_equal(one.unanswered, many.unanswered) and np.array_equal(one.nbytes, many.nbytes)
