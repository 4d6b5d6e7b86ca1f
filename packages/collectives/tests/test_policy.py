"""The policy: ordered lists, tuned bands, one decision per call, ranks that agree."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import Communicator, MismatchError, allreduce, world
from mpx.collectives.core import policy
from mpx.collectives.core.policy import ORDER, PolicyError, choose, layout_key, small_bytes
from mpx.collectives.tune import TIE, bands_from
from mpx.collectives.tune import main as tune_main
from mpx.launch import settings
from mpx.launch.settings import reload as reload_settings


def test_every_op_has_a_list_that_ends_in_a_fallback() -> None:
    for op, entries in ORDER.items():
        assert entries, op
        assert entries[-1].impl == "mpi", f"{op}: the last entry must take any CPU tensor"


def test_bands_keep_the_previous_winner_within_the_tie() -> None:
    measured = {
        4096: {"mpi": 1.0, "shm": 3.0},
        16384: {"mpi": 1.0, "shm": 1.0 / TIE * 1.01},  # shm a hair faster: mpi stays
        65536: {"mpi": 2.0, "shm": 1.0},
        262144: {"mpi": 4.0, "shm": 1.0},
    }
    bands = bands_from(measured)
    assert [impl for _, impl in bands] == ["mpi", "shm"]
    assert bands[0][0] == int((16384 * 65536) ** 0.5)  # the edge halfway between
    assert bands[-1][0] > 1 << 60


def test_a_tie_goes_to_the_built_in_choice() -> None:
    measured = {
        4096: {"mpi": 1.0, "ring": 0.99},  # ring a hair faster: a tie, the built-in mpi wins
        1 << 20: {"mpi": 2.0, "shm": 1.02, "ring": 1.0},  # ring vs shm: a tie, built-in shm
        1 << 24: {"mpi": 3.0, "shm": 2.0, "ring": 1.0},  # ring clearly faster: ring
    }

    def builtin(nbytes: int) -> str:
        return "mpi" if nbytes < 1 << 18 else "shm"

    assert [impl for _, impl in bands_from(measured, builtin)] == ["mpi", "shm", "ring"]
    assert [impl for _, impl in bands_from(measured)] == ["ring"]  # without: the fastest


@pytest.mark.mpi
def test_built_in_rules_by_size_and_layout() -> None:
    comm = world()
    small, large = small_bytes() - 4, small_bytes()
    assert choose("allreduce", False, small, comm) == "mpi"
    want = "mpi" if comm.size == 1 else "shm" if comm.single_node else "hier"
    assert choose("allreduce", False, large, comm) == want
    # reduce_scatter has no shared-memory algorithm: on one node it stays on MPI.
    rs = choose("reduce_scatter", False, large, comm)
    assert rs == ("mpi" if comm.single_node else "ring")
    assert choose("send", False, large, comm) == "mpi"
    assert choose("barrier", False, 0, comm) == "mpi"


def _same_path_everywhere(tmp_path: Path, name: str) -> Path:
    """A path chosen by rank 0, so that every rank reads the file rank 0 writes."""
    return Path(MPI.COMM_WORLD.bcast(str(tmp_path / name), root=0))


@pytest.mark.mpi
def test_tuned_bands_decide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = world()
    path = _same_path_everywhere(tmp_path, "policy.json")
    bands = {"allreduce": [[8192, "mpi"], [1 << 20, "ring"], [1 << 62, "shm"]]}
    if comm.rank == 0:
        layouts = {layout_key(comm): {"bands": bands}}
        path.write_text(json.dumps({"version": 1, "layouts": layouts}))
    MPI.COMM_WORLD.Barrier()
    monkeypatch.setenv("MPX_POLICY_FILE", str(path))
    reload_settings()
    assert policy.current().source == str(path)
    expect = {4096: "mpi", 65536: "ring", 4 << 20: "shm" if comm.single_node else "mpi"}
    for nbytes, impl in expect.items():
        chosen = choose("allreduce", False, nbytes, comm)
        assert chosen == ("mpi" if comm.size == 1 else impl), nbytes
        t = torch.full((nbytes // 4,), float(comm.rank + 1))
        allreduce(t)
        assert float(t[0]) == float(t[-1]) == comm.size * (comm.size + 1) / 2
    # Ops the file does not band follow the built-in rules.
    assert choose("broadcast", False, 4096, comm) == "mpi"


@pytest.mark.mpi
def test_missing_policy_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_POLICY_FILE", "/nonexistent/mpx-policy.json")
    reload_settings()
    with pytest.raises(PolicyError, match="mpxrun -n N --tune") as info:
        allreduce(torch.ones(4))
    assert "/nonexistent/mpx-policy.json" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.mpi
def test_ranks_with_different_policies_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = world()
    if comm.rank > 0:
        monkeypatch.setenv("MPX_AUTO_SMALL_BYTES", "1K")
    reload_settings()
    if comm.size == 1:
        Communicator.from_mpi(MPI.COMM_WORLD).free()  # nobody to disagree with
        return
    with pytest.raises(MismatchError, match=r"ranks \[1(, 2)?\] run a different"):
        Communicator.from_mpi(MPI.COMM_WORLD)


@pytest.mark.mpi
def test_a_call_consults_the_policy_once_and_reads_no_setting_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comm = world()
    t = torch.ones(1 << 18)  # 1 MiB
    allreduce(t)  # settings read (once, cached), workspaces made
    comm.choices.reset(policy.current())  # forget the decision: the next call decides again
    walks: list[str] = []
    reads: list[str] = []
    real_walk = policy._walk
    real_read = settings.Setting.read

    def counting_walk(call: Any, p: Any) -> str:
        walks.append(call.op)
        return real_walk(call, p)

    def counting_read(self: Any, env: Any = None) -> Any:
        reads.append(self.name)
        return real_read(self, env)

    monkeypatch.setattr(policy, "_walk", counting_walk)
    monkeypatch.setattr(settings.Setting, "read", counting_read)
    t.fill_(1.0)
    allreduce(t)
    assert walks == ["allreduce"]  # the first call decides...
    allreduce(t)
    allreduce(t)
    assert walks == ["allreduce"]  # ...and the same call again reuses the decision
    assert reads == []  # every setting was read before, once
    assert float(t[0]) == comm.size**3


@pytest.mark.mpi
def test_the_first_decision_per_size_class_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    reload_settings()  # a fresh policy has logged nothing yet
    with caplog.at_level(logging.DEBUG, logger="mpx.collectives"):
        for _ in range(3):
            allreduce(torch.ones(3000))  # 12000 bytes: class 2^13
    lines = [r.getMessage() for r in caplog.records if "allreduce of a CPU tensor" in r.message]
    assert len(lines) == 1
    assert "12000 bytes (class 2^13)" in lines[0]


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_tune_writes_the_policy_auto_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    comm = world()
    path = _same_path_everywhere(tmp_path, "tuned.json")
    assert tune_main(["--max-size", "16K", "--ops", "allreduce", "--output", str(path)]) == 0
    data = json.loads(path.read_text())
    entry = data["layouts"][layout_key(comm)]
    assert set(entry["measured_seconds"]["allreduce"]) == {"4096", "16384"}
    assert entry["bands"]["allreduce"][-1][0] > 1 << 60
    if comm.rank == 0:
        assert f"wrote {path}" in capsys.readouterr().out
    monkeypatch.setenv("MPX_POLICY_FILE", str(path))
    reload_settings()
    assert policy.current().bands(comm) is not None
    t = torch.ones(1024)
    allreduce(t)
    assert float(t[0]) == comm.size


def test_each_implementation_declares_what_its_module_runs() -> None:
    """The registry's declarations against the modules: every op declared exists, no other."""
    from mpx.collectives.core.registry import BUILT_IN, all_implementations, get

    assert [i.name for i in BUILT_IN] == list(policy.IMPLEMENTATIONS)
    assert set(policy.IMPLEMENTATIONS) <= set(all_implementations())
    for impl in BUILT_IN:
        owner = importlib.import_module(impl.module)
        if impl.attribute:
            owner = getattr(owner, impl.attribute)
        has = {op for op in policy.OPS if callable(getattr(owner, op, None))}
        assert has == impl.provides, impl.name
        assert all(impl.function(op) == getattr(owner, op) for op in impl.provides)
    with pytest.raises(PolicyError, match=r"impl must be 'auto' or one of mpi, ring, .*'bogus'"):
        choose("allreduce", False, 8, world(), "bogus")
    assert get("shm").refusal("allreduce", True, world(), False) is not None  # CPU only


