"""An image file's size from its header, so that a huge image is refused before OpenCV
decodes it: a 600 KB PNG can hold 25000 x 25000 pixels, 1.9 GB once decoded.

The header readers cover PNG, JPEG, BMP, GIF, WebP, PNM and TIFF. For the other formats
OpenCV checks the same bound itself: it reads OPENCV_IO_MAX_IMAGE_PIXELS when it is
imported, and ``datum.cv2()`` sets that variable (where the user has not) before it
imports OpenCV.
"""
import io
import os
import struct

from ..errors import CaffeError

#: the default bound: 2^27 pixels (11585 x 11585), 400 MB once decoded in colour
DEFAULT_MAX_PIXELS = 1 << 27
MAX_PIXELS_VARIABLE = 'OPENCV_IO_MAX_IMAGE_PIXELS'
#: bytes read from the start of a file; JPEG's markers are followed past it
_HEAD = 64

_JPEG_FRAME_MARKERS = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = set(range(0xD0, 0xD8)) | {0x01, 0xD8}


def max_image_pixels():
    """The most pixels an image may have: OPENCV_IO_MAX_IMAGE_PIXELS, else the default."""
    text = os.environ.get(MAX_PIXELS_VARIABLE, '')
    try:
        return int(text) if text else DEFAULT_MAX_PIXELS
    except ValueError:
        raise CaffeError('%s=%s is not a number of pixels' % (MAX_PIXELS_VARIABLE, text)) from None


def check_image_size(source, what):
    """Refuse the image in ``source`` (a path, or the bytes of an image file) if its
    header gives it more than ``max_image_pixels()`` pixels; ``what`` names it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        size = image_size(io.BytesIO(source))
    else:
        with open(source, 'rb') as f:
            size = image_size(f)
    limit = max_image_pixels()
    if size is not None and size[0] * size[1] > limit:
        raise CaffeError('%s is %d x %d pixels, more than %d (%s raises the bound)'
                         % (what, size[0], size[1], limit, MAX_PIXELS_VARIABLE))


def image_size(f):
    """(width, height) from the header of the image file open in ``f``, or None where
    the format is not one of those read here or the header is damaged."""
    head = f.read(_HEAD)
    try:
        for reader in (_png, _gif, _bmp, _webp, _pnm):
            size = reader(head)
            if size is not None:
                return size
        if head[:4] in _TIFF_ORDER:
            return _tiff(f, _TIFF_ORDER[head[:4]], head)
        if head.startswith(b'\xff\xd8'):
            return _jpeg(f)
    except (struct.error, ValueError):           # a header cut short or damaged
        return None
    return None


def _png(head):
    if head.startswith(b'\x89PNG\r\n\x1a\n') and head[12:16] == b'IHDR':
        return struct.unpack('>II', head[16:24])
    return None


def _gif(head):
    if head[:6] in (b'GIF87a', b'GIF89a'):
        return struct.unpack('<HH', head[6:10])
    return None


def _bmp(head):
    if not head.startswith(b'BM'):
        return None
    if struct.unpack('<I', head[14:18])[0] == 12:                  # OS/2's header
        return struct.unpack('<HH', head[18:22])
    width, height = struct.unpack('<ii', head[18:26])
    return abs(width), abs(height)                                  # < 0: stored top-down


def _webp(head):
    if head[:4] != b'RIFF' or head[8:12] != b'WEBP':
        return None
    chunk = head[12:16]
    if chunk == b'VP8 ':
        width, height = struct.unpack('<HH', head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b'VP8L':
        bits = struct.unpack('<I', head[21:25])[0]
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b'VP8X':
        return (int.from_bytes(head[24:27], 'little') + 1,
                int.from_bytes(head[27:30], 'little') + 1)
    return None


def _pnm(head):
    if len(head) < 2 or head[0:1] != b'P' or head[1:2] not in b'123456':
        return None
    words = []
    for line in head[2:].split(b'\n'):
        words += line.split(b'#')[0].split()
        if len(words) >= 2:
            return int(words[0]), int(words[1])
    return None


_TIFF_ORDER = {b'II*\x00': '<', b'MM\x00*': '>'}
_TIFF_WIDTH, _TIFF_HEIGHT, _TIFF_SHORT = 256, 257, 3


def _tiff(f, order, head):
    """Width and height from the first directory, which may lie anywhere in the file."""
    f.seek(struct.unpack(order + 'I', head[4:8])[0])
    count = struct.unpack(order + 'H', f.read(2))[0]
    found = {}
    for _ in range(count):
        tag, kind, _, value = struct.unpack(order + 'HHI4s', f.read(12))
        if tag in (_TIFF_WIDTH, _TIFF_HEIGHT):
            found[tag] = struct.unpack(order + ('H2x' if kind == _TIFF_SHORT else 'I'), value)[0]
            if len(found) == 2:
                return found[_TIFF_WIDTH], found[_TIFF_HEIGHT]
    return None


def _jpeg(f):
    """Width and height from the first frame header (SOFn), following the segments."""
    f.seek(2)
    while True:
        byte = f.read(1)
        if not byte:
            return None
        if byte != b'\xff':
            continue
        marker = f.read(1)
        while marker == b'\xff':                 # fill bytes
            marker = f.read(1)
        if not marker:
            return None
        code = marker[0]
        if code in _JPEG_STANDALONE:
            continue
        if code in (0xD9, 0xDA):                 # the end, or the scan data: no frame header
            return None
        length = struct.unpack('>H', f.read(2))[0]
        if code in _JPEG_FRAME_MARKERS:
            height, width = struct.unpack('>xHH', f.read(5))
            return (width, height) if height else None
        f.seek(length - 2, io.SEEK_CUR)
