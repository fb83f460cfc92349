"""baselines.py against zlib / lzma used directly."""
import lzma
import zlib

import pytest

from kdspec.engine.train.baselines import measure_baselines
from kdspec.engine.train.errors import TrainError

FILES = [b"def f(x):\n    return x + 1\n" * 40, b"import os\nprint(os.getcwd())\n", bytes(range(256)) * 3]


def gzip_len(data):
    # gzip = 10-byte header + raw deflate stream + CRC32 + ISIZE
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return 10 + len(c.compress(data) + c.flush()) + 8


def xz_len(data):
    return len(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9))


def test_baselines_match_direct_compression():
    raw = sum(map(len, FILES))
    got = measure_baselines(FILES)
    assert got["raw_bytes"] == raw and got["files"] == 3
    assert got["gzip_per_file"] == pytest.approx(8 * sum(map(gzip_len, FILES)) / raw)
    assert got["xz_per_file"] == pytest.approx(8 * sum(map(xz_len, FILES)) / raw)
    assert got["xz_whole"] == pytest.approx(8 * xz_len(b"".join(FILES)) / raw)
    assert got["gzip_whole"] == pytest.approx(8 * gzip_len(b"".join(FILES)) / raw)
    assert got["xz_whole"] < got["xz_per_file"]


def test_baselines_need_bytes():
    with pytest.raises(TrainError):
        measure_baselines([b""])
