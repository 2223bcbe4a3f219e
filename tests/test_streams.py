"""ppd's own CUDA streams (``ppd/decoding/streams.py``): never one CUDA stream twice while both are alive."""

import weakref

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
def test_own_streams_are_distinct_cuda_streams_on_the_gpu(monkeypatch):
    """torch's pool hands its 32 streams out in turn, so plain draws repeat; ppd's own streams skip those it already
    holds (and torch's default capture stream), and say so when the pool has none left."""
    from ppd.decoding import streams

    mine = [streams.own_stream("cuda") for _ in range(4)]
    drawn = [torch.cuda.Stream() for _ in range(2 * streams.POOL)]  # the pool wraps around
    assert len({s.cuda_stream for s in drawn}) <= streams.POOL < len(drawn)
    more = [streams.own_stream("cuda") for _ in range(4)]
    handles = {s.cuda_stream for s in mine + more}
    assert len(handles) == 8
    default = torch.cuda.graph.default_capture_stream
    assert default is None or default.cuda_stream not in handles
    taken = {(torch.cuda.current_device(), s.cuda_stream): weakref.ref(s) for s in drawn}
    monkeypatch.setattr(streams, "_handed", taken)  # every stream of the pool held
    with pytest.raises(RuntimeError, match="every pooled CUDA stream"):
        streams.own_stream("cuda")
