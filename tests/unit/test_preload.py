"""The torch_memory_saver glue: the child environment that preloads the hook, and the exit-time
release of the torch-hook mode's pools (which the library would otherwise end with status 1)."""

from pathlib import Path
from types import SimpleNamespace

from colocate import memory_saver
from colocate.memory_saver import _free_pools_at_exit, with_preload


class _Library:
    """The hook library's flag setter, recording the calls."""

    def __init__(self):
        self.flags: list[bool] = []

    def tms_set_interesting_region(self, value: bool) -> None:
        self.flags.append(value)


def _saver(hook_mode: str):
    library = _Library()
    impl = SimpleNamespace(
        _hook_mode=hook_mode,
        _binary_wrapper=SimpleNamespace(cdll=library),
        _mem_pools={("weights", True, False, "", 0): object()},
    )
    return SimpleNamespace(_impl=impl), library


def test_exit_hook_sets_the_region_flag_and_drops_the_pools_in_torch_mode():
    saver, library = _saver("torch")
    _free_pools_at_exit(saver)
    assert library.flags == [True] and saver._impl._mem_pools == {}


def test_exit_hook_leaves_preload_mode_and_unused_savers_alone():
    saver, library = _saver("preload")
    _free_pools_at_exit(saver)
    assert library.flags == [] and len(saver._impl._mem_pools) == 1
    _free_pools_at_exit(SimpleNamespace(_impl=None))  # never initialised: nothing to free


def test_child_environment_preloads_the_hook_once(monkeypatch):
    monkeypatch.setattr(memory_saver, "preload_library", lambda: "/lib/hook.so")
    env = with_preload({"LD_PRELOAD": "/lib/other.so"})
    assert env["LD_PRELOAD"] == "/lib/hook.so:/lib/other.so"
    preloaded = {"LD_PRELOAD": "/x/torch_memory_saver_hook.so"}
    assert with_preload(preloaded) == preloaded
    monkeypatch.setattr(memory_saver, "preload_library", lambda: None)
    assert "LD_PRELOAD" not in with_preload({})


def test_one_probe_prints_the_gpus_then_the_hook_the_run_needs(monkeypatch, capsys):
    import torch

    config = str(Path(__file__).parents[2] / "configs" / "default.yaml")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(memory_saver, "preload_library", lambda: "/lib/hook.so")

    def probe(*argv: str) -> list[str]:
        assert memory_saver.main(list(argv)) == 0
        return capsys.readouterr().out.split("\n")[:-1]

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert probe("--gpus", config) == ["0", ""]  # no GPU: nothing to preload
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert probe("--gpus", config) == ["2", "/lib/hook.so"]
    assert probe(config) == ["/lib/hook.so"]
    assert probe("--gpus", config, "--rollout.engine", "sglang") == ["2", ""]  # it preloads its own
    monkeypatch.setenv("LD_PRELOAD", "/x/torch_memory_saver_hook.so")
    assert probe("--gpus", config) == ["2", ""]  # already there
