"""The captured-step kit (decoding/steps.py): what a call stages into a key's static inputs, how
keys are captured, warmed and dropped. On a CPU, graphs=True runs graphs.CapturedCall's checked
stand-in (host reads forbidden, the warm-up's repeats, outputs in fixed buffers); `-m gpu` runs the
same checks with real CUDA graphs. Every comparison is exact: the kit copies values, it computes
nothing."""

from __future__ import annotations

import pytest
import torch

from specfoundry.decoding.graphs import HostReadError
from specfoundry.decoding.steps import PROMPT_GRAPH_MAX, CapturedSteps, Step, prompt_bucket, prompt_buckets

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def echo_steps(device, graphs=True, calls=None):
    """Steps whose body copies its inputs out (ids [T] and start [] int64, pattern [T, T] bool, rows
    [T, 2] float32), counting its runs in `calls`."""

    def make(tokens):
        def body(x):
            if calls is not None:
                calls.append(tokens)
            return x.ids * 1, x.start * 1, x.pattern.clone(), x.rows * 1

        inputs = dict(ids=torch.zeros(tokens, dtype=torch.long), start=torch.tensor(0),
                      pattern=torch.ones(tokens, tokens, dtype=torch.bool).tril(), rows=torch.zeros(tokens, 2))
        return Step(body, inputs)

    return CapturedSteps(torch.device(device), make, graphs=graphs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True])
