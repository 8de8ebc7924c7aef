"""The vLLM worker's choice (rd2h.staging.choice): host staging exactly where the KV is on a
device type the configured engine does not move."""

from __future__ import annotations

import pytest
import torch

from rd2h.api import KVSource, StagedKVSource
from rd2h.staging import choice
from rd2h.staging.decode_landing import DecodeLanding
from rd2h.tensors import LayerTensors, layer_layout


def layers() -> dict[str, LayerTensors]:
    return {f"l{i}": LayerTensors(main=[torch.zeros(8, 16, 32, dtype=torch.bfloat16)]) for i in range(2)}


def test_host_kv_is_never_staged() -> None:
    t = layers()
    staging = choice.WorkerStaging(t, {n: layer_layout(x) for n, x in t.items()}, "local")
    assert choice.device_types(t) == {"host"}
    assert not staging.needed("prefill") and not staging.needed("decode")
    assert staging.sink_options() == {}
    source = staging.source(KVSource, block_size=16, reuse_slots=False)
    try:
        assert type(source) is KVSource
    finally:
        source.close()


def test_kv_on_a_device_the_engine_does_not_move_is_staged_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    t = layers()
    monkeypatch.setattr(choice, "device_types", lambda _: {"cuda"})  # the same tensors, said to be on a GPU
    made: list[dict] = []
    real = DecodeLanding.for_layers.__func__  # type: ignore[attr-defined]

    def for_layers(cls: type, ls: dict, **kw: object) -> DecodeLanding:  # a real landing: the tensors are host
        made.append(kw)
        return real(cls, ls, force=True, capacity_bytes=1 << 16)

    monkeypatch.setattr(DecodeLanding, "for_layers", classmethod(for_layers))
    monkeypatch.setenv("RD2H_STAGING_BLOCKS", "4")
    staging = choice.WorkerStaging(t, {n: layer_layout(x) for n, x in t.items()}, "local")
    assert "cuda" not in choice.moved_by("local", "decode")
    assert staging.needed("prefill") and staging.needed("decode")
    landing = staging.sink_options()["landing"]
    assert isinstance(landing, DecodeLanding) and made == [{"force": False, "capacity_bytes": 256 << 20}]
    source = staging.source(KVSource, block_size=16, reuse_slots=False)
    try:
        assert isinstance(source, StagedKVSource) and source.mirror.main_rows == 4
        assert source.mirror.layouts["l0"].tag == layer_layout(t["l0"]).tag  # Decode checks the same tag
    finally:
        source.close()
