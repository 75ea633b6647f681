"""Reading an LMDB's records straight from its data file, with every page checked.

LMDB itself maps the file into memory and trusts it: a file shorter than its meta page
says, or one record whose size field is damaged, makes it read past the end of the file,
and the process dies of SIGBUS. Reading the pages with ``os.pread`` and checking each one
before use turns any damage into a CaffeError. The layout (LMDB 0.9, the format Caffe's
databases have; little-endian, 64-bit):

  page      16-byte header: page number (8), pad (2), flags (2), lower/upper free bounds
            (2 + 2) or, on an overflow page, its page count (4)
  meta      pages 0 and 1; after the header: magic, version, address, map size, then two
            48-byte database records (free pages, main) and the last page used and the
            transaction id. The meta with the larger transaction id is the current one.
  branch    nodes (child page number, key), reached through 16-bit offsets after the header
  leaf      nodes (data size, flags, key size, key, data or the number of the overflow
            page that holds a large value)

Only the main database is read (Caffe's have no named databases nor duplicate keys).
"""
import os
import struct

from ..errors import CaffeError

_MAGIC, _VERSION = 0xBEEFC0DE, 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_NO_PAGE = 2 ** 64 - 1
_MAX_DEPTH = 32                      # LMDB's cursor stack
_HEADER = struct.Struct('<QHHHH')    # page number, pad, flags, lower, upper
_NODE = struct.Struct('<HHHH')       # lo, hi, flags, key size
_META = struct.Struct('<16x II 16x I44x 32x Q Q Q Q')
#   page header | magic version (address, map size) | psize (rest of the free db) |
#   (main db: pad, flags, depth, branch, leaf, overflow pages) entries root | last page txnid


