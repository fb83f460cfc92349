"""numba_kernels/host_arrays.py's raw copies (upload / download): what goes up comes back, and a host array that
does not match the device buffer byte for byte is refused with a one-line error before any copy."""
import numpy as np
import pytest
from numba import cuda

from kdspec.numba_kernels.host_arrays import download, upload

pytestmark = pytest.mark.sim


def test_upload_then_download_returns_the_same_bytes():
    device = cuda.device_array((2, 1, 3, 5), np.int32)
    host = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (2, 1, 3, 5), dtype=np.int64).astype(np.int32)
    upload(device, host)
    back = np.full_like(host, -1)
    download(back, device)
    assert np.array_equal(back, host)


@pytest.mark.parametrize("host", [np.zeros((3, 5), np.int32),          # other size
                                  np.zeros((2, 5), np.float32),        # other dtype
                                  np.zeros((5, 2), np.int32).T])       # not C-contiguous
def test_a_host_array_that_does_not_match_is_refused(host):
    device = cuda.device_array((2, 5), np.int32)
    with pytest.raises(ValueError, match="upload: host"):
        upload(device, host)
    with pytest.raises(ValueError, match="download: host"):
        download(host, device)


def test_an_upload_queued_on_a_stream_arrives():
    """With a stream the copy is queued there (the step graphs capture it): after the stream, the device holds it."""
    stream = cuda.stream()
    host = cuda.pinned_array(6, np.int32)
    host[:] = np.arange(6, dtype=np.int32) * 7 - 3
    device = cuda.to_device(np.full(6, -1, np.int32))
    upload(device, host, stream)
    stream.synchronize()
    back = np.zeros(6, np.int32)
    download(back, device)
    assert np.array_equal(back, host)
