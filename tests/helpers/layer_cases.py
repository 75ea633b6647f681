"""Geometries that the im2col, pooling and cuDNN convolution tests run on the emulation, and
the GPU tests (tests/gpu) on CuPy."""

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

CUDNN_CONVOLUTIONS = [  # type, convolution_param, input shape
    ('Convolution', 'num_output: 3 kernel_size: 3 pad: 1', (2, 2, 5, 4)),
    ('Convolution', 'num_output: 4 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2',
     (2, 4, 7, 6)),
    ('Convolution', 'num_output: 4 kernel_size: 3 pad: 1 group: 4', (2, 4, 5, 5)),
    ('Convolution', 'num_output: 3 kernel_size: 1', (2, 3, 3, 4)),
    ('Convolution', 'num_output: 2 kernel_h: 3 kernel_w: 1 pad_h: 1 stride_h: 1 stride_w: 2',
     (1, 3, 5, 6)),
    ('Convolution', 'num_output: 2 kernel_size: 2 pad: 1 stride: 2', (1, 2, 4, 4, 3)),
    ('Deconvolution', 'num_output: 3 kernel_size: 3 stride: 2 pad: 1', (2, 2, 3, 4)),
    ('Deconvolution', 'num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 4', (1, 4, 3, 3)),
    ('Deconvolution', 'num_output: 2 kernel_size: 2 stride: 2', (1, 3, 2, 2, 2)),
]


def convolution(body, kind='Convolution'):
    """One (de)convolution layer from bottom x to top y, with random fillers."""
    return ('name: "c" type: "%s" bottom: "x" top: "y" convolution_param { %s weight_filler { '
            'type: "gaussian" std: 0.5 } bias_filler { type: "uniform" min: -0.5 max: 0.5 } }'
            % (kind, body))