def test_a_call_stages_host_values_device_values_and_pieces(device, graphs):
    """Host values, device values, pieces of both (ids from the host then a device tail) and values
    shorter than their input reach the body, call after call, in any order: including a pattern
    given again unchanged after a device value wrote into another dtype's buffer."""
    steps = echo_steps(device, graphs)
    dev = torch.device(device)
    tail = torch.tensor([7, 8], device=dev)
    rows = torch.arange(8.0, device=dev).view(4, 2)
    tril, full = torch.ones(4, 4, dtype=torch.bool).tril(), torch.ones(4, 4, dtype=torch.bool)
    cases = [  # (ids, start, pattern, rows) as given -> the ids expected
        (([1, 2], tail), 5, tril, rows, [1, 2, 7, 8]),
        ([3, 4, 5, 6], 6, full, rows[:2], [3, 4, 5, 6]),
        (([9], torch.tensor([10, 11, 12], device=dev)), 7, full, rows + 1, [9, 10, 11, 12]),
        ([1, 1, 1, 1], 0, tril, torch.zeros(4, 2), [1, 1, 1, 1]),
    ]
    held_rows = torch.zeros(4, 2, device=dev)
    for ids, start, pattern, given_rows, expected in cases:
        out_ids, out_start, out_pattern, out_rows = steps(4, ids=ids, start=start, pattern=pattern, rows=given_rows)
        held_rows[: given_rows.shape[0]] = given_rows.to(dev)  # a shorter value leaves the rest as it was
        assert out_ids.tolist() == expected and int(out_start) == start
        assert torch.equal(out_pattern.cpu(), pattern) and torch.equal(out_rows, held_rows)
    assert list(steps) == [4] and steps.captured == ([4] if graphs else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_is_captured_once_warmed_keys_are_not_captured_again_and_drop_forgets(device):
    calls = []
    steps = echo_steps(device, calls=calls)
    steps.warm([2, 3])
    assert sorted(steps.captured) == [2, 3]
    warmed_runs = len(calls)
    for _ in range(3):
        steps(2, ids=[1, 2], start=1, pattern=torch.ones(2, 2, dtype=torch.bool), rows=torch.zeros(2, 2))
    if device == "cuda":  # a replay runs the graph, not the Python body
        assert len(calls) == warmed_runs
    steps.drop()
    assert not list(steps) and not steps.captured
    steps(3, ids=[1, 2, 3], start=0, pattern=torch.ones(3, 3, dtype=torch.bool), rows=torch.zeros(3, 2))
    assert steps.captured == [3]


def test_every_input_is_given_and_a_value_fits_its_input():
    steps = echo_steps("cpu")
    with pytest.raises(TypeError, match="exactly the inputs"):
        steps(2, ids=[1, 2], start=0, rows=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="input ids: 3 rows given, it holds 2"):
        steps(2, ids=[1, 2, 3], start=0, pattern=torch.ones(2, 2, dtype=torch.bool), rows=torch.zeros(2, 2))


def test_a_captured_body_may_not_read_a_device_value_on_the_host():
    """The CPU stand-in of a capture refuses what a CUDA graph cannot hold: a host read."""
    steps = CapturedSteps(torch.device("cpu"), lambda key: Step(lambda x: int(x.n) + 1, dict(n=torch.tensor(0))),
                          graphs=True)
    with pytest.raises(HostReadError):
        steps(1, n=3)
    eager = CapturedSteps(torch.device("cpu"), lambda key: Step(lambda x: int(x.n) + 1, dict(n=torch.tensor(0))),
                          graphs=False)
    assert eager(1, n=3) == 4  # eagerly it is ordinary code


def host_data_steps(write):
    """Steps whose body writes into a [4, 4] bool mask by `write(mask, x.index)`, then returns it."""
    mask = torch.zeros(4, 4, dtype=torch.bool)

    def body(x):
        write(mask, x.index)
        return mask * 1

    return CapturedSteps(torch.device("cpu"), lambda key: Step(body, dict(index=torch.zeros(2, dtype=torch.long))),
                         graphs=True)


@pytest.mark.parametrize("write", [
    lambda mask, i: mask.__setitem__((i, i), True),  # index_put_ of a host 0-d tensor (a GPU's capture fails)
    lambda mask, i: mask.index_put_((i, i), torch.tensor(True)),
    lambda mask, i: mask.index_put_((i, i), torch.tensor(True).expand(2)),  # derived from one: host data too
    lambda mask, i: mask[0].copy_(torch.tensor([True, False, True, False])),
    lambda mask, i: mask.logical_or_(torch.tensor([True, False, True, False])),  # a host operand with a dimension
    lambda mask, i: mask.copy_(torch.where(mask, mask, torch.tensor(True))),  # where copies a host 0-d operand
    lambda mask, i: mask.logical_or_(torch.tensor(True, device=mask.device)),  # copied inside torch.tensor
    lambda mask, i: mask.logical_or_(mask.new_tensor(True)),  # new_tensor makes it on mask's device
], ids=["setitem-advanced", "index_put_", "derived", "copy_", "operand", "where", "tensor-on-device", "new_tensor"])
def test_a_captured_body_may_not_copy_host_data_it_made_to_the_device(write):
    """The CPU stand-in refuses what a capture on a GPU refuses: a tensor the body made from Python values
    copied to the device (`sees[slots, own] = True` in a captured body failed 7 GPU tests once, and
    passed every CPU test)."""
    with pytest.raises(HostReadError, match="Python values"):
        host_data_steps(write)(1, index=[0, 2])
    eager = CapturedSteps(torch.device("cpu"), host_data_steps(write).make, graphs=False)
    eager(1, index=[0, 2])  # eagerly it is ordinary code


@pytest.mark.parametrize("write", [
    lambda mask, i: mask.__setitem__(0, True),  # select + fill_ with a host 0-d value: a scalar to the kernel
    lambda mask, i: mask.__setitem__(mask.logical_not(), True),  # one boolean index: masked_fill_ of a number
    lambda mask, i: mask.logical_or_(torch.tensor(True)),  # a host 0-d operand of a pointwise op
    lambda mask, i: mask.logical_or_(torch.tensor(1).to(torch.bool)),  # cast on the host, then an operand
    lambda mask, i: mask.index_put_((i, i), torch.ones((), dtype=torch.bool, device=mask.device)),  # no copy
], ids=["setitem-basic", "setitem-boolean", "scalar-operand", "cast-operand", "device-value"])
def test_host_scalars_that_a_capture_holds_are_allowed(write):
    """A host 0-d tensor as a scalar operand is read once, at capture, on a GPU too: not refused."""
    out = host_data_steps(write)(1, index=[0, 2])
    assert bool(out.any())


@pytest.mark.parametrize("device", DEVICES)
def test_a_body_that_is_not_idempotent_runs_once_a_call(device):
    """The slot engine's step advances its own state: the kit never repeats it (no warm-up runs), its
    first call eager and every later one captured."""
    count = torch.zeros((), dtype=torch.long, device=torch.device(device))

    def make(key):
        def body(x):
            count.add_(1)
            return count
        return Step(body)

    steps = CapturedSteps(torch.device(device), make, graphs=True, idempotent=False)
    for n in range(1, 5):
        steps("window")
        assert int(count) == n
        assert steps.captured == ([] if n == 1 else ["window"])
    with pytest.raises(AssertionError):
        steps.warm(["window"])


def test_prompt_buckets():
    assert [prompt_bucket(n) for n in (1, 16, 17, 100, 128, 129, PROMPT_GRAPH_MAX)] == [16, 16, 32, 128, 128, 256,
                                                                                         PROMPT_GRAPH_MAX]
    assert prompt_buckets([3, 20, 30, 200, PROMPT_GRAPH_MAX + 1]) == [16, 32, 256]
