"""The standalone API with real torch tensors (CPU here; cuda/npu tensors go the same way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rd2h.api import KVSink, KVSource, LayerTensors, layer_layout, tensor_layout
from rd2h.errors import ConfigError
from rd2h.outcome import TerminalState


def test_bf16_layers_arrive_bit_exact(kv_port: int) -> None:
    torch.manual_seed(0)
    src = {f"layer.{i}": LayerTensors(main=[torch.randn(16, 64, 8, dtype=torch.bfloat16)],
                                      indexer=torch.randn(16, 64, 4, dtype=torch.float16)) for i in range(2)}
    dst = {name: LayerTensors(main=[torch.zeros_like(t.main[0])], indexer=torch.zeros_like(t.indexer))
           for name, t in src.items()}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=64) as source:
        sink.expect("r", main_blocks=[3, 1, 2])
        source.add_request("r", sink.endpoint, main_block_ids=[10, 11, 12], num_tokens=150)
        source.send_all({"r": 150})
        assert source.wait_finished(["r"], 10)["r"].ok
        assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    for name in src:
        assert torch.equal(dst[name].main[0][[3, 1, 2]], src[name].main[0][[10, 11, 12]])
        assert torch.equal(dst[name].indexer[[3, 1, 2]], src[name].indexer[[10, 11, 12]])
        assert not dst[name].main[0][0].any()


def test_tensor_layout_reads_torch_and_numpy_alike() -> None:
    t = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    a = np.zeros((8, 128), np.uint8)
    assert tensor_layout(t).block_len == 4 * 16 * 2 == tensor_layout(a).block_len
    assert tensor_layout(t).base_addr == t.data_ptr() and tensor_layout(t).num_blocks == 8
    assert layer_layout(LayerTensors(main=[t], indexer=a)).indexer.base_addr == a.ctypes.data


@pytest.mark.parametrize("bad", [torch.zeros(8, 16).t(), np.zeros((16, 8)).T, torch.zeros(0, 4), [1, 2]])
def test_tensor_layout_refuses_what_it_cannot_address(bad: object) -> None:
    with pytest.raises(ConfigError):
        tensor_layout(bad)


def test_record_event_on_cpu_is_already_complete() -> None:
    from rd2h.api import record_event

    assert record_event(torch.zeros(2)) is None
    assert record_event(np.zeros(2)) is None


def test_host_buffer_is_page_aligned_zeroed_and_typed() -> None:
    import mmap

    from rd2h.api import host_buffer

    buf = host_buffer((16, 4096), np.uint16)
    assert buf.shape == (16, 4096) and buf.dtype == np.uint16 and not buf.any()
    assert buf.ctypes.data % mmap.PAGESIZE == 0 and buf.flags.c_contiguous and buf.flags.writeable


def test_a_misaligned_tensor_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    raw = np.zeros(4096 + 128, np.uint8)
    misaligned = raw[(-raw.ctypes.data) % 64 + 16 :][:4096].reshape(4, 1024)
    with caplog.at_level("WARNING", logger="rd2h.tensors"):
        tensor_layout(misaligned)
    assert "not 64-byte aligned" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rd2h.tensors"):
        tensor_layout(torch.zeros(4, 1024, dtype=torch.uint8))
    assert caplog.text == ""


def test_tensor_layout_carries_the_memory_kind() -> None:
    assert tensor_layout(torch.zeros(2, 64)).kind == "host"
    assert tensor_layout(np.zeros((2, 64))).kind == "host"
    assert layer_layout(LayerTensors([torch.zeros(2, 64)])).regions()[0].kind == "host"
