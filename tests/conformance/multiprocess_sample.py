"""A test file in the form of torch's distributed test files, for run_torch_files' own test.

Not torch's code: three small ``MultiProcessTestCase`` tests of our own, one
per case the harness tells apart (runs on the backend under test, builds
gloo's class itself, needs more ranks).
"""

from typing import Any

import torch
import torch.distributed
from torch.testing._internal.common_distributed import MultiProcessTestCase

dist: Any = torch.distributed  # FileStore and ProcessGroupGloo are not in torch's stubs


class SampleTest(MultiProcessTestCase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @property
    def world_size(self) -> int:
        return 2

    def test_all_reduce_through_init_process_group(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.full((3,), float(self.rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 3
        dist.destroy_process_group()

    def test_gloo_class_built_directly(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        group = dist.ProcessGroupGloo(store, self.rank, self.world_size)
        t = torch.ones(2)
        group.allreduce([t]).wait()
        assert t.tolist() == [2.0, 2.0]


class FourRanksTest(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def test_needs_four(self) -> None:
        raise AssertionError("never runs at 2 ranks")

    def testNamedWithoutUnderscore(self) -> None:  # unittest finds test*, torch uses it
        raise AssertionError("never runs at 2 ranks")
