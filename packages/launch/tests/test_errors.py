"""mpx-launch's errors, and MPXError, the root of every mpx package's errors."""

from __future__ import annotations

import pytest

import mpx.launch
from mpx.launch import (
    LaunchEnvironmentError,
    Launcher,
    LauncherNotFound,
    LaunchError,
    MPXError,
    SettingError,
    UsageError,
    environment,
)
from mpx.launch.virtual_cluster import VirtualCluster


def test_every_public_error_derives_from_launch_error() -> None:
    found = [getattr(mpx.launch, name) for name in mpx.launch.__all__]
    errors = {x for x in found if isinstance(x, type) and issubclass(x, BaseException)}
    own = {LaunchError, LaunchEnvironmentError, LauncherNotFound, UsageError, SettingError}
    assert errors == {MPXError, *own}
    assert all(issubclass(e, LaunchError) for e in own)
    assert issubclass(LaunchError, MPXError)


def test_usage_errors_are_value_errors() -> None:
    assert issubclass(UsageError, ValueError)
    assert not issubclass(LaunchEnvironmentError, ValueError)  # also "needs root", "no mpi4py"
    assert not issubclass(LauncherNotFound, ValueError)


def test_a_bad_bind_names_the_value() -> None:
    with pytest.raises(ValueError, match="'socket'") as info:
        Launcher("mpich", "mpiexec").command(2, ["prog"], bind="socket")
    assert isinstance(info.value, UsageError)
    assert "--bind must be one of" in str(info.value)


def test_a_bad_node_count_names_the_value() -> None:
    with pytest.raises(ValueError, match="got 0") as info:
        VirtualCluster(0)
    assert isinstance(info.value, UsageError)


def test_a_malformed_variable_names_it_and_the_fix() -> None:
    with pytest.raises(LaunchEnvironmentError) as info:
        environment({"PMI_RANK": "one", "PMI_SIZE": "2"})
    assert "'one'" in str(info.value)
    assert "unset it or fix the launcher" in str(info.value)
