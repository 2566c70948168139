"""A finished run leaves nothing behind that could fail its exit: the tests' own probe for live gloo threads
(tests/helpers/tiny_recipe.py's gloo_threads) must not itself fail on a thread that ends while it looks."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "helpers"))
import tiny_recipe  # noqa: E402


def _vanished(kind: str) -> OSError:
    if kind == "FileNotFoundError":
        return FileNotFoundError(errno.ENOENT, "No such file or directory")
    if kind == "ProcessLookupError":  # what CI saw: ESRCH from reading /proc/self/task/<tid>/comm
        return ProcessLookupError(errno.ESRCH, "No such process")
    bare = OSError(f"a bare OSError ({kind})")  # no errno-specific subclass: only the errno says what happened
    bare.errno = errno.ENOENT if kind == "bare ENOENT" else errno.ESRCH
    return bare


@pytest.fixture
def fake_tasks(tmp_path, monkeypatch):
    """A task folder of three threads, two of them gloo's; thread 2 ends between the listing and its read."""
    tasks = tmp_path / "task"
    for tid, name in (("1", "python"), ("2", "gloo_ending"), ("3", "gloo_alive")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "comm").write_text(name + "\n")
    monkeypatch.setattr(tiny_recipe, "TASKS", tasks)

    def end_thread_2_with(error: OSError) -> None:
        read_text = Path.read_text

        def reading(self, *args, **kwargs):
            if self == tasks / "2" / "comm":
                raise error
            return read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", reading)

    return end_thread_2_with


@pytest.mark.parametrize("kind", ["FileNotFoundError", "ProcessLookupError", "bare ENOENT", "bare ESRCH"])
def test_gloo_threads_skips_a_thread_that_ended_while_listed(fake_tasks, kind):
    fake_tasks(_vanished(kind))
    assert tiny_recipe.gloo_threads() == ["gloo_alive"]


def test_gloo_threads_raises_what_is_not_a_thread_ending(fake_tasks):
    """A read refused for another reason is not a thread gone: the probe must not report "no gloo thread" then."""
    fake_tasks(PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(PermissionError):
        tiny_recipe.gloo_threads()


def test_gloo_threads_reads_this_process(monkeypatch):
    """The real /proc/self/task (Linux): pytest's own threads, none of them gloo's."""
    if not Path("/proc/self/task").is_dir():
        assert tiny_recipe.gloo_threads() is None
    else:
        assert tiny_recipe.gloo_threads() == []


def test_a_destroyed_group_ends_its_threads_though_the_fsdp_model_lives_on(tmp_path):
    """Issue 43 item 6: FSDP2's mesh infos and DeviceMesh (the model holds both) kept the destroyed group and its 3
    gloo threads; a rank that exited so while its peer still ran could abort, and the launch exited 1. Here on one
    process, in this one: the group's threads end at the close, while the sharded model is still referenced."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401 - imported before the group, as process_state does (a default argument)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from acceltrain.runtime.distributed import close_process_group

    assert not dist.is_initialized() and tiny_recipe.gloo_threads() == []
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        model(torch.randn(3, 4)).sum().backward()
        assert tiny_recipe.gloo_threads(), "the group's threads, which the probe must see"
    finally:
        close_process_group()
    assert tiny_recipe.gloo_threads() == []
    assert isinstance(model[0].weight, DTensor), "the model itself is left as it was"


def test_acceltrain_predict_leaves_no_process_group_behind(tmp_path, monkeypatch):
    """Under accelerate launch the processes of ``acceltrain predict`` join one group to split the rows; it was never
    destroyed, so each process exited with its gloo threads alive, as a DDP run did before it closed its group (the
    exit-time abort). Here the command's work is replaced by joining a group of one process."""
    import torch.distributed as dist

    import acceltrain.commands.predict
    from acceltrain.commands.cli import main

    def predicting(argv):
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        return 0

    monkeypatch.setattr(acceltrain.commands.predict, "main", predicting)
    try:
        assert main(["predict"]) == 0
        assert not dist.is_initialized()
        assert tiny_recipe.gloo_threads() == []
    finally:  # this pytest process goes on with other tests
        if dist.is_initialized():
            dist.destroy_process_group()
