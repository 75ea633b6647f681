#!/usr/bin/env python3
"""Generate the demo's synthetic segmentation dataset: shapes in scenes that differ as photos do.

    python examples/segmentation/make_dataset.py [--out DIR] [--train N] [--val N] [--seed S]

Writes DIR/images/*.jpg, DIR/labels/*.png (uint8 class per pixel: 0 background,
1 circle, 2 rectangle, 3 triangle, 4 ring; 255 on a thin band along every boundary, which
the loss ignores) and the list files DIR/train.txt and DIR/val.txt, whose
"images/x.jpg labels/x.png" lines are relative to DIR. The same seed gives the same files.

Every image is a scene of its own, so that one image's statistics are a poor estimate
of the whole set's, as with real photographs: its own exposure (brightness and
contrast) and colour cast, its own object scale (a few large shapes or many small
ones), and its own mix of classes (one to three of the four shapes). A net whose batch
norm sees one image at a time in training learns features normalized per image; at test
time it normalizes with running averages over many images, and pays for the difference.
"""
import argparse
import os
import sys

import numpy as np

CLASSES = ('background', 'circle', 'rectangle', 'triangle', 'ring')
IGNORE = 255
# Each shape has its own hue band (OpenCV hue, 0..180); the bands are near one another and
# the colour cast moves them, so colour is a good but imperfect cue and the net must also
# learn the shapes.
HUE_CENTRES = {1: 0, 2: 50, 3: 100, 4: 145}
HUE_JITTER = 22
# The per-image "camera": brightness offset (grey levels), contrast factor and per-channel
# gain (white balance) ranges; contrast and gains are drawn log-uniformly.
BRIGHTNESS = 50
CONTRAST = (0.4, 1.6)
CAST = (0.75, 1.33)
# The per-image object scale (times a radius of size/9), drawn log-uniformly.
OBJECT_SCALE = (0.6, 2.0)


def cv2():
    try:
        import cv2 as module
    except ImportError:
        sys.exit('error: the demo needs OpenCV: pip install opencv-python-headless')
    return module


def log_uniform(rng, low, high, size=None):
    return np.exp(rng.uniform(np.log(low), np.log(high), size))


def background(rng, size):
    """A low-saturation texture: a smooth random colour field plus stripes and grain."""
    cv = cv2()
    coarse = rng.uniform(0, 1, (4, 4, 3)).astype(np.float32)
    field = cv.resize(coarse, (size, size), interpolation=cv.INTER_CUBIC)
    base = rng.uniform(60, 190)
    image = base + 60 * (field - 0.5)
    gray = image.mean(axis=2, keepdims=True)
    image = gray + rng.uniform(0.1, 0.5) * (image - gray)          # washed-out colours
    angle, period = rng.uniform(0, np.pi), rng.uniform(4, 12)
    yy, xx = np.mgrid[0:size, 0:size]
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    image += rng.uniform(0, 18) * stripes[..., None]
    image += rng.normal(0, 6, image.shape)
    return image


def shape_colour(rng, cls):
    """A BGR colour from the class's hue band, saturated enough to stand out."""
    cv = cv2()
    hue = (HUE_CENTRES[cls] + rng.uniform(-HUE_JITTER, HUE_JITTER)) % 180
    hsv = np.uint8([[[hue, rng.uniform(120, 255), rng.uniform(110, 255)]]])
    return cv.cvtColor(hsv, cv.COLOR_HSV2BGR)[0, 0].astype(np.float64)


