"""Splitting one pytest run over processes that run side by side (MACHMOE_PYTEST_SHARD="i/n", conftest.py): shard i
of n keeps the collected tests whose position, after the markers' selection, is i modulo n. Dealt round-robin rather
than in blocks, so that a file of many slow tests (test_differential.py holds half the GPU tests) is spread over
every shard. The n shards together run each selected test exactly once."""


def parse_shard(spec: str) -> tuple:
    """ "i/n" -> (i, n), 0 <= i < n; anything else is refused with what was given."""
    try:
        index, total = map(int, spec.split("/"))  # (a ValueError too where there are not exactly two parts)
    except ValueError:
        index, total = -1, 0
    if not 0 <= index < total:
        raise ValueError(f"MACHMOE_PYTEST_SHARD: expected 'i/n' with 0 <= i < n (e.g. 0/3), got {spec!r}")
    return index, total


def split(items: list, index: int, total: int) -> tuple:
    """(kept, dropped) of items for shard index of total, each in the order collected."""
    return items[index::total], [item for pos, item in enumerate(items) if pos % total != index]
