"""Geometries that the im2col and pooling tests run on the emulated kernels, and the GPU
tests (tests/gpu) on CuPy."""

IM2COL = [  # kernel, pad, stride, dilation, spatial
    ((3, 3), (1, 1), (1, 1), (1, 1), (5, 6)),
    ((2, 3), (0, 1), (2, 1), (1, 2), (6, 7)),
    ((3, 2), (2, 0), (3, 2), (2, 1), (7, 5)),
    ((1, 1), (0, 0), (1, 1), (1, 1), (3, 4)),
]

POOLS = [  # method, in_hw, kernel, stride, pad, ceil
    ('MAX', (5, 5), (3, 3), (2, 2), (0, 0), True),
    ('MAX', (6, 7), (3, 2), (2, 2), (1, 1), True),
    ('MAX', (5, 6), (2, 2), (1, 1), (0, 0), True),
    ('AVE', (5, 5), (3, 3), (2, 2), (1, 1), True),
    ('AVE', (7, 6), (3, 3), (3, 2), (0, 1), True),
    ('AVE', (6, 6), (2, 2), (2, 2), (0, 0), False),
]
