"""YOLOv2's Region layer as lwplw/caffe_yolov2 computes it, the port that darknet2caffe's
YOLOv2 prototxts name (docs/fork-layers.md).

It does the part of darknet's region layer that inference needs, no decoding: each
image's (C, H * W) values are written cell by cell, (H * W, boxes, 4 + 1 + classes), as
darknet's ``flatten`` does; the objectness (entry 4 of each box) goes through the
logistic and, with ``softmax``, the classes through a softmax. x, y, w and h stay raw.
The top keeps the bottom's shape, so its axes no longer mean channels and rows.
"""
from ...layer import Layer, register


def _logistic(xp, x):
    return 1 / (1 + xp.exp(-x))


@register('Region')
class RegionLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if bottom[0] is top[0]:
            raise self.error('cannot run in place (the fork refuses it too)')
        p = self.param.region_param
        if p.coords != 4:
            # the fork's objectness and class offsets (4 and 5) hold for 4 coordinates only
            raise self.error('region_param.coords must be 4 (x, y, w, h), got %d' % p.coords)
        if p.classes < 1 or p.boxes_of_each_grid < 1:
            raise self.error('region_param needs classes and boxes_of_each_grid >= 1, got %d '
                             'and %d' % (p.classes, p.boxes_of_each_grid))
        self.classes, self.boxes, self.softmax = p.classes, p.boxes_of_each_grid, p.softmax
        self.entries = p.coords + 1 + p.classes

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4 or shape[1] != self.boxes * self.entries:
            raise self.error('bottom must be (N, %d, H, W): %d boxes of 4 + 1 + %d classes, '
                             'got %s' % (self.boxes * self.entries, self.boxes, self.classes,
                                         shape))
        top[0].reshape(shape)

    def by_box(self, array):
        """(N, C, H, W) values as (N, H * W, boxes, entries), cell by cell."""
        n, c = array.shape[:2]
        return array.reshape(n, c, -1).transpose(0, 2, 1).reshape(n, -1, self.boxes,
                                                                  self.entries)

    def forward(self, bottom, top):
        xp = self.xp
        values = self.by_box(bottom[0].data).copy()
        values[..., 4] = _logistic(xp, values[..., 4])
        if self.softmax:
            classes = values[..., 5:]
            exp = xp.exp(classes - classes.max(axis=-1, keepdims=True))
            values[..., 5:] = exp / exp.sum(axis=-1, keepdims=True)
        self.activated = values
        top[0].data[...] = values.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        # the exact gradient (the fork's backward writes nothing)
        if not propagate_down[0]:
            return
        grad = top[0].diff.reshape(self.activated.shape).copy()
        objectness = self.activated[..., 4]
        grad[..., 4] *= objectness * (1 - objectness)
        if self.softmax:
            prob = self.activated[..., 5:]
            inner = (grad[..., 5:] * prob).sum(axis=-1, keepdims=True)
            grad[..., 5:] = prob * (grad[..., 5:] - inner)
        n, c, h, w = bottom[0].shape
        bottom[0].diff[...] = grad.reshape(n, h * w, c).transpose(0, 2, 1).reshape(n, c, h, w)
