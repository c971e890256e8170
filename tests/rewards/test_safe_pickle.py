"""safe_pickle.loads_plain's caps (issue 55): nothing a pickle builds is allocated before its size is checked.

Each hostile pickle is a few hundred bytes that, given to an unrestricted reader (or to the reader before the caps),
allocates hundreds of MB: the allocations are measured with tracemalloc (which sees numpy's buffers too), and the
capped reader must refuse each with one line naming the cap, having allocated at most a few MB."""

import math
import pickle
import struct
import time
import tracemalloc

import numpy as np
import pytest

from jagg_lightning.rewards.safe_pickle import (
    ALLOWED, MAX_ANSWER_BYTES, MAX_ANSWER_ITEMS, PickleLimits, UnsafePickleError, loads_plain,
)

BOMB_BYTES = 300 << 20  # what each hostile pickle asks for: far past the 64 MiB default
PEAK_LIMIT = 16 << 20  # what refusing it may cost


class Call:
    """Pickles as ``fn(*args)``: what a hostile server writes with REDUCE."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def peak_of(fn):
    """(what ``fn()`` raised or returned, the peak traced allocation while it ran)."""
    tracemalloc.start()
    try:
        try:
            outcome = fn()
        except Exception as err:  # noqa: BLE001 -- the outcome is asserted by the caller
            outcome = err
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def declared(opcode: bytes, length: int, protocol: int = 5) -> bytes:
    """A pickle whose one opcode declares ``length`` bytes (8-byte length) and carries 3."""
    return bytes([0x80, protocol]) + opcode + struct.pack("<Q", length) + b"abc" + b"."


@pytest.mark.parametrize("payload, says", [
    (pickle.dumps({"outputs": [0.5], "extra": Call(bytearray, BOMB_BYTES)}, protocol=4),
     f"refused a bytearray of {BOMB_BYTES} bytes: more than max_answer_bytes={MAX_ANSWER_BYTES}"),
    # numpy.ndarray is wrapped like numpy's other globals: the shape is checked before the array exists
    (pickle.dumps({"outputs": [0.5], "extra": Call(np.ndarray, (BOMB_BYTES // 1024,), "S1024")}, protocol=4),
     f"refused an array of shape ({BOMB_BYTES // 1024},) of {BOMB_BYTES} bytes: more than max_answer_bytes="),
    (pickle.dumps({"extra": Call(np.ndarray, (BOMB_BYTES // 8,), "f8")}, protocol=2),
     f"refused an array of {BOMB_BYTES // 8} elements: more than max_answer_items={MAX_ANSWER_ITEMS}"),
    (pickle.dumps(Call(np._core.multiarray._reconstruct, np.ndarray, (BOMB_BYTES // 1024,), b"S1024"), protocol=4),
     f"refused an array of shape ({BOMB_BYTES // 1024},) of {BOMB_BYTES} bytes"),
    (declared(b"\x8e", BOMB_BYTES), "bytes8"),  # BINBYTES8: CPython allocates the declared length, then reads
    (declared(b"\x96", BOMB_BYTES), "bytearray8"),  # BYTEARRAY8 (protocol 5)
], ids=["bytearray(n)", "ndarray_bytes", "ndarray_items", "_reconstruct", "BINBYTES8", "BYTEARRAY8"])
def test_hostile_sizes_are_refused_before_they_are_allocated(payload, says):
    assert len(payload) < 400
    outcome, peak = peak_of(lambda: loads_plain(payload))
    assert isinstance(outcome, (UnsafePickleError, ValueError)), outcome
    assert says in str(outcome) and "\n" not in str(outcome), str(outcome)
    assert peak < PEAK_LIMIT, f"refusing cost {peak / 2**20:.0f} MB"
    # the control: the unrestricted reader allocates what the pickle asks for (the bomb is real)
    _, unrestricted = peak_of(lambda: pickle.loads(payload))
    assert unrestricted > BOMB_BYTES // 2


def test_the_caps_are_configurable_and_named(rng_seed):
    rng = np.random.default_rng(rng_seed)
    items = int(rng.integers(50, 500))
    values = rng.random(items).tolist()
    limits = PickleLimits(max_answer_bytes=MAX_ANSWER_BYTES, max_answer_items=items)  # fewer than the opcodes
    with pytest.raises(UnsafePickleError, match=f"more than max_answer_items={items}$"):
        loads_plain(pickle.dumps({"outputs": values}), limits)
    assert loads_plain(pickle.dumps({"outputs": values}), PickleLimits(max_answer_items=3 * items)) == {"outputs": values}
    with pytest.raises(UnsafePickleError, match=f"refused an array of {items} elements: more than max_answer_items="
                                                f"{items - 1}$"):
        loads_plain(pickle.dumps(Call(np.ndarray, (items,), "f8")), PickleLimits(max_answer_items=items - 1))
    array = rng.random(items)
    size = len(pickle.dumps(array))
    with pytest.raises(UnsafePickleError, match=f"refused a pickle of {size} bytes: more than max_answer_bytes={size - 1}"):
        loads_plain(pickle.dumps(array), PickleLimits(max_answer_bytes=size - 1))
    np.testing.assert_array_equal(loads_plain(pickle.dumps(array), PickleLimits(max_answer_bytes=size)), array)
    # a zero-width string dtype makes a shape free in bytes: its elements are counted
    with pytest.raises(UnsafePickleError, match="more than max_answer_items"):
        loads_plain(pickle.dumps(Call(np.ndarray, (10**12,), "S0")))
    for field in ("max_answer_bytes", "max_answer_items"):
        with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got 0"):
            PickleLimits(**{field: 0})
    assert MAX_ANSWER_ITEMS >= 1000  # room for Flow-GRPO's answers (five lists per 64 images)


def test_plain_answers_of_every_protocol_still_read(rng_seed):
    rng = np.random.default_rng(rng_seed)
    value = {"scores": rng.random(5), "f32": np.float32(rng.random()), "raw": bytearray(rng.bytes(7)),
             "tags": {"a", "b"}, "frozen": frozenset([1]), "c": complex(rng.random(), 1), "b": rng.bytes(3),
             "fortran": np.asfortranarray(rng.random((3, 2))), "names": np.array(["ab", "c"])}
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        got = loads_plain(pickle.dumps(value, protocol=protocol))
        for key, expected in value.items():
            if isinstance(expected, np.ndarray):
                np.testing.assert_array_equal(got[key], expected)
                assert type(got[key]) is np.ndarray
            else:
                assert got[key] == expected, (protocol, key)
    assert ("numpy", "ndarray") in ALLOWED and ("builtins", "bytearray") in ALLOWED


def test_shared_references_are_walked_once():
    """A pickle referencing one list twice per level, 40 levels deep, is 2^40 paths but 41 objects: read at once
    (walking every path would take days)."""
    level: list = [0.5]
    for _ in range(40):
        level = [level, level]
    start = time.monotonic()
    value = loads_plain(pickle.dumps({"outputs": level}))
    assert time.monotonic() - start < 2.0
    depth, node = 0, value["outputs"]
    while len(node) == 2:
        node, depth = node[0], depth + 1
    assert depth == 40 and node == [0.5] and math.isfinite(node[0])
