"""Write the shapes dataset of the detection example: 64 x 64 images of one to three
filled shapes (1 circle, 2 square, 3 triangle) on a noisy background, a txt annotation
per image ("label xmin ymin xmax ymax" in pixels), and the two LMDBs that
tools/convert_annoset.py makes of them.

    python examples/detection/make_shapes.py OUT [--train 256 --test 64 --seed 0]

Writes OUT/images/, OUT/labelmap.prototxt, OUT/{train,test}_list.txt and
OUT/{train,test}_lmdb.
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from caffe_syncbn.data.annotation import convert_annoset  # noqa: E402
from caffe_syncbn.data.datum import cv2  # noqa: E402

SIZE = 64
NAMES = ('circle', 'square', 'triangle')


def draw_scene(rs):
    """(H x W x 3 uint8 image, [(label, xmin, ymin, xmax, ymax)]) with shapes that do not
    overlap much (a new shape's box may cover at most a third of an earlier one's)."""
    cv = cv2()
    image = np.clip(rs.normal(110, 25, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
    boxes = []
    for _ in range(rs.randint(1, 4)):
        for _ in range(20):
            side = rs.randint(12, 34)
            left, top = rs.randint(0, SIZE - side), rs.randint(0, SIZE - side)
            box = (left, top, left + side, top + side)
            if all(overlap(box, other[1:]) < 0.34 for other in boxes):
                break
        else:
            continue
        label = rs.randint(1, 4)
        colour = tuple(int(c) for c in rs.randint(0, 256, 3))
        if label == 1:
            cv.circle(image, (left + side // 2, top + side // 2), side // 2, colour, -1)
        elif label == 2:
            cv.rectangle(image, (left, top), (left + side - 1, top + side - 1), colour, -1)
        else:
            points = np.array([[left + side // 2, top], [left, top + side - 1],
                               [left + side - 1, top + side - 1]], np.int32)
            cv.fillPoly(image, [points], colour)
        boxes.append((label,) + box)
    return image, boxes


def overlap(box, other):
    width = min(box[2], other[2]) - max(box[0], other[0])
    height = min(box[3], other[3]) - max(box[1], other[1])
    if width <= 0 or height <= 0:
        return 0.0
    return width * height / ((other[2] - other[0]) * (other[3] - other[1]))


def make_dataset(out, train=256, test=64, seed=0, log=print):
    """Write the dataset into ``out``; returns the paths of the train and test LMDBs."""
    rs = np.random.RandomState(seed)
    cv = cv2()
    os.makedirs(os.path.join(out, 'images'), exist_ok=True)
    with open(os.path.join(out, 'labelmap.prototxt'), 'w') as f:
        f.write('item { name: "background" label: 0 }\n')
        for label, name in enumerate(NAMES, 1):
            f.write('item { name: "%s" label: %d }\n' % (name, label))
    dbs = []
    for split, count in (('train', train), ('test', test)):
        lines = []
        for i in range(count):
            image, boxes = draw_scene(rs)
            name = 'images/%s_%04d' % (split, i)
            cv.imwrite(os.path.join(out, name + '.png'), image)
            with open(os.path.join(out, name + '.txt'), 'w') as f:
                f.writelines('%d %d %d %d %d\n' % box for box in boxes)
            lines.append('%s.png %s.txt\n' % (name, name))
        list_file = os.path.join(out, split + '_list.txt')
        with open(list_file, 'w') as f:
            f.writelines(lines)
        db = os.path.join(out, split + '_lmdb')
        convert_annoset(out + '/', list_file, db, label_type='txt', log=log)
        dbs.append(db)
    return dbs


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('out')
    p.add_argument('--train', type=int, default=256)
    p.add_argument('--test', type=int, default=64)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args()
    make_dataset(args.out, args.train, args.test, args.seed)


if __name__ == '__main__':
    main()
