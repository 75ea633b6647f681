"""The SSD fork's training augmentations of an image with boxes, in its order: photometric
distortion (distort_param), zoom out onto a canvas of the mean (expand_param), a random
crop from the batch samplers with their overlap constraints (batch_sampler), then the
transform_param's resize (WARP), crop and mirror. Boxes follow the image; a box leaves
when its centre (or enough of it, emit_constraint) falls outside a crop, or nothing of it
is left.

Images are OpenCV H x W (x C) uint8 arrays; boxes are the (n, 7) annotation rows of
annotation.py (columns 2-5 the normalized corners). Every random draw comes from the
numpy RandomState given, one per sample.
"""
import numpy as np

from .. import caffe_pb2
from .annotation import ROW_WIDTH
from .datum import cv2

CORNERS = slice(2, 6)
EMIT = caffe_pb2.EmitConstraint
UNIT_BOX = np.array([0.0, 0.0, 1.0, 1.0])


def box_size(box):
    width, height = box[2] - box[0], box[3] - box[1]
    return 0.0 if width < 0 or height < 0 else width * height


def intersection(box, other):
    if other[0] > box[2] or other[2] < box[0] or other[1] > box[3] or other[3] < box[1]:
        return np.zeros(4)
    return np.concatenate([np.maximum(box[:2], other[:2]), np.minimum(box[2:], other[2:])])


def jaccard(box, other):
    inter = intersection(box, other)
    width, height = inter[2] - inter[0], inter[3] - inter[1]
    if width <= 0 or height <= 0:
        return 0.0
    return width * height / (box_size(box) + box_size(other) - width * height)


def coverage(box, other):
    """The share of ``box`` that ``other`` covers."""
    covered = box_size(intersection(box, other))
    return covered / box_size(box) if covered > 0 else 0.0


def meets_emit_constraint(crop, box, constraint):
    """Whether ``box`` stays with a crop: its centre inside (CENTER) or more than
    emit_overlap of it covered (MIN_OVERLAP); no constraint keeps every box."""
    if constraint is None:
        return True
    if constraint.emit_type == EMIT.CENTER:
        x, y = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        return crop[0] <= x <= crop[2] and crop[1] <= y <= crop[3]
    return coverage(box, crop) > constraint.emit_overlap


def project_boxes(rows, crop, constraint=None):
    """The rows whose boxes stay in ``crop`` (normalized corners of the source image, may
    reach outside it), in the crop's normalized coordinates, clipped to [0, 1]; boxes
    that fail the emit constraint or keep no area are dropped."""
    kept = []
    crop = np.asarray(crop, np.float32).astype(np.float64)   # the fork keeps boxes in float32
    width, height = crop[2] - crop[0], crop[3] - crop[1]
    for row in rows:
        box = row[CORNERS]
        if not meets_emit_constraint(crop, box, constraint):
            continue
        if box[0] >= crop[2] or box[2] <= crop[0] or box[1] >= crop[3] or box[3] <= crop[1]:
            continue
        projected = (box - np.tile(crop[:2], 2)) / np.array([width, height, width, height])
        projected = np.clip(projected, 0, 1)
        if box_size(projected) > 0:
            out = row.copy()
            out[CORNERS] = projected
            kept.append(out)
    return np.array(kept, np.float64).reshape(-1, ROW_WIDTH)


def mirror_boxes(rows):
    out = rows.copy()
    out[:, 2], out[:, 4] = 1 - rows[:, 4], 1 - rows[:, 2]
    return out


def sample_box(sampler, rng):
    """A random box of the unit square: side scale in [min_scale, max_scale], aspect
    ratio in [min_aspect_ratio, max_aspect_ratio] (limited so that it fits)."""
    scale = rng.uniform(sampler.min_scale, sampler.max_scale)
    aspect = rng.uniform(sampler.min_aspect_ratio, sampler.max_aspect_ratio)
    aspect = min(max(aspect, scale ** 2), 1 / scale ** 2)
    width, height = scale * np.sqrt(aspect), scale / np.sqrt(aspect)
    left, top = rng.uniform(0, 1 - width), rng.uniform(0, 1 - height)
    return np.array([left, top, left + width, top + height])


def satisfies(sample, objects, constraint):
    """Whether one object box meets every bound the constraint sets (none: always)."""
    checks = []
    for field, measure in (('jaccard_overlap', lambda o: jaccard(sample, o)),
                           ('sample_coverage', lambda o: coverage(sample, o)),
                           ('object_coverage', lambda o: coverage(o, sample))):
        low, high = 'min_' + field, 'max_' + field
        if constraint.HasField(low) or constraint.HasField(high):
            checks.append((measure, getattr(constraint, low) if constraint.HasField(low)
                           else None, getattr(constraint, high) if constraint.HasField(high)
                           else None))
    if not checks:
        return True
    for box in objects:
        values = [(measure(box), low, high) for measure, low, high in checks]
        if all((low is None or v >= low) and (high is None or v <= high)
               for v, low, high in values):
            return True
    return False


