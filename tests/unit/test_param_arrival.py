"""Parameters streamed home under the first forward: the root's part is waited for at once, each
block's forward waits for its own part and the next block's (the one FSDP gathers ahead), and
nothing waits twice. The copies are faked (CPU): each part's "event" records when it is waited for."""

from __future__ import annotations

import torch

from colocate.models import from_pretrained
from colocate.trainer.memory import ACTOR_PARAMS, TrainerMemory
from tests.helpers import write_hf_model


class Arrival:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def synchronize(self):
        self.log.append(self.name)


def _streamed(tmp_path, empty: tuple[int, ...] = ()):
    """A 2-block model registered with a pinned TrainerMemory whose copies are faked: part j of
    `onload_parts` (0 the root, j the block j - 1) arrives as event "j", or moves nothing when j is
    in `empty`."""
    path, _ = write_hf_model(tmp_path, "qwen3")
    model = from_pretrained(path, dtype="float32")
    memory, log, queued = TrainerMemory("pinned", torch.device("cpu")), [], []

    def onload_parts(tag, parts):
        queued.append((tag, [list(p) for p in parts]))
        return [None if j in empty else Arrival(str(j), log) for j in range(len(queued[0][1]))], 123

    memory.add_model(ACTOR_PARAMS, model)
    memory.offloader.onload_parts = onload_parts
    return model, memory, log, queued


def test_each_block_waits_for_its_own_and_the_next_blocks_parameters(tmp_path):
    model, memory, log, queued = _streamed(tmp_path)
    stats = memory.onload(ACTOR_PARAMS, overlap=True)
    assert stats.num_bytes == 123 and log == ["0"]  # the root's part, before anything runs
    [(tag, parts)] = queued
    blocks = list(model.model.layers)
    assert tag == ACTOR_PARAMS and len(parts) == 1 + len(blocks) == 3
    assert [id(p) for p in parts[1]] == [id(p) for p in blocks[0].parameters()]
    named = {id(p): n for n, p in model.named_parameters()}
    assert {named[id(p)] for p in parts[0]} == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} - (
        {"lm_head.weight"} if model.lm_head.weight is model.model.embed_tokens.weight else set()
    )
    assert sum(map(len, parts)) == len(list(model.parameters()))
    ids = torch.tensor([[1, 2, 3]])
    model(ids)
    assert log == ["0", "2", "2"]  # block 0 waits for block 1's part (FSDP prefetches it), block 1 its own
    model(ids)
    assert log == ["0", "2", "2"]  # arrived once, waited for once
    assert not memory.param_arrivals[ACTOR_PARAMS].pending


def test_a_part_that_moved_nothing_waits_for_the_last_part_before_it(tmp_path):
    model, memory, log, _ = _streamed(tmp_path, empty=(2,))
    memory.onload(ACTOR_PARAMS, overlap=True)
    model(torch.tensor([[1, 2, 3]]))
    assert log == ["0", "1", "1"]


def test_settle_drops_what_no_forward_waited_for(tmp_path):
    model, memory, log, _ = _streamed(tmp_path)
    memory.onload(ACTOR_PARAMS, overlap=True)
    memory.settle()
    model(torch.tensor([[1, 2, 3]]))
    assert log == ["0"] and not memory.param_arrivals[ACTOR_PARAMS].pending


def test_without_overlap_nothing_is_streamed(tmp_path):
    model, memory, log, queued = _streamed(tmp_path)
    memory.onload(ACTOR_PARAMS)
    model(torch.tensor([[1, 2, 3]]))
    assert queued == [] and log == []