class LMDBFile:
    """The records of an LMDB data file (``data.mdb``), in key order. The file stays open
    while the object lives."""

    def __init__(self, path):
        self.path = path
        self.file = open(path, 'rb')
        try:
            self.size = os.fstat(self.file.fileno()).st_size
            self.page_size, self.entries, self.root, self.last_page = self._current_meta()
        except BaseException:
            self.file.close()
            raise

    def _read(self, offset, length):
        data = os.pread(self.file.fileno(), length, offset)
        if len(data) != length:      # the file may have shrunk since it was opened
            raise self._damaged('it ends at byte %d, inside a page'
                                % os.fstat(self.file.fileno()).st_size)
        return data

    def _damaged(self, reason):
        return CaffeError('LMDB data file %s is damaged: %s' % (self.path, reason))

    def _current_meta(self):
        """(page size, entries, root page, last page) of the current meta page, once both
        meta pages are checked and the file is seen to hold every page they count."""
        first = self._read_meta(0, None)
        page_size = first[2]
        if page_size < 256 or page_size > 65536 or page_size & (page_size - 1):
            raise CaffeError('%s is not an LMDB data file, or its first page is damaged (page '
                             'size %d)' % (self.path, page_size))
        second = self._read_meta(1, page_size)
        for number, (magic, version, psize, entries, root, last_page, _) in enumerate(
                (first, second)):
            where = '%s: meta page %d' % (self.path, number)
            if magic != _MAGIC:
                raise CaffeError('%s is damaged, or this is not an LMDB data file' % where)
            if version != _VERSION or psize != page_size:
                raise CaffeError('%s has format version %d and page size %d; expected version '
                                 '%d (LMDB 0.9) and page size %d'
                                 % (where, version, psize, _VERSION, page_size))
            if last_page < 1 or (last_page + 1) * page_size > self.size:
                raise CaffeError('%s is truncated or damaged: %d bytes, but meta page %d counts '
                                 '%d pages of %d bytes' % (self.path, self.size, number,
                                                           last_page + 1, page_size))
            if root != _NO_PAGE and not 2 <= root <= last_page:
                raise CaffeError('%s names root page %d, outside pages 2..%d'
                                 % (where, root, last_page))
        current = max(first, second, key=lambda meta: meta[6])
        return page_size, current[3], current[4], current[5]

    def _read_meta(self, number, page_size):
        if self.size < _META.size or (page_size and self.size < page_size + _META.size):
            raise CaffeError('%s is not an LMDB data file: it holds only %d bytes'
                             % (self.path, self.size))
        offset = number * page_size if page_size else 0
        pgno, _, flags, _, _ = _HEADER.unpack(self._read(offset, _HEADER.size))
        if not flags & _P_META or pgno != number:
            raise CaffeError('%s: page %d is not a meta page: the file is damaged, or it is not '
                             'an LMDB data file' % (self.path, number))
        return _META.unpack(self._read(offset, _META.size))

    # ---- pages ----------------------------------------------------------------------------
    def _page(self, number, kind):
        """The bytes of tree page ``number``, checked to be a page of that number, of kind
        branch or leaf, with its node offsets inside it; and its node offsets."""
        if not 2 <= number <= self.last_page:
            raise self._damaged('a %s points to page %d, outside pages 2..%d'
                                % (kind, number, self.last_page))
        page = self._read(number * self.page_size, self.page_size)
        pgno, _, flags, lower, upper = _HEADER.unpack_from(page)
        if pgno != number:
            raise self._damaged('page %d says it is page %d' % (number, pgno))
        if flags & (_P_LEAF2 | _P_META | _P_OVERFLOW) or not flags & (_P_BRANCH | _P_LEAF):
            raise self._damaged('page %d has flags 0x%x, not a branch or leaf page'
                                % (number, flags))
        if not _HEADER.size <= lower <= upper <= self.page_size or (lower - _HEADER.size) % 2:
            raise self._damaged('page %d has free-space bounds %d..%d' % (number, lower, upper))
        offsets = struct.unpack_from('<%dH' % ((lower - _HEADER.size) // 2), page, _HEADER.size)
        if any(not upper <= offset <= self.page_size - _NODE.size for offset in offsets):
            raise self._damaged('page %d has a node outside its used space' % number)
        return page, flags, offsets

    def _overflow(self, number, size):
        """The ``size`` bytes of a large value, stored from overflow page ``number`` on."""
        if not 2 <= number <= self.last_page:
            raise self._damaged('a record points to page %d, outside pages 2..%d'
                                % (number, self.last_page))
        pgno, _, flags, lower, upper = _HEADER.unpack(
            self._read(number * self.page_size, _HEADER.size))
        pages = lower | upper << 16
        if pgno != number or not flags & _P_OVERFLOW:
            raise self._damaged('page %d is not the overflow page a record points to' % number)
        if number + pages - 1 > self.last_page or size > pages * self.page_size - _HEADER.size:
            raise self._damaged('a record of %d bytes does not fit in its %d overflow page(s) '
                                'from page %d' % (size, pages, number))
        return self._read(number * self.page_size + _HEADER.size, size)

    def records(self):
        """Every (key, value) of the main database in key order, as bytes."""
        if self.root == _NO_PAGE:
            if self.entries:
                raise self._damaged('its main database counts %d records but has no tree'
                                    % self.entries)
            return
        visited = bytearray((self.last_page >> 3) + 1)
        count = 0
        stack = [(self.root, 0)]
        while stack:
            number, depth = stack.pop()
            page, flags, offsets = self._page(number, 'branch page' if depth else 'meta page')
            if visited[number >> 3] & 1 << (number & 7) or depth >= _MAX_DEPTH:
                raise self._damaged('page %d is reached twice or too deep: the tree has a loop'
                                    % number)
            visited[number >> 3] |= 1 << (number & 7)
            if flags & _P_BRANCH:
                children = []
                for offset in offsets:
                    lo, hi, high, _ = _NODE.unpack_from(page, offset)
                    children.append((lo | hi << 16 | high << 32, depth + 1))
                stack.extend(reversed(children))
                continue
            for offset in offsets:
                key, value = self._leaf_node(page, number, offset)
                count += 1
                yield key, value
        if count != self.entries:
            raise self._damaged('its main database counts %d records, but %d were found'
                                % (self.entries, count))

    def _leaf_node(self, page, number, offset):
        lo, hi, flags, key_size = _NODE.unpack_from(page, offset)
        size, key_at = lo | hi << 16, offset + _NODE.size
        if flags & (_F_SUBDATA | _F_DUPDATA):
            raise CaffeError('LMDB data file %s holds named databases or duplicate keys, which '
                             "Caffe's databases do not" % self.path)
        data_at = key_at + key_size
        stored = 8 if flags & _F_BIGDATA else size
        if data_at + stored > self.page_size:
            raise self._damaged('a record on page %d reaches past the page' % number)
        key = page[key_at:data_at]
        if flags & _F_BIGDATA:
            return key, self._overflow(struct.unpack_from('<Q', page, data_at)[0], size)
        return key, page[data_at:data_at + size]
