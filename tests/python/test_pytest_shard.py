"""The pytest sharding helper (sharding.py, MACHMOE_PYTEST_SHARD in conftest.py): every test in exactly one shard,
dealt round-robin, and a malformed spec refused with what was given; and a real sharded run of this file."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharding import parse_shard, split


@pytest.mark.parametrize("total", [1, 2, 3, 7])
@pytest.mark.parametrize("count", [0, 1, 5, 198])
def test_the_shards_partition_the_tests_round_robin(total, count):
    items = [f"t{i}" for i in range(count)]
    seen = []
    for index in range(total):
        kept, dropped = split(items, index, total)
        assert sorted(kept + dropped) == sorted(items)
        assert kept == items[index::total]  # round-robin, in collection order
        seen += kept
    assert sorted(seen) == sorted(items) and len(seen) == count


@pytest.mark.parametrize("spec, expected", [("0/1", (0, 1)), ("2/3", (2, 3)), ("0/6", (0, 6))])
def test_parse_shard(spec, expected):
    assert parse_shard(spec) == expected


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1/0", "1", "a/b", "1/2/3", ""])
def test_parse_shard_refuses_a_malformed_spec(spec):
    with pytest.raises(ValueError, match=r"expected 'i/n' with 0 <= i < n .* got"):
        parse_shard(spec)


def _run_shard(spec):
    env = dict(os.environ, MACHMOE_PYTEST_SHARD=spec)
    here = Path(__file__).resolve().parent
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           f"{here / 'test_pytest_shard.py'}::test_parse_shard"], cwd=here, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_sharded_run_keeps_its_share_and_refuses_a_bad_spec():
    ids = []
    for index in range(2):
        r = _run_shard(f"{index}/2")
        assert r.returncode == 0, r.stdout + r.stderr
        ids.append([line for line in r.stdout.splitlines() if "::test_parse_shard[" in line])
    assert [len(i) for i in ids] == [2, 1] and not set(ids[0]) & set(ids[1])
    r = _run_shard("2/2")
    assert r.returncode != 0 and "MACHMOE_PYTEST_SHARD: expected 'i/n'" in r.stdout + r.stderr