def check_sampler(batch_sampler, error):
    s = batch_sampler.sampler
    if not 0 < s.min_scale <= s.max_scale <= 1:
        raise error('batch_sampler scales must satisfy 0 < min_scale <= max_scale <= 1, '
                    'got %g and %g' % (s.min_scale, s.max_scale))
    if not 0 < s.min_aspect_ratio <= s.max_aspect_ratio:
        raise error('batch_sampler aspect ratios must satisfy 0 < min <= max, got %g and %g'
                    % (s.min_aspect_ratio, s.max_aspect_ratio))


def generate_samples(rows, batch_samplers, rng):
    """Candidate crops of every sampler with use_original_image: up to max_trials draws,
    at most max_sample kept, each meeting its sampler's constraint for some object."""
    objects = [row[CORNERS] for row in rows]
    samples = []
    for batch_sampler in batch_samplers:
        if not batch_sampler.use_original_image:
            continue
        found = 0
        for _ in range(batch_sampler.max_trials):
            if batch_sampler.HasField('max_sample') and found >= batch_sampler.max_sample:
                break
            sample = sample_box(batch_sampler.sampler, rng)
            if satisfies(sample, objects, batch_sampler.sample_constraint):
                found += 1
                samples.append(sample)
    return samples


def crop_image(image, crop):
    """The pixels of ``crop`` (clipped to the image), at whole-pixel offsets and sizes."""
    height, width = image.shape[:2]
    clipped = np.clip(crop, 0, 1) * np.array([width, height, width, height])
    left, top = int(clipped[0]), int(clipped[1])
    return image[top:top + int(clipped[3] - clipped[1]), left:left + int(clipped[2] - clipped[0])]


def random_crop(image, rows, batch_samplers, rng, constraint=None):
    """The image and boxes cropped to one of the sampled boxes, picked uniformly; unchanged
    when no sampler found one. The boxes follow the exact sampled box, the pixels its
    whole-pixel part."""
    samples = generate_samples(rows, batch_samplers, rng)
    if not samples:
        return image, rows
    crop = np.clip(samples[rng.randint(len(samples))], 0, 1)
    return crop_image(image, crop), project_boxes(rows, crop, constraint)


def expand(image, rows, param, mean_values, rng, constraint=None):
    """With probability ``prob``: the image at a random whole-pixel place of a canvas
    ``ratio`` (in [1, max_expand_ratio]) times larger, filled with the mean values."""
    if rng.uniform(0, 1) > param.prob or abs(param.max_expand_ratio - 1) < 1e-2:
        return image, rows
    ratio = rng.uniform(1, param.max_expand_ratio)
    height, width = image.shape[:2]
    canvas_h, canvas_w = int(height * ratio), int(width * ratio)
    top = np.floor(rng.uniform(0, canvas_h - height))
    left = np.floor(rng.uniform(0, canvas_w - width))
    channels = image.shape[2] if image.ndim == 3 else 1
    fill = np.zeros(channels) if not len(mean_values) else np.broadcast_to(
        np.asarray(mean_values, np.float64), (channels,))
    canvas = np.empty((canvas_h, canvas_w, channels), np.uint8)
    canvas[...] = np.clip(np.round(fill), 0, 255).astype(np.uint8)   # OpenCV's saturate_cast
    canvas = canvas.reshape((canvas_h, canvas_w) + image.shape[2:])
    canvas[int(top):int(top) + height, int(left):int(left) + width] = image
    frame = np.array([-left / width, -top / height,
                      (canvas_w - left) / width, (canvas_h - top) / height])
    return canvas, project_boxes(rows, frame, constraint)


def distort(image, param, rng):
    """Random brightness, contrast, saturation and hue changes, each with its
    probability, contrast first or after hue (a coin flip), then maybe a channel shuffle."""
    cv = cv2()
    contrast_last = rng.uniform(0, 1) <= 0.5

    def brightness(img):
        if rng.uniform(0, 1) < param.brightness_prob:
            delta = rng.uniform(-param.brightness_delta, param.brightness_delta)
            if delta:
                img = np.clip(np.round(img.astype(np.float32) + delta), 0, 255).astype(np.uint8)
        return img

    def contrast(img):
        if rng.uniform(0, 1) < param.contrast_prob:
            factor = rng.uniform(param.contrast_lower, param.contrast_upper)
            if abs(factor - 1) > 1e-3:
                img = np.clip(np.round(img.astype(np.float32) * factor), 0, 255).astype(np.uint8)
        return img

    def hsv_channel(img, probability, channel, draw):
        if rng.uniform(0, 1) < probability:
            hsv = cv.cvtColor(img, cv.COLOR_BGR2HSV).astype(np.float32)
            hsv[..., channel] = draw(hsv[..., channel])
            img = cv.cvtColor(np.clip(np.round(hsv), 0, 255).astype(np.uint8), cv.COLOR_HSV2BGR)
        return img

    def saturation(img):
        return hsv_channel(img, param.saturation_prob, 1, lambda s: s * rng.uniform(
            param.saturation_lower, param.saturation_upper))

    def hue(img):
        return hsv_channel(img, param.hue_prob, 0, lambda h: h + rng.uniform(
            -param.hue_delta, param.hue_delta))

    steps = ([brightness, saturation, hue, contrast] if contrast_last
             else [brightness, contrast, saturation, hue])
    for step in steps:
        image = step(image)
    if rng.uniform(0, 1) < param.random_order_prob:
        image = image[..., rng.permutation(3)]
    return image
