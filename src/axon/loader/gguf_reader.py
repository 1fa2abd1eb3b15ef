"""`gguf.GGUFReader` with the metadata arrays parsed in bulk.

gguf-py's reader makes two numpy memmap views per array element, which is most of the time it
takes to open a file with a large BPE vocabulary: a Qwen3.5 GGUF (248k tokens, their types and
247k merges) takes it over 30 seconds on a 2-core machine. This reader takes an array of numbers
as one view and an array of strings with one plain-ndarray slice per string, and opens the same
file in about a second. `ReaderField.contents()` of a whole field returns the same values; an
array of numbers is held as one part, so `field.data` has one index and `contents(i)` is not
supported for it. Tensors are read as before.
"""

from __future__ import annotations

import struct
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType

_ARRAY_HEADER_BYTES = 12  # uint32 element type, uint64 count


class BulkGGUFReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """(size, parts, data indices, types) of the value at `orig_offs`, as gguf-py's."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + _ARRAY_HEADER_BYTES
        item_type = GGUFValueType(int(raw_itype[0]))
        types = [GGUFValueType.ARRAY, item_type]
        numbers = self.gguf_scalar_to_np.get(item_type)
        if numbers is not None:
            values = self._get(offs, numbers, int(count[0]))
            return _ARRAY_HEADER_BYTES + values.nbytes, [raw_itype, count, values], [2], types
        if item_type == GGUFValueType.STRING:
            strings, end = self._strings(offs, int(count[0]))
            parts = [raw_itype, count, *strings]
            return end - orig_offs, parts, list(range(2, len(parts))), types
        return super()._get_field_parts(orig_offs, raw_type)  # arrays of arrays: rare, small

    def _strings(self, offs: int, count: int) -> tuple[list[np.ndarray], int]:
        """`count` length-prefixed strings from `offs` as uint8 arrays, and the offset after."""
        plain = self.data.view(np.ndarray)  # slicing a memmap costs ~10x more
        buffer = memoryview(plain)
        little_endian = (self.byte_order == "I") == (sys.byteorder == "little")
        length = struct.Struct("<Q" if little_endian else ">Q")
        strings = []
        for _ in range(count):
            (size,) = length.unpack_from(buffer, offs)
            offs += 8
            strings.append(plain[offs : offs + size])
            offs += size
        return strings, offs