def test_the_op_specs_describe_the_functional_api_and_torch() -> None:
    """op_specs.OP_SPECS: the one table the check, the queue and the policy read."""
    import inspect

    import torch.distributed as dist

    import mpx.collectives
    from mpx.collectives.core.consistency import CHECKED_OPS
    from mpx.collectives.core.op_specs import OP_SPECS

    assert tuple(OP_SPECS) == policy.OPS
    assert (
        {n for n, s in OP_SPECS.items() if s.ordered}
        == CHECKED_OPS
        == set(policy.OPS)
        - {
            "send",
            "recv",
        }
    )
    for name, spec in OP_SPECS.items():
        params = inspect.signature(getattr(mpx.collectives, name)).parameters
        assert ("op" in params) == spec.reduces, name
        assert ("root" in params) == spec.rooted, name
        assert ("t" in params) == spec.tensor, name
        assert callable(getattr(dist.ProcessGroup, spec.c10d)), name
    t = torch.ones(4)
    for name in ("allreduce", "broadcast", "reduce"):
        assert OP_SPECS[name].in_place
        assert getattr(mpx.collectives, name)(t) is t
    assert choose("send", False, 1 << 30, world(), "ring") == "mpi"  # not the policy's


def _one_node(ranks: int, gpus_shared: bool) -> Any:
    from types import SimpleNamespace

    from mpx.collectives.core.policy import ChoiceCache

    return SimpleNamespace(
        size=ranks, num_nodes=1, node_size=ranks, single_node=True,
        gpus_shared=gpus_shared, hierarchy=None, choices=ChoiceCache(),
    )  # fmt: skip


