import importlib.util
import os

import pytest
import torch

from sinkflow.errors import SinkflowError
from sinkflow.runtime.checkpoint import PhaseCheckpoints, atomic_save, load


def test_rotation_keeps_newest_k(tmp_path):
    ck = PhaseCheckpoints(tmp_path / "p", keep=2)
    for step in (10, 20, 30):
        ck.save({"w": torch.full((3,), float(step))}, step)
    assert [s for s, _ in ck.steps()] == [20, 30]
    assert ck.latest()["step"] == 30 and ck.latest()["w"][0] == 30


def test_failed_write_leaves_old_file_intact(tmp_path):
    path = tmp_path / "final.pt"
    atomic_save({"format": 1, "v": 1}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_save({"format": 1, "v": Boom()}, path)
    assert load(path)["v"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["final.pt"]  # no temp file left behind


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "step_00000010.pt"
    atomic_save({"format": 1, "w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SinkflowError, match="corrupt or truncated.*run this phase again from its start .it has no "
                                            "earlier checkpoint."):
        load(path)  # nothing before it: deleting it retrains the phase (it said "the previous checkpoint")
    for step in (5, 20):  # an earlier and a later one beside it: the earlier is named
        atomic_save({"format": 1}, tmp_path / f"step_{step:08d}.pt")
    with pytest.raises(SinkflowError, match=r"delete it to resume from the previous checkpoint \(step_00000005.pt\)"):
        load(path)
    final = tmp_path / "final.pt"  # final.pt's previous checkpoint: the newest step
    final.write_bytes(data[: len(data) // 2])
    with pytest.raises(SinkflowError, match=r"previous checkpoint \(step_00000020.pt\)"):
        load(final)


def test_a_flipped_byte_in_a_weight_is_a_clear_error_not_a_silent_load(tmp_path):
    """torch.load does not check the CRC-32 torch.save writes for every record: a byte flipped inside a weight (a
    disk or copy fault) loaded, and a resume trained on, a network nobody trained. The checksums are checked."""
    import zipfile

    path = tmp_path / "step_00000010.pt"
    atomic_save({"format": 2, "w": torch.randn(1000)}, path)
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.file_size == 4000)  # the weight's record
    data = bytearray(path.read_bytes())
    data[info.header_offset + 2000] ^= 0x01  # inside the 4,000 bytes after the record's header
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["w"].shape == (1000,)  # torch alone reads it without a word
    with pytest.raises(SinkflowError, match=r"step_00000010.pt is corrupt or truncated .*run this phase again"):
        load(path)
    if importlib.util.find_spec("torch.utils.serialization") is None:
        return  # torch 2.4 to 2.6: no switch to write a record without its checksum (compute_crc32): every one has it
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = False  # records written without a checksum (CRC 0) have none to check
    try:
        atomic_save({"format": 2, "w": torch.randn(1000)}, path)
    finally:
        config.save.compute_crc32 = old
    assert load(path)["w"].shape == (1000,)


def test_foreign_file_is_rejected(tmp_path):
    path = tmp_path / "x.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(SinkflowError, match="not a sinkflow checkpoint"):
        load(path)


def test_checkpoint_is_plain_torch(tmp_path):
    ck = PhaseCheckpoints(tmp_path, keep=1)
    ck.save_final({"model": {"w": torch.ones(2)}})
    obj = torch.load(os.path.join(tmp_path, "final.pt"), weights_only=True)  # any PyTorch tool can read it, safely
    assert obj["final"] and torch.equal(obj["model"]["w"], torch.ones(2))


def test_cuda_rng_states_of_more_cards_than_this_machine_has_restore_the_cards_it_has(monkeypatch):
    """A step checkpoint holds one CUDA generator state per card the training process saw (``get_rng_state_all``:
    8 on an 8-card node, one process); resumed on a machine with 1 card, ``set_rng_state_all`` set card 1's state
    and torch raised IndexError from ``default_generators[1]`` mid-resume. The cards here get theirs, no more. The
    cards are faked: only their count and the setter are read."""
    from sinkflow.runtime.checkpoint import rng_state, set_rng_state

    cards = {"count": 1, "set": []}

    def fake_set(new_state, device="cuda"):  # torch's own: default_generators[index].set_state(new_state)
        index = device if isinstance(device, int) else torch.device(device).index
        if index >= cards["count"]:
            raise IndexError("tuple index out of range")
        cards["set"].append(index)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cards["count"])
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake_set)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", fake_set)
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8) for _ in range(8)]
    set_rng_state(state)
    assert cards["set"] == [0]
    cards["count"], cards["set"] = 2, []
    state["cuda"] = state["cuda"][:1]  # a 1-card run resumed on 2 cards: card 0's state, card 1 keeps its own
    set_rng_state(state)
    assert cards["set"] == [0]
