"""CompressionConfig: defaults, validation, the environment (MPX and CGX names), filtering."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import mpx.collectives
import mpx.quantize as mq
from mpx.collectives import all_implementations
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.reduction.config import CompressionConfig, registry


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    registry.clear()
    yield
    registry.clear()


def test_defaults_follow_cgx() -> None:
    c = CompressionConfig()
    assert (c.bits, c.bucket_size, c.skip_incomplete_buckets) == (4, 512, False)
    assert c.fusion_buffer_mb == 64
    assert c.min_compressed == 16
    assert c.enabled
    assert not c.error_feedback
    assert c.stochastic
    assert c.exclude == ()


def test_bad_values_name_themselves() -> None:
    with pytest.raises(ValueError, match="bits=9"):
        CompressionConfig(bits=9)
    with pytest.raises(ValueError, match="bucket_size=0"):
        CompressionConfig(bucket_size=0)
    with pytest.raises(mq.QuantizeValueError, match=r"bucket_size=9223372036854775808 .*2\*\*60"):
        CompressionConfig(bucket_size=2**63)
    with pytest.raises(
        ValueError, match=r"2\*\*60.*environment: MPX_QUANTIZE_BUCKET_SIZE='9223372036854775808'"
    ):
        CompressionConfig.from_env({"MPX_QUANTIZE_BUCKET_SIZE": str(2**63)})
    with pytest.raises(ValueError, match="minimal_size=-1"):
        CompressionConfig(minimal_size=-1)
    with pytest.raises(ValueError, match="fusion_buffer_mb=0"):
        CompressionConfig(fusion_buffer_mb=0)
    with pytest.raises(ValueError, match="exclude entries"):
        CompressionConfig(exclude=("",))
    assert not CompressionConfig(bits=32).enabled


def test_a_single_exclude_string_is_one_pattern() -> None:
    c = CompressionConfig(exclude="bn")  # type: ignore[arg-type]
    assert c.exclude == ("bn",)
    assert c.compresses(1000, "layer1.conv.weight", 4)
    assert not c.compresses(1000, "layer1.bn.weight", 4)


def test_from_env_reads_mpx_names() -> None:
    env = {
        "MPX_QUANTIZE_BITS": "3",
        "MPX_QUANTIZE_BUCKET_SIZE": "1024",
        "MPX_QUANTIZE_SKIP_INCOMPLETE_BUCKETS": "1",
        "MPX_QUANTIZE_MINIMAL_SIZE": "5000",
        "MPX_QUANTIZE_FUSION_BUFFER_MB": "2.5",
        "MPX_QUANTIZE_ERROR_FEEDBACK": "true",
        "MPX_QUANTIZE_EXCLUDE": "bn, bias",
        "MPX_QUANTIZE_STOCHASTIC": "0",
        "MPX_QUANTIZE_SEED": "7",
    }
    c = CompressionConfig.from_env(env)
    assert c == CompressionConfig(3, 1024, True, 5000, 2.5, True, ("bn", "bias"), False, 7)


def test_from_env_accepts_cgx_names_and_mpx_wins() -> None:
    env = {
        "CGX_COMPRESSION_QUANTIZATION_BITS": "2",
        "CGX_COMPRESSION_BUCKET_SIZE": "128",
        "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "1",
        "CGX_COMPRESSION_MINIMAL_SIZE": "100",
        "CGX_FUSION_BUFFER_SIZE_MB": "8",
    }
    c = CompressionConfig.from_env(env)
    assert (c.bits, c.bucket_size, c.skip_incomplete_buckets) == (2, 128, True)
    assert (c.minimal_size, c.fusion_buffer_mb) == (100, 8.0)
    c2 = CompressionConfig.from_env({**env, "MPX_QUANTIZE_BITS": "8"})
    assert c2.bits == 8
    assert not CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "32"}).enabled
    assert CompressionConfig.from_env({}, bits=5).bits == 5  # overrides win
    assert CompressionConfig.from_env({}) == CompressionConfig()


def test_from_env_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="MPX_QUANTIZE_BITS='four'"):
        CompressionConfig.from_env({"MPX_QUANTIZE_BITS": "four"})
    with pytest.raises(ValueError, match="CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS='maybe'"):
        CompressionConfig.from_env({"CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "maybe"})
    with pytest.raises(ValueError, match=r"CGX_COMPRESSION_QUANTIZATION_BITS='0'.*1, 2.*32"):
        CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "0"})
    monkeypatch.setenv("MPX_QUANTIZE_BUCKET_SIZE", "64")
    assert CompressionConfig.from_env().bucket_size == 64


def test_which_tensors_are_compressed() -> None:
    c = CompressionConfig(minimal_size=100, exclude=("bn",))
    assert c.compresses(100)
    assert not c.compresses(99)
    assert not CompressionConfig(minimal_size=0).compresses(15)  # never below 16
    assert c.compresses(1000, "fc.weight", 2)
    assert not c.compresses(1000, "fc.bias", 1)  # 1-D
    assert not c.compresses(1000, "bn1.weight", 2)
    assert c.compresses(1000, None, None)  # a bare flat buffer: size only
    assert not CompressionConfig(bits=32).compresses(10**6)
    mq.exclude_layer("fc")
    assert not c.compresses(1000, "fc.weight", 2)
    with pytest.raises(ValueError, match="exclude_layer"):
        mq.exclude_layer("")


def test_torch_cgx_exclude_layer_needs_register_model_first() -> None:
    """Before register_model it was ignored in silence: every layer quantized (issue 41)."""
    import torch_cgx

    with pytest.raises(
        QuantizeValueError,
        match=r"torch_cgx\.exclude_layer\('bn'\) before torch_cgx\.register_model: no layers "
        r"are registered.*call torch_cgx\.register_model\(\[\(name, p\.numel\(\)\)",
    ):
        torch_cgx.exclude_layer("bn")
    assert registry.excluded == []
    torch_cgx.register_model([("fc.weight", 100), ("bn.weight", 10)])
    torch_cgx.exclude_layer("bn")
    assert registry.excluded == ["bn"]
    with pytest.raises(QuantizeValueError, match="non-empty name part"):
        torch_cgx.exclude_layer("")


def test_register_model_records_names() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    mq.register_model(model)
    assert registry.order == [("0.weight", 12), ("0.bias", 4), ("1.weight", 4), ("1.bias", 4)]
    assert registry.name_of(model[0].get_parameter("weight")) == "0.weight"
    state = mq.QuantizeState(CompressionConfig(), comm=None, model=None)
    assert state.name_of(model[1].get_parameter("bias")) == "1.bias"
    mq.register_model([("extra", 10)])
    assert registry.order[-1] == ("extra", 10)


def test_cgx_configuration_keeps_cgx_defaults() -> None:
    """Configured through CGX_* only, unset bits mean CGX's 32 (no compression), not 4."""
    c = CompressionConfig.from_env({"CGX_COMPRESSION_BUCKET_SIZE": "128"})
    assert c.bucket_size == 128
    assert c.bits == 32
    assert not c.enabled
    assert CompressionConfig.from_env({"CGX_COMMUNICATOR_TYPE": "SHM"}).bits == 32
    both = {"CGX_COMPRESSION_BUCKET_SIZE": "128", "CGX_COMPRESSION_QUANTIZATION_BITS": "2"}
    assert CompressionConfig.from_env(both).bits == 2
    assert CompressionConfig.from_env({"MPX_QUANTIZE_BUCKET_SIZE": "128"}).bits == 4  # mpx's