def test_cuda_calls_take_ipc_from_its_threshold_where_every_rank_sees_the_same_gpus() -> None:
    threshold = policy.current().ipc_bytes
    assert threshold == 4 << 20  # the H200's crossover (BENCHMARKS.md), unless set
    shared = _one_node(2, gpus_shared=True)
    assert choose("allreduce", True, threshold - 4, shared) == "staged"
    assert choose("allreduce", True, threshold, shared) == "ipc"
    assert choose("broadcast", True, 1 << 28, shared) == "ipc"
    assert choose("allgather", True, 1 << 28, shared) == "staged"  # ipc has no allgather
    assert choose("allreduce", False, 1 << 28, shared) == "shm"  # CPU tensors: unchanged
    # Each rank bound to its own GPU: a peer's memory cannot be mapped.
    assert choose("allreduce", True, 1 << 28, _one_node(2, gpus_shared=False)) == "staged"
    assert choose("allreduce", True, 1 << 28, _one_node(1, gpus_shared=True)) == "staged"


def test_auto_takes_only_what_the_registry_marks_automatic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registry's ``automatic`` is what ``auto`` reads: unmarked, a listed entry is skipped."""
    from mpx.collectives.core import registry

    shared = _one_node(2, gpus_shared=True)
    assert choose("allreduce", False, 1 << 28, shared) == "shm"
    assert choose("allreduce", True, 1 << 28, shared) == "ipc"
    for name in ("shm", "ipc"):
        unmarked = dataclasses.replace(registry.get(name), automatic=False)
        monkeypatch.setitem(registry._registry, name, unmarked)
    assert choose("allreduce", False, 1 << 28, _one_node(2, gpus_shared=True)) == "mpi"
    assert choose("allreduce", True, 1 << 28, _one_node(2, gpus_shared=True)) == "staged"
    # Named, an implementation that auto may not take still runs.
    assert choose("allreduce", False, 1 << 28, _one_node(2, gpus_shared=True), "shm") == "shm"


