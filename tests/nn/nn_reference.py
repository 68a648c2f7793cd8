"""Host references for the device ops whose results are not a function of the data alone (dropout's mask),
shared by the simulator tests (test_nn_device_ops.py) and the GPU ones (test_nn_gpu.py).  Written with numpy
uint64 arithmetic, independently of the device code's 16-bit-halves multiply, so a slip in either shows."""
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)


def _lowbias32(x):
    x = np.asarray(x, np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32  # the uint64 product wraps mod 2**64: its low 32 bits are right
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


def dropout_seed(generator_seed):
    """The seed F.dropout draws on the device from np.random.default_rng(generator_seed)."""
    return int(np.random.default_rng(generator_seed).integers(2 ** 32))


def dropout_keep(seed, shape, p):
    """The device dropout's keep mask (bool, `shape`) for `seed`: element i (C order) is kept iff the top 24
    bits of lowbias32(lowbias32(seed) + i) are at least round(p * 2**24)."""
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = _lowbias32((_lowbias32(seed) + idx) & _M32)
    return ((h >> np.uint64(8)) >= np.uint64(round(p * (1 << 24)))).reshape(shape)