def test_cgx_communicator_type_maps_to_an_implementation() -> None:
    for name, variable in (
        ("MPI", "CGX_COMMUNICATOR_TYPE"),
        ("SHM", "COMMUNICATOR_TYPE"),
        ("MPI", "CGX_INNER_COMMUNICATOR_TYPE"),  # what CGX itself reads
    ):
        c = CompressionConfig.from_env({variable: name})
        assert c.communicator == name.lower()
    mpi = CompressionConfig(communicator="MPI")
    assert [mpi.impl(op) for op in ("allreduce", "allgather", "alltoall")] == ["mpi"] * 3
    shm = CompressionConfig(communicator="shm")
    assert [shm.impl(op) for op in ("allreduce", "allgather", "alltoall")] == ["shm", "shm", "auto"]
    assert CompressionConfig().impl("allreduce") == "auto"  # named: never the env's
    # CGX's NCCL: refused by name, from the environment (as mpxrun --settings does) and here
    with pytest.raises(
        ValueError, match=r"CGX_INNER_COMMUNICATOR_TYPE='NCCL' is not valid: expected one of auto"
    ):
        CompressionConfig.from_env({"CGX_INNER_COMMUNICATOR_TYPE": "NCCL"})
    with pytest.raises(ValueError, match=r"communicator='NCCL' is not one of .*NCCL has no CPU"):
        CompressionConfig(communicator="NCCL")


def test_the_communicator_selects_through_the_collectives_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What an implementation runs is the registry's word (Implementation.provides)."""
    registered = all_implementations()
    for name in ("mpi", "shm"):
        config = CompressionConfig(communicator=name)
        for op in ("allreduce", "broadcast", "reduce", "allgather", "alltoall", "send"):
            expected = name if op in registered[name].provides else "auto"
            assert config.impl(op) == expected, (name, op)
    # An implementation that provides less: its other ops go to auto.
    narrow = replace(registered["shm"], provides=frozenset({"allreduce"}))
    monkeypatch.setattr(mpx.collectives, "all_implementations", lambda: {"shm": narrow})
    shm = CompressionConfig(communicator="SHM")
    assert [shm.impl(op) for op in ("allreduce", "allgather")] == ["shm", "auto"]
    # One that is not registered: a clear error naming what is.
    monkeypatch.setattr(mpx.collectives, "all_implementations", lambda: {"ring": narrow})
    with pytest.raises(QuantizeValueError, match=r"communicator='mpi'.*it has ring"):
        CompressionConfig(communicator="mpi").impl("allreduce")