def test_every_listed_implementation_is_automatic_and_no_other() -> None:
    """The lists and the registry say the same: what auto may take is marked ``automatic``."""
    from mpx.collectives.core import registry

    listed = {entry.impl for entries in ORDER.values() for entry in entries}
    automatic = {impl.name for impl in registry.BUILT_IN if impl.automatic}
    assert listed == automatic, f"listed {sorted(listed)}, automatic {sorted(automatic)}"


def test_readme_shows_the_lists_the_policy_walks() -> None:
    """The collectives README's block of ordered lists is ``policy.order_table()``."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### How `auto` decides", 1)[1]
    block = section.split("```\n", 2)[1]
    assert block.rstrip("\n") == policy.order_table(), (
        "the README's lists differ from mpx.collectives.core.policy.ORDER; paste "
        "python -c 'from mpx.collectives.core import policy; print(policy.order_table())'"
    )


def test_ipc_threshold_zero_turns_auto_ipc_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_AUTO_IPC_BYTES", "0")
    reload_settings()
    assert policy.current().ipc_bytes == 0
    assert choose("allreduce", True, 1 << 28, _one_node(2, gpus_shared=True)) == "staged"
    monkeypatch.setenv("MPX_AUTO_IPC_BYTES", "1M")
    reload_settings()
    assert choose("allreduce", True, 1 << 20, _one_node(2, gpus_shared=True)) == "ipc"


@pytest.mark.mpi
def test_gpus_are_shared_only_when_every_rank_sees_the_same_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comm = world()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    same = Communicator.from_mpi(MPI.COMM_WORLD)
    assert same.gpus_shared == same.single_node
    same.free()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(comm.rank))
    bound = Communicator.from_mpi(MPI.COMM_WORLD)
    assert bound.gpus_shared == (comm.size == 1)
    bound.free()


def _narrow(**declared: Any) -> Any:
    """A CPU allreduce implementation (MPI's functions) that declares narrow acceptance."""
    from mpx.collectives.core.registry import Implementation

    return Implementation(
        "narrow",
        "mpx.collectives.impl.mpi",
        frozenset({"allreduce"}),
        frozenset({"cpu"}),
        automatic=False,
        **declared,
    )


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Registers ``narrow``: float32 only, sum/avg only, at most 1 KiB."""
    from mpx.collectives.core import registry

    found = _narrow(
        dtypes=frozenset({torch.float32}), reduce_ops=frozenset({"sum", "avg"}), max_bytes=1024
    )
    monkeypatch.setitem(registry._registry, "narrow", found)
    return found


def test_auto_passes_by_an_implementation_that_declines_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The walk skips an entry whose implementation's declarations do not accept the call."""
    from mpx.collectives.core import registry

    big = 1 << 24  # shm's size on one node of two ranks
    assert choose("allreduce", False, big, _one_node(2, False), None, torch.bfloat16) == "shm"
    shm = registry.get("shm")
    narrowed = dataclasses.replace(
        shm, dtypes=frozenset({torch.float32}), reduce_ops=frozenset({"sum"}), max_bytes=big
    )
    monkeypatch.setitem(registry._registry, "shm", narrowed)
    layout = _one_node(2, False)
    assert choose("allreduce", False, big, layout, None, torch.float32, "sum") == "shm"
    assert choose("allreduce", False, big, layout, None, torch.bfloat16, "sum") == "mpi"
    assert choose("allreduce", False, big, layout, None, torch.float32, "max") == "mpi"
    assert choose("allreduce", False, big + 4, layout, None, torch.float32, "sum") == "mpi"
    # An op without a reduce op (broadcast) is not declined for it.
    assert choose("broadcast", False, big, layout, None, torch.float32) == "shm"


def test_a_named_implementation_that_declines_raises_naming_the_value(narrow: Any) -> None:
    layout = _one_node(2, False)
    assert choose("allreduce", False, 512, layout, "narrow", torch.float32, "avg") == "narrow"
    with pytest.raises(PolicyError, match=r"impl='narrow' takes dtypes float32, got float64.*"):
        choose("allreduce", False, 512, layout, "narrow", torch.float64, "sum")
    with pytest.raises(PolicyError, match=r"reduces with avg, sum, got op='max'; use impl='auto'"):
        choose("allreduce", False, 512, layout, "narrow", torch.float32, "max")
    with pytest.raises(PolicyError, match=r"at most 1024 bytes, got 2048; split the tensor"):
        choose("allreduce", False, 2048, layout, "narrow", torch.float32, "sum")
    assert choose("broadcast", False, 2048, layout, "narrow", torch.float64) == "mpi"  # not its op


def test_a_default_implementation_that_declines_a_call_leaves_it_to_auto(
    narrow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MPX_COLLECTIVES_IMPL is every call's default: a call it declines runs as auto's."""
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "narrow")
    reload_settings()
    layout = _one_node(2, False)
    assert choose("allreduce", False, 512, layout, None, torch.float32, "sum") == "narrow"
    assert choose("allreduce", False, 512, layout, None, torch.float32, "max") == "mpi"
    assert choose("allreduce", False, 1 << 24, layout, None, torch.float64, "sum") == "shm"


def test_declarations_are_checked_when_an_implementation_is_made() -> None:
    from mpx.collectives.core.registry import RegistryError

    with pytest.raises(RegistryError, match=r"requires_grad must be one of .*got 'sometimes'"):
        _narrow(requires_grad="sometimes")
    with pytest.raises(
        RegistryError, match=r"dtypes must be torch dtypes \(e.g. torch.float32\), got 'float32'"
    ):
        _narrow(dtypes=frozenset({"float32"}))
    with pytest.raises(RegistryError, match=r"reduce_ops must be among .*got \['mean'\]"):
        _narrow(reduce_ops=frozenset({"mean"}))
    with pytest.raises(RegistryError, match=r"max_bytes must be an int or None, got '1M'"):
        _narrow(max_bytes="1M")


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_named_implementation_that_declines_raises_on_every_rank(narrow: Any) -> None:
    """The error comes from the declarations before anything moves; the next call is sound."""
    comm = world()
    with pytest.raises(PolicyError, match=r"allreduce: impl='narrow' takes dtypes float32"):
        allreduce(torch.ones(4, dtype=torch.float64), impl="narrow")
    with pytest.raises(PolicyError, match=r"got op='max'"):
        allreduce(torch.ones(4), "max", impl="narrow")
    t = torch.ones(4)
    assert allreduce(t, impl="narrow") is t
    assert t.tolist() == [float(comm.size)] * 4


_GOT_GRAD: list[bool] = []


def allreduce_recording(comm: Any, t: torch.Tensor, op: str) -> Any:
    """An op function that records whether it got a tensor requiring grad (``as is``)."""
    from mpx.collectives.impl import mpi as impl_mpi

    _GOT_GRAD.append(t.requires_grad)
    return (yield from impl_mpi.allreduce(comm, t.detach(), op))


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_what_an_implementation_gets_for_a_tensor_that_requires_grad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``requires_grad="detached"`` (every built-in one): ``t.data``; ``"as is"``: ``t``."""
    from mpx.collectives.core import registry
    from mpx.collectives.core.registry import Implementation

    for name, handling in (("detaching", "detached"), ("keeping", "as is")):
        found = Implementation(
            name,
            __name__,
            frozenset({"allreduce"}),
            frozenset({"cpu"}),
            automatic=False,
            attribute="_RECORDING",
            requires_grad=handling,
        )
        monkeypatch.setitem(registry._registry, name, found)
    assert all(impl.requires_grad == "detached" for impl in registry.BUILT_IN)
    _GOT_GRAD.clear()
    x = torch.ones(3, requires_grad=True)
    allreduce(x, impl="detaching")
    allreduce(x, impl="keeping")
    assert _GOT_GRAD == [False, True]
    assert x.tolist() == [float(world().size ** 2)] * 3


class _Recording:
    allreduce = staticmethod(allreduce_recording)


_RECORDING = _Recording()
