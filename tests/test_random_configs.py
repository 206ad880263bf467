"""Random combinations of everything a call can ask for, each exact in float64 against dense
single-process attention (out, lse, dq, dk, dv, and the sinks' gradient): layout, world size (2, 3, 4, 6),
causal or not, a window of any reach, packed documents with empty and single-token ones, GQA,
a value head dim of its own, softcap, sinks, batch rows, and the strategy. The cases are drawn
from a fixed seed, so every run checks the same ones; each prints its configuration on failure.
The hand-picked tests elsewhere cover each feature; this covers how they meet."""

from __future__ import annotations

import random

import pytest

import dtcp
from dist_harness import run_ranks
from test_softcap_sinks import KEYS, errors

LAYOUTS = ["contiguous", "zigzag", "striped:1", "striped:2"]
HEADS = [(4, 2), (2, 2), (3, 1), (4, 1), (6, 3)]


def draw_case(rng: random.Random, n: int) -> dict:
    layout = rng.choice(LAYOUTS)
    s = dtcp.layout_from_spec(layout).multiple(n) * rng.randint(1, 4)
    while s < 2 * n:
        s *= 2
    is_causal = rng.random() < 0.6
    window = None
    if rng.random() < 0.6:
        left = rng.choice([-1, 0, 1, rng.randint(0, s)])
        right = 0 if is_causal else rng.choice([-1, 0, 1, rng.randint(0, s)])
        window = (left, right)
    cu = None
    if rng.random() < 0.5:
        cuts = sorted(rng.randint(0, s) for _ in range(rng.randint(1, 5)))
        cu = [0, *cuts, s]  # repeated boundaries: empty documents; neighbours: one-token ones
    heads = rng.choice(HEADS)
    strategies = ["ring", "auto"]
    if layout in ("contiguous", "zigzag"):
        strategies.append("allgather")
    hq, hkv = heads
    if hq % n == 0 and (hkv % n == 0 or n % hkv == 0):
        strategies.append("ulysses")
    return dict(layout_spec=layout, s=s, is_causal=is_causal, window=window, cu=cu, heads=heads,
                d=8, dv=rng.choice([8, 4]), b=rng.choice([1, 2]), softcap=rng.choice([None, None, 3.0]),
                with_sinks=rng.random() < 0.3, strategy=rng.choice(strategies), seed=rng.randint(0, 999))


def run_case(case):
    case = dict(case)
    return errors(case.pop("layout_spec"), case.pop("s"), **case)


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_random_combinations_are_exact(world_size):
    rng = random.Random(1000 + world_size)
    for i in range(14):
        case = draw_case(rng, world_size)
        for rank, r in enumerate(run_ranks(world_size, run_case, case)):
            for key in KEYS:
                if key in r:
                    assert r[key] < 1e-10, (i, case, rank, key, r[key])
