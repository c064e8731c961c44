"""Ids made a batch at a time (:func:`hardcount.ids.new_ids`) are ids as :func:`~hardcount.ids.new_id` makes them:
the same shape, distinct, and increasing with the ids made before and after them in the process."""

from hardcount import ids


def test_a_batch_of_ids_is_distinct_well_formed_and_in_order_with_the_ids_around_it():
    before = ids.new_id("mev")
    batch = ids.new_ids("mev", 3000)  # more than 1,024: the last-but-two characters move too
    middle = ids.new_id("mev")
    second = ids.new_ids("mev", 5)
    made = [before, *batch, middle, *second]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    assert {len(i) for i in made} == {len("mev_") + 26}
    assert all(i.startswith("mev_") and set(i[4:]) <= set(ids._ALPHABET) for i in made)
    assert ids.new_ids("mev", 0) == []


def test_a_batch_decodes_to_consecutive_values_under_one_millisecond():
    def value(i: str) -> int:
        n = 0
        for ch in i[4:]:
            n = n * 32 + ids._ALPHABET.index(ch)
        return n

    batch = ids.new_ids("mev", 2000)
    values = [value(i) for i in batch]
    assert values == list(range(values[0], values[0] + 2000))
    assert len({v >> 80 for v in values}) == 1  # one millisecond: the time part is shared