def draw_shape(canvas, cls, rng, size, radius, value):
    """Draw one shape of class ``cls`` and about ``radius`` into ``canvas`` (image or label
    map) with ``value``. The geometry comes from ``rng``, so drawing the image and the labels
    must replay it."""
    cv = cv2()
    cx, cy = rng.randint(4, size - 4, 2)
    r = max(3, int(radius * rng.uniform(0.7, 1.3)))
    if cls == 1:
        cv.circle(canvas, (int(cx), int(cy)), r, value, -1)
    elif cls == 2:
        w, h = np.maximum(2, (r * rng.uniform(0.5, 1.4, 2)).astype(int))
        cv.rectangle(canvas, (int(cx - w), int(cy - h)), (int(cx + w), int(cy + h)), value, -1)
    elif cls == 3:
        turn = rng.uniform(0, 2 * np.pi)
        corners = [(cx + 1.3 * r * np.cos(turn + k * 2 * np.pi / 3),
                    cy + 1.3 * r * np.sin(turn + k * 2 * np.pi / 3)) for k in range(3)]
        cv.fillPoly(canvas, [np.int32(corners)], value)
    else:
        cv.circle(canvas, (int(cx), int(cy)), r + 2, value, max(2, r // 2))


def expose(image, rng):
    """The scene through its own camera: contrast about mid-grey, a brightness offset and a
    colour cast (one gain per channel)."""
    contrast = log_uniform(rng, *CONTRAST)
    brightness = rng.uniform(-BRIGHTNESS, BRIGHTNESS)
    gains = log_uniform(rng, *CAST, size=3)
    return ((image - 128) * contrast + 128 + brightness) * gains


def make_sample(rng, size):
    """(H x W x 3 uint8 image, H x W uint8 labels): a scene of one to three shape classes."""
    cv = cv2()
    image = background(rng, size)
    labels = np.zeros((size, size), np.uint8)
    present = rng.choice(np.arange(1, len(CLASSES)), rng.randint(1, 4), replace=False)
    scale = log_uniform(rng, *OBJECT_SCALE)
    radius = scale * size / 9
    for _ in range(rng.randint(1, 2 + int(round(5 / scale)))):   # many small or a few large
        cls = int(rng.choice(present))
        colour = shape_colour(rng, cls)
        state = rng.get_state()
        mask = np.zeros((size, size), np.uint8)
        draw_shape(mask, cls, rng, size, radius, 1)
        rng.set_state(state)
        draw_shape(labels, cls, rng, size, radius, cls)
        shading = 1 + 0.25 * (np.linspace(-1, 1, size)[None, :, None] * rng.uniform(-1, 1))
        image = np.where(mask[..., None] > 0, colour * shading + rng.normal(0, 8, image.shape),
                         image)
    image = expose(image, rng)
    image = cv.GaussianBlur(np.clip(image, 0, 255).astype(np.float32), (3, 3), 0.6)
    boundary = np.zeros_like(labels, bool)              # 1 pixel wide, where a neighbour
    boundary[:, :-1] |= labels[:, :-1] != labels[:, 1:]  # to the right or below differs
    boundary[:-1, :] |= labels[:-1, :] != labels[1:, :]
    labels[boundary] = IGNORE
    return np.clip(image + 0.5, 0, 255).astype(np.uint8), labels


def write_split(out, name, count, rng, size):
    cv = cv2()
    lines = []
    for i in range(count):
        image, labels = make_sample(rng, size)
        image_name, label_name = 'images/%s_%04d.jpg' % (name, i), 'labels/%s_%04d.png' % (name, i)
        cv.imwrite(os.path.join(out, image_name), image, [cv.IMWRITE_JPEG_QUALITY, 95])
        cv.imwrite(os.path.join(out, label_name), labels)
        lines.append('%s %s\n' % (image_name, label_name))
    with open(os.path.join(out, name + '.txt'), 'w') as f:
        f.writelines(lines)


def make_dataset(out, train=1000, val=128, size=64, seed=0):
    """Write the dataset into ``out``; returns the paths of the two list files."""
    for folder in ('images', 'labels'):
        os.makedirs(os.path.join(out, folder), exist_ok=True)
    rng = np.random.RandomState(seed)
    write_split(out, 'train', train, rng, size)
    write_split(out, 'val', val, rng, size)
    return os.path.join(out, 'train.txt'), os.path.join(out, 'val.txt')


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', default=os.path.join(here, 'data'), help='output folder')
    p.add_argument('--train', type=int, default=1000, help='training images (default 1000)')
    p.add_argument('--val', type=int, default=128, help="held-out images (default 128)")
    p.add_argument('--size', type=int, default=64, help='image side in pixels (default 64)')
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.train < 1 or args.val < 1 or args.size < 24:
        p.error('need --train >= 1, --val >= 1 and --size >= 24')
    train, val = make_dataset(args.out, args.train, args.val, args.size, args.seed)
    print('wrote %d training and %d held-out %dx%d images (%d classes: %s) to %s'
          % (args.train, args.val, args.size, args.size, len(CLASSES), ', '.join(CLASSES),
             args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
